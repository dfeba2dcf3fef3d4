"""The device mesh and the one rule table that maps logical axes to mesh axes.

Mesh axes: `data` (pure data parallel: params replicated), `fsdp` (data parallel with params,
grads and optimizer state sharded over it) and `tensor` (Megatron-style: heads and MLP columns
split). The batch is split over (`data`, `fsdp`). Two optional axes sit between fsdp and
tensor, in this order, only when their size is not 1:
- `expert` (ep, a mixture of experts): its experts are split over it (models/moe.py), and
  outside the experts it is one more data-parallel axis of the batch;
- `context` (cp, long sequences): a row's tokens are split over it by position (context
  parallelism, models/attention.py), and the parameters are split over it as over fsdp, since
  its devices hold the same rows.
A mesh without them is the 3-axis mesh: rules naming an axis the mesh lacks skip it.
"""

from __future__ import annotations

import math

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from grpo_jax.errors import ConfigError, check
from grpo_jax.config.run import (AXES, CONTEXT, EXPERT, FIELD_AXES,  # noqa: F401 (API)
                                 MeshConfig)


# logical axis -> mesh axis or axes (None: replicated). A dimension that the mesh axes do not
# divide stays replicated, so one table serves every model size.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp", "expert"),  # rows: completions, sampler rows, KV-cache rows
    "expert": "expert",    # a mixture of experts' expert dimension
    # Positions of a row: its tokens, hidden states and queries in the update and log-prob
    # passes, and the sampler's KV-cache slots when one row's cache is too big for a device.
    "length": CONTEXT,
    "vocab": "tensor",     # embedding rows / LM-head columns
    # The model dimension of every matrix: FSDP, also over the context axis (whose devices
    # hold the same rows: parameters replicated over it would only repeat them).
    "embed": ("fsdp", CONTEXT),
    "heads": "tensor",     # query heads
    "kv_heads": "tensor",  # key/value heads (replicated when fewer than `tensor`)
    "mlp": "tensor",       # SwiGLU hidden
    "head_dim": None,
    "layers": None,        # the scan axis
    "norm": None,          # norm scales: tiny, replicated
    # LoRA adapters without a model dimension (B of q/k/v/gate/up, A of o/down): FSDP over
    # their weight-side dims instead, so no adapter (nor its AdamW state) is whole on a chip.
    "lora_heads": ("tensor", "fsdp"),
    "lora_mlp": ("tensor", "fsdp"),
    "lora_head_dim": "fsdp",
}


def config_for(sizes: dict[str, int]) -> MeshConfig:
    """The MeshConfig of mesh axis sizes {axis name: size} (axes left out: 1)."""
    return MeshConfig(**{f: sizes.get(axis, 1) for f, axis in FIELD_AXES.items()})


def flags(cfg: MeshConfig) -> list[str]:
    """The command-line flags that set `cfg`'s sizes (`--dp 1 --fsdp 16 --tp 1`; `--ep` and
    `--cp` only when not 1)."""
    return [x for f, s in zip(FIELD_AXES, cfg.sizes()) if f not in ("ep", "cp") or s != 1
            for x in (f"--{f}", str(s))]


def default_config(replicated_bytes: float, device_bytes: float | None,
                   share: float = 0.5) -> tuple[MeshConfig, str]:
    """The mesh of a run that gives none, from a cheap estimate: pure data parallelism (params
    replicated, today's default) while the replicated training state takes at most `share` of
    a device's memory (or the memory is unknown, as on the CPU), else FSDP over every device
    (MaxText's default): params, gradients and optimizer state split over all of them. Returns
    it and the reason, to be said."""
    if device_bytes is None:
        return MeshConfig(dp=-1), "data parallel over every device (their memory is not known)"
    need = f"{replicated_bytes / 1e9:.1f} GB of training state per device replicated"
    if replicated_bytes <= share * device_bytes:
        return MeshConfig(dp=-1), (f"data parallel over every device ({need} of "
                                   f"{device_bytes / 1e9:.0f} GB)")
    return MeshConfig(dp=1, fsdp=-1), (f"FSDP over every device ({need} would take over "
                                       f"{share:.0%} of {device_bytes / 1e9:.0f} GB)")


