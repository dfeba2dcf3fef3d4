"""Gemma 3 with images (Gemma3ForConditionalGeneration) against transformers (PyTorch CPU,
fp32): the SigLIP tower and projector, the image tokens' bidirectional attention (on a sliding
layer whose window is shorter than an image), greedy decoding through the KV cache after a
prefill with images, and the HF directory round trip."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from grpo_jax import hf
from grpo_jax.models import positions_from_mask, quant, siglip
from grpo_jax.models.decoder import image_blocks
from grpo_jax.rollout.native.refill import Refill
from grpo_jax.rollout.native.sampler import Sampler
from grpo_jax.rollout.native.sampling import SamplingParams

from vlm_models import (BOI, EOI, IMG, MM, PAD, bnb_quantized, own_features, quantized_tower,
                        same_modules, tiny_gemma3)

# Row 0: one image, row 1: two images and a longer text, so row 0 is left-padded.
ROWS = [[5, 17, BOI, *[IMG] * MM, EOI, 42, 8],
        [7, BOI, *[IMG] * MM, EOI, 9, 10, BOI, *[IMG] * MM, EOI, 11, 12, 13]]
NUM_IMAGES = 3


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(transformers model, its directory, our model loaded from it, batch)."""
    ref = tiny_gemma3()
    path = tmp_path_factory.mktemp("gemma3vl") / "hf"
    ref.save_pretrained(path)
    model, _ = hf.load_model(str(path), dtype=jnp.float32)
    width = max(map(len, ROWS))
    ids = np.array([[PAD] * (width - len(r)) + r for r in ROWS])
    mask = (np.arange(width)[None] >= (width - np.array([len(r) for r in ROWS]))[:, None])
    pixels = np.random.default_rng(0).normal(size=(NUM_IMAGES, 3, 28, 28)).astype(np.float32)
    return ref, path, model, (ids, mask.astype(np.int32), pixels)


def _hf_logits(ref, ids, mask, pixels):
    m = torch.as_tensor(mask)
    with torch.no_grad():
        return ref(input_ids=torch.as_tensor(ids), attention_mask=m,
                   pixel_values=torch.as_tensor(pixels),
                   token_type_ids=torch.as_tensor((ids == IMG).astype(np.int64)),
                   position_ids=(m.cumsum(-1) - 1).clamp(min=0)).logits.numpy()


def _logits(model, ids, mask, pixels):
    tokens, mask = jnp.asarray(ids), jnp.asarray(mask)
    embeds = model.embed_multimodal(tokens, jnp.asarray(pixels))
    hidden, _ = model(tokens, positions_from_mask(mask), mask, inputs_embeds=embeds)
    return np.asarray(model.logits(hidden))


def _diff(a, b, mask):
    return float(np.abs(a - b)[mask.astype(bool)].max())


def test_config_and_blocks(vlm):
    _, _, model, (ids, _, _) = vlm
    cfg = model.cfg
    assert cfg.model_type == "gemma3_text" and cfg.vision.image_token_id == IMG
    assert cfg.vision.mm_tokens_per_image == MM and cfg.vision.num_patches == 16
    blocks = np.asarray(image_blocks(jnp.asarray(ids), IMG))
    assert blocks[1].tolist() == [-1] * 2 + [0] * 4 + [-1] * 4 + [1] * 4 + [-1] * 4


def test_logits_match_transformers(vlm):
    """Left-padded rows with one and two images; every real position within 1e-4."""
    ref, _, model, (ids, mask, pixels) = vlm
    ours, theirs = _logits(model, ids, mask, pixels), _hf_logits(ref, ids, mask, pixels)
    diff = _diff(ours, theirs, mask)
    print("max logits diff", diff)
    assert diff < 1e-4
    # The images' bidirectional attention matters here: causal-only logits differ.
    tokens, m = jnp.asarray(ids), jnp.asarray(mask)
    embeds = model.embed_multimodal(tokens, jnp.asarray(pixels))
    cfg = model.cfg  # no image blocks: the placeholder id matches no token
    model.cfg = cfg.replace(vision=dataclasses.replace(cfg.vision, image_token_id=-1))
    try:
        hidden, _ = model(tokens, positions_from_mask(m), m, inputs_embeds=embeds)
    finally:
        model.cfg = cfg
    assert _diff(np.asarray(model.logits(hidden)), theirs, mask) > 1e-3


def test_greedy_generation_matches_generate(vlm):
    """The sampler prefills the prompts with their images (Sampler.generate's images) into
    the KV cache (rings of 3 slots on the sliding layers), then decodes 6 greedy tokens
    through it: transformers' generate's tokens; and so do refilled decode slots."""
    ref, _, model, (ids, mask, pixels) = vlm
    n, P = 6, ids.shape[1]
    with torch.no_grad():
        out = ref.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                           pixel_values=torch.as_tensor(pixels),
                           token_type_ids=torch.as_tensor((ids == IMG).astype(np.int64)),
                           do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=PAD)
    want = out[:, P:].numpy()
    sp = SamplingParams(max_completion_length=n, temperature=0, stop_token_ids=())
    got = Sampler(model.cfg, sp, pad_id=PAD, buckets=(32,)).generate(model, ROWS,
                                                                     pixel_values=pixels)
    print("greedy", want.tolist())
    np.testing.assert_array_equal(got.completion_ids, want)
    # Through 3 refilled decode slots, 2 rows a prompt (4 rows): each prompt's images encoded
    # and prefilled once, its rows admitted into whichever slot is free.
    sp = dataclasses.replace(sp, max_num_seqs=3)
    slots = Refill(Sampler(model.cfg, sp, pad_id=PAD, buckets=(32,))).generate(
        model, ROWS, 2, pixel_values=pixels)
    m = slots.metrics  # the refill program ran (a static batch would have 4 slots)
    assert m["generate/slot_steps"] == 3 * m["generate/decode_steps"], m
    np.testing.assert_array_equal(slots.completion_ids, np.repeat(want, 2, axis=0))
    assert np.abs(slots.sampler_logp - np.repeat(got.sampler_logp, 2, axis=0)).max() < 5e-5


