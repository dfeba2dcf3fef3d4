"""Disaggregated rounds in one process (rollout.sampler_devices,
grpo_jax.rollout.native.disaggregated): partial rollouts decode on a sampler mesh of their own a
round ahead of the trainer; every prompt trains once, each token one version behind the
weights that train it, and a stopped run resumes to the uninterrupted run's result. The sampler
in a process of its own (rollout.sampler_process), also one per trainer process of a
multi-process run (rollout/native/sampler_hosts.py), trains the same."""


import os
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tiny_run import (ODD_POSTS, advances, assert_resumed_like_whole, config, history,
                      stopped_at)

from grpo_jax.checkpoint import committed_steps
from grpo_jax.errors import SamplerProcessError
from grpo_jax.train import train

# 2 sampler devices (data parallel) and 2 trainer devices (FSDP): 16 rows, 4 groups a round;
# max_staleness 1: the sampler's round-ahead version is all the staleness allowed.
SPLIT = dict(sampler_devices=2, max_staleness=1, max_num_seqs=8, max_completion_length=12,
             per_device_train_batch_size=8, dp=1, fsdp=-1)
# Evaluation at steps 2 and 4 on 8 held-out prompts x 2 (one eval batch), on the sampler's
# devices once its advance has ended.
EVAL = dict(dataset_train_split="train[:48]", dataset_test_split="train[48:56]",
            eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8,
            num_generations_eval=2)


def untimed(record: dict) -> dict:
    """An evaluation's record without its wall-clock figures."""
    return {k: v for k, v in record.items()
            if not k.startswith(("timing/", "step_time", "timeline/"))
            and not k.endswith(("_runtime", "_per_second"))}


@pytest.mark.slow
def test_split_run_trains_each_prompt_once_one_version_behind_and_resumes(tiny_dir, tmp_path,
                                                                          monkeypatch):
    """4 rounds: the first batch is sampled before round 1 with its own weights (staleness 0),
    every later one a round ahead (every token exactly one version old); each prompt trained
    once, in draw order; resumed from its step-2 checkpoint (which holds the batch sampled
    ahead): the same prompts in the same order, the same metrics and bit-exact weights.
    Evaluation at steps 2 and 4 (on the sampler's devices) changes none of that."""
    got, drawn = advances(monkeypatch)
    devices = jax.devices()[:4]
    train(config(tiny_dir, tmp_path / "full", max_steps=4, save_steps=2, **SPLIT, **EVAL),
          devices=devices)
    full, full_drawn = list(got), list(drawn)
    # the first batch, then one advance per round: the last is sampled ahead, never trained
    assert len(full) == 5
    trained = [p for group in full[:4] for p in group]
    assert len(trained) == 16 and len(set(trained)) == 16 and set(trained) <= set(drawn)
    # As many group slots as a round's groups (no row may carry over at max_staleness 1): each
    # advance draws 4 prompts and none decodes only to start over in the next.
    assert len(drawn) == 5 * 4
    a = [h for h in history(tmp_path / "full") if "loss" in h]
    assert [h["step"] for h in a] == [1, 2, 3, 4]
    evals = [h for h in history(tmp_path / "full") if "eval_reward" in h]
    assert [h["step"] for h in evals] == [2, 4]
    assert all(np.isfinite(h["eval_reward"]) and h["eval_completions/mean_length"] > 0
               for h in evals)
    assert a[0]["staleness/max"] == 0
    for h in a[1:]:
        assert (h["staleness/mean"], h["staleness/max"], h["staleness/tokens_1"]) == (1, 1, 1)
        assert h["staleness/dropped_groups"] == 0
        assert h["timing/idle_trainer"] >= 0 and h["timing/idle_sampler"] >= 0

    got[:], drawn[:] = [], []
    stopped_at(tmp_path / "full", tmp_path / "cut", 2)
    assert len((tmp_path / "cut" / "queued" / "2.npz").read_bytes()) > 0
    train(config(tiny_dir, tmp_path / "cut", max_steps=4, save_steps=2, resume=True, **SPLIT,
                 **EVAL), devices=devices)
    # Round 3's batch comes from the checkpoint; the sampler draws on from round 4's.
    assert got == full[3:] and drawn == full_drawn[12:]
    b = [h for h in history(tmp_path / "cut") if "loss" in h]
    assert [h["step"] for h in b] == [1, 2, 3, 4]
    again = [h for h in history(tmp_path / "cut") if "eval_reward" in h]
    assert [untimed(h) for h in again] == [untimed(h) for h in evals]
    assert_resumed_like_whole(tmp_path, a, b)


