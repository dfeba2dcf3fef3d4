"""Shapes of public models by name, for planning without downloading weights (`grpo_jax.aot`).

Each preset is the architecture its Hugging Face `config.json` describes (hidden size, layers,
heads, KV heads, intermediate size, vocabulary, tied embeddings, RoPE, Qwen2.5's qkv bias,
Qwen3's qk norm, Gemma's windows and soft-caps, the mixtures' experts and routing); the weights
are not needed to compile or size a run.
"""

from __future__ import annotations

import math

from grpo_jax.errors import GrpoJaxError
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.qwen3_vl import MODEL_TYPE as QWEN3_VL, Qwen3VisionConfig
from grpo_jax.models.qwen_vl import MODEL_TYPE as QWEN_VL, QwenVisionConfig
from grpo_jax.models.siglip import SiglipConfig

# Llama 3.1's RoPE scaling (factor, low_freq_factor, high_freq_factor, original max position).
_LLAMA31_ROPE = (8.0, 1.0, 4.0, 8192)


def _qwen25(d, layers, heads, kv, f, vocab, tied, eps=1e-6) -> ModelConfig:
    return ModelConfig("qwen2", vocab, d, f, layers, heads, kv, d // heads, rms_norm_eps=eps,
                       rope_theta=1e6, tie_word_embeddings=tied, qkv_bias=True,
                       max_position_embeddings=32768)


def _qwen3(d, layers, heads, f) -> ModelConfig:
    return ModelConfig("qwen3", 151936, d, f, layers, heads, 8, 128, rope_theta=1e6,
                       qk_norm=True, max_position_embeddings=40960)


def _llama31(d, layers, heads, f) -> ModelConfig:
    return ModelConfig("llama", 128256, d, f, layers, heads, 8, d // heads, rms_norm_eps=1e-5,
                       rope_theta=5e5, rope_llama3=_LLAMA31_ROPE,
                       max_position_embeddings=131072)


def _gemma3(d, layers, heads, kv, f, vocab=262208, head_dim=256, window=1024, scalar=256,
            linear=8.0) -> ModelConfig:
    """Gemma 3's text model: five sliding-window layers to one global, local RoPE base 1e4,
    global 1e6 (linearly scaled by 8 from 4B up)."""
    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                  for i in range(layers))
    return ModelConfig("gemma3_text", vocab, d, f, layers, heads, kv, head_dim,
                       rope_theta=1e6, rope_local_theta=1e4, rope_linear=linear,
                       tie_word_embeddings=True, qk_norm=True, hidden_act="gelu_pytorch_tanh",
                       norm_offset=True, scale_embeddings=True, sandwich_norms=True,
                       query_pre_attn_scalar=scalar, sliding_window=window, layer_types=types,
                       max_position_embeddings=131072 if linear else 32768)


def _gemma2(d, layers, heads, kv, f, head_dim=256, scalar=256) -> ModelConfig:
    """Gemma 2: sliding and global layers alternate; soft-capped attention and logits."""
    types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
    return ModelConfig("gemma2", 256000, d, f, layers, heads, kv, head_dim,
                       tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
                       norm_offset=True, scale_embeddings=True, sandwich_norms=True,
                       query_pre_attn_scalar=scalar, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, sliding_window=4096, layer_types=types,
                       max_position_embeddings=8192)


def _qwen3_moe(d, layers, heads, expert_f, dense_f) -> ModelConfig:
    """Qwen3-MoE: 128 experts, 8 per token (renormalised), every layer sparse."""
    return ModelConfig("qwen3_moe", 151936, d, dense_f, layers, heads, 4, 128, rope_theta=1e6,
                       qk_norm=True, max_position_embeddings=40960, num_experts=128,
                       num_experts_per_tok=8, moe_intermediate_size=expert_f,
                       norm_topk_prob=True, router_aux_coef=0.001)


def _gpt_oss(layers, experts) -> ModelConfig:
    """gpt-oss: sliding (128) and full layers alternating, YaRN RoPE, attention sinks, biases,
    4 of `experts` per token with its clamped SwiGLU. Released as MXFP4 experts (dequantized
    on load; bf16 here)."""
    types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
    return ModelConfig("gpt_oss", 201088, 2880, 2880, layers, 64, 8, 64, rms_norm_eps=1e-5,
                       rope_theta=150000.0, rope_yarn=(32.0, 32.0, 1.0, 4096, False,
                                                       0.1 * math.log(32.0) + 1.0),
                       qkv_bias=True, o_bias=True, attention_sinks=True, sliding_window=128,
                       layer_types=types, max_position_embeddings=131072, num_experts=experts,
                       num_experts_per_tok=4, moe_intermediate_size=2880, norm_topk_prob=True,
                       router_bias=True, expert_bias=True, swiglu_limit=7.0,
                       router_aux_coef=0.9)


_SIGLIP_896 = SiglipConfig(hidden_size=1152, intermediate_size=4304, num_layers=27,
                           num_heads=16, image_size=896, patch_size=14)

