"""Where metrics go: a progress bar, metrics.jsonl, TensorBoard, W&B (when asked), a PNG.

Every record (grpo_jax.metrics: one per logging window) goes to all of them alike. A metric with
no value in its window is None, as TRL logs it: null in the JSONL, left out of TensorBoard and
W&B, "nan" on the console."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from tqdm.auto import tqdm

from grpo_jax.errors import TrainError


class MetricsLogger:
    def __init__(self, out_dir: Path, run_cfg, *, total_steps: int, start_step: int = 0,
                 enabled: bool = True):
        self.out = Path(out_dir)
        self.enabled = enabled  # only process 0 writes in a multi-process run
        self.run_cfg = run_cfg
        self._tb = self._wandb = None
        self._bar = None
        self._postfix: dict[str, str] = {}
        if not enabled:
            return
        # A resumed run replays the steps after its checkpoint: drop their old records (the
        # metrics' and the completions'), so that no step is logged twice.
        self._jsonl = _reopen(self.out / "metrics.jsonl", start_step)
        self._completions = (_reopen(self.out / "completions.jsonl", start_step)
                             if run_cfg.log_completions else None)
        report_to = tuple(run_cfg.report_to or ())
        if "tensorboard" in report_to:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(self.out / "tensorboard"))
        if "wandb" in report_to:
            try:
                import wandb
                self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo-jax"),
                                         dir=str(self.out), resume="allow")
            except ImportError:
                print("report_to has wandb but it is not installed (`pip install wandb`); "
                      "skipping it", file=sys.stderr)
        self._bar = tqdm(total=total_steps, initial=start_step, desc="GRPO", unit="step",
                         dynamic_ncols=True, file=sys.stderr)

    def advance(self, step: int) -> None:
        """The progress bar to optimizer step `step`."""
        if self.enabled:
            self._bar.update(step - self._bar.n)

    def log(self, step: int, metrics: dict) -> dict:
        """One record (a logging window's metrics) at optimizer step `step`."""
        metrics = {k: _number(v) for k, v in metrics.items()}
        if not self.enabled:
            return metrics
        self.advance(step)
        self._write(step, metrics, {f"train/{k}": v for k, v in metrics.items()})
        for key, fmt in (("reward", ".3f"), ("kl", ".4f")):  # the latest that was logged
            if metrics.get(key) is not None:
                self._postfix[key] = format(metrics[key], fmt)
        self._bar.set_postfix(self._postfix, refresh=False)
        keys = ("reward", "reward_std", "kl", "loss", "grad_norm", "clip_ratio/region_mean",
                "completions/mean_length", "step_time")
        self._bar.write(f"step {step}: {_shown(metrics, keys)}")
        return metrics

    def _write(self, step: int, metrics: dict, tagged: dict) -> None:
        """The record to metrics.jsonl, and its values (under `tagged` names) to TensorBoard
        and W&B."""
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        tagged = {k: v for k, v in tagged.items() if v is not None}
        if self._tb is not None:
            for k, v in tagged.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(tagged, step=step)

    def log_eval(self, step: int, metrics: dict) -> dict:
        """An evaluation's metrics (TRL's `eval_` names): a record of their own in the JSONL,
        TensorBoard's and W&B's "eval/" sections (as transformers' callbacks name them), a line
        under the progress bar and a curve in the PNG."""
        metrics = {k: _number(v) for k, v in metrics.items()}
        if not self.enabled:
            return metrics
        self._write(step, metrics, {(f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"):
                                    v for k, v in metrics.items()})
        keys = ("eval_reward", "eval_reward_std", "eval_kl", "eval_loss",
                "eval_completions/mean_length", "eval_runtime")
        self._bar.write(f"eval at step {step}: {_shown(metrics, keys)}")
        return metrics

    def log_completions(self, step: int, prompts, completions, rewards, advantages,
                        extra: dict | None = None) -> None:
        """One JSON row per completion; `extra`: reward functions' log_extra columns."""
        if not (self.enabled and self._completions):
            return
        extra = extra or {}
        rows = [{"step": step, "prompt": p, "completion": c, "reward": float(r),
                 "advantage": float(a), **{k: v[i] for k, v in extra.items()}}
                for i, (p, c, r, a) in enumerate(zip(prompts, completions, rewards, advantages))]
        self._completions.writelines(json.dumps(row, default=_jsonable) + "\n" for row in rows)
        self._completions.flush()
        shown = self.run_cfg.num_completions_to_print
        for row in rows[:len(rows) if shown is None else shown]:
            self._bar.write(f"  [{row['reward']:+.3g} adv {row['advantage']:+.3g}] "
                            f"{_short(row['prompt'])} -> {_short(row['completion'])}")
        if self._wandb is not None:
            if self.run_cfg.log_unique_prompts:  # one row per prompt (compared as text)
                unique: dict[str, dict] = {}
                for row in rows:
                    unique.setdefault(str(row["prompt"]), row)
                rows = list(unique.values())
            import wandb
            columns = list(rows[0]) if rows else []
            self._wandb.log({"completions": wandb.Table(
                columns=columns, data=[[str(row[k]) if k in ("prompt", "completion") else row[k]
                                        for k in columns] for row in rows])}, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._bar.close()
        self._jsonl.close()
        if self._completions:
            self._completions.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        history = read_history(self.out / "metrics.jsonl")
        if history:
            plot_curves(history, self.out / "reward_kl.png")


def _jsonable(v) -> str:
    """What completions.jsonl writes for a value JSON has no form for: an image part of a
    vision-language prompt as its size and mode (its str() is a memory address), others as str."""
    try:
        from PIL import Image
    except ImportError:  # the aot venv has no Pillow, and no images either
        return str(v)
    if isinstance(v, Image.Image):
        return f"<image {v.width}x{v.height} {v.mode}>"
    return str(v)


def _number(v) -> float | None:
    """A value as a record holds it: a float, or None (no value in its window; NaN too)."""
    return None if v is None or math.isnan(float(v)) else float(v)


def _shown(metrics: dict, keys) -> str:
    return "  ".join(f"{k}={math.nan if metrics[k] is None else metrics[k]:.4g}"
                     for k in keys if k in metrics)


def _short(x, n: int = 60) -> str:
    """A prompt or completion on one console line (chat messages: the last one's text)."""
    if isinstance(x, list) and x and isinstance(x[-1], dict):
        x = x[-1].get("content", "")
    if isinstance(x, list):  # a multimodal turn's parts: their text, each image as <image>
        x = " ".join("<image>" if part.get("type") == "image" else str(part.get("text", ""))
                     for part in x if isinstance(part, dict))
    text = " ".join(str(x).split())
    return text if len(text) <= n else text[:n - 3] + "..."


def _reopen(path: Path, start_step: int):
    """`path` (a jsonl file of records with a step) without its records after `start_step`,
    open for appending. The file is replaced whole (a crash meanwhile leaves the old one)."""
    kept = [h for h in read_history(path) if h["step"] <= start_step]
    staged = path.with_name(path.name + ".tmp")
    staged.write_text("".join(json.dumps(h) + "\n" for h in kept))
    os.replace(staged, path)
    return open(path, "a")


def read_history(path: Path) -> list[dict]:
    """The records of metrics.jsonl `path` ([] without one). A last line cut off mid-write (a
    crash, a full disk) is dropped, said on stderr; a damaged line before it is a TrainError
    (the file is the run's history: not silently cut)."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [(i, line) for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if line.strip()]
    history = []
    for i, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            record, why = None, f"not JSON ({e.msg} at column {e.colno})"
        else:
            why = "not a record with a step"
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            history.append(record)
        elif (i, line) == lines[-1] and record is None:
            print(f"{path}: its last line (line {i}, {len(line)} characters) was cut off "
                  "mid-write (a crash or a full disk); dropped it", file=sys.stderr)
        else:
            raise TrainError(f"{path} line {i} is {why}: the file is damaged (another run "
                             "writing to it?); delete that line or move the file away, then "
                             "run again")
    return history


def plot_curves(history: list[dict], path: Path) -> None:
    """Reward and KL against step (the run's whole metrics.jsonl, resumed parts included)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [h for h in history if h.get("reward") is not None]
    evals = [h for h in history if h.get("eval_reward") is not None]
    steps = [h["step"] for h in train]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].plot(steps, [h["reward"] for h in train], marker=".", label="train")
    if evals:  # evaluation on the eval split (eval_strategy / eval_on_start)
        axes[0].plot([h["step"] for h in evals], [h["eval_reward"] for h in evals], marker="o",
                     color="tab:green", label="eval")
        axes[0].legend()
    axes[0].set(xlabel="step", ylabel="reward", title="mean reward")
    # With beta = 0 there is no KL to show (TRL logs none); completion length stands in.
    key = "kl" if any("kl" in h for h in train) else "completions/mean_length"
    axes[1].plot(steps, [math.nan if h.get(key) is None else h[key] for h in train], marker=".",
                 color="tab:red")
    axes[1].set(xlabel="step", ylabel=key, title="KL to reference" if key == "kl"
                else "mean completion length (beta = 0: no KL)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
