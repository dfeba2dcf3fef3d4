"""What grpo-jax logs against what TRL 1.16's GRPOTrainer logs from the same generations and
steps, through TRL's own code: its `_generate` (completion lengths, with a rollout_func and an
env_mask, as tool results), its `_compute_loss` (each micro-batch's loss metrics, appended to its
buffer), the reward lines of `_generate_and_score_completions` (inline there: re-run here with
TRL's own nanstd), and its `log()` (a logging window: each list's mean over the values that are
not NaN, None when none is left; transformers' loss / grad_norm / learning_rate / epoch).
Ours: GRPORound.generate_and_score and the train step's metrics (loss.step_metrics,
trainer.update_logged) into grpo_jax.metrics.MetricWindow, as train.py feeds them."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from round_stubs import StubTrainer, plan
from trl_oracle import T, jax_step, make_inputs, run_trl, trl_trainer

from grpo_jax.config import GRPOArgs
from grpo_jax.grpo import loss as L
from grpo_jax.grpo.train_step import finish_entropy_control, init_train_state
from grpo_jax.metrics import Logged, MetricWindow
from grpo_jax.rollout import base
from grpo_jax.scoring import Scores
from grpo_jax.round import GRPORound, update_logged

torch = pytest.importorskip("torch")
trl_utils = pytest.importorskip("trl.trainer.utils")
from transformers import TrainerState  # noqa: E402

G, EOS, PAD = 4, 2, 0
NAMES = ["a", "b"]


class Tokenizer:  # what _generate reads of TRL's processing class
    pad_token_id = PAD

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, x)) for x in ids]


def completions(seed: int, n: int = 2 * G):
    """n completions of 1..T tokens: a truncated one has no EOS at its end; a few tokens are
    an environment's (env_mask 0: TRL's tool_mask)."""
    rng = np.random.default_rng(seed)
    ids, env = [], []
    for i in range(n):
        length = int(rng.integers(1, T + 1))
        row = rng.integers(3, 20, length).tolist()
        if i % 3:  # terminated
            row[-1] = EOS
        ids.append(row)
        env.append([1] + rng.integers(0, 2, length - 1).tolist() if i % 4 == 1 else [1] * length)
    return ids, env


class Rollout(base.Rollout):
    """Hands grpo-jax the same completions as TRL's rollout_func."""

    weight_mode = base.WeightMode.PUSH

    def __init__(self, ids, env):
        self.ids, self.env = ids, env

    def generate(self, weights, prompts, g, key, records=None):
        n = len(self.ids)
        c_ids, c_mask, tool = (np.zeros((n, T), np.int32) for _ in range(3))
        for i, (row, m) in enumerate(zip(self.ids, self.env)):
            c_ids[i, :len(row)], c_mask[i, :len(row)], tool[i, :len(row)] = row, 1, m
        truncated = np.array([row[-1] != EOS for row in self.ids])
        ones = np.ones((n, 2), np.int32)
        return base.RolloutBatch(ones, ones, c_ids, c_mask, truncated,
                                 np.zeros((n, T), np.float32),
                                 tool_mask=tool)


def trl_for_log(cfg: L.LossConfig, k: int):
    """A GRPOTrainer with what _compute_loss, _generate and log() read."""
    t = trl_trainer(cfg, k, k, use_vllm=False)
    t.accelerator.device = "cpu"
    t.accelerator.is_main_process = True
    t.rollout_func, t.tools, t.environment_factories = None, None, None
    t.processing_class = t._tokenizer = Tokenizer()
    t.eos_token_ids = [EOS]
    t.state = TrainerState()
    t.args.include_num_input_tokens_seen = "no"
    t.callback_handler = SimpleNamespace(on_log=lambda args, state, control, logs: control)
    t.control, t.log_completions = None, False
    return t


def trl_generation(t, ids, env, per_func):
    """TRL's metrics of one generation: _generate's (run) and the reward lines (re-run)."""
    t.rollout_func = lambda prompts, trainer: {
        "prompt_ids": [[1, 1]] * len(ids), "completion_ids": ids,
        "logprobs": [[0.0] * len(r) for r in ids], "env_mask": env}
    t._generate(["p"] * len(ids))
    x = torch.tensor(per_func, dtype=torch.float32)
    m = t._metrics["train"]
    for i, name in enumerate(NAMES):  # _generate_and_score_completions' lines
        m[f"rewards/{name}/mean"].append(torch.nanmean(x[:, i]).item())
        m[f"rewards/{name}/std"].append(trl_utils.nanstd(x[:, i]).item())
    rewards = x.nansum(dim=1)
    rewards[torch.isnan(x).all(dim=1)] = torch.nan
    m["reward"].append(torch.nanmean(rewards).item())
    m["reward_std"].append(trl_utils.nanstd(rewards).item())


