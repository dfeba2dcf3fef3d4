"""When a run checkpoints, logs, stops reading data and resumes (issue 47): save_steps inside a
generation round, save_strategy / logging_strategy as transformers, dynamic sampling ending
with the run's epochs, resume_from_checkpoint from another run, and a resume with other data or
batch settings refused by name. On the tiny model, each run shared by several checks."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from tiny_run import HERE, config

from grpo_jax import hf
from grpo_jax.checkpoint import committed_steps, load_checkpoint
from grpo_jax.errors import NoSignalError
from grpo_jax.train import main, train

ERROR = "grpo_jax.train: error:"
FOUR = dict(per_device_train_batch_size=4, steps_per_generation=4, max_steps=4)  # 4 per round


def _steps(out: Path) -> list[int]:
    return committed_steps(out / "checkpoints")


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _meta(out: Path, step: int) -> dict:
    return json.loads((out / "checkpoints" / str(step) / "meta" / "metadata").read_text())


def _prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"Post number {10 + i}: write something short."
                                                  "\nTL;DR:"}) + "\n" for i in range(n)))
    return path


@pytest.fixture(scope="module")
def mid_round(tiny_dir, tmp_path_factory):  # noqa: F811
    """One round of four updates, save_steps 1, logging_strategy 'no': (output_dir, stderr)."""
    out = tmp_path_factory.mktemp("mid_round") / "run"
    train(config(tiny_dir, out, save_steps=1, logging_strategy="no", **FOUR),
          devices=jax.devices()[:1])
    return out


def test_save_steps_inside_a_round_and_logging_strategy_no(mid_round):
    """transformers checkpoints at steps 1, 2, 3, 4 with save_steps 1 (it has no rounds): so
    does a round of four updates, each checkpoint holding the micro-batches not yet trained
    on. logging_strategy 'no': no record during the run, the run's end logged once."""
    assert _steps(mid_round) == [1, 2, 3, 4]
    assert [_meta(mid_round, s)["buffered_micro_batches"] for s in (1, 2, 3, 4)] == [3, 2, 1, 0]
    assert sorted(p.name for p in (mid_round / "generation_buffer").iterdir()) == [
        "1.npz", "2.npz", "3.npz"]
    assert [h["step"] for h in _records(mid_round)] == [4]


def test_resume_from_another_runs_mid_round_checkpoint_is_exact(tiny_dir, mid_round,  # noqa
                                                                 tmp_path, capsys):
    """resume_from_checkpoint names another run's checkpoint 2 (two micro-batches of its round
    still buffered): this run starts there, writes into its own output_dir, leaves the other
    run's untouched, and ends with the other run's step-4 params."""
    out = tmp_path / "run"
    train(config(tiny_dir, out, save_steps=1, logging_strategy="no",
                 resume_from_checkpoint=mid_round / "checkpoints" / "2", **FOUR),
          devices=jax.devices()[:1])
    assert f"resumed from step 2 in {mid_round / 'checkpoints'}" in capsys.readouterr().err
    assert _steps(out) == [3, 4] and _steps(mid_round) == [1, 2, 3, 4]
    a, _, _ = load_checkpoint(mid_round, 4)
    b, _, step = load_checkpoint(out)
    assert step == 4
    for name, pa in hf.params_numpy(a).items():
        assert np.abs(pa - hf.params_numpy(b)[name]).max() < 1e-6, name


def test_epoch_strategies_resume_with_safe_changes_and_refused_ones(tiny_dir, tmp_path,  # noqa
                                                                     capsys):
    """save_strategy / logging_strategy 'epoch' checkpoint and log at each epoch's end. A resume
    with other run settings says once which (config.yaml's previous settings kept); one with
    another num_generations and a dataset of another size is refused naming both, nothing
    touched."""
    from grpo_jax.errors import TrainError
    prompts = _prompts(tmp_path / "prompts.jsonl", 8)  # 2 generation batches, 2 updates each epoch
    out, one = tmp_path / "run", jax.devices()[:1]

    def cfg(**settings):
        return config(tiny_dir, out, dataset_name=prompts, max_steps=-1, **settings)

    train(cfg(num_train_epochs=2, save_strategy="epoch", logging_strategy="epoch"), devices=one)
    assert _steps(out) == [2, 4] and [h["step"] for h in _records(out)] == [2, 4]
    capsys.readouterr()

    train(cfg(resume=True, num_train_epochs=3, save_strategy="no", logging_strategy="epoch"),
          devices=one)
    err = capsys.readouterr().err
    assert err.count("save_strategy 'no': no periodic checkpoints") == 1
    changed = [line for line in err.splitlines() if "settings changed since checkpoint 4" in line]
    assert len(changed) == 1 and "num_train_epochs: checkpoint 4 2.0, this run 3.0" in changed[0]
    assert "save_strategy: checkpoint 4 'epoch', this run 'no'" in changed[0]
    assert "save_strategy: epoch" in (out / "config.step-4.yaml").read_text()
    assert _steps(out) == [2, 4, 6]  # no periodic one; the run's end is checkpointed

    saved = (out / "config.yaml").read_text()
    _prompts(prompts, 12)  # the dataset's file grew
    with pytest.raises(TrainError) as refused:
        train(cfg(resume=True, num_train_epochs=3, num_generations=8, save_strategy="no",
                  logging_strategy="epoch"), devices=one)
    line = str(refused.value)
    assert "\n" not in line and "num_generations: checkpoint 6 4, this run 8" in line, line
    assert "the dataset's prompts: checkpoint 6 8, this run 12" in line, line
    assert (out / "config.yaml").read_text() == saved and _steps(out) == [2, 4, 6]