# Tokens of one row a device holds before a run that gives no mesh splits rows over a context
# axis: at 8k a row's activations stay a fraction of a v5e's 16 GB (docs/scaling.md's long rows).
CONTEXT_TOKENS = 8192


def context_splits(completion_length: int, cp: int) -> bool:
    """Whether a context axis of `cp` devices can hold rows with this completion length: a
    power of 2 whose zig-zag order (attention.zigzag_order) cuts the completion into 2 x cp
    equal chunks."""
    return cp >= 1 and cp & (cp - 1) == 0 and completion_length % (2 * cp) == 0


def long_row_config(prompt_length: int, completion_length: int, chips: int,
                    slices: int = 1) -> tuple[MeshConfig, str] | None:
    """The mesh of a run with rows longer than CONTEXT_TOKENS that gives none: data parallel
    across slices only (the gradient all-reduce over DCN), FSDP over each slice's chips, and a
    context axis: the fewest devices (a power of 2 dividing the completion length and the
    slice) that bring a row's tokens per device to CONTEXT_TOKENS or fewer. Returns it and the
    reason, to be said; None for short rows (or when no such split exists)."""
    tokens = prompt_length + completion_length
    per_slice, cp = chips // slices, 1
    while (tokens > cp * CONTEXT_TOKENS and per_slice % (2 * cp) == 0
           and context_splits(completion_length, 2 * cp)):
        cp *= 2
    if cp == 1:
        return None
    return MeshConfig(dp=slices, fsdp=per_slice // cp, tp=1, cp=cp), (
        f"rows of {tokens} tokens: a context axis of {cp} brings a row to <= {CONTEXT_TOKENS} "
        "tokens per chip; FSDP over the rest of each slice, data parallel across slices")


def make_mesh(cfg: MeshConfig = MeshConfig(), devices=None) -> Mesh:
    """jax.make_mesh orders the devices by the physical topology (ICI neighbours on TPU).
    Devices of several TPU slices: the `data` axis spans the slices (DCN), so only the gradient
    all-reduce crosses them; fsdp and tensor stay within a slice. Auto axis types: jax's
    default, Explicit, rejects sharded contractions in the model. A mesh that cannot be laid
    over a TPU torus (an axis that is no product of its dimensions) is a ConfigError naming
    the torus and the nearest meshes that can."""
    devices = list(jax.devices() if devices is None else devices)
    shape, axes = cfg.shape(len(devices)), cfg.axes
    try:
        return _lay(shape, axes, devices)
    except NotImplementedError:  # jax: "Failed to find assignment for logical_axis_index ..."
        pass
    near = [" ".join(flags(c)) for c in _nearest(shape, axes, devices)]
    raise ConfigError(
        f"mesh {dict(zip(axes, shape))} can't be laid over {_torus(devices)}: every mesh axis "
        "must span whole torus dimensions (its size a product of some of them)"
        + (f"; the nearest that can: {', or '.join(near)}" if near else ""))


def can_lay(cfg: MeshConfig, devices) -> bool:
    """Whether make_mesh lays `cfg` over `devices` (without the error's search for the nearest
    meshes that can: the layout search asks this of every candidate)."""
    devices = list(devices)
    try:
        _lay(cfg.shape(len(devices)), cfg.axes, devices)
    # ConfigError is a ValueError too; jax asserts that TPU chips fill a box of the torus
    except (NotImplementedError, ValueError, AssertionError):
        return False
    return True


def slice_count(devices) -> int:
    """How many TPU slices (joined over DCN) `devices` span; 1 for GPUs and CPUs, whose
    devices have no slice_index."""
    return len({getattr(d, "slice_index", 0) for d in devices})


