"""Suite-wide setup: 8 host CPU devices (sharding tests), fp32 matmuls, offline hub."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# SmolLM2-135M-Instruct, loaded once for the session. Tests only read these objects: they must
# not change the models' weights or configs, nor the tokenizer.

@pytest.fixture(scope="session")
def smol_dir():
    """The converted Hugging Face directory of SmolLM2-135M-Instruct."""
    from grpo_jax import hf
    return hf.resolve_model_dir(hf.SMOL_ALIAS)


@pytest.fixture(scope="session")
def smol_tok(smol_dir):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def smol_ref(smol_dir):
    """transformers' SmolLM2 (PyTorch CPU, fp32, eval mode): the oracle."""
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(smol_dir, dtype="float32").eval()


@pytest.fixture(scope="session")
def smol_model(smol_dir):
    """SmolLM2 as the grpo_jax decoder, fp32."""
    import jax.numpy as jnp

    from grpo_jax import hf
    model, _ = hf.load_model(str(smol_dir), dtype=jnp.float32)
    return model
