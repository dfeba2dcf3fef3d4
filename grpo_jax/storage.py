"""The disk saying no: which OS errors mean the run's storage (full, read-only, no permission, a
file where a directory should be), finding them behind library exceptions, and checking a
directory is writable before a run relies on it (docs/reliability.md)."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from grpo_jax.errors import StorageError

STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                  errno.ENOTDIR, errno.EEXIST, errno.EISDIR)


def storage_cause(e: BaseException) -> OSError | None:
    """The storage OSError behind `e` (itself, a cause or context; tensorstore reports one in
    the text of its own exception, e.g. "... No space left on device ..."), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
        text = str(e)
        for n in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
            if os.strerror(n) in text:
                return OSError(n, os.strerror(n))
        e = e.__cause__ or e.__context__
    return None


def describe(e: OSError) -> str:
    """'No space left on device (PATH)': the error in one line."""
    what = e.strerror or str(e)
    return f"{what} ({e.filename})" if e.filename else what


def check_writable(path, what: str) -> Path:
    """Create directory `path` (and its parents) and write a file in it, or raise StorageError
    naming `what` (e.g. "output_dir") and the reason: a run finds out before its first hour of
    work, not at its first checkpoint."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".grpo_jax-write-test-"):
            pass
    except OSError as e:
        if isinstance(e, (FileExistsError, NotADirectoryError)) or not path.is_dir():
            blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()),
                           None)
            if blocker is not None:
                raise StorageError(f"{what} {path} can't be created: {blocker} is a file, not "
                                   "a directory") from None
        raise StorageError(f"{what} {path} is not writable: {describe(e)}") from None
    return path
