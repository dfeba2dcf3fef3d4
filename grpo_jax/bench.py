"""`python -m grpo_jax.bench {sampler,train-step,e2e,lora-sampler,refill,mismatch,partial,split}`:
speed vs hardware limits, decode slots refilled against static sub-batches on long-tailed
lengths, the sampler-trainer log-prob mismatch (TRL's sampling/* figures) in the workload's
dtype, partial rollouts against refilled rounds in trained groups per second, and partial
rollouts on one set of devices against a sampler and a trainer on devices of their own (with
each side's idle time).

Defaults are the issue's workload: the Qwen2-0.5B architecture with random weights, 8 prompts x
8 completions, 256 prompt tokens, 256 completion tokens forced (no early stop), bf16. `--tiny`
swaps in a small model so the benchmark runs (and stays working) on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax import distributed as dist
from grpo_jax import mesh as mesh_lib
from grpo_jax import run_facts
from grpo_jax.config import BatchArgs, BatchPlan, GRPOArgs, TrainConfig
from grpo_jax.grpo.batch import Batch
from grpo_jax.metrics import timing
from grpo_jax.models import Decoder, ModelConfig, lora, presets, quant
from grpo_jax.models.lora import PeftArgs
from grpo_jax.rollout.native.disaggregated import SplitRollouts
from grpo_jax.rollout.native.partial import group_slots_for
from grpo_jax.rollout.native.rollout import JaxRollout
from grpo_jax.rollout.native.refill import Refill
from grpo_jax.rollout.native.sampler import Sampler
from grpo_jax.rollout.native.sampler_process import SamplerProcess, SamplerSpec
from grpo_jax.rollout.native.sampling import SamplingParams
from grpo_jax.scoring import Scores
from grpo_jax.data import DataPosition
from grpo_jax.run_state import RunState
from grpo_jax.policy import Policy, step_config
from grpo_jax.round import Draw, GRPORound
from grpo_jax.shapes import completion_width

QWEN2_0_5B = ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=896,
                         intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                         head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                         tie_word_embeddings=True, qkv_bias=True)
TINY = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   tie_word_embeddings=True, qkv_bias=True)
# A tiny Qwen3-MoE (8 experts, 2 per token, every layer sparse): routing replay's figures.
TINY_MOE = ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=64,
                       intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, qk_norm=True, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, norm_topk_prob=True)

# (peak dense bf16 FLOP/s, HBM bytes/s) by device kind; None where unknown (CPU).
PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12), "A100": (312e12, 2.0e12),
         "TPU v5e": (197e12, 0.82e12), "TPU v4": (275e12, 1.2e12), "TPU v5p": (459e12, 2.76e12)}


def device_peaks():
    kind = jax.devices()[0].device_kind
    for name, peaks in PEAKS.items():
        if name.lower() in kind.lower():
            if name == "H100" and "PCIe" in kind:
                return kind, (756e12, 2.0e12)
            return kind, peaks
    return kind, (None, None)


def peak_memory() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _timed(fn, repeats):
    fn()  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def train_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    """Model FLOPs of one fwd+bwd (6 N T for the matmuls + causal attention), remat excluded;
    N counts a mixture of experts' active parameters (each token's k experts)."""
    dense = cfg.num_params(active=True) - cfg.vocab_size * cfg.hidden_size  # a free gather
    dense += cfg.vocab_size * cfg.hidden_size  # ...but the LM head is a matmul
    attn = 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq  # QK^T and PV, causal half
    return float(batch * seq * (6 * dense + attn))


def decode_bytes(cfg: ModelConfig, batch: int, cache_len: int, param_bytes: int) -> float:
    """HBM bytes one decode step must read: every weight once plus the whole KV cache."""
    kv = 2 * cfg.num_layers * batch * cache_len * cfg.num_kv_heads * cfg.head_dim * 2
    return float(cfg.num_params() * param_bytes + kv)


def model_settings(args) -> dict:
    """The ModelConfig fields the flags set, for random and real weights alike."""
    return dict(dtype=jnp.dtype(args.dtype), remat=not args.no_remat,
                remat_policy=args.remat_policy, attention_impl=args.attention,
                shared_prefix=not args.no_shared_prefix, padding_free=args.padding_free,
                sampler_layers=args.sampler_layers,
                decode_attention=args.decode_attention)


def make_workload(args):
    if args.model:
        return real_workload(args)
    base = (TINY_MOE if args.tiny_moe else TINY if args.tiny else
            presets.preset(args.preset) if args.preset else QWEN2_0_5B)
    if args.num_layers:
        base = base.with_layers(args.num_layers)
    cfg = base.replace(**model_settings(args))
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=-1))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, args.prompt_len)) for _ in range(args.prompts)]
    return cfg, model, mesh, prompts


# --long-every: most prompts ask for a few words, every K-th for a long text, so a real model's
# own lengths (to its EOS) are long-tailed: short groups mostly, a long one now and then.
SHORT_ASK = "\n\nAnswer in one short sentence."
LONG_ASK = "\n\nWrite a long, detailed story of at least 600 words inspired by this post."


def real_workload(args):
    """make_workload with a real model's weights and the shipped prompts (the embedded
    SmolLM2's `smol` config data), each cut to --prompt-len tokens."""
    from importlib import resources

    from transformers import AutoTokenizer

    from grpo_jax import hf
    model, model_dir = hf.load_model(args.model, **model_settings(args))
    tok = AutoTokenizer.from_pretrained(model_dir)
    lines = resources.files("grpo_jax").joinpath("assets/smol_prompts.jsonl").read_text()
    texts = [json.loads(line)["prompt"] for line in lines.splitlines()[:args.prompts]]
    if args.long_every:  # a long-tailed mix of asks, as reasoning prompts have
        texts = [t + (LONG_ASK if i % args.long_every == args.long_every - 1 else SHORT_ASK)
                 for i, t in enumerate(texts)]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                           add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"][-args.prompt_len:] for t in texts]
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=-1))
    return model.cfg, model, mesh, [list(map(int, p)) for p in prompts]


