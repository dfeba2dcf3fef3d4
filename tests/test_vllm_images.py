"""A vision-language model's rollouts from a real vLLM CPU server (rollout/vllm/rollout.py):
each prompt sent with one placeholder per image and its images, which vLLM expands itself.
Gemma 3: a tiny random one that vLLM can load (vLLM's processor looks up the newline tokens;
text head_dim 32; exported by grpo-jax, which vLLM 0.32 serves and transformers 5.23's own
save_pretrained not: hf.save_hf), one soft token
per image (MM below), trained 3 steps through the server. Qwen2.5-VL and Qwen3-VL: the
rollout on a server of each, before and after a push. Oracles: the trainer's own forward with
the images (the JAX model), and the processor's ids. Each server's start-up ~35-40 s (eager,
vllm_server.NO_INDUCTOR), RSS ~2 GB."""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from flax import nnx
from PIL import Image

from grpo_jax import hf, image_blocks, images, squares
from grpo_jax.checkpoint import load_checkpoint
from grpo_jax.cli import load_config
from grpo_jax.config.rollout import SamplingParams
from grpo_jax.errors import VLLMServerError
from grpo_jax.grpo.batch import Batch
from grpo_jax.grpo.train_step import completion_logps
from grpo_jax.models import lora
from grpo_jax.models.config import ModelConfig
from grpo_jax.rollout import tools
from grpo_jax.rollout.base import WeightMode
from grpo_jax.rollout.custom import CustomRollout
from grpo_jax.rollout.engines import MainProcessRollout
from grpo_jax.rollout.vllm.rollout import VLLMRollout, unexpanded_ids
from grpo_jax.train import train
import reward_fixtures
from hf_oracle import char_tokenizer
from vllm_server import API_KEY, NO_INDUCTOR, needs_vllm, start_vllm
from vlm_models import gemma3_for
from vlm_processors import (PICTURE_EPISODE, PICTURE_TOOL, QWEN_TEMPLATE,
                            ImageOnlyQwenProcessor, gemma_processor, tool_model)

# Soft tokens per image: one. vLLM's CPU attention (0.32) has no image-prefix mode, so Gemma 3's
# image tokens attend causally there, where transformers, the trainer and vLLM's GPU backends
# let an image's tokens see each other (docs/vllm.md); with one token the two are the same.
MM = 1


