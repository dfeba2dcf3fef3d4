"""Training on images end to end on CPU: a tiny random Gemma 3 vision-language model saved
with transformers (and a Gemma3Processor over a character tokenizer), the built-in 'squares'
dataset, the native sampler's rounds with the prompts' images, the trainer's forwards with
them (the tower frozen), checkpoints, --resume, and the export transformers reloads."""

import copy
import dataclasses
import functools
import itertools
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx
from PIL import Image

from grpo_jax import data, hf, image_blocks, peft_io, squares
from grpo_jax import mesh as mesh_lib
from grpo_jax import images as images_lib
from grpo_jax.cli import load_config
from grpo_jax.config.batch import OptimizerConfig
from grpo_jax.config.run import MeshConfig
from grpo_jax.calculator import calculator
from grpo_jax.errors import RolloutFuncError, ToolError
from grpo_jax.export import export
from grpo_jax.grpo.batch import Batch
from grpo_jax.grpo.loss import LossConfig
from grpo_jax.grpo.train_step import completion_logps
from grpo_jax.models import lora
from grpo_jax.models.config import ModelConfig, param_table
from grpo_jax.rollout import tools
from grpo_jax.rollout.custom import CustomRollout
from grpo_jax.rollout.native import disaggregated
from grpo_jax.rollout.native.partial import from_arrays, to_arrays
from grpo_jax.rollout.native.rollout import JaxRollout
from grpo_jax.rollout.native.sampling import SamplingParams
from grpo_jax.policy import frozen_parts, split_policy, state_init
from grpo_jax.train import train
import reward_fixtures
from hf_oracle import char_tokenizer
from processes import launch, log, wait_all
from tiny_run import TRAIN, stopped_at
from vlm_models import gemma3_for
from vlm_processors import (FORCED_CALL, PICTURE_EPISODE, PICTURE_TOOL, QWEN_TEMPLATE,
                            TOOL_TEMPLATE, ImageOnlyQwenProcessor, gemma_processor, tool_model)

MM = 4  # soft tokens per image (the processor's image_seq_length)


def _tiny_gemma3(processor, seed=0):
    return gemma3_for(processor, MM, seed=seed)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    """A tiny Gemma 3 VLM directory with its processor, as transformers saves them."""
    processor = gemma_processor()
    path = tmp_path_factory.mktemp("gemma3_train") / "model"
    _tiny_gemma3(processor).save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def seeing_dir(tmp_path_factory):
    """vlm_dir's model with its image projection (and norms) perturbed: transformers
    initialises the projection to zeros, so vlm_dir's image features are zeros, whatever the
    pixels; this one's depend on them."""
    processor = gemma_processor()
    path = tmp_path_factory.mktemp("gemma3_seeing") / "model"
    model = _tiny_gemma3(processor)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "mm_input" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _settings(vlm_dir, out) -> dict:
    return {"model_name_or_path": vlm_dir, "output_dir": out, "max_steps": 3,
            "num_generations": 4, "per_device_train_batch_size": 8,
            "max_completion_length": 6, "learning_rate": 0.01, "eval_strategy": "no",
            "eval_on_start": "false", "save_steps": 1, "report_to": "[]",
            "num_completions_to_print": 0, "log_completions": "false"}


def _cfg(vlm_dir, out, *extra):
    sets = _settings(vlm_dir, out)
    return load_config("squares", [f"{k}={v}" for k, v in sets.items()] + list(extra))


