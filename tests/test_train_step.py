"""The jitted train step: exact gradient accumulation, sharded == unsharded, skipped updates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import mesh as mesh_lib
from grpo_jax.grpo.optimizer import OptimizerConfig
from grpo_jax.grpo.train_step import StepConfig, TrainState, batch_loss, loss_and_grads
from grpo_jax.policy import Policy
from grpo_jax.models import Decoder
from step_batches import CFG, loss_config, make_batch

LR = 1e-2


def model():
    return Decoder(CFG, rngs=nnx.Rngs(0))


def grads_for(loss_type, k, batch, **loss_kw):
    graphdef, params = nnx.split(model(), nnx.Param)
    cfg = StepConfig(loss=loss_config(loss_type=loss_type, **loss_kw), temperature=0.9,
                     gradient_accumulation_steps=k, logprob_chunk=4)
    fn = jax.jit(lambda p, b: loss_and_grads(graphdef, cfg, p, b))
    loss, grads, _ = fn(params, jax.tree.map(jnp.asarray, batch))
    return float(loss), jax.tree.map(np.asarray, jax.tree.leaves(grads))


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_gradient_accumulation_is_exact(loss_type):
    batch = make_batch()
    loss1, g1 = grads_for(loss_type, 1, batch, beta=0.04)
    loss4, g4 = grads_for(loss_type, 4, batch, beta=0.04)
    assert abs(loss1 - loss4) < 1e-5 * max(1.0, abs(loss1))
    for a, b in zip(g1, g4):
        assert np.abs(a - b).max() <= 1e-5 * max(np.abs(a).max(), 1e-12)


def _step_once(mesh, batch, k=2):
    cfg = StepConfig(loss=loss_config(loss_type="dapo", beta=0.04), temperature=1.0,
                     gradient_accumulation_steps=k, logprob_chunk=4)
    trainer = Policy(model(), cfg, OptimizerConfig(learning_rate=LR,
                                                    lr_scheduler_type="constant"), 10, mesh)
    state, metrics = trainer.step(trainer.init_state, batch)
    return trainer, state, jax.device_get(metrics)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py sets "
                    "XLA_FLAGS for 8 host CPU devices)")
@pytest.mark.slow
def test_sharded_step_equals_single_device():
    batch = make_batch(1)
    one = mesh_lib.make_mesh(mesh_lib.MeshConfig(1, 1, 1), jax.devices()[:1])
    eight = mesh_lib.make_mesh(mesh_lib.MeshConfig(2, 2, 2))
    _, s1, m1 = _step_once(one, batch)
    trainer8, s8, m8 = _step_once(eight, batch)
    wq = s8.params["layers"]["wq"][...]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    # Adam's first step moves a weight by LR * g / (|g| + eps): where g is near eps (1e-8) the
    # float32 summation-order noise of the two meshes is a visible part of that step. Measured
    # 7.1e-6 = 7e-4 LR (one w_down entry; was under atol=1e-5); the bound is 7x that, and a wrong
    # sharding moves whole steps (~LR). grad_norm below checks the gradients' scale at 1e-5.
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s8.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-3 * LR, rtol=0)
    for key in ("loss", "kl", "grad_norm", "clip_ratio/region_mean"):
        np.testing.assert_allclose(m1[key], m8[key], rtol=1e-5, atol=1e-6)
    assert int(s8.step) == 1 and int(m8["skipped_updates"]) == 0


@pytest.mark.slow
def test_nonfinite_gradient_skips_update():
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(1, 1, 1), jax.devices()[:1])
    batch = make_batch(2)
    batch.advantages[0] = np.nan
    trainer = Policy(model(), StepConfig(loss=loss_config(), temperature=1.0,
                                          gradient_accumulation_steps=1),
                      OptimizerConfig(learning_rate=LR, lr_scheduler_type="constant"), 10, mesh)
    before = jax.tree.map(np.asarray, trainer.init_state.params)
    state, metrics = trainer.step(trainer.init_state, batch)
    assert int(metrics["skipped_updates"]) == 1 and int(state.step) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.slow
def test_metrics_have_trl_names():
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(1, 1, 1), jax.devices()[:1])
    _, _, m = _step_once(mesh, make_batch(3), k=1)
    for key in ("loss", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/low_min",
                "clip_ratio/high_mean", "clip_ratio/high_max", "clip_ratio/region_mean",
                "grad_norm", "learning_rate", "skipped_updates"):
        assert key in m, key
    assert np.isfinite(m["loss"]) and m["learning_rate"] == pytest.approx(LR)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo"])
@pytest.mark.slow
def test_eval_loss_is_one_micro_batch_of_the_train_loss(loss_type):
    """batch_loss (evaluation: TRL's loss in eval mode, no accumulation) == the step's loss over
    the same batch as one micro-batch, with KL, old log-probs and the entropy bonus on."""
    graphdef, params = nnx.split(model(), nnx.Param)
    batch = jax.tree.map(jnp.asarray, make_batch(3))
    cfg = StepConfig(loss=loss_config(loss_type=loss_type, beta=0.04, entropy_coef=0.01),
                     temperature=0.9, gradient_accumulation_steps=1, logprob_chunk=4)
    want, _, sums = loss_and_grads(graphdef, cfg, params, batch)
    got = jax.jit(lambda p, b: batch_loss(graphdef, cfg, TrainState(p, None, 0), b))(params,
                                                                                     batch)
    # Measured: equal to the last bit on XLA:CPU (one program differs from the other only in
    # the gradient it also takes).
    assert abs(float(got["loss"]) - float(want)) <= 1e-6 * max(1.0, abs(float(want)))
    assert {"kl", "entropy", "policy_loss", "clip_ratio/region_mean"} <= set(got)


@pytest.mark.slow
def test_reference_copy_halves_memory_keeps_logps_and_chunks_agree():
    """The reference is kept with its matrices in the compute dtype: in a bf16 run its log-probs
    equal the fp32 masters' bit for bit (the forward casts them alike), its buffers are its own
    (the step donates the params), and Policy.logps gives the same a micro-batch at a time."""
    from grpo_jax.rollout.native.sampler import reference_copy
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=-1), jax.devices()[:2])
    bf16 = Decoder(CFG.replace(dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
    trainer = Policy(bf16, StepConfig(loss=loss_config(), temperature=0.9,
                                       gradient_accumulation_steps=1), OptimizerConfig(), 10, mesh)
    params = trainer.init_state.params
    ref = reference_copy(params, jnp.bfloat16)
    dtypes = {jax.tree_util.keystr(p): x.dtype for p, x in jax.tree_util.tree_leaves_with_path(ref)}
    assert all((d == jnp.float32) == ("norm']" in k) for k, d in dtypes.items()), dtypes
    batch = make_batch(5)
    whole = trainer.logps(params, batch)
    np.testing.assert_array_equal(trainer.logps(ref, batch), whole)
    # A quarter of the rows per call: XLA blocks the smaller matmuls otherwise (measured: at
    # most 4.8e-7 apart, fp32 rounding).
    np.testing.assert_allclose(trainer.logps(params, batch, rows=4), whole, rtol=0, atol=2e-6)
    jax.tree.map(lambda x: x.delete(), params)  # as a step's donation would
    assert not any(x.is_deleted() for x in jax.tree.leaves(ref))
