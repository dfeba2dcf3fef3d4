"""Reward curves of the synchronous loop, partial rollouts and the disaggregated split, side by
side over seeds (issue #49: "learning is not hurt").

    python tools/reward_curves.py run --out outputs/curves --seeds 0,1,2
    python tools/reward_curves.py report --out outputs/curves --png docs/smol_curves.png

`run` trains `--config smol` once per (way, seed), each in its own output_dir, one after
another (a run whose metrics already reach max_steps is skipped, so an interrupted `run` goes
on where it stopped). `report` prints a markdown table of the reward per step (mean and spread
over seeds) with the staleness each way trained at, and draws the curves.

The ways (everything else is the smol config):
  sync     the synchronous loop (max_staleness 0), one device
  partial  partial rollouts on the same device: 8 group slots (a round's 4 groups and the next
           4) through 24 decode slots, max_staleness 2
  split    partial rollouts on a sampler device of their own, the trainer on another (two host
           devices, sampler_devices 1, max_staleness 1: every token one version old). The
           two-process split trains the same thing bit for bit (tests/test_split.py).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

WAYS = {
    "sync": ([], 1),
    "partial": (["--max_staleness", "2", "--max_num_seqs", "24"], 1),
    "split": (["--max_staleness", "1", "--max_num_seqs", "16", "--sampler_devices", "1"], 2),
}


def _records(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train_records(run_dir: pathlib.Path) -> dict[int, dict]:
    # Keep the newest record of each step: a resumed run logs its steps again from the checkpoint.
    out = {}
    for r in _records(run_dir):
        if "reward" in r and "step" in r:
            out[int(r["step"])] = r
    return out


def run(args) -> None:
    root = pathlib.Path(args.out)
    for way in args.ways.split(","):
        extra, devices = WAYS[way]
        for seed in [int(s) for s in args.seeds.split(",")]:
            run_dir = root / f"{way}-{seed}"
            if len(_train_records(run_dir)) >= args.max_steps:
                print(f"{run_dir}: done, skipped", flush=True)
                continue
            env = dict(os.environ, HF_HUB_OFFLINE="1",
                       XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
            cmd = [sys.executable, "-m", "grpo_jax.train", "--config", "smol",
                   "--seed", str(seed), "--max_steps", str(args.max_steps),
                   "--output_dir", str(run_dir), "--save_total_limit", "1", *extra]
            if (run_dir / "checkpoints").exists():
                cmd.append("--resume")
            t0 = time.time()
            log = run_dir.with_suffix(".log")
            root.mkdir(parents=True, exist_ok=True)
            with open(log, "a") as f:
                rc = subprocess.call(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
            print(f"{run_dir}: exit {rc} in {time.time() - t0:.0f} s (log {log})", flush=True)
            if rc != 0:
                sys.exit(rc)


def _stats(values: list[float]) -> tuple[float, float, float]:
    mean = sum(values) / len(values)
    return mean, min(values), max(values)


def report(args) -> None:
    root = pathlib.Path(args.out)
    curves: dict[str, dict[int, list[float]]] = {}
    stale: dict[str, list[float]] = {}
    for way in args.ways.split(","):
        per_step: dict[int, list[float]] = {}
        for seed in [int(s) for s in args.seeds.split(",")]:
            for step, r in _train_records(root / f"{way}-{seed}").items():
                per_step.setdefault(step, []).append(r["reward"])
                stale.setdefault(way, []).append(r.get("staleness/mean", 0.0))
        curves[way] = per_step
    ways = list(curves)
    steps = sorted(set().union(*[set(c) for c in curves.values()]))
    print("| step | " + " | ".join(f"{w}: mean [min, max]" for w in ways) + " |")
    print("| --- |" + " --- |" * len(ways))
    for step in steps:
        cells = []
        for w in ways:
            v = curves[w].get(step, [])
            cells.append("" if not v else "%.3f [%.3f, %.3f]" % _stats(v) + ("" if len(v) == len(args.seeds.split(",")) else f" (n={len(v)})"))
        print(f"| {step} | " + " | ".join(cells) + " |")
    for w in ways:
        last = [v for s, vs in curves[w].items() for v in vs if s > steps[-1] - 5] if steps else []
        first = [v for s, vs in curves[w].items() for v in vs if s <= 5]
        print(f"{w}: reward over steps 1-5 {sum(first) / max(len(first), 1):.3f}, over the last 5 "
              f"{sum(last) / max(len(last), 1):.3f}; staleness/mean over the run "
              f"{sum(stale.get(w, [0])) / max(len(stale.get(w, [])), 1):.3f}")
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for w in ways:
            xs = sorted(curves[w])
            mean = [_stats(curves[w][s])[0] for s in xs]
            ax.plot(xs, mean, label=w)
            ax.fill_between(xs, [_stats(curves[w][s])[1] for s in xs],
                            [_stats(curves[w][s])[2] for s in xs], alpha=0.2)
        ax.set_xlabel("step")
        ax.set_ylabel("reward: mean, min-max of seeds")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=100)
        print(f"wrote {args.png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["run", "report"])
    p.add_argument("--out", default="outputs/curves")
    p.add_argument("--ways", default="sync,partial,split")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--png", default=None)
    args = p.parse_args()
    run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()
