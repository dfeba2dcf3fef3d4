"""LoRA: the adapted forward, the trainable/frozen split, PEFT's files in both directions."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_oracle import hf_logits, tiny_hf_model

from grpo_jax import hf, mesh as mesh_lib, peft_io
from grpo_jax.errors import ConfigError
from grpo_jax.grpo.optimizer import OptimizerConfig
from grpo_jax.grpo.train_step import StepConfig
from grpo_jax.models import Decoder, lora
from grpo_jax.models.lora import PeftArgs
from grpo_jax.trainer import ADAPTERS_OFF, Trainer
from test_model import MASK, TOKENS, jax_logits
from test_train_step import CFG, loss_config, make_batch

ALL = ("all-linear",)


def _adapted(peft=PeftArgs(use_peft=True, lora_target_modules=ALL), seed=0, b_scale=0.0):
    """The tiny decoder with adapters; B random (scaled by `b_scale`) so they change outputs."""
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    lora.add_adapters(model, peft, jax.random.key(seed))
    if b_scale:
        for i, (name, var) in enumerate(sorted(vars(model.layers).items())):
            if name.endswith("_lora_b"):
                var.set_value(b_scale * jax.random.normal(jax.random.key(i), var.shape))
    return model


def test_zero_b_starts_at_the_base_and_adapters_change_the_output():
    base = Decoder(CFG, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(jax_logits(_adapted()), jax_logits(base))
    assert np.abs(jax_logits(_adapted(b_scale=0.1)) - jax_logits(base)).max() > 1e-3


def test_adapter_forward_equals_the_merged_weights():
    model = _adapted(b_scale=0.1)
    merged = peft_io.merged_model(model)
    assert not any(isinstance(v, lora.LoraParam) for v in vars(merged.layers).values())
    np.testing.assert_allclose(jax_logits(model), jax_logits(merged), atol=1e-4)


def test_scale_and_init_follow_peft():
    assert PeftArgs(lora_r=16, lora_alpha=32).scale == 2.0
    assert PeftArgs(lora_r=16, lora_alpha=32, use_rslora=True).scale == 8.0
    model = _adapted(PeftArgs(lora_r=4, lora_target_modules=("o_proj", "down_proj")))
    a = model.layers.wo_lora_a[...]
    assert a.shape == (CFG.num_layers, CFG.num_heads, CFG.head_dim, 4)
    fan_in = CFG.num_heads * CFG.head_dim
    assert 0.8 / fan_in ** 0.5 < float(jnp.abs(a).max()) <= 1 / fan_in ** 0.5  # kaiming-uniform
    assert not np.any(np.asarray(model.layers.w_down_lora_b[...]))
    assert not hasattr(model.layers, "wq_lora_a")


@pytest.mark.parametrize("kw,msg", [
    (dict(lora_r=0), "lora_r must be >= 1"),
    (dict(lora_target_modules=("q_proj", "qkv")), "match no module"),
    (dict(lora_dropout=0.05), "lora_dropout"),
])
def test_bad_settings_are_one_clear_error(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        PeftArgs(use_peft=True, **kw)


def _trainer(model, mesh, lr=1e-2):
    step_cfg = StepConfig(loss=loss_config(beta=0.04), temperature=0.9,
                          gradient_accumulation_steps=2, logprob_chunk=4)
    return Trainer(model, step_cfg, OptimizerConfig(learning_rate=lr, lr_scheduler_type="constant"),
                   10, mesh)


def test_trainer_trains_only_the_adapters_and_the_reference_is_the_base():
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=2, fsdp=2, tp=2))
    model = _adapted(b_scale=0.01)
    base = Decoder(CFG, rngs=nnx.Rngs(0))
    trainer = _trainer(model, mesh)
    state = trainer.init_state
    names = {k for k in state.params["layers"]}
    assert names and all("_lora_" in k for k in names)
    batch = make_batch(with_old=False)
    ref = np.asarray(trainer.logps(ADAPTERS_OFF, batch))
    plain = _trainer(base, mesh)
    np.testing.assert_allclose(ref, np.asarray(plain.logps(plain.init_state.params, batch)),
                               atol=1e-6)
    frozen = jax.tree.map(np.asarray, trainer.frozen[0])
    state, metrics = trainer.step(state, batch.replace(ref_logp=ref))
    state, metrics = trainer.step(state, batch.replace(ref_logp=ref))
    assert np.isfinite(float(metrics["loss"])) and float(metrics["kl"]) > 0
    jax.tree.map(np.testing.assert_array_equal, frozen, jax.tree.map(np.asarray,
                                                                     trainer.frozen[0]))
    # The sampler's merged weights give the trained model's log-probs.
    merged = trainer.rollout_params(state.params)
    np.testing.assert_allclose(np.asarray(plain.logps(merged, batch)),
                               np.asarray(trainer.logps(state.params, batch)), atol=1e-4)


def test_smollm2_r16_all_linear_trains_a_few_percent(smol_dir):
    """r=16 on every linear layer of SmolLM2-135M: the trainable count, gradients and AdamW
    state are the adapters' size (well under 5% of full fine-tuning)."""
    model, _ = hf.load_model(str(smol_dir), dtype=jnp.float32)
    full = model.cfg.num_params()
    lora.add_adapters(model, PeftArgs(use_peft=True, lora_r=16, lora_target_modules=ALL),
                      jax.random.key(0))
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=-1))
    trainer = _trainer(model, mesh)
    state = trainer.init_state
    c = model.cfg
    per_layer = 16 * (c.hidden_size + c.q_size  # q: D -> H*Dh
                      + 2 * (c.hidden_size + c.kv_size)  # k, v
                      + (c.q_size + c.hidden_size)  # o
                      + 3 * (c.hidden_size + c.intermediate_size))  # gate, up, down
    trainable = lora.count(state.params)
    assert trainable == c.num_layers * per_layer == 4_884_480
    assert trainable / full < 0.05 and full == 134_515_008
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
    # AdamW's mu and nu (fp32) plus a few counters: 2 x the adapters, never the base.
    assert 2 * 4 * trainable <= opt_bytes < 2 * 4 * trainable + 1024
    grads = jax.eval_shape(lambda p: p, state.params)
    assert sum(x.size for x in jax.tree.leaves(grads)) == trainable
    print(f"trainable {trainable} of {full} ({trainable / full:.2%}); "
          f"optimizer state {opt_bytes / 2**20:.1f} MiB "
          f"(full fine-tuning: {8 * full / 2**20:.0f} MiB)")
