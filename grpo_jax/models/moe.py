"""Mixture-of-experts MLP layers (Qwen3-MoE, Mixtral, gpt-oss): routing as transformers does it,
the experts as grouped matmuls, expert parallelism over the mesh's `expert` axis.

Routing, in fp32: softmax over all experts then the top k, renormalised to sum 1 with
norm_topk_prob (Qwen3-MoE both ways, Mixtral always). gpt-oss's router takes the top k logits
and a softmax over those: the same weights (exp(l_i) / sum over the k chosen either way). The
router's logits are the statistics transformers' load-balancing loss is computed from
(RouterStats, aux_loss).

Dropless by default: each token's k assignments are sorted by expert and every projection runs
as one grouped matmul over the sorted rows: megablox's gmm (Pallas) on TPU, `jax.lax.ragged_dot`
elsewhere (a masked dense matmul in XLA, on CPU and on GPU: every row times every expert, E times
the memory and work of the routed rows; fine for tests, too big for a GPU's training rows, see
docs/benchmarks.md, 2026-11-26), jax's Mosaic GPU kernels on Hopper and later GPUs
(models/gmm.py). Why not
ragged_dot on TPU too: its gradient w.r.t. the experts' weights is a contraction over every row
for every expert, which XLA's TPU cost analysis counts at E times the work (measured: a 4096 x
1024 @ 8 x 1024 x 2048 grad, 155 GFLOP where 34 are needed); megablox's tgmm visits each
expert's own rows. `moe_capacity_factor` instead gives each expert a fixed buffer and drops
what overflows it (GShard).

Routing replay (R3, arXiv 2510.11370; verl's router_replay mode R3): the trainer's forward can
take each token's experts as the sampler recorded them (`forced` [N, k], -1 where nothing was
recorded: the token routes itself). The gate weights are then recomputed from the trainer's own
router logits at the replayed experts (softmax over all experts gathered there, renormalised
with norm_topk_prob: for gpt-oss the softmax over the k replayed logits), so the router still
learns: its gradient flows through the replayed experts' gate weights only. The selection
itself is not differentiable either way (top-k has no gradient), with or without replay.
With `moe_capacity_factor`, a replayed forward ignores the capacity buffers (dropless): a
replayed token is never dropped (and the sampler of a run with replay runs dropless too, so
that what it records is what it ran).

Expert parallelism: with an `expert` mesh axis of size ep > 1 the experts' weights are split
over it (mesh.RULES "expert"). On any mesh the experts run inside `shard_map` (megablox's gmm
is a Mosaic kernel, which XLA cannot partition itself: outside shard_map a multi-device mesh
fails to compile on TPU, with or without an expert axis). The tokens stay on their batch axes
(and, for long rows, the context axis: a row's positions), the experts' weights arrive as the
rules split them over `expert` and `tensor` (gathered over fsdp, as any FSDP layer's). With
ep > 1 the tokens are all-gathered over `expert`, every shard runs its E/ep experts on the
assignments routed to them, and the partial outputs are reduce-scattered back to the tokens'
own shard. Each device sends and receives 2 (ep - 1) n D values per layer (n: its tokens),
where a ragged all-to-all dispatch and return moves 2 k (ep - 1) / ep n D: the same bytes
when ep = k (Qwen3-MoE: k = 8, ep <= 8), ep / k times more beyond. Chosen because its shapes
are static (no worst-case receive buffers sized for every token picking one shard) and it
runs on every backend (XLA:CPU has no ragged-all-to-all, so the CPU suite tests this path).
Gathering the experts' weights instead (FSDP over `expert`) moves 3 E D F values per layer
whatever the batch: more than moving the tokens below about 3 E F / k tokens per device
(Qwen3-30B-A3B: 37k), i.e. always at RL batch sizes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from grpo_jax import mesh as mesh_lib
from grpo_jax.models import gmm as gmm_lib
from grpo_jax.errors import GrpoJaxError

ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
# The per-layer weights of a sparse layer (stacked over the sparse layers only).
EXPERT_LEAVES = ("router", "router_bias", "we_gate", "we_up", "we_down", "be_gate", "be_up",
                 "be_down")


class RouterStats(NamedTuple):
    """What transformers' load_balancing_loss_func sums over the sparse layers, for the real
    (mask 1) tokens: top-k assignments per expert (no gradient), router probabilities per
    expert, and tokens (once per layer)."""

    counts: jax.Array  # [E]
    probs: jax.Array  # [E]
    tokens: jax.Array  # []

    @classmethod
    def zeros(cls, num_experts: int) -> "RouterStats":
        z = jnp.zeros((num_experts,), jnp.float32)
        return cls(z, z, jnp.zeros((), jnp.float32))

    def plus(self, other: "RouterStats | None", weight: float = 1.0) -> "RouterStats":
        if other is None:
            return self
        return RouterStats(*(a + weight * b for a, b in zip(self, other)))


def aux_loss(stats: RouterStats) -> jax.Array:
    """transformers' load_balancing_loss_func (Switch Transformer's): E * sum_e f_e P_e, with
    f_e the share of assignments and P_e the mean probability of expert e over every sparse
    layer's real tokens (k at a uniform router)."""
    tokens = jnp.maximum(stats.tokens, 1.0)
    return stats.counts.shape[0] * jnp.sum((stats.counts / tokens) * (stats.probs / tokens))


