"""The tiny training run most end-to-end tests start from: its settings (`config`) and reward.
The model and prompts it trains on are conftest.py's `tiny_dir` fixture."""

from pathlib import Path

from grpo_jax.cli import load_config

HERE = Path(__file__).parent
REWARD = f"{HERE / 'reward_fixtures.py'}:even_tokens"


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
