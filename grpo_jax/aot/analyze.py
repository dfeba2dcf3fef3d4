"""`python -m grpo_jax.aot`: compile a run's programs for a TPU slice or GPUs this machine does
not have, and report memory per chip, communication, and a forecast of a round's time and MFU.
See docs/scaling.md.

    python -m grpo_jax.aot --topology v6e:4x4 --model_name_or_path qwen2.5-7b \\
        --max_prompt_length 512 --max_completion_length 2048 --num_generations 8 --auto

Own options: --topology NAME (v5e:4x4, v5p:4x4x4, v6e:8x8, v5e-16, v5p-128, h100:8),
--num_slices N (TPU slices joined over DCN; the data axis spans them), --json PATH, --auto
(search the layout: mesh, remat policy, micro-batch split; candidates are compiled until
--top N of them fit, 2, or 1 with --quick; a layout fits with --margin F of HBM to spare,
0.1), --quick (compile the sampler with 2 and 3 layers and extrapolate, instead of whole:
minutes instead of tens of minutes for a large model), --phases generate,logprobs,update (the
programs to compile), --image-tokens N (a vision-language model, N image tokens per prompt
within --max_prompt_length: Qwen2.5-VL one image of N merged tokens, its pixels, M-RoPE
positions and grid; Gemma 3 N / 256 images; the layout search and estimate count its frozen
tower and its images), --images-per-prompt K (those tokens as K images of N / K tokens each,
a batch's blocks of K images: Qwen2.5-VL's K grids; Gemma 3's K must be N / 256), --split (also forecast the round split: some chips sampling while the
rest train, aot/split.py; --auto always does). Without mesh flags (--dp/--fsdp/--tp/--ep/--cp)
the layout is chosen as a run would need it
(search.default_layout; for long rows with a context axis) and said. Every other option is a
training option with TRL's name, as grpo-jax-train takes it (--config NAME|PATH, --set
key=value, --key value); the model is --model_name_or_path: a preset (grpo_jax.models.presets),
an HF config.json or a directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

from grpo_jax import run_facts
from grpo_jax.aot import report
from grpo_jax.errors import GrpoJaxError


# The sampler's depths --quick compiles (its layers are unrolled). Not 1: a 1-layer sampler
# holds one gathered layer where deeper ones keep two in flight (Qwen2.5-32B on v5p-64: 1.94,
# 3.80, 3.84, 2.08 GB of temporaries at 1, 2, 3, 4 layers), so growth read from 1 -> 2 was
# counted once per layer.
QUICK_LAYERS = (2, 3)

def model_config(name: str):
    from grpo_jax.models import ModelConfig
    from grpo_jax.models.presets import PRESETS, preset, preset_key

    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelConfig.from_hf(json.loads(path.read_text()))
    if preset_key(name) not in PRESETS and ("/" in name or name.endswith(".json")):
        raise GrpoJaxError(f"model {name!r}: no such config.json or directory")
    return preset(name)


def _has_cudnn() -> bool:
    """Whether jax's CUDA plugin finds a cuDNN library (the check jax itself makes)."""
    import importlib
    for plugin in ("jax_cuda13_plugin", "jax_cuda12_plugin"):
        try:
            versions = importlib.import_module(f"{plugin}._versions")
        except ImportError:
            continue
        try:
            return bool(versions.cudnn_get_version())
        except Exception:  # noqa: BLE001 - no cuDNN library installed
            return False
    return False


@contextlib.contextmanager
def backend_of(target):
    """Trace as on the target: attention_impl "auto" picks splash attention on a TPU and
    cuDNN on a GPU where a run would (this process runs on the CPU backend). Tracing cuDNN
    attention needs the cuDNN library (`pip install nvidia-cudnn-cu13`); without it attention
    is XLA's, which holds the scores in HBM: the memory figures then err high."""
    import jax

    from grpo_jax.models.config import tracing_for
    gpu = target.platform == "cuda" and _has_cudnn()
    backend = "gpu" if gpu else "tpu" if target.platform == "tpu" else jax.default_backend()
    with tracing_for(backend):
        yield


