"""Static description of a decoder: one dataclass for the Llama, Mistral, Phi-3, Qwen2, Qwen3,
Gemma 2 and Gemma 3 families and the mixtures of experts Qwen3-MoE, Mixtral and gpt-oss. The
families differ by switches (biases, norms, activation, sliding-window layers, soft-capping,
experts and their routing), each read from the HF config under its HF name."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Protocol

import jax
import jax.numpy as jnp

from grpo_jax.config.model import Numerics  # noqa: F401 (this module's API)
from grpo_jax.errors import ModelConfigError
from grpo_jax.models.tower_shape import TowerShape
from grpo_jax.models import qwen3_vl, qwen_vl
from grpo_jax.models.siglip import SiglipConfig

# The platform programs are traced for: this process's backend, unless aot traces for another
# (tracing_for) - attention_impl "auto" picks its kernel by it.
_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "target_platform", default=None)


def runs_of(kinds) -> tuple[tuple[int, int], ...]:
    """(first, stop) of each run of consecutive equal items of `kinds` (one per layer)."""
    runs: list[tuple[int, int]] = []
    for i, kind in enumerate(kinds):
        if runs and kinds[runs[-1][0]] == kind:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return tuple(runs)


def target_platform() -> str:
    """"cpu", "gpu" or "tpu": the platform the programs traced now will run on."""
    return _TARGET_PLATFORM.get() or jax.default_backend()


@contextlib.contextmanager
def tracing_for(platform: str):
    """Trace as on `platform` ("gpu", "tpu", "cpu") within the block (grpo_jax.aot)."""
    token = _TARGET_PLATFORM.set(platform)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)

# model_type -> the switches that family always has (the rest come from its config.json).
_GEMMA = dict(hidden_act="gelu_pytorch_tanh", norm_offset=True, scale_embeddings=True,
              sandwich_norms=True, tie_word_embeddings=True)
FAMILIES: dict[str, dict] = {
    "llama": {}, "mistral": {}, "phi3": {}, "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True), "qwen2_5_vl": dict(qkv_bias=True),
    "qwen3_vl": dict(qk_norm=True, mrope_interleaved=True), "gemma2": _GEMMA, "gemma3_text": dict(_GEMMA, qk_norm=True),
    "qwen3_moe": dict(qk_norm=True), "mixtral": dict(norm_topk_prob=True),
    # gpt-oss: a softmax over the k chosen logits (= the softmax over all experts' top k
    # renormalised), biases everywhere, a learned attention sink per head, its clamped SwiGLU.
    "gpt_oss": dict(norm_topk_prob=True, router_bias=True, expert_bias=True,
                    attention_sinks=True, swiglu_limit=7.0),
}
# Families whose attention_bias also puts a bias on o_proj (Qwen2's and Mistral's never do).
_O_BIAS_FAMILIES = ("llama", "qwen3", "gemma2", "gemma3_text", "qwen3_moe", "gpt_oss",
                    "qwen3_vl")
# Families whose config.json describes experts, and the key that counts them.
_NUM_EXPERTS_KEY = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts",
                    "gpt_oss": "num_local_experts"}
# Families whose config's sliding_window applies (Qwen2's needs use_sliding_window, refused).
_SLIDING_FAMILIES = ("mistral", "phi3", "gemma2", "gemma3_text", "mixtral", "gpt_oss")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "phi3": "Phi3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM", "gpt_oss": "GptOssForCausalLM",
                  "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                  "qwen3_vl": "Qwen3VLForConditionalGeneration"}
# gemma3 is Gemma 3's multimodal wrapper (4B and up): its text_config is the decoder.
_QWEN_VL = {qwen_vl.MODEL_TYPE: qwen_vl.QwenVisionConfig,
            qwen3_vl.MODEL_TYPE: qwen3_vl.Qwen3VisionConfig}
SUPPORTED_MODEL_TYPES = (*(f for f in FAMILIES if f not in _NUM_EXPERTS_KEY
                           and f not in _QWEN_VL), "gemma3", *_NUM_EXPERTS_KEY, *_QWEN_VL)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
ATTENTION_IMPLS = ("auto", "xla", "flash", "splash", "cudnn")
# "auto" leaves cuDNN for the blockwise attention beyond this many mask elements a device (cuDNN
# is given the mask as a bias: on an H200 2 rows of 32k took 3.6 GiB more than the blockwise
# attention, and the step 4.5x less time; docs/benchmarks.md).
CUDNN_MASK_ELEMENTS = 2 ** 32


_NUMERICS = tuple(f.name for f in dataclasses.fields(Numerics))


class ImageTower(Protocol):
    """A vision-language model's image encoder (Decoder.vision): qwen_vl.QwenVision,
    siglip.VisionTower, each a holder its VisionConfig builds (config.VisionConfig.tower) and
    the table walk fills. With LoRA adapters on it (models/lora.py) their scale, dropout and
    dropout key, as the Decoder's; lora_scale None: none. Its forward applies the adapters of
    every linear of its HF names (lora.tower_linears: each has one when PEFT's rules adapt
    it), beside the weight each adapts (`<holder>.<w>_lora_a|b`)."""

    lora_scale: float | None
    lora_dropout: float
    lora_dropout_key: jax.Array | None

    def __call__(self, pixel_values, image_grid_thw,
                 dtype) -> tuple[jax.Array, jax.Array | None]:
        """(features [n, F, D] of the batch's n images, each image's own first, how many are
        its own [n] int or None: all F), which replace the image placeholders in order."""

    def params(self) -> dict[str, jax.Array]:
        """Its parameters by the vision table's names (param_table's without "vision/")."""


class VisionConfig(Protocol):
    """A vision-language model's image side (ModelConfig.vision): qwen_vl.QwenVisionConfig
    (Qwen2.5-VL's ViT and merger), siglip.SiglipConfig (Gemma 3's SigLIP and projector). Its
    parameters are entries of the model's param_table under "vision/", placed by the Decoder
    into its tower and loaded and exported by hf.py with the decoder's."""

    image_token_id: int  # the placeholder whose embeddings the tower's features replace
    # HF tensor root -> a tensor under it every checkpoint has, by which hf.py finds where a
    # checkpoint put that root instead (Gemma 3's tower: "vision_tower.vision_model." on the Hub).
    hf_anchors: dict[str, str]
    # The decoder layers after which the tower's DeepStack features are added (Qwen3-VL; 0:
    # none). Its features are then [n, D * (1 + deepstack_layers)] (models/qwen3_vl.py).
    deepstack_layers: int

    def hf_export_name(self, key: str) -> str:
        """The name an export (and a push to a vLLM server) writes HF tensor `key` of hf_names
        under: where the wrapper's checkpoints keep it, as both transformers and vLLM load them
        (the decoder's nested: Gemma 3's "language_model.", Qwen3-VL's "model.language_model.";
        Gemma 3's tower under the Hub's "vision_tower.vision_model.")."""

    def param_table(self, text_hidden: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
        """name (without "vision/") -> (shape, logical axes); text_hidden: the decoder's."""

    def hf_names(self) -> dict[str, tuple[str, tuple[tuple[int, ...], ...]]]:
        """name -> (HF tensor name as save_pretrained writes it ({i}: a layer of a stacked
        entry), its layout: hf.py's groups of one layer)."""

    def tower(self) -> ImageTower:
        """The Decoder's holder of these parameters (set from the table), which encodes."""

    def encoded(self, image_tokens: int) -> TowerShape:
        """A prompt's `image_tokens` image tokens as the tower makes them (ModelConfigError
        when no set of its images gives that many)."""

    def to_hf(self, text_config: dict, tie_word_embeddings: bool) -> dict:
        """The wrapper's config.json around the decoder's `text_config` (ModelConfig.to_hf's)."""


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
    # "xla" (the plain [T, S] scores), "flash" (blockwise, plain JAX: models/attention.py),
    # "splash" (Pallas splash attention, TPU only), "cudnn" (fused flash attention on NVIDIA
    # GPUs, bf16/fp16 only) or "auto": see attention_kernel.
    attention_impl: str = "auto"
    hidden_act: str = "silu"  # "gelu_pytorch_tanh": Gemma's GeGLU MLP
    norm_offset: bool = False  # Gemma: RMSNorm scales by (1 + w)
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma 2/3: also a norm on the attention and MLP outputs
    query_pre_attn_scalar: float | None = None  # attention scores * this**-0.5 (None: head_dim)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the output logits
    # Sliding layers see keys fewer than sliding_window positions back. layer_types: per layer
    # "sliding_attention" or "full_attention"; None: every layer slides (Mistral, Phi-3).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # Gemma 3: sliding layers' RoPE base (None: rope_theta)
    rope_linear: float | None = None  # linear RoPE scaling of the full-attention layers
    # YaRN RoPE (gpt-oss): (factor, beta_fast, beta_slow, original_max_pos, truncate,
    # attention_factor); cos and sin are scaled by attention_factor.
    rope_yarn: tuple[float, float, float, int, bool, float] | None = None
    # Mixture of experts; num_experts 0: every MLP is dense. moe_intermediate_size: each
    # expert's hidden width. Layers listed in mlp_only_layers keep a dense MLP of
    # intermediate_size (Qwen3-MoE's mlp_only_layers and decoder_sparse_step).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    # Routing: softmax over all experts, then the top k, renormalised to sum 1 with
    # norm_topk_prob (Mixtral always; gpt-oss's softmax over its top k logits is the same).
    norm_topk_prob: bool = False
    router_bias: bool = False  # gpt-oss: the router has a bias
    expert_bias: bool = False  # gpt-oss: the experts' projections have biases
    # gpt-oss's SwiGLU: gate clamped above at the limit, up to [-limit, limit], then
    # (up + 1) * gate * sigmoid(alpha * gate). None: the plain gated activation (hidden_act).
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax
    o_bias: bool = False  # a bias on the attention output projection (gpt-oss)
    # The load-balancing loss's coefficient the checkpoint declares (TRL's default for
    # router_aux_loss_coef); 0 for dense models.
    router_aux_coef: float = 0.0
    # A vision-language model's image tower (None: text only): Qwen2.5-VL's ViT and merger
    # (models/qwen_vl.py), Qwen3-VL's (models/qwen3_vl.py) or Gemma 3's SigLIP tower and
    # projector (models/siglip.py), its params under vision/ in param_table; its features
    # replace the embeddings of its image_token_id tokens (Decoder.embed_multimodal).
    vision: VisionConfig | None = None
    # M-RoPE (Qwen2.5-VL, Qwen3-VL): head_dim/2 frequencies split into sections rotated by the
    # temporal, height and width positions (positions [3, B, T]); None: one position row.
    # Interleaved (Qwen3-VL): frequency j turns with row j % 3 while that row's section lasts
    # (3 x its size), else with the temporal row; else (Qwen2.5-VL) in contiguous sections.
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False

    def __post_init__(self):
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={self.attention_impl!r}: use one of "
                             f"{', '.join(ATTENTION_IMPLS)}")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelConfigError(f"unsupported hidden_act {self.hidden_act!r}; supported: "
                                   f"{', '.join(ACTIVATIONS)}")
        if self.layer_types is not None and (
                len(self.layer_types) != self.num_layers
                or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ModelConfigError(f"layer_types {self.layer_types} must name one of "
                                   f"{LAYER_TYPES} for each of the {self.num_layers} layers")
        if self.mrope_section and sum(self.mrope_section) != self.head_dim // 2:
            raise ModelConfigError(f"mrope_section {self.mrope_section} must add up to "
                                   f"head_dim / 2 = {self.head_dim // 2}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                                   f"[1, num_experts={self.num_experts}]")

    @property
    def deepstack_layers(self) -> int:
        """The first layers after which image features are added again (Qwen3-VL's DeepStack:
        models/qwen3_vl.py); 0 for every other model."""
        return 0 if self.vision is None else self.vision.deepstack_layers

    @property
    def image_blocks(self) -> bool:
        """Gemma 3 with images: each image's run of image tokens attends both ways among
        itself (transformers' token_type_ids mask), causal elsewhere."""
        return self.vision is not None and self.model_type == "gemma3_text"

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: does it route to experts (else a dense MLP)."""
        if not self.num_experts:
            return (False,) * self.num_layers
        return tuple(i not in self.mlp_only_layers for i in range(self.num_layers))

    def stack_layers(self, sparse: bool | None) -> tuple[int, ...]:
        """The layers whose weights a stacked parameter holds, in order: every layer (None),
        the sparse ones (True: experts, router) or the dense ones (False: the dense MLP)."""
        if sparse is None:
            return tuple(range(self.num_layers))
        return tuple(i for i, s in enumerate(self.moe_layers) if s == sparse)

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend over a sliding window."""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        if self.layer_types is None:
            return (True,) * self.num_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    def cache_length(self, layer: int, length: int) -> int:
        """KV-cache slots layer `layer` needs for `length` positions: a sliding layer keeps
        only its window (a ring, slot = position % window)."""
        if self.sliding_layers[layer]:
            return min(length, self.sliding_window)
        return length

    def cache_runs(self) -> tuple[tuple[int, int], ...]:
        """(first, stop) of each run of layers the sampler scans together, their KV caches
        stacked in one buffer (numerics.sampler_layers): consecutive layers alike in their MLP
        (dense or sparse) and attention (sliding or not), and in whether DeepStack features
        are added after them; each layer alone when unrolled."""
        mode, platform = self.numerics.sampler_layers, target_platform()
        if mode == "auto":
            wide = jnp.dtype(self.dtype).itemsize >= 4  # float32, or float64 under x64
            mode = "scan" if platform == "cpu" and wide else "unroll"
        if mode == "unroll":
            return tuple((i, i + 1) for i in range(self.num_layers))
        deep = [i < self.deepstack_layers for i in range(self.num_layers)]
        return runs_of(list(zip(self.moe_layers, self.sliding_layers, deep)))

    def use_cudnn_attention(self, decode: bool = False) -> bool:
        """decode: the step that attends from new tokens over a KV cache. "auto" keeps XLA's
        attention there: cuDNN's compiles for it (one kernel instead of four) but has not been
        timed on a GPU yet; "cudnn" uses it."""
        if self.attention_impl == "auto":
            return (not decode and target_platform() == "gpu"
                    and jnp.dtype(self.dtype) in (jnp.bfloat16, jnp.float16))
        return self.attention_impl == "cudnn"

    def attention_kernel(self, keys: int, context_parallel: bool = False,
                         queries: int | None = None, rows: int = 1) -> str:
        """The kernel of a pass without a KV cache (training, log-probs, prefill) of `queries`
        (default: `keys`) over `keys`, `rows` rows a device: attention_impl, or for "auto"
        splash on TPU; on a GPU cuDNN (bf16/fp16) while its dense [rows, T, S] mask stays
        under CUDNN_MASK_ELEMENTS (2 rows of 45k, one of 64k); else the plain scores while the
        keys fit one block, and the blockwise attention beyond. cuDNN has no soft-capping, nor
        a mask split over devices: with either the blockwise attention stands in."""
        impl, block = self.attention_impl, self.numerics.attention_block
        if impl == "auto":
            if target_platform() == "tpu":
                return "splash"
            small = rows * (queries or keys) * keys <= CUDNN_MASK_ELEMENTS
            impl = "cudnn" if self.use_cudnn_attention() and small else "xla"
        if impl == "cudnn" and (context_parallel or self.attn_logit_softcapping is not None):
            impl = "xla"
        if impl == "xla" and self.attention_impl == "auto" and (keys > block
                                                                or context_parallel):
            return "flash"
        return impl

    @property
    def attention_block(self) -> int:
        return self.numerics.attention_block

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

    def with_layers(self, n: int) -> "ModelConfig":
        """The first n layers, their per-layer settings cut to match (a shallower copy for
        compiling or timing a few layers of a big model)."""
        return self.replace(num_layers=n, layer_types=self.layer_types and self.layer_types[:n],
                            mlp_only_layers=tuple(i for i in self.mlp_only_layers if i < n))

    def vision_params(self) -> int:
        """The vision tower's and projector's parameters (0 for a text model)."""
        return sum(math.prod(shape) for shape, _ in vision_table(self).values())

    def num_params(self, active: bool = False) -> int:
        """All parameters (a vision tower's included); active: those one token runs through
        (its k experts of each sparse layer; no vision tower), the count a step's FLOPs scale
        with."""
        d, f, l, v = self.hidden_size, self.intermediate_size, self.num_layers, self.vocab_size
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 2 * d
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.o_bias:
            per_layer += d
        if self.attention_sinks:
            per_layer += self.num_heads
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.sandwich_norms:
            per_layer += 2 * d
        sparse = sum(self.moe_layers)
        fe, experts = self.moe_intermediate_size, self.num_experts
        expert = 3 * d * fe + (2 * fe + d if self.expert_bias else 0)
        moe = d * experts + (experts if self.router_bias else 0) + expert * (
            self.num_experts_per_tok if active else experts)
        head = 0 if self.tie_word_embeddings else d * v
        vision = 0 if active else self.vision_params()
        return (v * d + l * per_layer + (l - sparse) * 3 * d * f + sparse * moe + d + head
                + vision)

    @classmethod
    def from_hf(cls, hf: dict, **overrides) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict (transformers 4 or 5 layout)."""
        model_type = hf.get("model_type")
        vision, mrope = None, None
        if model_type == "gemma3":  # the wrapper's tie_word_embeddings is what transformers reads
            tie = {k: hf[k] for k in ("tie_word_embeddings",) if k in hf}
            if hf.get("vision_config"):  # Gemma3ForConditionalGeneration: also its images
                vision = SiglipConfig.from_hf(
                    hf["vision_config"], hf.get("mm_tokens_per_image", 256),
                    hf.get("image_token_index", hf.get("image_token_id")))
            hf = {**hf.get("text_config", {}), **tie, "model_type": "gemma3_text"}
            model_type = "gemma3_text"
        if model_type in _QWEN_VL:
            # transformers 5 nests the language model's fields in text_config; the hub's
            # Qwen2.5-VL checkpoints have them at the top level.
            vision = _QWEN_VL[model_type].from_hf(hf)
            tie = {k: hf[k] for k in ("tie_word_embeddings",) if k in hf}
            hf = {**(hf.get("text_config") or hf), **tie, "model_type": model_type}
            rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
            mrope = tuple(rope.get("mrope_section") or (16, 24, 24))
        if model_type not in FAMILIES:
            archs = hf.get("architectures")
            raise ModelConfigError(
                f"unsupported model_type {model_type!r} (architectures {archs}); "
                f"grpo_jax supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if hf.get("use_sliding_window"):
            raise ModelConfigError(f"{model_type} with use_sliding_window is not supported")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        family = FAMILIES[model_type]
        window = hf.get("sliding_window") if model_type in _SLIDING_FAMILIES else None
        _refuse_quantized(hf)
        layers = hf["num_hidden_layers"]
        rope = _rope(hf)
        kw = dict(
            family,
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            sliding_window=window,
            layer_types=_layer_types(hf, model_type, layers) if window else None,
            vision=vision,
            mrope_section=mrope,
            **rope,
        )
        kw["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings",
                                                family.get("tie_word_embeddings", False)))
        attention_bias = bool(hf.get("attention_bias", model_type == "gpt_oss"))
        kw["qkv_bias"] = family.get("qkv_bias", False) or attention_bias
        kw["o_bias"] = attention_bias and model_type in _O_BIAS_FAMILIES
        kw.update(_moe(hf, model_type, layers))
        return cls(**kw).replace(**overrides)

    def to_hf(self) -> dict:
        """A `config.json` dict that transformers reads back to the same architecture."""
        out = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.qkv_bias,
        }
        out.update(self._rope_hf())
        if self.model_type in _SLIDING_FAMILIES:
            out["sliding_window"] = self.sliding_window
        if self.layer_types is not None:
            out["layer_types"] = list(self.layer_types)
        if self.model_type.startswith("gemma"):
            out.update(hidden_activation=self.hidden_act,
                       query_pre_attn_scalar=self.query_pre_attn_scalar,
                       attn_logit_softcapping=self.attn_logit_softcapping,
                       final_logit_softcapping=self.final_logit_softcapping)
        if self.model_type == "llama":
            out["mlp_bias"] = False
        if self.num_experts:
            out.update(self._moe_hf())
        if self.vision is not None:  # the decoder is the wrapper's text_config
            if self.mrope_section:  # Qwen-VL's M-RoPE
                out["rope_parameters"]["mrope_section"] = list(self.mrope_section)
            return self.vision.to_hf(out, self.tie_word_embeddings)
        return out

    def _moe_hf(self) -> dict:
        out = {_NUM_EXPERTS_KEY[self.model_type]: self.num_experts,
               "num_experts_per_tok": self.num_experts_per_tok,
               "router_aux_loss_coef": self.router_aux_coef,
               "output_router_logits": False}
        if self.model_type == "qwen3_moe":
            out.update(moe_intermediate_size=self.moe_intermediate_size,
                       norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                       mlp_only_layers=list(self.mlp_only_layers))
        if self.model_type == "gpt_oss":
            out.update(swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
        return out

    def _rope_hf(self) -> dict:
        """RoPE in both spellings: transformers 4 reads rope_theta/rope_scaling, 5 reads
        rope_parameters (Gemma 3: one entry per layer type)."""
        full: dict = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_llama3:
            f, lo, hi, orig = self.rope_llama3
            full.update(rope_type="llama3", factor=f, low_freq_factor=lo, high_freq_factor=hi,
                        original_max_position_embeddings=orig)
        elif self.rope_linear:
            full.update(rope_type="linear", factor=self.rope_linear)
        elif self.rope_yarn:
            f, fast, slow, orig, truncate, attention = self.rope_yarn
            full.update(rope_type="yarn", factor=f, beta_fast=fast, beta_slow=slow,
                        original_max_position_embeddings=orig, truncate=truncate,
                        attention_factor=attention)
        out: dict = {"rope_theta": self.rope_theta, "rope_parameters": full}
        if full["rope_type"] != "default":
            out["rope_scaling"] = dict(full)
        if self.model_type == "gemma3_text":
            local = self.rope_local_theta or self.rope_theta
            out["rope_parameters"] = {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": local}}
            out["rope_local_base_freq"] = local
        return out


def _rope(hf: dict) -> dict:
    """The RoPE fields of a config.json: rope_parameters (transformers 5; Gemma 3 keyed by
    layer type) or rope_theta / rope_scaling / rope_local_base_freq (transformers 4)."""
    params = dict(hf.get("rope_parameters") or {})
    local = None
    if "full_attention" in params:  # Gemma 3 in transformers 5
        local = (params.get("sliding_attention") or {}).get("rope_theta")
        params = dict(params["full_attention"] or {})
    scaling = hf.get("rope_scaling") or {}
    rope = {**scaling, **params}
    theta = rope.get("rope_theta", hf.get("rope_theta")) or 10000.0
    local = local or hf.get("rope_local_base_freq")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelConfigError("partial_rotary_factor != 1 (partial RoPE) is not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "mrope":  # Qwen2-VL's hub configs: default RoPE, M-RoPE's sections aside
        rope_type = "default"
    out = dict(rope_theta=float(theta), rope_local_theta=float(local) if local else None)
    if rope_type == "llama3":
        out["rope_llama3"] = (float(rope["factor"]), float(rope["low_freq_factor"]),
                              float(rope["high_freq_factor"]),
                              int(rope["original_max_position_embeddings"]))
    elif rope_type == "linear":
        out["rope_linear"] = float(rope["factor"])
    elif rope_type == "yarn":
        out["rope_yarn"] = _yarn(rope, hf)
    elif rope_type not in ("default", None):
        raise ModelConfigError(
            f"unsupported rope scaling {rope_type!r}; supported: default, linear, llama3, yarn")
    return out


def _yarn(rope: dict, hf: dict) -> tuple:
    """transformers' _compute_yarn_parameters, its defaults included: (factor, beta_fast,
    beta_slow, original_max_pos, truncate, attention_factor)."""
    orig = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or hf["max_position_embeddings"] / orig
    attention = rope.get("attention_factor")
    if attention is None:
        mscale = lambda s, m=1.0: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0  # noqa: E731
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return (float(factor), float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1),
            orig, bool(rope.get("truncate", True)), float(attention))


def _moe(hf: dict, model_type: str, layers: int) -> dict:
    """The mixture-of-experts fields of a config.json (none for a dense family)."""
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map).
    experts = hf.get(_NUM_EXPERTS_KEY.get(model_type, "")) or hf.get("num_local_experts")
    if model_type not in _NUM_EXPERTS_KEY or not experts:
        return {}
    out = dict(num_experts=int(experts),
               num_experts_per_tok=int(hf["num_experts_per_tok"]),
               moe_intermediate_size=int(hf.get("moe_intermediate_size")
                                         or hf["intermediate_size"]),
               router_aux_coef=float(hf.get("router_aux_loss_coef", 0.001)))
    if model_type == "qwen3_moe":
        step = int(hf.get("decoder_sparse_step", 1))
        only = set(hf.get("mlp_only_layers") or ())
        out["mlp_only_layers"] = tuple(i for i in range(layers)
                                       if i in only or (i + 1) % step != 0)
        out["norm_topk_prob"] = bool(hf.get("norm_topk_prob", False))
    if model_type == "mixtral" and hf.get("router_jitter_noise"):
        raise ModelConfigError("Mixtral with router_jitter_noise (random router noise in "
                               "training) is not supported; set it to 0")
    if model_type == "gpt_oss":
        out.update(swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                   swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))
    return out


def _refuse_quantized(hf: dict) -> None:
    """Quantized checkpoints load only where the loader dequantizes them (gpt-oss's MXFP4
    experts); anything else stops with the fix."""
    quant = hf.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method and not (method == "mxfp4" and hf.get("model_type") == "gpt_oss"):
        raise ModelConfigError(
            f"quantized checkpoint (quant_method {method!r}): grpo_jax loads bf16/fp32 weights "
            "only (and gpt-oss's MXFP4 experts). Dequantize it once with transformers: "
            "`AutoModelForCausalLM.from_pretrained(DIR, dtype='bfloat16')."
            "save_pretrained(OUT)`")


def _layer_types(hf: dict, model_type: str, layers: int) -> tuple[str, ...] | None:
    """Which layers slide. transformers 5 writes layer_types; older Gemma configs imply them:
    Gemma 2 alternates (sliding first), Gemma 3 slides except every sliding_window_pattern-th."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    if model_type in ("gemma2", "gpt_oss"):
        pattern = 2
    elif model_type == "gemma3_text":
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    else:
        return None  # every layer slides
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers))


