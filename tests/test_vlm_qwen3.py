"""Qwen3-VL against transformers (PyTorch CPU, fp32): a tiny random model (tests/vlm_models.py
tiny_qwen3: a learned 6 x 6 position grid resampled to each image, DeepStack features added
after the first two of three decoder layers, interleaved M-RoPE) on the left-padded batch of two
prompts with images of different sizes of test_vlm_qwen: the tower's features (DeepStack's too),
the logits, greedy generation over the KV cache, the trainer's shared-prefix forward, an export
round trip, LoRA on the tower and the language model as PEFT's, and the forward on a context
axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from grpo_jax import hf, peft_io
from grpo_jax.models import lora, qwen3_vl, qwen_vl
from grpo_jax.rollout.native.sampler import Sampler
from grpo_jax.rollout.native.sampling import SamplingParams

from vlm_models import (GRIDS, IMAGE, bnb_quantized, own_features, qwen_batch as _batch,
                        qwen_hf_inputs as _hf_inputs, qwen_hf_logits, qwen_logits, quantized_tower,
                        real_diff as _real_diff, same_modules, tiny_qwen3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The HF model, its directory, and our model loaded from it."""
    path = tmp_path_factory.mktemp("qwen3_vl") / "hf"
    ref = tiny_qwen3()
    ref.save_pretrained(path)
    model, _ = hf.load_model(str(path), dtype=jnp.float32)
    return ref, path, model


def test_tower_and_logits_match_transformers(tiny):
    """The position table's taps as vision_utils' (bilinear, align_corners, merge-block order);
    M-RoPE positions as get_rope_index; the merger's and both DeepStack mergers' features; the
    logits (< 1e-4), which the DeepStack features move (dropping them: > 1e-2). Under
    load_in_4bit the tower's linears that bitsandbytes would quantize are NF4 codes."""
    from transformers import vision_utils
    ref, _, model = tiny
    v, batch = model.cfg.vision, _batch()
    taps, width = [], int(GRIDS.prod(1).max())
    for g in GRIDS:  # each image's, in the program from its grid, its own patches first
        layout = qwen_vl.image_layout(v, jnp.asarray(g), width, windows=False)
        taps.append([np.asarray(a)[:g.prod()] for a in qwen3_vl.position_taps(
            v, layout, jnp.asarray(g))])
    index, weight = (np.concatenate(a) for a in zip(*taps))
    want_index, want_weight = vision_utils.get_vision_interpolation_indices_and_weights(
        torch.as_tensor(GRIDS), 6, mode="bilinear", align_corners=True, spatial_merge_size=2)
    np.testing.assert_array_equal(index, want_index.numpy())
    np.testing.assert_allclose(weight, want_weight.numpy(), atol=1e-6)
    tokens, mask, pixels = batch
    ids = torch.as_tensor(tokens)
    want, deltas = ref.model.get_rope_index(ids, (ids == IMAGE).int(),
                                            image_grid_thw=torch.as_tensor(GRIDS),
                                            attention_mask=torch.as_tensor(mask))
    got, got_deltas = qwen_vl.rope_index(v, tokens, mask, GRIDS)
    np.testing.assert_array_equal(got, want.numpy())
    np.testing.assert_array_equal(got_deltas, deltas.numpy()[:, 0])
    with torch.no_grad():
        out = ref.model.get_image_features(torch.as_tensor(pixels), torch.as_tensor(GRIDS))
    theirs = [torch.cat(out.pooler_output)] + [torch.cat(f) for f in out.deepstack_features]
    features = own_features(model.vision(jnp.asarray(pixels), GRIDS, jnp.float32))
    assert v.deepstack_layers == 2 and features.shape[1] == 3 * model.cfg.hidden_size
    diff = np.abs(features - torch.cat(theirs, 1).numpy()).max()
    print(f"max |image features diff| (merger and DeepStack) {diff:.2e}")
    assert diff < 1e-4
    ours, hf_logits = qwen_logits(model, batch), qwen_hf_logits(ref, batch)
    diff = _real_diff(ours, hf_logits, mask)
    print(f"max |logits diff| {diff:.2e}")
    assert diff < 1e-4
    assert model.cfg.mrope_interleaved and model.cfg.mrope_section == (2, 3, 3)
    # QLoRA's base (load_in_4bit) quantizes the linears transformers' bitsandbytes quantizer
    # replaces on the tower (the DeepStack mergers' too); its features stay near the fp32's.
    q, _ = hf.load_model(str(tiny[1]), dtype=jnp.float32, quant_bits=4)
    theirs = {n for n in bnb_quantized(ref) if ".visual." in n}
    assert same_modules(theirs, quantized_tower(q)) and len(theirs) == 3 * 4 + 2 + 2 * 2
    coarse = own_features(q.vision(jnp.asarray(pixels), GRIDS, jnp.float32))
    assert 0 < np.abs(coarse - features).max() / np.abs(features).max() < 0.1
    # Without the DeepStack addends the logits move: the test above sees them.
    d = model.cfg.hidden_size
    emb = model.embed_multimodal(jnp.asarray(tokens), jnp.asarray(pixels), GRIDS)
    hidden, _ = model(jnp.asarray(tokens), jnp.asarray(got), jnp.asarray(mask),
                      inputs_embeds=emb[..., :d])
    assert _real_diff(np.asarray(model.logits(hidden)), hf_logits, mask) > 1e-2