def post(prompt: str) -> int:
    return int(prompt.split()[2].rstrip(":"))


@pytest.mark.slow
def test_split_dynamic_sampling_fills_from_the_samplers_next_advances_and_resumes(
        tiny_dir, tmp_path, monkeypatch):
    """dynamic_sampling with sampler_devices: posts with an even number score alike (no
    signal), so a round's queued batch (4 groups sampled a round ahead) is short and the round
    takes the sampler's next advances until 4 groups with signal are whole, then starts the
    next round's beside the update. Replayed from the advances' groups, each round takes the
    queued advance and as many more as it needs (its num_gen_batches), every prompt drawn is
    generated once, each group kept trains once; resumed from its step-2 checkpoint: the same
    advances, metrics and weights."""
    got, drawn = advances(monkeypatch)
    devices = jax.devices()[:4]
    settings = {**SPLIT, **ODD_POSTS, "save_steps": 2}
    train(config(tiny_dir, tmp_path / "full", **settings), devices=devices)
    full, full_drawn = list(got), list(drawn)
    a = [h for h in history(tmp_path / "full") if "loss" in h]
    assert [h["step"] for h in a] == [1, 2, 3]
    assert max(h["dynamic_sampling/num_gen_batches"] for h in a) >= 2
    assert len(set(drawn)) == len(drawn)  # each prompt drawn once ...
    returned = [p for group in full for p in group]
    assert len(set(returned)) == len(returned) and set(returned) <= set(drawn)  # ... made once
    assert any(post(p) % 2 == 0 for p in returned)  # returned, filtered out
    # The rounds replayed: each takes the next advance (queued a round ahead), then more until
    # 4 odd posts are kept (the first 4, in order); the advance after them is the next round's.
    left, trained = list(full), []
    for h in a:
        kept, n = [], 0
        while len(kept) < 4:
            kept += [p for p in left.pop(0) if post(p) % 2]
            n += 1
        assert h["dynamic_sampling/num_gen_batches"] == n, h["step"]
        if h["step"] > 1:  # the queued groups a version old, those waited for the round's own
            assert (h["staleness/tokens_0"] > 0) == (n > 1), h["step"]
        trained += kept[:4]
    assert len(left) == 1  # the last round's advance ahead, never trained
    assert len(set(trained)) == len(trained) == 12
    assert a[0]["staleness/max"] == 0

    got[:], drawn[:] = [], []
    stopped_at(tmp_path / "full", tmp_path / "cut", 2)
    train(config(tiny_dir, tmp_path / "cut", resume=True, **settings), devices=devices)
    # The resumed run's advances are the full run's last ones (its first from the checkpoint)
    assert got and got == full[len(full) - len(got):] and len(got) < len(full)
    assert drawn and drawn == full_drawn[-len(drawn):]
    b = [h for h in history(tmp_path / "cut") if "loss" in h]
    assert [h["step"] for h in b] == [1, 2, 3]
    assert_resumed_like_whole(tmp_path, a, b)


