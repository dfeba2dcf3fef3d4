"""Checkpoints of the training state with exact resume, on Orbax's CheckpointManager.

One checkpoint is a step directory `<directory>/<step>/` with two items: `state` (a pytree of
arrays: params, optimizer state, counters; written per shard with tensorstore) and `meta` (a JSON
dict: data position, round, metrics).

Safety comes from Orbax: a step is written into `<step>.orbax-checkpoint-tmp` and renamed only
when complete, so a process killed mid-save leaves the previous steps intact and the partial
directory is neither listed nor restored (it is deleted when the next Checkpointer opens the
directory). Old steps beyond `save_total_limit` are deleted only after the new one is committed.

Restore writes straight into the target's shardings, so a checkpoint written on one mesh loads
onto another (or onto one device) without gathering the full state on a host.

A write that fails (disk full, read-only, no permission) is a CheckpointWriteError naming the
error, the directory and the last good checkpoint: at the next save, `wait` or `poll`, never a
hang (Orbax's writer threads of the failed step are released; docs/reliability.md).

Each committed step gets a manifest of its files' SHA-256 (grpo_jax.checksums), written once
Orbax has committed it (for an async save: at the next save, `wait`, `poll` or `close`); a
restore verifies it first, so a flipped bit in a data file is a damaged checkpoint, not a wrong
number. A step without one is restored unverified, said on one line: its meta
(`CHECKSUMS_KEY`) tells a step whose run stopped before writing the manifest from an older
version's.

`load_checkpoint` restores a run's params from its output_dir alone (for export).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from grpo_jax import checksums
from grpo_jax import distributed as dist
from grpo_jax import internals
from grpo_jax import storage
from grpo_jax.errors import (CheckpointDamagedError, CheckpointError, CheckpointMismatchError,
                             CheckpointWriteError)
from grpo_jax.grpo.batch import Batch


def committed_steps(directory) -> list[int]:
    """Steps whose directory is complete on disk (Orbax renames `<step>.orbax-checkpoint-tmp`
    to `<step>` only once every file is written), ascending."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def last_good(directory) -> str:
    """'last good checkpoint: PATH', or that there is none: the end of a write error."""
    steps = committed_steps(directory)
    return (f"last good checkpoint: {Path(directory) / str(steps[-1])}" if steps
            else "no checkpoint was written")


def check_writable(directory) -> None:
    """CheckpointWriteError now when `directory` can't take a checkpoint (created if missing)."""
    try:
        storage.check_writable(directory, "checkpoint directory")
    except storage.StorageError as e:
        raise CheckpointWriteError(f"{e}; {last_good(directory)}") from None


class _QuietStorageErrors(logging.Filter):
    """Orbax logs a failed write with its traceback from each thread that sees it (hundreds of
    lines); the Checkpointer raises the same failure as one CheckpointWriteError, so those
    records are dropped. Orbax's other records pass."""

    def filter(self, record):
        e = record.exc_info and record.exc_info[1]
        return not (e and record.pathname and "orbax" in record.pathname
                    and (storage.storage_cause(e) is not None
                         # output_dir unmounted under the write (the run says so: run_dir)
                         or FileNotFoundError in map(type, (e, e.__cause__, e.__context__))))


_QUIET = _QuietStorageErrors()