def test_greedy_generation_and_the_trainers_forward(tiny):
    """The native sampler given the images (its prefill over the KV cache adds DeepStack's
    features in the first two layers; decode steps add nothing) against transformers'
    generate; its log-probs against one forward over prompt + completion and against the
    trainer's shared-prefix forward (each prompt's embeddings once, 2 completions each)."""
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
    # The trainer's view of prompt + completion: a sampled placeholder id is text (its
    # positions as if padding, Sampler.row_positions; no image feature takes it).
    ids, P = np.concatenate([tokens, want], 1), tokens.shape[1]
    full_mask = np.concatenate([mask, np.ones_like(want)], 1)
    positions, _ = qwen_vl.rope_index(model.cfg.vision, np.where(
        np.arange(ids.shape[1]) < P, ids, 0), full_mask, GRIDS)
    emb = model.embed_multimodal(jnp.asarray(ids), jnp.asarray(pixels), GRIDS,
                                 is_image=jnp.asarray((ids == IMAGE) & (np.arange(len(ids[0])) < P)))
    hidden, _ = model(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(full_mask),
                      inputs_embeds=emb)
    logp = jax.nn.log_softmax(np.asarray(model.logits(hidden))[:, P - 1:-1], axis=-1)
    logp = np.take_along_axis(np.asarray(logp), want[..., None], axis=-1)[..., 0]
    print(f"max |sampler - forward log-prob| {np.abs(out.sampler_logp - logp).max():.2e}")
    np.testing.assert_allclose(out.sampler_logp, logp, atol=1e-4)
    # Shared prefix: each prompt's embeddings (with DeepStack's addends) once, 2 rows each.
    rows = np.repeat(want, 2, axis=0)
    emb = model.embed_multimodal(jnp.asarray(tokens), jnp.asarray(pixels), GRIDS)
    pos = np.repeat(positions, 2, axis=1)
    _, hidden = model.shared_prefix(
        jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(rows), jnp.ones_like(rows), 2,
        prompt_embeds=emb, positions=(jnp.asarray(positions[:, :, :P]),
                                      jnp.asarray(pos[:, :, P:])))
    shared = jax.nn.log_softmax(np.asarray(model.logits(hidden)), axis=-1)
    # hidden at completion token t predicts token t + 1; the prompt's last predicts token 0.
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(shared)[:, :-1], rows[:, 1:, None], -1)[..., 0],
        np.repeat(logp, 2, axis=0)[:, 1:], atol=1e-4)


