"""Training on images end to end on CPU: a tiny random Gemma 3 vision-language model saved
with transformers (and a Gemma3Processor over a character tokenizer), the built-in 'squares'
dataset, the native sampler's rounds with the prompts' images, the trainer's forwards with
them (the tower frozen), checkpoints, --resume, and the export transformers reloads."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers

from grpo_jax.cli import load_config
from grpo_jax.errors import ConfigError
from grpo_jax.export import export
from grpo_jax.train import train
from test_vlm_data import gemma_processor

MM = 4  # soft tokens per image (the processor's image_seq_length)


def _tiny_gemma3(processor, seed=0):
    tok = processor.tokenizer
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image", "<image_soft_token>"), ("boi", "<start_of_image>"),
        ("eoi", "<end_of_image>"))}
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, rms_norm_eps=1e-6, query_pre_attn_scalar=16,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=7, num_channels=3,
                  vision_use_head=False)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                    mm_tokens_per_image=MM, image_token_index=ids["image"],
                                    boi_token_index=ids["boi"], eoi_token_index=ids["eoi"])
    torch.manual_seed(seed)
    return transformers.Gemma3ForConditionalGeneration(cfg).eval()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    """A tiny Gemma 3 VLM directory with its processor, as transformers saves them."""
    processor = gemma_processor()
    path = tmp_path_factory.mktemp("gemma3_train") / "model"
    _tiny_gemma3(processor).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _cfg(vlm_dir, out, *extra):
    sets = {"model_name_or_path": vlm_dir, "output_dir": out, "max_steps": 3,
            "num_generations": 4, "per_device_train_batch_size": 8,
            "max_completion_length": 6, "learning_rate": 0.01, "eval_strategy": "no",
            "eval_on_start": "false", "save_steps": 1, "report_to": "[]",
            "num_completions_to_print": 0, "log_completions": "false"}
    return load_config("squares", [f"{k}={v}" for k, v in sets.items()] + list(extra))


def _records(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_squares_trains_resumes_and_exports(vlm_dir, tmp_path):
    """Three steps on 'squares' (2 images x 4 answers a step, fp32, one device): the sampler's
    and the trainer's log-probs of the rows with images agree; a run stopped after step 2 and
    resumed ends where the uninterrupted one does; the export reloads in transformers with the
    vision tower as it was (frozen) and the language model trained."""
    one = jax.devices()[:1]
    whole = tmp_path / "whole"
    train(_cfg(vlm_dir, whole), devices=one)
    steps = [r for r in _records(whole) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    worst = max(r["sampling/sampling_logp_difference/max"] for r in steps)
    print(f"sampler vs trainer log-probs, max |diff| over 3 steps: {worst:.3g}")
    assert worst < 5e-5
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in steps)

    cut = tmp_path / "cut"
    train(_cfg(vlm_dir, cut, "max_steps=2"), devices=one)
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


@pytest.mark.parametrize("setting", ["max_num_seqs=4", "backend=vllm"])
def test_settings_images_cannot_take_are_refused(vlm_dir, tmp_path, setting):
    with pytest.raises(ConfigError, match="static batches only; unset "
                       + setting.split("=")[0].replace("backend", "rollout.backend")):
        train(_cfg(vlm_dir, tmp_path / "run", setting), devices=jax.devices()[:1])