def test_export_round_trip(vlm, tmp_path):
    """save_hf writes the names transformers' save_pretrained writes, but the tower's under the
    Hub's vision_tower.vision_model. (which vLLM loads); transformers reloads the export with
    the same logits, and so do we."""
    ref, path, model, (ids, mask, pixels) = vlm
    hf.save_hf(model, tmp_path / "out", source_dir=path)
    back = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    want = _logits(model, ids, mask, pixels)
    diff = _diff(want, _hf_logits(back, ids, mask, pixels), mask)
    print("export round trip max diff", diff)
    assert diff < 1e-4
    again, _ = hf.load_model(str(tmp_path / "out"), dtype=jnp.float32)
    assert again.cfg == model.cfg
    assert _diff(_logits(again, ids, mask, pixels), want, mask) == 0
    # hf_state_dict (a weight sync's names) with the tower: the export's.
    params = {**hf.params_numpy(model),
              **{"vision/" + k: v for k, v in model.vision.params().items()}}
    with safe_open(path / "model.safetensors", "np") as st:
        assert set(hf.hf_state_dict(model.cfg, params)) == {
            k.replace("vision_tower.", "vision_tower.vision_model.") for k in st.keys()}


def test_loads_the_hub_and_transformers_5_nestings(vlm, tmp_path):
    """The Hub's checkpoints nest the tower as vision_tower.vision_model.*, transformers 5's
    modules as model.language_model.* / model.vision_tower.*: both load to the same model."""
    from safetensors.numpy import save_file
    _, path, model, (ids, mask, pixels) = vlm
    want = _logits(model, ids, mask, pixels)
    with safe_open(path / "model.safetensors", "np") as st:
        tensors = {k: st.get_tensor(k) for k in st.keys()}
    for name, rename in (("hub", lambda k: k.replace("vision_tower.", "vision_tower.vision_model.")),
                         ("v5", lambda k: "model." + k.replace("language_model.model.",
                                                               "language_model."))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_bytes((path / "config.json").read_bytes())
        save_file({rename(k): v for k, v in tensors.items()},
                  tmp_path / name / "model.safetensors")
        again, _ = hf.load_model(str(tmp_path / name), dtype=jnp.float32)
        assert _diff(_logits(again, ids, mask, pixels), want, mask) == 0, name


def test_load_in_4bit_quantizes_the_tower_as_bitsandbytes(vlm):
    """QLoRA's base (load_in_4bit) quantizes SigLIP's attention and MLP linears, those
    transformers' bitsandbytes quantizer replaces on the same model; the patch conv, the
    position embedding and the projector (mm_input_projection_weight: a bare nn.Parameter)
    stay in fp32, as bitsandbytes leaves them. The codes and scales are quant.py's of the fp32
    weights; the tower's features are those of its dequantized weights, and near the fp32
    model's: NF4 rounds a weight by up to 15% of its block's absmax (here a block is a whole
    32-input row), so on this tiny random model the features are within 25% of the largest
    (0.168 measured) and the logits, the decoder quantized too, within 60% (0.430)."""
    ref, path, model, (ids, mask, pixels) = vlm
    q, _ = hf.load_model(str(path), dtype=jnp.float32, quant_bits=4)
    theirs = {n for n in bnb_quantized(ref) if "vision_tower" in n or "projector" in n}
    assert same_modules(theirs, quantized_tower(q)) and len(theirs) == 2 * 6
    for name, (_, n_in) in quant.tower_linears(q.cfg.vision).items():
        leaf = name.split("/")[1]
        codes, scale = quant.quantize(getattr(model.vision.layers, leaf)[...], n_in, 4)
        np.testing.assert_array_equal(getattr(q.vision.layers, leaf)[...], codes)
        np.testing.assert_array_equal(getattr(q.vision.layers, f"{leaf}_qscale")[...], scale)
    assert {q.vision.mm_proj[...].dtype, q.vision.patch_embed[...].dtype} == {np.dtype(np.float32)}
    features = [own_features(m.vision(jnp.asarray(pixels), None, jnp.float32))
                for m in (model, q)]
    params = q.vision.params()  # the weights dequantized, without their scales
    params = {k: quant.dequantize(v, params[f"{k}_qscale"], jnp.float32, stacked=True)
              if f"{k}_qscale" in params else v
              for k, v in params.items() if not k.endswith("_qscale")}
    dequantized = siglip.encode(q.cfg.vision, params, jnp.asarray(pixels), jnp.float32)
    np.testing.assert_allclose(features[1], np.asarray(dequantized).reshape(features[1].shape),
                               atol=1e-6)
    feature_err = np.abs(features[1] - features[0]).max() / np.abs(features[0]).max()
    want = _logits(model, ids, mask, pixels)
    logit_err = _diff(_logits(q, ids, mask, pixels), want, mask) / np.abs(want).max()
    print(f"NF4 tower: image features within {feature_err:.3f}, logits {logit_err:.3f} of "
          "the largest (fp32)")
    assert 0 < feature_err < 0.25 and 0 < logit_err < 0.6
