"""Per-chip memory and forecast time of a round, from the compiled programs.

Memory: what stays resident (TrainState, the reference params when beta > 0) plus, per phase,
the compiled program's own arguments, outputs and temporaries (XLA's memory_analysis); the peak
phase decides whether it fits. Time, per phase: compute (XLA's FLOPs over the chip's peak), HBM
(XLA's bytes accessed over its bandwidth) and communication (the programs' collectives over the
interconnect, `comms`); the forecast is a range, from everything overlapped (the largest of the
three) to nothing overlapped (their sum). MFU: the model's FLOPs (`model_flops`: 2 per weight
and token forward, 6 with the backward, attention included, no rematerialisation) over the
forecast time and the chips' peak. A phase whose compiled FLOPs come out below the model's
takes the model's for its compute time (`phase_time`): the MFU never exceeds 100%.
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


def phase_time(cost: Cost, comm_s: float, chip: Chip, model_flops: float = 0.0) -> dict:
    """A phase's compute, HBM and communication seconds, its forecast range and MFU at both
    ends of it. `model_flops` (per chip, `model_flops`) is the least work the phase does:
    where the compiled program's count is below it (work the count can't see, as in a kernel
    without a cost estimate) the compute time is the model's, and `floored` says so; the MFU
    is then at most 100%."""
    flops = max(cost.flops, model_flops)
    compute, hbm = flops / chip.peak_flops, cost.bytes / chip.hbm_bandwidth
    span = (max(compute, hbm, comm_s), compute + hbm + comm_s)
    return {"tflop": cost.flops / 1e12, "model_tflop": model_flops / 1e12,
            "floored": cost.flops < model_flops, "gb": cost.bytes / GB, "compute_s": compute,
            "hbm_s": hbm, "comm_s": comm_s, "overlapped_s": span[0], "serial_s": span[1],
            "mfu": tuple(model_flops / (t * chip.peak_flops) if t else 0.0 for t in span),
            "bound": max((compute, "compute"), (hbm, "memory"), (comm_s, "communication"))[1]}


def matmul_params(m) -> int:
    """Weights a token meets in matmuls (attention and MLP projections, the LM head); in a
    mixture of experts' sparse layers, the router and the token's k experts only."""
    d = m.hidden_size
    attention = d * (m.q_size + 2 * m.kv_size) + m.q_size * d
    sparse = sum(m.moe_layers)
    experts = d * m.num_experts + m.num_experts_per_tok * 3 * d * m.moe_intermediate_size
    return (m.num_layers * attention + (m.num_layers - sparse) * 3 * d * m.intermediate_size
            + sparse * experts + m.vocab_size * d)


def forward_flops(m, tokens: float, context: float) -> float:
    """A forward pass over `tokens` tokens that attend to `context` keys each on average: 2 FLOPs
    per matmul weight, and 4 per (query, key, head dim) for the scores and their weighted sum."""
    return tokens * (2 * matmul_params(m) + 4 * m.num_layers * m.q_size * context)


def model_flops(m, prompts: int, rows: int, prompt: int, completion: int, logprob_passes: float,
                update_rows: float, group: int = 1) -> dict:
    """The model FLOPs of a round, as MFU counts them: the sampler's prefill (each prompt once)
    and decode (every row, every token), `logprob_passes` forwards over the generation batch,
    and forward + backward (3 forwards) over `update_rows` rows, their prompts once per `group`
    rows (numerics.shared_prefix); attention causal (a token sees half its prefix on
    average)."""
    def rows_of(n):  # a forward over n rows
        return (forward_flops(m, n / group * prompt, prompt / 2)
                + forward_flops(m, n * completion, prompt + completion / 2))
    return {"generate": forward_flops(m, prompts * prompt, prompt / 2)
            + forward_flops(m, rows * (completion - 1), prompt + completion / 2),
            "logprobs": logprob_passes * rows_of(rows), "update": 3 * rows_of(update_rows)}


def routing_record_bytes(m, rows: int, tokens: int) -> int:
    """Bytes of the routing a mixture of experts' sampler records for `rows` rows of `tokens`
    prompt + completion tokens (routing replay, router/mismatch): a top-k expert index per
    token, sparse layer and k, int8 up to 127 experts, else int16 (models/moe.routing_dtype);
    0 for a dense model."""
    if not m.num_experts:
        return 0
    return rows * tokens * sum(m.moe_layers) * m.num_experts_per_tok * (
        1 if m.num_experts <= 127 else 2)


def phase_memory(mem, resident: float, in_resident: float) -> dict:
    """A program's peak on the chip: the resident state, plus its arguments not already in it
    (`in_resident`: bytes of its arguments that are resident buffers), its outputs not aliased
    to donated arguments, and its temporaries."""
    extra = max(mem.argument_size_in_bytes - in_resident + mem.output_size_in_bytes
                - mem.alias_size_in_bytes, 0)
    return {"temporaries_GB": mem.temp_size_in_bytes / GB,
            "peak_GB": (resident + extra + mem.temp_size_in_bytes) / GB}


def _params_split(r: dict) -> str:
    """A vision-language model's params as the language model's and the tower's; a mixture of
    experts' active params (those one token runs through)."""
    if r.get("vision_params_B"):
        return (f": {r['params_B'] - r['vision_params_B']:.2f}B language model + "
                f"{r['vision_params_B']:.2f}B vision tower")
    active = r.get("active_params_B", r["params_B"])
    return f", {active:.2f}B active" if active < r["params_B"] else ""