def bench_sampler(args, cfg, model, mesh, prompts):
    sp = SamplingParams(max_completion_length=args.completion_len, temperature=1.0,
                        stop_token_ids=())  # no stop token: every row runs the full length
    sampler = Sampler(cfg, sp, pad_id=0, mesh=mesh)
    params = nnx.split(model, nnx.Param)[1]
    t0 = time.perf_counter()
    sampler.generate(params, prompts, args.generations, 0)  # returns host arrays: finished
    first_call = time.perf_counter() - t0  # compiling included
    sec = _timed(lambda: sampler.generate(params, prompts, args.generations, 0), args.repeats)
    # The same program with one completion token: prefill, first token and the call's fixed
    # costs, so the rest is the decode loop alone.
    first = Sampler(cfg, dataclasses.replace(sp, max_completion_length=1), pad_id=0, mesh=mesh)
    prefill = _timed(lambda: first.generate(params, prompts, args.generations, 0), args.repeats)
    n = len(prompts) * args.generations
    _, (_, bw) = device_peaks()
    # The sampler casts the weights to the compute dtype once per call: that is what it reads.
    floor = decode_bytes(cfg, n, args.prompt_len + args.completion_len,
                         jnp.dtype(cfg.dtype).itemsize) / bw if bw else None
    per_step = max(sec - prefill, 0.0) / max(args.completion_len - 1, 1)
    return {"generate_s": sec, "generated_tokens_per_s": n * args.completion_len / sec,
            "generate_first_call_s": first_call,
            "prefill_and_first_token_s": prefill,
            "decode_ms_per_step": per_step * 1e3,
            "decode_floor_ms": floor * 1e3 if floor else None,
            "decode_fraction_of_hbm_limit": floor / per_step if floor and per_step else None}


