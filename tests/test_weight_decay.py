"""AdamW's weight decay skips what transformers' Trainer skips: biases and norm weights
(`Trainer.get_decay_parameter_names`); the embedding and the LM head decay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.grpo import optimizer as opt
from grpo_jax.models import Decoder, ModelConfig

NO_DECAY = {"final_norm", "layers/attn_norm", "layers/mlp_norm", "layers/q_norm",
            "layers/k_norm", "layers/bq", "layers/bk", "layers/bv"}


def _params():
    cfg = ModelConfig("qwen3", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=8, qkv_bias=True, qk_norm=True)
    params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)[1]
    # non-zero biases and norms that are not 1, so decay would show on every leaf
    return jax.tree.map(lambda x: x + 0.5, params)


def _named(tree):
    return {"/".join(str(getattr(k, "key", "")) for k in path if hasattr(k, "key")): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.slow
def test_decay_mask_matches_transformers_names():
    mask = _named(opt.decay_mask(_params()))
    assert {k for k, v in mask.items() if not v} == NO_DECAY
    assert {"embed", "lm_head", "layers/wq", "layers/w_down"} <= {k for k, v in mask.items() if v}


def test_weight_decay_leaves_norms_and_biases_alone():
    params = _params()
    wd, lr = 0.1, 0.5
    tx, _ = opt.make_optimizer(opt.OptimizerConfig(learning_rate=lr, lr_scheduler_type="constant",
                                                   weight_decay=wd, max_grad_norm=0.0), 10)
    zeros = jax.tree.map(jnp.zeros_like, params)  # Adam's step is 0: only decay moves params
    updates, _ = tx.update(zeros, tx.init(params), params)
    new = _named(jax.tree.map(jnp.add, params, updates))
    old = _named(params)
    for name, before in old.items():
        factor = 1.0 if name in NO_DECAY else 1.0 - lr * wd
        np.testing.assert_allclose(new[name], before * factor, rtol=1e-6, err_msg=name)
