"""A run's output_dir, shared or taken away for real: a second run started on a running run's
directory (one process and two), a run killed with SIGKILL whose lock and torn last metrics line
the resumed run finds, a damaged metrics.jsonl, and the output_dir's file system unmounted
(`umount -l`) under a running run (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import jax
import pytest
from fault_injection import STALL, finish, one_error_line, start_cli, tmpfs, wait_for
from processes import cli_config, launch, log, wait_all
from tiny_run import config

from grpo_jax.run_dir import LOCK_NAME
from grpo_jax.train import main, train


def files(out: Path) -> dict[str, bytes]:
    """Every file under `out` and its bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file()}


@pytest.mark.slow
def test_busy_output_dir_is_refused_then_a_killed_runs_lock_and_torn_line_are_taken_over(
        tiny_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Run A stalls in its third round, before its first checkpoint (which the "already holds
    checkpoints" refusal needs). A second run on its output_dir, as two processes and as one,
    is refused on every process with one line naming A (host, pid), exit 2, A's files
    untouched (config.yaml too) and A running on. A is then killed with SIGKILL mid-write of a
    metrics record: the next run (--resume) takes over A's lock and drops the torn line,
    saying each in one line, and leaves a consistent metrics.jsonl."""
    out, marker = tmp_path / "run", tmp_path / "stalled"
    monkeypatch.setenv("GRPO_JAX_TEST_STALL", str(marker))
    a = start_cli(tiny_dir, out, max_steps=4, save_steps=100, reward_funcs=f"[{STALL}]")
    try:
        wait_for(marker, a)
        before = files(out)
        assert {"config.yaml", "metrics.jsonl"} <= before.keys() and not [
            k for k in before if k.startswith("checkpoints/")], list(before)
        owner = f"pid {a.pid} on {socket.gethostname()}"
        b_dir = tmp_path / "b"
        b_dir.mkdir()
        codes = wait_all(launch(cli_config(tiny_dir, out, max_steps=2), log_dir=b_dir), 120)
        errors = [log(b_dir, f"p{i}.err") for i in range(2)]
        assert codes == [2, 2], errors
        for err in errors:
            line = one_error_line(err)
            assert "is in use by another run" in line and owner in line, line
        monkeypatch.delenv("GRPO_JAX_TEST_STALL")
        (tmp_path / "c.yaml").write_text(config(
            tiny_dir, out, max_steps=2, seed=5, dp=-1, per_device_train_batch_size=2).to_yaml())
        capsys.readouterr()
        assert main(["--config", str(tmp_path / "c.yaml")]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert owner in line and "choose another output_dir" in line, line
        assert files(out) == before and a.poll() is None
    finally:
        a.kill()  # SIGKILL: its lock stays named in the file, as after a crash
        a.wait()
    assert a.returncode == -signal.SIGKILL
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == a.pid
    with open(out / "metrics.jsonl", "a") as f:  # the record being written as it died
        f.write('{"step": 3, "reward": 0.5, "kl": nu')
    train(config(tiny_dir, out, max_steps=3, save_steps=1, resume=True),
          devices=jax.devices()[:1])
    err = capsys.readouterr().err
    took_over = [x for x in err.splitlines() if "taking over its lock" in x]
    assert len(took_over) == 1 and f"pid {a.pid} on" in took_over[0], err[-3000:]
    torn = [x for x in err.splitlines() if "was cut off mid-write" in x]
    assert len(torn) == 1 and "line 3" in torn[0], err[-3000:]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (out / LOCK_NAME).read_text() == ""  # released at the end


def test_damaged_metrics_history_is_one_error_line(tiny_dir, tmp_path, capsys):  # noqa: F811
    """A line inside metrics.jsonl that is not a record (not the last: that one is torn, not
    damaged) stops the run with one line naming the file and the line, exit 2."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew\n'
                                       '{"step": 3, "reward": 0.5}\n')
    (tmp_path / "run.yaml").write_text(config(  # the suite's 8 devices
        tiny_dir, out, max_steps=1, dp=-1, per_device_train_batch_size=2).to_yaml())
    assert main(["--config", str(tmp_path / "run.yaml")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{out / 'metrics.jsonl'} line 2 is not JSON" in line, line
    assert (out / LOCK_NAME).read_text() == ""  # the refused run released its lock


@pytest.mark.slow
def test_output_dir_unmounted_mid_run_stops_nonzero(tiny_dir, tmp_path):  # noqa: F811
    """output_dir is a tmpfs, unmounted lazily (`umount -l`) after checkpoint 2: the run stops
    within a bound with one line naming output_dir and exit 2 (it used to end 0 with its
    config and metrics gone), and writes nothing into the directory left in its place."""
    out = tmp_path / "run"
    out.mkdir()
    with tmpfs(out, "64m"):
        proc = start_cli(tiny_dir, out, max_steps=400, save_steps=1)
        try:
            wait_for(out / "checkpoints" / "2", proc)
            subprocess.run(["umount", "-l", str(out)], check=True)
            gone = time.monotonic()
            rc, err, _ = finish(proc, 120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    after = time.monotonic() - gone
    line = one_error_line(err)
    print(f"exit {rc} {after:.1f} s after umount: {line}")
    assert rc == 2 and after < 60, (after, err[-3000:])
    assert f"output_dir {out} is no longer the directory this run started in" in line, line
    assert not os.path.ismount(out)
    # Nothing of the run's own in the mount point's place (a checkpoint write in flight at the
    # unmount may finish there: Orbax writes by path).
    assert not {"config.yaml", "metrics.jsonl", LOCK_NAME} & {p.name for p in out.iterdir()}