def _lay(shape: tuple[int, ...], axes: tuple[str, ...], devices: list) -> Mesh:
    auto = (jax.sharding.AxisType.Auto,) * len(axes)
    slices = slice_count(devices)
    if slices == 1:
        return jax.make_mesh(shape, axes, axis_types=auto, devices=devices)
    check(shape[0] % slices == 0, f"{slices} slices: the data axis (dp={shape[0]}) must be a "
          "multiple of the slice count: only data parallelism crosses slices")
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_hybrid_device_mesh((shape[0] // slices, *shape[1:]),
                                                (slices, *[1] * (len(shape) - 1)), devices)
    return Mesh(grid, axes, axis_types=auto)


def _torus(devices: list) -> str:
    """`16 TPU v6 lite chips (a 4x4 torus)`; a torus per slice where there are several."""
    first = getattr(devices[0], "slice_index", 0)
    one = [d for d in devices if getattr(d, "slice_index", 0) == first]
    coords = [getattr(d, "coords", None) for d in one]
    dims = ([max(c[i] for c in coords) + 1 for i in range(len(coords[0]))] if all(coords)
            else [len(one)])
    while len(dims) > 2 and dims[-1] == 1:  # a 2-D torus's coords are (x, y, 0)
        dims.pop()
    shape, slices = "x".join(map(str, dims)), slice_count(devices)
    where = f"a {shape} torus" if slices == 1 else f"{slices} slices, each a {shape} torus"
    return f"{len(devices)} {devices[0].device_kind} chips ({where})"


def _nearest(shape: tuple[int, ...], axes: tuple[str, ...], devices: list,
             most: int = 2) -> list[MeshConfig]:
    """The meshes over the same axes that can be laid over `devices`, nearest to `shape`
    (the fewest doublings and halvings of its sizes, spread over the axes), at most `most`."""
    def factorizations(n: int, k: int):
        if k == 1:
            yield (n,)
            return
        for d in (d for d in range(1, n + 1) if n % d == 0):
            for rest in factorizations(n // d, k - 1):
                yield (d, *rest)

    scored = []
    for sizes in factorizations(len(devices), len(axes)):
        steps = [abs(math.log2(s / w)) for s, w in zip(sizes, shape)]
        scored.append((sum(steps), max(steps), sizes))
    out = []
    for *_, sizes in sorted(scored):
        cfg = config_for(dict(zip(axes, sizes)))
        if cfg.axes == axes and can_lay(cfg, devices):
            out.append(cfg)
            if len(out) == most:
                break
    return out


def _size(mesh: Mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def _present(mesh: Mesh, axes):
    """A rule's mesh axes that `mesh` has (a dense model's mesh has no `expert` axis, a short
    run's no `context` axis)."""
    flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
    kept = tuple(a for a in flat if a in mesh.axis_names)
    if isinstance(axes, str) or len(kept) == len(flat):
        return axes if kept else None
    return kept[0] if len(kept) == 1 else kept or None


def context_size(mesh: Mesh | None) -> int:
    """Devices a row's positions are split over (1: no context axis)."""
    return 1 if mesh is None or CONTEXT not in mesh.axis_names else mesh.shape[CONTEXT]


def spec_for(names: tuple[str | None, ...], shape: tuple[int, ...] | None, mesh: Mesh) -> P:
    """The PartitionSpec of logical axis `names` (None: replicated) by the rule table; a mesh
    axis is used once, and only where it divides the dimension (when `shape` is given)."""
    used: set[str] = set()
    out = []
    for i, name in enumerate(names):
        axes = _present(mesh, RULES.get(name)) if name else None
        flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
        if (not flat or used & set(flat)
                or (shape is not None and shape[i] % _size(mesh, flat))):
            out.append(None)
        else:
            used.update(flat)
            out.append(axes)
    return P(*out)


def logical_sharding(mesh: Mesh, *names: str | None, shape=None) -> NamedSharding:
    """e.g. logical_sharding(mesh, "batch", None): rows split over the data axes."""
    return NamedSharding(mesh, spec_for(names, shape, mesh))


def param_shardings(params: nnx.State, mesh: Mesh) -> nnx.State:
    """The NamedSharding of every parameter, from its logical `axes` metadata."""
    def one(v):
        return v.replace(NamedSharding(mesh, spec_for(v.axes, v.shape, mesh)))
    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading axis over the batch axes, the rest replicated."""
    return logical_sharding(mesh, "batch", *[None] * (ndim - 1))


def batch_divisor(mesh: Mesh) -> int:
    return _size(mesh, _present(mesh, RULES["batch"]) or ())
