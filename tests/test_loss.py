"""GRPO loss and metrics vs a float64 numpy re-derivation of TRL's formulas; exact accumulation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.grpo import loss as L
from grpo_jax.grpo.batch import Batch

B, T = 8, 7


def make_inputs(seed=0, b=B):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, b)
    lengths[1] = 0  # an empty completion
    lengths[2] = T
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    logp = (-3.0 * rng.random((b, T))).astype(np.float32)
    f = lambda s: (s * rng.standard_normal((b, T))).astype(np.float32)  # noqa: E731
    x = dict(logp=logp, old_logp=logp + f(0.5), ref_logp=logp + f(0.2),
             advantages=rng.standard_normal(b).astype(np.float32), completion_mask=mask,
             truncated=lengths == T, entropy=(3.0 * rng.random((b, T))).astype(np.float32),
             sampler_logp=logp + f(0.4))
    x["advantages"][3] = 0.0  # a zero-std group's advantage: neither low- nor high-clipped
    return x


def loss_config(**kw):
    """The loss settings, with the sampler correction off unless a case turns it on (TRL's
    default is on; these cases test the loss without it)."""
    return L.LossConfig(**{"vllm_importance_sampling_correction": False, **kw})


def batch(x) -> Batch:
    """The typed batch of the arrays in `x` (missing or None log-probs stay None)."""
    return Batch(prompt_ids=None, prompt_mask=None, completion_ids=None,
                 completion_mask=x["completion_mask"], truncated=x["truncated"],
                 advantages=x["advantages"], old_logp=x.get("old_logp"),
                 ref_logp=x.get("ref_logp"), sampler_logp=x.get("sampler_logp"))


def oracle(x, cfg):
    """TRL's per-micro-batch loss value and logged metrics, re-derived in float64."""
    g = {k: None if v is None else np.asarray(v, np.float64) for k, v in x.items()}
    logp, A = g["logp"], g["advantages"][:, None]
    old = logp if g["old_logp"] is None else g["old_logp"]
    m = g["completion_mask"] * (1.0 - g["truncated"][:, None] * cfg.mask_truncated_completions)
    lo_eps, hi_eps = cfg.epsilon, cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    seq = cfg.importance_sampling_level == "sequence"
    lr = logp - old
    if seq:
        lr = np.array([[(lr[i] * m[i]).sum() / max(m[i].sum(), 1.0)] for i in range(len(m))])
    r = r0 = np.exp(lr)
    if cfg.loss_type == "cispo":
        per = -np.minimum(r, hi_eps) * A * logp
    else:
        r2 = np.clip(r, 1 - lo_eps, 1 + hi_eps)
        r = r if cfg.delta is None else np.minimum(r, cfg.delta)
        per = -np.minimum(r * A, r2 * A)
    if cfg.top_entropy_quantile < 1:
        thr = np.quantile(g["entropy"][m > 0], 1 - cfg.top_entropy_quantile)
        per = per * ((g["entropy"] >= thr) & (m > 0))
    out = {}
    if g["sampler_logp"] is not None:
        d = (old - g["sampler_logp"]) * m
        w = np.exp(d.sum(1, keepdims=True) if "sequence" in cfg.vllm_importance_sampling_mode
                   else d)
        lo, hi = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
        lo, hi = -np.inf if lo is None else lo, np.inf if hi is None else hi
        w = np.clip(w, lo, hi) if "truncate" in cfg.vllm_importance_sampling_mode else np.where(
            (w < lo) | (w > hi), 0.0, w)
        if cfg.vllm_importance_sampling_correction:
            per = per * w
        diff = np.abs(old - g["sampler_logp"])[m > 0]
        flat = w.ravel() if w.shape[1] == 1 else w[m > 0]
        out.update({"sampling/sampling_logp_difference/mean": diff.mean(),
                    "sampling/sampling_logp_difference/max": diff.max(),
                    "sampling/importance_sampling_ratio/min": flat.min(),
                    "sampling/importance_sampling_ratio/mean": flat.mean(),
                    "sampling/importance_sampling_ratio/max": flat.max()})
    if cfg.beta > 0:
        kl = np.exp(g["ref_logp"] - logp) - (g["ref_logp"] - logp) - 1
        if cfg.use_bias_correction_kl:  # times the ratio before delta's cap
            kl = kl * r0
        per = per + cfg.beta * kl
        out["kl"] = (np.broadcast_to(kl, m.shape) * m).sum() / m.sum()
    per = np.broadcast_to(per, m.shape) * m
    value = {"grpo": lambda: np.mean(per.sum(1) / np.maximum(m.sum(1), 1)),
             "bnpo": lambda: per.sum() / max(m.sum(), 1),
             "dr_grpo": lambda: per.sum() / (len(m) * m.shape[1]),
             "dapo": lambda: per.sum() / max(m.sum(), 1),
             "cispo": lambda: per.sum() / max(m.sum(), 1)}[cfg.loss_type]()
    out["entropy"] = (g["entropy"] * m).sum() / m.sum()
    gmean = lambda z: z.mean() if seq else (z * m).sum() / m.sum()  # noqa: E731
    with np.errstate(invalid="ignore"):
        smean = lambda z: z[:, 0] if seq else (z * m).sum(1) / m.sum(1)  # noqa: E731
        if cfg.loss_type == "cispo":
            out["cispo_clip_ratio"] = gmean((r > hi_eps) & (A > 0))
        else:
            low, high = (r < 1 - lo_eps) & (A < 0), (r > 1 + hi_eps) & (A > 0)
            out.update({"clip_ratio/low_mean": gmean(low), "clip_ratio/high_mean": gmean(high),
                        "clip_ratio/region_mean": gmean(low | high),
                        "clip_ratio/low_min": np.nanmin(smean(low)),
                        "clip_ratio/high_max": np.nanmax(smean(high))})
    return value, out


