"""Tiny random vision-language models made with transformers (PyTorch CPU, fp32), the oracles
of the VLM tests: Gemma 3 (a SigLIP tower, a sliding window shorter than an image) and
Qwen2.5-VL (a 3-block ViT, windows that do not tile the images). Norms and biases are perturbed
so that a comparison sees them."""

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from grpo_jax.models import qwen_vl

# Gemma 3: placeholder, begin and end of image, pad.
IMG, BOI, EOI, PAD = 100, 101, 102, 0
MM = 4  # soft tokens per image: 28 px / 7 px patches = a 4 x 4 grid, pooled 2 x 2


def tiny_gemma3(seed=0):
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=256, rms_norm_eps=1e-6, query_pre_attn_scalar=24,
                # A window of 3 < the 4 tokens of an image: a sliding layer's image token sees
                # the later tokens of its image but not the earliest one's.
                sliding_window=3,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                    "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 1e4}},
                bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=7, num_channels=3,
                  vision_use_head=False)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                    mm_tokens_per_image=MM, image_token_index=IMG,
                                    boi_token_index=BOI, eoi_token_index=EOI)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    # Init leaves norms at 1 (or 0), biases and the projection at 0: perturb them all so that
    # the comparison sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "mm_input" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


# Qwen2.5-VL
IMAGE, START, END, EOS = 150, 152, 153, 2
# Patch grids (t, h, w): 8x10 patches merge to 4x5 tokens, windows of 2x2 merged tokens leave
# a partial column; 4x6 patches merge to 2x3 tokens (a partial window too).
GRIDS = np.array([[1, 8, 10], [1, 4, 6]])


def qwen_batch():
    """Two left-padded prompts, each text, an image (its merged-token placeholders between
    vision start and end) and more text; row 1 shorter, with the smaller image."""
    merged = GRIDS.prod(1) // 4
    rows = [[5, 17, START, *[IMAGE] * merged[0], END, 99, 3, 42],
            [7, START, *[IMAGE] * merged[1], END, 8, 9]]
    width = max(map(len, rows))
    tokens = np.array([[0] * (width - len(r)) + r for r in rows])
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((int(GRIDS.prod(1).sum()), 3 * 2 * 4 * 4)).astype(np.float32)
    return tokens, mask, pixels


def qwen_hf_inputs(tokens, mask, pixels):
    t = torch.as_tensor(tokens)
    return dict(input_ids=t, attention_mask=torch.as_tensor(mask),
                pixel_values=torch.as_tensor(pixels), image_grid_thw=torch.as_tensor(GRIDS),
                mm_token_type_ids=(t == IMAGE).int())


def own_features(out) -> np.ndarray:
    """A tower's (features [n, F, D], counts) as HF's: each image's own features, in order."""
    features, counts = out
    features = np.asarray(features)
    if counts is None:
        return features.reshape(-1, features.shape[-1])
    return np.concatenate([f[:c] for f, c in zip(features, np.asarray(counts))])


def real_diff(a, b, mask):
    return float(np.abs(a - b)[mask.astype(bool)].max())


def qwen_hf_logits(ref, batch):
    """transformers' logits of a Qwen-VL model `ref` on qwen_batch's `batch`."""
    with torch.no_grad():
        return ref(**qwen_hf_inputs(*batch)).logits.float().numpy()


@nnx.jit
def _qwen_forward(model, tokens, positions, mask, pixels):
    emb = model.embed_multimodal(tokens, pixels, GRIDS)  # the processor's order, its grids
    hidden, _ = model(tokens, positions, mask, inputs_embeds=emb)
    return model.logits(hidden)


def qwen_logits(model, batch):
    """Our Qwen-VL `model`'s logits on qwen_batch's `batch` (M-RoPE positions as rope_index
    places them)."""
    tokens, mask, pixels = batch
    positions, _ = qwen_vl.rope_index(model.cfg.vision, tokens, mask, GRIDS)
    return np.asarray(_qwen_forward(model, *map(jnp.asarray, (tokens, positions, mask, pixels))))


def tiny_qwen25(seed=0):
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                         eos_token_id=EOS, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=16, out_hidden_size=64, fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=151, vision_start_token_id=START,
        vision_end_token_id=END, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def tiny_qwen3(seed=0):
    """Qwen3-VL: a 3-block ViT on a learned 6 x 6 position grid (resampled up and down to the
    images' grids), DeepStack mergers after blocks 0 and 1 (added after the first two of three
    decoder layers), interleaved M-RoPE, Qwen3's q/k norms."""
    cfg = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=64, num_position_embeddings=36,
                           deepstack_visual_indexes=[0, 1]),
        image_token_id=IMAGE, video_token_id=151, vision_start_token_id=START,
        vision_end_token_id=END, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen3VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def bnb_quantized(model) -> set[str]:
    """The modules transformers' bitsandbytes quantizer replaces under load_in_4bit (and
    load_in_8bit: the same filter): every `nn.Linear` but those get_modules_to_not_convert
    keeps (lm_head, tied weights, the last module, llm_int8_skip_modules, the model's
    _keep_in_fp32_modules), as the bnb quantizer's _process_model_before_weight_loading and
    replace_with_bnb_linear select them; bitsandbytes itself is not needed to read them."""
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module
    config = transformers.BitsAndBytesConfig(load_in_4bit=True)
    skip = HfQuantizer.get_modules_to_not_convert(model, config.llm_int8_skip_modules,
                                                  model._keep_in_fp32_modules)
    return {n for n, m in model.named_modules()
            if type(m) is torch.nn.Linear and should_convert_module(n, skip)}


def quantized_tower(model) -> set[str]:
    """The HF module names ({i}: each layer) of our model's tower linears stored quantized."""
    from grpo_jax.models import quant
    out = set()
    for name, (module, _) in quant.tower_linears(model.cfg.vision).items():
        part, leaf = name.split("/")
        holder = vars(getattr(model.vision, part))
        if f"{leaf}_qscale" in holder:
            layers = range(holder[leaf].shape[0]) if "{i}" in module else [None]
            out |= {module.format(i=i) for i in layers}
    return out


def same_modules(theirs: set[str], ours: set[str]) -> bool:
    """Each of transformers' module names ends with exactly one of ours, each of ours is
    matched (checkpoint roots differ: "model.visual." / "visual.")."""
    matches = {t: [o for o in ours if t == o or t.endswith("." + o)] for t in theirs}
    return (all(len(m) == 1 for m in matches.values())
            and {m[0] for m in matches.values()} == ours)


def gemma3_for(processor, mm: int, head_dim: int = 16, seed: int = 0):
    """A random Gemma 3 whose special ids are `processor`'s, `mm` soft tokens per image (a
    28 px image: SigLIP's 4 x 4 patches pooled), text width 4 x head_dim (vLLM's CPU attention
    wants head_dim 32 or more)."""
    tok = processor.tokenizer
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image", "<image_soft_token>"), ("boi", "<start_of_image>"),
        ("eoi", "<end_of_image>"))}
    text = dict(vocab_size=128, hidden_size=4 * head_dim, intermediate_size=6 * head_dim,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=head_dim, max_position_embeddings=512, rms_norm_eps=1e-6,
                query_pre_attn_scalar=head_dim, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=7, num_channels=3,
                  vision_use_head=False)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                    mm_tokens_per_image=mm, image_token_index=ids["image"],
                                    boi_token_index=ids["boi"], eoi_token_index=ids["eoi"])
    torch.manual_seed(seed)
    return transformers.Gemma3ForConditionalGeneration(cfg).eval()