def sampler_processes(parent: int | None = None) -> list[int]:
    """The pids of the sampler processes (rollout.sampler_process) of `parent` (default: this
    process)."""
    parent = os.getpid() if parent is None else parent
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"sampler_process" in cmd:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_sampler_process_equals_the_one_process_split_resumes_and_dies_with_one_line(
        tiny_dir, tmp_path):
    """rollout.sampler_process: the same split, the sampler in a process of its own (2 host
    devices there): stopped at step 2 and resumed, it logs what the one-process split logs and
    ends with its weights, bit for bit; its process ends with the run. Then a sampler process
    killed (SIGKILL) after the run's first checkpoint: the run stops within seconds with one
    SamplerProcessError naming the kill, its checkpoints whole, and --resume finishes it."""
    devices = jax.devices()[:4]
    train(config(tiny_dir, tmp_path / "full", max_steps=3, **SPLIT), devices=devices)
    own = dict(SPLIT, sampler_process=True)
    train(config(tiny_dir, tmp_path / "cut", max_steps=2, **own), devices=devices)
    assert not sampler_processes()
    train(config(tiny_dir, tmp_path / "cut", max_steps=3, resume=True, **own), devices=devices)
    a = [h for h in history(tmp_path / "full") if "loss" in h]
    b = [h for h in history(tmp_path / "cut") if "loss" in h]
    assert [h["step"] for h in b] == [1, 2, 3]
    assert_resumed_like_whole(tmp_path, a, b)
    assert b[-1]["timing/idle_trainer"] >= 0 and b[-1]["timing/idle_sampler"] >= 0

    out, killed = tmp_path / "killed", []

    def kill_after_first_checkpoint():
        while not killed:
            if (out / "checkpoints" / "1").exists():
                for pid in sampler_processes():
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)
    watcher = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    with pytest.raises(SamplerProcessError, match=r"sampler process .* killed by SIGKILL.*"
                                                   r"--resume"):
        train(config(tiny_dir, out, max_steps=6, save_steps=1, **own), devices=devices)
    assert killed and time.perf_counter() - t0 < 120
    steps = committed_steps(out / "checkpoints")
    assert steps and max(steps) < 6
    train(config(tiny_dir, out, max_steps=6, save_steps=1, resume=True, **own), devices=devices)
    assert max(committed_steps(out / "checkpoints")) == 6
    c = [h for h in history(out) if "loss" in h]
    assert sorted({h["step"] for h in c}) == list(range(1, 7))


# A multi-process split run (rollout/native/sampler_hosts.py): each of 2 trainer processes with
# 2 host devices, 1 for its sampler process, 1 for the trainer's mesh (data parallel over the
# processes). 16 rows a round, 4 groups: 2 decoded by each host's sampler.
POD = dict(sampler_devices=1, sampler_process=True, max_staleness=1, max_num_seqs=8,
           max_completion_length=12, per_device_train_batch_size=8, dp=2, fsdp=1,
           log_completions="true", learning_rate=0.002)
POD_KEYS = ("reward", "reward_std", "loss", "grad_norm", "entropy", "completions/mean_length",
            "num_tokens", "staleness/mean", "staleness/max")


def launch_pod(tiny_dir, out, *flags, **settings):
    from processes import launch
    path = out.parent / f"{out.name}.{len(list(out.parent.glob(out.name + '.*.yaml')))}.yaml"
    path.write_text(config(tiny_dir, out, **{**POD, **settings}).to_yaml())
    from tiny_run import TRAIN
    return launch([*TRAIN, "--config", str(path), *flags], devices=2, log_dir=out.parent)


def run_pod(tiny_dir, out, *flags, **settings) -> None:
    from processes import log, wait_all
    out.parent.mkdir(parents=True, exist_ok=True)
    codes = wait_all(launch_pod(tiny_dir, out, *flags, **settings), timeout=600)
    assert codes == [0, 0], log(out.parent, "p0.err")[-3000:] + log(out.parent, "p1.err")[-3000:]


def trained(out) -> dict[int, list]:
    """Each step's (prompt, completion) pairs, from completions.jsonl."""
    import json
    rows = [json.loads(line) for line in (out / "completions.jsonl").open()]
    steps: dict[int, list] = {}
    for r in rows:
        steps.setdefault(r["step"], []).append((r["prompt"], r["completion"]))
    return steps


@pytest.mark.slow
def test_split_across_two_trainer_processes_resumes_and_trains_each_prompt_once(tiny_dir,
                                                                                tmp_path):
    """Two trainer processes (jax.distributed on 127.0.0.1), each with a sampler process of
    its own decoding half of every batch, resumed by the two processes from its step-2
    checkpoint (which holds each host's rows in flight; max_staleness 2, so rows carry over): the
    uninterrupted run's prompts, log and weights, bit for bit, each prompt trained once. (That
    such a run trains what the one-process split trains: the dynamic-sampling test below,
    whose rounds take the same path plus more advances.)"""
    # Each host's sampler keeps 4 group slots and returns 2 a round, so step 2's checkpoint
    # holds rows in flight on both hosts.
    run_pod(tiny_dir, tmp_path / "full", max_steps=3, max_staleness=2, save_steps=2)
    stopped_at(tmp_path / "full", tmp_path / "cut", 2)
    with np.load(tmp_path / "cut" / "rows_in_flight" / "2.npz") as f:
        assert (f["p0/seq"] >= 0).any() and (f["p1/seq"] >= 0).any()
        assert set(f["p0/seq"][f["p0/seq"] >= 0] % 2) == {0}  # host p: draws 2k + p
        assert set(f["p1/seq"][f["p1/seq"] >= 0] % 2) == {1}
    run_pod(tiny_dir, tmp_path / "cut", "--resume", max_steps=3, max_staleness=2, save_steps=2)
    b = [h for h in history(tmp_path / "full") if "loss" in h]
    c = [h for h in history(tmp_path / "cut") if "loss" in h]
    assert [h["step"] for h in c] == [1, 2, 3]
    assert_resumed_like_whole(tmp_path, b, c)
    assert trained(tmp_path / "full") == trained(tmp_path / "cut")
    prompts = [p for rows in trained(tmp_path / "cut").values() for p, _ in rows[::4]]
    assert len(prompts) == len(set(prompts)) == 12