def _records(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole(vlm_dir, tmp_path_factory):
    """Three steps on 'squares' on one device: the run the other runs are held against."""
    out = tmp_path_factory.mktemp("squares") / "whole"
    train(_cfg(vlm_dir, out), devices=jax.devices()[:1])
    return out


def test_squares_trains_resumes_and_exports(vlm_dir, whole, tmp_path):
    """Three steps on 'squares' (2 images x 4 answers a step, fp32, one device): the sampler's
    and the trainer's log-probs of the rows with images agree; the run resumed from its step-2
    checkpoint ends where the uninterrupted one does; the export reloads in transformers with the
    vision tower as it was (frozen) and the language model trained."""
    one = jax.devices()[:1]
    steps = [r for r in _records(whole) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    worst = max(r["sampling/sampling_logp_difference/max"] for r in steps)
    print(f"sampler vs trainer log-probs, max |diff| over 3 steps: {worst:.3g}")
    assert worst < 5e-5
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in steps)

    cut = tmp_path / "cut"
    stopped_at(whole, cut, 2)
    train(_cfg(vlm_dir, cut, "resume=true"), devices=one)
    resumed = {r["step"]: r for r in _records(cut) if "loss" in r}
    for key in ("loss", "reward", "grad_norm", "completions/mean_length"):
        print(f"step 3 {key}: whole {steps[2][key]:.6g} resumed {resumed[3][key]:.6g}")
        assert resumed[3][key] == pytest.approx(steps[2][key], rel=1e-5, abs=1e-7), key

    out, step = export(whole, tmp_path / "hf", dtype="float32")
    assert step == 3
    before = transformers.Gemma3ForConditionalGeneration.from_pretrained(vlm_dir).state_dict()
    after = transformers.Gemma3ForConditionalGeneration.from_pretrained(out).state_dict()
    assert before.keys() == after.keys()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    tower = {k for k in before if "vision_tower" in k or "multi_modal_projector" in k}
    assert tower and not moved & tower, sorted(moved & tower)[:3]
    assert any("language_model" in k for k in moved)
    print(f"export: {len(moved)} of {len(before)} tensors trained, the {len(tower)} of the "
          "tower and projector as they were")


def test_squares_sharded_equals_one_device(vlm_dir, whole, tmp_path):
    """The same three steps on a 2 x 2 mesh (fsdp x tensor: the tower's and the decoder's
    weights split by the one rule table, mesh.RULES) train as on one device."""
    cfg = ModelConfig.from_hf(hf.read_config(vlm_dir))
    mesh = mesh_lib.make_mesh(MeshConfig(fsdp=2, tp=2), jax.devices()[:4])
    specs = {name: mesh_lib.spec_for(axes, shape, mesh)
             for name, (shape, axes) in param_table(cfg).items() if name.startswith("vision/")}
    split = [name for name, spec in specs.items() if any(a is not None for a in spec)]
    assert {"vision/layers/wq", "vision/layers/fc1", "vision/mm_proj"} <= set(split), specs
    out = tmp_path / "sharded"
    train(_cfg(vlm_dir, out, "mesh.fsdp=2", "mesh.tp=2", "per_device_train_batch_size=4"),
          devices=jax.devices()[:4])
    one = [r for r in _records(whole) if "loss" in r]
    four = [r for r in _records(out) if "loss" in r]
    assert [r["step"] for r in four] == [1, 2, 3]
    for a, b in zip(one, four):
        for key in ("loss", "reward", "grad_norm", "completions/mean_length"):
            print(f"step {a['step']} {key}: one device {a[key]:.6g} 2 x 2 mesh {b[key]:.6g}")
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_two_processes_train_on_images_like_one_device(vlm_dir, whole, tmp_path):
    """The same three steps as two processes of one device each (JAX's multi-controller
    runtime on 127.0.0.1, data parallel over the processes): each process reads, encodes and
    samples its own rows' images, and the run trains as the one-device run."""
    sets = {**_settings(vlm_dir, tmp_path / "run"), "per_device_train_batch_size": 4, "dp": 2}
    argv = [*TRAIN, "--config", "squares",
            *(x for k, v in sets.items() for x in (f"--{k}", str(v)))]
    codes = wait_all(launch(argv, n=2, devices=1, log_dir=tmp_path), timeout=300)
    assert codes == [0, 0], log(tmp_path, "p0.err")[-3000:] + log(tmp_path, "p1.err")[-3000:]
    one = [r for r in _records(whole) if "loss" in r]
    two = [r for r in _records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        for key in ("loss", "reward", "grad_norm", "completions/mean_length"):
            print(f"step {a['step']} {key}: one device {a[key]:.6g} two processes {b[key]:.6g}")
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert b["sampling/sampling_logp_difference/max"] < 5e-5


def test_squares_trains_through_refilled_slots(vlm_dir, tmp_path):
    """Two steps with 3 decode slots for a step's 8 rows (refilled as rows finish): the
    sampler's log-probs of the rows with images, each admitted into whichever slot is free,
    are the trainer's."""
    out = tmp_path / "slots"
    train(_cfg(vlm_dir, out, "max_steps=2", "save_steps=10", "max_num_seqs=3"),
          devices=jax.devices()[:1])
    steps = [r for r in _records(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["generate/slot_steps"] == 3 * r["generate/decode_steps"] for r in steps)
    worst = max(r["sampling/sampling_logp_difference/max"] for r in steps)
    print(f"refilled slots, sampler vs trainer log-probs, max |diff| over 2 steps: {worst:.3g}")
    assert worst < 5e-5


@pytest.mark.parametrize("split", [None, "thread", "process"],
                         ids=["shared", "sampler_devices", "sampler_process"])
def test_squares_trains_through_partial_rollouts(seeing_dir, tmp_path, split):
    """Two steps of partial rollouts (max_staleness 1, 3 decode slots for the group slots of 4
    rows): rows carry over into the next round with their prompts' images (each round's prompt
    pass encodes every group slot's), and the sampler's log-probs of them are the trainer's.
    Learning rate 0, so that every round's weights are the same: a carried token's log-prob,
    drawn a round earlier, is then the trainer's too. The run resumed from its step-1
    checkpoint (which holds the rows in flight and their images, and with sampler_devices the
    batch sampled ahead with its images) makes the same step 2. With sampler_devices the
    sampler decodes on a device of its own a round ahead (max_staleness 2 there: one version
    for the round ahead, one for carried rows), with sampler_process in a process of its own
    (the processor sent there with the sampler's settings). On shared devices the prompts hold
    0, 1 or 2 images (in turn: test_trains_on_prompts_with_different_numbers_of_images's data
    set), so rows carried over rounds hold blocks of blanks too."""
    data = _counted_squares(tmp_path / "data", [0, 1, 2] * 4)
    one, partial = jax.devices()[:1], ("max_num_seqs=3", "max_staleness=1", "learning_rate=0.0",
                                       f"dataset_name={data}", "shuffle_dataset=false")
    if split:
        one, partial = jax.devices()[:2], ("max_num_seqs=3", "max_staleness=2",
                                           "learning_rate=0.0", "sampler_devices=1", "dp=1",
                                           f"sampler_process={split == 'process'}")
    out = tmp_path / "partial"
    train(_cfg(seeing_dir, out, "max_steps=2", *partial), devices=one)
    steps = [r for r in _records(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    worst = max(r["sampling/sampling_logp_difference/max"] for r in steps)
    print(f"partial rollouts, sampler vs trainer log-probs, max |diff| over 2 steps: {worst:.3g}"
          f"; staleness/max {[r['staleness/max'] for r in steps]}")
    assert worst < 5e-5
    assert max(r["staleness/max"] for r in steps) >= 1  # tokens of the last round's weights

    cut = tmp_path / "cut"
    stopped_at(out, cut, 1)
    train(_cfg(seeing_dir, cut, "max_steps=2", "resume=true", *partial), devices=one)
    resumed = {r["step"]: r for r in _records(cut) if "loss" in r}
    for key in ("reward", "completions/mean_length", "staleness/mean",
                "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"):
        print(f"step 2 {key}: whole {steps[1][key]:.6g} resumed {resumed[2][key]:.6g}")
        assert resumed[2][key] == pytest.approx(steps[1][key], rel=1e-5, abs=1e-7), key


# ---------------------------------------------------------------- Qwen2.5-VL's rows

def _tiny_qwen(tok, family: str = "qwen2_5_vl"):
    """A tiny Qwen2.5-VL (or Qwen3-VL: a DeepStack merger after its first block, interleaved
    M-RoPE) whose special ids are `tok`'s (patches of 4 px, merged 2 x 2)."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in (
        "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    qwen3 = family == "qwen3_vl"
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64)
    vision |= (dict(num_position_embeddings=16, deepstack_visual_indexes=[0]) if qwen3
               else dict(window_size=16, fullatt_block_indexes=[1]))
    make = (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration) if qwen3 \
        else (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration)
    cfg = make[0](
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3],
                                          **({"mrope_interleaved": True} if qwen3 else {})}),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = make[1](cfg).eval()
    if qwen3:  # its DeepStack merger's features otherwise start near the main merger's scale
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
    return model


def _qwen_model(tmp_path, family: str = "qwen2_5_vl"):
    """(the tiny Qwen2.5-VL (or Qwen3-VL) loaded in fp32, its processor: 4 px patches, up to
    32 x 32 px)."""
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
        "<|video_pad|>"]})
    tok.padding_side = "left"
    proc = ImageOnlyQwenProcessor(
        image_processor=transformers.Qwen2VLImageProcessorPil(
            patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
            max_pixels=32 * 32),
        tokenizer=tok, chat_template=QWEN_TEMPLATE)
    _tiny_qwen(tok, family).save_pretrained(tmp_path / "qwen")
    return hf.load_model(str(tmp_path / "qwen"), dtype=np.float32)[0], proc


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_rows_carry_their_images_and_positions(tmp_path, family):
    """Qwen-VL through the rollout and the trainer's forward: two prompts of different lengths
    (left padding) with a 16 x 24 image each, 2 completions each. The trainer's log-probs of the
    rows (their pixel rows, grids and M-RoPE positions over prompt + completion; Qwen3-VL's
    DeepStack features added in the first layer, its prompts computed once for the group: the
    shared prefix) equal the sampler's; a split of the rows keeps each row's images (the same
    log-probs); the images matter (zeroed pixels change them)."""
    model, proc = _qwen_model(tmp_path, family)
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8))
                for _ in range(2)]
    prompts = [images_lib.multimodal_messages([{"role": "user", "content": text}], [p], i)
               for i, (text, p) in enumerate(zip(["How many?", "Count them, please."],
                                                  pictures))]
    ids = images_lib.process(proc, prompts)
    records = [{"prompt": p, "prompt_ids": ids.prompt_ids(i)} for i, p in enumerate(prompts)]
    rollout = JaxRollout(model.cfg, SamplingParams(max_completion_length=6, temperature=1.0,
                                                   stop_token_ids=(2,)),
                         pad_id=0, mesh=None, processor=proc)
    assert rollout.takes_records
    r = rollout.generate(nnx.split(model, nnx.Param)[1], [x["prompt_ids"] for x in records], 2,
                         jax.random.key(0), records)
    np.testing.assert_array_equal(r.image_grid, [[[1, 4, 6]]] * 4)
    assert r.pixel_values.shape == (4, 1, 24, 96)
    assert r.positions.shape == (4, 3, r.prompt_ids.shape[1] + 6)
    batch = Batch(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                  r.truncated, np.zeros(4, np.float32), pixel_values=r.pixel_values,
                  positions=r.positions, image_grid=r.image_grid)
    logp = np.asarray(completion_logps(model, batch, 1.0, 128)[0])
    real = r.completion_mask.astype(bool)
    diff = float(np.abs(logp - r.sampler_logp)[real].max())
    print(f"Qwen-VL sampler vs trainer log-probs: max |diff| {diff:.3g}")
    assert diff < 5e-5
    half = np.asarray(completion_logps(model, batch.rows(slice(2, 4)), 1.0, 128)[0])
    assert np.abs(half - logp[2:])[real[2:]].max() < 5e-5
    shared = np.asarray(completion_logps(model, batch, 1.0, 128, 2)[0])
    assert np.abs(shared - logp)[real].max() < 5e-5
    blind = np.asarray(completion_logps(model, batch.replace(
        pixel_values=np.zeros_like(r.pixel_values)), 1.0, 128)[0])
    assert np.abs(blind - logp)[real].max() > 1e-3


def test_the_tower_is_frozen_in_the_optimizer(vlm_dir):
    """The optimizer leaves vision/* as it is (no update, no decay) and keeps no moments for
    it; the language model's params move. Text-only params get the optimizer as before."""
    model, _ = hf.load_model(str(vlm_dir), dtype=np.float32)
    params = split_policy(model).params
    assert frozen_parts(params) == ("vision",)
    tx, _, init = state_init(LossConfig(), OptimizerConfig(learning_rate=0.1, weight_decay=0.1),
                             10, frozen_parts(params))
    state = init(params)
    grads = jax.tree.map(np.ones_like, params)
    updates, _ = tx.update(grads, state.opt_state, params)
    new = optax.apply_updates(params, updates)
    moved = {jax.tree_util.keystr(path): bool(np.any(np.asarray(a) != np.asarray(b)))
             for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params),
                                     jax.tree.leaves(new))}
    tower = {k: v for k, v in moved.items() if k.startswith("['vision']")}
    assert tower and not any(tower.values())
    assert all(v for k, v in moved.items() if k not in tower)
    # Adam's two moments for the language model's leaves only (besides the counters an
    # optimizer of no params holds).
    counters = len(jax.tree.leaves(init({}).opt_state))
    assert len(jax.tree.leaves(state.opt_state)) == counters + 2 * (len(moved) - len(tower))
    assert frozen_parts({"embed": 0}) == ()


def test_qlora_trains_on_a_quantized_tower(seeing_dir, tmp_path):
    """QLoRA (load_in_4bit, all-linear) on the VLM: the tower's linears are NF4 codes as the
    decoder's projections, frozen, with adapters trained on top; two steps run and the sampler
    (the adapters on the quantized base, the tower's too) gives the trainer's log-probs."""
    run = tmp_path / "qlora"
    cfg = _cfg(seeing_dir, run, "max_steps=2", "use_peft=true", "load_in_4bit=true",
               "lora_target_modules=all-linear", "learning_rate=0.05", "save_steps=2")
    model, _ = peft_io.load_model(cfg, None)
    assert model.vision.layers.fc1[...].dtype == jnp.uint4
    params = split_policy(model).params
    assert sorted(params["vision"]["layers"]) == sorted(
        f"{w}_lora_{m}" for w in ("wq", "wk", "wv", "wo", "fc1", "fc2") for m in "ab")
    train(cfg, devices=jax.devices()[:1])
    steps = [r for r in _records(run) if "loss" in r]
    assert len(steps) == 2 and all(np.isfinite(r["loss"]) for r in steps)
    assert max(r["sampling/sampling_logp_difference/max"] for r in steps) < 5e-5


def test_lora_adapters_load_in_peft_on_the_vlm(seeing_dir, tmp_path):
    """Two LoRA steps (all-linear) on 'squares' with a tower whose features reach the
    language model: the adapters are the language model's and, as PEFT's all-linear adapts
    them, the SigLIP tower's linears (trained: their lora_B moved off zero; the tower's base
    weights as they were). Exported as a PEFT directory they load with PeftModel onto
    transformers' Gemma 3, adapting the modules PEFT would, and give, on prompts with images,
    the logits of our merged export; as model_name_or_path the directory loads back (its
    targets read from the pattern), the optimizer's params are its adapters (the tower's
    base is no part of them), and its tower runs the adapters as the merged one."""
    run = tmp_path / "lora"
    train(_cfg(seeing_dir, run, "max_steps=2", "use_peft=true",
               "lora_target_modules=all-linear", "learning_rate=0.05", "save_steps=2"),
          devices=jax.devices()[:1])
    # The sampler runs the tower's adapters as the trainer does (step 2: trained ones).
    worst = max(r["sampling/sampling_logp_difference/max"] for r in _records(run) if "loss" in r)
    assert worst < 5e-5
    adapter, _ = export(run, tmp_path / "adapter", dtype="float32")
    merged, _ = export(run, tmp_path / "merged", dtype="float32", merge=True)
    saved = safetensors.numpy.load_file(adapter / peft_io.WEIGHTS_NAME)
    tower_b = {k: v for k, v in saved.items() if "vision_tower" in k and "lora_B" in k}
    assert len(tower_b) == 2 * 6 and all(np.abs(v).max() > 0 for v in tower_b.values())
    peft = pytest.importorskip("peft")
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(seeing_dir).eval()
    ours = transformers.Gemma3ForConditionalGeneration.from_pretrained(merged).eval()
    proc = transformers.AutoProcessor.from_pretrained(seeing_dir)
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8))
                for _ in range(2)]
    inputs = proc(text=["<start_of_image> how many?", "count <start_of_image>"],
                  images=[[p] for p in pictures], return_tensors="pt", padding=True)
    with torch.no_grad():
        before = base(**inputs).logits
        model = peft.PeftModel.from_pretrained(base, adapter).eval()
        adapted = {n for n, _ in model.named_modules() if n.endswith(".lora_A")}
        assert len(adapted) == 2 * 7 + 2 * 6
        got, want = model(**inputs).logits, ours(**inputs).logits
    mask = inputs["attention_mask"].bool()
    diff = float((got - want).abs()[mask].max())
    moved = float((want - before).abs()[mask].max())
    print(f"PEFT on transformers vs our merged export: max |logit diff| {diff:.3g} "
          f"(the adapters moved them by {moved:.3g})")
    assert diff < 1e-4 and moved > 1e-3

    # The directory as model_name_or_path: its regex targets read back, its adapters loaded.
    cfg = peft_io.adapter_settings(_cfg(adapter, tmp_path / "again", "use_peft=true",
                                        "lora_target_modules=q_proj"))
    assert set(cfg.peft.lora_target_modules) == {*lora.TARGETS, "out_proj", "fc1", "fc2"}
    again, _ = peft_io.load_model(cfg, None)
    assert all(np.array_equal(v, saved[k]) for k, v in peft_io.adapter_tensors(again).items())
    # What the optimizer trains: the adapters, the tower's among them (not frozen); the
    # tower's base weights are no part of it.
    params = split_policy(again).params
    assert frozen_parts(params) == () and sorted(params["vision"]["layers"]) == sorted(
        f"{w}_lora_{m}" for w in ("wq", "wk", "wv", "wo", "fc1", "fc2") for m in "ab")
    # Our tower with its adapters applied (the trainer's, and the sampler's with READ_ADAPTERS)
    # gives the image features of the tower they are merged into (READ, and the export).
    pixels = inputs["pixel_values"].numpy()
    tokens = np.full((1, 2 * MM), again.cfg.vision.image_token_id)
    applied = np.asarray(again.embed_multimodal(tokens, pixels, None))
    merged_features = np.asarray(peft_io.merged_model(again).embed_multimodal(tokens, pixels,
                                                                             None))
    assert np.abs(applied - merged_features).max() < 1e-5
    assert np.abs(applied).max() > 0


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), "all-linear"])
def test_adapted_modules_are_peft_s(vlm_dir, tmp_path, targets):
    """The modules grpo-jax adapts on Gemma 3 (language model and SigLIP tower) are the ones
    peft.get_peft_model adapts on the transformers VLM for the same target_modules, and the
    exported adapter_config makes PeftModel adapt those again (no warning: nothing left out)."""
    peft = pytest.importorskip("peft")
    args = lora.PeftArgs(use_peft=True, lora_target_modules=(
        (targets,) if isinstance(targets, str) else targets))
    model, _ = hf.load_model(str(vlm_dir), dtype=np.float32)
    lora.add_adapters(model, args, jax.random.key(0))
    ours = {k[len(peft_io.PREFIX):-len(".lora_A.weight")]
            for k in peft_io.adapter_tensors(model) if k.endswith(".lora_A.weight")}
    hf_model = transformers.Gemma3ForConditionalGeneration.from_pretrained(vlm_dir)
    names = targets if isinstance(targets, str) else list(targets)
    theirs = {n[len("base_model.model."):-len(".lora_A")] for n, _ in peft.get_peft_model(
        hf_model, peft.LoraConfig(target_modules=names)).named_modules()
        if n.endswith(".lora_A")}
    assert ours == theirs and any(".vision_tower." in m for m in ours)
    out = peft_io.save_adapter(model, args, tmp_path / "adapter", str(vlm_dir))
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(vlm_dir)
    again = {n[len("base_model.model."):-len(".lora_A")] for n, _ in peft.PeftModel.from_pretrained(
        base, out).named_modules() if n.endswith(".lora_A")}
    assert again == theirs


def test_tower_adapters_take_gradient_and_dropout_in_the_train_forward_only(seeing_dir):
    """With adapters on SigLIP (q_proj, v_proj, lora_dropout 0.5) the train forward's image
    features take gradient into the tower's adapters and PEFT's dropout on their inputs (a
    mask per key); without a dropout key (sampler, reference, evaluation) they are the plain
    forward's."""
    model, _ = hf.load_model(str(seeing_dir), dtype=np.float32)
    args = lora.PeftArgs(use_peft=True, lora_dropout=0.5)
    lora.add_adapters(model, args, jax.random.key(0))
    b = model.vision.layers.wq_lora_b
    b.set_value(np.full(b.shape, 0.1, np.float32))  # trained off zero: the adapter counts
    v = model.cfg.vision
    pixels = np.random.default_rng(0).normal(size=(1, 3, v.image_size, v.image_size))
    tokens = np.full((1, v.mm_tokens_per_image), v.image_token_id)
    plain = np.asarray(model.embed_multimodal(tokens, pixels, None))
    graphdef, adapters, base = nnx.split(model, lora.LoraParam, nnx.Param)

    def features(adapters, key):
        m = lora.with_dropout(nnx.merge(graphdef, adapters, base), key)
        return m.embed_multimodal(tokens, pixels, None, frozen_tower=not lora.tower_adapted(m))

    one, two = (np.asarray(features(adapters, jax.random.key(k))) for k in (1, 2))
    assert np.abs(one - plain).max() > 1e-3 and np.abs(one - two).max() > 1e-3
    assert np.array_equal(np.asarray(features(adapters, None)), plain)
    grads = jax.grad(lambda a: (features(a, None) ** 2).sum())(adapters)["vision"]["layers"]
    assert sorted(grads) == ["wq_lora_a", "wq_lora_b", "wv_lora_a", "wv_lora_b"]
    assert all(np.abs(np.asarray(grads[n][...])).max() > 0
               for n in ("wq_lora_a", "wq_lora_b", "wv_lora_b"))


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("gate_proj",),
                                     ("q_proj", "qkv", "fc1"), "all-linear"])
def test_tower_modules_are_the_ones_peft_adapts(targets):
    """peft_io.tower_modules (the tower's modules grpo-jax adapts) is the set of tower
    modules peft.get_peft_model adapts for the same target_modules, on Gemma 3's SigLIP and
    Qwen2.5-VL's ViT and merger."""
    peft = pytest.importorskip("peft")
    from grpo_jax.models.config import ModelConfig
    from vlm_models import tiny_gemma3, tiny_qwen25
    for hf_model, tower in ((tiny_gemma3(), "vision_tower."), (tiny_qwen25(), "visual.")):
        cfg = ModelConfig.from_hf(hf_model.config.to_dict())
        args = lora.PeftArgs(use_peft=True, lora_target_modules=targets)
        # PEFT takes all-linear as a string only (a list would be module names).
        names = targets if isinstance(targets, str) else list(targets)
        model = peft.get_peft_model(hf_model, peft.LoraConfig(target_modules=names))
        # base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A ->
        # vision_tower.encoder.layers.{i}.self_attn.q_proj, the tower's HF name.
        theirs = sorted({re.sub(r"\.\d+\.", ".{i}.", n[n.index("." + tower) + 1:-7], count=1)
                         for n, _ in model.named_modules()
                         if n.endswith(".lora_A") and "." + tower in n})
        assert theirs == sorted(peft_io.tower_modules(args, cfg)), (cfg.model_type, targets)


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_partial_rollouts_carry_each_groups_images(family, seeing_dir, tmp_path):
    """Partial rollouts of prompts with images (fixed weights; 3 decode slots, groups of 4, 2
    groups a round, 2 rounds): each group returned, rows decoded over two rounds among them,
    is what one static batch of its prompt and its images draws from the same keys; the
    trainer's log-probs of its rows (with their images, and Qwen-VL's M-RoPE positions) are
    the sampler's, and with the images zeroed they are not: the pixels reach the sampler. A
    checkpoint's rows in flight (to_arrays, from_arrays) keep each group slot's images: the
    next round from them is the next round from the rows themselves. A prompt with more
    images than those in flight joins them (each slot's block widened with a blank); with
    Qwen-VL one of another size is refused."""
    if family == "gemma3":
        model, proc, size = hf.load_model(str(seeing_dir), dtype=np.float32)[0], \
            images_lib.load_processor(seeing_dir), (28, 28)
    else:
        (model, proc), size = _qwen_model(tmp_path), (16, 24)
    g, k, tok = 4, 2, proc.tokenizer
    rng = np.random.default_rng(0)
    prompts = [images_lib.multimodal_messages(
        [{"role": "user", "content": "count" + "!" * int(rng.integers(0, 9))}],
        [Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))], i)
        for i in range(10)]
    ids = images_lib.process(proc, prompts)
    records = [{"prompt": p, "prompt_ids": ids.prompt_ids(i)} for i, p in enumerate(prompts)]
    # Many stop tokens: rows end after 1 to 6 tokens, so slots free at different steps and
    # rows are left mid-way when a round's groups are whole.
    sp = SamplingParams(max_completion_length=6, temperature=1.0, max_num_seqs=3,
                        stop_token_ids=tuple(range(2, 40)))
    rollout = JaxRollout(model.cfg, sp, pad_id=tok.pad_token_id, mesh=None,
                         partial_rollouts=(g, k, 100), processor=proc)
    params, partial = nnx.split(model, nnx.Param)[1], rollout.partial
    width = max(len(r["prompt_ids"]) for r in records)
    at, drawn, spanned = partial.empty(width), 0, 0

    def advance(at, version):
        new = records[drawn:drawn + at.empty_groups]
        return partial.advance(params, at, new, list(range(drawn, drawn + len(new))), version,
                               jax.random.key(7)), len(new)
    for version in range(2):
        done, n = advance(at, version)
        at, drawn, r = done.in_flight, drawn + n, done.rollout
        spanned += sum(len(set(v[m > 0])) > 1 for v, m in zip(r.versions, r.completion_mask))
        for j, rec in enumerate(done.records):
            i = next(i for i, x in enumerate(records) if x is rec)
            px = images_lib.prompt_pixels(proc, [rec["prompt"]])
            one = rollout.sampler.generate(
                params, [rec["prompt_ids"]], g, jax.random.key(7), first_row=i * g,
                pixel_values=px.pixel_values.reshape(-1, *px.pixel_values.shape[2:]),
                image_grid_thw=None if px.image_grid is None else px.image_grid.reshape(-1, 3))
            rows = slice(j * g, (j + 1) * g)
            np.testing.assert_array_equal(r.completion_ids[rows], one.completion_ids)
            np.testing.assert_allclose(r.sampler_logp[rows], one.sampler_logp, atol=2e-6)
            np.testing.assert_array_equal(r.pixel_values[rows],
                                          np.repeat(px.pixel_values, g, axis=0))
        batch = Batch(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                      r.truncated, np.zeros(len(r.truncated), np.float32),
                      pixel_values=r.pixel_values, positions=r.positions, image_grid=r.image_grid)
        real = r.completion_mask.astype(bool)
        logp = np.asarray(completion_logps(model, batch, 1.0, 128)[0])
        blind = np.asarray(completion_logps(model, batch.replace(
            pixel_values=np.zeros_like(r.pixel_values)), 1.0, 128)[0])
        print(f"{family} round {version}: sampler vs trainer max |diff| "
              f"{np.abs(logp - r.sampler_logp)[real].max():.3g}, images zeroed "
              f"{np.abs(blind - r.sampler_logp)[real].max():.3g}")
        assert np.abs(logp - r.sampler_logp)[real].max() < 5e-5
        assert np.abs(blind - r.sampler_logp)[real].max() > 1e-3
    assert spanned > 0
    back = from_arrays(partial.empty(width), to_arrays(at), records.__getitem__)
    np.testing.assert_array_equal(back.pixel_values, at.pixel_values)
    assert (back.image_grid is None) == (at.image_grid is None) and at.pixel_values.any()
    if at.image_grid is not None:
        np.testing.assert_array_equal(back.image_grid, at.image_grid)
    (a, _), (b, _) = advance(at, 2), advance(back, 2)
    for name in ("completion_ids", "sampler_logp", "versions", "pixel_values", "positions"):
        x, y = getattr(a.rollout, name), getattr(b.rollout, name)
        assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), name
    # A prompt of two images joins: every slot's block widens to two, the others' a blank.
    [two] = _counted_records(proc, size, [2], seed=1)
    wide = partial.advance(params, a.in_flight, [two], [0], 3, jax.random.key(7)).in_flight
    slot = next(i for i, x in enumerate(wide.records) if x is two)
    before = a.in_flight.pixel_values
    assert image_blocks.count(wide.pixel_values) == 2
    np.testing.assert_array_equal(wide.pixel_values[slot], images_lib.prompt_pixels(
        proc, [two["prompt"]]).pixel_values[0])
    others = [i for i in range(len(wide.records)) if i != slot]
    np.testing.assert_array_equal(wide.pixel_values[others, :1], before[others])
    assert not wide.pixel_values[others, 1:].any()
    if family == "qwen2_5_vl":  # a larger image joins: the slots' patches pad to its
        [other] = _counted_records(proc, (32, 32), [1])
        mixed = partial.advance(params, wide, [other], [0], 4, jax.random.key(7))
        assert mixed.in_flight.pixel_values.shape[2] == 64  # 8 x 8 patches
        r = mixed.rollout
        held = [*mixed.in_flight.image_grid[:, 0].tolist(), *r.image_grid[:, 0].tolist()]
        assert [1, 8, 8] in held and [1, 4, 6] in held and len(r.truncated)
        real = r.completion_mask.astype(bool)
        logp = np.asarray(completion_logps(model, _rows_batch(r), 1.0, 128)[0])
        assert np.abs(logp - r.sampler_logp)[real].max() < 5e-5


# ---------------------------------------------------------------- different numbers of images

def _family(family, seeing_dir, tmp_path):
    """(model in fp32, processor, image size) of a tiny VLM: Gemma 3's seeing one or Qwen-VL's."""
    if family == "gemma3":
        return (hf.load_model(str(seeing_dir), dtype=np.float32)[0],
                images_lib.load_processor(seeing_dir), (28, 28))
    return (*_qwen_model(tmp_path), (16, 24))


def _counted_records(proc, size, counts, seed=0) -> list[dict]:
    """Records of chat prompts holding counts[i] random images each, their own ids; `size`:
    the images' (h, w), or a list of sizes the images take in turn."""
    rng = np.random.default_rng(seed)
    sizes = itertools.cycle(size if isinstance(size, list) else [size])
    prompts = [images_lib.multimodal_messages(
        [{"role": "user", "content": "count" + "!" * i}],
        [Image.fromarray(rng.integers(0, 256, (*next(sizes), 3), dtype=np.uint8))
         for _ in range(n)], i)
        for i, n in enumerate(counts)]
    return [{"prompt": p, "prompt_ids": images_lib.process(proc, [p]).prompt_ids(0)}
            for p in prompts]


def _rows_batch(r, pixel_values=None) -> Batch:
    return Batch(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.truncated,
                 np.zeros(len(r.truncated), np.float32),
                 pixel_values=r.pixel_values if pixel_values is None else pixel_values,
                 positions=r.positions, image_grid=r.image_grid)


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_prompts_with_different_numbers_of_images(family, seeing_dir, tmp_path):
    """A batch of prompts holding 1, 0, 2 and 1 images (TRL's: each row its own list), 2
    completions each: each prompt's block holds its images then blanks up to 2. Each prompt's
    rows sample what the prompt alone with its own images samples (the same keys), and the
    trainer's log-probs of them are the sampler's and those of the prompt's rows alone. A
    blank's pixels reach nothing; a real image's reach its rows only. A batch of prompts
    without images samples as text. Qwen-VL's images are of four sizes (24 to 64 patches,
    each padded to 64 in its block): one program, each image laid out by its own grid."""
    model, proc, size = _family(family, seeing_dir, tmp_path)
    if family == "qwen2_5_vl":
        size = [(16, 24), (32, 32), (24, 16), (8, 16)]
    g, counts = 2, [1, 0, 2, 1]
    records = _counted_records(proc, size, counts)
    sp = SamplingParams(max_completion_length=6, temperature=1.0,
                        stop_token_ids=(proc.tokenizer.eos_token_id,))
    rollout = JaxRollout(model.cfg, sp, pad_id=proc.tokenizer.pad_token_id, mesh=None,
                         processor=proc)
    params = nnx.split(model, nnx.Param)[1]
    r = rollout.generate(params, [x["prompt_ids"] for x in records], g, jax.random.key(3),
                         records)
    assert image_blocks.count(r.pixel_values) == 2
    if family == "qwen2_5_vl":
        assert r.pixel_values.shape[2] == 64
        np.testing.assert_array_equal(r.image_grid[::g], [
            [[1, 4, 6], [0, 0, 0]], [[0, 0, 0]] * 2, [[1, 8, 8], [1, 6, 4]],
            [[1, 2, 4], [0, 0, 0]]])
    # Static sub-batches (max_num_seqs without continuous_batching) sample the same rows,
    # each part with its prompts' images: whole groups (3 slots) and, a group being larger
    # than 1 slot, each row with its own copy of its prompt's block.
    for slots in (3, 1):
        sub = JaxRollout(model.cfg, dataclasses.replace(
            sp, max_num_seqs=slots, continuous_batching=False),
            pad_id=proc.tokenizer.pad_token_id, mesh=None, processor=proc).generate(
                params, [x["prompt_ids"] for x in records], g, jax.random.key(3), records)
        np.testing.assert_array_equal(sub.completion_ids, r.completion_ids)
        np.testing.assert_array_equal(sub.pixel_values, r.pixel_values)
        np.testing.assert_allclose(sub.sampler_logp, r.sampler_logp, atol=2e-6)
    real = r.completion_mask.astype(bool)
    logp = np.asarray(completion_logps(model, _rows_batch(r), 1.0, 128)[0])
    print(f"{family}: sampler vs trainer |diff| {np.abs(logp - r.sampler_logp)[real].max():.3g}")
    assert np.abs(logp - r.sampler_logp)[real].max() < 5e-5
    for i, rec in enumerate(records):
        px = images_lib.prompt_pixels(proc, [rec["prompt"]])
        pixels = px.pixel_values[0] if counts[i] else None  # its own images, in order
        one = rollout.sampler.generate(  # HF's order, the prompt's own images (or none)
            params, [rec["prompt_ids"]], g, jax.random.key(3), first_row=i * g,
            pixel_values=pixels,
            image_grid_thw=(px.image_grid.reshape(-1, 3)
                            if counts[i] and px.image_grid is not None else None))
        rows = slice(i * g, (i + 1) * g)
        np.testing.assert_array_equal(r.completion_ids[rows], one.completion_ids)
        np.testing.assert_allclose(r.sampler_logp[rows], one.sampler_logp, atol=2e-6)
        grids = None if px.image_grid is None else np.repeat(px.image_grid, g, axis=0)
        alone = one._replace(
            pixel_values=np.repeat(px.pixel_values, g, axis=0), image_grid=grids,
            positions=None if grids is None else rollout.sampler.row_positions(
                one.prompt_ids, one.prompt_mask, grids, 6))
        mine = np.asarray(completion_logps(model, _rows_batch(alone), 1.0, 128)[0])
        np.testing.assert_allclose(np.where(real[rows], logp[rows], 0),
                                   np.where(real[rows], mine, 0), atol=1e-5)
    # Prompt 0's block: its image, then a blank.
    blanks, seen = r.pixel_values.copy(), r.pixel_values.copy()
    noise = np.random.default_rng(1).normal(size=blanks[2:4].shape)  # prompt 1's: all blank
    blanks[:2, 1:], blanks[2:4] = noise[:, 1:], noise
    seen[:2, :1] = 0
    noise = np.asarray(completion_logps(model, _rows_batch(r, blanks), 1.0, 128)[0])
    blind = np.asarray(completion_logps(model, _rows_batch(r, seen), 1.0, 128)[0])
    assert np.abs(noise - logp)[real].max() < 1e-6
    assert np.abs(blind - logp)[:2][real[:2]].max() > 1e-3
    assert np.abs(blind - logp)[2:][real[2:]].max() < 1e-6
    # A batch without any image samples as text; its rows still carry (empty) blocks.
    text = rollout.generate(params, [records[1]["prompt_ids"]], g, jax.random.key(3),
                            [records[1]])
    plain = rollout.sampler.generate(params, [records[1]["prompt_ids"]], g, jax.random.key(3))
    np.testing.assert_array_equal(text.completion_ids, plain.completion_ids)
    assert image_blocks.count(text.pixel_values) == 0
    mine = np.asarray(completion_logps(model, _rows_batch(text), 1.0, 128)[0])
    assert np.abs(mine - text.sampler_logp)[text.completion_mask.astype(bool)].max() < 5e-5


def _counted_squares(path, counts, sizes=None) -> str:
    """A jsonl dataset of 'squares' rows holding counts[i] images each (an `images` column of
    file paths, TRL's list per row; [] for none), the answer their red squares in all;
    `sizes`: (w, h) the images are resized to in turn (None: as drawn)."""
    rng, rows = np.random.default_rng(0), []
    sizes = None if sizes is None else itertools.cycle(sizes)
    path.mkdir()
    for i, n in enumerate(counts):
        drawn = [squares.draw(rng) for _ in range(n)]
        for j, (image, _) in enumerate(drawn):
            (image if sizes is None else image.resize(next(sizes))).save(path / f"{i}_{j}.png")
        rows.append({"prompt": [{"role": "user", "content": squares.QUESTION}],
                     "images": [str(path / f"{i}_{j}.png") for j in range(n)],
                     "answer": str(sum(c for _, c in drawn))})
    (path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path / "data.jsonl")


def test_trains_on_prompts_with_different_numbers_of_images(seeing_dir, tmp_path):
    """Two steps on a dataset whose prompts hold 0, 1 or 2 images (3 prompts a step, one of
    each), through static rounds: the sampler's log-probs of every row are the trainer's.
    (Through partial rollouts: test_squares_trains_through_partial_rollouts[shared] trains on
    this data set.)"""
    data = _counted_squares(tmp_path / "data", [0, 1, 2] * 4)
    _two_steps_agree(seeing_dir, data, tmp_path / "run", "static: 0 to 2 images a prompt")


def test_qwen_trains_on_images_of_different_sizes(tmp_path, monkeypatch):
    """Qwen2.5-VL, two steps through `train` on a dataset of 0 to 2 images a prompt in four
    sizes (8 to 64 patches) and no image_buckets: one program for the batch's sizes, the
    sampler's log-probs of every row the trainer's."""
    _, proc = _qwen_model(tmp_path)
    proc.tokenizer.save_pretrained(tmp_path / "qwen")
    monkeypatch.setattr(images_lib, "load_processor", lambda model_dir: proc)
    data = _counted_squares(tmp_path / "data", [0, 1, 2] * 4,
                            sizes=[(24, 16), (16, 24), (32, 32), (16, 8)])
    _two_steps_agree(tmp_path / "qwen", data, tmp_path / "run", "Qwen-VL, four image sizes",
                     "image_buckets=null")


def _two_steps_agree(model_dir, data, out, what, *extra):
    """Two static steps of 3 prompts x 4 on `data` in order: the sampler's log-probs of every
    row are the trainer's."""
    train(_cfg(model_dir, out, f"dataset_name={data}", "shuffle_dataset=false",
               "per_device_train_batch_size=12", "max_steps=2", "save_steps=10", *extra),
          devices=jax.devices()[:1])
    steps = [r for r in _records(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    worst = max(r["sampling/sampling_logp_difference/max"] for r in steps)
    print(f"{what}: sampler vs trainer max |diff| {worst:.3g}")
    assert worst < 5e-5


# ---------------------------------------------------------------- tools with images

def _tool_tokenizer(proc):
    """The processor's character tokenizer with the shipped ChatML tool template and its
    Hermes parser, anchored without the newline the character vocabulary lacks (it reads
    "<unk>")."""
    tok = copy.deepcopy(proc.tokenizer)
    tok.chat_template = data.chat_template("chatml_tools")
    tok.response_template = dict(tools.HERMES_RESPONSE_TEMPLATE,
                                 start_anchor="<|im_start|>assistant")
    return tools.prepare_tool_tokenizer(tok)


@pytest.mark.parametrize("family, partial", [("gemma3", False), ("qwen2_5_vl", False),
                                             ("gemma3", True)],
                         ids=["gemma3", "qwen2_5_vl", "gemma3-partial"])
def test_tool_turns_see_the_prompts_images(family, partial, seeing_dir, tmp_path):
    """The calculator tool with prompts that hold an image, each prompt's assistant turn begun
    with a call (so every row's first turn, whatever random tokens end it, is a call): each
    row runs its call, gets the result's tokens (tool_mask 0) and writes a second turn; the
    second turn is re-prefilled as prompt + completion so far with the prompt's images
    (static batches), or fed the result in its decode slot (partial rollouts). The trainer's
    log-probs of every model token, over the whole row with its images (and Qwen-VL's M-RoPE
    positions over prompt + completion with the result), are the sampler's; with the images
    zeroed the second turns' are not: the pixels reach every turn. The tool's result holds the
    image placeholder's text: a placeholder token in a completion is text, in the re-prefill
    as for the trainer. A tool that returns an image is refused in one line, naming it, by a
    rollout without a processor (a text model's, vLLM's); one whose image part has no image,
    by all."""
    if family == "gemma3":
        model, proc, size = hf.load_model(str(seeing_dir), dtype=np.float32)[0], \
            images_lib.load_processor(seeing_dir), (28, 28)
    else:
        (model, proc), size = _qwen_model(tmp_path), (16, 24)
    tok, g = _tool_tokenizer(proc), 2
    rng = np.random.default_rng(0)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    prompts = [images_lib.multimodal_messages(
        [{"role": "user", "content": "how many" + "?" * i}],
        [Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))], i)
        for i in range(2)]
    ids = images_lib.process(proc, prompts)
    records = [{"prompt": p, "prompt_ids": ids.prompt_ids(i) + tok.encode(
        call % e, add_special_tokens=False)} for i, (p, e) in enumerate(zip(prompts,
                                                                             ["7 * 8", "5 + 5"]))]
    C, stops = 96, tuple(range(2, 40))  # many stop tokens: turns of a few tokens
    sp = SamplingParams(max_completion_length=C, temperature=1.0, stop_token_ids=stops,
                        **({"max_num_seqs": 3} if partial else {}))
    inner = JaxRollout(model.cfg, sp, pad_id=tok.pad_token_id, mesh=None, processor=proc,
                       partial_rollouts=(g, 2, 1) if partial else None)
    assert inner.turns is None  # with images every turn re-prefills (no cache continuation)

    def rollout(fn):
        return tools.ToolRollout(inner, tok, tools.Toolbox([fn], 10.0), None, stops,
                                 tok.pad_token_id)
    def answer(expression: str) -> str:
        """The calculator's answer and the image placeholder's text, which the result's
        tokens hold as text (as the trainer embeds a completion), not as an image.

        Args:
            expression: The expression.
        """
        return calculator(expression) + placeholder
    placeholder = tok.convert_ids_to_tokens(model.cfg.vision.image_token_id)
    answer.__name__ = "calculator"
    params = nnx.split(model, nnx.Param)[1]
    if partial:
        p = rollout(answer).partial
        done = p.advance(params, p.empty(max(len(r["prompt_ids"]) for r in records)), records,
                         [0, 1], 0, jax.random.key(3))
        r = done.rollout
        assert done.records == records
    else:
        r = rollout(answer).generate(params, [x["prompt_ids"] for x in records], g,
                                     jax.random.key(3), records)
    np.testing.assert_array_equal(r.tool_calls, 1)
    assert r.tool_failures.sum() == 0
    model_tok = (r.completion_mask * r.tool_mask).astype(bool)
    # the tokens after each row's tool result: its second turn
    second = model_tok & (np.cumsum(r.tool_mask == 0, axis=1) > 0)
    assert second.any(axis=1).all()
    for row, msgs in enumerate(r.completions):
        answer = "56" if row // g == 0 else "10"
        assert [m["role"] for m in msgs][:2] == ["assistant", "tool"] and msgs[1]["content"] \
            == answer + placeholder
    batch = Batch(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                  r.truncated, np.zeros(len(r.truncated), np.float32), tool_mask=r.tool_mask,
                  pixel_values=r.pixel_values, positions=r.positions, image_grid=r.image_grid)
    if family == "qwen2_5_vl":
        assert r.positions.shape == (2 * g, 3, r.prompt_ids.shape[1] + C)
    logp = np.asarray(completion_logps(model, batch, 1.0, 128)[0])
    blind = np.asarray(completion_logps(model, batch.replace(
        pixel_values=np.zeros_like(r.pixel_values)), 1.0, 128)[0])
    diff = np.abs(logp - r.sampler_logp)[model_tok].max()
    zeroed = np.abs(blind - r.sampler_logp)[second].max()
    print(f"{family}{' partial' if partial else ''} tools: sampler vs trainer max |diff| "
          f"{diff:.3g}; second turns with the images zeroed {zeroed:.3g}")
    assert diff < 5e-5
    assert zeroed > 1e-3

    def unfilled(expression: str) -> list:
        """An image part without its image.

        Args:
            expression: The expression.
        """
        return [{"type": "image"}, {"type": "text", "text": expression}]
    unfilled.__name__ = "calculator"
    picture = _picture_tool(Image.new("RGB", size[::-1]))
    if partial:
        p = rollout(unfilled).partial
        with pytest.raises(ToolError, match="tool 'calculator' returned an image part "
                           "without its image") as e:
            p.advance(params, p.empty(max(len(r["prompt_ids"]) for r in records)), records,
                      [0, 1], 0, jax.random.key(3))
    else:
        with pytest.raises(ToolError, match="tool 'calculator' returned an image part "
                           "without its image"):
            rollout(unfilled).generate(params, [x["prompt_ids"] for x in records], g,
                                       jax.random.key(3), records)
        # Without a processor (a text model's rollout) an image is refused.
        text = tools.ToolRollout(JaxRollout(model.cfg, sp, pad_id=tok.pad_token_id, mesh=None),
                                 tok, tools.Toolbox([picture], 10.0), None, stops,
                                 tok.pad_token_id)
        with pytest.raises(ToolError, match="tool 'calculator' returned an image .* need a "
                           "vision-language model, whose processor") as e:
            text.generate(params, [x["prompt_ids"] for x in records], g, jax.random.key(3))
    assert "\n" not in str(e.value)


def _picture_tool(picture):
    """A calculator whose result is `picture` and the answer's text, as content blocks (TRL
    1.16's multimodal tool result)."""
    def calculator_picture(expression: str) -> list:
        """A picture and the answer.

        Args:
            expression: The expression.
        """
        return [{"type": "image", "image": picture}, {"type": "text", "text": calculator(expression)}]
    calculator_picture.__name__ = "calculator"
    return calculator_picture


def _picture_family(family, seeing_dir, tmp_path):
    """(model in fp32, processor, image size, its tokenizer prepared for tools with
    TOOL_TEMPLATE, which renders a tool's image part as the model's placeholder) of Gemma 3's
    seeing model or a tiny Qwen-VL's."""
    if family == "gemma3":
        model = hf.load_model(str(seeing_dir), dtype=np.float32)[0]
        proc, size = images_lib.load_processor(seeing_dir), (28, 28)
        template = TOOL_TEMPLATE.replace(FORCED_CALL, "")
    else:
        (model, proc), size = _qwen_model(tmp_path, family), (16, 24)
        template = TOOL_TEMPLATE.replace(FORCED_CALL, "").replace(
            "<start_of_image>", "<|vision_start|><|image_pad|><|vision_end|>")
    tok = copy.deepcopy(proc.tokenizer)
    tok.chat_template = template
    tok.response_template = dict(tools.HERMES_RESPONSE_TEMPLATE,
                                 start_anchor="<|im_start|>assistant")
    return model, proc, size, tools.prepare_tool_tokenizer(tok)


def _call_records(proc, tok, shown, expressions) -> list[dict]:
    """Records of prompts holding the image shown[i] each, their assistant turns begun with a
    calculator call of expressions[i] (so every row's first turn, whatever random tokens end
    it, is a call)."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    prompts = [images_lib.multimodal_messages(
        [{"role": "user", "content": "how many" + "?" * i}], [image], i)
        for i, image in enumerate(shown)]
    ids = images_lib.process(proc, prompts)
    return [{"prompt": p, "prompt_ids": ids.prompt_ids(i) + tok.encode(
        call % e, add_special_tokens=False)} for i, (p, e) in enumerate(zip(prompts,
                                                                             expressions))]


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl", "qwen3_vl"])
def test_tool_images_reach_the_model_as_transformers_places_them(family, seeing_dir, tmp_path):
    """A tool that returns an image (TRL 1.16's [{"type": "image", ...}, {"type": "text",
    ...}] result), on the static tool loop: each row's completion holds the image's tokens as
    the processor expands them (tool_mask 0, completion_images), the row's images are its
    prompt's then the tool's, and the second turn is generated seeing both. The trainer's
    log-probs of every completion token equal transformers' forward over prompt + completion
    (PyTorch, the same weights) with both images and the token type ids TRL builds from the
    ids (Qwen3-VL: both images' DeepStack features too); the sampler's of the model's tokens
    are the trainer's."""
    model, proc, size, tok = _picture_family(family, seeing_dir, tmp_path)
    ref = (transformers.Gemma3ForConditionalGeneration.from_pretrained(seeing_dir)
           if family == "gemma3" else
           transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "qwen")).eval()
    rng, g = np.random.default_rng(1), 2
    shown, picture = (Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
                      for _ in range(2))
    records = _call_records(proc, tok, [shown, shown], ["7 * 8", "5 + 5"])
    C, stops = 64, tuple(range(2, 40))
    inner = JaxRollout(model.cfg, SamplingParams(max_completion_length=C, temperature=1.0,
                                                 stop_token_ids=stops),
                       pad_id=tok.pad_token_id, mesh=None, processor=proc)
    r = tools.ToolRollout(inner, tok, tools.Toolbox([_picture_tool(picture)], 10.0), None,
                          stops, tok.pad_token_id).generate(
        nnx.split(model, nnx.Param)[1], [x["prompt_ids"] for x in records], g,
        jax.random.key(3), records)
    np.testing.assert_array_equal(r.tool_calls, 1)
    image_id = model.cfg.vision.image_token_id
    per_image = int((r.prompt_ids[0] == image_id).sum())  # the prompt holds one image
    placed = r.completion_images
    assert (placed.sum(axis=1) == per_image).all()
    assert (r.completion_ids[placed] == image_id).all() and (r.tool_mask[placed] == 0).all()
    model_tok = (r.completion_mask * r.tool_mask).astype(bool)
    assert (model_tok & (np.cumsum(placed, axis=1) > 0)).any(axis=1).all()  # a second turn
    assert image_blocks.count(r.pixel_values) == 2
    batch = Batch(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                  r.truncated, np.zeros(len(r.truncated), np.float32), tool_mask=r.tool_mask,
                  pixel_values=r.pixel_values, positions=r.positions,
                  completion_images=r.completion_images, image_grid=r.image_grid)
    logp = np.asarray(completion_logps(model, batch, 1.0, 128)[0])
    sampled = float(np.abs(logp - r.sampler_logp)[model_tok].max())
    pixels = proc.image_processor(images=[shown, picture], return_tensors="pt")
    oracle = 0.0
    for i in range(len(r.truncated)):
        c = int(r.completion_mask[i].sum())
        row = np.concatenate([r.prompt_ids[i][r.prompt_mask[i].astype(bool)],
                              r.completion_ids[i, :c]])
        assert (row == image_id).sum() == 2 * per_image  # the model wrote no placeholder
        t = torch.as_tensor(row[None].astype(np.int64))
        types = {"token_type_ids" if family == "gemma3" else "mm_token_type_ids":
                 (t == image_id).long()}
        with torch.no_grad():
            logits = ref(input_ids=t, attention_mask=torch.ones_like(t), **pixels,
                         **types).logits[0].float()
        want = torch.log_softmax(logits[len(row) - c - 1:-1], -1)[
            torch.arange(c), t[0, len(row) - c:]].numpy()
        oracle = max(oracle, float(np.abs(logp[i, :c] - want).max()))
    print(f"{family} tool images: trainer vs transformers max |diff| {oracle:.3g}; sampler "
          f"vs trainer {sampled:.3g}")
    assert oracle < 1e-4
    assert sampled < 5e-5


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_partial_rollouts_feed_a_tools_image(family, seeing_dir, tmp_path):
    """A tool that returns an image under partial rollouts (3 decode slots, groups of 2, 2
    groups a round, 3 rounds at fixed weights): a row fed a result holding an image prefills
    its context (prompt, completion, the result's image tokens) again in its decode slot with
    its prompt's image and the tool's, Gemma 3's image block both ways (its sliding layers'
    ring rolled into the slot's layout), Qwen-VL's M-RoPE positions and decode positions
    moved by the image's. The trainer's log-probs of every model token, over the whole row
    with both images (completion_images), are the sampler's, also of rows drawn over
    several rounds; with the images zeroed the turns after a result are not. A checkpoint's rows in
    flight keep their tools' images (the episodes' PNGs): the next round from them is the next
    round from the rows themselves."""
    model, proc, size, tok = _picture_family(family, seeing_dir, tmp_path)
    rng, g = np.random.default_rng(2), 2
    picture, *shown = (Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
                       for _ in range(13))
    records = _call_records(proc, tok, shown, [f"{i} + 1" for i in range(12)])
    C, stops = 64, tuple(range(2, 16))
    inner = JaxRollout(model.cfg, SamplingParams(max_completion_length=C, temperature=1.0,
                                                 stop_token_ids=stops, max_num_seqs=3),
                       pad_id=tok.pad_token_id, mesh=None, processor=proc,
                       partial_rollouts=(g, 2, 100))
    partial = tools.ToolRollout(inner, tok, tools.Toolbox([_picture_tool(picture)], 10.0), None,
                                stops, tok.pad_token_id).partial
    params, image_id = nnx.split(model, nnx.Param)[1], model.cfg.vision.image_token_id
    width = max(len(r["prompt_ids"]) for r in records)
    at, drawn, spanned, seen = partial.empty(width), 0, 0, 0

    def advance(at, version):
        new = records[drawn:drawn + at.empty_groups]
        return partial.advance(params, at, new, list(range(drawn, drawn + len(new))), version,
                               jax.random.key(5)), len(new)
    for version in range(3):
        done, n = advance(at, version)
        at, drawn, r = done.in_flight, drawn + n, done.rollout
        placed = r.completion_images
        per_image = int((r.prompt_ids[0] == image_id).sum())  # each prompt holds one image
        fed = placed.any(axis=1)
        assert set(placed.sum(axis=1)) <= {0, per_image} and fed.any()
        assert (r.completion_ids[placed] == image_id).all() and (r.tool_mask[placed] == 0).all()
        assert image_blocks.count(r.pixel_values) == 2  # the prompt's, the tool's or a blank
        assert [bool(x.any()) for x in r.pixel_values[:, 1]] == fed.tolist()
        model_tok = (r.completion_mask * r.tool_mask).astype(bool)
        after = model_tok & (np.cumsum(placed, axis=1) > 0)  # the turns after a tool's image
        seen += int(after.any(axis=1).sum())
        spanned += sum(len(set(v[m > 0])) > 1  # rows fed an image, drawn over rounds
                       for v, m in zip(r.versions[fed], r.completion_mask[fed]))
        batch = Batch(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                      r.truncated, np.zeros(len(r.truncated), np.float32),
                      tool_mask=r.tool_mask, pixel_values=r.pixel_values, positions=r.positions,
                      completion_images=placed, image_grid=r.image_grid)
        logp = np.asarray(completion_logps(model, batch, 1.0, 128)[0])
        blind = np.asarray(completion_logps(model, batch.replace(
            pixel_values=np.zeros_like(r.pixel_values)), 1.0, 128)[0])
        diff = float(np.abs(logp - r.sampler_logp)[model_tok].max())
        zeroed = float(np.abs(blind - r.sampler_logp)[after].max()) if after.any() else 1.0
        print(f"{family} round {version}: a tool's image under partial rollouts, sampler vs "
              f"trainer max |diff| {diff:.3g}; after the image, images zeroed {zeroed:.3g}")
        assert diff < 5e-5 and zeroed > 1e-3
    assert seen and spanned
    shown = [i for i, e in enumerate(at.episodes) if e["image_spans"]]
    assert shown  # rows in flight that hold a tool's image
    back = from_arrays(partial.empty(width), to_arrays(at), records.__getitem__)
    assert np.array_equal(np.asarray(back.episodes[shown[0]]["results"][0][0]["content"][0][
        "image"]), np.asarray(picture))
    (a, _), (b, _) = advance(at, 3), advance(back, 3)
    # A split run's batch sampled ahead, checkpointed: its rows' messages keep the picture.
    queued = disaggregated.from_arrays(disaggregated.to_arrays(disaggregated.Queued(
        b.rollout, tuple(b.records), np.arange(len(b.records)), 0)), records.__getitem__)
    for name in ("completion_ids", "sampler_logp", "versions", "pixel_values", "positions",
                 "completion_images"):
        x, y, z = (getattr(r, name) for r in (a.rollout, b.rollout, queued.rollout))
        assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), name
        assert (z is None) == (y is None) and (z is None or np.array_equal(z, y)), name
    tool = next(m for row in queued.rollout.completions for m in row if m["role"] == "tool"
                and isinstance(m["content"], list))
    assert np.array_equal(np.asarray(tool["content"][0]["image"]), np.asarray(picture))


@pytest.mark.parametrize("rounds", ["refill", "sampler_devices", "sampler_process"])
def test_squares_trains_with_tools(seeing_dir, tmp_path, rounds):
    """Two steps on 'squares' with the calculator tool (seeing_dir's Gemma 3 with TOOL_TEMPLATE
    and its parser saved with the tokenizer; many stop tokens, so turns are short): every row
    calls the calculator, turns after the results are re-prefilled with the prompts' images
    (refilled decode slots; static batches: the run with a tool that returns an image below)
    or fed in their slots (partial rollouts on a sampler device of their own, whose thread, or
    process, runs the tools; on shared devices: test_tool_turns_see_the_prompts_images), and
    the sampler's
    log-probs of the rows with images and tool results are the trainer's. A reward function
    checks each completion's messages: the call, its result and the turn after it."""
    model_dir = tool_model(seeing_dir, tmp_path / "model")
    # 1.0 for a completion that is a call, the calculator's answer and another turn
    (tmp_path / "episode.py").write_text(
        "def episode(prompts, completions, **kw):\n"
        "    return [float([m['role'] for m in c] == ['assistant', 'tool', 'assistant']\n"
        "                  and c[1]['content'] == '56') for c in completions]\n")
    out = tmp_path / "tools"
    extra, devices = ("max_num_seqs=3",), jax.devices()[:1]
    if rounds != "refill":  # partial rollouts on a device of their own, a round ahead
        extra, devices = ("max_num_seqs=3", "max_staleness=2", "learning_rate=0.0",
                          "sampler_devices=1", "dp=1",
                          f"sampler_process={rounds == 'sampler_process'}"), jax.devices()[:2]
    train(_cfg(model_dir, out, "max_steps=2", "save_steps=10", "max_completion_length=192",
               "tools=[grpo_jax.calculator:calculator]", "max_tool_calling_iterations=1",
               f"reward_funcs=[accuracy,{tmp_path / 'episode.py'}:episode]", *extra),
          devices=devices)
    steps = [r for r in _records(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    worst = max(r["sampling/sampling_logp_difference/max"] for r in steps)
    print(f"tools ({rounds}), sampler vs trainer log-probs, max "
          f"|diff| over 2 steps: {worst:.3g}; tools/call_frequency "
          f"{[r['tools/call_frequency'] for r in steps]}")
    assert worst < 5e-5
    assert all(r["tools/call_frequency"] == 1 and r["tools/failure_frequency"] == 0
               and r["rewards/episode/mean"] == 1 for r in steps)


@pytest.mark.parametrize("rounds", ["static", "sampler_process"])
def test_squares_trains_with_a_tool_that_returns_an_image(seeing_dir, tmp_path, rounds):
    """Two steps on 'squares' with a calculator that returns a picture and the answer (TRL
    1.16's multimodal tool result), seeing_dir's Gemma 3 with TOOL_TEMPLATE (which renders a
    tool's image part as a placeholder), in static rounds or in partial rollouts in a sampler
    process of its own (the processor goes there with the tool loop; the rows, their episodes
    and batches come back with the picture): every row calls it, its completion gets the
    picture's tokens, its next turn sees the prompt's image and the picture, and the trainer's
    log-probs (both images in the forward) are the sampler's; the loss is finite and the tool
    metrics are TRL's."""
    model_dir = tool_model(seeing_dir, tmp_path / "model")
    (tmp_path / "picture.py").write_text(PICTURE_TOOL)
    (tmp_path / "episode.py").write_text(PICTURE_EPISODE)
    out = tmp_path / "run"
    extra, devices = (), jax.devices()[:1]
    if rounds == "sampler_process":
        extra, devices = ("max_num_seqs=3", "max_staleness=2", "learning_rate=0.0",
                          "sampler_devices=1", "dp=1", "sampler_process=true"), jax.devices()[:2]
    train(_cfg(model_dir, out, "max_steps=2", "save_steps=10", "max_completion_length=192",
               f"tools=[{tmp_path / 'picture.py'}:calculator]", "max_tool_calling_iterations=1",
               f"reward_funcs=[accuracy,{tmp_path / 'episode.py'}:episode]", *extra),
          devices=devices)
    steps = [r for r in _records(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    worst = max(r["sampling/sampling_logp_difference/max"] for r in steps)
    print(f"a tool's image ({rounds}), sampler vs trainer log-probs, max |diff| over 2 steps: "
          f"{worst:.3g}"
          f"; loss {[r['loss'] for r in steps]}")
    assert worst < 5e-5
    assert all(np.isfinite(r["loss"]) and r["tools/call_frequency"] == 1
               and r["tools/failure_frequency"] == 0 and r["rewards/episode/mean"] == 1
               for r in steps)


# ---------------------------------------------------------------- a rollout_func with images

def test_a_rollout_func_samples_and_trains_with_the_prompts_images(seeing_dir, tmp_path):
    """TRL 1.16's rollout_func with a vision-language model: it gets each prompt with its
    images in its image parts, renders and expands it with trainer.processing_class (the
    processor) and samples it with trainer.generate(..., images=...); the rows train with their
    prompts' images. Two 'squares' steps: the sampler's log-probs are the trainer's. Directly:
    rows sampled with blank images instead score otherwise under the trainer (which has the
    prompts'), and ids without the images' placeholders are refused in one line."""
    out = tmp_path / "run"
    train(_cfg(seeing_dir, out, "max_steps=2", "save_steps=10",
               f"rollout_func={Path(reward_fixtures.__file__)}:seeing_episode"),
          devices=jax.devices()[:1])
    steps = [r for r in _records(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    worst = max(r["sampling/sampling_logp_difference/max"] for r in steps)

    model = hf.load_model(str(seeing_dir), dtype=np.float32)[0]
    proc = images_lib.load_processor(seeing_dir)
    cfg = _cfg(seeing_dir, tmp_path / "direct")
    rng = np.random.default_rng(2)
    prompts = [images_lib.multimodal_messages(
        [{"role": "user", "content": squares.QUESTION}], [squares.draw(rng)[0]], i)
        for i in range(2)]
    records = [{"prompt": p, "prompt_ids": images_lib.process(proc, [p]).prompt_ids(0)}
               for p in prompts]
    inner = JaxRollout(model.cfg, SamplingParams(max_completion_length=6,
                                                 stop_token_ids=(proc.tokenizer.eos_token_id,)),
                       pad_id=proc.tokenizer.pad_token_id, mesh=None, processor=proc)
    params = nnx.split(model, nnx.Param)[1]

    def rollout(fn):
        return CustomRollout(inner, fn, proc.tokenizer, cfg, (proc.tokenizer.eos_token_id,),
                             proc.tokenizer.pad_token_id).generate(
            params, [r["prompt_ids"] for r in records], 2, jax.random.key(0), records)
    blind = rollout(functools.partial(reward_fixtures.seeing_episode, blank=True))
    batch = Batch(blind.prompt_ids, blind.prompt_mask, blind.completion_ids,
                  blind.completion_mask, blind.truncated, np.zeros(4, np.float32),
                  pixel_values=blind.pixel_values)
    real = blind.completion_mask.astype(bool)
    blank = float(np.abs(np.asarray(completion_logps(model, batch, 1.0, 128)[0])
                         - blind.sampler_logp)[real].max())
    print(f"rollout_func with images: sampler vs trainer max |diff| over 2 steps {worst:.3g}; "
          f"sampled with blank images {blank:.3g}")
    assert worst < 5e-5
    assert blank > 1e-3

    def text_ids(prompts, trainer):
        ids = [proc.tokenizer(images_lib.render(proc, p))["input_ids"] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [[2]] * len(ids),
                "logprobs": [[0.0]] * len(ids)}
    with pytest.raises(RolloutFuncError, match=r"rollout_func's prompt_ids of row 0 holds 0 "
                       r"images' placeholders for 1 prompt's images; give the processor's"):
        rollout(text_ids)
