"""Training as several processes on JAX's multi-controller runtime, on 127.0.0.1.

Two processes with 4 CPU devices each must train exactly as one process with 8 (same mesh, same
global batch, same data order and keys), their checkpoints must restore in 2 processes and in 1,
and a process that dies must end the other within the heartbeat timeout instead of hanging it.
The oracle is the one-process run of the same program (the suite's 8 devices).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import pytest
from processes import (RUN, TRAIN_KEYS, assert_same_metrics, assert_same_params, cli_config,
                       launch, log, params, wait_all)
from tiny_run import config

from grpo_jax.train import main, train

HEARTBEAT = 10  # seconds: how long a dead peer may go unnoticed
def metrics(out, kind: str = "reward") -> list[dict]:
    """The training records (kind "eval_reward": the evaluations') of a run's metrics.jsonl."""
    return [r for line in (Path(out) / "metrics.jsonl").open() if kind in (r := json.loads(line))]


EVAL_KEYS = tuple(f"eval_{k}" for k in TRAIN_KEYS if k != "grad_norm")


def logged_extra(out, upto: int) -> list:
    rows = [json.loads(line) for line in (Path(out) / "completions.jsonl").open()]
    return [r["num_ids"] for r in rows if r["step"] <= upto]


# ---------------------------------------------------------------- runs shared by the tests

@pytest.fixture(scope="module")
def one_process(tiny_dir, tmp_path_factory):  # noqa: F811
    """The oracle: one process, the suite's 8 devices, 4 steps (checkpoints at 2 and 4)."""
    assert jax.device_count() == 8
    out = tmp_path_factory.mktemp("one") / "run"
    train(config(tiny_dir, out, max_steps=4, **RUN))
    return out


@pytest.fixture(scope="module")
def two_processes(tiny_dir, tmp_path_factory):  # noqa: F811
    """Two processes with 4 devices each, 2 steps: a checkpoint at step 2 written by both."""
    root = tmp_path_factory.mktemp("two")
    out = root / "run"
    procs = launch(cli_config(tiny_dir, out, max_steps=2), log_dir=root)
    codes = wait_all(procs, timeout=300)
    assert codes == [0, 0], log(root, "p0.err")[-3000:] + log(root, "p1.err")[-3000:]
    return out


# ---------------------------------------------------------------- tests

@pytest.mark.slow
def test_two_processes_train_like_one(one_process, two_processes):
    assert_same_params(params(one_process, 2), params(two_processes, 2))
    assert_same_metrics(metrics(one_process)[:2], metrics(two_processes))
    # The evaluation at step 2, and what the reward function logged on both processes.
    assert_same_metrics(metrics(one_process, "eval_reward")[:1],
                        metrics(two_processes, "eval_reward"), EVAL_KEYS)
    assert logged_extra(one_process, 2) == logged_extra(two_processes, 2)
    assert None not in logged_extra(two_processes, 2)
    # Process 0 alone writes the run's files and prints the result.
    root = two_processes.parent
    printed = [[line for line in log(root, f"p{i}.out").splitlines() if line.startswith("{")]
               for i in range(2)]  # gloo writes its own lines to stdout too
    assert json.loads(printed[0][-1])["reward"] == pytest.approx(
        metrics(two_processes)[-1]["reward"], abs=1e-5)
    assert printed[1] == [] and "GRPO" not in log(root, "p1.err")
    saved = (two_processes / "config.yaml").read_text()
    assert "num_processes: 2" in saved and "process_id: null" in saved


@pytest.mark.slow
def test_checkpoint_of_two_processes_resumes_in_one(tiny_dir, one_process,  # noqa: F811
                                                    two_processes, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(two_processes, out)
    train(config(tiny_dir, out, max_steps=4, resume=True, **RUN))  # 1 process, 8 devices
    assert_same_params(params(one_process, 4), params(out, 4))
    assert_same_metrics(metrics(one_process), metrics(out))


@pytest.mark.slow
def test_two_processes_resume_and_a_dead_peer_ends_the_run(tiny_dir, one_process,  # noqa: F811
                                                            two_processes, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(two_processes, out)
    procs = launch(cli_config(tiny_dir, out, max_steps=10, heartbeat_timeout=HEARTBEAT)
                   + ["--resume"], log_dir=tmp_path)
    deadline = time.time() + 300
    while not (out / "checkpoints" / "4").is_dir() and time.time() < deadline and all(
            p.poll() is None for p in procs):
        time.sleep(0.05)
    alive = [p.poll() is None for p in procs]
    procs[1].send_signal(signal.SIGKILL)
    killed = time.time()
    code = wait_all(procs[:1], timeout=HEARTBEAT + 60)[0]
    waited = time.time() - killed
    err = log(tmp_path, "p0.err")
    assert alive == [True, True], err[-3000:]
    assert code != 0 and waited < HEARTBEAT + 60, (code, waited)
    # Which of the runtime's two detections ends process 0 is a race: the coordination
    # service's heartbeat ("another task died"), or, when process 0 is inside a host collective
    # as the peer dies, Gloo's broken connection to it. Both end the run, nonzero, in time.
    assert "another task died" in err or "Connection reset by peer" in err, err[-3000:]
    # Restored by 2 processes, the run went on exactly as the one-process run did.
    assert_same_params(params(one_process, 4), params(out, 4))
    assert_same_metrics(metrics(one_process), metrics(out)[:4])


def test_incomplete_settings_one_clear_error(tmp_path, capsys):
    code = main(["--config", "smol", "--output_dir", str(tmp_path),
                 "--coordinator_address", "127.0.0.1:1", "--num_processes", "2"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("grpo_jax.train: error:")]
    assert code == 2 and len(errors) == 1 and "--process_id" in errors[0], err


# ---------------------------------------------------------------- the helpers, two processes

HELPERS = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from grpo_jax import distributed as dist, mesh as mesh_lib
    from grpo_jax.config import DistributedArgs

    flags = dict(zip(sys.argv[1::2], sys.argv[2::2]))  # launch()'s flags, as train reads them
    assert dist.initialize(DistributedArgs(flags["--coordinator_address"], 2,
                                           int(flags["--process_id"]), heartbeat_timeout=5))
    me, out = jax.process_index(), {}
    devices = jax.devices()
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=2, fsdp=4, tp=1), devices)
    rows = mesh_lib.batch_sharding(mesh, 2)
    full = np.arange(48, dtype=np.float32).reshape(16, 3)
    local = dist.local_rows(rows, 16)
    x = dist.put_rows(full[local], rows, 16)
    total = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P()))(x)
    out["local"] = local.tolist()
    out["sum_ok"] = bool(np.allclose(np.asarray(total), full.sum(0)))
    out["to_host_ok"] = bool(np.array_equal(dist.to_host(x), full))
    out["shard_ok"] = bool(np.array_equal(dist.to_host(dist.shard_host_array(full, rows)), full))
    # tensor pairs spanning the processes: both hold every row, and each row has one owner
    pairs = [d for pair in zip(devices[:4], devices[4:]) for d in pair]
    mesh_t = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=4, tp=2), pairs)
    rows_t = mesh_lib.batch_sharding(mesh_t, 1)
    out["local_t"] = dist.local_rows(rows_t, 8).tolist()
    owned = dist.owned_rows(rows_t, 8)
    out["owned_t"] = owned.tolist()
    out["gather_t"] = dist.gather_rows(owned * 10.0, owned, 8).tolist()
    owned = dist.owned_rows(rows, 16)
    out["gather"] = dist.gather_rows(owned[:, None] * [1.0, -1.0], owned, 16)[:, 1].tolist()
    out["any"] = [dist.any_process(me == 1), dist.any_process(False)]
    out["from_main"] = dist.from_main(lambda: {"by": jax.process_index()})

    def boom():
        raise ValueError("boom on 0")
    def bad_on_1():
        if me == 1:
            raise KeyError("bad row on 1")
        return me
    for name, call in (("main_error", lambda: dist.from_main(boom)),
                       ("together_error", lambda: dist.together(bad_on_1))):
        try:
            call()
            out[name] = None
        except Exception as e:
            out[name] = [type(e).__name__, str(e), dist.failed_alone(e)]
    out["alone"] = dist.failed_alone(ValueError("only here"))
    print("RESULT " + json.dumps(out), flush=True)
    # An error on process 1 alone: it exits at once (no shutdown barrier), and process 0, left
    # waiting in a collective, is ended by the heartbeat.
    if me == 1:
        dist.exit_code(3, ValueError("only on 1"))
    dist.any_process(False)
    print("NOT REACHED", flush=True)
