"""Faults a long run meets, injected for real on the tiny model: a checkpoint directory that
turns unwritable (chattr +i: EPERM), a file system that turns read-only (EROFS) or fills up
(ENOSPC on a small tmpfs), a stop signal mid-round, a corrupt newest checkpoint.

Each fault ends the run within a bound with one line and the exit code the docs promise
(docs/reliability.md), and leaves the last good checkpoint restorable. Every injected fault is
undone in a `finally` (chattr -i, umount), also when the test fails. chattr and mount need root:
without it those tests skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from fault_injection import (STALL, export, finish, immutable, one_error_line,
                             restorable, root_or_skip, start_cli, tmpfs, wait_for)
from tiny_run import HERE, config, user_env

# ------------------------------------------------------------------ checkpoint writes

@pytest.mark.slow
def test_unwritable_checkpoint_directory_before_the_first_save(tiny_dir, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    with immutable(out / "checkpoints"):
        rc, err, took = finish(start_cli(tiny_dir, out, max_steps=4, save_steps=1), 240)
    line = one_error_line(err)
    assert rc == 2 and took < 120, (took, err[-3000:])  # before loading the model, even
    assert "checkpoints" in line and "Operation not permitted" in line, line
    assert "no checkpoint" in line, line  # nothing good to fall back on, and it says so
    assert not list((out / "checkpoints").iterdir())


def test_a_failed_background_write_is_one_error_and_leaves_no_writer_waiting(tmp_path):
    """In-process: Orbax's writer threads of the failed save would wait out its 300 s
    coordination timeout (and hold the interpreter's exit); they end at once."""
    import threading

    import jax.numpy as jnp

    from grpo_jax.checkpoint import Checkpointer, CheckpointWriteError
    directory = tmp_path / "c"
    ckpt = Checkpointer(directory, save_total_limit=None)
    ckpt.save(1, {"x": jnp.ones(3)}, {})
    ckpt.wait()
    with immutable(directory):
        ckpt.save(2, {"x": jnp.ones(3)}, {})  # started in the background
        with pytest.raises(CheckpointWriteError, match=(
                rf"can't write a checkpoint to {directory}: Operation not permitted \(.*2\."
                rf"orbax-checkpoint-tmp.*\); last good checkpoint: {directory / '1'}\.")):
            ckpt.wait()
        with pytest.raises(CheckpointWriteError):  # every later call says the same
            ckpt.poll()
        ckpt.close()  # reported already: no second raise
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            type(t).__name__ == "_SignalingThread" for t in threading.enumerate()):
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if type(t).__name__ == "_SignalingThread"]
    assert ckpt.all_steps() == [1]


def remount_read_only(path: Path) -> None:
    """The kernel refuses ("mount point is busy") while a file there is open for writing, as
    during a checkpoint write: retried between writes (a save every step leaves gaps)."""
    deadline = time.monotonic() + 30
    while subprocess.run(["mount", "-o", "remount,ro", str(path)],
                         capture_output=True).returncode:
        assert time.monotonic() < deadline, f"{path} stayed busy for 30 s"
        time.sleep(0.02)