def tiny_gemma3_for_vllm(processor, seed=0, mm=MM):
    """A random Gemma 3 whose image features depend on the pixels (transformers initialises
    the projection to zeros: it and the norms are perturbed) and whose language model is far
    enough from uniform that a changed weight shows in the log-probs."""
    model = gemma3_for(processor, mm, head_dim=32, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "mm_input" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "language_model" in name:
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3_vllm")
    processor = gemma_processor(newlines=True, image_seq_length=MM)
    tiny_gemma3_for_vllm(processor).save_pretrained(root / "saved")
    processor.save_pretrained(root / "saved")
    # vLLM's Gemma 3 loader takes the tower under the Hub's name only: our export writes it
    # there, transformers 5.23's save_pretrained under vision_tower.* (vLLM can't load that).
    model, _ = hf.load_model(str(root / "saved"), dtype=jnp.float32)
    hf.save_hf(model, root / "model", source_dir=root / "saved", dtype="float32")
    processor.save_pretrained(root / "model")
    assert any(k.startswith("vision_tower.vision_model.") for k in
               safetensors.torch.load_file(root / "model" / "model.safetensors"))
    return root / "model"


@pytest.fixture(scope="module")
def gemma3_server(gemma3_dir, tmp_path_factory):
    srv = start_vllm(gemma3_dir, tmp_path_factory.mktemp("gemma3_server"), 512, **NO_INDUCTOR)
    yield srv
    srv.stop()


def _prompts(processor, n: int, seed: int):
    """n 'squares' prompts (the dataset's question over a drawn image) as records, with the
    processor's ids."""
    rng = np.random.default_rng(seed)
    prompts = [images.multimodal_messages([{"role": "user", "content": squares.QUESTION}],
                                          [squares.draw(rng)[0]], i) for i in range(n)]
    batch = images.process(processor, prompts)
    return [{"prompt": p, "prompt_ids": batch.prompt_ids(i)} for i, p in enumerate(prompts)]


def _scores(model, r) -> np.ndarray:
    """The trainer's log-probs of a rollout's completions, with the rows' images (and
    Qwen-VL's M-RoPE positions; a tool loop's: its results' images and tool_mask)."""
    batch = Batch(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                  r.truncated, np.zeros(len(r.prompt_ids), np.float32),
                  pixel_values=r.pixel_values, image_grid=r.image_grid,
                  positions=r.positions, tool_mask=r.tool_mask,
                  completion_images=r.completion_images)
    return np.asarray(completion_logps(model, batch, 1.0, 128)[0])


def _lora_reaches_the_server(model_dir, processor, base_url, tmp_path) -> dict[str, float]:
    """LoRA on every linear, the tower's too (PEFT's all-linear), its B drawn away from zero,
    pushed to the server as a LoRA run does by default (the adapters alone, merged there into
    the base pushed first, by the base's names): the max |diff| of the server's samples'
    log-probs against the trainer's with those adapters, without them, and with the tower's
    alone zeroed."""
    cfg = load_config("squares", _settings(model_dir, tmp_path / "lora", base_url) + [
        "use_peft=true", "lora_target_modules=all-linear", "lora_r=4"])
    model, _ = hf.load_model(str(model_dir), dtype=jnp.float32)
    lora.add_adapters(model, cfg.peft, jax.random.key(3))
    graphdef, adapters, base = nnx.split(model, lora.LoraParam, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(4), 1000))
    adapters = jax.tree_util.tree_map_with_path(
        lambda path, x: 0.3 * jax.random.normal(next(keys), x.shape, x.dtype)
        if "_lora_b" in jax.tree_util.keystr(path) else x, adapters)
    rollout = VLLMRollout(cfg, model.cfg, SamplingParams(
        max_completion_length=6, stop_token_ids=(processor.tokenizer.eos_token_id,)),
        processor.tokenizer.pad_token_id, processor)
    assert rollout.weight_mode is WeightMode.PUSH_ADAPTERS and rollout.tower_adapted
    rollout.update_weights((adapters, base), None)
    # An adapter named after no pushed weight (as PEFT's module names were for Gemma 3, the
    # old defect) stops the push with one line before the server is asked, instead of
    # sampling from the base.
    version = rollout.weights.version
    wrong = {"model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A": np.zeros((4, 8))}
    with pytest.raises(VLLMServerError, match="1 LoRA tensors .* adapt no weight pushed"):
        rollout.weights.push_adapters(None, wrong)
    assert rollout.weights.version == version
    records = _prompts(processor, 2, seed=5)
    r = rollout.generate(None, [x["prompt_ids"] for x in records], 2, jax.random.key(5), records)
    real = r.completion_mask.astype(bool)
    blind_tower = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if path[0].key == "vision"
        and "_lora_b" in jax.tree_util.keystr(path) else x, adapters)
    return {name: float(np.abs(_scores(nnx.merge(graphdef, a, base), r) - r.sampler_logp)[
        real].max()) for name, a in (
            ("adapted", adapters), ("no adapters", jax.tree.map(jnp.zeros_like, adapters)),
            ("tower's adapters zeroed", blind_tower))}


def _settings(model_dir, out, base_url) -> list[str]:
    sets = {"model_name_or_path": model_dir, "output_dir": out, "max_steps": 3,
            "num_generations": 4, "per_device_train_batch_size": 8, "dtype": "float32",
            "max_completion_length": 6, "max_prompt_length": 128, "learning_rate": 0.01,
            "eval_strategy": "no", "eval_on_start": "false", "save_steps": 3,
            "report_to": "[]", "num_completions_to_print": 0, "log_completions": "false",
            "use_vllm": "true", "vllm_server_base_url": base_url,
            "vllm_server_api_key": API_KEY, "vllm_server_timeout": 60}
    return [f"{k}={v}" for k, v in sets.items()]