def _shapes(tree) -> dict:
    """{key path: shape} of an Orbax tree (saved metadata or a serialized target). Dtypes are
    left out: a restore casts them."""
    def key(k):
        return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
    return {"/".join(key(k) for k in path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


# In a step's meta: the step was saved by a Checkpointer that writes manifests, so a step
# without one was left by a run that stopped before writing it, not by an older version.
CHECKSUMS_KEY = "checksums"


# The sections whose settings shape the checkpointed state (params, optimizer state, counters).
STATE_SECTIONS = ("model", "peft", "numerics", "optim", "loss")


def _mismatch(step, directory, saved: dict, wanted: dict, settings: dict,
              saved_settings: dict | None) -> str:
    diffs = [f"{key}: checkpoint {old!r}, this run {new!r}"
             for section, key, old, new in settings_diff(saved_settings, settings)
             if section in STATE_SECTIONS]
    if not diffs:  # the same settings, another state: e.g. the model's files changed
        key = next((k for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k)))
        diffs = [f"the state's {key} has shape {saved.get(key, 'absent')} in the checkpoint, "
                 f"{wanted.get(key, 'absent')} in this run (did model_name_or_path's files "
                 "change?)"]
    return (f"checkpoint {step} in {directory} was written by a run with other settings "
            f"({'; '.join(diffs)}): resume with the settings it was written with, or train "
            "into another output_dir")


# The settings that fix what a checkpoint's data position and epoch mean: resumed with other
# values, the run would skip or repeat prompts and jump epochs. The batch's shape is compared
# as the checkpoint's batch plan (its meta), so that the same batch on other devices (another
# per_device_train_batch_size and dp) resumes. Run-time settings (where the run writes and how
# it resumes) are not compared at all.
DATA_SETTINGS = {"data": ("dataset_name", "dataset_config", "dataset_train_split",
                          "prompt_column", "shuffle_dataset", "seed"),
                 "grpo": ("num_generations",)}
BATCH_SECTIONS = ("batch", "mesh", "grpo")  # settings that may change the batch plan
RUN_TIME_SETTINGS = (("run", "resume"), ("run", "output_dir"), ("distributed", None))


def settings_diff(old: dict | None, new: dict) -> list[tuple[str, str, object, object]]:
    """(section, key, old, new) for each setting of `new` (TrainConfig.to_dict) whose value in
    `old` (a config.yaml's) differs, run-time settings left out; [] when `old` is None."""
    return [(section, key, was, value)
            for section, values in new.items() for key, value in values.items()
            for was in [((old or {}).get(section) or {}).get(key, value)]
            if was != value and (section, key) not in RUN_TIME_SETTINGS
            and (section, None) not in RUN_TIME_SETTINGS]


def resume_changes(step: int, saved_settings: dict | None, settings: dict,
                   saved_schedule: dict | None, schedule: dict) -> tuple[list[str], list[str]]:
    """(refused, changed) between checkpoint `step`'s run and this one, each 'key: checkpoint
    X, this run Y'. Refused: the data settings (DATA_SETTINGS), the dataset's size and the
    batch plan (`schedule`: `num_prompts` and BatchPlan's fields, kept in each checkpoint's
    meta; with the settings that changed it). Changed: every other setting (it applies from
    the resumed step on)."""
    diffs = settings_diff(saved_settings, settings)
    text = {(sec, key): f"{key}: checkpoint {step} {was!r}, this run {value!r}"
            for sec, key, was, value in diffs}
    refused = [text[sec, key] for sec, key, *_ in diffs if key in DATA_SETTINGS.get(sec, ())]
    changed = [t for t in text.values() if t not in refused]
    saved_schedule = saved_schedule or {}
    plan = [f"the batch's {key}: checkpoint {step} {saved_schedule[key]}, this run {value}"
            for key, value in schedule.items() if key != "num_prompts"
            and saved_schedule.get(key, value) != value]
    if plan and not refused:  # else num_generations explains it
        causes = [text[sec, key] for sec, key, *_ in diffs if sec in BATCH_SECTIONS]
        refused += causes + plan
        changed = [t for t in changed if t not in causes]
    if saved_schedule.get("num_prompts", schedule.get("num_prompts")) != schedule.get(
            "num_prompts"):
        refused.append(f"the dataset's prompts: checkpoint {step} "
                       f"{saved_schedule['num_prompts']}, this run {schedule['num_prompts']}")
    return refused, changed


def _abstract_leaf(path, leaf):
    if leaf is ocp.PLACEHOLDER:  # a leaf left unrestored
        return leaf
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        raise ValueError(
            f"restore target leaf {jax.tree_util.keystr(path)} has no sharding; build the target "
            "from jax.ShapeDtypeStruct(shape, dtype, sharding=...) leaves (e.g. jax.eval_shape "
            "of the init function plus the shardings the state should live on)")
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


class Checkpointer:
    """Numbered checkpoints of (state, meta) in `directory`.

    save_total_limit: keep only the newest N steps (None keeps all), as in TRL.
    read_only: nothing in `directory` is written or deleted (another run's checkpoints).
    async_save: `save` returns once the arrays are copied off the accelerator; files are written
      in the background. The state's buffers may then be donated or deleted. Call `wait()` to
      block until the write is committed; the next `save`, `restore` and `close` wait too.
    """

    def __init__(self, directory, *, save_total_limit: int | None, async_save: bool = True,
                 read_only: bool = False):
        if save_total_limit is not None and save_total_limit < 1:
            raise ValueError(f"save_total_limit must be None (keep all) or >= 1, "
                             f"got {save_total_limit}")
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=save_total_limit,
            enable_async_checkpointing=async_save,
            # partial saves of a killed run; read_only: another run's, which may be running
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self.read_only = read_only
        self._operations: set[str] = set()  # Orbax operation ids of this object's saves
        self._unsealed: list[int] = []  # steps saved here whose manifest is not written yet
        self.failed: CheckpointWriteError | None = None
        logging.getLogger("absl").addFilter(_QUIET)

    def _write_error(self, e: BaseException) -> CheckpointWriteError:
        """`e`, raised by a save or a wait, as one line; Orbax's threads of the failed save are
        released. Later calls raise the same error."""
        if self.failed is None:
            cause = storage.storage_cause(e)
            reason = (storage.describe(cause) if cause is not None
                      else " ".join(f"{type(e).__name__}: {e}".split())[:500])
            self.failed = CheckpointWriteError(
                f"can't write a checkpoint to {self.directory}: {reason}; "
                f"{last_good(self.directory)}. Free space or fix the directory, then resume "
                "with --resume")
            internals.release_orbax_writers(self._operations)
        return self.failed

    def all_steps(self) -> list[int]:
        """Steps of complete checkpoints (plus one being written by this process), ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state, meta: dict) -> bool:
        """Write `state` and `meta` as checkpoint `step`. Returns whether a save was started:
        False when `step` is already saved, so a final save right after a periodic one is
        harmless."""
        step = int(step)
        steps = self.all_steps()
        if step in steps:
            return False
        if steps and step < steps[-1]:
            raise ValueError(
                f"cannot save step {step}: {self.directory} already holds the later step "
                f"{steps[-1]}. Resume from the latest step, or use a fresh directory.")
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint meta must be JSON-serializable (convert numpy/jax "
                            f"scalars with float()/int()): {e}") from None
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(
            {**meta, CHECKSUMS_KEY: checksums.MANIFEST}))
        # The previous save is committed (or has failed) first, as Orbax's save would wait for
        # it anyway: an error then names it as the last good checkpoint, not the one before.
        self.wait()
        self._check_space(step, state)
        try:
            started = self._manager.save(step, args=args, force=True)
        except Exception as e:  # this save, or the previous one it waited for
            self._note_operation()
            raise self._write_error(e) from None
        self._note_operation()
        self._seal()  # the previous save is committed now (Orbax waited for it)
        if started:
            self._unsealed.append(step)
            if not self._manager.is_saving_in_progress():
                self._seal()  # a synchronous save is committed already
        return started

    def _seal(self) -> None:
        """Write the manifests of this object's saves that Orbax has committed (process 0:
        the step directory holds every process's files once committed)."""
        committed = set(committed_steps(self.directory))
        for step in [s for s in self._unsealed if s in committed]:
            if dist.is_main():
                try:
                    checksums.write(Path(self.directory) / str(step))
                except FileNotFoundError:  # deleted meanwhile (save_total_limit)
                    pass
                except OSError as e:
                    raise self._write_error(e) from None
        # Steps not committed stay, unless gone for good (deleted by save_total_limit).
        self._unsealed = [s for s in self._unsealed if s not in committed
                          and s in self._manager.all_steps()]

    def _check_space(self, step: int, state) -> None:
        """CheckpointWriteError (ENOSPC) when the disk lacks room for this process's part of
        `state`: said before a write that would fail half-way (whose writer threads then
        print tracebacks of their own). This object's earlier saves are committed by now;
        bytes other processes write can still fill it first, a failure that surfaces at the
        next save, wait or poll."""
        need = sum(shard.data.nbytes for x in jax.tree.leaves(state)
                   if isinstance(x, jax.Array) for shard in x.addressable_shards
                   if shard.replica_id == 0)
        need = int(need * 1.02) + (256 << 10)  # Orbax's metadata and file rounding
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            return  # the write itself will say what is wrong
        if free < need:
            raise self._write_error(OSError(errno.ENOSPC, (
                f"No space left on device: checkpoint {step} needs about {need / 2**20:.1f} "
                f"MiB, {free / 2**20:.1f} MiB are free"), self.directory))

    def _note_operation(self) -> None:
        """Remember the Orbax operation id of the save just started (its threads carry it)."""
        op = internals.orbax_operation_id()
        if op is not None:
            self._operations.add(op)

    def restore(self, step: int | None, target):
        """(state, meta) of checkpoint `step` (None: the latest). `target` is the state's abstract
        pytree: leaves with shape, dtype and sharding (jax.ShapeDtypeStruct or jax.Array); arrays
        are restored onto those shardings and in those dtypes, each process reading only its
        devices' blocks. Leaves that are `ocp.PLACEHOLDER` are not read (they stay so)."""
        self.wait()
        steps = self.all_steps()
        if step is None and steps:
            step = steps[-1]
        if step is None or step not in steps:
            what = "no checkpoint" if step is None else f"no checkpoint for step {step}"
            raise FileNotFoundError(
                f"{what} in {self.directory}; complete checkpoints there: {steps or 'none'}")
        self.verify(step)
        abstract = jax.tree_util.tree_map_with_path(_abstract_leaf, target)
        if any(leaf is ocp.PLACEHOLDER for leaf in jax.tree.leaves(abstract)):
            # StandardRestore refuses placeholders; PyTreeRestore reads the same files.
            state = ocp.args.PyTreeRestore(
                abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
        else:
            state = ocp.args.StandardRestore(abstract)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=state, meta=ocp.args.JsonRestore()))
        meta = dict(restored.meta)
        meta.pop(CHECKSUMS_KEY, None)
        return restored.state, meta

    def verify(self, step: int) -> None:
        """CheckpointDamagedError (on every process) when checkpoint `step`'s files differ
        from its manifest; a step without one is restored unverified, said on one line. The
        processes split the files to hash."""
        step_dir = Path(self.directory) / str(step)
        error = None
        try:
            if checksums.has_manifest(step_dir):
                share = (jax.process_index(), jax.process_count())
                problems = checksums.mismatches(step_dir, share)
                if problems:
                    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                    error = CheckpointDamagedError(f"{problems[0]}{more}")
            elif dist.is_main():
                # Promised but missing: the run stopped (SIGKILL, a disk turned read-only)
                # between Orbax's commit and the manifest. Such a step is often the last good
                # one, so it is taken, unverified (Orbax still refuses truncated or missing
                # files); setting it aside would lose the newest checkpoint on every such stop.
                promised = CHECKSUMS_KEY in self._manager.restore(step, args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore())).meta
                why = (f"its {checksums.MANIFEST} was not written (the run stopped right after "
                       "saving it)" if promised else "no checksums (written by an older grpo_jax)")
                print(f"checkpoint {step} in {self.directory}: {why}; restored unverified",
                      file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - an unreadable manifest or meta: damaged
            error = CheckpointDamagedError(" ".join(f"{type(e).__name__}: {e}".split())[:300])
        dist.raise_together(error, CheckpointDamagedError)

    def restore_newest(self, target, settings: dict, saved_settings: dict | None,
                       at_most: int | None = None):
        """(step, state, meta) of the newest checkpoint that restores onto `target` (see
        `restore`), or None when none does. One that can't be read (a truncated or missing
        file, garbage metadata, a missing item) is renamed `<step>.corrupt`, kept for a look,
        and skipped with one line on stderr. One whose state has another shape than `target`
        raises CheckpointMismatchError naming the settings (`settings`, this run's
        TrainConfig.to_dict(), against `saved_settings`, the checkpoints' run's) that differ.
        `at_most`: only checkpoints up to that step are tried."""
        for step in reversed([s for s in self.all_steps() if at_most is None or s <= at_most]):
            error = None
            try:
                saved = ocp.StandardCheckpointHandler().metadata(
                    epath.Path(self.directory) / str(step) / "state")
                shapes = _shapes(saved)
            except Exception as e:  # noqa: BLE001 - any unreadable metadata: corrupt
                error = e
            if not dist.any_process(error is not None):
                wanted = _shapes(ocp.tree.serialize_tree(target, keep_empty_nodes=True))
                if shapes != wanted:
                    raise CheckpointMismatchError(_mismatch(
                        step, self.directory, shapes, wanted, settings, saved_settings))
                try:
                    state, meta = self.restore(step, target)
                except CheckpointDamagedError as e:  # its bytes changed since it was written
                    error = e
                except CheckpointError:
                    raise
                except Exception as e:  # noqa: BLE001 - truncated or missing data: corrupt
                    error = e
                if not dist.any_process(error is not None):
                    return step, state, meta
            self._set_aside(step, error)
        return None

    def _set_aside(self, step: int, error: BaseException | None) -> None:
        """Rename step directory `step` to `<step>.corrupt` (process 0), saying why. Another
        run's checkpoints (read_only) are left as they are: CheckpointError."""
        reason = ("unreadable on another process" if error is None else
                  " ".join(f"{type(error).__name__}: {error}".split())[:300])
        if self.read_only:
            raise CheckpointError(f"checkpoint {step} in {self.directory} can't be restored "
                                  f"({reason}); it is another run's and is left as it is: "
                                  "resume from another of its checkpoints")
        path = Path(self.directory) / str(step)
        aside = path.with_name(f"{step}.corrupt")
        k = 1
        while aside.exists():
            k += 1
            aside = path.with_name(f"{step}.corrupt{k}")
        if dist.is_main():
            os.rename(path, aside)
            print(f"checkpoint {step} in {self.directory} can't be restored ({reason}); kept "
                  f"as {aside.name} and skipped (rename it back to retry)", file=sys.stderr)
        dist.any_process(False)  # a barrier: every process re-lists after the rename
        self._manager.reload()

    def delete(self, step: int) -> None:
        """Remove checkpoint `step` (Orbax's delete: every process calls it together)."""
        self._manager.delete(step)

    def wait(self) -> None:
        """Block until pending async saves are committed; CheckpointWriteError if one failed."""
        if self.failed is not None:
            raise self.failed
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._write_error(e) from None
        self._seal()

    def poll(self) -> None:
        """CheckpointWriteError if a background save has failed by now; never blocks."""
        if self.failed is not None or not self._manager.is_saving_in_progress():
            self.wait()

    def close(self) -> None:
        """Wait for pending saves and release Orbax's resources; after a failed write, only
        what can be released (the error was raised already)."""
        reported = self.failed is not None
        try:
            self.wait()
        except CheckpointWriteError:
            if reported:
                return
            raise
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class StopRun(BaseException):
    """A run stopped by signal `signum` (a BaseException, as KeyboardInterrupt: code that catches
    Exception lets it through). train.main exits with 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = int(signum)


class StopSignal:
    """Context manager turning SIGTERM/SIGINT into a flag the train loop polls, so it can save a
    checkpoint and exit cleanly; the original handlers come back on exit. A second signal of the
    same kind gets the original behaviour (a stuck loop can still be interrupted).

    `interrupt`: a signal that arrives inside `interruptible()` (work that changes nothing the
    checkpoint holds, such as generating and scoring) raises StopRun at once instead of waiting
    for the flag to be polled, so a stop never waits for a long generation to end."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT), *, interrupt: bool = False):
        self.signals = tuple(signals)
        self.received: int | None = None
        self._previous = {}
        self.interrupt = interrupt
        self._interruptible = False

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignal must be entered in the main thread (Python delivers "
                               "signals only there)")
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signum
        signal.signal(signum, self._original(signum))
        if self._interruptible:
            self._interruptible = False
            raise StopRun(signum)

    def _original(self, signum):
        # None means a handler installed outside Python; the default is the closest equivalent.
        previous = self._previous[signum]
        return signal.SIG_DFL if previous is None else previous

    def should_stop(self) -> bool:
        return self.received is not None

    @contextlib.contextmanager
    def interruptible(self):
        """A block a signal may abort (with `interrupt`): StopRun at once, also when one
        arrived before the block began."""
        if not self.interrupt:
            yield
            return
        if self.received is not None:
            raise StopRun(self.received)
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def __exit__(self, *exc):
        for s in self._previous:
            signal.signal(s, self._original(s))
        self._previous = {}


class RefCheckpoints:
    """The reference params of a sync_ref_model run: `<directory>/<step>/`, an Orbax checkpoint
    per state checkpoint (sharded, written by every process, restored onto the live
    reference's shardings). Written synchronously before the state's checkpoint of the same
    step, so a committed state checkpoint always finds its reference; a reference a killed run
    wrote for a step whose state never committed is deleted on resume."""

    def __init__(self, directory: Path, save_total_limit: int | None, read_only: bool = False):
        self.ckpt = Checkpointer(directory, save_total_limit=save_total_limit, async_save=False,
                                 read_only=read_only)

    def save(self, step: int, ref_params) -> None:
        self.ckpt.save(step, ref_params, {"step": int(step)})

    def drop_after(self, step: int) -> None:
        """Delete references saved after `step` (the latest state checkpoint; 0: none)."""
        for later in [s for s in self.ckpt.all_steps() if s > step]:
            self.ckpt.delete(later)

    def restore(self, step: int, target, saved: bool):
        """The reference saved with state checkpoint `step` (`saved`: its meta says one was);
        a checkpoint of a run without sync_ref_model keeps `target` (the initial model)."""
        if step not in self.ckpt.all_steps():
            if saved:
                raise CheckpointError(
                    f"checkpoint {step} was saved with its reference model in "
                    f"{self.ckpt.directory}, but that step is missing there: restore it or "
                    "resume from another checkpoint")
            if dist.is_main():
                print(f"checkpoint {step} has no reference model (saved without "
                      "sync_ref_model): the reference starts from the initial model",
                      file=sys.stderr)
            return target
        ref, _ = self.ckpt.restore(step, target)
        return ref

    def close(self) -> None:
        self.ckpt.close()


class BufferFiles:
    """The generation buffer of a checkpoint (micro-batches generated but not yet trained on,
    when steps_per_generation is not a multiple of gradient_accumulation_steps or max_steps
    ended a round early): `<directory>/<step>.npz`, written by process 0 beside Orbax's step
    directories; every process holds the whole host batch, so every process reads it back.
    `what` names the files' content in errors (the rollouts in flight use the same files)."""

    def __init__(self, directory: Path, what: str = "generation buffer"):
        self.directory = Path(directory)
        self.what = what

    def save(self, step: int, buffer) -> None:
        if not buffer:
            return
        self.save_arrays(step, {f"{i}/{name}": np.asarray(value) for i, mb in enumerate(buffer)
                                for name, value in _fields(mb).items()})

    def save_arrays(self, step: int, arrays: dict) -> None:
        if not dist.is_main():
            return
        tmp = self.directory / f"{step}.tmp.npz"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            np.savez(tmp, **arrays)
            tmp.replace(self.directory / f"{step}.npz")
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise CheckpointWriteError(
                f"can't write checkpoint {step}'s {self.what} to {self.directory}: "
                f"{storage.describe(e)}; {last_good(self.directory.parent / 'checkpoints')}"
            ) from None

    def load(self, step: int, count: int) -> list:
        if not count:
            return []
        fields: list[dict] = [{} for _ in range(count)]
        for key, value in self.load_arrays(step, f"{count} generated micro-batches not yet "
                                                 "trained on").items():
            i, name = key.split("/", 1)
            fields[int(i)][name] = value
        return [Batch(**mb) for mb in fields]

    def load_arrays(self, step: int, saved_with: str) -> dict:
        path = self.directory / f"{step}.npz"
        if not path.exists():
            raise CheckpointError(f"checkpoint {step} was saved with {saved_with}, but {path} "
                                  "is missing: restore that file or resume from another "
                                  "checkpoint")
        with np.load(path) as f:
            return {key: f[key] for key in f.files}

    def prune(self, kept_steps) -> None:
        if not dist.is_main() or not self.directory.is_dir():
            return
        kept = {str(s) for s in kept_steps}
        for path in self.directory.glob("*.npz"):
            if path.name.split(".")[0] not in kept:
                path.unlink(missing_ok=True)


def _fields(batch: Batch) -> dict:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
            if getattr(batch, f.name) is not None}


