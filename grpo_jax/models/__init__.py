from grpo_jax.models.config import ModelConfig, ModelConfigError, param_table
from grpo_jax.models.decoder import Decoder, KVCache, positions_from_mask

__all__ = ["Decoder", "KVCache", "ModelConfig", "ModelConfigError", "param_table",
           "positions_from_mask"]
