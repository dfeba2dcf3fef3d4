"""LoRA adapters on the decoder's projections, with PEFT's semantics and TRL's setting names.

An adapter of projection W (our layout [L, in..., out...]) is A [L, in..., r] and
B [L, r, out...]; the layer computes x W + scale * (x A) B with scale = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora). A starts as PEFT's kaiming-uniform, B at zero, so
training starts at the base model.

Why not qwix: qwix's LoRA intercepts flax Linear/Einsum modules (or jnp.einsum calls inside a
module it rewrites) and makes one adapter per intercepted call. The decoder has no such modules:
its weights are stacked [L, ...] arrays fed to one lax.scan, so an intercepted einsum inside the
scan body would get a single unstacked adapter shared by every layer, and the adapters would not
carry the layer axis that sharding, checkpoints and PEFT's per-layer keys need. The few lines
below put stacked adapters beside the stacked weights instead, and `project` adds them at the
projection sites.

The adapters are `LoraParam` variables (not `nnx.Param`): `nnx.split(model, LoraParam,
nnx.Param)` separates what is trained from the frozen base, and everything that reads
`nnx.Param` (sampler, HF export) sees the plain base model.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.errors import check
from grpo_jax.models import quant
from grpo_jax.models.config import param_table
from grpo_jax.config.model import DEFAULT_TARGETS, TARGETS, PeftArgs  # noqa: F401 (API)


class LoraParam(nnx.Variable):
    """An adapter matrix: trained, while the base's nnx.Param stay frozen."""


def model_targets(peft: PeftArgs, cfg) -> tuple[str, ...]:
    """peft.targets() that the model `cfg` has. A mixture of experts has no dense MLP in its
    sparse layers, and PEFT reads the MLP names on one as the experts' stacked parameters:
    on a mixture of experts all-linear adapts attention only, and an MLP module named
    outright is refused."""
    # The decoder's layers only: "vision/" is as long as "layers/", so a tower's top-level
    # entry would otherwise pass for a layer's.
    have = {name[len("layers/"):] for name in param_table(cfg) if name.startswith("layers/")}
    missing = [n for n in peft.target_modules() if TARGETS[n] not in have]
    names = peft.lora_target_modules or ()
    check(not missing or "all-linear" in names, f"lora_target_modules {missing}: "
          f"{cfg.model_type} has no dense {', '.join(missing)} (its MLPs are experts, "
          "which grpo-jax's LoRA does not adapt); target attention (q_proj, k_proj, "
          "v_proj, o_proj) or all-linear, or train without use_peft")
    if cfg.num_experts:
        # PEFT (0.21, transformers 5) reads these names on a mixture of experts as the
        # experts' stacked parameters and adapts no dense MLP: an adapter of a dense layer's
        # MLP would load into PEFT as something else. all-linear adapts attention only.
        mlp = ("gate_proj", "up_proj", "down_proj")
        named = [n for n in names if n in mlp]
        check(not named, f"lora_target_modules {named}: on a mixture of experts "
              f"({cfg.model_type}) PEFT reads them as the experts' parameters, which "
              "grpo-jax's LoRA does not adapt; target attention (q_proj, k_proj, v_proj, "
              "o_proj) or all-linear, or train without use_peft")
        have -= {TARGETS[n] for n in mlp}
    return tuple(t for t in peft.targets() if t in have)


def tower_linears(peft: PeftArgs, cfg) -> dict[str, str]:
    """The vision tower's linear modules that PEFT's rules adapt for `peft`'s
    lora_target_modules on the wrapper (...ForConditionalGeneration), by table name (without
    "vision/") -> HF module name ({i}: each layer): a name adapts each module whose name ends
    with it, all-linear every nn.Linear. {} for a text model."""
    if cfg.vision is None:
        return {}
    names = peft.lora_target_modules or DEFAULT_TARGETS
    names = (names,) if isinstance(names, str) else names
    linear = {name: module for name, (module, _) in quant.tower_linears(cfg.vision).items()}
    if "all-linear" in names:
        return linear
    # As PEFT: a name that matches no module here adapts nothing (a config may serve models
    # with other towers); the config refuses names no model has.
    return {n: m for n, m in linear.items() if m.rsplit(".", 1)[-1] in names}


def tower_targets(peft: PeftArgs, cfg) -> tuple[str, ...]:
    """The tower's weights (table names without "vision/": "layers/wq", "blocks/wqkv",
    "merger/w1") that get adapters: every linear of tower_linears, as PEFT adapts them (a
    fused linear such as Qwen2.5-VL's attn.qkv is one module: one adapter, its B as wide as
    the fused output)."""
    return tuple(tower_linears(peft, cfg)) if cfg.vision is not None else ()


