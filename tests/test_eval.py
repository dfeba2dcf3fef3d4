"""TRL's evaluation loop: when it runs (transformers' schedule), what it measures (the eval split,
num_generations_eval completions per prompt, the loss of one micro-batch without an update) and
where it goes (metrics.jsonl, TensorBoard, the PNG) - without changing the training it sits in."""

import json
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
from tiny_run import config
from tensorboardX.proto import event_pb2

from grpo_jax import evaluation
from grpo_jax.cli import config_from_dict
from grpo_jax.errors import ConfigError
from grpo_jax.evaluation import EvalArgs, Evaluator
from grpo_jax.train import main, train

SPLITS = dict(dataset_train_split="train[:48]", dataset_test_split="train[48:]")  # 16 held out
EVAL = dict(eval_strategy="steps", eval_steps=2, eval_on_start="true",
            per_device_eval_batch_size=8, num_generations_eval=2)


def records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]


def test_schedule_follows_transformers():
    def due(cfg, total, gas=1, micro=4, logging=3):
        s = evaluation.schedule(cfg, logging, total, gas, micro)
        steps = [t for t in range(1, total + 1) if s.due(t)]
        chain, t = [], 0  # next_due walks the same steps
        while (t := s.next_due(t)) is not None:
            chain.append(t)
        assert chain == steps, (chain, steps)
        return steps
    assert due(EvalArgs(eval_strategy="steps", eval_steps=3), 7) == [3, 6, 7]  # and the end
    assert due(EvalArgs(eval_strategy="steps"), 7) == [3, 6, 7]  # eval_steps: logging_steps
    assert due(EvalArgs(eval_strategy="steps", eval_steps=0.25), 10) == [3, 6, 9, 10]
    assert due(EvalArgs(eval_strategy="steps", eval_steps=2, eval_delay=5), 9) == [6, 8, 9]
    assert due(EvalArgs(eval_strategy="no", eval_on_start=True), 9) == []
    # Epochs of 4 micro-steps, 3 per update: windows of 3 and 1 (transformers' partial last
    # window), so every second step ends an epoch.
    assert due(EvalArgs(eval_strategy="epoch"), 5, gas=3) == [2, 4, 5]
    assert due(EvalArgs(eval_strategy="epoch"), 9, gas=1) == [4, 8, 9]
    assert due(EvalArgs(eval_strategy="epoch", eval_delay=2), 9, gas=1) == [8, 9]


def test_bad_eval_settings_name_the_fix():
    for bad, needle in [({"eval_strategy": "sometimes"}, "is not one of no, steps, epoch"),
                        ({"eval_steps": 2.5}, "whole number of steps"),
                        ({"per_device_eval_batch_size": 0}, "per_device_eval_batch_size"),
                        ({"num_generations_eval": 0}, "num_generations_eval must be >= 1")]:
        with pytest.raises(ConfigError, match=needle):
            config_from_dict(bad)
    cfg = config_from_dict({"per_device_eval_batch_size": 6, "num_generations_eval": 4})
    with pytest.raises(ConfigError, match=r"global eval batch size .*6 x data-parallel 1.* \(4\)"):
        cfg.eval_prompts_per_batch(1)
    assert cfg.eval_prompts_per_batch(2) == 3


def test_eval_batches_cover_the_split_and_fill_the_last():
    class Split:  # a PromptDataset's interface: its order and records
        def __len__(self):
            return 5

        def order(self, epoch):
            return np.array([4, 0, 3, 1, 2])

        def record(self, i):
            return {"i": i}
    ev = Evaluator(None, Split(), None, num_generations=2, prompts_per_batch=2, rows_multiple=4)
    got = [[r["i"] for r in b] for b in ev.batches()]
    # The short last batch (1 prompt, 2 rows) is filled from the start up to 4 rows.
    assert got == [[4, 0], [3, 1], [2, 4]]
    ev.rows_multiple = 2
    assert [[r["i"] for r in b] for b in ev.batches()][-1] == [2]
    # transformers' eval_loss: each batch's loss eval_batch_size (4) times, the last one's cut
    # to len(dataset) % 4 = 1 by accelerate's gather_for_metrics.
    assert ev.loss_weights(3) == [4, 4, 1]
    ev.prompts_per_batch = 5
    assert ev.loss_weights(1) == [5]  # 5 prompts % 10 completions: accelerate's remainder


