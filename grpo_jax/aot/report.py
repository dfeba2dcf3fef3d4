"""Per-chip memory and roofline time of a round, from the compiled programs.

Memory: what stays resident (TrainState, the reference params when beta > 0) plus, per phase,
the compiled program's own arguments, outputs and temporaries (XLA's memory_analysis); the peak
phase decides whether it fits. Time: each program's FLOPs and HBM bytes (XLA's cost_analysis,
per chip) over the chip's peaks, max(compute, memory): a floor that ignores communication.
"""

from __future__ import annotations

import dataclasses

from grpo_jax.aot.hardware import Chip

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Cost:
    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, o: "Cost") -> "Cost":
        return Cost(self.flops + o.flops, self.bytes + o.bytes)

    def __sub__(self, o: "Cost") -> "Cost":
        return Cost(self.flops - o.flops, self.bytes - o.bytes)

    def __mul__(self, k: float) -> "Cost":
        return Cost(self.flops * k, self.bytes * k)

    def seconds(self, chip: Chip) -> float:
        return max(self.flops / chip.peak_flops, self.bytes / chip.hbm_bandwidth)


def cost_of(compiled) -> Cost:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, list) else c
    return Cost(float(c.get("flops", 0.0)), float(c.get("bytes accessed", 0.0))) if c else Cost()


def by_layers(one: Cost, two: Cost, layers: int) -> Cost:
    """Layers are identical, so a program's cost is linear in their count: from the 1- and
    2-layer compiles, the L-layer cost."""
    return one + (two - one) * (layers - 1)


def phase_memory(mem, resident: float, in_resident: float) -> dict:
    """A program's peak on the chip: the resident state, plus its arguments not already in it
    (`in_resident`: bytes of its arguments that are resident buffers), its outputs not aliased
    to donated arguments, and its temporaries."""
    extra = max(mem.argument_size_in_bytes - in_resident + mem.output_size_in_bytes
                - mem.alias_size_in_bytes, 0)
    return {"temporaries_GB": mem.temp_size_in_bytes / GB,
            "peak_GB": (resident + extra + mem.temp_size_in_bytes) / GB}


def render(r: dict) -> str:
    """The report as text (`r` is what __main__ also writes as JSON)."""
    m, t = r["memory_per_chip"], r.get("time")
    lines = [
        f"{r['model']} ({r['params_B']:.2f}B params"
        + (f", {r['active_params_B']:.2f}B active" if r.get("active_params_B", r["params_B"])
           < r["params_B"] else "") + f") on {r['topology']}: {r['chips']} x "
        f"{r['chip']}, mesh {r['mesh']}, {r['hosts']} hosts",
        f"round: {r['plan']['generation_batch_size']} completions ({r['plan']['prompts']} prompts"
        f" x {r['plan']['num_generations']}), prompt {r['prompt_width']} + completion "
        f"{r['completion_length']} tokens, {r['plan']['updates_per_round']:g} update(s) of "
        f"{r['plan']['rows_per_update']} rows" + (
            f"; generated through {r['plan']['decode_slots']} decode slots (max_num_seqs), "
            "refilled as rows finish" if r["plan"].get("decode_slots") else ""),
        "", "memory per chip (GB):",
        f"  params {m['params_GB']:.2f}  optimizer state {m['optimizer_state_GB']:.2f}  "
        f"reference params {m['reference_params_GB']:.2f}  KV cache {m['kv_cache_GB']:.2f}",
    ]
    if r.get("lora"):
        lo = r["lora"]
        bits = f", base in {lo['quant_bits']} bits" if lo["quant_bits"] else ""
        lines[3:3] = [f"LoRA r={lo['r']} on {', '.join(lo['target_modules'])}{bits}; the "
                      f"sampler runs {lo['sampler']}"]
        lines[-1] = (f"  adapters {m['params_GB']:.2f}  their optimizer state "
                     f"{m['optimizer_state_GB']:.2f}  frozen base {m['frozen_base_GB']:.2f}  "
                     f"KV cache {m['kv_cache_GB']:.2f}")
    for phase, p in m["phases"].items():
        lines.append(f"  {phase:<9} temporaries {p['temporaries_GB']:7.2f}   peak "
                     f"{p['peak_GB']:7.2f}" + ("  (at least: the compiler refused it)"
                                              if "refused_by_compiler" in p else ""))
    verdict = "fits" if m["fits"] else "does NOT fit"
    lines.append(f"  peak {m['peak_GB']:.2f} of {m['hbm_GB']:.0f} GB HBM: {verdict} "
                 f"({'margin' if m['fits'] else 'over by'} {abs(m['margin_GB']):.2f} GB)")
    lines.append(f"  compiled in {r['compile_s']:.0f} s on {r['host']} (jax {r['jax']}"
                 f"{', libtpu ' + r['libtpu'] if r.get('libtpu') else ''})")
    if t is None:
        return "\n".join(lines)
    lines += ["", "roofline per chip (XLA cost analysis; communication not included):"]
    for phase, p in t["phases"].items():
        lines.append(f"  {phase:<9} {p['tflop']:10.2f} TFLOP {p['gb']:10.1f} GB  "
                     f"{p['seconds']:8.3f} s ({p['bound']}-bound)")
    lines.append(f"  round     {t['round_s']:.3f} s  ({t['per_update_s']:.3f} s per optimizer "
                 f"update)")
    if "update_model_tflop" in t:
        lines.append(f"  an update's model FLOPs (6 x active params x tokens, per chip): "
                     f"{t['update_model_tflop']:.2f} TFLOP")
    return "\n".join(lines)