def check_config(cfg) -> None:
    if cfg.data.max_prompt_length is None:
        raise GrpoJaxError("set --max_prompt_length: the programs are compiled for one prompt "
                           "length (the sampler's bucket that holds it)")


def check_images(cfg, model, image_tokens: int, images: int | None = None) -> None:
    """--image-tokens: a vision-language model (Qwen2.5-VL: one image of that many tokens, or
    --images-per-prompt images sharing them; Gemma 3: images of mm_tokens_per_image each) and
    the placeholders within the prompt."""
    if not image_tokens:
        if images:
            raise GrpoJaxError("--images-per-prompt: give the prompt's --image-tokens too")
        return
    if model.vision is None:
        raise GrpoJaxError(f"--image-tokens: {cfg.model.name_or_path} is not a vision-language "
                           "model (Qwen2.5-VL or Gemma 3 with its vision tower)")
    model.vision.encoded(image_tokens, images)  # a count its images can make
    if image_tokens >= cfg.data.max_prompt_length:
        raise GrpoJaxError(f"--image-tokens {image_tokens}: the image's placeholders are "
                           f"prompt tokens; --max_prompt_length {cfg.data.max_prompt_length} "
                           "must hold them and the text")


def make_lowering(target, cfg, image_tokens: int = 0, images: int | None = None, **device_kw):
    """The programs.Lowering of `cfg` on `target`'s devices, meshed as train.py meshes them;
    `image_tokens`: merged image tokens per prompt (a vision-language model's programs), in
    `images` images (programs.Lowering.images)."""
    from grpo_jax import mesh as mesh_lib
    from grpo_jax.aot import hardware, programs

    check_config(cfg)
    model = model_config(cfg.model.name_or_path).replace(
        numerics=cfg.peft.base_numerics(cfg.numerics))
    check_images(cfg, model, image_tokens, images)
    mesh = mesh_lib.make_mesh(cfg.mesh, hardware.devices(target, **device_kw))
    return programs.Lowering(cfg, model, mesh, cfg.batch_plan(mesh_lib.batch_divisor(mesh)),
                             image_tokens, images)