def render(r: dict) -> str:
    """The report as text (`r` is what __main__ also writes as JSON)."""
    m, t = r["memory_per_chip"], r.get("time")
    lines = [
        f"{r['model']} ({r['params_B']:.2f}B params" + _params_split(r)
        + f") on {r['topology']}: {r['chips']} x "
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
    state_line = len(lines) - 1  # LoRA's replaces it (the tower's line may follow)
    if m.get("vision_tower_GB"):
        image = r.get("image")
        grid = f", patch grid {'x'.join(map(str, image['grid']))}" if image and image.get(
            "grid") else ""
        state = ("its LoRA adapters trained" if m.get("vision_adapted")
                 else "frozen: no optimizer state")
        # (With LoRA the params are the adapters; the tower's weights are in the frozen base.)
        share = "" if r.get("lora") else f" ({m['vision_tower_GB'] / m['params_GB']:.0%})"
        lines.append(f"  of which the vision tower ({state}): params "
                     f"{m['vision_tower_GB']:.2f}{share}"
                     f"  reference {m['vision_reference_GB']:.2f}"
                     + (f"; {image['tokens']} image tokens per prompt ({image['images']} "
                        f"image(s) of {image['patches']} patches{grid})" if image else
                        "; programs compiled without images (--image-tokens)"))
    if r.get("routing_record"):
        rec = r["routing_record"]
        lines.append(f"  routing record (top-k experts per token and sparse layer, the "
                     f"generate program's output): {rec['GB']:.3f} GB a round, "
                     f"{rec['per_chip_GB']:.4f} GB per chip (rows over {rec['row_shards']})")
    if r.get("lora"):
        lo = r["lora"]
        bits = f", base in {lo['quant_bits']} bits" if lo["quant_bits"] else ""
        lines[state_line] = (f"  adapters {m['params_GB']:.2f}  their optimizer state "
                             f"{m['optimizer_state_GB']:.2f}  frozen base "
                             f"{m['frozen_base_GB']:.2f}  KV cache {m['kv_cache_GB']:.2f}")
        lines[3:3] = [f"LoRA r={lo['r']} on {', '.join(lo['target_modules'])}{bits}; the "
                      f"sampler runs {lo['sampler']}"]
    if r.get("mesh_chosen"):
        flags = " ".join(f"--{k} {v}" for k, v in _mesh_flags(r["mesh"]).items())
        lines.insert(1, f"layout chosen by aot (no mesh settings given): {flags}")
    for phase, p in m["phases"].items():
        lines.append(f"  {phase:<9} temporaries {p['temporaries_GB']:7.2f}   peak "
                     f"{p['peak_GB']:7.2f}" + ("  (at least: the compiler refused it)"
                                              if "refused_by_compiler" in p else ""))
    verdict = "fits" if m["fits"] else "does NOT fit"
    lines.append(f"  peak {m['peak_GB']:.2f} of {m['hbm_GB']:.0f} GB HBM: {verdict} "
                 f"({'margin' if m['fits'] else 'over by'} {abs(m['margin_GB']):.2f} GB)")
    lines.append(f"  attention: {r['attention']}; compiled in {r['compile_s']:.0f} s on "
                 f"{r['host']} (jax {r['jax']}"
                 f"{', libtpu ' + r['libtpu'] if r.get('libtpu') else ''})")
    if r.get("experts_kernel"):
        lines.append(f"  experts' grouped matmuls: {r['experts_kernel']}")
    if r.get("chosen"):
        lines.insert(1, f"layout: {r['chosen']}")
    if r.get("search"):
        lines += render_search(r["search"])
    if r.get("split"):
        lines += render_split(r["split"])
    if r.get("chosen") or r.get("search"):
        lines += ["", "run with: " + " ".join(r.get("command") or [
            "python -m grpo_jax.train", "[the other flags]", *r["flags"]])]
    if r.get("communication"):
        lines += render_comms(r)
    if t is None:
        return "\n".join(lines)
    lines += ["", "forecast per chip (compute: XLA's FLOPs at peak; HBM: its bytes at full "
              "bandwidth; comm: collectives at ICI/DCN bandwidth):",
              f"  {'phase':<9} {'TFLOP':>9} {'HBM GB':>9} {'comm GB':>9} {'compute s':>10} "
              f"{'HBM s':>9} {'comm s':>9}  forecast s (overlapped - serial), MFU"]
    for phase, p in t["phases"].items():
        lines.append(f"  {phase:<9} {p['tflop']:9.2f} {p['gb']:9.1f} {p['comm_gb']:9.2f} "
                     f"{p['compute_s']:10.3f} {p['hbm_s']:9.3f} {p['comm_s']:9.3f}  "
                     f"{p['overlapped_s']:.3f} - {p['serial_s']:.3f} ({p['bound']}-bound), "
                     f"{_percent(p['mfu'][1])}-{_percent(p['mfu'][0])}%"
                     + ("  *" if p.get("floored") else ""))
    floored = [k for k, p in t["phases"].items() if p.get("floored")]
    if floored:
        lines.append(f"  * {', '.join(floored)}: the compiled programs' FLOPs are below the "
                     "model's (work the count can't see); compute taken at the model's FLOPs")
    lines.append(f"  round     {t['round_s'][0]:.3f} - {t['round_s'][1]:.3f} s; forecast MFU "
                 f"{_percent(t['mfu'][1])}% - {_percent(t['mfu'][0])}% "
                 f"({t['model_tflop']:.1f} model TFLOP per chip)")
    if "update_model_tflop" in t:
        # A vision-language model's update trains the language model only (the tower frozen).
        counted = "language-model" if r.get("vision_params_B") else "active"
        lines.append(f"  an update's model FLOPs (6 x {counted} params x tokens, per chip): "
                     f"{t['update_model_tflop']:.2f} TFLOP")
    return "\n".join(lines)


def _percent(mfu: float) -> str:
    """An MFU as a percentage, never above 100 (phase_time keeps it there; this guards the
    text against a rounding)."""
    return f"{100 * min(mfu, 1.0):.1f}"


def render_search(s: dict) -> list[str]:
    lines = ["", f"layout search (--auto{' --quick' if s['quick'] else ''}): {s['layouts']} "
             f"layouts, {s['ruled_out_by_estimate']} ruled out by the estimate, "
             f"{len(s['compiled'])} compiled in {s['search_s']:.0f} s"
             + (f", {s['skipped_as_slower']} more not compiled (their estimated round over "
                f"{s['far']:.2f}x the best fitting one's)" if s.get("skipped_as_slower") else "")
             + ":"]
    for c in s["compiled"]:
        round_ = f"{c['round_s']:8.2f} s" if c["round_s"] else "       -  "
        lines.append(f"  {'fits   ' if c['fits'] else 'no room'} peak {c['peak_GB']:6.2f} GB  "
                     f"round {round_}  {c['layout']} ({'; '.join(c['programs'])})")
    lines.append(f"  winner: {s['winner']}")
    if s["runner_up"]:
        lines.append(f"  runner-up: {s['runner_up']['layout']}: {s['runner_up']['why']} "
                     f"({' '.join(s['runner_up']['flags'])})")
    return lines


def render_split(f: dict) -> list[str]:
    """aot/split.py's forecast: the round colocated and each split."""
    c = f["colocated"]
    lines = ["", "colocated or split (the estimate's clock, both sides laid out by it):",
             f"  colocated   round {c['round_s']:9.3g} s = generate {c['generate_s']:.3g} + "
             f"train {c['train_s']:.3g}   ({c['layout']})"]
    for s in f["splits"]:
        lines.append(
            f"  {s['sampler_chips']:>3} + {s['trainer_chips']:<3}  round {s['round_s']:9.3g} s: "
            f"generate {s['generate_s']:.3g} + weights {s['weights_move_s']:.2g} | train "
            f"{s['train_s']:.3g}; idle sampler {s['idle_sampler_s']:.3g}, trainer "
            f"{s['idle_trainer_s']:.3g}   (sampler: {s['sampler']}; trainer: {s['trainer']})")
    lines.append(f"  choice: {f['why']}")
    return lines


def render_comms(r: dict) -> list[str]:
    """Communication per phase: bytes per chip and seconds by collective and mesh axes."""
    lines = ["", "communication per chip (collectives of the compiled programs, loops counted "
             "by trip count):"]
    for phase, c in r["communication"].items():
        if c is None:
            lines.append(f"  {phase:<9} not counted (the compiler refused the program)")
            continue
        lines.append(f"  {phase:<9} {c['gb']:9.2f} GB {c['seconds']:9.3f} s per round"
                     + (f"  ({c['unknown_loops']} loop(s) of unknown length counted "
                        f"{c['unknown_trips']:g} times)" if c["unknown_loops"] else ""))
        for key, e in sorted(c["by"].items(), key=lambda kv: -kv[1]["seconds"])[:4]:
            lines.append(f"     {key:<40} {e['count']:10.0f} x  {e['gb']:9.2f} GB "
                         f"{e['seconds']:9.3f} s")
    return lines


def _mesh_flags(mesh: dict) -> dict:
    """The mesh's axis sizes as the training flags that give it."""
    names = {"data": "dp", "fsdp": "fsdp", "context": "cp", "tensor": "tp"}
    return {names[a]: n for a, n in mesh.items()}
