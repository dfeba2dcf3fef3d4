"""LoRA against PEFT (PyTorch CPU, fp32): transformers' model with a PEFT adapter, the settings
of a LoRA run on a base directory, and our adapted model next to PEFT's loading of the adapter
we saved. Shared by test_lora and test_moe."""

import jax
from hf_oracle import tiny_hf_model

from grpo_jax import peft_io
from grpo_jax.models.lora import PeftArgs


def peft_model(base_dir, adapter_dir=None, seed=0, **lora_kw):
    """transformers' model from `base_dir` with a PEFT adapter: loaded from `adapter_dir`, or
    a fresh one (random B so it matters)."""
    import torch
    import transformers
    from peft import LoraConfig, PeftModel, get_peft_model
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        return PeftModel.from_pretrained(base, adapter_dir).eval()
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **lora_kw))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model.eval()


def peft_train_config(name_or_path, **peft):
    from grpo_jax.config import TrainConfig
    from grpo_jax.models.config import Numerics
    return TrainConfig(model=TrainConfig().model.__class__(name_or_path=str(name_or_path)),
                       numerics=Numerics(dtype="float32"), peft=PeftArgs(use_peft=True, **peft))


def ours_and_peft(tmp_path, family, **peft):
    """Our model with rank-4 adapters (random B) on a tiny `family` base, and PEFT's model
    loading the adapter we saved."""
    tiny_hf_model(family).save_pretrained(tmp_path / "base")
    cfg = peft_train_config(tmp_path / "base", lora_r=4, lora_alpha=8, **peft)
    model, _ = peft_io.load_model(cfg, None)
    for i, (name, var) in enumerate(sorted(vars(model.layers).items())):
        if name.endswith("_lora_b"):
            var.set_value(0.1 * jax.random.normal(jax.random.key(i), var.shape))
    peft_io.save_adapter(model, cfg.peft, tmp_path / "adapter", str(tmp_path / "base"))
    return model, peft_model(tmp_path / "base", tmp_path / "adapter")
