from grpo_jax.models.config import ModelConfig, ModelConfigError, Numerics
from grpo_jax.models.decoder import Decoder, KVCache, param_table, positions_from_mask

__all__ = ["Decoder", "KVCache", "ModelConfig", "ModelConfigError", "param_table",
           "positions_from_mask"]
