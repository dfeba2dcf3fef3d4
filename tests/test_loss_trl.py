"""grpo-jax's loss against TRL 1.16's own GRPOTrainer._compute_loss.

TRL's trainer is built without its __init__ (object.__new__) and given the attributes that
_compute_loss reads; its _get_per_token_logps_and_entropies is replaced by one that returns given
float64 log-probs and entropies (leaf tensors that require grad). Each case runs one optimizer
step of k micro-batches through TRL (the sum of _compute_loss's values, which TRL has already
scaled for accumulation, with the gradients accumulated in the leaves) and through
grpo_jax.grpo.train_step.accumulate in float32 with the same log-probs and entropies as the
parameters. Compared: the loss, its gradient w.r.t. every log-prob and entropy, and every metric
both log, micro-batch by micro-batch (TRL appends one value per micro-batch to its buffer;
loss.step_metrics gives the same list). The contract is 1e-5, relative to max(1, |TRL's value|)
(gradients: to max(1, max |TRL's gradient|)). Measured over all cases (relative to that scale):
loss 1.4e-7, d/d logp 2e-8, d/d entropy 2e-10, metrics <= 1.1e-7 (clip fractions exactly equal).

The vLLM importance-sampling ratio is an input of _compute_loss that TRL computes in
_generate_and_score_completions (inline, not a function we can call): `trl_is_ratio` re-derives it
from those lines.
"""

import dataclasses

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
from trl import GRPOConfig  # noqa: E402
from trl_oracle import (jax_step, make_inputs, run_trl, trl_sampling_metrics,  # noqa: E402
                        trl_trainer)

from grpo_jax.grpo import loss as L  # noqa: E402
from grpo_jax.grpo.train_step import finish_entropy_control, init_train_state  # noqa: E402

TOL = 1e-5


def close(name, got, want, worst):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert (np.isnan(got) == np.isnan(want)).all(), (name, got, want)  # TRL's nanmin of nothing
    got, want = got[~np.isnan(want)], want[~np.isnan(want)]
    if not want.size:
        return
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    worst[name] = max(worst.get(name, 0.0), err / scale)
    assert err <= TOL * scale, f"{name}: |grpo-jax - TRL| = {err:.3g} (scale {scale:.3g})"


IS = dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_clip_min=0.6,
          vllm_importance_sampling_clip_max=1.8)