def test_export_round_trip_and_lora_as_peft(tiny, tmp_path):
    """Our export reloads in transformers under its own tensor names with equal logits, and
    our loader reads it back to the same config. All-linear adapters (random A and B: the
    language model's, every tower linear's, both DeepStack mergers' too) exported as a PEFT
    directory adapt the modules peft.get_peft_model adapts, and give PeftModel's logits."""
    peft = pytest.importorskip("peft")
    ref, path, model = tiny
    hf.save_hf(model, tmp_path / "out", source_dir=path)
    back = transformers.Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "out")
    assert set(back.state_dict()) == set(ref.state_dict())
    batch = _batch()
    diff = _real_diff(qwen_logits(model, batch), qwen_hf_logits(back.eval(), batch), batch[1])
    print(f"max |logits diff| after export {diff:.2e}")
    assert diff < 1e-4
    again, _ = hf.load_model(str(tmp_path / "out"), dtype=jnp.float32)
    assert again.cfg == model.cfg
    adapted, _ = hf.load_model(str(path), dtype=jnp.float32)
    args = lora.PeftArgs(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules="all-linear")
    lora.add_adapters(adapted, args, jax.random.key(0))
    rng = np.random.default_rng(1)
    nnx.update(adapted, jax.tree.map(lambda a: jnp.asarray(
        0.1 * rng.standard_normal(a.shape), jnp.float32), nnx.state(adapted, lora.LoraParam)))
    out = peft_io.save_adapter(adapted, args, tmp_path / "adapter", str(path))
    fresh = transformers.Qwen3VLForConditionalGeneration.from_pretrained(path).eval()
    theirs = peft.get_peft_model(fresh, peft.LoraConfig(target_modules="all-linear"))
    modules = lambda m: {n[len("base_model.model."):-len(".lora_A")]  # noqa: E731
                         for n, _ in m.named_modules() if n.endswith(".lora_A")}
    ours = {k[len(peft_io.PREFIX):-len(".lora_A.weight")]
            for k in peft_io.adapter_tensors(adapted) if k.endswith(".lora_A.weight")}
    assert ours == modules(theirs) and any("deepstack_merger_list" in m for m in ours)
    fresh = transformers.Qwen3VLForConditionalGeneration.from_pretrained(path).eval()
    want = qwen_hf_logits(peft.PeftModel.from_pretrained(fresh, out).eval(), batch)
    diff = _real_diff(qwen_logits(adapted, batch), want, batch[1])
    merged = _real_diff(qwen_logits(peft_io.merged_model(adapted), batch), want, batch[1])
    moved = _real_diff(qwen_hf_logits(ref, batch), want, batch[1])
    print(f"LoRA: ours vs PEFT {diff:.2e}, merged {merged:.2e} (the adapters moved the "
          f"logits by {moved:.2e})")
    assert diff < 1e-4 and merged < 1e-4 and moved > 1e-2


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py)")
def test_a_context_axis_takes_the_deepstack_features(tiny):
    """On a (fsdp 2, context 2, tensor 2) mesh, positions zig-zag over the context axis, as
    the trainer lays out long rows: the input embeddings are permuted with their DeepStack
    part before the decoder splits it off, so the logits equal one device's (fp32)."""
    from grpo_jax import mesh as mesh_lib
    _, _, model = tiny
    tokens, mask, pixels = _batch()
    pad = -tokens.shape[1] % 8  # zig-zag: 2 x context chunks of equal length
    tokens, mask = (np.pad(a, ((0, 0), (pad, 0))) for a in (tokens, mask))
    want = qwen_logits(model, (tokens, mask, pixels))
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=2, tp=2, cp=2))
    laid = nnx.merge(*nnx.split(model))
    laid.shard_activations(mesh)
    graphdef, params = nnx.split(laid, nnx.Param)
    params = jax.device_put(params, mesh_lib.param_shardings(params, mesh))
    positions, _ = qwen_vl.rope_index(model.cfg.vision, tokens, mask, GRIDS)
    order = laid.sequence_order(tokens.shape[1])
    assert order is not None  # the context axis permutes

    @jax.jit
    def forward(params, tokens, positions, mask, pixels):
        m = nnx.merge(graphdef, params)
        emb = m.embed_multimodal(tokens, pixels, GRIDS)
        hidden, _ = m(tokens, positions, mask, inputs_embeds=emb, order=order)
        return m.logits(hidden)[:, np.argsort(order)]
    got = np.asarray(forward(params, *map(jnp.asarray, (tokens, positions, mask, pixels))))
    diff = _real_diff(got, want, mask) / np.abs(want).max()
    print(f"context axis vs one device, logits {diff:.2e} relative")
    assert diff < 1e-5