def test_final_summary_keeps_significant_digits(tmp_path, capsys, monkeypatch):
    """The CLI's last line, the run's last metrics: a learning rate of 3.3e-7 is not 0.0."""
    from grpo_jax import train as train_lib
    monkeypatch.setattr(train_lib, "train", lambda cfg: {"learning_rate": 3.3e-7, "loss": None,
                                                         "reward": 0.123456789})
    assert main(["--output_dir", str(tmp_path / "run")]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary == {"learning_rate": 3.3e-7, "loss": None, "reward": 0.123457}


GUARD = """
import os, pathlib
def constant_guarded(prompts, completions, **kwargs):
    # The same reward for every completion (no group has signal); the test's bound on a run
    # that would read prompts forever: it fails after 40 generation batches.
    calls = pathlib.Path(os.environ["GRPO_TEST_CALLS"])
    n = int(calls.read_text()) + 1 if calls.exists() else 1
    calls.write_text(str(n))
    if n > 40:
        raise RuntimeError("dynamic sampling read past the run's data")
    return [1.0] * len(completions)
"""


DYNAMIC = dict(max_steps=-1, num_train_epochs=1, dynamic_sampling=True, max_num_gen_batches=0)


def test_dynamic_sampling_ends_with_the_runs_epochs(tiny_dir, tmp_path, capsys):  # noqa: F811
    """12 prompts, 4 a generation batch, num_train_epochs 1 (3 steps), max_num_gen_batches 0
    (endless, verl's semantics): with half the prompts giving no signal the batches fill fewer
    than 3 times, then the run ends with its epoch, as verl's with its data: one line, its end
    checkpointed, the next epoch's prompts never read."""
    out = tmp_path / "run"
    train(config(tiny_dir, out, dataset_name=_prompts(tmp_path / "prompts.jsonl", 12),
                 reward_funcs=f"[{HERE / 'reward_fixtures.py'}:even_tokens_odd_posts]",
                 **DYNAMIC), devices=jax.devices()[:1])
    lines = [line for line in capsys.readouterr().err.splitlines()
             if "dynamic_sampling used up the run's 1 epoch(s) of prompts" in line]
    steps = _steps(out)
    assert len(lines) == 1 and steps and steps[-1] < 3, (lines, steps)
    assert f"at step {steps[-1]} of 3" in lines[0]
    assert _meta(out, steps[-1])["data_position"][0] == 0  # never the next epoch's prompts


def test_dynamic_sampling_without_signal_stops_at_the_data_end(tiny_dir, tmp_path,  # noqa
                                                                monkeypatch):
    """The same run with a constant reward, endless mode: no batch ever fills. It stops with one
    error after the epoch's 3 generation batches (it went on forever: the reward's guard ends it
    after 40), with nothing to checkpoint."""
    (tmp_path / "guard.py").write_text(GUARD)
    monkeypatch.setenv("GRPO_TEST_CALLS", str(tmp_path / "calls"))
    with pytest.raises(NoSignalError, match="without filling one batch"):
        train(config(tiny_dir, tmp_path / "run",
                     dataset_name=_prompts(tmp_path / "prompts.jsonl", 12),
                     reward_funcs=f"[{tmp_path / 'guard.py'}:constant_guarded]", **DYNAMIC),
              devices=jax.devices()[:1])
    assert (tmp_path / "calls").read_text() == "3"  # the epoch's 3 generation batches
    assert not _steps(tmp_path / "run")


def test_resume_checks_the_batch_plan_not_the_per_device_split():
    """The same global batch on twice the devices (per_device_train_batch_size halved) resumes,
    saying what changed; another micro-batch is refused, naming the setting and its effect."""
    from grpo_jax.checkpoint import resume_changes
    saved = {"batch": {"per_device_train_batch_size": 16}, "mesh": {"dp": 1}}
    plan = {"num_prompts": 64, "micro_batch_size": 16, "num_generations": 4}
    refused, changed = resume_changes(3, saved, {"batch": {"per_device_train_batch_size": 8},
                                                 "mesh": {"dp": 2}}, plan, plan)
    assert not refused and changed == ["per_device_train_batch_size: checkpoint 3 16, this run 8",
                                       "dp: checkpoint 3 1, this run 2"]
    refused, _ = resume_changes(3, saved, {"batch": {"per_device_train_batch_size": 8},
                                           "mesh": {"dp": 1}}, plan,
                                {**plan, "micro_batch_size": 8})
    assert refused == ["per_device_train_batch_size: checkpoint 3 16, this run 8",
                       "the batch's micro_batch_size: checkpoint 3 16, this run 8"]
