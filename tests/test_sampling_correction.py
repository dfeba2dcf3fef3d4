"""The sampler/trainer mismatch on the native path (issue #50, items 2 and 3): TRL's sampling/*
metrics every round, TRL's importance-sampling correction when native_importance_sampling_correction
asks for it (its equality with TRL's own computation: test_loss_trl's
test_native_path_corrections_match_trl), and verl's rollout rejection sampling (rollout_rs:
token_k1, seq_mean_k1) against numpy written from its definition."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trl_oracle import jax_step, make_inputs

from grpo_jax import mesh as mesh_lib
from grpo_jax.config import BatchPlan, TrainConfig
from grpo_jax.data import DataPosition
from grpo_jax.errors import ConfigError
from grpo_jax.grpo import loss as L
from grpo_jax.models import Decoder, ModelConfig
from grpo_jax.policy import Policy, step_config
from grpo_jax.round import Draw, GRPORound
from grpo_jax.run_state import RunState
from grpo_jax.scoring import Scores

MODEL = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                    tie_word_embeddings=True)


def run_cfg(backend="jax", **loss) -> TrainConfig:
    cfg = TrainConfig()
    return dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, **loss),
                               rollout=dataclasses.replace(cfg.rollout, backend=backend))


# ------------------------------------------------------------------ the native path's defaults

def test_native_default_is_todays_no_correction():
    """TRL's default (correction on) holds for vLLM; the JAX sampler gets it only when asked,
    and no rejection unless rollout_rs is set: the default native step is the one before #50
    (tests/test_loss_trl's cases and a run's seeded results unchanged)."""
    cfg = run_cfg()
    assert cfg.loss.vllm_importance_sampling_correction  # TRL's default
    assert not cfg.loss.native_importance_sampling_correction and cfg.loss.rollout_rs is None
    native = step_config(cfg, cfg.batch_plan(), MODEL).loss
    assert native == dataclasses.replace(cfg.loss, vllm_importance_sampling_correction=False)
    vllm = run_cfg("vllm")
    assert step_config(vllm, vllm.batch_plan(), MODEL).loss == vllm.loss
    asked = run_cfg(native_importance_sampling_correction=True)
    assert step_config(asked, asked.batch_plan(), MODEL).loss == asked.loss


def test_default_native_step_has_todays_metrics():
    """With the default native settings the step's metrics are the same names as before: the
    sampling/* ones (sampler_logp given) and no rollout_corr/*."""
    cfg = run_cfg()
    lc = step_config(cfg, cfg.batch_plan(), MODEL).loss
    _, _, _, sums = jax_step(make_inputs(0, 8), lc, 2, 8, False, True, None)
    metrics = L.step_metrics(sums)
    per_gen = set(metrics.pop(L.GENERATION_SUMS)["mean"])
    assert per_gen == {"sampling/sampling_logp_difference/mean",
                       "sampling/importance_sampling_ratio/mean"}
    assert not any(k.startswith("rollout_corr/") for k in metrics)


@pytest.mark.parametrize("kw,msg", [
    (dict(rollout_rs="token_k1"), "go together"),
    (dict(rollout_rs_threshold=2.0), "go together"),
    (dict(rollout_rs_threshold_lower=0.5), "go together"),
    (dict(rollout_rs="seq_sum_k1", rollout_rs_threshold=2.0), "rollout_rs must be one of"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=2.0),
     "rollout_rs_threshold_lower < rollout_rs_threshold"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold=-1.0), "bounds"),
    (dict(native_importance_sampling_correction=True,
          vllm_importance_sampling_correction=False), "set vllm_importance_sampling_correction"),
])
def test_bad_combinations_are_one_config_error(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        L.LossConfig(**kw)


# ------------------------------------------------------- rollout_rs against its definition

def np_rs_keep(old, sampler, m, mode, lo, hi):
    """[B, T] 1 inside [lo, hi], 0 outside: each token's ratio (token_k1) or each sequence's
    geometric mean of its tokens' ratios (seq_mean_k1)."""
    keep = np.ones(m.shape)
    for i in range(m.shape[0]):
        valid = m[i] > 0
        r = np.exp(np.nan_to_num(old[i].astype(np.float64) - sampler[i], nan=0.0))
        if mode == "token_k1":
            keep[i] = np.where((r >= lo) & (r <= hi), 1.0, 0.0)
        else:
            g = np.exp(np.log(r[valid]).mean()) if valid.any() else 1.0
            keep[i] = float(lo <= g <= hi)
    return keep


RS_CASES = [("token_k1", 1.3, None), ("token_k1", 1.2, 0.9), ("seq_mean_k1", 1.05, None),
            ("seq_mean_k1", 1.1, 0.97)]


@pytest.mark.parametrize("mode,hi,lo", RS_CASES)
def test_rollout_rs_mask_is_its_definition(mode, hi, lo):
    x = make_inputs(3, 16, noise=0.3)
    x["sampler_logp"][5, 2] = np.nan  # a token the sampler could not score: ratio 1
    cfg = L.LossConfig(rollout_rs=mode, rollout_rs_threshold=hi, rollout_rs_threshold_lower=lo)
    m = np.asarray(L.loss_mask(x["completion_mask"], x["truncated"], cfg))
    got = np.asarray(L.rollout_rs_mask(jnp.asarray(x["old_logp"]), jnp.asarray(x["sampler_logp"]),
                                       jnp.asarray(m), cfg))
    want = np_rs_keep(x["old_logp"], x["sampler_logp"], m, mode, 1.0 / hi if lo is None else lo,
                      hi)
    np.testing.assert_array_equal(got * m, want * m)
    dropped = ((1 - want) * m)
    assert 0 < dropped.sum() < m.sum()  # the case drops some tokens and keeps others
    if mode == "seq_mean_k1":  # whole sequences
        assert all(d.sum() in (0, row.sum()) for d, row in zip(dropped, m))
    # verl's fractions: of the loss tokens, and of the sequences with any loss token.
    sums = L.rs_metric_sums(jnp.asarray(got), jnp.asarray(m))
    metrics = L.finalize_metrics({"mean": sums, "min": {}, "max": {}})
    has = m.sum(1) > 0
    assert float(metrics["rollout_corr/rollout_rs_masked_fraction"]) == pytest.approx(
        dropped.sum() / m.sum())
    assert float(metrics["rollout_corr/rollout_rs_seq_masked_fraction"]) == pytest.approx(
        ((dropped.sum(1) > 0) & has).sum() / has.sum())


def np_dapo_loss(x, keep, weight, cfg, old):
    """TRL's dapo loss of one micro-batch from its definition: the clipped objective per token,
    times the correction weight and rollout_rs's keep mask, summed over the loss tokens / them."""
    m = L.loss_mask(x["completion_mask"], x["truncated"], cfg)
    m = np.asarray(m, np.float64)
    lp = x["logp"].astype(np.float64)
    o = x["old_logp"].astype(np.float64) if old else lp
    r = np.exp(lp - o)
    A = x["advantages"].astype(np.float64)[:, None]
    per = -np.minimum(r * A, np.clip(r, 1 - cfg.epsilon, 1 + cfg.eps_high) * A)
    return float((per * weight * keep * m).sum() / m.sum())


@pytest.mark.parametrize("mode,hi,lo", RS_CASES)
@pytest.mark.parametrize("old", [True, False])
@pytest.mark.parametrize("correction", [False, True])
def test_rollout_rs_in_the_loss(mode, hi, lo, old, correction):
    """The loss with rollout_rs is the loss whose dropped tokens weigh 0 (the denominator
    unchanged), with or without TRL's token_truncate weight; dropped tokens get no gradient;
    its metrics are the generation batch's fractions."""
    x = make_inputs(7, 8, noise=0.2)
    cfg = L.LossConfig(rollout_rs=mode, rollout_rs_threshold=hi, rollout_rs_threshold_lower=lo,
                       vllm_importance_sampling_correction=correction,
                       vllm_importance_sampling_mode="token_truncate",
                       vllm_importance_sampling_clip_min=0.8, vllm_importance_sampling_clip_max=1.2)
    m = np.asarray(L.loss_mask(x["completion_mask"], x["truncated"], cfg))
    o = x["old_logp"] if old else x["logp"]
    keep = np_rs_keep(o, x["sampler_logp"], m, mode, 1.0 / hi if lo is None else lo, hi)
    weight = np.clip(np.exp(o.astype(np.float64) - x["sampler_logp"]), 0.8, 1.2) if correction \
        else 1.0
    assert 0 < ((1 - keep) * m).sum() < m.sum()  # some tokens dropped, some kept
    loss, g_lp, _, sums = jax_step(x, cfg, 1, 8, old, True, None)
    assert loss == pytest.approx(np_dapo_loss(x, keep, weight, cfg, old), rel=1e-5, abs=1e-7)
    assert (g_lp[(keep == 0) & (m > 0)] == 0).all() and (g_lp[(keep == 1) & (m > 0)] != 0).any()
    metrics = L.per_generation_metrics(
        jax.device_get(L.step_metrics(sums)[L.GENERATION_SUMS]), 1)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"][0] == pytest.approx(
        ((1 - keep) * m).sum() / m.sum())


# ------------------------------------------------- a real round: sampler vs trainer log-probs

def tiny_round(dtype, spg, gas, loss_kw):
    """A GRPORound of a tiny random Decoder sampled by the real JaxRollout."""
    from grpo_jax.rollout.native.rollout import JaxRollout
    from grpo_jax.rollout.native.sampling import SamplingParams
    model_cfg = MODEL.replace(dtype=dtype)
    cfg = run_cfg(**loss_kw)
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, num_generations=4))
    plan = BatchPlan(data_parallel_size=1, micro_batch_size=4, gradient_accumulation_steps=gas,
                     steps_per_generation=spg, generation_batch_size=4 * spg,
                     num_generations=4, num_iterations=1, pad_to_multiple_of=None)
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(1, 1, 1), jax.devices()[:1])
    from grpo_jax.grpo.optimizer import OptimizerConfig
    policy = Policy(Decoder(model_cfg, rngs=nnx.Rngs(0)), step_config(cfg, plan, model_cfg),
                    OptimizerConfig(learning_rate=1e-3), 10, mesh)
    rollout = JaxRollout(model_cfg, SamplingParams(max_completion_length=6, temperature=1.0),
                         pad_id=0, mesh=mesh)

    def score(records, r):  # any reward that differs within a group
        return Scores(r.completion_ids[:, :1].astype(np.float32) % 3)
    rnd = GRPORound(policy, rollout, plan, score, ["r"], cfg.grpo)
    return rnd, RunState(policy.init_state)


def round_metrics(rnd, at, k=0):
    records = [{"prompt_ids": [3, 4, 5]}, {"prompt_ids": [7, 8]}][:rnd.plan.prompts_per_generation]
    at, result = rnd(at, Draw(records, DataPosition(0, k + 1)), jax.random.key(k))
    metrics = dict(result.metrics)
    for logged in result.step_metrics:
        metrics.update({n: v[0] for n, v in logged.append.items()})
    return at, metrics


SAMPLING = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
            "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
            "sampling/importance_sampling_ratio/max")


RS = dict(native_importance_sampling_correction=True, rollout_rs="token_k1",
          rollout_rs_threshold=1.5)


# Measured (tiny random model, 2 rounds): fp32 mean 5e-8, max 2.4e-7; bf16 mean 1.3e-4 to
# 1.6e-4, max 3.5e-4 to 5.3e-4.
@pytest.mark.slow
@pytest.mark.parametrize("dtype,bound,spg,loss_kw", [
    (jnp.float32, 1e-5, 1, {}), (jnp.float32, 1e-5, 2, RS),
    (jnp.bfloat16, 2e-3, 1, RS), (jnp.bfloat16, 2e-3, 2, {})],
    ids=["fp32-step", "fp32-old-rs", "bf16-step-rs", "bf16-old"])
def test_native_round_logs_the_mismatch(dtype, bound, spg, loss_kw):
    """Every round of the native path logs TRL's sampling/* metrics: the JAX sampler's
    log-probs against the trainer's under the weights that sampled, taken in the step (spg 1:
    no old log-probs) or at generation (spg 2, gas 1: old log-probs). Within the numerics'
    bound; with native_importance_sampling_correction and rollout_rs the correction applies and
    its rejection fractions are logged (none dropped at these bounds)."""
    rnd, at = tiny_round(dtype, spg, 1, loss_kw)
    assert rnd.plan.needs_old_logps == (spg > 1)
    assert rnd.policy.cfg.loss.vllm_importance_sampling_correction == bool(loss_kw)
    for k in range(2):
        at, metrics = round_metrics(rnd, at, k)
        assert set(SAMPLING) <= set(metrics), sorted(metrics)
        diff = metrics["sampling/sampling_logp_difference/mean"]
        assert 0 <= diff < bound, (dtype, diff)
        assert metrics["sampling/sampling_logp_difference/max"] < 10 * bound
        assert abs(metrics["sampling/importance_sampling_ratio/mean"] - 1) < 10 * bound
        has_rs = "rollout_corr/rollout_rs_masked_fraction" in metrics
        assert has_rs == bool(loss_kw)
        if has_rs:
            assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