def expert_load(stats: RouterStats, k: int) -> jax.Array:
    """[E] each expert's share of the assignments times E: 1 everywhere when balanced."""
    return stats.counts * stats.counts.shape[0] / jnp.maximum(stats.tokens * k, 1.0)


def gated(cfg, gate, up):
    """The gated activation of an MLP's two projections: hidden_act(gate) * up, or gpt-oss's
    clamped SwiGLU."""
    if cfg.swiglu_limit is None:
        return ACTIVATIONS[cfg.hidden_act](gate) * up
    limit = cfg.swiglu_limit
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha)


def route(cfg, p, x, forced=None):
    """x [N, D] -> (router logits [N, E] fp32, chosen experts [N, k] int32, their weights
    [N, k]). The router's weights are rounded to the compute dtype first, as the sampler holds
    them (rollout/native/sampler.py casts every matrix once): the trainer and the sampler then
    route every token alike; the product and everything after it are fp32. `forced` [N, k]
    (any int dtype): replayed experts (see the module docstring), -1 rows route themselves."""
    f32 = lambda w: w.astype(cfg.dtype).astype(jnp.float32)  # noqa: E731
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), f32(p["router"]))
    if cfg.router_bias:
        logits = logits + f32(p["router_bias"])
    probs = jax.nn.softmax(logits, axis=-1)
    weights, idx = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if forced is not None:
        replayed = forced[:, :1] >= 0  # a recorded token: all k replayed
        idx = jnp.where(replayed, forced.astype(jnp.int32), idx)
        # The gate weights of the replayed experts from the trainer's own router: the router's
        # gradient flows through them.
        weights = jnp.take_along_axis(probs, idx, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return logits, idx, weights


def router_stats(logits, idx, token_mask) -> RouterStats:
    """One layer's RouterStats; token_mask [N] (1: a real token)."""
    m = token_mask.astype(jnp.float32)
    E = logits.shape[-1]
    counts = jnp.zeros((E,), jnp.float32).at[idx.reshape(-1)].add(
        jnp.repeat(m, idx.shape[-1]))
    probs = jnp.einsum("ne,n->e", jax.nn.softmax(logits, axis=-1), m)
    return RouterStats(jax.lax.stop_gradient(counts), probs, m.sum())


def moe_mlp(cfg, p, h, token_mask=None, mesh=None, forced=None):
    """A sparse layer's MLP on h [B, T, D] (after the norm): (output [B, T, D], RouterStats
    over the tokens where token_mask [B, T] is 1 (None without a mask), the experts each token
    ran [B, T, k] int32). `forced` [B, T, k]: replayed experts (route)."""
    B, T, D = h.shape
    x = h.reshape(B * T, D)
    k = cfg.num_experts_per_tok
    logits, idx, weights = route(cfg, p, x, None if forced is None else forced.reshape(B * T, k))
    if forced is not None and cfg.numerics.moe_capacity_factor is not None:
        # A replayed forward runs dropless: which assignments overflow a capacity buffer
        # depends on the batch the forward sees, which is the very difference between the
        # sampler's forward and the trainer's that replay removes (a replayed token is never
        # dropped).
        cfg = cfg.replace(moe_capacity_factor=None)
    y = experts(cfg, p, x, idx, weights, mesh)
    stats = None if token_mask is None else router_stats(logits, idx, token_mask.reshape(-1))
    return y.reshape(B, T, D).astype(h.dtype), stats, idx.reshape(B, T, k)


def routing_dtype(num_experts: int):
    """The dtype a recorded expert index is stored in: int8 up to 127 experts, else int16
    (-1: no record)."""
    return jnp.int8 if num_experts <= 127 else jnp.int16


# The metric of routing_mismatch_sums (not TRL's: TRL has no routing record), logged once per
# generation batch like TRL's sampling/* metrics.
ROUTER_MISMATCH = "router/mismatch"


def routing_mismatch_sums(used, recorded, mask) -> jax.Array:
    """[2]: (token-layers whose top-k expert set differs, token-layers counted) over the tokens
    where mask [N, T] is 1 and a record exists (recorded >= 0); used, recorded [N, T, S, k]
    (S sparse layers). A set, not an order: both sorted first."""
    rec = recorded.astype(jnp.int32)
    differs = jnp.any(jnp.sort(used.astype(jnp.int32), axis=-1) != jnp.sort(rec, axis=-1),
                      axis=-1)  # [N, T, S]
    counted = ((mask > 0)[..., None] & (rec[..., 0] >= 0)).astype(jnp.float32)
    return jnp.stack([jnp.sum(differs * counted), jnp.sum(counted)])


def experts(cfg, p, x, idx, weights, mesh=None):
    """sum_k weights[:, k] * expert_{idx[:, k]}(x) for x [N, D]; under shard_map on a mesh,
    with the experts split over its `expert` axis when it has one (see the module docstring)."""
    dt = cfg.dtype
    w = {k: p[k].astype(dt) for k in ("we_gate", "we_up", "we_down", "be_gate", "be_up")
         if k in p}
    E = cfg.num_experts
    ep = mesh.shape.get("expert", 1) if mesh is not None else 1
    if E % ep:
        raise GrpoJaxError(f"{E} experts don't split over an expert axis of {ep} devices: "
                           "choose ep dividing num_experts")
    if mesh is None:
        y = _local_experts(cfg, w, x, idx, weights, 0, E)
    else:
        y = _sharded_experts(cfg, w, x, idx, weights, mesh, ep)
    if cfg.expert_bias:  # the down projection's bias, weighted like the expert's output
        bias = p["be_down"].astype(dt).astype(jnp.float32)[idx]  # [N, k, D]
        y = y + jnp.einsum("nkd,nk->nd", bias, weights)
    return y.astype(dt)


def token_axes(mesh, n: int) -> tuple[str, ...]:
    """The mesh axes the experts' n tokens (rows of [B T, D], B major) are split over inside
    shard_map: the batch axes, then the context axis (a row's positions), each kept while the
    product divides n (as mesh.spec_for keeps them)."""
    kept, size = [], 1
    for a in (*_flat(mesh_lib.RULES["batch"]), *_flat(mesh_lib.RULES["length"])):
        if a in mesh.axis_names and a not in kept and n % (size * mesh.shape[a]) == 0:
            kept.append(a)
            size *= mesh.shape[a]
    return tuple(kept)


def _sharded_experts(cfg, w, x, idx, weights, mesh, ep: int):
    """_local_experts under shard_map: each `expert` shard (the only one without an expert
    axis) holds E / ep experts (and, with a `tensor` axis, a slice of their hidden width, its
    partial outputs summed over it)."""
    N, F = x.shape[0], cfg.moe_intermediate_size
    kept = token_axes(mesh, N)
    row_spec = P(kept or None, None)
    tp = mesh.shape.get("tensor", 1)
    tensor = "tensor" if tp > 1 and F % tp == 0 else None
    expert = "expert" if ep > 1 else None
    specs = {"we_gate": P(expert, None, tensor), "we_up": P(expert, None, tensor),
             "we_down": P(expert, tensor, None), "be_gate": P(expert, tensor),
             "be_up": P(expert, tensor)}
    names = sorted(w)
    local = cfg.num_experts // ep
    gathered = "expert" in kept

    def body(x, idx, weights, *ws):
        if gathered:  # every shard sees the tokens of all its expert-axis peers
            x, idx, weights = (jax.lax.all_gather(a, "expert", axis=0, tiled=True)
                               for a in (x, idx, weights))
        first = jax.lax.axis_index("expert") * local if expert else 0
        y = _local_experts(cfg, dict(zip(names, ws)), x, idx, weights, first, local)
        if tensor:
            y = jax.lax.psum(y, tensor)
        if gathered:
            return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, "expert") if expert else y

    return jax.shard_map(
        body, mesh=mesh, in_specs=(row_spec, row_spec, row_spec, *(specs[n] for n in names)),
        out_specs=row_spec, check_vma=False)(x, idx, weights, *(w[n] for n in names))


