"""Qwen2.5-VL against transformers (PyTorch CPU, fp32): a tiny random model with a 3-block ViT
(one full-attention block, windows that do not tile the images) on a left-padded batch of two
prompts with images of different sizes: the logits, greedy generation over the KV cache with
M-RoPE's decode positions, and a load / export round trip through an HF directory."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from grpo_jax import hf, peft_io
from grpo_jax.cli import load_config
from grpo_jax.models import lora, quant, qwen_vl
from grpo_jax.rollout.native.refill import Refill
from grpo_jax.rollout.native.sampler import Sampler
from grpo_jax.rollout.native.sampling import SamplingParams

from vlm_models import (EOS, GRIDS, IMAGE, bnb_quantized, own_features, quantized_tower,
                        same_modules, tiny_qwen25)
from vlm_models import qwen_batch as _batch, qwen_hf_inputs as _hf_inputs
from vlm_models import qwen_hf_logits, qwen_logits, real_diff as _real_diff


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The HF model, its directory, and our model loaded from it."""
    path = tmp_path_factory.mktemp("qwen_vl") / "hf"
    ref = tiny_qwen25()
    ref.save_pretrained(path)
    model, _ = hf.load_model(str(path), dtype=jnp.float32)
    return ref, path, model


def test_layout_and_rope_index_match_transformers(tiny):
    """Each image's layout, computed in the program from its grid over the batch's padded
    patch count: positions as HF's vision_utils, windows the same sets of patches as its
    window index and cu_seqlens, the whole image one segment, padding in none; M-RoPE
    positions and deltas as get_rope_index, left padding included."""
    from transformers import vision_utils
    ref, _, model = tiny
    v = model.cfg.vision
    grid = torch.as_tensor(GRIDS)
    index, cu = vision_utils.get_vision_window_index(grid, 2, 16, 4)
    patches = (index.numpy()[:, None] * 4 + np.arange(4)).ravel()  # window order, in patches
    theirs = [frozenset(patches[a:b].tolist()) for a, b in zip(cu[:-1], cu[1:]) if b > a]
    want_positions = vision_utils.get_vision_position_ids(grid, 2).numpy()
    width = int(GRIDS.prod(1).max())
    ours, positions, offset = [], [], 0
    for g in GRIDS:
        layout = jax.jit(qwen_vl.image_layout, static_argnums=(0, 2))(v, jnp.asarray(g), width)
        n = int(g.prod())
        rows = np.asarray(layout.windows.index)[np.asarray(layout.windows.valid).any(1)]
        valid = np.asarray(layout.windows.valid)[np.asarray(layout.windows.valid).any(1)]
        ours += [frozenset((r[m] + offset).tolist()) for r, m in zip(rows, valid)]
        assert np.asarray(layout.valid).sum() == n == np.asarray(layout.frame.valid).sum()
        positions.append(np.asarray(layout.positions)[:n])
        offset += n
    assert sorted(ours, key=min) == sorted(theirs, key=min)
    np.testing.assert_array_equal(np.concatenate(positions), want_positions)
    tokens, mask, _ = _batch()
    ids = torch.as_tensor(tokens)
    want, deltas = ref.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=grid,
                                            attention_mask=torch.as_tensor(mask))
    got, got_deltas = qwen_vl.rope_index(v, tokens, mask, GRIDS)
    np.testing.assert_array_equal(got, want.numpy())
    np.testing.assert_array_equal(got_deltas, deltas.numpy()[:, 0])


def test_logits_match_transformers(tiny):
    ref, _, model = tiny
    batch = _batch()
    v = model.cfg.vision
    with torch.no_grad():  # the tower alone first: a failure here is the ViT's
        want = ref.model.get_image_features(torch.as_tensor(batch[2]), torch.as_tensor(GRIDS))
    features = own_features(model.vision(jnp.asarray(batch[2]), GRIDS, jnp.float32))
    feature_diff = np.abs(np.asarray(features) - torch.cat(want.pooler_output).numpy()).max()
    print(f"max |image features diff| {feature_diff:.2e}")
    assert feature_diff < 1e-4
    diff = _real_diff(qwen_logits(model, batch), qwen_hf_logits(ref, batch), batch[1])
    print(f"max |logits diff| {diff:.2e}")
    assert diff < 1e-4
    assert v.fullatt_block_indexes == (1,) and model.cfg.mrope_section == (2, 3, 3)


