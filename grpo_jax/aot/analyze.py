"""`python -m grpo_jax.aot`: compile a run's programs for a TPU slice or GPUs this machine does
not have, and report memory per chip and roofline time. See docs/scaling.md.

    python -m grpo_jax.aot --topology v5e-16 --model_name_or_path qwen2.5-7b \\
        --max_prompt_length 512 --max_completion_length 1024 --num_generations 8 \\
        --per_device_train_batch_size 1 --gradient_accumulation_steps 8 --fsdp -1 --dp 1

Own options: --topology NAME (v5e:4x4, v5p:4x4x4, v6e:8x8, v5e-16, v5p-128, h100:8),
--num_slices N (TPU slices joined over DCN; the data axis spans them), --json PATH, --quick
(skip the cost compiles). Every other option is a training option with TRL's name, as
grpo-jax-train takes it (--config NAME|PATH, --set key=value, --key value); the model is
--model_name_or_path: a preset (grpo_jax.models.presets), an HF config.json or a directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import sys
import time
import types
from pathlib import Path
from unittest import mock

from grpo_jax.errors import GrpoJaxError


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
    try:
        from jax._src.lib import cuda_versions
        return cuda_versions is not None and bool(cuda_versions.cudnn_get_version())
    except Exception:  # noqa: BLE001 - no cuDNN library installed
        return False


@contextlib.contextmanager
def backend_of(target):
    """Trace as on the target: on a GPU, attention_impl "auto" picks cuDNN where a run would
    (this process runs on the CPU backend). Tracing cuDNN attention needs the cuDNN library
    (`pip install nvidia-cudnn-cu13`); without it attention is XLA's, which holds the scores in
    HBM: the memory figures then err high."""
    import jax

    from grpo_jax.models import config as model_config_lib
    gpu = target.platform == "cuda" and _has_cudnn()
    backend = "gpu" if gpu else jax.default_backend()
    with mock.patch.object(model_config_lib, "jax",
                           types.SimpleNamespace(default_backend=lambda: backend)):
        yield


def make_run(target, cfg, **device_kw):
    """The run `cfg` on `target`'s devices, meshed as train.py meshes them."""
    from grpo_jax import mesh as mesh_lib
    from grpo_jax.aot import hardware, programs

    if cfg.data.max_prompt_length is None:
        raise GrpoJaxError("set --max_prompt_length: the programs are compiled for one prompt "
                           "length (the sampler's bucket that holds it)")
    model = model_config(cfg.model.name_or_path).replace(
        numerics=cfg.peft.base_numerics(cfg.numerics))
    mesh = mesh_lib.make_mesh(cfg.mesh, hardware.devices(target, **device_kw))
    return programs.Run(cfg, model, mesh, cfg.batch_plan(mesh_lib.batch_divisor(mesh)))