def tower_adapter_params(peft: PeftArgs, cfg) -> int:
    """The trainable parameters of the tower's adapters (r x (in + out) a module, each layer's
    of a stacked weight): what a tower-adapted run trains there, from the config alone."""
    if cfg.vision is None or not peft.use_peft:
        return 0
    table = cfg.vision.param_table(cfg.hidden_size)
    total = 0
    for name in tower_targets(peft, cfg):
        hf_name, groups = cfg.vision.hf_names()[name]
        shape = table[name][0]
        stack, shape = (shape[0], shape[1:]) if "{i}" in hf_name else (1, shape)
        n = len(groups[1])
        total += stack * peft.lora_r * (math.prod(shape[:n]) + math.prod(shape[n:]))
    return total


def _tower_target(vision, cfg, name: str) -> tuple:
    """(holder, leaf, shape, axes, inputs) of tower weight `name`: a weight outside the
    stacked layers (Qwen2.5-VL's merger) as a stack of one, so its adapters have the layer
    axis every other adapter has (merging, export and sharding read them alike)."""
    part, leaf = name.split("/")
    holder = getattr(vision, part)
    w = getattr(holder, leaf)
    hf_name, groups = cfg.vision.hf_names()[name]
    inputs = len(groups[1])  # torch's [out, in]: the HF tensor's second group is the input
    if "{i}" in hf_name:
        return holder, leaf, w.shape, w.axes, inputs
    return holder, leaf, (1, *w.shape), (None, *w.axes), inputs


def add_adapters(model, peft: PeftArgs, key: jax.Array, dtype=None) -> None:
    """Give `model` (a Decoder) fresh adapters in `dtype` (default: the model's param dtype):
    A kaiming-uniform as PEFT's (bound 1/sqrt(fan_in)), B zero. Axes follow the weight's. On a
    vision-language model the tower's modules that PEFT's rules select get theirs too (beside
    the tower's weights: `model.vision.layers`, or Qwen2.5-VL's `.blocks` and `.merger`)."""
    # PEFT adapts Phi-3's fused qkv_proj / gate_up_proj as single modules; our split weights
    # would give adapters of another shape than PEFT's, so refuse rather than export a mismatch.
    check(model.cfg.model_type != "phi3", "LoRA on Phi-3 (fused qkv_proj and gate_up_proj) "
          "is not supported yet; train it without use_peft, or use a Llama-shaped model")
    dtype = model.cfg.param_dtype if dtype is None else dtype
    model.lora_scale = peft.scale
    model.lora_dropout = peft.lora_dropout
    targets = [(model.layers, leaf, getattr(model.layers, leaf).shape,
                getattr(model.layers, leaf).axes, quant.num_inputs(leaf))
               for leaf in model_targets(peft, model.cfg)]
    tower = tower_targets(peft, model.cfg) if model.vision is not None else ()
    if tower:
        model.vision.lora_scale = peft.scale
        model.vision.lora_dropout = peft.lora_dropout
        targets += [_tower_target(model.vision, model.cfg, name) for name in tower]
    shapes = tuple(((*shape[:1 + n], peft.lora_r), (shape[0], peft.lora_r, *shape[1 + n:]))
                   for _, _, shape, _, n in targets)  # (A, B) of each
    bounds = tuple(1.0 / math.sqrt(math.prod(shape[1:1 + n])) for _, _, shape, _, n in targets)
    drawn = _draw_adapters(key, shapes, bounds, jnp.dtype(dtype))
    for (holder, leaf, _, axes, n), (a, b) in zip(targets, drawn):
        setattr(holder, f"{leaf}_lora_a", LoraParam(a, axes=_fsdp((*axes[:1 + n], None))))
        setattr(holder, f"{leaf}_lora_b",
                LoraParam(b, axes=_fsdp((axes[0], None, *axes[1 + n:]))))


def tower_adapted(model) -> bool:
    """Whether `model`'s vision tower has adapters (its forwards then train through it)."""
    return model.vision is not None and model.vision.lora_scale is not None


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw_adapters(key, shapes, bounds, dtype):
    """Every target's (A, B) in one program: drawn one by one, each shape was a program of its
    own to compile (a LoRA run's start-up paid for seven)."""
    return [(jax.random.uniform(jax.random.fold_in(key, i), a, jnp.float32, -bound,
                                bound).astype(dtype), jnp.zeros(b, dtype))
            for i, ((a, b), bound) in enumerate(zip(shapes, bounds))]


def _fsdp(axes: tuple) -> tuple:
    """An adapter's logical axes: the weight's, or, for one without the model dimension (the
    weights' FSDP axis), the lora_* names that put FSDP on its other dims (mesh.RULES)."""
    if "embed" in axes:
        return axes
    names = {"heads": "lora_heads", "kv_heads": "lora_heads", "head_dim": "lora_head_dim",
             "mlp": "lora_mlp"}
    return tuple(names.get(a, a) for a in axes)


