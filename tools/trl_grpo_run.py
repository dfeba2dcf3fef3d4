"""TRL's GRPOTrainer on one workload, for tools/side_by_side.py (runs in the TRL venv, imports
nothing of grpo-jax). Prints one line `RESULT {json}`: each optimizer step's wall time, the
rewards logged, and the process's peak RSS."""

import argparse
import json
import resource
import time

import datasets
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def reward_len(completions, **kwargs):
    """TRL's quick-start reward (grpo_jax.rewards.reward_len): close to 20 characters."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [-abs(20 - len(t)) for t in texts]


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self.logs, self.t0 = [], [], None

    def on_step_begin(self, args, state, control, **kw):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self.t0)

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs or {}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="a .jsonl of conversational prompts")
    p.add_argument("--num_generations", type=int, required=True)
    p.add_argument("--per_device_train_batch_size", type=int, required=True)
    p.add_argument("--max_completion_length", type=int, required=True)
    p.add_argument("--max_steps", type=int, required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--no_gradient_checkpointing", action="store_true")
    a = p.parse_args()
    cfg = GRPOConfig(
        output_dir=a.output_dir, num_generations=a.num_generations,
        per_device_train_batch_size=a.per_device_train_batch_size,
        max_completion_length=a.max_completion_length, temperature=0.8, beta=0.0,
        learning_rate=2e-5, lr_scheduler_type="constant", max_steps=a.max_steps,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
        # TRL's default (True) recomputes activations, as grpo-jax's CPU recipe does (remat).
        gradient_checkpointing=not a.no_gradient_checkpointing,
        model_init_kwargs={"dtype": "float32"}, seed=42)
    times = StepTimes()
    trainer = GRPOTrainer(model=a.model, reward_funcs=reward_len, args=cfg,
                          train_dataset=datasets.load_dataset("json", data_files=a.data,
                                                              split="train"),
                          callbacks=[times])
    t0 = time.perf_counter()
    trainer.train()
    print("RESULT " + json.dumps({
        "step_times": times.times, "wall_s": time.perf_counter() - t0,
        "rewards": [l["reward"] for l in times.logs if "reward" in l],
        "peak_rss_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}))


if __name__ == "__main__":
    main()