KL = dict(beta=0.04)
# (LossConfig settings, options): k micro-batches; old: old_logp given (else on-policy);
# sampler: sampler log-probs given (TRL: vLLM); spg: steps_per_generation (> k: the step is a
# part of the generation batch, whose tokens are TRL's num_items_in_batch).
CASES = [
    (dict(loss_type="grpo"), {}), (dict(loss_type="bnpo"), {}), (dict(loss_type="dr_grpo"), {}),
    (dict(loss_type="dapo"), {}), (dict(loss_type="cispo", epsilon_high=1.1), {}),
    (dict(loss_type="sapo"), {}),
    (dict(loss_type="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=0.5, **KL), {}),
    (dict(loss_type="luspo", importance_sampling_level="sequence"), {}),
    (dict(loss_type="luspo"), dict(k=1)),
    (dict(loss_type="vespo"), {}),
    (dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
          vespo_lambda_neg=5.0), dict(k=1)),
    (dict(loss_type="vespo", **IS, vllm_importance_sampling_mode="token_truncate"),
     dict(sampler=True)),
    (dict(loss_type="vespo", **IS, vllm_importance_sampling_mode="token_mask"),
     dict(sampler=True, old=False)),
    # The KL term, with and without the importance ratio, token and sequence level.
    (dict(**KL), {}), (dict(**KL, use_bias_correction_kl=False), {}),
    (dict(**KL, loss_type="grpo", importance_sampling_level="sequence", epsilon=0.1), {}),
    (dict(**KL, loss_type="grpo", importance_sampling_level="sequence",
          use_bias_correction_kl=False), {}),
    (dict(**KL, loss_type="cispo", epsilon_high=1.1), dict(k=1)),
    (dict(**KL), dict(old=False)),  # on-policy: the ratio is 1 but has a gradient
    (dict(**KL, delta=1.15, epsilon=0.1), {}),
    (dict(epsilon_high=0.28), dict(k=1)),
    (dict(mask_truncated_completions=True, loss_type="grpo", **KL), {}),
    # The off-policy sequence mask: against the sampler's log-probs, or the old ones.
    (dict(off_policy_mask_threshold=0.02), dict(sampler=True)),
    (dict(off_policy_mask_threshold=0.02, loss_type="grpo", **KL), {}),
    (dict(off_policy_mask_threshold=0.0), dict(old=False)),
    # top_entropy_quantile: its threshold is per micro-batch, in TRL too.
    (dict(top_entropy_quantile=0.3), {}), (dict(top_entropy_quantile=0.0), dict(k=1)),
    (dict(top_entropy_quantile=0.5, mask_truncated_completions=True, loss_type="grpo"), {}),
    # The sampler importance-sampling correction, each mode.
    (dict(**IS, vllm_importance_sampling_mode="token_truncate"), dict(sampler=True)),
    (dict(**IS, vllm_importance_sampling_mode="token_mask"), dict(sampler=True)),
    (dict(**IS, vllm_importance_sampling_mode="sequence_truncate", loss_type="dr_grpo"),
     dict(sampler=True)),
    (dict(**IS, vllm_importance_sampling_mode="sequence_mask", **KL), dict(sampler=True)),
    (dict(vllm_importance_sampling_correction=True), dict(sampler=True, old=False)),  # TRL's
    (dict(vllm_importance_sampling_correction=False), dict(sampler=True)),  # metrics only
    # The entropy bonus: a mean per micro-batch, averaged over the k micro-batches.
    (dict(entropy_coef=0.01), {}), (dict(entropy_coef=0.05, loss_type="grpo", **KL), dict(k=4)),
    (dict(entropy_coef=0.02, top_entropy_quantile=0.4), dict(k=1)),
    (dict(entropy_coef=-0.03, loss_type="bnpo", mask_truncated_completions=True), {}),
    # num_items_in_batch over a generation batch of several steps.
    (dict(loss_type="dapo", **KL), dict(spg=6)), (dict(loss_type="cispo"), dict(spg=4)),
    (dict(loss_type="vespo"), dict(spg=8, k=4)),
    (dict(loss_type="dapo", entropy_coef=0.01), dict(spg=4, old=False)),
    # The window that ends an epoch with fewer micro-batches than gradient_accumulation_steps:
    # transformers' current_gradient_accumulation_steps is its own count (here 1 of a 3-step
    # generation batch).
    (dict(loss_type="dapo", entropy_coef=0.01), dict(spg=3, k=1)),
    (dict(loss_type="grpo", entropy_coef=0.02), dict(spg=3, k=1)),
]


def case_id(case):
    kw, opt = case
    return ",".join([f"{k}={v}" for k, v in {**kw, **opt}.items() if "clip_m" not in k
                     and k != "vllm_importance_sampling_correction"]) or "default"


WORST = {}


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_loss_and_gradients_match_trl(case):
    kw, opt = case
    cfg = L.LossConfig(**{"vllm_importance_sampling_correction": False, **kw})
    k, old, sampler, spg = opt.get("k", 2), opt.get("old", True), opt.get("sampler", False), \
        opt.get("spg", opt.get("k", 2))
    rows = 8
    x = make_inputs(len(CASES) + CASES.index(case), rows * spg // k)
    gen_mask = L.loss_mask(x["completion_mask"], x["truncated"], cfg)
    num_items = float(np.asarray(gen_mask).sum())  # TRL: the generation batch's loss tokens
    items = L.num_items_per_row(x["completion_mask"], x["truncated"], cfg) if spg != k else None
    t = trl_trainer(cfg, k, spg, use_vllm=sampler)
    want, want_glp, want_gent = run_trl(t, x, cfg, k, rows, old, sampler, num_items)
    got, glp, gent, sums = jax_step(x, cfg, k, rows, old, sampler, items)
    close("loss", got, want, WORST)
    close("grad logp", glp, want_glp, WORST)
    close("grad entropy", gent, want_gent, WORST)
    assert np.abs(want_glp).max() > 1e-3  # the gradient is there to compare
    if cfg.entropy_bonus:
        assert np.abs(want_gent).max() > 1e-4
    # TRL's buffer gets one value per micro-batch; so does step_metrics' list of each.
    metrics = L.step_metrics(sums)
    logged = {n: v for n, v in t._metrics["train"].items() if n != "entropy_coef"}
    assert logged and set(logged) <= set(metrics), set(logged) - set(metrics)
    assert ("policy_loss" in logged) == cfg.entropy_bonus
    for n, v in logged.items():
        assert len(v) == k and np.shape(metrics[n]) == (k,), n
        close(f"metric {n}", metrics[n], v, WORST)


MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("old", [True, False], ids=["old", "on-policy"])
def test_native_path_corrections_match_trl(mode, old):
    """The native path with native_importance_sampling_correction: the step config it builds
    (policy.step_config, backend jax) keeps TRL's correction, and a step of 2 micro-batches
    (one generation batch) gives TRL's loss, gradients and loss metrics with vLLM, each mode;
    its sampling/* metrics over the generation batch, from the step (no old log-probs) or from
    old log-probs (GRPORound.sampling_metrics' sums), are TRL's lines'. On-policy: TRL (vLLM)
    computes the old log-probs at generation, under the weights of the step; here the step's
    own log-probs (the same weights)."""
    from grpo_jax.config import TrainConfig
    from grpo_jax.models import ModelConfig
    from grpo_jax.policy import step_config
    base = TrainConfig()
    run = dataclasses.replace(base, loss=dataclasses.replace(
        base.loss, native_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=0.6, vllm_importance_sampling_clip_max=1.8))
    assert run.rollout.backend == "jax"
    model = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24,
                        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
    cfg = step_config(run, run.batch_plan(), model).loss
    assert cfg.vllm_importance_sampling_correction and cfg.vllm_importance_sampling_mode == mode
    k, rows, worst = 2, 8, {}
    x = make_inputs(500 + MODES.index(mode), rows)
    m = np.asarray(L.loss_mask(x["completion_mask"], x["truncated"], cfg))
    t = trl_trainer(cfg, k, k, use_vllm=True)
    want, want_glp, want_gent = run_trl(t, x, cfg, k, rows, old, True, float(m.sum()))
    got, glp, gent, sums = jax_step(x, cfg, k, rows, old, True, None)
    close("loss", got, want, worst)
    close("grad logp", glp, want_glp, worst)
    close("grad entropy", gent, want_gent, worst)
    metrics = L.step_metrics(sums)
    logged = t._metrics["train"]
    assert logged and set(logged) <= set(metrics), set(logged) - set(metrics)
    for n, v in logged.items():
        close(f"metric {n}", metrics[n], v, worst)
    # The generation batch's sampling/* metrics, as TRL's _generate_and_score_completions.
    old_lp = x["old_logp"] if old else x["logp"]
    want_s = trl_sampling_metrics(old_lp, x["sampler_logp"], m, cfg)
    in_step = L.per_generation_metrics(jax.device_get(metrics[L.GENERATION_SUMS]), k)
    w = L.sampler_is_weight(old_lp, x["sampler_logp"], m, cfg)
    at_generation = L.per_generation_metrics(jax.tree.map(
        lambda v: np.asarray(v)[None], L.sampling_metric_sums(old_lp, x["sampler_logp"], w, m)), 1)
    assert set(in_step) == set(at_generation) == set(want_s)
    for n, v in want_s.items():
        close(f"step {n}", in_step[n], [v], worst)
        close(f"generation {n}", at_generation[n], [v], worst)


def test_adaptive_entropy_matches_trl():
    """Three steps of 2 micro-batches with use_adaptive_entropy: TRL's coefficient (gated by the
    previous step's entropy, moved after each step) vs init_train_state / applied_entropy_coef /
    finish_entropy_control, and each step's loss and gradients."""
    cfg = L.LossConfig(vllm_importance_sampling_correction=False, use_adaptive_entropy=True,
                       entropy_coef=0.05, entropy_coef_delta=0.02, entropy_coef_min=0.02,
                       entropy_coef_max=0.08, entropy_target=1.0, top_entropy_quantile=0.6)
    k, rows = 2, 8
    t = trl_trainer(cfg, k, k, use_vllm=False)
    state = init_train_state(None, None, cfg)
    coefs, worst = [], {}
    # Entropies around 1.5 (above the target: coefficient down), then 0.5 (below: up).
    for step, scale in enumerate((3.0, 1.0, 1.0, 3.0)):
        x = make_inputs(100 + step, rows, entropy_scale=scale)
        num_items = float(np.asarray(L.loss_mask(x["completion_mask"], x["truncated"],
                                                 cfg)).sum())
        want, want_glp, want_gent = run_trl(t, x, cfg, k, rows, True, False, num_items)
        coef = L.applied_entropy_coef(state.entropy_coef, state.last_entropy, cfg)
        got, glp, gent, sums = jax_step(x, cfg, k, rows, True, False, None, coef)
        state, metrics = finish_entropy_control(state, L.step_metrics(sums), cfg)
        close("loss", got, want, worst)
        close("grad logp", glp, want_glp, worst)
        close("grad entropy", gent, want_gent, worst)
        close("entropy_coef", float(state.entropy_coef), t.entropy_coef, worst)
        close("metric entropy_coef", float(metrics["entropy_coef"]),
              t._metrics["train"]["entropy_coef"][-1], worst)
        close("last entropy", float(state.last_entropy), t._last_world_entropy, worst)
        assert L.ADAPTIVE_ENTROPY not in metrics
        coefs.append(round(t.entropy_coef, 6))
    # The coefficient moved both ways; the gate was closed in the first two steps (no entropy
    # measured yet, then entropy above the target) and open in the last two.
    assert coefs == [0.03, 0.05, 0.07, 0.05], coefs


# LossConfig's settings that TRL lacks (docs/configs.md): the native path's opt-in to TRL's
# correction, and verl's rollout rejection sampling (verl's names).
NOT_TRLS = {"native_importance_sampling_correction", "rollout_rs", "rollout_rs_threshold",
            "rollout_rs_threshold_lower"}


def test_defaults_match_trl():
    """LossConfig's fields are GRPOConfig's, with its defaults; its loss types are TRL's."""
    trl_defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for f in dataclasses.fields(L.LossConfig):
        if f.name in NOT_TRLS:
            assert f.name not in trl_defaults, f.name
            continue
        assert f.name in trl_defaults, f.name
        assert f.default == trl_defaults[f.name], f.name
    help_text = next(f for f in dataclasses.fields(GRPOConfig)
                     if f.name == "loss_type").metadata["help"]
    for name in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"):
        assert f"'{name}'" in help_text and name in L.LossType.__args__, name


def test_new_settings_are_validated():
    bad = [(dict(sapo_temperature_neg=0.0), "sapo_temperature"),
           (dict(vespo_lambda_pos=0.0), "vespo_lambda"), (dict(vespo_k_neg=-1.0), "vespo_k"),
           (dict(entropy_coef_min=0.5, entropy_coef_max=0.1), "entropy_coef_min"),
           (dict(entropy_coef_delta=-0.1), "entropy_coef_delta"),
           (dict(off_policy_mask_threshold=-0.5), "off_policy_mask_threshold")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            L.LossConfig(**kw)
    x = make_inputs(0, 4)
    cfg = L.LossConfig(loss_type="vespo", vllm_importance_sampling_mode="sequence_mask")
    with pytest.raises(ValueError, match="token-level"):  # TRL raises this too (with vLLM)
        jax_step(x, cfg, 1, 4, True, True, None)