def test_greedy_generation_matches_transformers(tiny):
    """The native sampler given the images (its prompt pass: embed_multimodal's embeddings,
    M-RoPE positions, over the KV cache; its decode steps: text positions plus the rope delta;
    the prompts padded to a wider bucket than HF's) against transformers' generate; its
    log-probs against one forward over prompt + completion, as the trainer would run it; and
    so do refilled decode slots."""
    ref, _, model = tiny
    batch, n = _batch(), 6
    with torch.no_grad():
        want = ref.generate(**_hf_inputs(*batch), do_sample=False, max_new_tokens=n,
                            min_new_tokens=n, pad_token_id=0)
    want = want[:, batch[0].shape[1]:].numpy()
    tokens, mask, pixels = batch
    prompts = [row[m.astype(bool)] for row, m in zip(tokens, mask)]
    sp = SamplingParams(max_completion_length=n, temperature=0)
    out = Sampler(model.cfg, sp, pad_id=0, buckets=(32,)).generate(
        model, prompts, pixel_values=pixels, image_grid_thw=GRIDS)
    np.testing.assert_array_equal(out.completion_ids, want)
    # The trainer's view: one forward over prompt + completion, M-RoPE positions from
    # rope_index of the whole rows (the completion continues the text), gives the sampler's
    # log-probs.
    full = (np.concatenate([tokens, want], 1), np.concatenate([mask, np.ones_like(want)], 1),
            pixels)
    logp = jax.nn.log_softmax(qwen_logits(model, full)[:, tokens.shape[1] - 1:-1], axis=-1)
    logp = np.take_along_axis(np.asarray(logp), want[..., None], axis=-1)[..., 0]
    print(f"max |sampler - forward log-prob| {np.abs(out.sampler_logp - logp).max():.2e}")
    np.testing.assert_allclose(out.sampler_logp, logp, atol=1e-4)
    # Through 3 refilled decode slots, 2 rows a prompt (4 rows): a row's M-RoPE delta follows
    # it into its slot.
    sp = dataclasses.replace(sp, max_num_seqs=3)
    slots = Refill(Sampler(model.cfg, sp, pad_id=0, buckets=(32,))).generate(
        model, prompts, 2, pixel_values=pixels, image_grid_thw=GRIDS)
    m = slots.metrics  # the refill program ran (a static batch would have 4 slots)
    assert m["generate/slot_steps"] == 3 * m["generate/decode_steps"], m
    np.testing.assert_array_equal(slots.completion_ids, np.repeat(want, 2, axis=0))
    assert np.abs(slots.sampler_logp - np.repeat(out.sampler_logp, 2, axis=0)).max() < 5e-5


def test_export_round_trip(tiny, tmp_path):
    """Our export reloads in transformers with the same tensor names and equal logits; our
    loader reads it back to the same config."""
    ref, path, model = tiny
    hf.save_hf(model, tmp_path / "out", source_dir=path)
    back = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "out")
    assert set(back.state_dict()) == set(ref.state_dict())
    assert back.config.text_config.eos_token_id == EOS  # the source's text fields kept
    batch = _batch()
    diff = _real_diff(qwen_logits(model, batch), qwen_hf_logits(back.eval(), batch), batch[1])
    print(f"max |logits diff| after export {diff:.2e}")
    assert diff < 1e-4
    again, _ = hf.load_model(str(tmp_path / "out"), dtype=jnp.float32)
    assert again.cfg == model.cfg
    exported = hf.hf_state_dict(model.cfg, hf.params_numpy(model))
    from safetensors.numpy import load_file
    assert set(exported) == set(load_file(path / "model.safetensors"))


def test_text_only_positions_are_plain_rope(tiny):
    """A VL model on text alone takes [B, T] positions: M-RoPE with three equal rows."""
    _, _, model = tiny
    tokens = jnp.asarray([[5, 6, 7, 8]])
    mask = jnp.ones_like(tokens)
    pos = jnp.arange(4)[None]
    one, _ = model(tokens, pos, mask)
    three, _ = model(tokens, jnp.broadcast_to(pos, (3, 1, 4)), mask)
    np.testing.assert_allclose(np.asarray(one), np.asarray(three), atol=1e-6)


