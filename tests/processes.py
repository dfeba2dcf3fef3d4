"""Training runs as several processes on 127.0.0.1 (JAX's multi-controller runtime): the
launch, the wait, the logs, the settings of the suite's two-process run, and the comparisons
of a run's params and metrics with the one-process run's. Shared by test_multihost, test_run_dir
and test_vllm_async."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tiny_run import FAST_COMPILE, TRAIN, config

from grpo_jax import hf
from grpo_jax.checkpoint import load_checkpoint

# dp over processes, fsdp within each; a low learning rate keeps Adam's step on the few weights
# whose gradients nearly cancel (where the all-reduce order shows) far under the tolerance.
# A reward function that logs (gathered from both processes), and evaluation on held-out prompts.
RUN = dict(dp=2, fsdp=-1, per_device_train_batch_size=2, learning_rate=0.002, save_steps=2,
           beta=0.04,  # a reference model too
           reward_funcs=f"[{Path(__file__).parent / 'reward_fixtures.py'}:even_tokens_logged]",
           log_completions="true", dataset_test_split="train[48:]",  # here: a subset of train
           eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(devices: int) -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
            "JAX_DEFAULT_MATMUL_PRECISION": "highest", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def launch(argv: list[str], n: int = 2, devices: int = 4, *, log_dir: Path) -> list:
    """n processes of `python ARGV... --coordinator_address ... --process_id i`, logs in files."""
    port = free_port()
    procs = []
    for i in range(n):
        flags = ["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", str(n),
                 "--process_id", str(i)]
        with open(log_dir / f"p{i}.out", "w") as out, open(log_dir / f"p{i}.err", "w") as err:
            procs.append(subprocess.Popen([sys.executable, *argv, *flags], env=env(devices),
                                          stdout=out, stderr=err, text=True))
    return procs


def wait_all(procs, timeout: float) -> list[int]:
    deadline = time.time() + timeout
    try:
        return [p.wait(timeout=max(deadline - time.time(), 1)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def log(path: Path, name: str) -> str:
    return (path / name).read_text()


def cli_config(tiny_dir, out, **extra) -> list[str]:
    cfg = config(tiny_dir, out, **{**RUN, **extra})
    path = Path(out).parent / f"{Path(out).name}.yaml"
    path.write_text(cfg.to_yaml())
    return [*TRAIN, "--config", str(path)]  # python -m grpo_jax.train, without torch


def params(out, step) -> dict[str, np.ndarray]:
    model, _, got = load_checkpoint(out, step)
    assert got == step
    return hf.params_numpy(model)


def assert_same_params(a, b, tol=1e-5):
    assert a.keys() == b.keys()
    worst = {k: float(np.abs(a[k] - b[k]).max()) for k in a}
    assert max(worst.values()) < tol, worst


TRAIN_KEYS = ("reward", "reward_std", "loss", "grad_norm", "entropy", "kl",
              "completions/mean_length", "num_tokens", "logged/score_mean")
EVAL_KEYS = tuple(f"eval_{k}" for k in TRAIN_KEYS if k != "grad_norm")


def assert_same_metrics(a: list[dict], b: list[dict], keys=TRAIN_KEYS):
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for ma, mb in zip(a, b):
        for k in keys:
            assert abs(ma[k] - mb[k]) < 1e-4 * max(1.0, abs(ma[k])), (ma["step"], k, ma[k], mb[k])
