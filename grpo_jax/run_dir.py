"""A run's hold on its output_dir: one run per directory, and the directory staying the one the
run opened (docs/reliability.md).

The lock is an flock on `output_dir/grpo_jax.lock`, held by process 0 of a run for its whole
life; the kernel drops it when that process ends however it ends, so a killed run leaves no lock
that blocks the next one. The file names its owner (host, pid, the process's start time): what a
refused run reports, and how a lock the kernel did not enforce (a file system without working
flock) is still seen to belong to a live process on this host. A file with an owner in it that
is no longer running is a stale lock: taken over, said in one line.

A directory stat'ed at the start (device and inode, on every process) and again after each round
and at the end tells whether output_dir is still that directory: a file system unmounted under
a run (`umount -l`) or a directory moved or replaced would otherwise take the run's config,
metrics and checkpoints with it while it ends with exit 0.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
import weakref
from pathlib import Path

from grpo_jax import distributed as dist
from grpo_jax.errors import StorageError, TrainError

LOCK_NAME = "grpo_jax.lock"


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field), which
    tells a live owner from a new process that got its pid; None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # fields after the command's ")"


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks":
            _start_ticks(os.getpid()), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _running(owner: dict) -> bool:
    """Whether `owner` (a lock file's contents) is a process running on this host."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    return owner.get("start_ticks") in (None, _start_ticks(owner["pid"]))


def _describe(owner: dict) -> str:
    return (f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}, started "
            f"{owner.get('started', '?')}")


def _read_owner(fd: int) -> dict:
    """The owner a lock file names ({} when it is empty: released, or not ours)."""
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}


def _take(out: Path) -> int:
    """Lock `out` for this process: the lock file's descriptor, its flock held and this
    process named in it; or TrainError naming the run that holds it."""
    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            enforced = True
        except BlockingIOError:
            enforced = None  # held
        except OSError as e:  # no file locks here (ENOLCK, ...): the owner's pid decides
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            enforced = False
        owner = _read_owner(fd)
        if enforced is None or owner and _running(owner):
            raise TrainError(
                f"output_dir {out} is in use by another run ({_describe(owner)}; lock file "
                f"{path}): wait for that run to end or stop it, or choose another output_dir")
        if owner:
            print(f"output_dir {out}: the run that held it ({_describe(owner)}) is no longer "
                  "running; taking over its lock", file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_owner()) + "\n").encode(), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _release(fd: int) -> None:
    """The lock file emptied (so the next run sees no stale owner) and its flock dropped."""
    try:
        os.ftruncate(fd, 0)  # a failure leaves the owner's name: the next run says stale
    except OSError:
        pass
    finally:
        os.close(fd)  # drops the flock


def _identity(out: Path) -> tuple[int, int]:
    st = os.stat(out)
    return st.st_dev, st.st_ino


class RunDirLock:
    """Process 0's lock on output_dir (the other processes of a run hold none: they follow
    process 0's outcome) and every process's record of which directory it is."""

    def __init__(self, out: Path, fd: int | None):
        # Released once: by release(), else when dropped (a run abandoned in a test's process)
        # or at the interpreter's exit.
        self._release = None if fd is None else weakref.finalize(self, _release, fd)
        self.out, self._identity = Path(out), _identity(Path(out))

    @classmethod
    def acquire(cls, out) -> "RunDirLock":
        """The lock on `out` (an existing directory) for this run; TrainError on every process
        when another run holds it. Before anything of this run is written in `out`."""
        out, held = Path(out), []

        def take() -> str | None:  # process 0's: the refusal every process raises, or None
            try:
                held.append(_take(out))
            except TrainError as e:
                return str(e)
            return None
        refusal = dist.from_main(take, TrainError)  # other failures too reach every process
        if refusal is not None:
            raise dist.raised_on_all(TrainError(refusal))
        return cls(out, held[0] if held else None)

    def moved(self) -> StorageError | None:
        """The error to stop with when output_dir is no longer the directory this run opened
        (its file system unmounted, or it was moved, deleted or replaced); else None."""
        try:
            now = _identity(self.out)
        except OSError as e:
            what = f"it is gone: {e.strerror}"
        else:
            if now == self._identity:
                return None
            what = "another directory is there now"
        return StorageError(
            f"output_dir {self.out} is no longer the directory this run started in ({what}): "
            "its file system was unmounted, or it was moved, deleted or replaced. The run "
            "stopped and writes nothing more there; its config.yaml, metrics.jsonl and "
            "checkpoints so far are in the directory it had: mount or move it back to "
            f"{self.out}, then resume with --resume")

    def check(self) -> None:
        """StorageError (moved's) unless output_dir is still the directory this run opened."""
        error = self.moved()
        if error is not None:
            raise error

    def release(self) -> None:
        """The lock given up and its file emptied; a second call does nothing."""
        if self._release is not None:
            self._release()
