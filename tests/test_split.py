"""Disaggregated rounds in one process (rollout.sampler_devices,
grpo_jax.rollout.native.disaggregated): partial rollouts decode on a sampler mesh of their own a
round ahead of the trainer; every prompt trains once, each token one version behind the
weights that train it, and a stopped run resumes to the uninterrupted run's result."""


import os
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tiny_run import ODD_POSTS, advances, assert_resumed_like_whole, config, history

from grpo_jax.checkpoint import committed_steps
from grpo_jax.errors import SamplerProcessError
from grpo_jax.train import train

# 2 sampler devices (data parallel) and 2 trainer devices (FSDP): 16 rows, 4 groups a round;
# max_staleness 1: the sampler's round-ahead version is all the staleness allowed.
SPLIT = dict(sampler_devices=2, max_staleness=1, max_num_seqs=8, max_completion_length=12,
             per_device_train_batch_size=8, dp=1, fsdp=-1)
# Evaluation at steps 2 and 4 on 8 held-out prompts x 2 (one eval batch), on the sampler's
# devices once its advance has ended.
EVAL = dict(dataset_train_split="train[:48]", dataset_test_split="train[48:56]",
            eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8,
            num_generations_eval=2)


def untimed(record: dict) -> dict:
    """An evaluation's record without its wall-clock figures."""
    return {k: v for k, v in record.items()
            if not k.startswith(("timing/", "step_time", "timeline/"))
            and not k.endswith(("_runtime", "_per_second"))}


@pytest.mark.slow
def test_split_run_trains_each_prompt_once_one_version_behind_and_resumes(tiny_dir, tmp_path,
                                                                          monkeypatch):
    """4 rounds: the first batch is sampled before round 1 with its own weights (staleness 0),
    every later one a round ahead (every token exactly one version old); each prompt trained
    once, in draw order; stopped at step 2 (the checkpoint holds the batch sampled ahead) and
    resumed: the same prompts in the same order, the same metrics and bit-exact weights.
    Evaluation at steps 2 and 4 (on the sampler's devices) changes none of that."""
    got, drawn = advances(monkeypatch)
    devices = jax.devices()[:4]
    train(config(tiny_dir, tmp_path / "full", max_steps=4, **SPLIT, **EVAL), devices=devices)
    full, full_drawn = list(got), list(drawn)
    # the first batch, then one advance per round: the last is sampled ahead, never trained
    assert len(full) == 5
    trained = [p for group in full[:4] for p in group]
    assert len(trained) == 16 and len(set(trained)) == 16 and set(trained) <= set(drawn)
    # As many group slots as a round's groups (no row may carry over at max_staleness 1): each
    # advance draws 4 prompts and none decodes only to start over in the next.
    assert len(drawn) == 5 * 4
    a = [h for h in history(tmp_path / "full") if "loss" in h]
    assert [h["step"] for h in a] == [1, 2, 3, 4]
    evals = [h for h in history(tmp_path / "full") if "eval_reward" in h]
    assert [h["step"] for h in evals] == [2, 4]
    assert all(np.isfinite(h["eval_reward"]) and h["eval_completions/mean_length"] > 0
               for h in evals)
    assert a[0]["staleness/max"] == 0
    for h in a[1:]:
        assert (h["staleness/mean"], h["staleness/max"], h["staleness/tokens_1"]) == (1, 1, 1)
        assert h["staleness/dropped_groups"] == 0
        assert h["timing/idle_trainer"] >= 0 and h["timing/idle_sampler"] >= 0

    got[:], drawn[:] = [], []
    train(config(tiny_dir, tmp_path / "cut", max_steps=2, **SPLIT, **EVAL), devices=devices)
    assert len((tmp_path / "cut" / "queued" / "2.npz").read_bytes()) > 0
    train(config(tiny_dir, tmp_path / "cut", max_steps=4, resume=True, **SPLIT, **EVAL),
          devices=devices)
    assert got == full and drawn == full_drawn
    b = [h for h in history(tmp_path / "cut") if "loss" in h]
    assert [h["step"] for h in b] == [1, 2, 3, 4]
    again = [h for h in history(tmp_path / "cut") if "eval_reward" in h]
    assert [untimed(h) for h in again] == [untimed(h) for h in evals]
    assert_resumed_like_whole(tmp_path, a, b)


def post(prompt: str) -> int:
    return int(prompt.split()[2].rstrip(":"))