def test_unexpanded_ids_are_the_rendered_texts_ids(gemma3_dir):
    proc = gemma_processor(newlines=True)
    cfg = ModelConfig.from_hf(json.loads((gemma3_dir / "config.json").read_text()))
    im = Image.new("RGB", (28, 28), (255, 0, 0))
    prompts = [[{"role": "user", "content": [{"type": "image", "image": im},
                                             {"type": "text", "text": "How many?"}]}],
               [{"role": "user", "content": [{"type": "text", "text": "Look:\n"},
                                             {"type": "image", "image": im},
                                             {"type": "image", "image": im},
                                             {"type": "text", "text": "count"}]}]]
    batch = images.process(proc, prompts)
    for i, p in enumerate(prompts):
        want = proc.tokenizer(images.render(proc, p), add_special_tokens=False)["input_ids"]
        got = unexpanded_ids(proc, cfg, batch.prompt_ids(i))
        assert got == want
        boi = proc.tokenizer.convert_tokens_to_ids(proc.boi_token)
        assert got.count(boi) == len(images.prompt_images(p))
        assert len(got) < len(batch.prompt_ids(i))
    # A tool loop's context: its tool result's image is one (marked), a placeholder token the
    # model wrote is not, and such a context can't go to the server.
    soft, ids = cfg.vision.image_token_id, batch.prompt_ids(0)
    result = proc.tokenizer("ok" + proc.full_image_sequence + "56",
                            add_special_tokens=False)["input_ids"]
    marks = [True] * len(ids) + [t == soft for t in result]
    want = proc.tokenizer(images.render(proc, prompts[0]) + "ok" + proc.boi_token + "56",
                          add_special_tokens=False)["input_ids"]
    assert unexpanded_ids(proc, cfg, ids + result, marks) == want
    for wrote in (boi, soft):
        assert unexpanded_ids(proc, cfg, ids + result + [wrote], marks + [False]) is None


def test_images_go_to_the_server_at_the_processors_size():
    """An image resized to the processor's one size first makes the same pixels in the trainer's
    processor (PIL) as the image itself, and leaves the server's processor (torchvision's resize,
    one uint8 level off in places for a 100 x 73 image) nothing to resize."""
    proc = gemma_processor(newlines=True)
    im = Image.fromarray(np.random.default_rng(0).integers(0, 256, (73, 100, 3), np.uint8))
    small = images.at_processed_size(proc, im)
    assert small.size == (28, 28)
    pixels = [proc.image_processor(images=[x], return_tensors="np")["pixel_values"]
              for x in (im, small)]
    np.testing.assert_array_equal(*pixels)