def evaluate(target, run, *, full_depth: bool = True, phases=("generate", "logprobs", "update"),
             compiled: dict | None = None, small: dict | None = None) -> dict:
    """Compile `run`'s programs and measure them: memory per chip, collectives, FLOPs and HBM
    bytes (`hlo.cost`: every loop trip counted, the decode loop as running to
    max_completion_length). `full_depth=False` (the layout search's shortcut) compiles the
    sampler at QUICK_LAYERS only and takes its collectives and costs as linear in the layers
    and its memory as growing by what the last layer added (`_grown`) (its layers are
    unrolled, so a full-depth sampler compiles for minutes); the
    update and log-prob programs, which scan their layers, are compiled whole either way.
    `phases`: the programs to compile (the others are left out of the report). With decode
    slots (max_num_seqs) the generate phase's memory is the `refill` program's, which a run
    runs; its communication and costs stay the static `generate` program's (every row to
    max_completion_length). `compiled` (phase -> program) and `small` (the sampler at
    QUICK_LAYERS, {2: {...}, 3: {...}}): programs of this run compiled before, taken as they
    are (the search compiles a candidate's update first, and reuses its programs for the
    winner's report); both come back in the result."""
    from grpo_jax.aot import programs

    model = run.model
    compiled = dict(compiled or {})
    sampled = "generate" in phases and not full_depth
    whole = tuple(p for p in phases if (p != "generate" or full_depth) and p not in compiled)
    with backend_of(target):
        progs = programs.build(run, whole)
        compiled.update({k: _compile(k, v) for k, v in progs.lowered.items()})
        compiled = {k: v for k, v in compiled.items()
                    if (k if k != "refill" else "generate") in phases}
        small = {} if not sampled else small or {
            n: {k: _compile(f"{k} ({n} layer{'s' * (n > 1)})", v) for k, v in programs.build(
                run.with_layers(n), ("generate",)).lowered.items()}
            for n in QUICK_LAYERS}
        if sampled:  # a full-depth program handed in does not stand for the extrapolation
            compiled = {k: v for k, v in compiled.items() if k not in ("generate", "refill")}
    a, b = QUICK_LAYERS

    def depth(at_a, at_b):
        return report.Cost(_deeper(at_a.flops, at_b.flops, model.num_layers),
                           _deeper(at_a.bytes, at_b.bytes, model.num_layers))
    memory = _memory(run, progs, compiled)
    timed = {k: c for k, c in compiled.items() if k != "refill"}
    comm = {k: _comms(c, run, k) for k, c in timed.items()}
    cost = {k: _cost(c, run, k) for k, c in timed.items()}
    if sampled:  # the sampler's from its programs at QUICK_LAYERS
        by_n = {n: _memory(run.with_layers(n), programs.build(run.with_layers(n), ()),
                           small[n]) for n in QUICK_LAYERS}
        above = {n: by_n[n]["phases"]["generate"]["peak_GB"] - by_n[n]["resident_GB"]
                 for n in QUICK_LAYERS}
        temp = {n: by_n[n]["phases"]["generate"]["temporaries_GB"] for n in QUICK_LAYERS}
        memory["phases"]["generate"] = {
            "temporaries_GB": _grown(temp[a], temp[b], model.num_layers),
            "peak_GB": memory["resident_GB"] + _grown(above[a], above[b], model.num_layers),
            "from_layers": f"{a} and {b}"}
        if any(isinstance(c, Refused) for n in small.values() for c in n.values()):
            memory["phases"]["generate"]["refused_by_compiler"] = f"at {a} or {b} layers"
        at_a, at_b = (_comms(small[n]["generate"], run.with_layers(n), "generate")
                      for n in QUICK_LAYERS)
        comm["generate"] = None if at_a is None or at_b is None else _comm_by_layers(
            at_a, at_b, model.num_layers)
        at_a, at_b = (_cost(small[n]["generate"], run, "generate") for n in QUICK_LAYERS)
        cost["generate"] = None if at_a is None or at_b is None else depth(at_a, at_b)
    memory["phases"] = {k: memory["phases"][k] for k in programs.PHASES if k in phases}
    _verdict(memory, target.chip)
    return {"memory": memory, "comm": comm, "cost": cost, "progs": progs,
            "unknown_trips": run.cfg.generation.max_completion_length - 1,
            "compiled": compiled, "small": small}


def _cost(compiled, run, phase: str):
    """FLOPs and HBM bytes of one run of a program (None when the compiler refused it)."""
    from grpo_jax.aot import hlo

    if isinstance(compiled, Refused):
        return None
    C = run.cfg.generation.max_completion_length
    c = hlo.cost(compiled.as_text(), unknown_trips=C - 1 if phase == "generate" else 1)
    return report.Cost(c.flops, c.bytes)


