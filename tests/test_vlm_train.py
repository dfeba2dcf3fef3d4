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

from grpo_jax import hf
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
    sets = {"model_name_or_path": vlm_dir, "output_dir": out, "max_steps": 2,
            "num_generations": 4, "per_device_train_batch_size": 8,
            "max_completion_length": 6, "learning_rate": 0.01, "eval_strategy": "no",
            "save_steps": 1, "report_to": "[]", "num_completions_to_print": 0,
            "log_completions": "false"}
    return load_config("squares", [f"{k}={v}" for k, v in sets.items()] + list(extra))


def test_squares_trains_resumes_and_exports(vlm_dir, tmp_path):
    out = tmp_path / "run"
    last = train(_cfg(vlm_dir, out), devices=jax.devices()[:1])
    print(last)