@needs_vllm
def test_grpo_run_through_the_server_with_images_and_tools(gemma3_dir, gemma3_server, tmp_path):
    """A calculator that returns a picture of its answer (TRL 1.16's multimodal tool result;
    TOOL_TEMPLATE's generation prompt begins every turn with a call). First the tool loop on
    the server's initial weights: every row calls it, its completion holds the picture's
    tokens, and the server's samples of both turns score as the trainer's (prompt's image and
    picture in the forward), the turn after the picture not as without it. Then three GRPO
    steps on 'squares' with the server's rollouts in async rounds (max_staleness 1), the
    language model pushed after each update: every step's completions score alike under the
    server and the trainer with the weights that generated them, one version old after the
    first step (so each push landed: the weights moved between steps). Then, on the trained
    weights, the server's samples score as the checkpoint's model does, not as the initial one,
    and not as without the images, and so do a rollout_func's (TRL 1.16's, sampling with its
    prompts' images)."""
    model_dir = tool_model(gemma3_dir, tmp_path / "model")
    (tmp_path / "picture.py").write_text(PICTURE_TOOL)
    (tmp_path / "episode.py").write_text(PICTURE_EPISODE)
    out = tmp_path / "run"
    cfg = load_config("squares", _settings(model_dir, out, gemma3_server.base_url) + [
        "max_staleness=1", "max_prompt_length=256", "max_completion_length=192",
        f"tools=[{tmp_path / 'picture.py'}:calculator]", "max_tool_calling_iterations=1",
        f"reward_funcs=[accuracy,{tmp_path / 'episode.py'}:episode]"])
    processor = images.load_processor(model_dir)
    initial, _ = hf.load_model(str(gemma3_dir), dtype=jnp.float32)
    tok = tools.prepare_tool_tokenizer(processor.tokenizer)
    with_call = copy.deepcopy(processor)
    with_call.chat_template = tok.chat_template  # as the run renders its prompts
    records = _prompts(with_call, 2, seed=7)
    stops = tuple(range(2, 40))
    # Process 0's rollout as a multi-process run holds it: every process places a tool's
    # images itself (here the one process).
    looped = tools.ToolRollout(
        MainProcessRollout(lambda: VLLMRollout(
            cfg, initial.cfg, SamplingParams(max_completion_length=192, stop_token_ids=stops),
            tok.pad_token_id, processor), takes_records=True, processor=processor,
            model_cfg=initial.cfg, pad=tok.pad_token_id),
        tok, tools.Toolbox(tools.load_tools([f"{tmp_path / 'picture.py'}:calculator"]), 10.0),
        1, stops, tok.pad_token_id).generate(None, [x["prompt_ids"] for x in records], 2,
                                             jax.random.key(1), records)
    np.testing.assert_array_equal(looped.tool_calls, 1)
    assert (looped.completion_images.sum(axis=1) == MM).all()
    assert image_blocks.count(looped.pixel_values) == 2
    model_tok = (looped.completion_mask * looped.tool_mask).astype(bool)
    after = model_tok & (np.cumsum(looped.completion_images, axis=1) > 0)
    assert after.any(axis=1).all()
    blind = looped.pixel_values.copy()
    blind[:, 1] = 0  # each row's second image: the picture
    diff = {"tool loop": float(np.abs(_scores(initial, looped) - looped.sampler_logp)[
        model_tok].max()), "turn after the picture, picture zeroed": float(np.abs(
            _scores(initial, looped._replace(pixel_values=blind)) - looped.sampler_logp)[
            after].max())}

    train(cfg, devices=jax.devices()[:1])
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "loss" in s]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # Under the weights that generated each batch (one version old after the first).
    worst = max(s["sampling/engine_logp_difference/max"] for s in steps)
    print(f"server vs trainer log-probs over the run, same weights: max |diff| {worst:.3g}; "
          f"async/staleness {[s['async/staleness'] for s in steps]}; rewards/episode/mean "
          f"{[s['rewards/episode/mean'] for s in steps]}")
    assert worst < 1e-4
    assert [s["async/staleness"] for s in steps] == [0, 1, 1]
    assert all(s["timing/weight_sync"] > 0 for s in steps)
    # Every row calls the tool; most write a turn after its result (another call, unparsed).
    assert all(s["tools/call_frequency"] == 1 and s["tools/failure_frequency"] == 0
               and s["rewards/episode/mean"] > 0.5 for s in steps)

    trained, _, step = load_checkpoint(out)
    assert step == 3
    trained.cfg = trained.cfg.replace(dtype=jnp.float32)
    eos = processor.tokenizer.eos_token_id
    sp = SamplingParams(max_completion_length=6, stop_token_ids=(eos,))
    rollout = VLLMRollout(cfg, trained.cfg, sp, processor.tokenizer.pad_token_id, processor)
    records = _prompts(processor, 2, seed=7)
    r = rollout.generate(None, [x["prompt_ids"] for x in records], 2, jax.random.key(0),
                         records)
    assert r.pixel_values.shape[0] == 4
    real = r.completion_mask.astype(bool)
    diff |= {name: float(np.abs(logp - r.sampler_logp)[real].max()) for name, logp in (
        ("trained", _scores(trained, r)), ("initial", _scores(initial, r)),
        ("trained, images zeroed",
         _scores(trained, r._replace(pixel_values=np.zeros_like(r.pixel_values)))))}
    # A rollout_func's rows, sampled through the server with their prompts' images.
    by_fn = CustomRollout(rollout, reward_fixtures.seeing_episode, processor.tokenizer, cfg,
                          (eos,), processor.tokenizer.pad_token_id).generate(
        None, [x["prompt_ids"] for x in records], 2, jax.random.key(2), records)
    diff["rollout_func"] = float(np.abs(_scores(trained, by_fn) - by_fn.sampler_logp)[
        by_fn.completion_mask.astype(bool)].max())
    # A tool loop's context holding a begin-of-image token the model wrote can't go to the
    # server, which would read it as an image: that row ends with no tokens, the other is sampled.
    boi = processor.tokenizer.convert_tokens_to_ids(processor.boi_token)
    wrote = dict(records[0], image_tokens=[True] * len(records[0]["prompt_ids"]) + [False])
    ended = rollout.generate(None, [records[0]["prompt_ids"] + [boi], records[1]["prompt_ids"]],
                             1, jax.random.key(3), [wrote, records[1]])
    assert ended.completion_mask.sum(axis=1)[0] == 0 and ended.completion_mask[1].sum() > 0
    print(f"server's samples vs trainer log-probs, max |diff|: {diff}")
    assert diff["tool loop"] < 1e-4 and diff["trained"] < 1e-4 and diff["rollout_func"] < 1e-4
    assert diff["turn after the picture, picture zeroed"] > 1e-3
    assert diff["initial"] > 1e-3 and diff["trained, images zeroed"] > 1e-3