def _memory(run, progs, compiled: dict) -> dict:
    """Memory per chip: resident state and each phase's peak (report.phase_memory)."""
    import jax

    from grpo_jax.aot import programs
    from grpo_jax.models import lora

    params = programs.shard_bytes(progs.state.params)  # with LoRA: the adapters
    opt = programs.shard_bytes(progs.state.opt_state)
    state = programs.shard_bytes(progs.state)
    base = programs.shard_bytes(progs.frozen)  # LoRA's frozen base (0 without LoRA)
    # train.py keeps a copy of the initial params, matrices in the compute dtype (norms: tiny);
    # LoRA's reference is the base with the adapters off: no copy.
    ref = (params * jax.numpy.dtype(run.model.dtype).itemsize / run.model.param_dtype.itemsize
           if run_facts.keeps_reference_copy(run.cfg) else 0.0)
    resident = state + ref + base
    mem = {k: c.memory_analysis() for k, c in compiled.items()}
    # Resident buffers among each program's arguments; a LoRA sampler that does not take the
    # adapters reads a merged copy, which is not resident: it counts in the generate phase.
    gen_reads = (params + base if progs.sampler_takes_adapters
                 else 0.0 if progs.frozen else params)
    reads = {"generate": (resident, gen_reads), "logprobs": (resident, params + base),
             "update": (ref, 0.0)}
    out = {}
    # With decode slots the run generates with `refill`: its memory is the generate phase's.
    for phase in sorted(mem, key=lambda k: k == "refill"):
        at = "generate" if phase == "refill" else phase
        out[at] = report.phase_memory(mem[phase], *reads[at])
        if isinstance(compiled[phase], Refused):  # XLA's figure: a lower bound on the peak
            out[at]["refused_by_compiler"] = compiled[phase].refused
    # The vision tower's share of the resident state: its params (frozen: no optimizer
    # moments) and their reference copy; with LoRA it is in the frozen base, beside its
    # adapters (trained, with their moments) where PEFT's rules adapt the tower.
    vision = sum(programs.shard_bytes(tree["vision"]) for tree in (progs.state.params,
                                                                      *progs.frozen)
                 if "vision" in tree)
    vision_ref = (vision * jax.numpy.dtype(run.model.dtype).itemsize
                  / run.model.param_dtype.itemsize if ref else 0.0)
    return {"params_GB": params / report.GB, "optimizer_state_GB": opt / report.GB,
            "vision_tower_GB": vision / report.GB, "vision_reference_GB": vision_ref / report.GB,
            "vision_adapted": bool(run.cfg.peft.use_peft
                                   and lora.tower_targets(run.cfg.peft, run.model)),
            "reference_params_GB": ref / report.GB, "frozen_base_GB": base / report.GB,
            "kv_cache_GB": programs.shard_bytes(progs.kv_cache) / report.GB,
            "resident_GB": resident / report.GB, "phases": out}


def _verdict(memory: dict, chip) -> None:
    peak = max(p["peak_GB"] for p in memory["phases"].values()) * report.GB
    memory.update(peak_GB=peak / report.GB, hbm_GB=chip.hbm_bytes / report.GB,
                  margin_GB=(chip.hbm_bytes - peak) / report.GB, fits=peak <= chip.hbm_bytes)


def _comms(compiled, run, phase: str) -> list | None:
    """The program's collectives (None when the compiler refused it). The sampler's decode loop
    has no trip count XLA knows (it stops once every row is done): it counts as running to
    max_completion_length, as the workload rows do."""
    from grpo_jax.aot import comms

    if isinstance(compiled, Refused):
        return None
    C = run.cfg.generation.max_completion_length
    colls, unknown = comms.collectives(compiled.as_text(), run.mesh,
                                       unknown_trips=C - 1 if phase == "generate" else 1)
    return [colls, unknown]


def _deeper(at_a: float, at_b: float, layers: int) -> float:
    """A cost (FLOPs, bytes, a collective's count) of the sampler at `layers` from its programs
    at QUICK_LAYERS: linear in the layers; where the deeper program costs less (the compiler
    laid the two out differently: Qwen3-8B's long-row decode on v5p-64 went negative), in
    proportion to the deeper one's layers instead."""
    a, b = QUICK_LAYERS
    if at_b >= at_a:
        return at_a + (at_b - at_a) * (layers - a)
    return at_b * layers / b