def bench_lora_sampler(args, cfg, model, mesh, prompts):
    """LoRA in the JAX sampler both ways: the base with the adapters merged once per round
    (the merge timed apart), and the adapters run on the base at every step (what QLoRA's
    sampler does, PeftArgs.sampler_takes_adapters). Adapters on every linear layer, random B."""
    peft = PeftArgs(use_peft=True, lora_r=args.lora_r, lora_target_modules=("all-linear",),
                    load_in_8bit=args.lora_quant == "8", load_in_4bit=args.lora_quant == "4")
    if peft.quant_bits:
        quant.quantize_model(model, peft.quant_bits)
    lora.add_adapters(model, peft, jax.random.key(0))
    for i, (name, var) in enumerate(sorted(vars(model.layers).items())):
        if name.endswith("_lora_b"):
            var.set_value(0.01 * jax.random.normal(jax.random.key(i), var.shape, var.dtype))
    _, adapters, base = nnx.split(model, lora.LoraParam, nnx.Param)
    sp = SamplingParams(max_completion_length=args.completion_len, temperature=1.0,
                        stop_token_ids=())
    merge = jax.jit(lambda b, a: lora.merge_into_base(b, a, peft.scale))
    merged_sampler = Sampler(cfg, sp, pad_id=0, mesh=mesh)
    adapter_sampler = Sampler(cfg, sp, pad_id=0, mesh=mesh, peft=peft)
    g = args.generations
    return {
        "lora_merge_s": _timed(lambda: merge(base, adapters), args.repeats),
        "lora_merged_generate_s": _timed(lambda: merged_sampler.generate(
            merge(base, adapters), prompts, g, 0), args.repeats),
        "lora_adapters_generate_s": _timed(lambda: adapter_sampler.generate(
            (adapters, base), prompts, g, 0), args.repeats)}


def bench_refill(args, cfg, model, mesh, prompts):
    """A long-tailed-length workload through `--max-num-seqs` decode slots, refilled as rows
    finish and in static sub-batches (each until its longest row is done). Random weights
    sample nearly uniformly, so with a stop set of `--stop-fraction` of the vocabulary a row
    stops after each token with about that probability: geometric lengths capped at
    --completion-len (most rows short, a few long). Both ways draw the same tokens."""
    stops = tuple(range(3, 3 + max(1, round(args.stop_fraction * cfg.vocab_size))))
    sp = SamplingParams(max_completion_length=args.completion_len, temperature=1.0,
                        stop_token_ids=stops, max_num_seqs=args.max_num_seqs)
    params = nnx.split(model, nnx.Param)[1]
    result, outs = {}, {}
    for name, refill in (("static", False), ("refilled", True)):
        slots = Refill(Sampler(cfg, dataclasses.replace(sp, continuous_batching=refill),
                               pad_id=0, mesh=mesh))

        def run():
            outs[name] = slots.generate(params, prompts, args.generations, 0)
        sec = _timed(run, args.repeats)
        m = outs[name].metrics
        result.update({f"{name}_generate_s": sec,
                       f"{name}_tokens_per_s": int(outs[name].completion_mask.sum()) / sec,
                       f"{name}_decode_steps": m["generate/decode_steps"],
                       f"{name}_slot_occupancy": m["generate/slot_occupancy"]})
    lengths = outs["refilled"].completion_mask.sum(axis=1)
    result.update({
        "refill_speedup": result["static_generate_s"] / result["refilled_generate_s"],
        "same_completions": bool((outs["static"].completion_ids
                                  == outs["refilled"].completion_ids).all()),
        "rows": len(lengths), "decode_slots": slots.slots,
        "length_mean": float(lengths.mean()), "length_p50": float(np.median(lengths)),
        "length_p90": float(np.percentile(lengths, 90)), "length_max": int(lengths.max())})
    return result


def train_batch(cfg, n, prompt_len, completion_len, seed=0) -> Batch:
    rng = np.random.default_rng(seed)
    return Batch(prompt_ids=rng.integers(3, cfg.vocab_size, (n, prompt_len)).astype(np.int32),
                 prompt_mask=np.ones((n, prompt_len), np.int32),
                 completion_ids=rng.integers(3, cfg.vocab_size,
                                             (n, completion_len)).astype(np.int32),
                 completion_mask=np.ones((n, completion_len), np.int32),
                 truncated=np.zeros(n, bool),
                 advantages=rng.standard_normal(n).astype(np.float32))