PRESETS: dict[str, ModelConfig] = {
    # The embedded model (SmolLM2-135M-Instruct): `bench --preset smollm2-135m` sizes CPU runs.
    "smollm2-135m": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, rms_norm_eps=1e-5,
                                rope_theta=1e5, tie_word_embeddings=True,
                                max_position_embeddings=8192),
    "qwen2.5-0.5b": _qwen25(896, 24, 14, 2, 4864, 151936, tied=True),
    "qwen2.5-1.5b": _qwen25(1536, 28, 12, 2, 8960, 151936, tied=True),
    "qwen2.5-7b": _qwen25(3584, 28, 28, 4, 18944, 152064, tied=False),
    # Qwen2.5-VL-7B: Qwen2.5-7B's decoder with M-RoPE, and its 32-block ViT + merger.
    "qwen2.5-vl-7b": _qwen25(3584, 28, 28, 4, 18944, 152064, tied=False).replace(
        model_type=QWEN_VL,
        max_position_embeddings=128000, mrope_section=(16, 24, 24),
        vision=QwenVisionConfig(depth=32, hidden_size=1280, intermediate_size=3420,
                                num_heads=16, out_hidden_size=3584)),
    "qwen2.5-32b": _qwen25(5120, 64, 40, 8, 27648, 152064, tied=False, eps=1e-5),
    "qwen2.5-72b": _qwen25(8192, 80, 64, 8, 29568, 152064, tied=False),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288),
    # Qwen3-VL-8B: Qwen3-8B's shapes with interleaved M-RoPE (base 5e6), and its 27-block ViT
    # with DeepStack mergers after blocks 8, 16 and 24.
    "qwen3-vl-8b": _qwen3(4096, 36, 32, 12288).replace(
        model_type=QWEN3_VL, rope_theta=5e6, max_position_embeddings=262144,
        mrope_section=(24, 20, 20), mrope_interleaved=True,
        vision=Qwen3VisionConfig(depth=27, hidden_size=1152, intermediate_size=4304,
                                 num_heads=16, out_hidden_size=4096)),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600),
    "llama-3.1-8b": _llama31(4096, 32, 32, 14336),
    "llama-3.1-70b": _llama31(8192, 80, 64, 28672),
    "gemma-3-270m": _gemma3(640, 18, 4, 1, 2048, vocab=262144, window=512, linear=None),
    "gemma-3-1b": _gemma3(1152, 26, 4, 1, 6912, vocab=262144, window=512, linear=None),
    "gemma-3-4b": _gemma3(2560, 34, 8, 4, 10240),
    "gemma-3-12b": _gemma3(3840, 48, 16, 8, 15360),
    "gemma-3-27b": _gemma3(5376, 62, 32, 16, 21504, head_dim=128, scalar=168),
    # Gemma 3 4B / 12B as the Hub ships them (Gemma3ForConditionalGeneration): the text model
    # and SigLIP-So400m at 896 px (4096 patches, pooled to 256 tokens an image).
    "gemma-3-4b-vlm": _gemma3(2560, 34, 8, 4, 10240).replace(vision=_SIGLIP_896),
    "gemma-3-12b-vlm": _gemma3(3840, 48, 16, 8, 15360).replace(vision=_SIGLIP_896),
    "gemma-2-2b": _gemma2(2304, 26, 8, 4, 9216),
    "gemma-2-9b": _gemma2(3584, 42, 16, 8, 14336),
    "gemma-2-27b": _gemma2(4608, 46, 32, 16, 36864, head_dim=128, scalar=144),
    # Mixtures of experts. Active parameters (num_params(active=True), the embedding included):
    # 3.35B, 22.19B, 12.88B, 5.71B, 4.19B; gpt-oss's model card counts 5.1B and 3.6B without it.
    "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 768, 6144),
    "qwen3-235b-a22b": _qwen3_moe(4096, 94, 64, 1536, 12288),
    "mixtral-8x7b": ModelConfig("mixtral", 32000, 4096, 14336, 32, 32, 8, 128, rms_norm_eps=1e-5,
                                rope_theta=1e6, max_position_embeddings=32768, num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=14336,
                                norm_topk_prob=True, router_aux_coef=0.02),
    "gpt-oss-120b": _gpt_oss(36, 128),
    "gpt-oss-20b": _gpt_oss(24, 32),
}


def preset_key(name: str) -> str:
    """`name` as a key of PRESETS: case-insensitive, an `Org/` prefix such as `Qwen/` and an
    -it / -Instruct suffix (the tuned models have the base's shapes) dropped."""
    key = name.rsplit("/", 1)[-1].lower().replace("meta-llama-", "llama-")
    return key.removesuffix("-it").removesuffix("-instruct")


def preset(name: str) -> ModelConfig:
    """The preset named `name` (see preset_key)."""
    key = preset_key(name)
    if key not in PRESETS:
        raise GrpoJaxError(f"unknown model preset {name!r}: use one of {', '.join(PRESETS)}, "
                           "an HF config.json, or a model directory")
    return PRESETS[key]