def _grown(at_a: float, at_b: float, layers: int) -> float:
    """A sampler's memory at `layers` from its programs at QUICK_LAYERS: the larger, plus what
    the last layer added for every layer after (never less: XLA reuses buffers across the
    unrolled layers, so the temporaries are not linear in them)."""
    return max(at_a, at_b) + max(at_b - at_a, 0.0) * max(layers - QUICK_LAYERS[1], 0)


def _comm_by_layers(at_a, at_b, layers: int) -> list:
    """Collectives of a program with `layers` layers from its programs at QUICK_LAYERS: the
    deeper one's, plus what its last layer added for every layer after."""
    import dataclasses as dc
    from collections import Counter

    key = lambda c: dc.replace(c, count=0)  # noqa: E731
    a, b = Counter(), Counter()
    for c in at_a[0]:
        a[key(c)] += c.count
    for c in at_b[0]:
        b[key(c)] += c.count
    out = [dc.replace(k, count=_deeper(a[k], b[k], layers)) for k in b]
    return [[c for c in out if c.count > 0], at_b[1]]


def per_round(run) -> dict:
    """Runs of each program per round: the sampler once, the log-prob program once per
    micro-batch of the generation batch per pass (reference, old), the update once per
    optimizer step."""
    plan, cfg = run.plan, run.cfg
    passes = run_facts.has_reference(cfg) + plan.needs_old_logps
    return {"generate": 1.0, "logprobs": float(passes * plan.steps_per_generation),
            "update": plan.steps_per_generation * plan.num_iterations
            / plan.gradient_accumulation_steps}


def run_phases(run, phases=("generate", "logprobs", "update")) -> tuple[str, ...]:
    """`phases` less those a round does not run (no log-prob pass: beta 0 and one update per
    generation batch)."""
    runs = per_round(run)
    return tuple(p for p in phases if runs[p] > 0)


