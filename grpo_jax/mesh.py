"""The device mesh and the one rule table that maps logical axes to mesh axes.

Mesh axes: `data` (pure data parallel: params replicated), `fsdp` (data parallel with params,
grads and optimizer state sharded over it) and `tensor` (Megatron-style: heads and MLP columns
split). The batch is split over (`data`, `fsdp`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")

# logical axis -> mesh axis (None: replicated). A dimension that the mesh axis does not divide
# stays replicated, so one table serves every model size.
RULES: dict[str, str | None] = {
    "vocab": "tensor",     # embedding rows / LM-head columns
    "embed": "fsdp",       # the model dimension of every matrix: FSDP
    "heads": "tensor",     # query heads
    "kv_heads": "tensor",  # key/value heads (replicated when fewer than `tensor`)
    "mlp": "tensor",       # SwiGLU hidden
    "head_dim": None,
    "layers": None,        # the scan axis
    "norm": None,          # norm scales: tiny, replicated
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = -1  # -1: every device not used by the other axes
    tensor: int = 1


def make_mesh(cfg: MeshConfig = MeshConfig(), devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh {sizes}: at most one axis may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh {dict(zip(AXES, sizes))}: {len(devices)} devices are not "
                             f"divisible by {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh {dict(zip(AXES, sizes))} needs {int(np.prod(sizes))} devices, "
                         f"found {len(devices)}; set mesh sizes whose product is {len(devices)}")
    # Auto axis types: jax.make_mesh defaults to Explicit, which rejects sharded contractions.
    return Mesh(np.asarray(devices).reshape(sizes), AXES)


def spec_for(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    used: set[str] = set()
    out = []
    for name, dim in zip(axes, shape):
        mesh_axis = RULES.get(name)
        if mesh_axis is None or mesh_axis in used or dim % mesh.shape[mesh_axis]:
            out.append(None)
        else:
            used.add(mesh_axis)
            out.append(mesh_axis)
    return P(*out)


def param_shardings(params: nnx.State, mesh: Mesh) -> nnx.State:
    """The NamedSharding of every parameter, from its logical `axes` metadata."""
    def one(v):
        return v.replace(NamedSharding(mesh, spec_for(v.axes, v.shape, mesh)))
    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def like_params(tree, params: nnx.State, shardings: nnx.State, mesh: Mesh):
    """Shardings for a tree that mirrors the params (optimizer moments): leaves whose path ends
    with a parameter's path and whose shape matches get that parameter's sharding; the rest
    (counters, scalars) are replicated."""
    by_path = {}
    for (path, leaf), s in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                               jax.tree.leaves(shardings)):
        by_path[path] = (leaf.shape, s)
    replicated = NamedSharding(mesh, P())

    def one(path, leaf):
        for start in range(len(path)):
            hit = by_path.get(tuple(path[start:]))
            if hit and hit[0] == getattr(leaf, "shape", None):
                return hit[1]
        return replicated
    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    spec = [None] * ndim
    spec[batch_axis] = BATCH
    return NamedSharding(mesh, P(*spec))


def batch_divisor(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]
