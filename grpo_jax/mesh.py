"""The device mesh and the one rule table that maps logical axes to mesh axes.

Mesh axes: `data` (pure data parallel: params replicated), `fsdp` (data parallel with params,
grads and optimizer state sharded over it) and `tensor` (Megatron-style: heads and MLP columns
split). The batch is split over (`data`, `fsdp`). A mixture of experts may add `expert` (ep > 1;
between fsdp and tensor): its experts are split over it (models/moe.py), and outside the experts
it is one more data-parallel axis of the batch. A mesh without it (ep = 1) is the 3-axis mesh of
a dense model: rules naming an axis the mesh lacks skip it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from grpo_jax.errors import check

AXES = ("data", "fsdp", "tensor")
EXPERT = "expert"  # only in meshes with ep > 1, between fsdp and tensor

# logical axis -> mesh axis or axes (None: replicated). A dimension that the mesh axes do not
# divide stays replicated, so one table serves every model size.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp", "expert"),  # rows: completions, sampler rows, KV-cache rows
    "expert": "expert",    # a mixture of experts' expert dimension
    "vocab": "tensor",     # embedding rows / LM-head columns
    "embed": "fsdp",       # the model dimension of every matrix: FSDP
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


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes (data, fsdp, tensor, and expert for a mixture of experts), the
    config's `mesh` section; one may be -1 (= all remaining devices)."""

    dp: int = -1
    fsdp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallelism: a mixture of experts' experts split over ep devices

    def __post_init__(self):
        sizes = dataclasses.astuple(self)
        check(all(s == -1 or s >= 1 for s in sizes) and sizes.count(-1) <= 1,
              f"mesh sizes (dp, fsdp, tp, ep) = {sizes}: each must be >= 1, and at most one -1")

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's axis names: `expert` only when ep is not 1."""
        return AXES if self.ep == 1 else (*AXES[:2], EXPERT, AXES[2])

    def shape(self, num_devices: int) -> tuple[int, ...]:
        """Axis sizes for `num_devices` devices (in `axes` order), the -1 axis taking what is
        left."""
        sizes = [self.dp, self.fsdp, self.tp] if self.ep == 1 else [self.dp, self.fsdp,
                                                                     self.ep, self.tp]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            check(num_devices % known == 0, f"mesh {dict(zip(self.axes, sizes))}: {num_devices} "
                  f"devices are not divisible by the fixed axes' product {known}")
            sizes[sizes.index(-1)] = num_devices // known
        check(math.prod(sizes) == num_devices, f"mesh {dict(zip(self.axes, sizes))} needs "
              f"{math.prod(sizes)} devices but {num_devices} are in use; set one size to -1")
        return tuple(sizes)


def make_mesh(cfg: MeshConfig = MeshConfig(), devices=None) -> Mesh:
    """jax.make_mesh orders the devices by the physical topology (ICI neighbours on TPU).
    Devices of several TPU slices: the `data` axis spans the slices (DCN), so only the gradient
    all-reduce crosses them; fsdp and tensor stay within a slice. Auto axis types: jax's
    default, Explicit, rejects sharded contractions in the model."""
    devices = list(jax.devices() if devices is None else devices)
    shape, axes = cfg.shape(len(devices)), cfg.axes
    auto = (jax.sharding.AxisType.Auto,) * len(axes)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices == 1:
        return jax.make_mesh(shape, axes, axis_types=auto, devices=devices)
    check(shape[0] % slices == 0, f"{slices} slices: the data axis (dp={shape[0]}) must be a "
          "multiple of the slice count: only data parallelism crosses slices")
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_hybrid_device_mesh((shape[0] // slices, *shape[1:]),
                                                (slices, *[1] * (len(shape) - 1)), devices)
    return Mesh(grid, axes, axis_types=auto)


def _size(mesh: Mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def _present(mesh: Mesh, axes):
    """A rule's mesh axes that `mesh` has (a dense model's mesh has no `expert` axis)."""
    flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
    kept = tuple(a for a in flat if a in mesh.axis_names)
    if isinstance(axes, str) or len(kept) == len(flat):
        return axes if kept else None
    return kept[0] if len(kept) == 1 else kept or None


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
