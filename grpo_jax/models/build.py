"""Where the decoder is built as a whole: plain, quantized, with LoRA adapters; concrete from
weights (hf.load_model, peft_io.load_model) or abstract (nnx.eval_shape), for a program to be
traced for or a checkpoint to be read into."""

from __future__ import annotations

import jax
from flax import nnx

from grpo_jax.models import lora, quant
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.decoder import Decoder


def abstract_model(cfg: ModelConfig, peft: lora.PeftArgs | None = None, adapter_dtype=None,
                   quantize: bool = True) -> Decoder:
    """The abstract decoder of `cfg`; with `peft` (use_peft), quantized (unless `quantize` is
    false: a checkpoint's adapters alone) and with adapters in `adapter_dtype`, as
    peft_io.load_model builds a LoRA run's model."""
    def build():
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        if peft:
            if peft.quant_bits and quantize:
                quant.quantize_model(model, peft.quant_bits)
            lora.add_adapters(model, peft, jax.random.key(0), adapter_dtype)
        return model
    return nnx.eval_shape(build)