IS = dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_clip_min=0.6,
          vllm_importance_sampling_clip_max=1.8)
CASES = [
    dict(loss_type="grpo"), dict(loss_type="bnpo"), dict(loss_type="dr_grpo"), dict(),
    dict(loss_type="cispo", epsilon_high=1.1), dict(beta=0.04), dict(epsilon_high=0.28),
    dict(delta=1.15, epsilon=0.1),
    dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=0.1),
    dict(importance_sampling_level="sequence", epsilon=0.05, beta=0.1),
    dict(mask_truncated_completions=True, loss_type="grpo"), dict(top_entropy_quantile=0.3),
    dict(top_entropy_quantile=0.0, mask_truncated_completions=True),
    dict(**IS, vllm_importance_sampling_mode="token_truncate"),
    dict(**IS, vllm_importance_sampling_mode="token_mask"),
    dict(**IS, vllm_importance_sampling_mode="sequence_truncate", loss_type="dr_grpo"),
    dict(**IS, vllm_importance_sampling_mode="sequence_mask", beta=0.04),
    dict(vllm_importance_sampling_mode="token_mask"),  # sampler given: metrics only
]


def run(x, cfg, old=True):
    args = {k: (None if v is None else jnp.asarray(v)) for k, v in x.items()}
    if not old:
        args["old_logp"] = None
    num, sums = L.grpo_loss_terms(args["logp"], args["entropy"], batch(args), cfg)
    den = L.loss_denominator(args["completion_mask"], args["truncated"], cfg)
    return num / den, {k: float(v) for k, v in L.finalize_metrics(sums).items()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()
                                                             if "clip_m" not in k) or "default")
def test_matches_numpy(case):
    cfg = loss_config(**case)
    x = make_inputs(1)
    if cfg.top_entropy_quantile == 1.0 and cfg.beta == 0:
        x["ref_logp"] = None  # the reference is optional when beta == 0
    value, metrics = run(x, cfg)
    want, want_metrics = oracle(x, cfg)
    assert abs(float(value) - want) < 1e-5 * max(1.0, abs(want))
    assert metrics.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        assert abs(metrics[k] - v) < 1e-5 * max(1.0, abs(v)), k
    if "clip_ratio/region_mean" in want_metrics and case.get("delta") is None:
        assert 0 < metrics["clip_ratio/region_mean"] < 1  # inputs do exercise clipping


@pytest.mark.parametrize("case", [dict(), dict(importance_sampling_level="sequence", beta=0.1),
                                  dict(delta=1.15, epsilon=0.1, loss_type="grpo"),
                                  dict(**IS, vllm_importance_sampling_mode="token_mask"),
                                  dict(top_entropy_quantile=0.5, loss_type="dr_grpo")])
def test_gradient_matches_finite_differences(case):
    """d loss / d logp vs central differences of the oracle, old_logp held fixed (the on-policy
    case passes old_logp=None, which must act as stop_gradient(logp))."""
    cfg = loss_config(**case)
    for old in (True, False):
        x = make_inputs(2)
        if not old:
            x["old_logp"] = x["logp"].copy()
        grad = jax.grad(lambda lp: run({**x, "logp": lp}, cfg, old)[0])(jnp.asarray(x["logp"]))
        fd = np.zeros((B, T))
        for i in range(B):
            for t in range(T):
                e = np.zeros((B, T))
                e[i, t] = 1e-6
                lp = x["logp"].astype(np.float64)
                fd[i, t] = (oracle({**x, "logp": lp + e}, cfg)[0] -
                            oracle({**x, "logp": lp - e}, cfg)[0]) / 2e-6
        np.testing.assert_allclose(np.asarray(grad), fd, atol=1e-5)  # measured <= 1.3e-8
        # The gradient is not ~0, so the atol above means something: smallest case measured
        # 1.9e-2 (the bound was 1e-2); 5e-3 is still 500x the atol.
        assert np.abs(fd).max() > 5e-3


def test_clip_extremes_skip_empty_completions():
    x = make_inputs(7)
    x["advantages"][:] = -1.0
    x["old_logp"] = x["logp"] + 1.0  # every token's ratio is 1/e: all low-clipped
    _, metrics = run(x, loss_config())
    assert metrics["clip_ratio/low_min"] == 1.0  # the empty completion does not count as 0
    assert metrics["clip_ratio/low_mean"] == 1.0 and metrics["clip_ratio/high_max"] == 0.0


