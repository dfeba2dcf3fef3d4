"""Static description of a decoder: one dataclass for the Llama, Qwen2 and Qwen3 families."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from grpo_jax.errors import GrpoJaxError, check

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


class ModelConfigError(GrpoJaxError, ValueError):
    """A model directory or config the decoder can't represent."""


Dtype = Literal["bfloat16", "float16", "float32"]


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How the model runs, the config's `numerics` section: dtypes and rematerialisation."""

    dtype: Dtype = "bfloat16"  # compute dtype of matmuls
    param_dtype: Dtype = "float32"  # master weights and optimizer state
    remat: bool = True  # TRL: gradient_checkpointing (default True)
    # With remat, what each layer keeps for the backward pass: "full" only its input (least
    # memory); "dots" also its matmul outputs (no matmul recomputed; more activation memory).
    remat_policy: Literal["full", "dots"] = "full"

    def __post_init__(self):
        check(self.remat_policy in ("full", "dots"),
              f"remat_policy={self.remat_policy!r}: use 'full' or 'dots'")


_NUMERICS = tuple(f.name for f in dataclasses.fields(Numerics))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Llama-3 style frequency scaling: (factor, low_freq_factor, high_freq_factor, original_max_pos).
    rope_llama3: tuple[float, float, float, int] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    max_position_embeddings: int = 4096
    numerics: Numerics = Numerics()
    # "xla" (portable), "cudnn" (fused flash attention on NVIDIA GPUs, bf16/fp16 only) or
    # "auto": cudnn on a GPU for training, log-probs and prefill (see use_cudnn_attention).
    attention_impl: str = "auto"

    def __post_init__(self):
        if self.attention_impl not in ("auto", "xla", "cudnn"):
            raise ValueError(f"attention_impl={self.attention_impl!r}: use 'auto', 'xla' or "
                             "'cudnn'")

    def use_cudnn_attention(self, decode: bool = False) -> bool:
        """decode: the step that attends from new tokens over a KV cache. "auto" keeps XLA's
        attention there: cuDNN's compiles for it (one kernel instead of four) but has not been
        timed on a GPU yet; "cudnn" uses it."""
        if self.attention_impl == "auto":
            return (not decode and jax.default_backend() == "gpu"
                    and jnp.dtype(self.dtype) in (jnp.bfloat16, jnp.float16))
        return self.attention_impl == "cudnn"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # The numerics' fields read as before (dtypes as jnp dtypes).
    dtype = property(lambda self: jnp.dtype(self.numerics.dtype))
    param_dtype = property(lambda self: jnp.dtype(self.numerics.param_dtype))
    remat = property(lambda self: self.numerics.remat)
    remat_policy = property(lambda self: self.numerics.remat_policy)

    def replace(self, **kw) -> "ModelConfig":
        """Also takes the numerics' fields (dtypes as names or jnp dtypes)."""
        knobs = {k: kw.pop(k) for k in _NUMERICS if k in kw}
        for k in ("dtype", "param_dtype"):
            if k in knobs:
                knobs[k] = jnp.dtype(knobs[k]).name
        if knobs:
            kw["numerics"] = dataclasses.replace(kw.get("numerics", self.numerics), **knobs)
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        d, f, l, v = self.hidden_size, self.intermediate_size, self.num_layers, self.vocab_size
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        head = 0 if self.tie_word_embeddings else d * v
        return v * d + l * per_layer + d + head

    @classmethod
    def from_hf(cls, hf: dict, **overrides) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict (transformers 4 or 5 layout)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = hf.get("architectures")
            raise ModelConfigError(
                f"unsupported model_type {model_type!r} (architectures {archs}); "
                f"grpo_jax supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        if scaling:
            rope = {**scaling, **rope}
        theta = rope.get("rope_theta", hf.get("rope_theta")) or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        llama3 = None
        if rope_type == "llama3":
            llama3 = (
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ModelConfigError(
                f"unsupported rope scaling {rope_type!r}; supported: default, llama3"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"unsupported hidden_act {hf.get('hidden_act')!r}; only silu")
        kw = dict(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_llama3=llama3,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
        )
        return cls(**kw).replace(**overrides)

    def to_hf(self) -> dict:
        """A `config.json` dict that transformers reads back to the same architecture."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        rope: dict = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_llama3:
            f, lo, hi, orig = self.rope_llama3
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta, "factor": f,
                    "low_freq_factor": lo, "high_freq_factor": hi,
                    "original_max_position_embeddings": orig}
        out = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: transformers 4 reads rope_theta/rope_scaling, 5 reads rope_parameters.
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        }
        if self.rope_llama3:
            out["rope_scaling"] = dict(rope)
        if self.model_type == "llama":
            out["attention_bias"] = self.qkv_bias
            out["mlp_bias"] = False
        return out
