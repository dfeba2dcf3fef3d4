"""The tiny training run most end-to-end tests start from: its settings (`config`), reward and
command line (`run_cli`, `cli_args`), and what a run's partial rollouts returned (`advances`)
and logged (`history`), a run directory as a run stopped after a step left it (`stopped_at`),
and that a resumed run ended as the whole one (`assert_resumed_like_whole`).
The model and prompts it trains on are conftest.py's `tiny_dir` fixture."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from grpo_jax import hf
from grpo_jax.checkpoint import load_checkpoint
from grpo_jax.cli import load_config

HERE = Path(__file__).parent
REWARD = f"{HERE / 'reward_fixtures.py'}:even_tokens"
# dynamic_sampling where posts with an even number score 0.5 whatever the completion.
ODD_POSTS = dict(reward_funcs=f"[{HERE / 'reward_fixtures.py'}:even_tokens_odd_posts]",
                 dynamic_sampling=True, save_steps=1, max_steps=3)
# `python -m grpo_jax.train` as `python TRAIN... ARGS`, in an install without torch: torch is no
# dependency of grpo-jax (only the SmolLM2 GGUF conversion, an extra, uses it), but the test
# environment has it, and transformers imports it whenever it can: ~4 of the ~6 CPU-seconds a
# process spends importing, half of a resumed run's whole cost (measured on a warm compilation
# cache: 6.2 CPU-s against 11-12 s; the run's weights and metrics bit-for-bit the same). Hiding
# it from the import system (not `sys.modules["torch"] = None`, which datasets' pickler trips
# on) makes transformers and datasets see what a user's torch-free install has.
TRAIN = ["-c", "\n".join([
    "import runpy, sys",
    "from importlib.machinery import PathFinder",
    "class NoTorch(PathFinder):",
    "    @classmethod",
    "    def find_spec(cls, name, path=None, target=None):",
    "        if name.partition('.')[0] != 'torch':",
    "            return super().find_spec(name, path, target)",
    "sys.meta_path = [NoTorch if f is PathFinder else f for f in sys.meta_path]",
    "runpy.run_module('grpo_jax.train', run_name='__main__', alter_sys=True)"])]


def config(tiny_dir, out, **extra):
    """A TrainConfig of the tiny model on its prompts, with `extra` settings (flat names)."""
    sets = {
        "name_or_path": str(tiny_dir), "dtype": "float32", "dataset_name":
        str(tiny_dir / "prompts.jsonl"), "reward_funcs": f"[{REWARD}]", "num_generations": 4,
        "max_completion_length": 8, "per_device_train_batch_size": 16,
        "learning_rate": 0.02, "lr_scheduler_type": "constant", "beta": 0.0,
        "output_dir": str(out), "logging_steps": 1, "save_steps": 100, "report_to": "[]",
        "max_steps": 14, "seed": 3, "dp": 1, "temperature": 1.0,
    }
    sets.update(extra)
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


# LLVM's expensive passes off in every process the suite starts, as in the suite's own
# (conftest.py: compiles 5-12% faster, results the same).
FAST_COMPILE = "--xla_llvm_disable_expensive_passes=true"


def user_env() -> dict:
    """A training subprocess's environment: one CPU device, as a user's run (not the suite's
    eight host devices)."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILE}


def run_cli(args, **kw):
    """`python -m grpo_jax.train ARGS` as a user runs it: a process of its own on one CPU
    device (without torch: `TRAIN`)."""
    return subprocess.Popen([sys.executable, *TRAIN, *args], env=user_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def cli_args(tiny_dir, out, max_steps=10, save_steps=2, **extra):
    """run_cli's arguments for `config`'s run (written to OUT.yaml beside it)."""
    cfg = config(tiny_dir, out, max_steps=max_steps, save_steps=save_steps, **extra)
    path = Path(out).parent / f"{Path(out).name}.yaml"
    path.write_text(cfg.to_yaml())
    return ["--config", str(path)]


def advances(monkeypatch):
    """(the prompts of each PartialRollouts.advance's finished groups, in order; the prompts
    drawn), filled as the run goes (each advance appends once, in order, also from a split run's
    sampler thread)."""
    from grpo_jax.rollout.native.partial import PartialRollouts
    got, drawn = [], []
    advance = PartialRollouts.advance

    def record(self, params, at, records, *a, **kw):
        drawn.extend(r["prompt"] for r in records)
        done = advance(self, params, at, records, *a, **kw)
        got.append([r["prompt"] for r in done.records])
        return done
    monkeypatch.setattr(PartialRollouts, "advance", record)
    return got, drawn


def stopped_at(full, cut, step: int) -> None:
    """`cut`: the run directory `full` as a run stopped after checkpoint `step` (a signal, a
    crash) left it: full's later checkpoints left out. A resume from it replays full's later
    steps (its metrics after `step` are dropped as a resumed run drops them). Saves the tests a
    run up to `step` of their own: `full` must have saved that step."""
    shutil.copytree(full, cut)
    ckpts = [p for p in (Path(cut) / "checkpoints").iterdir() if p.name.isdigit()]
    assert any(int(p.name) == step for p in ckpts), (step, sorted(p.name for p in ckpts))
    for p in ckpts:
        if int(p.name) > step:
            shutil.rmtree(p)


def history(out):
    """The run's metrics.jsonl records."""
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


def assert_resumed_like_whole(tmp_path, a: list[dict], b: list[dict],
                              names=("full", "cut")) -> None:
    """The resumed run (`names[1]`, "cut") logged what the uninterrupted one (`names[0]`,
    "full") did, timings aside, and ended with bit-exact weights."""
    for ha, hb in zip(a, b):
        for name in set(ha) | set(hb):
            if not name.startswith(("timing/", "step_time", "timeline/")):
                assert ha.get(name) == hb.get(name), (ha["step"], name)
    pa, _, _ = load_checkpoint(tmp_path / names[0])
    pb, _, _ = load_checkpoint(tmp_path / names[1])
    for name, x in hf.params_numpy(pa).items():
        np.testing.assert_array_equal(x, hf.params_numpy(pb)[name], name)
