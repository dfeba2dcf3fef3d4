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

`load_checkpoint` restores a run's params from its output_dir alone (for export).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from grpo_jax import distributed as dist
from grpo_jax.errors import GrpoJaxError
from grpo_jax.grpo.batch import Batch


class CheckpointError(GrpoJaxError):
    """No usable checkpoint where one was asked for."""


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
    async_save: `save` returns once the arrays are copied off the accelerator; files are written
      in the background. The state's buffers may then be donated or deleted. Call `wait()` to
      block until the write is committed; the next `save`, `restore` and `close` wait too.
    """

    def __init__(self, directory, *, save_total_limit: int | None, async_save: bool = True):
        if save_total_limit is not None and save_total_limit < 1:
            raise ValueError(f"save_total_limit must be None (keep all) or >= 1, "
                             f"got {save_total_limit}")
        self.directory = os.path.abspath(os.fspath(directory))
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
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(meta))
        return self._manager.save(step, args=args, force=True)

    def restore(self, step: int | None, target):
        """(state, meta) of checkpoint `step` (None: the latest). `target` is the state's abstract
        pytree: leaves with shape, dtype and sharding (jax.ShapeDtypeStruct or jax.Array); arrays
        are restored onto those shardings and in those dtypes, each process reading only its
        devices' blocks. Leaves that are `ocp.PLACEHOLDER` are not read (they stay so)."""
        self._manager.wait_until_finished()
        steps = self.all_steps()
        if step is None and steps:
            step = steps[-1]
        if step is None or step not in steps:
            what = "no checkpoint" if step is None else f"no checkpoint for step {step}"
            raise FileNotFoundError(
                f"{what} in {self.directory}; complete checkpoints there: {steps or 'none'}")
        abstract = jax.tree_util.tree_map_with_path(_abstract_leaf, target)
        if any(leaf is ocp.PLACEHOLDER for leaf in jax.tree.leaves(abstract)):
            # StandardRestore refuses placeholders; PyTreeRestore reads the same files.
            state = ocp.args.PyTreeRestore(
                abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
        else:
            state = ocp.args.StandardRestore(abstract)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=state, meta=ocp.args.JsonRestore()))
        return restored.state, restored.meta

    def delete(self, step: int) -> None:
        """Remove checkpoint `step` (Orbax's delete: every process calls it together)."""
        self._manager.delete(step)

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


class RefCheckpoints:
    """The reference params of a sync_ref_model run: `<directory>/<step>/`, an Orbax checkpoint
    per state checkpoint (sharded, written by every process, restored onto the live
    reference's shardings). Written synchronously before the state's checkpoint of the same
    step, so a committed state checkpoint always finds its reference; a reference a killed run
    wrote for a step whose state never committed is deleted on resume."""

    def __init__(self, directory: Path, save_total_limit: int | None):
        self.ckpt = Checkpointer(directory, save_total_limit=save_total_limit, async_save=False)

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
    directories; every process holds the whole host batch, so every process reads it back."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def save(self, step: int, buffer) -> None:
        if not buffer or not dist.is_main():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        arrays = {f"{i}/{name}": np.asarray(value) for i, mb in enumerate(buffer)
                  for name, value in _fields(mb).items()}
        tmp = self.directory / f"{step}.tmp.npz"
        np.savez(tmp, **arrays)
        tmp.replace(self.directory / f"{step}.npz")

    def load(self, step: int, count: int) -> list:
        if not count:
            return []
        path = self.directory / f"{step}.npz"
        if not path.exists():
            raise CheckpointError(f"checkpoint {step} was saved with {count} generated "
                                  f"micro-batches not yet trained on, but {path} is missing: "
                                  "restore that file or resume from another checkpoint")
        with np.load(path) as f:
            fields: list[dict] = [{} for _ in range(count)]
            for key in f.files:
                i, name = key.split("/", 1)
                fields[int(i)][name] = f[key]
        return [Batch(**mb) for mb in fields]

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
    from flax import nnx

    from grpo_jax import hf, peft_io
    from grpo_jax.grpo.optimizer import make_optimizer
    from grpo_jax.grpo.train_step import init_train_state
    from grpo_jax.models import Decoder, ModelConfig, lora
    model_dir = hf.resolve_model_dir(peft_io.base_name(cfg))
    model_cfg = ModelConfig.from_hf(hf.read_config(model_dir), numerics=cfg.numerics)

    def build():
        model = Decoder(model_cfg, rngs=nnx.Rngs(0))
        if cfg.peft.use_peft:
            lora.add_adapters(model, cfg.peft, jax.random.key(0))
        return model
    if cfg.peft.use_peft:
        graphdef, params, _ = nnx.split(nnx.eval_shape(build), lora.LoraParam, nnx.Param)
    else:
        graphdef, params = nnx.split(nnx.eval_shape(build), nnx.Param)
    tx, _ = make_optimizer(cfg.optim, 1)
    state = jax.eval_shape(lambda p: init_train_state(p, tx.init(p), cfg.loss), params)
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                         state)
    return state, graphdef, model_cfg, model_dir


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
    ckpt = Checkpointer(Path(output_dir) / "checkpoints", save_total_limit=None)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {ckpt.directory}: train first, or pass the "
                                  "output_dir of a run that saved one")
        state, _ = ckpt.restore(step, target)
    except FileNotFoundError as e:
        raise CheckpointError(str(e)) from None
    finally:
        ckpt.close()
    if cfg.peft.use_peft:
        from grpo_jax import peft_io
        model, model_dir = peft_io.load_model(cfg, mesh)
        nnx.update(model, state.params)
        return model, model_dir, step
    return nnx.merge(graphdef, state.params), model_dir, step