def test_num_params_counts_the_tower(tiny):
    ref, _, model = tiny
    assert model.cfg.num_params() == sum(p.numel() for p in ref.parameters())
    assert model.cfg.num_params(active=True) == sum(
        p.numel() for n, p in ref.named_parameters() if not n.startswith("model.visual."))


def _adapted(model, targets):
    """A fresh copy of our tiny model with LoRA adapters on `targets` (PEFT's
    target_modules), every A and B random (B off zero: each adapter counts)."""
    args = lora.PeftArgs(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=targets)
    lora.add_adapters(model, args, jax.random.key(0))
    rng = np.random.default_rng(1)
    nnx.update(model, jax.tree.map(lambda a: jnp.asarray(
        0.1 * rng.standard_normal(a.shape), jnp.float32), nnx.state(model, lora.LoraParam)))
    assert all(np.abs(np.asarray(b)).min() > 0 for b in jax.tree.leaves(
        nnx.state(model, lora.LoraParam)))
    return model, args


def _peft_modules(model) -> set[str]:
    return {n[len("base_model.model."):-len(".lora_A")] for n, _ in model.named_modules()
            if n.endswith(".lora_A")}


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("gate_proj", "down_proj"),
                                     ("v_proj", "qkv", "fc1"), "all-linear"])
def test_lora_adapts_the_modules_peft_adapts(tiny, tmp_path, targets):
    """The modules grpo-jax adapts on Qwen2.5-VL (language model, ViT blocks and merger) are
    those peft.get_peft_model adapts on the transformers model for the same target_modules
    (q_proj / v_proj: none of the tower's, whose attention is one fused qkv; the MLP names:
    the ViT's MLPs too; all-linear: also qkv as one module, proj and the merger's mlp.0 /
    mlp.2), and the exported adapter_config makes PeftModel adapt those again and loads back
    as model_name_or_path (the same adapters)."""
    peft = pytest.importorskip("peft")
    _, path, _ = tiny
    model, args = _adapted(hf.load_model(str(path), dtype=jnp.float32)[0], targets)
    ours = {k[len(peft_io.PREFIX):-len(".lora_A.weight")]
            for k in peft_io.adapter_tensors(model) if k.endswith(".lora_A.weight")}
    names = targets if isinstance(targets, str) else list(targets)
    fresh = lambda: transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path)  # noqa
    theirs = _peft_modules(peft.get_peft_model(fresh(), peft.LoraConfig(target_modules=names)))
    assert ours == theirs
    assert any(".visual." in m for m in ours) == (targets != ("q_proj", "v_proj"))
    out = peft_io.save_adapter(model, args, tmp_path / "adapter", str(path))
    assert _peft_modules(peft.PeftModel.from_pretrained(fresh(), out)) == theirs
    # As model_name_or_path the directory loads back: its targets read from the pattern.
    cfg = peft_io.adapter_settings(load_config("squares", [
        f"model_name_or_path={out}", "use_peft=true", f"output_dir={tmp_path / 'run'}"]))
    again, _ = peft_io.load_model(cfg, None)
    saved = peft_io.adapter_tensors(model)
    assert all(np.array_equal(v, saved[k]) for k, v in peft_io.adapter_tensors(again).items())
    assert set(peft_io.adapter_tensors(again)) == set(saved)


def test_tower_lora_logits_are_peft_s(tiny, tmp_path):
    """All-linear adapters (random A and B) on the tiny Qwen2.5-VL, exported as a PEFT
    directory and loaded by PeftModel.from_pretrained onto transformers' model: its logits on
    prompts with images equal ours (adapters applied, and merged into the base as the sampler
    and --merge get them), and differ from the base's. The image features take gradient into
    every tower adapter (the qkv's, the merger's among them), as many as aot's estimate
    counts."""
    peft = pytest.importorskip("peft")
    ref, path, _ = tiny
    model, args = _adapted(hf.load_model(str(path), dtype=jnp.float32)[0], "all-linear")
    out = peft_io.save_adapter(model, args, tmp_path / "adapter", str(path))
    fresh = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
    batch = _batch()
    want = qwen_hf_logits(peft.PeftModel.from_pretrained(fresh, out).eval(), batch)
    ours = qwen_logits(model, batch)
    merged = qwen_logits(peft_io.merged_model(model), batch)
    diff, moved = _real_diff(ours, want, batch[1]), _real_diff(qwen_hf_logits(ref, batch), want,
                                                              batch[1])
    print(f"tower LoRA: ours vs PEFT max |logits diff| {diff:.2e} (the adapters moved them "
          f"by {moved:.2e}); merged vs PEFT {_real_diff(merged, want, batch[1]):.2e}")
    assert diff < 1e-4 and _real_diff(merged, want, batch[1]) < 1e-4 and moved > 1e-2
    tokens, _, pixels = batch
    graphdef, adapters, rest = nnx.split(model, lora.LoraParam, nnx.Param)
    # aot's estimate counts them from the config alone.
    assert lora.tower_adapter_params(args, model.cfg) == lora.count(adapters["vision"])
    features = lambda a: nnx.merge(graphdef, a, rest).embed_multimodal(  # noqa: E731
        tokens, pixels, GRIDS)
    grads = jax.jit(jax.grad(lambda a: (features(a) ** 2).sum()))(adapters)["vision"]
    assert sorted(grads) == ["blocks", "merger"]
    assert all(np.abs(np.asarray(g[...])).max() > 0 for g in jax.tree.leaves(grads))