""")


@pytest.mark.slow
def test_helpers_across_two_processes(tmp_path):
    procs = launch(["-c", HELPERS], log_dir=tmp_path)
    codes = wait_all(procs, timeout=180)
    errs = [log(tmp_path, f"p{i}.err") for i in range(2)]
    assert codes[1] == 3 and codes[0] not in (0, None), (codes, errs[0][-2000:] + errs[1][-2000:])
    assert "another task died" in errs[0] and "NOT REACHED" not in log(tmp_path, "p0.out")
    res = [json.loads(next(line[7:] for line in log(tmp_path, f"p{i}.out").splitlines()
                           if line.startswith("RESULT "))) for i in range(2)]
    assert res[0]["local"] == list(range(8)) and res[1]["local"] == list(range(8, 16))
    assert res[0]["local_t"] == res[1]["local_t"] == list(range(8))
    assert res[0]["owned_t"] == list(range(8)) and res[1]["owned_t"] == []
    for i, r in enumerate(res):
        assert r["sum_ok"] and r["to_host_ok"] and r["shard_ok"], (i, r)
        assert r["gather_t"] == [10.0 * k for k in range(8)]
        assert r["gather"] == [-float(k) for k in range(16)]
        assert r["any"] == [True, False]
        assert r["from_main"] == {"by": 0}
        assert r["alone"] is True
    assert res[0]["main_error"] == ["ValueError", "boom on 0", False]
    assert res[1]["main_error"] == ["DistributedError", "on process 0: ValueError: boom on 0",
                                    False]
    assert res[1]["together_error"] == ["KeyError", "'bad row on 1'", False]
    assert res[0]["together_error"] == ["DistributedError",
                                        "on process 1: KeyError: 'bad row on 1'", False]


@pytest.mark.parametrize("user", ["", "--xla_cpu_enable_concurrency_optimized_scheduler=true"])
def test_default_xla_flags_are_known_and_the_users_win(user):
    """The entry points' CPU flags (distributed.default_xla_flags): XLA aborts a process on a
    flag its release does not know, so a fresh process must start with them and compile; a
    flag the user set is left as it is."""
    code = ("import os; from grpo_jax import distributed as d; d.default_xla_flags(); "
            "import jax; print(os.environ['XLA_FLAGS']); print(jax.jit(lambda x: x + 1)(1))")
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {user}".strip())
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    flags, value = out.stdout.split("\n")[:2]
    assert value == "2" and "--xla_force_host_platform_device_count=2" in flags
    want = user or "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    assert want in flags and flags.count("concurrency_optimized_scheduler") == 1, flags