def run_config(args, n: int) -> TrainConfig:
    """The workload as a run's settings (TRL's defaults otherwise): n completions per round,
    one window of args.grad_accum micro-batches, JAX rollouts."""
    return TrainConfig(
        grpo=GRPOArgs(num_generations=args.generations, num_iterations=args.num_iterations),
        batch=BatchArgs(per_device_train_batch_size=n // args.grad_accum,
                        gradient_accumulation_steps=args.grad_accum,
                        pad_to_multiple_of=args.pad_to_multiple_of),
        generation=SamplingParams(max_completion_length=args.completion_len))


def run_policy(args, model, mesh, n: int) -> tuple[Policy, BatchPlan]:
    """The run's Policy and batch plan, as train builds them, for n completions a round."""
    run = run_config(args, n)
    plan = run.batch_plan(1)
    # No dataset: run_facts.UNLOADED_TOTAL_STEPS (only the schedule's length depends on it).
    return Policy(model, step_config(run, plan, model.cfg), run.optim,
                  run_facts.total_steps(run.batch, plan), mesh), plan


def bench_train_step(args, cfg, policy):
    n = args.prompts * args.generations
    batch = train_batch(cfg, n, args.prompt_len, args.completion_len)
    box = {"state": policy.init_state}

    def run():
        box["state"], m = policy.step(box["state"], batch)
        jax.block_until_ready(m)
    sec = _timed(run, args.repeats)
    tokens = n * (args.prompt_len + args.completion_len)
    flops = train_flops(cfg, n, args.prompt_len + args.completion_len)
    peak, _ = device_peaks()[1]
    return {"train_step_s": sec, "train_tokens_per_s": tokens / sec,
            "model_tflops_per_s": flops / sec / 1e12,
            "mfu": flops / sec / peak if peak else None}


def bench_mismatch(args, cfg, model, mesh, prompts):
    """The native sampler's per-token log-probs against the trainer's under the same weights
    (TRL's sampling/sampling_logp_difference and sampling/importance_sampling_ratio, over every
    completion token), sampled at temperature 1 in the workload's dtype: the numerical
    mismatch of the two forwards, the floor of what off-policy corrections see (issue #50).
    A mixture of experts records its routing and is measured twice, routing replay off and
    on (numerics.router_replay, figures prefixed `replay_disabled/`, `replay_R3/`), with the
    fraction of completion token-layers routed to other experts than the sampler's
    (router/mismatch)."""
    from grpo_jax.grpo.train_step import completion_logps_and_router
    sp = SamplingParams(max_completion_length=args.completion_len, temperature=1.0)
    moe = bool(cfg.num_experts)
    out = Sampler(cfg, sp, pad_id=0, record_routing=moe).generate(model, prompts,
                                                                   args.generations, rng=0)
    batch = Batch(out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask,
                  out.truncated, np.zeros(len(out.truncated), np.float32),
                  prompt_routing=out.prompt_routing, completion_routing=out.completion_routing)
    m = np.asarray(out.completion_mask, bool)
    result = {"mismatch/tokens": int(m.sum())}
    forward = nnx.jit(lambda m, b: completion_logps_and_router(m, b, 1.0, 64))
    for mode in ("disabled", "R3") if moe else ("disabled",):
        model.cfg = cfg.replace(router_replay=mode)
        trainer, _, _, sums = forward(model, batch)
        delta = np.asarray(trainer, np.float64) - np.asarray(out.sampler_logp, np.float64)
        diff, ratio = np.abs(delta)[m], np.exp(delta)[m]
        figures = {"sampling/sampling_logp_difference/mean": float(diff.mean()),
                   "sampling/sampling_logp_difference/max": float(diff.max()),
                   "sampling/importance_sampling_ratio/min": float(ratio.min()),
                   "sampling/importance_sampling_ratio/mean": float(ratio.mean()),
                   "sampling/importance_sampling_ratio/max": float(ratio.max())}
        if sums is not None:
            figures["router/mismatch"] = float(sums[0] / max(float(sums[1]), 1.0))
        result.update({(f"replay_{mode}/" if moe else "") + k: v for k, v in figures.items()})
    model.cfg = cfg
    return result


