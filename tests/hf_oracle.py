"""Tiny random transformers models (PyTorch CPU, fp32): the oracle for logits and generation."""

from __future__ import annotations

import numpy as np
import torch
import transformers

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
}
# What each family's tiny config sets beyond the shared shape: windows shorter than the test
# sequences, a query scale other than head_dim, soft-caps low enough to bite (a tiny
# random model's scores and logits are small), Gemma 3's two
# RoPE bases with linear scaling on the global layers.
FAMILY_CONFIG = {
    "qwen3": dict(head_dim=16),
    "mistral": dict(sliding_window=5),
    "phi3": dict(sliding_window=5),
    "gemma2": dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=1,
                   attn_logit_softcapping=0.02, final_logit_softcapping=0.3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   num_hidden_layers=3),
    "gemma3_text": dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                        num_hidden_layers=3,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                        rope_parameters={
                            "full_attention": {"rope_type": "linear", "factor": 4.0,
                                               "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # Mixtures of experts: 4 experts, 2 per token, narrow experts; Qwen3-MoE with a dense layer
    # between sparse ones (mlp_only_layers), gpt-oss with its alternating windows, YaRN RoPE
    # and a swiglu_limit low enough to clamp a tiny model's activations.
    "qwen3_moe": dict(head_dim=16, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5),
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    intermediate_size=32, swiglu_limit=0.05),
}


def tiny_hf_model(family: str, *, tie: bool = False, seed: int = 0, vocab: int = 128,
                  **overrides):
    config_cls, model_cls = FAMILIES[family]
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
    kw.update(FAMILY_CONFIG.get(family, {}))
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("sinks"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_logits(model, tokens, mask):
    """Logits for a left-padded batch, positions counted from each row's first real token."""
    t = torch.as_tensor(tokens, dtype=torch.long)
    m = torch.as_tensor(mask, dtype=torch.long)
    pos = (m.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=t, attention_mask=m, position_ids=pos).logits.float().numpy()


def hf_greedy(ref, prompts, n, pad=0):
    """transformers greedy generate, stopping at EOS (2), then padded as the sampler pads."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = ref.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                           eos_token_id=[2], pad_token_id=pad)
    out = out[:, width:].numpy()
    return np.pad(out, ((0, 0), (0, n - out.shape[1])), constant_values=pad)



def char_tokenizer(extra=()):
    """A character-level tokenizer (pad 0, bos 1, eos 2, then printable ASCII, then `extra`): a
    small vocab that a tiny random model can learn over in a few RL steps. (A run of newlines,
    which the split leaves whole, is a token only if it is in `extra`.)"""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>",
                                        *string.printable[:95], *extra])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>")


def tiny_grpo_run(tmp_path, model, **mesh) -> dict:
    """Two GRPO steps (reward_len, 8 prompts x 4, fp32) of the tiny HF `model` with
    char_tokenizer over 4 devices laid out by `mesh` (dp, fsdp, ep...): the run's last record."""
    import json

    import jax

    from grpo_jax.cli import load_config
    from grpo_jax.train import train
    policy = tmp_path / "policy"
    model.save_pretrained(policy)
    char_tokenizer().save_pretrained(policy)
    with open(tmp_path / "p.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"Post {i}: say something.\n"}) + "\n")
    sets = {"name_or_path": policy, "dtype": "float32", "dataset_name": tmp_path / "p.jsonl",
            "reward_funcs": "[reward_len]", "num_generations": 4, "max_completion_length": 8,
            "per_device_train_batch_size": 2, "learning_rate": 0.01, "beta": 0.04,
            "output_dir": tmp_path / "out", "report_to": "[]", "max_steps": 2,
            "num_completions_to_print": 0, **mesh}
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
    return train(cfg, devices=jax.devices()[:4])