@pytest.mark.slow
def test_split_across_processes_a_dead_host_sampler_stops_every_process(tiny_dir, tmp_path):
    """Process 1's sampler process killed after the first checkpoint: both trainer processes
    stop at the round's collect with one error line naming the kill (process 0 naming process
    1), exit 2, and the checkpoints written stand."""
    from processes import log, wait_all
    out = tmp_path / "run"
    procs = launch_pod(tiny_dir, out, max_steps=6, save_steps=1)
    killed, deadline = [], time.time() + 300
    while not killed and time.time() < deadline and all(p.poll() is None for p in procs):
        if (out / "checkpoints" / "1").exists():
            for pid in sampler_processes(procs[1].pid):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.05)
    codes = wait_all(procs, timeout=180)
    errs = [log(tmp_path, f"p{i}.err") for i in range(2)]
    assert killed and codes == [2, 2], (codes, errs[0][-3000:] + errs[1][-3000:])
    lines = [[line for line in err.splitlines() if line.startswith("grpo_jax.train: error:")]
             for err in errs]
    assert len(lines[1]) == 1 and "killed by SIGKILL" in lines[1][0], errs[1][-3000:]
    assert len(lines[0]) == 1 and "on process 1:" in lines[0][0], errs[0][-3000:]
    steps = committed_steps(out / "checkpoints")
    assert steps and max(steps) < 6


@pytest.mark.slow
def test_split_across_processes_with_dynamic_sampling_trains_as_one(tiny_dir, tmp_path):
    """Two trainer processes, each with a sampler process of its own decoding half of every
    batch, train the same prompts, completions, metrics (within test_multihost's tolerance)
    and weights as the one-process split run with the same global batch and mesh, here with
    dynamic_sampling: a round short of groups with signal runs every host's sampler's next
    advance (the same on every process, the batch gathered being the same)."""
    from processes import assert_same_metrics, assert_same_params, params
    settings = {**ODD_POSTS, "save_steps": 100}
    train(config(tiny_dir, tmp_path / "one" / "run", **POD, **settings),
          devices=jax.devices()[:3])
    run_pod(tiny_dir, tmp_path / "pod", **settings)
    one, pod = tmp_path / "one" / "run", tmp_path / "pod"
    a = [h for h in history(one) if "loss" in h]
    b = [h for h in history(pod) if "loss" in h]
    assert [h["step"] for h in b] == [1, 2, 3]
    assert max(h["dynamic_sampling/num_gen_batches"] for h in b) >= 2
    assert_same_metrics(a, b, POD_KEYS + ("dynamic_sampling/num_gen_batches",))
    assert_same_params(params(one, 3), params(pod, 3))
    assert trained(one) == trained(pod)


@pytest.mark.parametrize("settings, needle", [
    (dict(EVAL), "does not run eval_strategy yet"),
    (dict(per_device_train_batch_size=6), "make prompts_per_generation a multiple"),
])
def test_split_across_processes_refuses_what_it_does_not_run(tiny_dir, tmp_path, settings,
                                                             needle):
    """Settings a multi-process split run does not run: one error line on each process."""
    from processes import log, wait_all
    out = tmp_path / "run"
    codes = wait_all(launch_pod(tiny_dir, out, max_steps=2, **settings), timeout=300)
    errs = [log(tmp_path, f"p{i}.err") for i in range(2)]
    assert codes == [2, 2], (codes, errs[0][-3000:])
    for err in errs:
        lines = [line for line in err.splitlines() if line.startswith("grpo_jax.train: error:")]
        assert len(lines) == 1 and needle in lines[0], err[-3000:]
