"""SHA-256 manifests of checkpoint files: a flipped bit in a step's data is found before the
step is restored.

Orbax writes no checksum of the array data (TensorStore's zarr3 `crc32c` codec guards only the
shard indexes, and Orbax offers no option to add it to the chunks; OCDBT checks its own tree
nodes only), so a flipped byte in a data file restores as a wrong number. A step directory that
Orbax has committed gets `SHA256SUMS` beside its items: one `HEX  PATH` line per file under the
items' directories, the format of coreutils' `sha256sum` (`cd STEP && sha256sum -c SHA256SUMS`
checks a step by hand).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from pathlib import Path

MANIFEST = "SHA256SUMS"
_BLOCK = 8 << 20
_WORKERS = 8  # hashlib releases the GIL: files are hashed in parallel


def _files(step_dir: Path) -> list[str]:
    """The files of a step's items (its subdirectories), relative to it, sorted."""
    return sorted(str(p.relative_to(step_dir)) for item in step_dir.iterdir() if item.is_dir()
                  for p in item.rglob("*") if p.is_file())


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _digests(step_dir: Path, names: list[str]) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(min(_WORKERS, max(len(names), 1))) as pool:
        return list(pool.map(lambda n: _digest(step_dir / n), names))


def write(step_dir) -> None:
    """Write `step_dir`'s manifest (atomically: a step has a whole manifest or none)."""
    step_dir = Path(step_dir)
    names = _files(step_dir)
    text = "".join(f"{d}  {n}\n" for d, n in zip(_digests(step_dir, names), names))
    tmp = step_dir / f".{MANIFEST}.tmp"
    tmp.write_text(text)
    os.replace(tmp, step_dir / MANIFEST)


def has_manifest(step_dir) -> bool:
    return (Path(step_dir) / MANIFEST).is_file()


def mismatches(step_dir, share: tuple[int, int] = (0, 1)) -> list[str]:
    """What of `step_dir` differs from its manifest: files whose bytes changed, are missing, or
    are not listed. `share` (i, n): only every n-th listed file from the i-th is hashed (the
    processes of a run split the reading)."""
    step_dir = Path(step_dir)
    listed = {}
    for line in (step_dir / MANIFEST).read_text().splitlines():
        digest, _, name = line.partition("  ")
        listed[name] = digest
    present = set(_files(step_dir))
    problems = [f"{n} is missing" for n in sorted(set(listed) - present)]
    problems += [f"{n} is not in {MANIFEST}" for n in sorted(present - set(listed))]
    names = [n for n in sorted(listed) if n in present][share[0]::share[1]]
    problems += [f"{n} does not match its checksum" for n, d in
                 zip(names, _digests(step_dir, names)) if d != listed[n]]
    return problems
