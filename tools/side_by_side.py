"""grpo-jax against TRL 1.16's GRPOTrainer on this machine: the same SmolLM2-135M-Instruct
directory, the same prompts (as chat), the same shape and settings (temperature 0.8, beta 0,
lr 2e-5 constant, fp32, activations recomputed in the backward pass: TRL's default gradient
checkpointing, grpo-jax's remat; TRL's reward_len), one run after the other.

    python tools/side_by_side.py [--shapes smol tldr] [--steps 8] [--json out.json]

TRL runs in its own venv (tools/install_trl.sh makes .venv-trl when --trl-python is not given);
each run is a child process whose peak RSS comes from the kernel (wait4). Shapes: `smol` is
`--config smol` (4 prompts x 4 completions of <= 32 tokens, the shipped Reddit posts); `tldr`
is TRL's tldr recipe's form on CPU: posts of ~300 tokens, 2 prompts x 8 completions. Step time
is the median of steps 2.. (step 1 compiles / warms up)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"smol": {"num_generations": 4, "per_device_train_batch_size": 16, "posts": 1},
          "tldr": {"num_generations": 8, "per_device_train_batch_size": 16, "posts": 3}}
MAX_COMPLETION_LENGTH = 32


def prompts(posts: int) -> list[dict]:
    """The shipped posts as one chat turn each (data.py's smol_prompts); posts > 1 joins that
    many consecutive posts into one longer one."""
    from grpo_jax import data
    rows = data._load_columns("smol_prompts", None, "train", 0)["prompt"]
    if posts == 1:
        return [{"prompt": r} for r in rows]
    bodies = [r[0]["content"].removesuffix("\n\nTL;DR in a few words:") for r in rows]
    return [{"prompt": [{"role": "user", "content": "\n\n".join(bodies[i:i + posts])
                         + "\n\nTL;DR in a few words:"}]}
            for i in range(0, len(bodies) - posts + 1, posts)]


def run(cmd: list[str], env=None) -> tuple[str, float, float]:
    """(stdout, wall seconds, peak RSS GB) of a child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"{cmd[:3]} failed ({proc.returncode}):\n{out[-4000:]}")
    return out, time.perf_counter() - t0, usage.ru_maxrss * 1024 / 1e9


def run_trl(python: str, model: Path, data: Path, shape: dict, steps: int, tmp: Path,
            extra: list[str]) -> dict:
    out, wall, rss = run([python, str(ROOT / "tools" / "trl_grpo_run.py"), "--model", str(model),
                          "--data", str(data), "--max_steps", str(steps),
                          "--max_completion_length", str(MAX_COMPLETION_LENGTH),
                          "--output_dir", str(tmp / "trl"),
                          "--num_generations", str(shape["num_generations"]),
                          "--per_device_train_batch_size",
                          str(shape["per_device_train_batch_size"]), *extra],
                         env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    result = json.loads([s for s in out.splitlines() if s.startswith("RESULT ")][-1][7:])
    return {"step_times": result["step_times"], "rewards": result["rewards"],
            "wall_s": wall, "peak_rss_GB": rss}


def run_grpo_jax(model: Path, data: Path, shape: dict, steps: int, tmp: Path,
                 extra: list[str]) -> dict:
    out_dir = tmp / "grpo_jax"
    _, wall, rss = run([sys.executable, "-m", "grpo_jax.train", "--config", "smol",
                        "--model.name_or_path", str(model), "--dataset_name", str(data),
                        "--max_prompt_length", "1024", "--max_steps", str(steps),
                        "--max_completion_length", str(MAX_COMPLETION_LENGTH),
                        "--num_generations", str(shape["num_generations"]),
                        "--per_device_train_batch_size", str(shape["per_device_train_batch_size"]),
                        "--output_dir", str(out_dir), "--save_steps", "1000000",
                        "--log_completions", "false", "--report_to", "[]", *extra],
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))
    rows = [json.loads(s) for s in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time" in r]
    return {"step_times": [r["step_time"] for r in rows],
            "rewards": [r["reward"] for r in rows], "wall_s": wall, "peak_rss_GB": rss}


def summary(r: dict) -> dict:
    return {**r, "median_step_s": statistics.median(r["step_times"][1:])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--trl-python", help="a Python with TRL 1.16 (default: .venv-trl, made by "
                   "tools/install_trl.sh when missing)")
    p.add_argument("--grpo-jax-args", default="", help="extra flags for grpo_jax.train")
    p.add_argument("--trl-no-gradient-checkpointing", action="store_true",
                   help="TRL without its default gradient checkpointing (grpo-jax's recipe "
                   "recomputes too: remat, policy dots)")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args(argv)
    from grpo_jax import hf
    model = hf.resolve_model_dir(hf.SMOL_ALIAS)
    trl_python = a.trl_python
    if trl_python is None:
        subprocess.run(["bash", str(ROOT / "tools" / "install_trl.sh"),
                        str(ROOT / ".venv-trl")], check=True)
        trl_python = str(ROOT / ".venv-trl" / "bin" / "python")
    import platform

    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(model)
    results = {"machine": f"{platform.machine()} x{os.cpu_count()}", "steps": a.steps}
    for name in a.shapes:
        shape = SHAPES[name]
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            rows = prompts(shape["posts"])
            data = tmp / "prompts.jsonl"
            data.write_text("".join(json.dumps(r) + "\n" for r in rows))
            lengths = [len(tok(tok.apply_chat_template(r["prompt"], tokenize=False,
                                                       add_generation_prompt=True),
                               add_special_tokens=False)["input_ids"]) for r in rows]
            print(f"[{name}] {len(rows)} prompts, mean {statistics.mean(lengths):.0f} tokens; "
                  f"TRL first", flush=True)
            trl = summary(run_trl(trl_python, model, data, shape, a.steps, tmp,
                                  ["--no_gradient_checkpointing"]
                                  if a.trl_no_gradient_checkpointing else []))
            print(f"[{name}] TRL median step {trl['median_step_s']:.1f} s; grpo-jax", flush=True)
            ours = summary(run_grpo_jax(model, data, shape, a.steps, tmp, a.grpo_jax_args.split()))
        results[name] = {"shape": {**shape, "max_completion_length": MAX_COMPLETION_LENGTH,
                                   "mean_prompt_tokens": statistics.mean(lengths)},
                         "trl": trl, "grpo_jax": ours,
                         "speedup": trl["median_step_s"] / ours["median_step_s"],
                         "rss_ratio": ours["peak_rss_GB"] / trl["peak_rss_GB"]}
    print(f"\nmachine: {results['machine']}, {a.steps} steps each, one after the other")
    print("| shape | | median step (steps 2..) | wall | peak RSS |\n|---|---|---|---|---|")
    for name in a.shapes:
        r = results[name]
        for who in ("trl", "grpo_jax"):
            x = r[who]
            print(f"| {name} | {'TRL 1.16' if who == 'trl' else 'grpo-jax'} | "
                  f"{x['median_step_s']:.1f} s | {x['wall_s']:.0f} s | {x['peak_rss_GB']:.2f} GB |")
        print(f"| {name} | grpo-jax / TRL | {r['speedup']:.3f}x faster | | "
              f"{r['rss_ratio']:.2f}x |")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