def with_dropout(model, key: jax.Array | None):
    """`model` (merged inside a traced train step) with adapter dropout drawn from `key` in
    its forward passes; unchanged when it has no adapters, lora_dropout 0 or key None.
    Everything else (sampler, reference and old log-probs, evaluation) never sets a key, so
    it runs the adapters without dropout, as PEFT in eval mode."""
    if key is not None and model.lora_dropout > 0:
        model.lora_dropout_key = key
        if tower_adapted(model):  # its own stream of masks
            model.vision.lora_dropout_key = jax.random.fold_in(key, len(quant.PROJECTIONS))
    return model


def scale_of(model) -> float | None:
    """The adapters' scale (PEFT's lora_alpha / r, or / sqrt(r) with rsLoRA) of a model that
    apply() gave adapters; None for a plain model."""
    return model.lora_scale


def layer_extras(model) -> dict[str, jax.Array]:
    """What the layer scan needs beyond the param table: the stacked adapters
    {leaf_lora_a: A, leaf_lora_b: scale * B}, a quantized base's `leaf_qscale` scales and,
    under with_dropout, one dropout key and the rate per layer ({} for a plain model). B is
    scaled here, once per forward, so the scan body needs no static scale."""
    scale = scale_of(model)
    out = {}
    for name, var in vars(model.layers).items():
        if name.endswith("_qscale"):
            out[name] = var[...]
        elif isinstance(var, LoraParam) and scale is not None:
            out[name] = var[...] * scale if name.endswith("_lora_b") else var[...]
    key = model.lora_dropout_key
    if key is not None and scale is not None:
        L = model.cfg.num_layers
        out[DROPOUT_KEY] = jax.random.split(key, L)
        out[DROPOUT_RATE] = jnp.full((L,), model.lora_dropout, jnp.float32)
    return out


DROPOUT_KEY, DROPOUT_RATE = "lora_dropout_key", "lora_dropout_rate"


def dropout(x: jax.Array, rate: jax.Array, key: jax.Array) -> jax.Array:
    """torch's nn.Dropout in training: zero with probability `rate`, the rest / (1 - rate)."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate).astype(x.dtype), jnp.zeros((), x.dtype))


def project(p: dict, leaf: str, eq: str, x: jax.Array, dtype) -> jax.Array:
    """einsum(eq, x, W) for weight `leaf` of layer params `p`, plus its adapter when `p` has
    one: (x A) B, contracted in two small matmuls (never forming the [in, out] delta), with
    PEFT's dropout on the adapter's input when `p` has a dropout key (with_dropout). A
    quantized weight is dequantized to `dtype` here, inside the layer."""
    y = jnp.einsum(eq, x, quant.weight(p, leaf, dtype))
    if f"{leaf}_lora_a" not in p:
        return y
    if DROPOUT_KEY in p:  # PEFT: each adapted module draws its own mask
        key = jax.random.fold_in(p[DROPOUT_KEY], quant.PROJECTIONS.index(leaf))
        x = dropout(x, p[DROPOUT_RATE], key)
    lhs, out = eq.split("->")
    xs, ws = lhs.split(",")
    ins = "".join(c for c in ws if c in xs)
    outs = "".join(c for c in ws if c not in xs)
    r = jnp.einsum(f"{xs},{ins}r->btr", x, p[f"{leaf}_lora_a"].astype(dtype))
    return y + jnp.einsum(f"btr,r{outs}->{out}", r, p[f"{leaf}_lora_b"].astype(dtype))


def merged_weight(w: jax.Array, a: jax.Array, b_scaled: jax.Array) -> jax.Array:
    """W + A (scale B) for stacked [L, in..., out...] W, in fp32, cast back to W's dtype (a
    W outside the stacked layers: [in..., out...] with its adapters a stack of one)."""
    L, r = a.shape[0], a.shape[-1]
    delta = jnp.matmul(a.reshape(L, -1, r).astype(jnp.float32),
                       b_scaled.reshape(L, r, -1).astype(jnp.float32))
    return (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)


def merge_into_base(base, adapters, scale: float):
    """The base's nnx.Param state with each adapted weight replaced by W + scale * A B: the
    weights the sampler (and a vLLM server) run; a quantized base comes back dequantized.
    `adapters`: the LoraParam state."""
    merged = jax.tree.map(lambda x: x, quant.dequantized_base(base))  # a new State
    holders = [(adapters["layers"], merged["layers"])]
    if "vision" in adapters:  # the tower's adapters (add_adapters), by holder (layers, merger)
        holders += [(adapters["vision"][part], merged["vision"][part])
                    for part in adapters["vision"]]
    for layers, weights in holders:
        for name in layers:
            if name.endswith("_lora_a"):
                leaf = name[:-len("_lora_a")]
                var = weights[leaf]
                var.set_value(merged_weight(var.get_value(), layers[name].get_value(),
                                            layers[f"{leaf}_lora_b"].get_value() * scale))
    return merged


def count(state) -> int:
    """Number of scalars in a state (e.g. the trainable adapters)."""
    return sum(x.size for x in jax.tree.leaves(state))