def bench_e2e(args, cfg, model, mesh, prompts):
    """One GRPO round as the train loop runs it (grpo_jax.round.GRPORound), with random
    rewards in place of reward functions: generate, old log-probs under the loop's rule, then
    `num_iterations` passes of updates over the generation batch."""
    n = len(prompts) * args.generations
    policy, plan = run_policy(args, model, mesh, n)
    rollout = JaxRollout(cfg, SamplingParams(max_completion_length=args.completion_len),
                         pad_id=0, mesh=mesh)  # no stop token: every row runs the full length
    rng = np.random.default_rng(0)
    round_ = GRPORound(policy, rollout, plan,
                       lambda records, r: Scores(rng.standard_normal((n, 1)).astype(np.float32)),
                       ["random"], run_config(args, n).grpo)
    draw = Draw([{"prompt_ids": p} for p in prompts], DataPosition())
    box = {"at": RunState(policy.init_state)}
    parts = {"generate": [], "logprobs": [], "update": []}

    def run(record=True):
        box["at"], r = round_(box["at"], draw, jax.random.key(0))
        if record:
            for k in parts:
                parts[k].append(r.metrics[timing(k)])
    run(record=False)
    sec = _timed(run, args.repeats)
    out = {"grpo_step_s": sec}
    out.update({f"grpo_step/{k}_s": float(np.median(v)) for k, v in parts.items()})
    return out


def _cycled(prompts, start: int, count: int) -> list:
    """Draws start .. start + count - 1 of `prompts` cycled (as many as the group slots ask)."""
    return [prompts[i % len(prompts)] for i in range(start, start + count)]


def bench_partial(args, cfg, model, mesh, prompts):
    """Trained groups per second over --rounds GRPO rounds (grpo_jax.round.GRPORound, random
    rewards in place of reward functions) of --prompts groups each, through --max-num-seqs
    decode slots: refilled rounds, each decoding until its longest row is done, against
    partial rollouts (rollout/native/partial.py) with --max-staleness, whose rounds train as
    soon as --prompts groups are whole. Long-tailed lengths: with random weights, stop tokens
    of --stop-fraction of the vocabulary (geometric lengths); with --model, the model's own
    (its EOS). A round's prompts are the next of `prompts`, cycled. The first round of each
    (compiling) is not timed; the programs a later round compiles (an update for a completion
    width not seen yet: shapes.completion_width) are, and their seconds are also given apart
    (`compile_s`), with the groups per second without them (`warm_groups_per_s`: a long run's,
    where each width compiles once)."""
    k, g = len(prompts), args.generations
    n = k * g
    policy, plan = run_policy(args, model, mesh, n)
    stops = (() if args.model else
             tuple(range(3, 3 + max(1, round(args.stop_fraction * cfg.vocab_size)))))
    if args.model:
        from transformers import AutoTokenizer

        from grpo_jax import hf
        tok = AutoTokenizer.from_pretrained(hf.resolve_model_dir(args.model))
        stops = (tok.eos_token_id,)
    sp = SamplingParams(max_completion_length=args.completion_len, temperature=1.0,
                        stop_token_ids=stops, max_num_seqs=args.max_num_seqs)
    rng = np.random.default_rng(0)

    def score(records, r):
        return Scores(rng.standard_normal((len(r.truncated), 1)).astype(np.float32))
    start = jax.tree.map(jnp.copy, policy.init_state)  # each way from the same weights
    result = {}
    for name, staleness in (("refill", 0), ("partial", args.max_staleness)):
        in_flight = group_slots_for(args.max_inflight_tasks, staleness, g, k, split=False)
        rollout = JaxRollout(cfg, sp, pad_id=0, mesh=mesh,
                             partial_rollouts=(g, k, staleness, in_flight) if staleness else None)
        round_ = GRPORound(policy, rollout, plan, score, ["random"], run_config(args, n).grpo)
        at = RunState(jax.tree.map(jnp.copy, start), rows_in_flight=None if not staleness else
                      rollout.partial.empty(max(map(len, prompts))))
        drawn, times, stale, occupancy, tokens, widths = 0, [], [], [], 0, []
        parts = {"generate": [], "update": [], "logprobs": []}
        compiled = [0.0]

        def on_event(event, duration, **kw):
            if event.startswith("/jax/core/compile/"):  # tracing, lowering, compiling
                compiled[0] += duration
        jax.monitoring.register_event_duration_secs_listener(on_event)
        for i in range(args.rounds + 1):
            if i == 1:
                compiled[0] = 0.0
            want = at.rows_in_flight.empty_groups if staleness else k
            draw = Draw([{"prompt_ids": p} for p in _cycled(prompts, drawn, want)],
                        DataPosition(), rows=tuple(range(drawn, drawn + want)))
            drawn += want
            t0 = time.perf_counter()
            at, r = round_(at, draw, jax.random.key(i))
            jax.block_until_ready(at.state.params)
            if i:  # the first round compiles
                times.append(time.perf_counter() - t0)
                stale.append(r.metrics.get("staleness/mean", 0.0))
                occupancy.append(r.metrics["generate/slot_occupancy"])
                for part, got in parts.items():
                    got.append(r.metrics[timing(part)])
                tokens += int(round(r.metrics["completions/mean_length"] * n))
                widths.append(completion_width(int(r.metrics["completions/max_length"]),
                                               args.completion_len, args.pad_to_multiple_of))
        jax.monitoring.unregister_event_duration_listener(on_event)
        sec = float(np.sum(times))
        result.update({f"{name}_groups_per_s": args.rounds * k / sec,
                       f"{name}_round_s": sec / args.rounds,
                       f"{name}_completion_tokens_per_s": tokens / sec,
                       f"{name}_completion_tokens": tokens,
                       f"{name}_slot_occupancy": float(np.mean(occupancy)),
                       f"{name}_staleness_mean": float(np.mean(stale)),
                       f"{name}_update_width_mean": float(np.mean(widths)),
                       f"{name}_compile_s": compiled[0],
                       f"{name}_warm_groups_per_s": args.rounds * k / (sec - compiled[0]),
                       **{f"{name}_{part}_s": float(np.mean(got)) for part, got in parts.items()}})
    result["partial_speedup"] = result["partial_groups_per_s"] / result["refill_groups_per_s"]
    result["partial_warm_speedup"] = (result["partial_warm_groups_per_s"]
                                      / result["refill_warm_groups_per_s"])
    # The two ways draw different completions: over a few rounds their rare long rows differ,
    # and trained tokens per second compare them whatever lengths each drew.
    result["partial_token_speedup"] = (result["partial_completion_tokens_per_s"]
                                       / result["refill_completion_tokens_per_s"])
    result["decode_slots"] = rollout.slots.slots
    return result


