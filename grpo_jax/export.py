"""`python -m grpo_jax.export --checkpoint OUTPUT_DIR [--step N] --out HF_DIR [--dtype D]
[--overwrite]`.

Writes a Hugging Face model directory (weights, config, tokenizer, chat template) that
`transformers` loads and `vllm serve` serves. A LoRA run (use_peft) writes a PEFT adapter
directory (`adapter_config.json`, `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained` loads onto the base; `--merge` writes the full model instead.

Weights that are not finite (NaN, inf: a diverged run) or beyond --dtype's range are refused
before anything is written.

The export is written into a hidden directory beside HF_DIR and renamed into place when
complete, so an interrupted export never leaves a half model (a killed export's hidden
directory is removed by the next export). A directory that can't be renamed (a mount point, the
working directory) is written in place instead, file by file. HF_DIR must be new or empty;
`--overwrite` replaces an existing model there (its old weights and indexes go, other files
such as a README stay, and so does its mode; a new HF_DIR gets the umask's mode). The run's
base model, its output_dir and the state directories in it are never written to.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fnmatch
import glob
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax import hf, peft_io, storage
from grpo_jax.checkpoint import committed_steps, load_checkpoint
from grpo_jax.cli import load_config
from grpo_jax.errors import GrpoJaxError, ExportError

# Files of an old model that a new export must not leave beside its own (a loader would follow
# a stale index to old shards).
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json",
                "*.pt", "*.pth", "*.gguf", "adapter_config.json")


# The directories of a run's output_dir that hold its state: an export never goes inside them.
RUN_DIRS = ("checkpoints", "reference", "generation_buffer")


def check_destination(out: Path, overwrite: bool, protected: dict[str, Path],
                      run_dir: Path | None = None) -> None:
    """Refuse `out` when it is (or holds) a directory in `protected` (name -> path: the run's
    base model, its output_dir), lies inside one of `run_dir`'s RUN_DIRS, is a file, or is a
    non-empty directory without `overwrite`."""
    where = out.resolve()
    for what, path in protected.items():
        path = Path(path).resolve()
        if where == path or where in path.parents:
            raise ExportError(f"--out {out} is {'' if where == path else 'a parent of '}{what} "
                              f"{path}: the export would overwrite it; choose another directory")
    for name in RUN_DIRS if run_dir is not None else ():
        path = Path(run_dir).resolve() / name
        if where == path or path in where.parents:
            raise ExportError(f"--out {out} is inside the run's {name} directory {path}: the "
                              "export would mix model files into the run's state; choose a "
                              "directory outside it")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; pass a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        some = sorted(p.name for p in out.iterdir())[:3]
        raise ExportError(f"--out {out} is not empty (it holds {', '.join(some)}, ...): pass "
                          "--overwrite to replace the model there, or choose a new directory")


def _mount_points() -> set[str]:
    try:  # Linux: every mount, bind mounts of a directory on the same device included
        with open("/proc/self/mountinfo") as f:
            return {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4])
                    for line in f}  # spaces and such are written as octal escapes
    except OSError:
        return set()


def _fixed(out: Path) -> bool:
    """Whether `out` can't be swapped by a rename: a mount point (EBUSY), or the working
    directory or one above it (the shell would be left in the removed old directory)."""
    cwd = Path.cwd().resolve()
    where = out.resolve()
    return (where == cwd or where in cwd.parents or os.path.ismount(where)
            or str(where) in _mount_points())


def _partial_prefix(out: Path) -> str:
    """Staging directories name their host and pid, so a later export can tell a killed
    export's (its pid gone) from a running one's."""
    return f".{out.name}.partial-{socket.gethostname()}-"


def remove_stale_partials(parent: Path, out: Path) -> None:
    """Remove staging directories of `out` in `parent` left by exports on this host that were
    killed (their pid is no longer running)."""
    prefix = _partial_prefix(out)
    for p in parent.glob(f"{glob.escape(prefix)}*"):
        pid = p.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:  # running, as another user
            pass


def _new_mode(out: Path) -> int:
    """The mode the export directory ends with: an existing one's (--overwrite), else what
    mkdir gives under the umask (mkdtemp's 0700 is for the staging only)."""
    if out.is_dir():
        return stat.S_IMODE(out.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def _keep_others(out: Path, tmp: Path) -> None:
    """Copy what the export does not make (a README, ...) from the old `out` into `tmp`."""
    for old in out.iterdir():
        if old.name != tmp.name and not (tmp / old.name).exists() and not any(
                fnmatch.fnmatch(old.name, p) for p in WEIGHT_FILES):
            (shutil.copytree if old.is_dir() else shutil.copy2)(old, tmp / old.name)


def _move_in(tmp: Path, out: Path) -> None:
    """Write `tmp`'s files into `out` in place (a directory that can't be renamed): the old
    weights go first (a loader must not follow an old index to old shards), then each new file
    replaces its old one whole."""
    made = {p.name for p in tmp.iterdir()}
    for old in out.iterdir():
        if old.name != tmp.name and old.name not in made and any(
                fnmatch.fnmatch(old.name, p) for p in WEIGHT_FILES):
            (shutil.rmtree if old.is_dir() and not old.is_symlink() else os.unlink)(old)
    for new in tmp.iterdir():
        dest = out / new.name
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        shutil.move(new, dest)  # a rename, or a copy across file systems


# (all finite, largest magnitude) of one weight, on its devices: nothing is gathered.
_finite_max = jax.jit(lambda w: (jnp.isfinite(w).all(), jnp.abs(w).max()))


def check_weights(model, dtype: str, where: str, others: list[int]) -> None:
    """ExportError when a weight of `model` is NaN or inf (a diverged run, a damaged
    checkpoint), or beyond `dtype`'s range (it would be written as inf): a model file of such
    weights loads and then generates garbage."""
    limit = float(jnp.finfo(dtype).max)
    for path, w in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
        if not jnp.issubdtype(w.dtype, jnp.floating):  # a quantized base's integers
            continue
        finite, largest = _finite_max(w)
        name = "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
        if not finite:
            raise ExportError(
                f"{where} holds weights that are not finite (NaN or inf in {name}); nothing was "
                "written: " + (f"export another with --step (complete ones: {others})" if others
                               else "no other checkpoint to export"))
        if float(largest) > limit:
            raise ExportError(f"{where}: {name} holds {float(largest):.3g}, beyond {dtype}'s "
                              f"range (it would be written as inf); nothing was written: "
                              "export with --dtype bfloat16 or float32")


@contextlib.contextmanager
def staged(out: Path):
    """A temporary directory to write the export into; on success it becomes `out` (an
    existing `out` is swapped out whole, keeping its files that are not weights), on failure it
    is removed and `out` is as it was. A directory that can't be renamed (a mount point, the
    working directory) is staged inside and written in place instead."""
    out = Path(os.path.abspath(out))
    storage.check_writable(out.parent, "the parent of --out")
    mode = _new_mode(out)
    in_place = out.is_dir() and _fixed(out)
    stage = out if in_place else out.parent
    remove_stale_partials(stage, out)
    tmp = Path(tempfile.mkdtemp(dir=stage, prefix=f"{_partial_prefix(out)}{os.getpid()}-"))
    try:
        yield tmp
        os.chmod(tmp, mode)
        if in_place:
            _move_in(tmp, out)
        elif out.exists():
            _keep_others(out, tmp)
            aside = tmp.with_name(f".{out.name}.old-{os.getpid()}")
            try:
                os.rename(out, aside)
            except OSError as e:
                if e.errno != errno.EBUSY:  # a mount point _fixed did not see
                    raise
                _move_in(tmp, out)
                return
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(aside, out)  # as it was
                raise
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export(checkpoint, out, *, step: int | None = None, dtype: str = "bfloat16",
           merge: bool = False, overwrite: bool = False) -> tuple[Path, int]:
    """Export checkpoint `step` (None: the latest) of the run in `checkpoint` to `out`; returns
    (out, step)."""
    out = Path(out)
    model, source_dir, step = load_checkpoint(checkpoint, step)
    others = [s for s in committed_steps(Path(checkpoint) / "checkpoints") if s != step]
    check_weights(model, dtype, f"checkpoint {step} of {checkpoint}", others)
    check_destination(out, overwrite, {"the run's base model": Path(source_dir),
                                       "the run's output_dir": Path(checkpoint)},
                      run_dir=Path(checkpoint))
    with staged(out) as tmp:
        if model.lora_scale is None:
            hf.save_hf(model, tmp, source_dir=source_dir, dtype=dtype)
        elif merge:
            hf.save_hf(peft_io.merged_model(model), tmp, source_dir=source_dir, dtype=dtype)
        else:
            cfg = load_config(str(Path(checkpoint) / "config.yaml"))
            base = peft_io.base_name(cfg)  # PEFT can't resolve our alias: name the directory
            peft_io.save_adapter(model, cfg.peft, tmp,
                                 str(source_dir) if base == hf.SMOL_ALIAS else base, dtype=dtype)
    return out, step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpo_jax.export", description=__doc__)
    p.add_argument("--checkpoint", required=True, help="a training run's output_dir")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, help="the HF directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--merge", action="store_true",
                   help="LoRA runs: merge the adapters into the base and write the full model")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the model in a non-empty --out (its old weights and indexes "
                        "are removed)")
    args = p.parse_args(argv)
    try:
        out, step = export(args.checkpoint, args.out, step=args.step, dtype=args.dtype,
                           merge=args.merge, overwrite=args.overwrite)
    except GrpoJaxError as e:
        print(f"grpo_jax.export: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        cause = storage.storage_cause(e)
        if cause is None:
            raise
        print(f"grpo_jax.export: error: can't write {args.out}: {storage.describe(cause)}",
              file=sys.stderr)
        return 2
    print(f"exported step {step} of {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    code = main()
    if code:  # a failed read's TensorStore reads may still be completing: don't wait on them,
        sys.stdout.flush()  # nor let them report through an interpreter being finalized
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