def test_cispo_gradient_flows_through_logp_only():
    cfg = loss_config(loss_type="cispo", epsilon_high=1.1)
    x = make_inputs(3)
    grad = jax.grad(lambda lp: run({**x, "logp": lp}, cfg)[0])(jnp.asarray(x["logp"]))
    r = np.minimum(np.exp(x["logp"] - x["old_logp"]), 1.1)
    m = x["completion_mask"]
    want = -r * x["advantages"][:, None] * m / m.sum()
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-7)


def _policy_loss(W, feats, x, cfg, sl):
    """A linear policy: logp of the targets under log_softmax(feats @ W)."""
    logq = jax.nn.log_softmax(feats[sl] @ W, -1)
    logp = jnp.take_along_axis(logq, jnp.asarray(x["targets"][sl])[..., None], -1)[..., 0]
    get = lambda k: jnp.asarray(x[k][sl])  # noqa: E731
    return L.grpo_loss_terms(logp, get("entropy"), batch(
        {k: get(k) for k in ("ref_logp", "advantages", "completion_mask", "truncated",
                             "sampler_logp")}), cfg)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "cispo"])
def test_gradient_accumulation_is_exact(loss_type):
    n, d, v = 8, 5, 11
    cfg = loss_config(loss_type=loss_type, beta=0.04,
                       epsilon_high=1.5 if loss_type == "cispo" else None,
                       mask_truncated_completions=True,
                       **{**IS, "vllm_importance_sampling_mode": "sequence_truncate"})
    rng = np.random.default_rng(4)
    x = make_inputs(5, b=n)
    x["targets"] = rng.integers(0, v, (n, T))
    feats = jnp.asarray(rng.standard_normal((n, T, d)), jnp.float32)
    W = jnp.asarray(rng.standard_normal((d, v)), jnp.float32)
    vg = jax.value_and_grad(_policy_loss, has_aux=True)

    def accumulate(k):
        size = n // k
        parts = [vg(W, feats, x, cfg, slice(j * size, (j + 1) * size)) for j in range(k)]
        den = sum(L.loss_denominator(jnp.asarray(x["completion_mask"][j * size:(j + 1) * size]),
                                     jnp.asarray(x["truncated"][j * size:(j + 1) * size]), cfg)
                  for j in range(k))
        num = sum(p[0][0] for p in parts)
        grad = functools.reduce(jnp.add, [p[1] for p in parts])
        return num / den, grad / den, L.finalize_metrics([p[0][1] for p in parts])

    (l1, g1, m1), (l4, g4, m4) = accumulate(1), accumulate(4)
    assert abs(float(l1 - l4)) < 1e-5 * max(1.0, abs(float(l1)))
    assert float(jnp.abs(g1 - g4).max()) <= 1e-5 * float(jnp.abs(g1).max())
    assert m1.keys() == m4.keys()
    for k in m1:
        assert abs(float(m1[k]) - float(m4[k])) < 1e-5 * max(1.0, abs(float(m1[k]))), k


def test_merge_identity_and_jit():
    cfg = loss_config(beta=0.04)
    x = make_inputs(6)
    f = jax.jit(lambda a: L.grpo_loss_terms(a["logp"], a["entropy"], batch(a), cfg)[1])
    sums = f({k: jnp.asarray(v) for k, v in x.items()})
    merged = L.merge_metric_sums(L.empty_metric_sums(jax.eval_shape(lambda: sums)), sums)
    a, b = L.finalize_metrics(sums), jax.jit(L.finalize_metrics)(merged)
    assert a.keys() == b.keys() and all(float(a[k]) == float(b[k]) for k in a)


def test_validation_errors():
    bad = [(dict(loss_type="ppo"), "loss_type"), (dict(epsilon=0), "epsilon"),
           (dict(delta=0.9), "delta"), (dict(top_entropy_quantile=1.5), "top_entropy_quantile"),
           (dict(importance_sampling_level="seq"), "importance_sampling_level"),
           (dict(vllm_importance_sampling_mode="truncate"), "vllm_importance_sampling_mode"),
           (dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_clip_max=None,
                 vllm_importance_sampling_mode="token_truncate"), "clip_min or"),
           (dict(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.0),
            "must be <")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            L.LossConfig(**kw)
    x = {k: jnp.asarray(v) for k, v in make_inputs().items()}
    x.update(old_logp=None, ref_logp=None, sampler_logp=None)
    with pytest.raises(ValueError, match="ref_logp"):
        L.grpo_loss_terms(x["logp"], None, batch(x), loss_config(beta=0.1))
    with pytest.raises(ValueError, match="sampler_logp"):
        L.grpo_loss_terms(x["logp"], None, batch(x), L.LossConfig())
    with pytest.raises(ValueError, match="entropy"):
        L.grpo_loss_terms(x["logp"], None, batch(x), loss_config(top_entropy_quantile=0.5))