def abstract_state(cfg, device=None):
    """The TrainState's shapes on one device for `cfg` (a TrainConfig): a restore target that
    needs no training setup. Returns (state, graphdef, model config, model dir); with use_peft
    the state's params are the LoRA adapters (graphdef: of the model with adapters)."""
    from grpo_jax import hf, peft_io
    from grpo_jax.models import ModelConfig, build
    from grpo_jax.policy import frozen_parts, split_policy, state_init
    model_dir = hf.resolve_model_dir(peft_io.base_name(cfg))
    model_cfg = ModelConfig.from_hf(hf.read_config(model_dir), numerics=cfg.numerics)
    # The adapters alone are the state with use_peft: the base is left unquantized.
    split = split_policy(build.abstract_model(model_cfg, cfg.peft if cfg.peft.use_peft else None,
                                              quantize=False))
    _, _, init = state_init(cfg.loss, cfg.optim, 1, frozen_parts(split.params))
    state = jax.eval_shape(init, split.params)
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                         state)
    return state, split.graphdef, model_cfg, model_dir


def quiet_closed_loop_reports():
    """When a checkpoint write or read fails midway (disk full, read-only, a damaged file),
    tensorstore's operations still in flight complete after Orbax closed the failed operation's
    event loop, and tensorstore reports each with PyErr_Print, i.e. sys.excepthook: a 3-line
    'RuntimeError: Event loop is closed' traceback each. From now on those are dropped (the
    program reports the failure in one line); every other exception is printed as before.
    Returns the hook it replaced."""
    import traceback
    previous = sys.excepthook

    def hook(kind, value, tb):
        frames = traceback.extract_tb(tb)
        if not (kind is RuntimeError and str(value) == "Event loop is closed" and frames and all(
                f"{os.sep}asyncio{os.sep}" in f.filename for f in frames)):
            previous(kind, value, tb)
    sys.excepthook = hook
    return previous