@pytest.mark.parametrize("fault", ["immutable", "read-only", "full"])
@pytest.mark.slow
def test_checkpoint_writes_failing_mid_run_stop_at_once(tiny_dir, tmp_path, fault):  # noqa: F811
    """The directory becomes unwritable (or the disk full) after some checkpoints: the run
    stops within a bound with one line naming the error, the directory and the last good
    checkpoint, which restores."""
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    ckpts.mkdir(parents=True)
    # 4 MiB: three checkpoints of the tiny model (0.86 MiB each) fit, the fifth can't.
    mounted = tmpfs(ckpts, "4m") if fault != "immutable" else contextlib.nullcontext()
    with mounted:
        proc = start_cli(tiny_dir, out, max_steps=400, save_steps=1, save_total_limit=None)
        try:
            wait_for(ckpts / "2", proc)
            if fault == "immutable":
                with immutable(ckpts):
                    injected = time.monotonic()
                    rc, err, took = finish(proc, 120)
            else:
                if fault == "read-only":
                    remount_read_only(ckpts)
                injected = time.monotonic()
                rc, err, took = finish(proc, 120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        line = one_error_line(err)
        after = time.monotonic() - injected
        print(f"{fault}: exit {rc} {after:.1f} s after the fault: {line}")
        assert rc == 2 and after < 60, (after, err[-3000:])  # Orbax alone: hangs for 300 s+
        expected = {"immutable": "Operation not permitted", "read-only": "Read-only file system",
                    "full": "No space left on device"}[fault]
        assert expected in line and str(ckpts) in line, line
        good = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
        assert good and f"last good checkpoint: {ckpts / str(good[-1])}" in line, (good, line)
        restorable(config(tiny_dir, out), ckpts, good[-1])


# ------------------------------------------------------------------ stop signals



@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.slow
def test_signal_mid_round_stops_at_once_with_128_plus_signal(
        tiny_dir, tmp_path, monkeypatch, sig):  # noqa: F811
    """The signal lands while round 3 is being scored (a reward that stalls for 10 minutes): the
    run does not wait for the round. It checkpoints the last completed update (step 2), exits
    128 + the signal, and resuming it gives the params of a run that never stopped."""
    from grpo_jax.checkpoint import Checkpointer, load_checkpoint
    from grpo_jax.hf import params_numpy
    from grpo_jax.train import train
    out, marker = tmp_path / "run", tmp_path / "stalled"
    monkeypatch.setenv("GRPO_JAX_TEST_STALL", str(marker))
    proc = start_cli(tiny_dir, out, max_steps=4, save_steps=100, reward_funcs=f"[{STALL}]")
    try:
        wait_for(marker, proc)
        proc.send_signal(sig)
        rc, err, took = finish(proc, 120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"{sig.name}: exit {rc} {took:.1f} s after the signal")
    assert rc == 128 + sig, err[-3000:]
    assert took < 30, took  # the stalled round is abandoned, not awaited
    assert "Traceback" not in err
    assert f"stopped by {sig.name}: the last completed update, step 2" in err, err[-2000:]
    assert Checkpointer(out / "checkpoints", save_total_limit=None).all_steps() == [2]
    if sig != signal.SIGTERM:
        return
    monkeypatch.delenv("GRPO_JAX_TEST_STALL")
    one = jax.devices()[:1]
    train(config(tiny_dir, out, max_steps=4, save_steps=100, reward_funcs=f"[{STALL}]",
                 resume=True), devices=one)
    train(config(tiny_dir, tmp_path / "full", max_steps=4, save_steps=100,
                 reward_funcs=f"[{STALL}]"), devices=one)
    a, _, step_a = load_checkpoint(tmp_path / "full")
    b, _, step_b = load_checkpoint(out)
    assert step_a == step_b == 4
    diff = max(np.abs(x - params_numpy(b)[k]).max() for k, x in params_numpy(a).items())
    print("max |uninterrupted - stopped and resumed| params:", diff)
    assert diff < 1e-6


# ------------------------------------------------------------------ resume

def _corrupt(step_dir: Path, how: str) -> None:
    state = step_dir / "state"
    if how == "truncated data file":
        # Every data file: which one holds the params (all export reads) varies between runs.
        for data in [p for p in state.rglob("*") if p.is_file() and p.parent.name == "d"]:
            with open(data, "r+b") as f:
                f.truncate(data.stat().st_size // 2)
    elif how == "missing _METADATA":
        (state / "_METADATA").unlink()
    elif how == "garbage metadata":
        (state / "_METADATA").write_text("{not json")
    elif how == "missing state/":
        shutil.rmtree(state)


CORRUPTIONS = ["truncated data file", "missing _METADATA", "garbage metadata", "missing state/"]


@pytest.mark.slow
def test_resume_sets_corrupt_checkpoints_aside_and_takes_the_newest_good_one(
        tiny_dir, tmp_path, capsys):  # noqa: F811
    """Checkpoints 2 to 5 are damaged four ways: each is named in one line, renamed (kept)
    and skipped; the run resumes from 1 and saves new checkpoints 2 to 6 beside them."""
    from grpo_jax.checkpoint import Checkpointer
    from grpo_jax.train import train
    out, one = tmp_path / "run", jax.devices()[:1]
    train(config(tiny_dir, out, max_steps=5, save_steps=1), devices=one)
    for step, how in zip(range(5, 1, -1), CORRUPTIONS):
        _corrupt(out / "checkpoints" / str(step), how)
    capsys.readouterr()
    train(config(tiny_dir, out, max_steps=6, save_steps=1, resume=True), devices=one)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "can't be restored" in line]
    assert len(lines) == 4 and "Traceback" not in err, err[-3000:]
    for step, line in zip(range(5, 1, -1), lines):
        assert line.startswith(f"checkpoint {step} in ") and f"kept as {step}.corrupt" in line
    assert "resumed from step 1" in err
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == sorted([*map(str, range(1, 7)), *(f"{s}.corrupt" for s in range(2, 6))])
    assert Checkpointer(out / "checkpoints", save_total_limit=None).all_steps() == [1, 2, 3, 4,
                                                                                     5, 6]


@pytest.mark.slow
def test_resume_with_settings_that_change_the_state_says_which(tiny_dir, tmp_path):  # noqa: F811
    from grpo_jax.checkpoint import CheckpointMismatchError
    from grpo_jax.train import train
    out, one = tmp_path / "run", jax.devices()[:1]
    train(config(tiny_dir, out, max_steps=1), devices=one)
    with pytest.raises(CheckpointMismatchError,
                       match=r"checkpoint 1 in .* other settings \(use_peft: checkpoint False, "
                             r"this run True; lora_target_modules: .*\)"):
        train(config(tiny_dir, out, max_steps=2, resume=True, use_peft=True,
                     lora_target_modules="[q_proj]"), devices=one)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["1"]  # untouched


# ------------------------------------------------------------------ rewards

@pytest.mark.slow
def test_nan_rewards_for_a_whole_batch_are_said_not_trained_on_silently(
        tiny_dir, tmp_path, capsys):  # noqa: F811
    from grpo_jax.train import train
    nan = f"{HERE / 'reward_fixtures.py'}:nan_rewards"
    last = train(config(tiny_dir, tmp_path / "run", max_steps=2, reward_funcs=f"[{nan}]"),
                 devices=jax.devices()[:1])
    err = capsys.readouterr().err
    # The function's warning once; the batch's every round (TRL warns every batch too).
    assert err.count("warning: reward function 'nan_rewards' gave no reward") == 1, err[-2000:]
    assert err.count("warning: no completion of this batch has a reward") == 2, err[-2000:]
    # No reward at all: the logged mean is NaN, which the log leaves out (None), as TRL's.
    assert last["reward"] is None and last["grad_norm"] == 0.0


# ------------------------------------------------------------------ one line, exit 2

def _sharded_copy(tiny_dir, dest: Path) -> Path:  # noqa: F811
    """The tiny model saved in shards of ~100 KB (with an index)."""
    import transformers
    shutil.copytree(tiny_dir, dest)
    for f in dest.glob("model*.safetensors*"):
        f.unlink()
    transformers.AutoModelForCausalLM.from_pretrained(tiny_dir).save_pretrained(
        dest, max_shard_size="100KB")
    assert (dest / "model.safetensors.index.json").exists()
    return dest


BAD_INPUTS = ["empty dataset", "malformed JSONL", "truncated safetensors", "missing shard",
              "output_dir under a file", "output_dir not writable", "output_dir on a full disk"]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_files_and_places_one_line_exit_2(tiny_dir, tmp_path, capsys, case):  # noqa: F811
    from grpo_jax.train import main
    settings = dict(max_steps=1, dp=-1, per_device_train_batch_size=2)  # 8 devices here
    model = tmp_path / "model"
    if case in ("truncated safetensors", "missing shard"):
        _sharded_copy(tiny_dir, model)
        shards = sorted(model.glob("model-*.safetensors"))
        if case == "missing shard":
            shards[-1].unlink()
        else:
            with open(shards[0], "r+b") as f:
                f.truncate(shards[0].stat().st_size - 100)
        settings["name_or_path"] = model
    if case == "empty dataset":
        (tmp_path / "empty.jsonl").write_text("")
        settings["dataset_name"] = tmp_path / "empty.jsonl"
    if case == "malformed JSONL":
        (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"\n')
        settings["dataset_name"] = tmp_path / "bad.jsonl"
    out = tmp_path / "run"
    if case == "output_dir under a file":
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" / "run"
    cfg = config(tiny_dir, out, **settings)
    (tmp_path / "run.yaml").write_text(cfg.to_yaml())
    guard = contextlib.nullcontext()
    if case == "output_dir not writable":
        out.mkdir()
        guard = immutable(out)
    if case == "output_dir on a full disk":
        out.mkdir()
        guard = tmpfs(out, "1m")
    with guard:
        if case == "output_dir on a full disk":
            with open(out / "filler", "wb") as f, pytest.raises(OSError):
                while True:
                    f.write(bytes(64 << 10))
                    f.flush()
        assert main(["--config", str(tmp_path / "run.yaml")]) == 2
    line = one_error_line(capsys.readouterr().err)
    expected = {"empty dataset": "empty.jsonl is empty",
                "malformed JSONL": "JSON parse error",
                "truncated safetensors": "is damaged or truncated",
                "missing shard": "shards that model.safetensors.index.json lists are missing",
                "output_dir under a file": f"{tmp_path / 'afile'} is a file",
                "output_dir not writable": "not writable: Operation not permitted",
                "output_dir on a full disk": "No space left on device; no checkpoint was written"
                }[case]
    assert expected in line, line


# ------------------------------------------------------------------ export

@pytest.fixture(scope="module")
def run_dir(tiny_dir, tmp_path_factory):  # noqa: F811
    from grpo_jax.train import train
    out = tmp_path_factory.mktemp("export") / "run"
    train(config(tiny_dir, out, max_steps=2, save_steps=1), devices=jax.devices()[:1])
    return out


def test_export_refuses_the_base_model_and_the_run(run_dir, tiny_dir, capsys):  # noqa: F811
    before = {p.name: p.read_bytes() for p in tiny_dir.iterdir() if p.is_file()}
    for out, what in ((tiny_dir, "is the run's base model"),
                      (run_dir, "is the run's output_dir"),
                      (run_dir.parent, "is a parent of the run's output_dir")):
        for extra in ((), ("--overwrite",)):
            assert export(run_dir, out, *extra) == 2
            err = capsys.readouterr().err
            assert what in err and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in tiny_dir.iterdir() if p.is_file()} == before


def test_export_into_an_old_model_needs_overwrite_and_leaves_no_stale_shards(
        run_dir, tiny_dir, tmp_path, capsys):  # noqa: F811
    import transformers
    out = _sharded_copy(tiny_dir, tmp_path / "old")
    (out / "README.md").write_text("my notes")
    assert export(run_dir, out) == 2
    assert "is not empty" in capsys.readouterr().err
    assert (out / "model.safetensors.index.json").exists()  # untouched
    assert export(run_dir, out, "--overwrite") == 0
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and "README.md" in names
    assert not [n for n in names if n.startswith("model-") or n.endswith(".index.json")], names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left
    fresh = tmp_path / "fresh"
    assert export(run_dir, fresh) == 0
    a = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(fresh).state_dict()
    assert all((a[k] == b[k]).all() for k in b)  # the new weights, not the old shards


def test_interrupted_export_leaves_no_half_model(run_dir, tmp_path, monkeypatch):
    from grpo_jax import hf
    write = hf._write_safetensors

    def interrupted(path, specs, tensor, metadata):
        write(path, specs, tensor, metadata)
        raise KeyboardInterrupt  # Ctrl-C after the weights, before config.json
    monkeypatch.setattr(hf, "_write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export(run_dir, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither a half model nor staging


def _export_cli(run_dir, out, *extra, cwd=None):
    """`python -m grpo_jax.export` as a user runs it: (exit code, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "grpo_jax.export", "--checkpoint", str(run_dir),
                           "--out", str(out), "--dtype", "float32", *extra], env=user_env(),
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stderr


def _damage_data_files(step_dir: Path, how: str) -> None:
    """Every data file of the state (which one holds the params varies between runs): cut to
    10 bytes, removed, or overwritten with random bytes of its size."""
    rng = np.random.default_rng(0)
    for data in [p for p in (step_dir / "state").rglob("*") if p.is_file()
                 and p.parent.name == "d"]:
        if how == "truncated":
            os.truncate(data, 10)
        elif how == "missing":
            data.unlink()
        else:
            data.write_bytes(rng.bytes(data.stat().st_size))


@pytest.mark.slow
def test_export_of_a_damaged_checkpoint_prints_only_its_line(run_dir, tmp_path, capfd):
    """Three damages, each in its own process as a user meets it: stderr is the one line (it
    was 30-60 lines of TensorStore's reads reporting 'Event loop is closed', some after the
    line); the complete checkpoint 1 it names exports. A garbage _CHECKPOINT_METADATA (Orbax
    reads the step without it) exports without absl's ERROR line."""
    for how in ("truncated", "missing", "garbage"):
        damaged = tmp_path / how
        shutil.copytree(run_dir, damaged)
        _damage_data_files(damaged / "checkpoints" / "2", how)
        rc, err = _export_cli(damaged, tmp_path / "hf")
        assert rc == 2 and err.count("\n") == 1, (how, err[-3000:])
        assert err.startswith("grpo_jax.export: error: checkpoint 2 in ") and (
            "damaged" in err and "--step (complete ones: [1])" in err), (how, err)
        assert "TensorStore details" not in err, err  # a pointer to details not shown
    assert not (tmp_path / "hf").exists()
    capfd.readouterr()
    assert export(tmp_path / "garbage", tmp_path / "hf", "--step", "1") == 0
    (tmp_path / "garbage" / "checkpoints" / "2" / "_CHECKPOINT_METADATA").write_text("{garbage")
    assert export(tmp_path / "garbage", tmp_path / "hf2", "--step", "1") == 0
    assert capfd.readouterr().err == ""


def test_export_into_the_working_directory_writes_in_place(run_dir, tmp_path, monkeypatch,
                                                           capsys):
    """`--out .` (an empty working directory; then again with --overwrite): the model is
    written there, not swapped in by a rename that would leave the shell in a removed
    directory. The directory keeps its inode and mode."""
    out = tmp_path / "here"
    out.mkdir()
    out.chmod(0o751)
    inode = out.stat().st_ino
    monkeypatch.chdir(out)
    assert export(run_dir, ".") == 0, capsys.readouterr().err
    (out / "README.md").write_text("my notes")
    assert export(run_dir, ".", "--overwrite") == 0, capsys.readouterr().err
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and "config.json" in names and "README.md" in names
    assert not [n for n in names if n.startswith(".")], names  # no staging left
    assert out.stat().st_ino == inode and out.stat().st_mode & 0o777 == 0o751


def test_export_onto_a_bind_mount_writes_in_place(run_dir, tmp_path, capsys):
    """A bind-mounted --out can't be renamed (EBUSY): written in place, one line on failure."""
    root_or_skip("mount")
    src, out = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    out.mkdir()
    (src / "model-00001-of-00002.safetensors").write_bytes(b"old")
    if subprocess.run(["mount", "--bind", str(src), str(out)], capture_output=True).returncode:
        pytest.skip("can't bind-mount here")
    try:
        assert export(run_dir, out, "--overwrite") == 0, capsys.readouterr().err
        names = sorted(p.name for p in out.iterdir())
        assert "model.safetensors" in names and "model-00001-of-00002.safetensors" not in names
        assert not [n for n in names if n.startswith(".")], names
    finally:
        subprocess.run(["umount", "-l", str(out)], check=True)
    assert sorted(p.name for p in src.iterdir()) == names


def test_export_refuses_the_runs_state_directories(run_dir, capsys):
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    for out in (run_dir / "checkpoints", run_dir / "checkpoints" / "hf",
                run_dir / "checkpoints" / "1"):
        assert export(run_dir, out, "--overwrite") == 2
        err = capsys.readouterr().err
        assert "is inside the run's checkpoints directory" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def test_export_modes_and_a_killed_exports_staging(run_dir, tmp_path, capsys):
    """A new directory gets the umask's mode (not mkdtemp's 0700), --overwrite keeps the old
    one's; a killed export's hidden staging directory (its pid gone) is removed by the next."""
    killed = subprocess.Popen(["sleep", "0"])
    killed.wait()
    stale = tmp_path / f".new.partial-{socket.gethostname()}-{killed.pid}-abc123"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    running = tmp_path / f".new.partial-{socket.gethostname()}-{os.getpid()}-def456"
    running.mkdir()  # an export still running: kept
    old = os.umask(0o027)
    try:
        assert export(run_dir, tmp_path / "new") == 0, capsys.readouterr().err
    finally:
        os.umask(old)
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o750
    assert not stale.exists() and running.exists()
    (tmp_path / "new").chmod(0o755)
    assert export(run_dir, tmp_path / "new", "--overwrite") == 0
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o755