def bench_split(args, cfg, model, mesh, prompts):
    """Partial rollouts on every device, the sampler and trainer taking turns, against
    disaggregated rounds (rollout/native/disaggregated.py): the sampler on the first
    --sampler-devices devices a round ahead (in this process, or with `--ways process` in a
    process of its own on as many devices), the trainer on the rest; trained groups per second
    and the measured idle time of each side over --rounds rounds of --prompts groups (after one
    rounds that warm up: the first compiles, and in the second the split sampler's wait still
    holds the trainer's compiling; random rewards, stop tokens as `partial`)."""
    k, g = len(prompts), args.generations
    n, devices = k * g, jax.devices()
    s = args.sampler_devices or len(devices) // 2
    if not 0 < s < len(devices):
        raise SystemExit(f"--sampler-devices {s}: 1 to {len(devices) - 1} of {len(devices)}")
    stops = tuple(range(3, 3 + max(1, round(args.stop_fraction * cfg.vocab_size))))
    sp = SamplingParams(max_completion_length=args.completion_len, temperature=1.0,
                        stop_token_ids=stops, max_num_seqs=args.max_num_seqs)
    rng = np.random.default_rng(0)

    def score(records, r):
        return Scores(rng.standard_normal((len(r.truncated), 1)).astype(np.float32))
    result = {}
    start = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))  # each way from the same
    width = max(map(len, prompts))
    ways = args.ways.split(",")
    for name in ways:
        nnx.update(model, start)
        t_mesh = mesh if name == "colocated" else mesh_lib.make_mesh(
            mesh_lib.MeshConfig(dp=1, fsdp=-1), devices[s:])
        s_mesh = None if name == "colocated" else mesh_lib.make_mesh(
            mesh_lib.MeshConfig(dp=-1), devices[:s])
        policy, plan = run_policy(args, model, t_mesh, n)
        # split: the sampler's bound counts its round-ahead version (engines.make_rollout)
        staleness = args.max_staleness - (s_mesh is not None)
        in_flight = group_slots_for(args.max_inflight_tasks, args.max_staleness, g, k,
                                    split=s_mesh is not None)
        rollout = JaxRollout(cfg, sp, pad_id=0, mesh=s_mesh or t_mesh,
                             partial_rollouts=(g, k, staleness, in_flight))
        split = (None if s_mesh is None else
                 SplitRollouts(rollout.partial, s_mesh, args.max_staleness) if name == "split"
                 else SamplerProcess(SamplerSpec(rollout.settings, dict(s_mesh.shape), width),
                                     s, args.max_staleness))
        round_ = GRPORound(policy, rollout, plan, score, ["random"], run_config(args, n).grpo,
                           split)
        at = RunState(policy.init_state, rows_in_flight=rollout.partial.empty(
            max(map(len, prompts))))
        drawn, times, idle = 0, [], {"idle_sampler": [], "idle_trainer": []}

        def draw():
            nonlocal drawn
            want = at.rows_in_flight.empty_groups
            drawn += want
            return Draw([{"prompt_ids": p} for p in _cycled(prompts, drawn - want, want)],
                        DataPosition(), rows=tuple(range(drawn - want, drawn)))
        for i in range(args.rounds + 2):
            t0 = time.perf_counter()
            if split is not None:  # as train.run_rounds: the batch sampled ahead, collected
                at = round_.settle(at)
                if at.queued is None:
                    at = round_.prime(at, draw(), jax.random.key(i))
            at, r = round_(at, draw(), jax.random.key(i))
            jax.block_until_ready(at.state.params)
            if i >= 2:  # warmed up
                times.append(time.perf_counter() - t0)
                for part, got in idle.items():
                    got.append(r.metrics[timing(part)])
        at = round_.settle(at)  # no advance left running
        if split is not None:
            split.close()
        sec = float(np.sum(times))
        result.update({f"{name}_groups_per_s": args.rounds * k / sec,
                       f"{name}_round_s": sec / args.rounds,
                       **{f"{name}_{part}_s": float(np.mean(v)) for part, v in idle.items()}})
    for name in (w for w in ways if w != "colocated" and "colocated" in ways):
        result[f"{name}_speedup"] = (result[f"{name}_groups_per_s"]
                                     / result["colocated_groups_per_s"])
    result["sampler_devices"], result["trainer_devices"] = s, len(devices) - s
    return result


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m grpo_jax.bench", description=__doc__)
    p.add_argument("what", choices=["sampler", "train-step", "e2e", "lora-sampler", "refill",
                                    "mismatch", "partial", "split", "all"])
    p.add_argument("--tiny", action="store_true", help="small model (CPU)")
    p.add_argument("--tiny-moe", action="store_true",
                   help="a small mixture of experts (Qwen3-MoE, 8 experts, 2 per token; CPU)")
    p.add_argument("--model", help="a real model's weights (an HF directory or alias, e.g. "
                   "smollm2-135m-instruct) in --dtype, prompted with the shipped Reddit-style "
                   "posts through its chat template; default: random weights, random prompts")
    p.add_argument("--preset", help="a model shape of grpo_jax.models.presets (random weights), "
                   "e.g. smollm2-135m; default: Qwen2-0.5B's")
    p.add_argument("--num-layers", type=int,
                   help="the model's first N layers only (a big model's shape on one device)")
    p.add_argument("--no-shared-prefix", action="store_true",
                   help="numerics.shared_prefix off: every row runs its prompt in training")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--long-every", type=int, default=0,
                   help="with --model: every K-th prompt asks for a long text and the rest for "
                        "one sentence (long-tailed lengths); 0: the shipped prompts as they are")
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--pad-to-multiple-of", type=int,
                   help="batch.pad_to_multiple_of: the update's completions padded to a "
                   "multiple of this (--completion-len: always to it); default: to the length "
                   "bucket of the batch's longest")
    p.add_argument("--padding-free", action="store_true",
                   help="numerics.padding_free: a group's short completions run end to end in "
                   "one row of the update and log-prob passes (grpo/packing.py)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--num-iterations", type=int, default=1,
                   help="optimizer updates per generation batch (TRL's num_iterations)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-remat", action="store_true")
    p.add_argument("--sampler-layers", default="auto", choices=["auto", "scan", "unroll"],
                   help="numerics.sampler_layers: the sampler's layers under lax.scan or "
                        "unrolled")
    p.add_argument("--remat-policy", default="full", choices=["full", "dots"],
                   help="what remat keeps per layer: its input only, or also matmul outputs")
    p.add_argument("--attention", default="auto", choices=["auto", "xla", "flash", "cudnn"],
                   help="attention kernel; 'cudnn' also for the decode step, which 'auto' "
                        "leaves to XLA")
    p.add_argument("--decode-attention", default="auto", choices=["auto", "xla", "pallas"],
                   help="numerics.decode_attention: the decode step's attention by XLA or the "
                        "fused Pallas kernel (models/decode_attention.py); 'auto' is XLA")
    p.add_argument("--lora-r", type=int, default=16, help="lora-sampler: the adapters' rank")
    p.add_argument("--lora-quant", default="none", choices=["none", "8", "4"],
                   help="lora-sampler: the base stored in 8 bits (int8) or 4 (NF4)")
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="refill: the decode slots (static sub-batches of as many rows)")
    p.add_argument("--stop-fraction", type=float, default=1 / 64,
                   help="refill: the share of the vocabulary that stops a row (mean length "
                        "about its inverse)")
    p.add_argument("--rounds", type=int, default=4,
                   help="partial: GRPO rounds timed (after one that compiles)")
    p.add_argument("--max-staleness", type=int, default=2,
                   help="partial: the partial rollouts' max_staleness")
    p.add_argument("--max-inflight-tasks", type=int, default=-1,
                   help="partial, split: rollout.max_inflight_tasks, the rows in flight "
                   "(-1: max_staleness generation batches, at least two colocated)")
    p.add_argument("--sampler-devices", type=int,
                   help="split: the sampler's devices (the first N; default half)")
    p.add_argument("--ways", default="colocated,split",
                   help="split: the ways timed, of colocated (one set of devices, taking "
                   "turns), split (the sampler on devices of its own, this process) and "
                   "process (the sampler in a process of its own: rollout.sampler_process)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    dist.default_xla_flags()
    cfg, model, mesh, prompts = make_workload(args)
    kind, _ = device_peaks()
    result = {"device": kind, "devices": jax.device_count(), "jax": jax.__version__,
              "workload": {k: v for k, v in vars(args).items() if k not in ("what", "json")},
              "params_M": cfg.num_params() / 1e6}
    if args.what in ("train-step", "all"):
        policy, _ = run_policy(args, model, mesh, args.prompts * args.generations)
        result.update(bench_train_step(args, cfg, policy))
    if args.what in ("sampler", "all"):
        result.update(bench_sampler(args, cfg, model, mesh, prompts))
    if args.what in ("e2e", "all"):
        result.update(bench_e2e(args, cfg, model, mesh, prompts))
    if args.what == "lora-sampler":  # it adds adapters to the model: not part of "all"
        result.update(bench_lora_sampler(args, cfg, model, mesh, prompts))
    if args.what == "refill":
        result.update(bench_refill(args, cfg, model, mesh, prompts))
    if args.what == "partial":
        result.update(bench_partial(args, cfg, model, mesh, prompts))
    if args.what == "split":
        result.update(bench_split(args, cfg, model, mesh, prompts))
    if args.what == "mismatch":
        result.update(bench_mismatch(args, cfg, model, mesh, prompts))
    result["peak_device_memory_GiB"] = ((peak_memory() or 0) / 2**30) or None
    width = max(map(len, result))
    for k, v in result.items():
        shown = f"{v:.4g}" if isinstance(v, float) else v
        print(f"{k:<{width}}  {shown}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


if __name__ == "__main__":
    main()
