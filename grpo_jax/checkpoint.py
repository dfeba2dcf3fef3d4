"""Checkpoints of the training state with exact resume, on Orbax's CheckpointManager.

One checkpoint is a step directory `<directory>/<step>/` with two items: `state` (a pytree of
arrays: params, optimizer state, RNG keys, counters; written per shard with tensorstore) and
`meta` (a JSON dict: data position, config snapshot, metrics).

Safety comes from Orbax: a step is written into `<step>.orbax-checkpoint-tmp` and renamed only
when complete, so a process killed mid-save leaves the previous steps intact and the partial
directory is neither listed nor restored (it is deleted when the next Checkpointer opens the
directory). Old steps beyond `save_total_limit` are deleted only after the new one is committed.

Restore writes straight into the target's shardings, so a checkpoint written on one mesh loads
onto another (or onto one device) without gathering the full state on a host.

Typed PRNG keys (`jax.random.key`) are stored as their raw `jax.random.key_data` (plain uint32
arrays) and rewrapped with the target's key implementation on restore, so the format does not
depend on Orbax's typed-key handling, which is recent and has changed between versions.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import jax
import orbax.checkpoint as ocp


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def pack_rng(tree):
    """Typed PRNG keys in `tree` replaced by their uint32 key data (other leaves unchanged)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _key_impl(abstract_key):
    # jax.random.key_impl rejects ShapeDtypeStruct but accepts a tracer of the same type.
    found = []
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), abstract_key)
    return found[0]


def unpack_rng(tree, like):
    """Inverse of `pack_rng`: leaves where `like` (same structure) holds a typed key are rewrapped
    with that key's implementation."""
    return jax.tree.map(
        lambda x, t: jax.random.wrap_key_data(x, impl=_key_impl(t)) if _is_key(t) else x,
        tree, like)


def _abstract_leaf(path, leaf):
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        raise ValueError(
            f"restore target leaf {jax.tree_util.keystr(path)} has no sharding; build the target "
            "from jax.ShapeDtypeStruct(shape, dtype, sharding=...) leaves (e.g. jax.eval_shape "
            "of the init function plus the shardings the state should live on)")
    if _is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        # Shardings name leading axes only, so the key's sharding also fits its key data
        # (the trailing key-data axis stays replicated).
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


class Checkpointer:
    """Numbered checkpoints of (state, meta) in `directory`.

    save_total_limit: keep only the newest N steps (None keeps all), as in TRL.
    save_steps: `save` writes only on multiples of this (force=True writes anyway).
    async_save: `save` returns once the arrays are copied off the accelerator; files are written
      in the background. The state's buffers may then be donated or deleted. Call `wait()` to
      block until the write is committed; the next `save`, `restore` and `close` wait too.
    """

    def __init__(self, directory, *, save_total_limit: int | None, save_steps: int = 1,
                 async_save: bool = True):
        if save_total_limit is not None and save_total_limit < 1:
            raise ValueError(f"save_total_limit must be None (keep all) or >= 1, "
                             f"got {save_total_limit}")
        if save_steps < 1:
            raise ValueError(f"save_steps must be >= 1, got {save_steps}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.save_steps = save_steps
        options = ocp.CheckpointManagerOptions(
            max_to_keep=save_total_limit,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # partial saves of a killed run
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def all_steps(self) -> list[int]:
        """Steps of complete checkpoints (plus one being written by this process), ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
        """Write `state` and `meta` as checkpoint `step`. Returns whether a save was started:
        False when `step` is not a multiple of save_steps (and not forced) or is already saved,
        so a final forced save right after a periodic one is harmless."""
        step = int(step)
        if not force and step % self.save_steps:
            return False
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
        args = ocp.args.Composite(state=ocp.args.StandardSave(pack_rng(state)),
                                  meta=ocp.args.JsonSave(meta))
        return self._manager.save(step, args=args, force=True)

    def restore(self, step: int | None, target):
        """(state, meta) of checkpoint `step` (None: the latest). `target` is the state's abstract
        pytree: leaves with shape, dtype and sharding (jax.ShapeDtypeStruct or jax.Array); arrays
        are restored onto those shardings and in those dtypes."""
        self._manager.wait_until_finished()
        steps = self.all_steps()
        if step is None and steps:
            step = steps[-1]
        if step is None or step not in steps:
            what = "no checkpoint" if step is None else f"no checkpoint for step {step}"
            raise FileNotFoundError(
                f"{what} in {self.directory}; complete checkpoints there: {steps or 'none'}")
        abstract = jax.tree_util.tree_map_with_path(_abstract_leaf, target)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return unpack_rng(restored.state, target), restored.meta

    def wait(self) -> None:
        """Block until pending async saves are committed; raises if one failed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class StopSignal:
    """Context manager turning SIGTERM/SIGINT into a flag the train loop polls, so it can save a
    checkpoint and exit cleanly; the original handlers come back on exit. A second signal of the
    same kind gets the original behaviour (a stuck loop can still be interrupted)."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.received: int | None = None
        self._previous = {}

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

    def _original(self, signum):
        # None means a handler installed outside Python; the default is the closest equivalent.
        previous = self._previous[signum]
        return signal.SIG_DFL if previous is None else previous

    def should_stop(self) -> bool:
        return self.received is not None

    def __exit__(self, *exc):
        for s in self._previous:
            signal.signal(s, self._original(s))
        self._previous = {}
