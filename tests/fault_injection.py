"""Faults injected for real, and what the suite reads of a run that met one: mounts, immutable
directories, the training CLI as a user starts it, its one error line. Shared by the modules
that inject faults (test_faults, test_run_dir, test_integrity). chattr and mount need root:
without it the tests that use them skip."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_run import TRAIN, config, user_env

HERE = Path(__file__).parent
ERROR = "grpo_jax.train: error:"


def root_or_skip(tool: str) -> None:
    if os.geteuid() != 0 or shutil.which(tool) is None:
        pytest.skip(f"needs root and {tool} to inject the fault")


@contextlib.contextmanager
def immutable(path: Path):
    """`path` immutable (chattr +i: creating, renaming or deleting inside it fails with EPERM,
    also for root) until the block ends."""
    root_or_skip("chattr")
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip(f"chattr +i is not supported on the file system of {path}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted on `path` (which must exist) until the block ends."""
    root_or_skip("mount")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode:
        pytest.skip("can't mount a tmpfs here")
    try:
        yield
    finally:
        if os.path.ismount(path):  # a test may have unmounted it itself
            subprocess.run(["umount", "-l", str(path)], check=True)


def start_cli(tiny_dir, out, *args, **settings):  # noqa: F811
    cfg = config(tiny_dir, out, **settings)
    path = Path(out).parent / f"{Path(out).name}.yaml"
    path.write_text(cfg.to_yaml())
    return subprocess.Popen([sys.executable, *TRAIN, "--config", str(path),
                             *args], env=user_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, timeout: float):
    """(exit code, stderr, seconds) of `proc`, killed (and the test failed) after `timeout`."""
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the run hung: still running {timeout:.0f} s later; stderr tail:\n"
                    f"{err[-3000:]}")
    return proc.returncode, err, time.monotonic() - start


# After a failed mid-write, tensorstore's writes still in flight report "Event loop is closed"
# from asyncio as they complete (checkpoint.quiet_closed_loop_reports drops those reaching
# sys.excepthook; some still get through, the known gap in docs/reliability.md): not ours.
# Several threads may print those reports at once, their lines interleaved: they are dropped
# line by line (their header, asyncio's two frames and the RuntimeError); anything left that
# looks like a traceback (a header or a frame) is ours.
CLOSED_LOOP = re.compile(r'Traceback \(most recent call last\):$|^\s+File ".*/asyncio/'
                         r'base_events\.py", line \d+, in (call_soon_threadsafe|_check_closed)$'
                         r"|^\s+self\._check_closed\(\)$|^\s+raise RuntimeError\('Event loop "
                         r"is closed'\)$|^RuntimeError: Event loop is closed$")


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith(ERROR)]
    left = [line for line in err.splitlines() if not CLOSED_LOOP.search(line)]
    assert len(lines) == 1 and not any("Traceback" in line or line.lstrip().startswith("File \"")
                                       for line in left), err[-4000:]
    return lines[0]


def wait_for(path: Path, proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.exists(), (proc.poll(), proc.stderr.read()[-3000:] if proc.poll() is not None
                           else "still running")


def restorable(cfg, directory: Path, step: int) -> None:
    from grpo_jax.checkpoint import Checkpointer, abstract_state
    target, *_ = abstract_state(cfg)
    with Checkpointer(directory, save_total_limit=None) as ckpt:
        state, meta = ckpt.restore(step, target)
    assert int(state.step) == step and meta["round"] >= 1


STALL = f"{HERE / 'reward_fixtures.py'}:even_tokens_then_stall"


def export(run_dir, out, *extra):
    """`grpo_jax.export`'s main on checkpoint `run_dir` (float32): its exit code."""
    from grpo_jax.export import main
    return main(["--checkpoint", str(run_dir), "--out", str(out), "--dtype", "float32",
                 *extra])