def test_load_in_4bit_quantizes_the_tower_as_bitsandbytes(tiny):
    """QLoRA's base (load_in_4bit) quantizes the ViT's and the merger's linears, those
    transformers' bitsandbytes quantizer replaces on the same model (and no others: the
    Conv3d patch embedding stays): their codes and scales are quant.py's of the fp32 weights
    (the merger's, outside the stacked blocks, as a stack of one); the tower's features are
    those of its dequantized weights, and near the fp32 model's (NF4 on a tiny random model:
    within 5% of the largest, 0.034 measured; the logits, the decoder's projections quantized
    too, within 20%, 0.135 measured)."""
    ref, path, model = tiny
    q, _ = hf.load_model(str(path), dtype=jnp.float32, quant_bits=4)
    theirs = {n for n in bnb_quantized(ref) if ".visual." in n}
    assert same_modules(theirs, quantized_tower(q)) and len(theirs) == 3 * 5 + 2
    for name, (module, n_in) in quant.tower_linears(q.cfg.vision).items():
        part, leaf = name.split("/")
        w = getattr(getattr(model.vision, part), leaf)[...]
        stacked = "{i}" in module
        codes, scale = quant.quantize(w if stacked else w[None], n_in, 4)
        holder = getattr(q.vision, part)
        got = getattr(holder, leaf)[...], getattr(holder, f"{leaf}_qscale")[...]
        assert got[0].dtype == jnp.uint4
        np.testing.assert_array_equal(got[0], codes if stacked else codes[0])
        np.testing.assert_array_equal(got[1], scale if stacked else scale[0])
    assert q.vision.patch_embed[...].dtype == jnp.float32
    batch = _batch()
    features = [own_features(m.vision(jnp.asarray(batch[2]), GRIDS, jnp.float32))
                for m in (model, q)]
    params = q.vision.params()  # the weights dequantized, without their scales
    scales = {k[:-len("_qscale")]: v for k, v in params.items() if k.endswith("_qscale")}
    params = {k: quant.dequantize(v, scales[k], jnp.float32, stacked=scales[k].ndim == 3)
              if k in scales else v
              for k, v in params.items() if not k.endswith("_qscale")}
    dequantized = own_features(qwen_vl.per_image(q.cfg.vision, qwen_vl.vision_forward, params,
                                                 jnp.asarray(batch[2]), GRIDS, jnp.float32))
    np.testing.assert_allclose(features[1], dequantized, atol=1e-6)
    # What a merge (the sampler's merged copy, export --merge) starts from: the same weights.
    base = quant.dequantized_base(nnx.state(q, nnx.Param))["vision"]
    assert all(np.array_equal(base[part][leaf][...], params[f"{part}/{leaf}"])
               for part, leaf in (n.split("/") for n in quant.tower_linears(q.cfg.vision)))
    assert not any(k.endswith("_qscale") for part in ("blocks", "merger") for k in base[part])
    feature_err = np.abs(features[1] - features[0]).max() / np.abs(features[0]).max()
    want = qwen_logits(model, batch)
    logit_err = _real_diff(qwen_logits(q, batch), want, batch[1]) / np.abs(want).max()
    print(f"NF4 tower: image features within {feature_err:.3f}, logits {logit_err:.3f} of "
          "the largest (fp32)")
    assert 0 < feature_err < 0.05 and 0 < logit_err < 0.2