def test_eval_split_is_shuffled_with_the_seed_whatever_shuffle_dataset(tmp_path):
    """TRL's eval sampler (RepeatSampler with shuffle on) shuffles the eval split with the
    seed whatever shuffle_dataset says; the train split keeps its order when it is off."""
    from hf_oracle import char_tokenizer

    from grpo_jax.config import DataArgs
    from grpo_jax.data import load_prompts
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(20)))
    args = DataArgs(dataset_name=str(path), dataset_train_split="train[:10]",
                    dataset_test_split="train[10:]", shuffle_dataset=False, seed=5)
    tok = char_tokenizer()
    evals = load_prompts(args, tok, test=True)
    assert sorted(evals.order(0)) == list(range(10)) and list(evals.order(0)) != list(range(10))
    assert list(load_prompts(args, tok).order(0)) == list(range(10))


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory):  # noqa: F811
    """The same 5 steps with evaluation (on start, every 2 steps, at the end) and without."""
    root = tmp_path_factory.mktemp("eval")
    devices = jax.devices()[:1]
    train(config(tiny_dir, root / "plain", max_steps=5, **SPLITS), devices=devices)
    train(config(tiny_dir, root / "eval", max_steps=5, report_to="[tensorboard]", **SPLITS,
                 **EVAL), devices=devices)
    return root


@pytest.mark.slow
def test_eval_runs_on_schedule_with_trl_names(runs):
    history = records(runs / "eval")
    evals = [h for h in history if "eval_reward" in h]
    assert [h["step"] for h in evals] == [0, 2, 4, 5]
    for h in evals:
        for key in ("eval_loss", "eval_reward_std", "eval_frac_reward_zero_std",
                    "eval_rewards/even_tokens/mean", "eval_rewards/even_tokens/std",
                    "eval_completions/mean_length", "eval_completions/clipped_ratio",
                    "eval_entropy", "eval_num_tokens", "eval_runtime",
                    "eval_samples_per_second", "eval_steps_per_second", "epoch"):
            assert key in h and np.isfinite(h[key]), (key, h)
        assert not any(k.startswith("eval_timing") for k in h)
        # 16 prompts x 2 completions in batches of 8: 4 batches.
        assert h["eval_samples_per_second"] / h["eval_steps_per_second"] == pytest.approx(8)
        assert 0.0 <= h["eval_rewards/even_tokens/mean"] <= 1.0
    assert evals[0]["eval_num_tokens"] == 0 and evals[-1]["eval_num_tokens"] > 0
    # The tiny model learns (see test_train): the held-out prompts' reward rises too.
    assert evals[-1]["eval_reward"] > evals[0]["eval_reward"], evals
    assert (runs / "eval" / "reward_kl.png").stat().st_size > 1000


def test_eval_leaves_training_as_it_was(runs):
    train_of = lambda out: [h for h in records(out) if "reward" in h]  # noqa: E731
    plain, with_eval = train_of(runs / "plain"), train_of(runs / "eval")
    assert [h["step"] for h in plain] == [h["step"] for h in with_eval] == [1, 2, 3, 4, 5]
    for a, b in zip(plain, with_eval):
        for k in ("reward", "loss", "grad_norm", "entropy", "num_tokens"):
            assert a[k] == b[k], (a["step"], k, a[k], b[k])


def _tensorboard_tags(directory: Path) -> set[str]:
    tags = set()
    for path in directory.glob("events.out.tfevents.*"):
        data = path.read_bytes()
        at = 0
        while at < len(data):  # TFRecord: length, its crc, the event, its crc
            (n,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
            tags.update(v.tag for v in event.summary.value)
            at += 12 + n + 4
    return tags


def test_eval_metrics_reach_tensorboard(runs):
    tags = _tensorboard_tags(runs / "eval" / "tensorboard")
    assert {"eval/reward", "eval/loss", "eval/rewards/even_tokens/mean", "train/reward",
            "train/epoch"} <= tags, sorted(tags)


def test_eval_split_missing_is_one_clear_error(tiny_dir, tmp_path, capsys):  # noqa: F811
    cfg = config(tiny_dir, tmp_path / "run", max_steps=1, eval_strategy="steps", dp=-1)
    path = tmp_path / "run.yaml"
    path.write_text(cfg.to_yaml())
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "a single file holds one split" in err and "dataset_test_split" in err, err
    assert "Traceback" not in err
