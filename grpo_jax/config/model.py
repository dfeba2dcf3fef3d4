"""The model's sections: which checkpoint, its numerics, and LoRA/QLoRA (TRL's ModelConfig
names; PEFT's LoraConfig behind them)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from grpo_jax.config.fields import arg
from grpo_jax.errors import check


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    name_or_path: str = arg(
        "smollm2-135m-instruct",
        "The policy: a hub id, a local Hugging Face directory, or a built-in preset name.")


Dtype = Literal["bfloat16", "float16", "float32"]


# Numerics.moe_gmm's values (models/gmm.py's implementations)
MOE_GMM = ("auto", "xla", "megablox", "mosaic_gpu")
# Numerics.decode_attention's values (models/decode_attention.py)
DECODE_ATTENTION = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How the model runs, the config's `numerics` section: dtypes and rematerialisation."""

    dtype: Dtype = arg("bfloat16", "The compute dtype of the matmuls.")
    param_dtype: Dtype = arg("float32", "The dtype of the master weights and the optimizer state.")
    remat: bool = arg(True, "TRL: gradient_checkpointing (default True)")
    remat_policy: Literal["full", "dots"] = arg(
        "full",
        "With remat, what each layer keeps for the backward pass: \"full\" only its input (least "
        "memory); \"dots\" also its matmul outputs (no matmul recomputed; more activation "
        "memory).")
    shared_prefix: bool = arg(
        True,
        "Training and log-prob passes compute each prompt once per group of completions sharing "
        "it (Decoder.shared_prefix): same values, fewer FLOPs. A generation batch is then split "
        "into micro-batches by whole groups, shuffled group-wise (TRL shuffles rows; with "
        "steps_per_generation = gradient_accumulation_steps, TRL's default, an update sees the "
        "same rows either way). false: TRL's row shuffle, every row runs its prompt.")
    padding_free: bool = arg(
        False,
        "TRL's padding_free (SFTConfig's; its GRPOConfig has none): with shared_prefix, the "
        "training and log-prob passes run short completions end to end in one row (each "
        "attending to its own prompt and itself, at its own positions; a row holds up to 8 "
        "prompts) instead of each padded to the batch's longest: fewer rows, the same tokens, "
        "the same values up to "
        "rounding (grpo/packing.py). Plain text with full attention only (not with images, "
        "M-RoPE, routing replay's record, sliding-window layers, a context axis, expert "
        "capacity, or LoRA dropout in the update): those run padded. Each packed row's attention takes a dense "
        "mask (the plain or cuDNN kernel, not the blockwise ones).")
    attention_block: int = arg(
        512,
        "Queries and keys per block of the blockwise attention (attention.flash, and splash's "
        "blocks on TPU): scores are held one [block, block] pair at a time, never [T, S].")
    sampler_layers: Literal["auto", "scan", "unroll"] = arg(
        "auto",
        "How the native sampler's prefill and decode steps run the layers: \"scan\" under "
        "lax.scan, as training does (one layer compiled, whatever the depth; the KV cache one "
        "buffer per run of like layers), \"unroll\" one copy of each layer (a buffer per layer). "
        "\"auto\": scan on CPUs in float32 or 64 (compiles sooner, decodes no slower); unroll "
        "on GPUs, where XLA copies each layer's keys and values out of the stacked cache every "
        "step (decode 1.8x slower on an H100), on CPUs in 16 bits, where XLA:CPU widens the "
        "whole buffer around each write, and on TPUs (not timed there; MaxText decodes unscanned) "
        "(docs/benchmarks.md).")
    moe_capacity_factor: float | None = arg(
        None,
        "Mixture-of-experts layers: None routes every token to its k experts (dropless, a grouped "
        "matmul over the tokens sorted by expert); a number c gives each expert room for c * "
        "tokens * k / experts assignments and drops the rest (GShard's capacity factor), as "
        "transformers never does: outputs then differ from it wherever an expert overflows.")
    moe_gmm: Literal["auto", "xla", "megablox", "mosaic_gpu"] = arg(
        "auto",
        "Mixture-of-experts grouped matmuls (dropless): \"auto\" runs megablox on TPUs, jax's "
        "Mosaic GPU kernels on Hopper and later GPUs (forward and both gradients) and XLA's "
        "ragged_dot elsewhere (a masked dense product over every expert on GPUs); the others "
        "force one implementation (models/gmm.py).")
    decode_attention: Literal["auto", "xla", "pallas"] = arg(
        "auto",
        "The native sampler's decode step (one token over the KV cache): \"pallas\" runs a fused "
        "split-K decode-attention kernel (Pallas, Triton: one launch per layer instead of XLA's "
        "four; models/decode_attention.py) on GPUs, in Pallas' interpreter on CPUs (tests: slow), "
        "refused on TPUs; layers with soft-capping or sinks keep XLA's. \"xla\": XLA's attention "
        "(cuDNN's with the bench's --attention cudnn). \"auto\": \"xla\" until the kernel is "
        "timed on a GPU (docs/benchmarks.md).")
    router_replay: Literal["disabled", "R3"] = arg(
        "disabled",
        "Mixture-of-experts routing replay, verl's actor.router_replay.mode names (slime: "
        "--use-rollout-routing-replay): \"R3\" (rollout routing replay, arXiv 2510.11370) has "
        "the JAX sampler record each token's top-k experts per sparse layer and the trainer's "
        "old-log-prob, reference and update forwards run those experts, their gate weights "
        "recomputed from the trainer's own router (its gradient flows through them; "
        "models/moe.py); \"disabled\": each forward routes itself. verl's R2 (replaying the "
        "old-log-prob forward's routing) is not offered. With moe_capacity_factor, R3's "
        "forwards run dropless (a replayed token is never dropped). router/mismatch is logged "
        "either way for a mixture of experts on the JAX sampler.")

    def __post_init__(self):
        check(self.remat_policy in ("full", "dots"),
              f"remat_policy={self.remat_policy!r}: use 'full' or 'dots'")
        check(self.sampler_layers in ("auto", "scan", "unroll"),
              f"sampler_layers={self.sampler_layers!r}: use 'auto', 'scan' or 'unroll'")
        check(self.moe_capacity_factor is None or self.moe_capacity_factor > 0,
              f"moe_capacity_factor={self.moe_capacity_factor}: must be > 0, or null (dropless)")
        check(self.moe_gmm in MOE_GMM,
              f"moe_gmm={self.moe_gmm!r}: use one of {', '.join(MOE_GMM)}")
        check(self.decode_attention in DECODE_ATTENTION,
              f"decode_attention={self.decode_attention!r}: use one of "
              f"{', '.join(DECODE_ATTENTION)}")
        check(self.router_replay in ("disabled", "R3"),
              f"router_replay={self.router_replay!r}: use 'disabled' or 'R3'")

    @property
    def replay(self) -> bool:
        """Routing replay on (router_replay R3)."""
        return self.router_replay == "R3"