def timing(run, target, ev: dict) -> tuple[dict | None, dict]:
    """The forecast (None without costs) and the communication per round."""
    from grpo_jax.aot import comms

    chip, runs, progs = target.chip, per_round(run), ev["progs"]
    if progs.decode_slots:  # the rows in waves through fewer slots: each wave a static decode
        runs["generate"] = float(-(-progs.sampler_rows // progs.decode_slots))
    communication = {}
    for phase, found in ev["comm"].items():
        if found is None:
            communication[phase] = None
            continue
        s = comms.summary(found[0], chip)
        k = runs[phase]
        communication[phase] = {
            "gb": s["gb"] * k, "seconds": s["seconds"] * k, "runs_per_round": k,
            "unknown_loops": found[1], "unknown_trips": ev["unknown_trips"],
            "by": {key: {n: v * k for n, v in e.items()} for key, e in s["by"].items()}}
    cost = ev["cost"]
    if not cost or any(c is None for c in cost.values()):
        return None, communication
    C = run.cfg.generation.max_completion_length
    per_phase = {k: c * runs[k] for k, c in cost.items()}
    plan, chips = run.plan, run.mesh.size
    model_flops = report.model_flops(
        run.model, plan.prompts_per_generation, plan.generation_batch_size, progs.prompt_width,
        C, runs["logprobs"] * plan.micro_batch_size / plan.generation_batch_size,
        runs["update"] * plan.micro_batch_size * plan.gradient_accumulation_steps,
        run_facts.planned_prompt_group(run.cfg, plan))
    phases = {}
    for k, c in per_phase.items():  # each with its own MFU, at both ends of its range
        comm_s = communication[k]["seconds"] if communication.get(k) else 0.0
        phases[k] = report.phase_time(c, comm_s, chip, model_flops[k] / chips)
        phases[k]["comm_gb"] = communication[k]["gb"] if communication.get(k) else 0.0
    total = sum(model_flops[k] for k in phases) / chips
    span = (sum(p["overlapped_s"] for p in phases.values()),
            sum(p["serial_s"] for p in phases.values()))
    return {"phases": phases, "round_s": span, "model_tflop": total / 1e12,
            "mfu": tuple(total / (t * chip.peak_flops) if t else 0.0 for t in span),
            # 6 x active parameters x tokens (a mixture of experts: each token's k experts
            # only; remat and attention excluded), per chip: what XLA's count compares to.
            "update_model_tflop": 6 * run.model.num_params(active=True) * plan.micro_batch_size
            * plan.gradient_accumulation_steps * (progs.prompt_width + C) / chips / 1e12
            }, communication


def image_facts(run) -> dict:
    """The report's image section: tokens, images and patches per prompt (Qwen2.5-VL: the
    patch grid)."""
    from grpo_jax.aot import programs
    shape, grid = run.tower_shape, programs.image_grid(run)
    return {"tokens": run.image_tokens, "images": shape.images, "patches": shape.patches,
            **({"grid": list(grid[0])} if grid else {})}


def summarize(target, cfg, run, ev: dict, start: float) -> dict:
    """The report's dict (rendered by report.render, written by --json)."""
    plan, chip, progs, model = run.plan, target.chip, ev["progs"], run.model
    devices = run.mesh.devices.flat
    C = cfg.generation.max_completion_length
    updates = plan.steps_per_generation * plan.num_iterations / plan.gradient_accumulation_steps
    memory = dict(ev["memory"])
    memory.pop("resident_GB", None)
    result = {
        "model": cfg.model.name_or_path, "params_B": model.num_params() / 1e9,
        "active_params_B": model.num_params(active=True) / 1e9,
        "vision_params_B": model.vision_params() / 1e9,
        "image": image_facts(run) if run.image_tokens else None,
        "topology": target.name, "chip": chip.name, "chips": run.mesh.size,
        "hosts": len({d.process_index for d in devices}), "mesh": dict(run.mesh.shape),
        "flags": flags_of(cfg),
        "lora": (None if not cfg.peft.use_peft else {
            "r": cfg.peft.lora_r, "target_modules": list(cfg.peft.target_modules()),
            "quant_bits": cfg.peft.quant_bits, "sampler": "the adapters on the base"
            if progs.sampler_takes_adapters else "a merged copy"}),
        "prompt_width": progs.prompt_width, "completion_length": C,
        "plan": {"generation_batch_size": plan.generation_batch_size,
                 "prompts": plan.prompts_per_generation, "num_generations": plan.num_generations,
                 "sampler_rows": progs.sampler_rows, "decode_slots": progs.decode_slots,
                 "updates_per_round": updates,
                 "rows_per_update": plan.micro_batch_size * plan.gradient_accumulation_steps},
        "memory_per_chip": memory,
    }
    if model.num_experts:
        from grpo_jax.models import gmm
        result["experts_kernel"] = gmm.describe(
            model.numerics.moe_gmm, target.platform, run.mesh.devices.flat[0].device_kind,
            model.hidden_size, model.moe_intermediate_size)
    if model.num_experts and not progs.decode_slots:  # the sampler records the routing
        from grpo_jax import mesh as mesh_lib
        record = report.routing_record_bytes(model, progs.sampler_rows, progs.prompt_width + C)
        shards = mesh_lib.batch_divisor(run.mesh)
        result["routing_record"] = {"GB": record / report.GB, "row_shards": shards,
                                    "per_chip_GB": record / shards / report.GB}
    time_, communication = timing(run, target, ev)
    result["communication"] = communication
    if time_:
        result["time"] = time_
    with backend_of(target):
        attention = _attention_kernel(run, progs.prompt_width)
    result.update(attention=attention,
                  compile_s=time.perf_counter() - start, libtpu=_version("libtpu"),
                  host=f"{platform.machine()} x{os.cpu_count()}")
    return result


def _attention_kernel(run, prompt_width: int) -> str:
    """The update's attention kernel over a whole row (Decoder's _attend decides the same
    way): splash falls back to the blockwise attention where its blocks do not tile."""
    from grpo_jax import mesh as mesh_lib
    from grpo_jax.models import attention

    cfg, cp = run.cfg, mesh_lib.context_size(run.mesh)
    C = cfg.generation.max_completion_length
    keys = prompt_width + C
    kernel = run.model.attention_kernel(keys, context_parallel=cp > 1 and C % cp == 0,
                                        rows=run.plan.micro_batch_size
                                        // mesh_lib.batch_divisor(run.mesh) or 1)
    if kernel == "splash" and not attention.splash_fits(C, keys, run.model.attention_block,
                                                        cp if C % cp == 0 else 1):
        return "flash"
    return kernel


def flags_of(cfg) -> list[str]:
    """The layout flags of `cfg`: mesh, per-device batch, accumulation, decode slots, remat."""
    from grpo_jax import mesh as mesh_lib
    b, n = cfg.batch, cfg.numerics
    out = mesh_lib.flags(cfg.mesh) + [
        "--per_device_train_batch_size", str(b.per_device_train_batch_size),
        "--gradient_accumulation_steps", str(b.gradient_accumulation_steps)]
    if b.generation_batch_size is not None:
        out += ["--generation_batch_size", str(b.generation_batch_size)]
    if cfg.generation.max_num_seqs is not None:
        out += ["--max_num_seqs", str(cfg.generation.max_num_seqs)]
    return out + (["--remat_policy", n.remat_policy] if n.remat else ["--remat", "false"])


@dataclasses.dataclass(frozen=True)
class RefusedMemory:
    """memory_analysis() of a program the compiler refused: the temporaries it asked for."""
    temp_size_in_bytes: float
    argument_size_in_bytes: int = 0
    output_size_in_bytes: int = 0
    alias_size_in_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Refused:
    """What _compile gives for a program the TPU compiler refused for want of HBM."""
    refused: str  # the compiler's first line
    temp_bytes: float

    def memory_analysis(self) -> RefusedMemory:
        return RefusedMemory(self.temp_bytes)


# XLA's human-readable sizes: 512B, 1.50K, 11.17T (TPU), 3.20GiB (tsl's form); powers of 1024.
_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}
_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGTPE]?)(?:i?B)?\s*$")