@contextlib.contextmanager
def _quiet_restore():
    """While load_checkpoint reads a checkpoint, what Orbax, absl and TensorStore print is
    dropped: their logging, warnings and native logs (fd 2 itself, where native code writes).
    A damaged checkpoint is one line, load_checkpoint's CheckpointError. Reads still in flight
    when one failed report 'Event loop is closed' when they complete, also after this: those
    are dropped by a hook set before the read (one set later could catch a report half
    printed), kept after a failure."""
    import warnings
    disabled = logging.root.manager.disable
    previous = quiet_closed_loop_reports()
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            with contextlib.redirect_stderr(devnull), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                logging.disable(logging.CRITICAL)
                yield
            sys.excepthook = previous
        finally:
            logging.disable(disabled)
            os.dup2(saved, 2)
            os.close(saved)


def _damaged(ckpt: Checkpointer, step: int, reason: str) -> str:
    others = [s for s in ckpt.all_steps() if s != step]
    return (f"checkpoint {step} in {ckpt.directory} can't be read, it is damaged ("
            + " ".join(reason.split())[:300] + "); "
            + (f"export another with --step (complete ones: {others})" if others
               else "no other checkpoint to export"))


def load_checkpoint(output_dir, step: int | None = None):
    """(model with the checkpoint's params, source model dir, step) from a run's output_dir.
    Only the params are read (not the optimizer state), each device's block onto an FSDP mesh
    over this process's devices: no device, nor the host, holds a whole copy. A LoRA run's
    model is its base (read from the base's files) with the checkpoint's adapters."""
    from pathlib import Path

    from flax import nnx

    from grpo_jax import mesh as mesh_lib
    from grpo_jax.cli import load_config
    cfg_path = Path(output_dir) / "config.yaml"
    if not cfg_path.exists():
        raise CheckpointError(f"{output_dir} has no config.yaml: not a grpo_jax output_dir")
    cfg = load_config(str(cfg_path))
    target, graphdef, _, model_dir = abstract_state(cfg)
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=-1), jax.local_devices())
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          target.params, mesh_lib.param_shardings(target.params, mesh))
    target = target._replace(params=params, opt_state=jax.tree.map(
        lambda _: ocp.PLACEHOLDER, target.opt_state))
    with _quiet_restore():
        ckpt = Checkpointer(Path(output_dir) / "checkpoints", save_total_limit=None)
        try:
            step = ckpt.latest_step() if step is None else step
            if step is None:
                raise CheckpointError(f"no checkpoint in {ckpt.directory}: train first, or pass "
                                      "the output_dir of a run that saved one")
            state, _ = ckpt.restore(step, target)
        except FileNotFoundError as e:
            raise CheckpointError(str(e)) from None
        except CheckpointDamagedError as e:  # its files differ from their checksums
            raise CheckpointError(_damaged(ckpt, step, str(e))) from None
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - truncated or missing files, garbage metadata
            # TensorStore's messages end in a pointer to details not printed: left out
            why = f"{type(e).__name__}: {e}".split(" See full TensorStore details")[0]
            raise CheckpointError(_damaged(ckpt, step, why)) from None
        finally:
            ckpt.close()
    if cfg.peft.use_peft:
        from grpo_jax import peft_io
        model, model_dir = peft_io.load_model(cfg, mesh)
        nnx.update(model, state.params)
        return model, model_dir, step
    return nnx.merge(graphdef, state.params), model_dir, step
