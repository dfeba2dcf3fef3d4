"""Learning-rate schedules against transformers' own (the oracle for TrainingArguments)."""

import numpy as np
import pytest
import torch
import transformers

from grpo_jax.cli import config_from_dict
from grpo_jax.errors import ConfigError
from grpo_jax.grpo.optimizer import make_schedule


@pytest.mark.parametrize("sets", [
    {"lr_scheduler_type": "linear", "warmup_steps": 3},
    {"lr_scheduler_type": "cosine", "warmup_ratio": 0.1},
    {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 4},
    {"lr_scheduler_type": "constant"},
    {"lr_scheduler_type": "cosine_with_min_lr", "warmup_ratio": 0.1,
     "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
    {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 1e-6}},
    {"lr_scheduler_type": "cosine", "warmup_steps": 2, "lr_scheduler_kwargs": {"num_cycles": 1.5}},
    {"lr_scheduler_type": "cosine_with_restarts", "warmup_steps": 3},
    {"lr_scheduler_type": "cosine_with_restarts", "warmup_ratio": 0.1,
     "lr_scheduler_kwargs": {"num_cycles": 3}},
    {"lr_scheduler_type": "polynomial", "warmup_steps": 4},
    {"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"lr_end": 2e-6, "power": 2.0}},
    {"lr_scheduler_type": "warmup_stable_decay", "warmup_steps": 5,
     "lr_scheduler_kwargs": {"num_decay_steps": 10}},
    {"lr_scheduler_type": "warmup_stable_decay", "warmup_steps": 6,
     "lr_scheduler_kwargs": {"num_decay_steps": 8, "num_stable_steps": 12, "warmup_type": "cosine",
                             "decay_type": "1-sqrt", "min_lr_ratio": 0.1}},
    {"lr_scheduler_type": "warmup_stable_decay", "warmup_ratio": 0.2,
     "lr_scheduler_kwargs": {"num_decay_steps": 20, "warmup_type": "1-sqrt",
                             "decay_type": "linear", "num_cycles": 1.0}},
], ids=lambda sets: "-".join(f"{v}" for v in sets.values()))
def test_schedules_match_transformers(sets):
    total = 40
    cfg = config_from_dict({"learning_rate": 2e-5, **sets}).optim
    ours = make_schedule(cfg, total)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.learning_rate)
    ref = transformers.get_scheduler(cfg.lr_scheduler_type, opt,
                                     num_warmup_steps=cfg.num_warmup_steps(total),
                                     num_training_steps=total,
                                     scheduler_specific_kwargs=cfg.lr_scheduler_kwargs or {})
    want = []
    for _ in range(total + 3):  # and past the end (polynomial's lr_end, WSD's floor)
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    got = [float(ours(s)) for s in range(total + 3)]
    # fp32 schedule vs float64: measured 1.0e-7 of the peak rate at worst; bound 10x that
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * cfg.learning_rate)


def test_lr_scheduler_kwargs_errors():
    with pytest.raises(ConfigError, match="cosine_with_min_lr needs"):
        config_from_dict({"lr_scheduler_type": "cosine_with_min_lr"})
    with pytest.raises(ConfigError, match=r"\['min_lr_rate'\]: lr_scheduler_type linear reads "
                       "none"):
        config_from_dict({"lr_scheduler_kwargs": {"min_lr_rate": 0.1}})
    with pytest.raises(ConfigError, match="warmup_stable_decay needs lr_scheduler_kwargs"):
        config_from_dict({"lr_scheduler_type": "warmup_stable_decay"})
    with pytest.raises(ConfigError, match="decay_type must be one of"):
        config_from_dict({"lr_scheduler_type": "warmup_stable_decay",
                          "lr_scheduler_kwargs": {"num_decay_steps": 3, "decay_type": "exp"}})
    with pytest.raises(ConfigError, match=r"lr_end \(1e-05\) must be smaller"):
        config_from_dict({"lr_scheduler_type": "polynomial", "learning_rate": 1e-5,
                          "lr_scheduler_kwargs": {"lr_end": 1e-5}})
    with pytest.raises(ConfigError, match="lr_scheduler_kwargs: expected dict"):
        config_from_dict({"lr_scheduler_kwargs": 3})