def _flat(axes) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def _local_experts(cfg, w, x, idx, weights, first, num_local: int):
    """The contribution of experts [first, first + num_local) (weights `w` [num_local, ...]) to
    x [M, D]'s outputs [M, D] fp32; assignments to other experts add nothing."""
    M, k = idx.shape
    local = idx - first
    valid = (local >= 0) & (local < num_local)
    key = jnp.where(valid, local, num_local).reshape(-1)  # other shards' experts sort last
    order = jnp.argsort(key, stable=True)
    key_sorted = key[order]
    rows = x[order // k]  # [M k, D], grouped by expert
    sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    if cfg.numerics.moe_capacity_factor is None:
        out = _grouped(cfg, w, rows, key_sorted, sizes, num_local)
    else:
        capacity = math.ceil(cfg.numerics.moe_capacity_factor * M * k / cfg.num_experts)
        out = _with_capacity(cfg, w, rows, key_sorted, sizes, capacity)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    per_choice = out[inverse].reshape(M, k, -1).astype(jnp.float32)
    return jnp.einsum("mkd,mk->md", per_choice, jnp.where(valid, weights, 0.0))


def _bias(w, name, key_sorted):
    b = w.get(name)
    return 0 if b is None else b[jnp.minimum(key_sorted, b.shape[0] - 1)]


def _grouped(cfg, w, rows, key_sorted, sizes, num_local):
    """Dropless: one grouped matmul per projection over the rows sorted by expert; rows past
    the last local group (other shards' experts) come out 0."""
    ok = (key_sorted < num_local)[:, None]
    rows = jnp.where(ok, rows, 0)
    gate = _gmm(cfg, rows, w["we_gate"], sizes) + _bias(w, "be_gate", key_sorted)
    up = _gmm(cfg, rows, w["we_up"], sizes) + _bias(w, "be_up", key_sorted)
    hidden = jnp.where(ok, gated(cfg, gate, up), 0)
    return jnp.where(ok, _gmm(cfg, hidden, w["we_down"], sizes), 0)


def _gmm(cfg, lhs, rhs, sizes):
    """lhs [M, K] (rows grouped by `sizes`, then rows in no group) @ rhs [G, K, N] per group, by
    models/gmm.py's choice (megablox on TPU, Mosaic GPU on Hopper+, XLA's ragged_dot elsewhere;
    Numerics.moe_gmm forces one). Rows in no group come out unspecified: callers mask them."""
    return gmm_lib.gmm(lhs, rhs, sizes, cfg.numerics.moe_gmm)


def _with_capacity(cfg, w, rows, key_sorted, sizes, capacity: int):
    """Each expert's first `capacity` assignments (in token order) in a [E, capacity, D]
    buffer, run as batched matmuls; the rest come out 0 (dropped)."""
    num_local = w["we_gate"].shape[0]
    starts = jnp.cumsum(sizes) - sizes
    pos = jnp.arange(rows.shape[0]) - jnp.concatenate([starts, jnp.zeros((1,), sizes.dtype)])[
        key_sorted]
    buf = jnp.zeros((num_local, capacity, rows.shape[1]), rows.dtype).at[key_sorted, pos].set(
        rows, mode="drop")
    gate = jnp.einsum("ecd,edf->ecf", buf, w["we_gate"])
    up = jnp.einsum("ecd,edf->ecf", buf, w["we_up"])
    if "be_gate" in w:
        gate, up = gate + w["be_gate"][:, None], up + w["be_up"][:, None]
    out = jnp.einsum("ecf,efd->ecd", gated(cfg, gate, up), w["we_down"])
    return out.at[key_sorted, pos].get(mode="fill", fill_value=0)


def router_metric_sums(sums: dict, stats: RouterStats, aux, k: int) -> dict:
    """Metric sums (grpo/loss.py) with a micro-batch's router metrics: `aux_loss` (TRL's name:
    the mean over micro-batches) when the loss is on, and each expert's load over the step's
    tokens (`router/load/<e>`; 1 = a balanced share) with its max and min over the experts."""
    load = expert_load(stats, k)
    E = load.shape[0]
    mean = dict(sums["mean"])
    if aux is not None:
        mean["aux_loss"] = _mean_sum(jax.lax.stop_gradient(aux), 1.0)
    for e in range(E):  # per micro-batch, as every loss metric (TRL logs each)
        mean[f"router/load/{e}"] = _mean_sum(stats.counts[e] * E / k, stats.tokens)
    return {**sums, "mean": mean,
            "max": {**sums["max"], "router/load_max": jax.lax.stop_gradient(load.max())},
            "min": {**sums["min"], "router/load_min": jax.lax.stop_gradient(load.min())}}


def _mean_sum(value, count) -> jax.Array:
    """A mean metric's (sum, count) pair as grpo/loss.py stacks it."""
    return jnp.stack([jnp.asarray(value, jnp.float32), jnp.asarray(count, jnp.float32)])


def router_aux_loss_coef(requested: float | None, model_cfg) -> float:
    """The load-balancing loss's coefficient as TRL resolves it: the requested one, else the
    checkpoint's (config.json's router_aux_loss_coef); a nonzero request on a dense model is an
    error (there is no router to balance)."""
    if requested is None:
        return float(model_cfg.router_aux_coef) if model_cfg.num_experts else 0.0
    if requested and not model_cfg.num_experts:
        raise GrpoJaxError(f"router_aux_loss_coef is set to {requested} but the model "
                           f"({model_cfg.model_type}) is not a mixture of experts: there is no "
                           "auxiliary loss to weight; drop it or set it to 0")
    return float(requested)