@needs_vllm
def test_lora_on_the_tower_reaches_the_server(gemma3_dir, gemma3_server, tmp_path):
    """Gemma 3 with LoRA on the language model and the SigLIP tower: the adapters pushed by
    the names the server loaded (the tower's under the Hub's vision_tower.vision_model.), its
    samples score as the trainer's adapted model, not as the base or the unadapted tower."""
    adapted = _lora_reaches_the_server(gemma3_dir, images.load_processor(gemma3_dir),
                                       gemma3_server.base_url, tmp_path)
    print(f"LoRA (the tower's too) pushed, server vs trainer log-probs, max |diff|: {adapted}")
    assert adapted["adapted"] < 1e-4
    assert adapted["no adapters"] > 1e-3 and adapted["tower's adapters zeroed"] > 1e-3


# ------------------------------------------------------------------ Qwen2.5-VL

def qwen_processor_for_vllm():
    """The test Qwen-VL processor (4 px patches, 8 x 8 to 64 x 64 px: a 56 x 56 'squares'
    image is 49 image tokens), without its video processor (torchvision: not in this venv)."""
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
        "<|video_pad|>"]})
    tok.padding_side = "left"
    image = transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2,
                                                  temporal_patch_size=2, min_pixels=8 * 8,
                                                  max_pixels=64 * 64)
    return ImageOnlyQwenProcessor(image_processor=image, tokenizer=tok,
                                  chat_template=QWEN_TEMPLATE)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen_dir(request, tmp_path_factory):
    """A tiny random Qwen2.5-VL (windowed and full ViT blocks) or Qwen3-VL (a learned position
    grid, a DeepStack merger after the first block, interleaved M-RoPE) that vLLM loads: text
    head_dim 32, M-RoPE sections 4/6/6; its processor saved as the family's processor class
    with the image settings as its video processor's too (vLLM builds both)."""
    qwen3 = request.param == "qwen3_vl"
    path = tmp_path_factory.mktemp(request.param) / "model"
    proc = qwen_processor_for_vllm()
    ids = {t: proc.tokenizer.convert_tokens_to_ids(t) for t in (
        "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=128)
    vision |= (dict(num_position_embeddings=36, deepstack_visual_indexes=[0]) if qwen3
               else dict(window_size=16, fullatt_block_indexes=[1]))
    make = ((transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration) if qwen3
            else (transformers.Qwen2_5_VLConfig,
                  transformers.Qwen2_5_VLForConditionalGeneration))
    cfg = make[0](
        text_config=dict(vocab_size=128, hidden_size=128, intermediate_size=192,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [4, 6, 6],
                                          **({"mrope_interleaved": True} if qwen3 else {})}),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = make[1](cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif "language_model" in name or "lm_head" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    settings = json.loads((path / "processor_config.json").read_text())
    image = settings["image_processor"]
    (path / "preprocessor_config.json").write_text(json.dumps(image))
    video = dict(image, video_processor_type="Qwen3VLVideoProcessor" if qwen3
                 else "Qwen2VLVideoProcessor")
    (path / "video_preprocessor_config.json").write_text(json.dumps(video))
    settings.update(processor_class="Qwen3VLProcessor" if qwen3 else "Qwen2_5_VLProcessor",
                    video_processor=video)
    (path / "processor_config.json").write_text(json.dumps(settings))
    return path


@pytest.fixture(scope="module")
def qwen_server(qwen_dir, tmp_path_factory):
    srv = start_vllm(qwen_dir, tmp_path_factory.mktemp("qwen_server"), 512, **NO_INDUCTOR)
    yield srv
    srv.stop()


@needs_vllm
def test_qwen_vl_server_samples_as_the_trainer_scores(qwen_dir, qwen_server, tmp_path):
    """Qwen-VL's prompts through the server, each image's 49 placeholders sent as one: the
    server's samples score as the trainer does with the rows' images at their M-RoPE
    positions (not with the images zeroed); after a push of moved
    language-model weights, as the moved model does, not the initial one."""
    proc = qwen_processor_for_vllm()
    initial, _ = hf.load_model(str(qwen_dir), dtype=jnp.float32)
    cfg = load_config("squares", _settings(qwen_dir, tmp_path / "run", qwen_server.base_url))
    rollout = VLLMRollout(cfg, initial.cfg, SamplingParams(max_completion_length=6,
                                                           stop_token_ids=(2,)), 0, proc)
    records = _prompts(proc, 2, seed=7)
    ids = [x["prompt_ids"] for x in records]
    assert [len(unexpanded_ids(proc, initial.cfg, x)) for x in ids] == [len(x) - 48 for x in ids]

    r = rollout.generate(None, ids, 2, jax.random.key(0), records)
    assert r.positions.shape == (4, 3, r.prompt_ids.shape[1] + 6)
    real = r.completion_mask.astype(bool)

    def diff(model, r):
        return float(np.abs(_scores(model, r) - r.sampler_logp)[real].max())
    seen = {"initial": diff(initial, r),
            "images zeroed": diff(initial, r._replace(pixel_values=np.zeros_like(r.pixel_values)))}
    graphdef, params = nnx.split(initial, nnx.Param)
    moved_params = jax.tree_util.tree_map_with_path(
        lambda path, x: x if path[0].key == "vision" else x * 1.05, params)
    moved = nnx.merge(graphdef, moved_params)
    rollout.update_weights(moved_params)
    r2 = rollout.generate(None, ids, 2, jax.random.key(1), records)
    real = r2.completion_mask.astype(bool)
    seen |= {"pushed": diff(moved, r2), "pushed vs initial": diff(initial, r2)}
    adapted = _lora_reaches_the_server(qwen_dir, proc, qwen_server.base_url, tmp_path)
    print(f"{initial.cfg.model_type} server's samples vs trainer log-probs, max |diff|: {seen}; "
          f"LoRA (the tower's too) pushed: {adapted}")
    assert seen["initial"] < 1e-4 and seen["pushed"] < 1e-4
    assert seen["images zeroed"] > 1e-3 and seen["pushed vs initial"] > 1e-3
    assert adapted["adapted"] < 1e-4
    assert adapted["no adapters"] > 1e-3 and adapted["tower's adapters zeroed"] > 1e-3