# The decoder's projections (models/quant.py quantizes these), in its order.
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# PEFT's module names -> the decoder's stacked weights.
TARGETS = dict(zip(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                   PROJECTIONS))


# PEFT's module names that only a vision tower has (SigLIP's out_proj, fc1, fc2; Qwen-VL's
# fused attn.qkv and attn.proj; Qwen3-VL's linear_fc1, linear_fc2, its mergers' too): valid in
# lora_target_modules beside the decoder's, they adapt the tower's modules of that name
# (models/lora.py refuses them on a model without such).
TOWER_TARGETS = ("qkv", "proj", "out_proj", "fc1", "fc2", "linear_fc1", "linear_fc2")

# PEFT's default target_modules for the llama / qwen2 / qwen3 families.
DEFAULT_TARGETS = ("q_proj", "v_proj")


@dataclasses.dataclass(frozen=True)
class PeftArgs:
    """The config's `peft` section: TRL's ModelConfig names (PEFT's LoraConfig behind them)."""

    use_peft: bool = arg(False, "Train LoRA adapters on a frozen base instead of the whole model.")
    lora_r: int = arg(16, "The adapters' rank.")
    lora_alpha: int = arg(
        32,
        "The adapters' scale numerator: alpha / r (alpha / sqrt(r) with use_rslora).")
    lora_dropout: float = arg(
        0.0,
        "PEFT's dropout on each adapter's input, in the train step's forward only (TRL: 0.05).")
    lora_target_modules: tuple[str, ...] | None = arg(
        None,
        "Names of PEFT's modules, or \"all-linear\"; None: PEFT's default for the model (q, v). "
        "On a vision-language model PEFT's rules also reach the tower's modules of these names "
        "(all-linear: every tower linear, Qwen2.5-VL's fused attn.qkv as one module; the "
        "tower's own names qkv, proj, out_proj, fc1, fc2 may be given too), and they get "
        "adapters there too.")
    use_rslora: bool = arg(
        False,
        "Scale the adapters by lora_alpha / sqrt(r) instead of lora_alpha / r (rsLoRA).")
    load_in_8bit: bool = arg(
        False,
        "QLoRA: the frozen base's projections stored as int8 or 4-bit codes (models/quant.py).")
    load_in_4bit: bool = arg(
        False,
        "QLoRA: the frozen base's projections stored as 4-bit NF4 codes (models/quant.py).")
    bnb_4bit_quant_type: str = arg("nf4", "The 4-bit code: nf4 (the only one supported).")

    def __post_init__(self):
        check(not (self.load_in_8bit and self.load_in_4bit),
              "load_in_8bit and load_in_4bit are both set: choose one")
        check(self.use_peft or not (self.load_in_8bit or self.load_in_4bit),
              "load_in_8bit / load_in_4bit quantize a frozen base, which only LoRA trains "
              "around: set use_peft: true (a quantized model can't be fine-tuned itself)")
        check(self.bnb_4bit_quant_type == "nf4", f"bnb_4bit_quant_type="
              f"{self.bnb_4bit_quant_type!r} is not supported: grpo-jax's 4-bit base is nf4")
        check(self.lora_r >= 1, f"lora_r must be >= 1 (the adapters' rank), got {self.lora_r}")
        check(0 <= self.lora_dropout < 1, f"lora_dropout={self.lora_dropout}: a dropout "
              "probability must be in [0, 1)")
        self.targets()  # bad names fail when the config is read

    @property
    def quant_bits(self) -> int | None:
        return 8 if self.load_in_8bit else 4 if self.load_in_4bit else None

    @property
    def sampler_takes_adapters(self) -> bool:
        """Whether the JAX sampler runs the adapters on the frozen base rather than on a merged
        copy: only for a quantized base, whose merged copy would be the base dequantized (2x
        the int8 codes' memory, 4x NF4's). Unquantized, merged weights decode as fast or faster
        (docs/benchmarks.md) and the copy is the size of the base."""
        return self.use_peft and self.quant_bits is not None

    def base_numerics(self, numerics):
        """The numerics a run's model is built with: a LoRA run's frozen base is never updated,
        so it is kept in the compute dtype (its adapters get the param dtype)."""
        if not self.use_peft:
            return numerics
        return dataclasses.replace(numerics, param_dtype=numerics.dtype)

    @property
    def scale(self) -> float:
        return self.lora_alpha / (math.sqrt(self.lora_r) if self.use_rslora else self.lora_r)

    def target_modules(self) -> tuple[str, ...]:
        """PEFT's names of the adapted modules, in the decoder's order."""
        names = self.lora_target_modules or DEFAULT_TARGETS
        if isinstance(names, str):
            names = (names,)
        if "all-linear" in names:
            return tuple(TARGETS)
        unknown = [n for n in names if n not in TARGETS and n not in TOWER_TARGETS]
        check(not unknown, f"lora_target_modules {unknown} match no module of the decoder; use "
              f"some of {', '.join(TARGETS)} (a vision tower's: {', '.join(TOWER_TARGETS)}), "
              "or all-linear")
        out = tuple(n for n in TARGETS if n in names)
        check(bool(out), f"lora_target_modules {list(names)} select no module of the language "
              f"model: grpo-jax's LoRA adapts it, and the tower beside it; add some of "
              f"{', '.join(TARGETS)}, or all-linear")
        return out

    def targets(self) -> tuple[str, ...]:
        """The decoder's weight names of the adapted modules."""
        return tuple(TARGETS[n] for n in self.target_modules())