@pytest.mark.slow
def test_split_dynamic_sampling_fills_from_the_samplers_next_advances_and_resumes(
        tiny_dir, tmp_path, monkeypatch):
    """dynamic_sampling with sampler_devices: posts with an even number score alike (no
    signal), so a round's queued batch (4 groups sampled a round ahead) is short and the round
    takes the sampler's next advances until 4 groups with signal are whole, then starts the
    next round's beside the update. Replayed from the advances' groups, each round takes the
    queued advance and as many more as it needs (its num_gen_batches), every prompt drawn is
    generated once, each group kept trains once; stopped at step 2 and resumed: the same
    advances, metrics and weights."""
    got, drawn = advances(monkeypatch)
    devices = jax.devices()[:4]
    settings = {**SPLIT, **ODD_POSTS, "save_steps": 100}
    train(config(tiny_dir, tmp_path / "full", **settings), devices=devices)
    full, full_drawn = list(got), list(drawn)
    a = [h for h in history(tmp_path / "full") if "loss" in h]
    assert [h["step"] for h in a] == [1, 2, 3]
    assert max(h["dynamic_sampling/num_gen_batches"] for h in a) >= 2
    assert len(set(drawn)) == len(drawn)  # each prompt drawn once ...
    returned = [p for group in full for p in group]
    assert len(set(returned)) == len(returned) and set(returned) <= set(drawn)  # ... made once
    assert any(post(p) % 2 == 0 for p in returned)  # returned, filtered out
    # The rounds replayed: each takes the next advance (queued a round ahead), then more until
    # 4 odd posts are kept (the first 4, in order); the advance after them is the next round's.
    left, trained = list(full), []
    for h in a:
        kept, n = [], 0
        while len(kept) < 4:
            kept += [p for p in left.pop(0) if post(p) % 2]
            n += 1
        assert h["dynamic_sampling/num_gen_batches"] == n, h["step"]
        if h["step"] > 1:  # the queued groups a version old, those waited for the round's own
            assert (h["staleness/tokens_0"] > 0) == (n > 1), h["step"]
        trained += kept[:4]
    assert len(left) == 1  # the last round's advance ahead, never trained
    assert len(set(trained)) == len(trained) == 12
    assert a[0]["staleness/max"] == 0

    got[:], drawn[:] = [], []
    train(config(tiny_dir, tmp_path / "cut", **{**settings, "max_steps": 2}), devices=devices)
    train(config(tiny_dir, tmp_path / "cut", resume=True, **settings), devices=devices)
    assert got == full and drawn == full_drawn
    b = [h for h in history(tmp_path / "cut") if "loss" in h]
    assert [h["step"] for h in b] == [1, 2, 3]
    assert_resumed_like_whole(tmp_path, a, b)


def sampler_processes() -> list[int]:
    """The pids of this process's sampler processes (rollout.sampler_process)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"sampler_process" in cmd:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_sampler_process_equals_the_one_process_split_resumes_and_dies_with_one_line(
        tiny_dir, tmp_path):
    """rollout.sampler_process: the same split, the sampler in a process of its own (2 host
    devices there): stopped at step 2 and resumed, it logs what the one-process split logs and
    ends with its weights, bit for bit; its process ends with the run. Then a sampler process
    killed (SIGKILL) after the run's first checkpoint: the run stops within seconds with one
    SamplerProcessError naming the kill, its checkpoints whole, and --resume finishes it."""
    devices = jax.devices()[:4]
    train(config(tiny_dir, tmp_path / "full", max_steps=3, **SPLIT), devices=devices)
    own = dict(SPLIT, sampler_process=True)
    train(config(tiny_dir, tmp_path / "cut", max_steps=2, **own), devices=devices)
    assert not sampler_processes()
    train(config(tiny_dir, tmp_path / "cut", max_steps=3, resume=True, **own), devices=devices)
    a = [h for h in history(tmp_path / "full") if "loss" in h]
    b = [h for h in history(tmp_path / "cut") if "loss" in h]
    assert [h["step"] for h in b] == [1, 2, 3]
    assert_resumed_like_whole(tmp_path, a, b)
    assert b[-1]["timing/idle_trainer"] >= 0 and b[-1]["timing/idle_sampler"] >= 0

    out, killed = tmp_path / "killed", []

    def kill_after_first_checkpoint():
        while not killed:
            if (out / "checkpoints" / "1").exists():
                for pid in sampler_processes():
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)
    watcher = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    with pytest.raises(SamplerProcessError, match=r"sampler process .* killed by SIGKILL.*"
                                                   r"--resume"):
        train(config(tiny_dir, out, max_steps=6, save_steps=1, **own), devices=devices)
    assert killed and time.perf_counter() - t0 < 120
    steps = committed_steps(out / "checkpoints")
    assert steps and max(steps) < 6
    train(config(tiny_dir, out, max_steps=6, save_steps=1, resume=True, **own), devices=devices)
    assert max(committed_steps(out / "checkpoints")) == 6
    c = [h for h in history(out) if "loss" in h]
    assert sorted({h["step"] for h in c}) == list(range(1, 7))