def our_generation(window, ids, env, per_func, tokens_seen: int) -> int:
    """The generation's metrics into the window as train.py adds them; the tokens seen after
    it (train.py's count: prompt + model tokens)."""
    rnd = GRPORound(StubTrainer(), Rollout(ids, env), plan(2, 2), None, NAMES, GRPOArgs())
    gen = rnd.generate_and_score(0, [{"prompt_ids": [1, 1]}] * (len(ids) // G),
                                 jax.random.key(0), num_generations=G,
                                 score=lambda records, r: Scores(per_func))
    tokens_seen += int(gen.batch.prompt_mask.sum() + gen.batch.model_mask().sum())
    window.add(Logged(gen.metrics, put={"num_tokens": tokens_seen}))
    return tokens_seen


def steps(t, window, cfg, k, seeds, empty_micro_batch=False):
    """Optimizer steps of k micro-batches through TRL's _compute_loss and our step's metrics;
    the transformers logs of the window (the steps' mean loss, the last grad_norm and rate)."""
    losses = []
    for s, seed in enumerate(seeds):
        x = make_inputs(seed, 8)
        if empty_micro_batch and s == 0:  # every completion of micro-batch 0 empty
            x["completion_mask"][:8 // k] = 0
        items = float(np.asarray(L.loss_mask(x["completion_mask"], x["truncated"], cfg)).sum())
        losses.append(run_trl(t, x, cfg, k, 8, True, False, items)[0])
        loss, _, _, sums = jax_step(x, cfg, k, 8, True, False, None)
        _, metrics = finish_entropy_control(init_train_state(None, None, cfg),
                                            L.step_metrics(sums), cfg)
        host = jax.device_get({**metrics, "loss": loss, "grad_norm": 1.0 + s,
                               "learning_rate": 1e-3 * (s + 1), "skipped_updates": 0})
        window.step(update_logged(host, None))
    return {"loss": float(np.mean(losses)), "grad_norm": float(len(seeds)),
            "learning_rate": 1e-3 * len(seeds)}


def trl_log(t, logs, epoch):
    t.state.epoch = epoch
    t.log(dict(logs))
    return {k: v for k, v in t.state.log_history[-1].items() if k != "step"}


def same_record(got: dict, want: dict):
    """Every value TRL logs, ours alike (None where TRL's is None); ours adds only its own."""
    assert set(want) <= set(got), set(want) - set(got)
    for k, v in want.items():
        if v is None:
            assert got[k] is None, (k, got[k])
        else:
            assert got[k] is not None and abs(got[k] - v) <= 1e-5 * max(1.0, abs(v)), (k, got[k], v)
    extra = {k for k in set(got) - set(want) if not k.startswith("timing/")}
    assert extra <= {"skipped_updates", "frac_reward_zero_std"}, extra


def test_logging_windows_are_trls_log():
    """Window 1: two generations (one whose reward function "b" returned None for all: NaN,
    left out of the mean; one None in "a") and two steps of 2 micro-batches, one micro-batch
    with every completion empty (clip_ratio/low_min: TRL's nanmin of nothing, NaN, left out).
    Window 2: a generation with "b" all None again and one step: "b"'s metrics log None. Window
    3: a step without a generation: no generation metric at all."""
    cfg = L.LossConfig(vllm_importance_sampling_correction=False, beta=0.04, entropy_coef=0.01)
    k = 2
    t, window = trl_for_log(cfg, k), MetricWindow()
    rng = np.random.default_rng(0)
    per_func = rng.standard_normal((3, 2 * G, 2)).astype(np.float32)
    per_func[0, :, 1] = per_func[2, :, 1] = np.nan
    per_func[0, 3, 0] = np.nan
    records, tokens = [], 0
    for window_gens, seeds, empty in (([0, 1], [10, 11], True), ([2], [12], False),
                                      ([], [13], False)):
        for g in window_gens:
            ids, env = completions(g)
            trl_generation(t, ids, env, per_func[g])
            tokens = our_generation(window, ids, env, per_func[g], tokens)
        logs = steps(t, window, cfg, k, seeds, empty)
        if empty:  # TRL's nanmin / nanmax of micro-batch 0's sequences: NaN, then left out
            buffer = t._metrics["train"]
            assert [np.isnan(buffer[n]).sum() for n in ("clip_ratio/low_min",
                                                        "clip_ratio/high_max")] == [1, 1]
        window.add(Logged(put={"epoch": 0.25 * len(records)}))
        want, got = trl_log(t, logs, 0.25 * len(records)), window.flush()
        same_record(got, want)
        records.append(got)
    first, second, third = records
    assert first["rewards/b/mean"] == pytest.approx(np.mean(per_func[1, :, 1]), rel=1e-5)
    assert second["rewards/b/mean"] is None and second["rewards/b/std"] is None
    assert second["rewards/a/mean"] is not None
    assert "reward" not in third and "completions/mean_length" not in third
    assert {"kl", "entropy", "policy_loss", "clip_ratio/low_min", "entropy_coef"} <= set(third)
    # the empty micro-batch's NaN is left out: 3 of the 4 micro-batches' maxima averaged
    assert first["clip_ratio/high_max"] > 0


def test_completion_lengths_are_trls():
    """_generate's completion metrics over model tokens (env_mask 0 not counted), truncated =
    no EOS at the end, terminated-length stats (0 when none terminated)."""
    t = trl_for_log(L.LossConfig(vllm_importance_sampling_correction=False), 1)
    for seed in range(3):
        ids, env = completions(seed)
        if seed == 2:
            ids = [row[:-1] + [5] if row[-1] == EOS else row for row in ids]  # none terminated
        trl_generation(t, ids, env, np.zeros((len(ids), 2), np.float32))
        window = MetricWindow()
        our_generation(window, ids, env, np.zeros((len(ids), 2), np.float32), 0)
        got = window.flush()
        for name, values in t._metrics["train"].items():
            if name.startswith("completions/"):
                assert got[name] == pytest.approx(values[-1], rel=1e-6), (seed, name)
    assert t._metrics["train"]["completions/mean_terminated_length"][-1] == 0.0