def parse_size(text: str) -> float | None:
    """Bytes of a size as XLA writes it (`11.17T`, `512B`, `1.5GiB`, `4096`); None when it is
    none of those."""
    m = _SIZE.match(text)
    if not m:
        return None
    try:
        return float(m.group(1)) * 1024 ** _UNITS[m.group(2)]
    except ValueError:  # "1.2.3"
        return None


def refused_temporaries(message: str) -> float | None:
    """The temporaries (bytes) a compiler's RESOURCE_EXHAUSTED message says a program needs
    ("... HLO temporaries (11.17T) ..."); None for any other message."""
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    m = re.search(r"HLO temporaries \(([^()]*)\)", message)
    return parse_size(m.group(1)) if m else None


def _compile(phase: str, lowered, quiet: bool = False):
    """The compiled program, or, where the TPU compiler refuses it for want of HBM, the
    temporaries it asked for (a stand-in with memory_analysis()). Any other refusal, or one
    whose size can't be read, is a GrpoJaxError with the compiler's first line."""
    import jax

    start = time.perf_counter()
    try:
        out = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        temp = refused_temporaries(str(e))
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if temp is None:
            hint = ("a layout needing less memory may compile: more chips, --auto, shorter "
                    "rows" if "RESOURCE_EXHAUSTED" in str(e) else "the layout or model is one "
                    "this compiler does not take: try another mesh")
            raise GrpoJaxError(f"the compiler refused the {phase} program: {first[:400]} "
                               f"({hint})") from None
        out = Refused(first, temp)
    if not quiet:
        print(f"compiled {phase} in {time.perf_counter() - start:.0f} s", file=sys.stderr,
              flush=True)
    return out


def _version(package: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