def analyze(target, cfg, quick: bool = False) -> dict:
    import jax

    from grpo_jax.aot import programs, report

    start = time.perf_counter()
    run = make_run(target, cfg)
    devices, model = run.mesh.devices.flat, run.model
    with backend_of(target):
        progs = programs.build(run)
        # With decode slots the run generates with `refill`; the static program stays for
        # the roofline (its decode step's cost).
        skip = ("prefill", "generate") if progs.decode_slots else ("prefill",)
        compiled = {k: _compile(k, v) for k, v in progs.lowered.items() if k not in skip}
        costs = {}
        # XLA's GPU compiler gives no cost analysis without a device: no roofline there.
        if not quick and target.platform == "tpu":
            with programs.unrolled_scans():
                small = [programs.build(run.with_layers(n)).lowered for n in (1, 2)]
            try:
                for phase in ("generate", "prefill", "logprobs", "update"):
                    one, two = (report.cost_of(lo[phase].compile()) for lo in small)
                    costs[phase] = report.by_layers(one, two, model.num_layers)
            except jax.errors.JaxRuntimeError as e:
                # Unrolled loops keep more alive than the real program: XLA may refuse them.
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                costs = {}
                print(f"no roofline: the unrolled {phase} program does not fit in HBM",
                      file=sys.stderr)

    plan, chip = run.plan, target.chip
    params = programs.shard_bytes(progs.state.params)  # with LoRA: the adapters
    opt = programs.shard_bytes(progs.state.opt_state)
    state = programs.shard_bytes(progs.state)
    base = programs.shard_bytes(progs.frozen)  # LoRA's frozen base (0 without LoRA)
    # train.py keeps a copy of the initial params, matrices in the compute dtype (norms: tiny);
    # LoRA's reference is the base with the adapters off: no copy.
    ref = (params * jax.numpy.dtype(run.model.dtype).itemsize / run.model.param_dtype.itemsize
           if cfg.loss.beta and not progs.frozen else 0.0)
    resident = state + ref + base
    mem = {k: c.memory_analysis() for k, c in compiled.items()}
    # Resident buffers among each program's arguments; a LoRA sampler that does not take the
    # adapters reads a merged copy, which is not resident: it counts in the generate phase.
    gen_reads = (params + base if progs.sampler_takes_adapters
                 else 0.0 if progs.frozen else params)
    phases = {"generate": report.phase_memory(mem.get("refill", mem.get("generate")), resident,
                                              gen_reads),
              "logprobs": report.phase_memory(mem["logprobs"], resident, params + base),
              "update": report.phase_memory(mem["update"], ref, 0.0)}
    for phase, c in compiled.items():
        if hasattr(c, "refused"):  # XLA's figure: a lower bound on the peak
            phases["generate" if phase == "refill" else phase]["refused_by_compiler"] = c.refused
    peak = max(p["peak_GB"] for p in phases.values()) * report.GB
    C = cfg.generation.max_completion_length
    updates = plan.steps_per_generation * plan.num_iterations / plan.gradient_accumulation_steps
    result = {
        "model": cfg.model.name_or_path, "params_B": model.num_params() / 1e9,
        "active_params_B": model.num_params(active=True) / 1e9,
        "topology": target.name, "chip": chip.name, "chips": run.mesh.size,
        "hosts": len({d.process_index for d in devices}), "mesh": dict(run.mesh.shape),
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
        "memory_per_chip": {
            "params_GB": params / report.GB, "optimizer_state_GB": opt / report.GB,
            "reference_params_GB": ref / report.GB, "frozen_base_GB": base / report.GB,
            "kv_cache_GB": programs.shard_bytes(progs.kv_cache) / report.GB,
            "phases": phases, "peak_GB": peak / report.GB, "hbm_GB": chip.hbm_bytes / report.GB,
            "margin_GB": (chip.hbm_bytes - peak) / report.GB, "fits": peak <= chip.hbm_bytes},
    }
    if costs:
        decode = costs["generate"] - costs["prefill"]  # the loop's body, counted once
        per_phase = {"generate": costs["prefill"] + decode * (C - 1),
                     "logprobs": costs["logprobs"] * ((cfg.loss.beta > 0) + plan.needs_old_logps),
                     "update": costs["update"] * updates}
        seconds = {"generate": costs["prefill"].seconds(chip) + (C - 1) * decode.seconds(chip),
                   "logprobs": per_phase["logprobs"].seconds(chip),
                   "update": per_phase["update"].seconds(chip)}
        result["time"] = {
            "phases": {k: {"tflop": c.flops / 1e12, "gb": c.bytes / report.GB,
                           "seconds": seconds[k],
                           "bound": "compute" if c.flops / chip.peak_flops
                           >= c.bytes / chip.hbm_bandwidth else "memory"}
                       for k, c in per_phase.items()},
            "round_s": sum(seconds.values()),
            "per_update_s": costs["update"].seconds(chip),
            # 6 x active parameters x tokens (a mixture of experts: each token's k experts
            # only; remat and attention excluded), per chip: what XLA's count compares to.
            "update_model_tflop": 6 * model.num_params(active=True) * plan.micro_batch_size
            * plan.gradient_accumulation_steps * (progs.prompt_width + C) / run.mesh.size / 1e12}
    result.update(attention="cudnn" if target.platform == "cuda" and _has_cudnn() else "xla",
                  compile_s=time.perf_counter() - start, jax=jax.__version__,
                  libtpu=_version("libtpu"), host=f"{platform.machine()} x{os.cpu_count()}")
    return result


def _compile(phase: str, lowered):
    """The compiled program, or, where the TPU compiler refuses it for want of HBM, the
    temporaries it asked for (a stand-in with memory_analysis())."""
    import jax

    start = time.perf_counter()
    try:
        out = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        need = re.search(r"HLO temporaries \(([\d.]+)([GMK])\)", str(e))
        if "RESOURCE_EXHAUSTED" not in str(e) or not need:
            raise
        temp = float(need.group(1)) * {"G": 2**30, "M": 2**20, "K": 2**10}[need.group(2)]
        out = types.SimpleNamespace(memory_analysis=lambda: types.SimpleNamespace(
            argument_size_in_bytes=0, output_size_in_bytes=0, alias_size_in_bytes=0,
            temp_size_in_bytes=temp), refused=str(e).splitlines()[0])
    print(f"compiled {phase} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return out


def _version(package: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m grpo_jax.aot", add_help=False)
    p.add_argument("--topology")
    p.add_argument("--num_slices", "--num-slices", type=int, default=1)
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("-h", "--help", action="store_true")
    args, rest = p.parse_known_args(argv)
    if args.help:
        print(__doc__)
        raise SystemExit(0)
    try:
        if not args.topology:
            raise GrpoJaxError("--topology is required, e.g. --topology v5e:4x4 or h100:8")
        import jax
        jax.config.update("jax_platforms", "cpu")  # compile only: never open an accelerator
        from grpo_jax import cli
        from grpo_jax.aot import hardware, report
        target = hardware.parse_target(args.topology, args.num_slices)
        result = analyze(target, cli.parse_cli(rest), quick=args.quick)
    except GrpoJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(report.render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result