# name -> (shape, logical axes). L layers, D embed, H heads, K kv heads, Dh head dim, F mlp,
# V vocab, E experts, Fe an expert's hidden width; Ld, Ls: the dense and the sparse layers.
def param_table(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    L, D, H, K = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
    Dh, F, V = cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    Ls = sum(cfg.moe_layers)
    Ld = L - Ls
    table = {
        "embed": ((V, D), ("vocab", "embed")),                          # [V, D]
        "final_norm": ((D,), ("norm",)),                                # [D]
        "layers/attn_norm": ((L, D), ("layers", "norm")),               # [L, D]
        "layers/wq": ((L, D, H, Dh), ("layers", "embed", "heads", "head_dim")),
        "layers/wk": ((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "layers/wv": ((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "layers/wo": ((L, H, Dh, D), ("layers", "heads", "head_dim", "embed")),
        "layers/mlp_norm": ((L, D), ("layers", "norm")),                # [L, D]
    }
    if Ld:
        table["layers/w_gate"] = ((Ld, D, F), ("layers", "embed", "mlp"))  # [Ld, D, F]
        table["layers/w_up"] = ((Ld, D, F), ("layers", "embed", "mlp"))    # [Ld, D, F]
        table["layers/w_down"] = ((Ld, F, D), ("layers", "mlp", "embed"))  # [Ld, F, D]
    if Ls:
        E, Fe = cfg.num_experts, cfg.moe_intermediate_size
        table["layers/router"] = ((Ls, D, E), ("layers", "embed", None))
        table["layers/we_gate"] = ((Ls, E, D, Fe), ("layers", "expert", "embed", "mlp"))
        table["layers/we_up"] = ((Ls, E, D, Fe), ("layers", "expert", "embed", "mlp"))
        table["layers/we_down"] = ((Ls, E, Fe, D), ("layers", "expert", "mlp", "embed"))
        if cfg.router_bias:
            table["layers/router_bias"] = ((Ls, E), ("layers", None))
        if cfg.expert_bias:
            table["layers/be_gate"] = ((Ls, E, Fe), ("layers", "expert", "mlp"))
            table["layers/be_up"] = ((Ls, E, Fe), ("layers", "expert", "mlp"))
            table["layers/be_down"] = ((Ls, E, D), ("layers", "expert", None))
    if cfg.qkv_bias:
        table["layers/bq"] = ((L, H, Dh), ("layers", "heads", "head_dim"))
        table["layers/bk"] = ((L, K, Dh), ("layers", "kv_heads", "head_dim"))
        table["layers/bv"] = ((L, K, Dh), ("layers", "kv_heads", "head_dim"))
    if cfg.o_bias:
        table["layers/bo"] = ((L, D), ("layers", None))
    if cfg.attention_sinks:
        table["layers/sinks"] = ((L, H), ("layers", "heads"))
    if cfg.qk_norm:
        table["layers/q_norm"] = ((L, Dh), ("layers", "head_dim"))
        table["layers/k_norm"] = ((L, Dh), ("layers", "head_dim"))
    if cfg.sandwich_norms:  # Gemma 2/3: on the attention and MLP outputs, before the residual
        table["layers/post_attn_norm"] = ((L, D), ("layers", "norm"))
        table["layers/post_mlp_norm"] = ((L, D), ("layers", "norm"))
    if not cfg.tie_word_embeddings:
        table["lm_head"] = ((D, V), ("embed", "vocab"))                 # [D, V]
    table.update({"vision/" + k: v for k, v in vision_table(cfg).items()})
    return table


def vision_table(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """name -> (shape, logical axes) of the vision tower's parameters ({} for text)."""
    return {} if cfg.vision is None else cfg.vision.param_table(cfg.hidden_size)
