"""`python -m grpo_jax.aot --auto`: the layout with the shortest forecast round that fits.

A layout is the mesh (a size for every axis of mesh.AXES, `expert` for a mixture of experts and
`context` for rows over mesh.CONTEXT_TOKENS, whose product is the chip count), the
rematerialisation policy, the per-device batch and gradient accumulation that keep the round's
rows per update and generation batch as the given config has them (the same updates, so the
same training), and the decode slots (max_num_seqs: all of a round's rows, or a half or a
quarter of them, refilled). Candidates go through two filters:

1. `estimate`, no compile: memory per chip from the parameter table and the mesh rules (exact
   for the resident state and the KV cache; activations, attention scores and gathered weights
   from their shapes), and a rough time. A candidate whose estimate is over HBM is ruled out;
   the rest are ranked by estimated time.
2. The best are compiled, in the estimate's order, until `top` fit with `MARGIN` of HBM to
   spare (`_try`: the scanned update and log-prob programs whole, then, only if they fit, the
   sampler at 2 and 3 layers, once per mesh and decode slots; a candidate whose estimate is FAR
   behind the best fitting one is not compiled), and ranked by their forecast round (the
   midpoint of its range).

Without --quick the winner's sampler is then compiled whole for the report (its update and
log-prob programs are the search's); with --quick its sampler figures are the 2- and 3-layer
extrapolation. A config with no mesh gets the estimate's best layout without compiling the
others (`default_layout`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time

from grpo_jax import run_facts
from grpo_jax.errors import GrpoJaxError

MARGIN = 0.1  # of HBM left free by a layout that "fits" (--margin's default)
# A candidate whose estimated round is more than FAR times the best compiled fitting one's
# estimate is not compiled (the estimate's time is rough, but not off by that much).
FAR = 1.25
REMAT = ((True, "full"), (True, "dots"), (False, "full"))
PHASES = ("generate", "logprobs", "update")  # a round's programs
SLOT_SPLITS = (2, 4)  # decode slots tried: a round's rows over 2 and over 4
# The update's working memory per row (saved activations, attention, MLP, log-prob head) from
# shapes, times UPDATE_ROWS, plus UPDATE_SLACK of HBM: fitted to the compiled updates of a
# Qwen2.5-14B shape on v6e:4x4 at 1 and 2 rows per chip (docs/scaling.md, "The estimate").
UPDATE_ROWS = 1.28
UPDATE_SLACK = 0.03


@dataclasses.dataclass(frozen=True)
class Layout:
    mesh: tuple[tuple[str, int], ...]  # (axis, size) for every axis of `mesh_axes(model)`
    per_device: int
    accumulation: int
    remat: bool
    remat_policy: str
    slots: int | None = None  # decode slots (max_num_seqs); None: every row of a round at once

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    def describe(self) -> str:
        split = " x ".join(f"{a} {s}" for a, s in self.mesh if s > 1) or "1 chip"
        remat = f"remat {self.remat_policy}" if self.remat else "no remat"
        slots = f"; {self.slots} decode slots" if self.slots else ""
        return (f"{split}; {self.per_device} row(s) per chip per micro-batch x "
                f"{self.accumulation} accumulation step(s); {remat}{slots}")

    def apply(self, cfg, generation_batch_size: int):
        """`cfg` with this layout (and the round's generation batch pinned)."""
        from grpo_jax import mesh as mesh_lib
        return dataclasses.replace(
            cfg, mesh=mesh_lib.config_for(self.sizes),
            batch=dataclasses.replace(cfg.batch, per_device_train_batch_size=self.per_device,
                                      gradient_accumulation_steps=self.accumulation,
                                      generation_batch_size=generation_batch_size,
                                      steps_per_generation=None),
            generation=dataclasses.replace(cfg.generation, max_num_seqs=self.slots),
            numerics=dataclasses.replace(cfg.numerics, remat=self.remat,
                                         remat_policy=self.remat_policy))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorizations(n: int, k: int):
    if k == 1:
        yield (n,)
        return
    for d in divisors(n):
        for rest in _factorizations(n // d, k - 1):
            yield (d, *rest)


def mesh_axes(model, tokens: int = 0) -> tuple[str, ...]:
    """The mesh axes a layout of `model` splits: mesh.AXES, `expert` for a mixture of experts
    and `context` for rows of more than mesh.CONTEXT_TOKENS `tokens` (between fsdp and tensor,
    in mesh.MeshConfig's order)."""
    from grpo_jax import mesh as mesh_lib
    a = mesh_lib.AXES
    mid = (((mesh_lib.EXPERT,) if model.num_experts else ())
           + ((mesh_lib.CONTEXT,) if tokens > mesh_lib.CONTEXT_TOKENS else ()))
    return (*a[:2], *mid, a[2])


def _useful(axis: str, size: int, model) -> bool:
    """Whether some weight of `model` is split over `axis` at `size` by mesh.RULES (an axis
    that splits only the batch, or nothing, is data parallelism)."""
    from grpo_jax import mesh as mesh_lib
    from grpo_jax.models import param_table

    sizes = {a: 1 for a in mesh_axes(model)} | {axis: size}
    mesh = _AbstractMesh(sizes)
    return any(axis in _flat(spec) for shape, names in param_table(model).values()
               for spec in mesh_lib.spec_for(names, shape, mesh))


def _flat(spec) -> tuple:
    return (spec,) if isinstance(spec, str) else tuple(spec or ())


class _AbstractMesh:
    """Axis sizes where mesh.spec_for needs a mesh (it reads `.shape` and `.axis_names`)."""

    def __init__(self, sizes: dict[str, int]):
        self.shape = dict(sizes)
        self.axis_names = tuple(sizes)


def candidates(cfg, model, devices, remat=None, image_tokens: int = 0) -> list[Layout]:
    """Every layout of `devices` over mesh_axes(model) for `cfg`'s round (the rows per update
    and the generation batch of `cfg` as planned on its own mesh, pure data parallelism without
    one) whose mesh mesh.make_mesh can lay over them (jax.make_mesh maps axes onto the torus,
    and not every split of a 4x4 slice has a mapping). With images (`image_tokens`) no decode
    slots: the refill program takes no images."""
    from grpo_jax import mesh as mesh_lib

    chips = len(devices)
    slices = mesh_lib.slice_count(devices)
    base = cfg.batch_plan(batch_size(cfg, chips))
    rows = base.micro_batch_size * base.gradient_accumulation_steps
    batch_axes = _flat(mesh_lib.RULES["batch"])
    out = []
    completion = cfg.generation.max_completion_length
    axes = mesh_axes(model, cfg.data.max_prompt_length + completion)
    for sizes in _factorizations(chips, len(axes)):
        named = dict(zip(axes, sizes))
        if any(s > 1 and a not in batch_axes and not _useful(a, s, model)
               for a, s in named.items()):
            continue
        if not mesh_lib.context_splits(completion, named.get(mesh_lib.CONTEXT, 1)):
            continue
        if slices > 1 and named[mesh_lib.AXES[0]] % slices:
            continue  # only the data axis crosses slices
        dp = math.prod(named.get(a, 1) for a in batch_axes)
        if rows % dp or base.generation_batch_size % dp or not _meshable(named, devices):
            continue
        # Decode slots (the JAX sampler's): the user's, or every row at once, or a half or a
        # quarter of them (a whole number a batch shard), refilled: less KV cache, more steps.
        gen, given = base.generation_batch_size, cfg.generation.max_num_seqs
        slots = ([given] if given is not None else [None] if cfg.rollout.backend != "jax"
                 or image_tokens else [None] + [gen // d for d in SLOT_SPLITS
                                                if gen % (d * dp) == 0])
        for per_device in divisors(rows // dp):
            for (on, policy), n in itertools.product(remat or REMAT, slots):
                lay = Layout(tuple(named.items()), per_device, rows // dp // per_device, on,
                             policy, n)
                try:
                    lay.apply(cfg, gen).batch_plan(dp)
                except GrpoJaxError:
                    continue
                out.append(lay)
    return out


def _meshable(sizes: dict[str, int], devices) -> bool:
    from grpo_jax import mesh as mesh_lib
    return mesh_lib.can_lay(mesh_lib.config_for(sizes), devices)


def batch_size(cfg, chips: int) -> int:
    """The batch axes' size of `cfg`'s own mesh on `chips` devices (all of them without one)."""
    from grpo_jax import mesh as mesh_lib
    shape = dict(zip(cfg.mesh.axes, cfg.mesh.shape(chips)))
    return math.prod(shape.get(a, 1) for a in _flat(mesh_lib.RULES["batch"]))


def current(cfg, chips: int) -> Layout:
    b, n = cfg.batch, cfg.numerics
    return Layout(tuple(zip(cfg.mesh.axes, cfg.mesh.shape(chips))),
                  b.per_device_train_batch_size, b.gradient_accumulation_steps, n.remat,
                  n.remat_policy)


# ---------------------------------------------------------------- the estimate (no compile)

def estimate(lay: Layout, cfg, model, target, chips: int, phases=PHASES,
             image_tokens: int = 0, margin: float = MARGIN, images: int | None = None) -> dict:
    """Memory per chip (GB) and round time (s) of a layout, from shapes alone. The resident
    state and KV cache are what the programs hold; the phases' working memory (saved layer
    inputs or matmul outputs by remat policy, one layer's attention scores and MLP, a gathered
    layer, the sampler's compute-dtype copy of the weights) is sized from the shapes and
    checked against compiled programs in docs/scaling.md. Time: the model's FLOPs at peak, the
    decode loop's weight and KV reads at HBM bandwidth, and the collectives the layout implies
    (FSDP gathers per layer, gradient reduce-scatters and all-reduces, tensor-parallel
    all-reduces) at the ICI bandwidth of the torus dimensions an axis spans.

    `phases`: the programs these chips run (aot/split.py: a sampler mesh runs `generate`
    alone and holds no training state, only the weights it decodes with; a trainer mesh the
    other two).

    `image_tokens` (a vision-language model's image tokens per prompt, within the prompt, in
    `images` images: programs.Lowering.images):
    its tower is frozen (policy.frozen_parts: its params and reference copy, no moments or
    gradient), and each phase runs it forward over its rows' images (_tower_memory). With LoRA
    adapters on the tower (lora.tower_targets) they are trained (their params, gradients and
    AdamW's moments, replicated) and the update differentiates the tower: it keeps every
    tower layer's activations for the backward and runs it (about the forward's FLOPs again).
    It fits with `margin` of HBM to spare."""
    import jax.numpy as jnp

    from grpo_jax import mesh as mesh_lib
    from grpo_jax.aot import report
    from grpo_jax.models import lora, param_table
    from grpo_jax.shapes import bucket_width


    chip, sizes = target.chip, lay.sizes
    mesh = _AbstractMesh(sizes)
    data, f, tp, cp = _roles(sizes)
    dp = data * f
    g = f * cp  # the devices a weight is split over, besides tensor (mesh.RULES' embed)
    c_bytes = jnp.dtype(cfg.numerics.dtype).itemsize
    peft = cfg.peft.use_peft
    elems = tower = 0.0  # weights per chip, and the vision tower's of them
    tower_split = 1  # what the tower's heads are split over
    for name, (shape, names) in param_table(model).items():
        spec = mesh_lib.spec_for(names, shape, mesh)
        axes = [a for s in spec for a in _flat(s)]
        local = math.prod(shape) / math.prod(sizes[a] for a in axes)
        elems += local
        if name.startswith("vision/"):
            tower += local
            tower_split = max(tower_split, math.prod(
                sizes[a] for a in axes if a in _flat(mesh_lib.RULES["heads"])))
    n_params = model.num_params()
    # params, AdamW's moments, the reference copy, LoRA's base (the gradient: in `update`)
    held = run_facts.state_bytes(cfg, elems - tower)
    frozen = run_facts.state_bytes(cfg, tower)  # the tower's: no moments, never a gradient
    # The tower's LoRA adapters (trained: the tower is then differentiated in the update).
    tower_lora = lora.tower_adapter_params(cfg.peft, model) * jnp.dtype(
        cfg.numerics.param_dtype).itemsize
    resident = (held.resident + frozen.params + frozen.reference + frozen.frozen_base
                + 3 * tower_lora)  # the adapters and their two moments
    plan = lay.apply(cfg, cfg.batch_plan(batch_size(cfg, chips)).generation_batch_size
                     ).batch_plan(dp)
    L, D, F, V = model.num_layers, model.hidden_size, model.intermediate_size, model.vocab_size
    H, K, Dh = model.num_heads, model.num_kv_heads, model.head_dim
    h, k = (H // tp if H % tp == 0 else H), (K // tp if K % tp == 0 else K)
    ff = F // tp if F % tp == 0 else F
    P = bucket_width(cfg.data.max_prompt_length)
    C = cfg.generation.max_completion_length
    T = P + C
    Tc = T // cp  # a row's positions on one device
    rows = -(-(1 << (plan.generation_batch_size - 1).bit_length()) // dp) * dp
    rows_chip = rows // dp
    prompts_chip = -(-(-(-rows // plan.num_generations)) // dp)
    # The sampler's cache is split by position over the context axis.
    kv = sum(2 * rows_chip * k * model.cache_length(i, T) * Dh * c_bytes
             for i in range(L)) / cp
    # Decode slots: the cache of that many rows, the round's rows in as many waves of decode.
    waves = -(-rows // lay.slots) if lay.slots else 1
    kv /= waves
    layer = (D * (H + 2 * K) * Dh + H * Dh * D + 3 * D * F) * c_bytes / tp
    gathered = 2 * layer if g > 1 else 0.0
    r = lay.per_device
    # Rows over mesh.CONTEXT_TOKENS run blockwise attention (splash, flash): a block of keys
    # at a time against a device's queries, never [T, T] scores; their keys and values are
    # gathered over the context axis per layer.
    long = T > mesh_lib.CONTEXT_TOKENS
    scores = r * h * Tc * (min(T, 512) if long else T) * 4
    kv_gathered = r * T * 2 * k * Dh * c_bytes if cp > 1 else 0.0
    if not lay.remat:
        saved = r * Tc * ((h + 2 * k) * Dh + 4 * D + 3 * ff) * 2 + scores / 4 * c_bytes
    elif lay.remat_policy == "dots":
        saved = r * Tc * ((h + 2 * k) * Dh + 2 * D + 2 * ff) * 2
    else:
        saved = r * Tc * D * 2
    # The log-prob head, vocabulary-parallel: a chunk of every row's logits, a 1/chips slice
    # of the vocabulary, fp32, with its softmax and gradient.
    logits = r * dp * min(C, 128) * V / chips * 4 * 3
    slack = 0.02 * chip.hbm_bytes  # XLA's own buffers, scratch
    trained = held.params
    images = model.vision.encoded(image_tokens, images) if image_tokens else None
    prompts = -(-rows // plan.num_generations)
    # The sampler's images are one host's, replicated: every chip encodes every prompt's.
    seen = {"generate": prompts, "logprobs": r, "update": r}
    towers = {p: _tower_memory(images, n, tower_split, c_bytes,
                               backward=p == "update" and tower_lora > 0) if images else 0.0
              for p, n in seen.items()}
    towers["update"] += tower_lora  # the adapters' gradients
    # The update's batch holds its accumulation steps' pixels at once.
    towers["update"] += (r * lay.accumulation * images.images * math.prod(images.pixels) * 4
                         if images else 0.0)
    temps = {
        "generate": kv + elems * c_bytes + gathered + prompts_chip * h * P * P * 4
        # refill's store of each prompt's prefilled keys and values, for the waves to come
        + (2 * prompts_chip * k * P * Dh * c_bytes * L if lay.slots else 0.0)
        + rows_chip * V * 4 * 3 + slack,
        "logprobs": r * Tc * D * 2 * 2 + scores + r * Tc * ff * 2 * 2 + gathered + kv_gathered
        + slack + logits,
        # Calibrated (UPDATE_ROWS, UPDATE_SLACK) against compiled updates: docs/scaling.md.
        "update": 3 * trained + gathered + UPDATE_SLACK * chip.hbm_bytes
        + UPDATE_ROWS * (saved * L + 2 * scores + r * Tc * ff * 2 * 3 + logits + 2 * kv_gathered),
    }
    temps = {p: v + towers[p] for p, v in temps.items()}
    if "update" not in phases:  # a sampler mesh: its weights are generate's own copy
        resident = 0.0
    peak = max(resident + temps[p] for p in phases)
    # Time per chip.
    runs = {"generate": 1.0,
            "logprobs": (run_facts.has_reference(cfg) + plan.needs_old_logps)
            * plan.steps_per_generation,
            "update": plan.steps_per_generation * plan.num_iterations
            / plan.gradient_accumulation_steps}
    flops = report.model_flops(model, plan.prompts_per_generation, plan.generation_batch_size,
                               P, C, runs["logprobs"] * plan.micro_batch_size
                               / plan.generation_batch_size,
                               runs["update"] * plan.micro_batch_size
                               * plan.gradient_accumulation_steps,
                               run_facts.planned_prompt_group(cfg, plan))
    flops["update"] *= (4 / 3) if lay.remat and lay.remat_policy == "full" else 1.0
    if images:  # the tower's forward over each phase's images (frozen: no backward)
        encoded = {"generate": prompts * dp,  # replicated: each batch shard encodes them all
                   "logprobs": runs["logprobs"] * plan.micro_batch_size,
                   "update": runs["update"] * plan.micro_batch_size
                   * plan.gradient_accumulation_steps}
        backward = 2 if tower_lora else 1  # an adapted tower's backward: the forward again
        for p, n in encoded.items():
            flops[p] += (n * images.images * _tower_flops(images, model.vision_params())
                         * (backward if p == "update" else 1))
    weights_chip = elems * c_bytes
    hbm = {"generate": waves * (C - 1) * (weights_chip + kv),
           "logprobs": runs["logprobs"] * (n_params * c_bytes / tp + 4 * r * Tc * D * 2 * L),
           "update": runs["update"] * (plan.gradient_accumulation_steps
                                       * (3 * n_params * c_bytes / tp + 6 * r * Tc * D * 2 * L)
                                       + 5 * trained)}
    bw = {"data": bandwidth(target, data, dcn=target.num_slices > 1),
          "fsdp": bandwidth(target, g), "model": bandwidth(target, tp),
          "context": bandwidth(target, cp)}
    gathered, reduced = _weight_traffic(model, sizes)
    gather = gathered * c_bytes / bw["fsdp"]
    passes = 3 if lay.remat and lay.remat_policy == "full" else 2
    grads = gathered * (4 if not peft else 0) / bw["fsdp"]
    allreduce = reduced * (4 if not peft else 0) / bw["data"]
    # An expert axis moves tokens instead of the experts' weights: each sparse layer gathers a
    # device's tokens over it and reduce-scatters their outputs back (models/moe.py), in every
    # forward (the backward the same again); the weights stay split over it (no gather).
    ep = sizes.get(mesh_lib.EXPERT, 1)
    sparse = sum(model.moe_layers) if model.num_experts else 0
    tokens = lambda n: (2 * (ep - 1) * n * D * c_bytes * sparse  # noqa: E731
                        / bandwidth(target, ep)) if ep > 1 else 0.0
    # Keys and values all-gathered over the context axis in every layer's forward, their
    # gradients reduce-scattered back in the backward.
    context = ((cp - 1) / cp * kv_gathered * L / bw["context"]) if cp > 1 else 0.0
    tp_bytes = lambda rows_, tokens: (2 * 2 * (tp - 1) / tp * rows_ * tokens * D * c_bytes  # noqa
                                      * L / bw["model"]) if tp > 1 else 0.0
    step_fsdp = (2 * (g - 1) * rows_chip * c_bytes * (2 * D + (H + 2 * K) * Dh / tp + 3 * F / tp)
                 * L / bw["fsdp"] if g > 1 else 0.0)
    # (Slots leave the decode's collectives as they are: as many rows, over more steps.)
    comm = {"generate": (C - 1) * (step_fsdp + tp_bytes(rows_chip, 1) + tokens(rows_chip)),
            "logprobs": runs["logprobs"] * (gather + tp_bytes(r, Tc) + context
                                            + tokens(r * Tc)),
            "update": runs["update"] * (plan.gradient_accumulation_steps
                                        * (passes * gather + grads + 2 * tp_bytes(r, Tc)
                                           + (passes + 1) * (context + tokens(r * Tc)))
                                        + allreduce)}
    times = {p: {"compute_s": flops[p] / chips / chip.peak_flops,
                 "hbm_s": hbm[p] / chip.hbm_bandwidth, "comm_s": comm[p]} for p in phases}
    seconds = sum(sum(v.values()) for v in times.values())
    return {"peak_GB": peak / 1e9, "resident_GB": resident / 1e9,
            "temporaries_GB": {p: temps[p] / 1e9 for p in phases},
            "phases": times, "seconds": seconds, "weights_GB": weights_chip / 1e9,
            "fits": peak <= (1 - margin) * chip.hbm_bytes}


def _tower_memory(t, images_of: int, split: int, c_bytes: int,
                  backward: bool = False) -> float:
    """Bytes of a vision tower's forward over the images of `images_of` prompts (or rows) at
    once (models/qwen_vl.py, siglip.py): one layer's activations of every patch (its input,
    q, k, v, attention output and MLP), and its attention scores per head in fp32, over a
    whole image in a full-attention layer (the largest), else over a window of patches. A
    frozen tower keeps nothing for a backward; with `backward` (LoRA adapters on it, the
    update differentiates it) every layer's activations and attention probabilities (fp32
    scores and their compute-dtype softmax) are kept as well. `split`: what its heads and
    MLP are split over (the tensor axis, for a tower whose weights follow mesh.RULES)."""
    n = images_of * t.images
    heads = t.heads // split if t.heads % split == 0 else t.heads
    acts = n * t.patches * (5 * t.width + 2 * t.mlp // split) * c_bytes
    span = t.patches if t.full_layers else t.window
    working = acts + n * heads * t.patches * span * 4
    if not backward:
        return working
    spans = t.full_layers * t.patches + (t.layers - t.full_layers) * t.window
    return working + t.layers * acts + n * heads * t.patches * spans * (4 + c_bytes)


def _tower_flops(t, params: int) -> float:
    """One image's FLOPs through the tower: its weights over every patch, and attention (QK
    and AV) over an image in full layers, a window in the others."""
    spans = t.full_layers * t.patches + (t.layers - t.full_layers) * t.window
    return 2 * params * t.patches + 4 * t.patches * spans * t.width


def _weight_traffic(model, sizes: dict[str, int]) -> tuple[float, float]:
    """Weights a device receives per pass and sends per gradient sync, by mesh.RULES: each
    weight is all-gathered over the FSDP-like axes it is split on (fsdp, context: a weight
    split over `expert` or `tensor` stays split), and its gradient all-reduced over the batch
    axes it is not split on (data; `expert` for every weight but the experts'). Returns
    (elements gathered, elements all-reduced) per device."""
    from grpo_jax import mesh as mesh_lib
    from grpo_jax.models import param_table

    mesh = _AbstractMesh(sizes)
    gathered_axes = {a for name in ("embed", "length") for a in _flat(mesh_lib.RULES[name])}
    batch = _flat(mesh_lib.RULES["batch"])
    gathered = reduced = 0.0
    for shape, names in param_table(model).values():
        split = {a for part in mesh_lib.spec_for(names, shape, mesh) for a in _flat(part)}
        local = math.prod(shape) / math.prod(sizes[a] for a in split)
        g = math.prod(sizes[a] for a in split & gathered_axes)
        r = math.prod(sizes.get(a, 1) for a in batch if a not in split)
        gathered += local * (g - 1)
        reduced += 2 * (r - 1) / r * local
    return gathered, reduced


def _roles(sizes: dict[str, int]) -> tuple[int, int, int, int]:
    """(data, fsdp, model, context) parallel sizes of a mesh, read from mesh.RULES: batch axes
    that split no weight replicate the params (data), batch axes that do are FSDP, the axis of
    a row's positions is context, the others split the weights and not the batch (tensor, or
    any axis added to the rules later)."""
    from grpo_jax import mesh as mesh_lib
    batch = _flat(mesh_lib.RULES["batch"])
    length = _flat(mesh_lib.RULES["length"])
    weights = {a for name, v in mesh_lib.RULES.items() if name != "batch" for a in _flat(v)}
    data = math.prod(sizes.get(a, 1) for a in batch if a not in weights)
    fsdp = math.prod(sizes.get(a, 1) for a in batch if a in weights)
    context = math.prod(sizes.get(a, 1) for a in length)
    return data, fsdp, math.prod(s for a, s in sizes.items()
                                 if a not in batch and a not in length), context


def bandwidth(target, size: int, dcn: bool = False) -> float:
    """Bytes/s a ring over `size` chips receives: the torus dimensions it can span (jax.make_mesh
    lays axes along the physical ones), or NVLink, or the DCN (the data axis of several
    slices)."""
    chip = target.chip
    if size <= 1:
        return float("inf")
    if dcn:
        return chip.dcn_bandwidth
    if not chip.ici_ports or target.platform != "tpu":
        return chip.ici_bandwidth / 2
    dims = sorted((int(d) for d in target.topology.split(":")[1].split("x")), reverse=True)
    spanned, covered = 0, 1
    for d in dims:
        if covered >= size:
            break
        spanned, covered = spanned + 1, covered * d
    return chip.ici_bandwidth * max(spanned, 1) / chip.ici_ports


# ---------------------------------------------------------------- choosing

def ranked(cfg, model, target, devices, remat=None, phases=PHASES, image_tokens: int = 0,
           images: int | None = None,
           margin: float = MARGIN) -> list[tuple[Layout, dict]]:
    """The layouts of `devices` for `phases`, fitting ones first, by estimated time."""
    chips = len(devices)
    lays = candidates(cfg, model, devices, remat, image_tokens)
    if not lays:
        raise GrpoJaxError(f"no layout of {chips} chips divides the round: rows per update and "
                           "the generation batch must split over the batch axes")
    scored = [(lay, estimate(lay, cfg, model, target, chips, phases, image_tokens, margin,
                             images))
              for lay in lays]
    return sorted(scored, key=lambda x: (not x[1]["fits"], x[1]["seconds"]))


def default_layout(target, cfg, image_tokens: int = 0, images: int | None = None) -> tuple:
    """A config without a mesh, laid out as the estimate ranks best among layouts that keep its
    remat setting (the user's, or TRL's gradient checkpointing), preferring its own per-device
    batch and accumulation when they fit. Rows longer than mesh.CONTEXT_TOKENS get
    mesh.long_row_config's context axis instead (the estimate sizes attention as whole [T, T]
    scores, which the blockwise kernels never hold). Returns (cfg, what was chosen and why)."""
    from grpo_jax import mesh as mesh_lib
    from grpo_jax.aot import analyze
    model = analyze.model_config(cfg.model.name_or_path)
    devices = _devices(target)
    chips = len(devices)
    long = mesh_lib.long_row_config(cfg.data.max_prompt_length,
                                    cfg.generation.max_completion_length, chips,
                                    target.num_slices)
    if long is not None:
        return dataclasses.replace(cfg, mesh=long[0]), (
            f"no mesh given: chose {' '.join(mesh_lib.flags(long[0]))} ({long[1]})")
    mine = current(cfg, chips)
    scored = ranked(cfg, model, target, devices, remat=((mine.remat, mine.remat_policy),),
                    image_tokens=image_tokens, images=images)
    fitting = [x for x in scored if x[1]["fits"]]
    same_split = [x for x in fitting if x[0].per_device * data_parallel(x[0]) == mine.per_device
                  * data_parallel(mine) and x[0].accumulation == mine.accumulation]
    lay, est = (same_split or fitting or scored)[0]
    gen = cfg.batch_plan(batch_size(cfg, chips)).generation_batch_size
    why = (f"no mesh given: chose {lay.describe()} (estimated peak {est['peak_GB']:.1f} GB of "
           f"{target.chip.hbm_bytes / 1e9:.0f}; the estimate's best of {len(scored)} layouts"
           + ("" if same_split else ", with the micro-batch split changed to fit")
           + "; --auto compiles the best few to choose)")
    return lay.apply(cfg, gen), why


def data_parallel(lay: Layout) -> int:
    data, fsdp, _, _ = _roles(lay.sizes)
    return data * fsdp


def _devices(target):
    from grpo_jax.aot import hardware
    return hardware.devices(target)


def auto(target, cfg, quick: bool = False, top: int | None = None,
         image_tokens: int = 0, margin: float = MARGIN, images: int | None = None) -> dict:
    """The search (see the module's doc). Returns analyze's report of the winner with a
    `search` section: the candidates compiled, the winner's flags, the runner-up and why it
    lost. `top`: compiled layouts that must fit before the search stops (default 2, 1 with
    `quick`; the runner-up is then the estimate's next). `image_tokens`: a vision-language
    model's image tokens per prompt (in `images` images), estimated and compiled with its
    images. `margin`: the
    fraction of HBM a layout must leave free to fit."""
    from grpo_jax.aot import analyze

    top = top or (1 if quick else 2)
    start = time.perf_counter()
    analyze.check_config(cfg)
    model = analyze.model_config(cfg.model.name_or_path)
    devices = _devices(target)
    chips = len(devices)
    scored = ranked(cfg, model, target, devices, image_tokens=image_tokens, margin=margin,
                    images=images)
    gen = cfg.batch_plan(batch_size(cfg, chips)).generation_batch_size
    fitting = [x for x in scored if x[1]["fits"]]
    ruled_out = len(scored) - len(fitting)
    # The estimate's order, until `top` compiled layouts fit (at most top + 2 compiled), and
    # none the estimate puts FAR behind the best that fits; if none does, the layout the
    # estimate thinks smallest.
    queue = (fitting or scored)[:top + 2]
    safest = min(fitting or scored, key=lambda x: x[1]["peak_GB"])
    print(f"--auto: {len(scored)} layouts; the estimate rules out {ruled_out}; compiling the "
          f"best (until {top} fit)", file=sys.stderr, flush=True)
    tried, samplers, skipped = [], {}, 0
    while queue and sum(t["fits"] for t in tried) < top:
        lay, est = queue.pop(0)
        fit = [t["estimate"]["seconds"] for t in tried if t["fits"]]
        if fit and est["seconds"] > FAR * min(fit):
            skipped += 1 + len(queue)
            break
        tried.append(_try(target, cfg, lay, est, gen, samplers, image_tokens, margin, images))
        if not queue and not any(t["fits"] for t in tried) and safest[0] not in [
                t["layout"] for t in tried]:
            queue.append(safest)
    order = sorted(tried, key=lambda t: (not t["fits"], t["round_s"] or math.inf))
    best = order[0]
    if not best["fits"]:
        raise GrpoJaxError(
            f"no layout fits {target.name} with {margin:.0%} of HBM to spare: the best tried, "
            f"{best['layout'].describe()}, peaks at {best['peak_GB']:.2f} GB of "
            f"{target.chip.hbm_bytes / 1e9:.0f}; use more chips, LoRA, or a shorter "
            "completion (or a smaller --margin)")
    ev = best["ev"]
    if not quick:  # the sampler whole; the update and log-prob programs as the search had them
        phases = analyze.run_phases(best["run"])
        ev = analyze.evaluate(target, best["run"], phases=phases, compiled={
            k: v for k, v in ev["compiled"].items() if k not in ("generate", "refill")})
    result = analyze.summarize(target, best["cfg"], best["run"], ev, start)
    import jax
    result["jax"] = jax.__version__
    runner = next((t for t in order[1:] if t["fits"]), order[1] if len(order) > 1 else None)
    runner_up = None if runner is None else {
        "layout": runner["layout"].describe(), "flags": analyze.flags_of(runner["cfg"]),
        "why": _why_lost(runner, best, margin)}
    if runner is None or not runner["fits"]:  # the estimate's next, not compiled
        done = [t["layout"] for t in tried]
        nxt = next(((lay, est) for lay, est in fitting if lay not in done), None)
        if nxt is not None:
            runner_up = {"layout": nxt[0].describe(),
                         "flags": analyze.flags_of(nxt[0].apply(cfg, gen)),
                         "why": f"not compiled: the estimate gives it {nxt[1]['seconds']:.1f} s "
                                f"a round against the winner's {best['estimate']['seconds']:.1f} s"}
    result["search"] = {
        "layouts": len(scored), "ruled_out_by_estimate": ruled_out,
        "compiled": [{"layout": t["layout"].describe(), "peak_GB": t["peak_GB"],
                      "fits": t["fits"], "round_s": t["round_s"],
                      "programs": t["programs"]} for t in tried],
        "skipped_as_slower": skipped, "far": FAR,
        "winner": best["layout"].describe(), "flags": analyze.flags_of(best["cfg"]),
        "runner_up": runner_up,
        "quick": quick, "search_s": time.perf_counter() - start}
    return result


def _try(target, cfg, lay: Layout, est: dict, gen: int, samplers: dict,
         image_tokens: int = 0, margin: float = MARGIN, images: int | None = None) -> dict:
    """A candidate compiled: its update (and log-prob) programs first, and, only when they fit,
    the sampler at analyze.QUICK_LAYERS (analyze.evaluate's shortcut), which depends on the
    mesh and the decode slots alone: `samplers` keeps it per both for the candidates after."""
    from grpo_jax.aot import analyze

    lcfg = lay.apply(cfg, gen)
    run = analyze.make_lowering(target, lcfg, image_tokens, images)
    t0 = time.perf_counter()
    phases = analyze.run_phases(run)
    trained = tuple(p for p in phases if p != "generate")
    ev = analyze.evaluate(target, run, full_depth=False, phases=trained)
    mem = ev["memory"]
    room = lambda m: m["peak_GB"] <= (1 - margin) * m["hbm_GB"]  # noqa: E731
    refused = lambda m: any("refused_by_compiler" in p for p in m["phases"].values())  # noqa
    done, sampled = list(trained), "generate" not in phases
    if not sampled and room(mem) and not refused(mem):
        reused = (lay.mesh, lay.slots) in samplers
        ev = analyze.evaluate(target, run, full_depth=False, phases=phases,
                              compiled=ev["compiled"], small=samplers.get((lay.mesh, lay.slots)))
        samplers[lay.mesh, lay.slots], mem, sampled = ev["small"], ev["memory"], True
        done.append("generate at %s and %s layers" % analyze.QUICK_LAYERS
                    + (" (the same mesh's)" if reused else ""))
    fits = sampled and room(mem) and not refused(mem)
    time_ = analyze.timing(run, target, ev)[0] if fits else None
    # Without XLA's costs (a GPU target) the estimate's round ranks them.
    round_s = sum(time_["round_s"]) / 2 if time_ else est["seconds"] if fits else None
    said = (f"round {round_s:.3g} s{'' if time_ else ' (estimated)'}" if fits
            else "over: the sampler not compiled" if not sampled else "over")
    print(f"  {lay.describe()}: peak {mem['peak_GB']:.3g} GB (estimated {est['peak_GB']:.3g}), "
          f"{said}; compiled {', '.join(done)} [{time.perf_counter() - t0:.0f} s]",
          file=sys.stderr, flush=True)
    return {"layout": lay, "cfg": lcfg, "run": run, "ev": ev, "estimate": est,
            "peak_GB": mem["peak_GB"], "fits": fits, "round_s": round_s,
            "range_s": time_["round_s"] if time_ else None,
            "mfu": time_["mfu"] if time_ else None, "programs": done}


def _why_lost(loser: dict, best: dict, margin: float) -> str:
    if not loser["fits"]:
        return (f"does not fit with {margin:.0%} to spare (peak {loser['peak_GB']:.1f} GB)")
    ratio = loser["round_s"] / best["round_s"]
    return (f"forecast round {loser['round_s']:.1f} s against {best['round_s']:.1f} s "
            f"({ratio:.2f}x)")
