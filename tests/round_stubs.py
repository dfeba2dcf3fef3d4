"""A round (grpo_jax.round.GRPORound) without a model: a stub sampler whose completions name
their rows, a stub trainer that records the windows it is given, and the batch plan of a round.
Shared by test_round and test_metrics_trl."""

import types
from typing import NamedTuple

import numpy as np

from grpo_jax.config import BatchPlan
from grpo_jax.grpo.batch import Batch
from grpo_jax.grpo.loss import LossConfig
from grpo_jax.rollout.base import Rollout, RolloutBatch, WeightMode

G, MICRO, C = 4, 4, 3


class State(NamedTuple):
    params: int
    step: int


class StubRollout(Rollout):
    """Row r of the run (counted over all rounds) has completion token r; round k's prompts are
    padded to width 2 + 2 * (k % 2), so windows across generations mix widths."""

    def __init__(self):
        self.rows = 0
        self.rounds = 0
        self.generated: list[RolloutBatch] = []

    weight_mode = WeightMode.PUSH  # a server's: synced after each update

    def generate(self, weights, prompts, g, key, records=None):
        n = len(prompts) * g
        width = 2 + 2 * (self.rounds % 2)
        ids = np.arange(self.rows, self.rows + n, dtype=np.int32)
        p_ids = np.zeros((n, width), np.int32)
        p_ids[:, -1] = ids  # the last prompt token: the row id too
        p_mask = np.zeros((n, width), np.int32)
        p_mask[:, -1] = 1
        c_ids = np.repeat(ids[:, None], C, 1)
        r = RolloutBatch(p_ids, p_mask, c_ids, np.ones((n, C), np.int32), np.zeros(n, bool),
                         np.zeros((n, C), np.float32))
        self.rows, self.rounds = self.rows + n, self.rounds + 1
        self.generated.append(r)
        return r

    def update_weights(self, weights, params):
        return None


class StubTrainer:
    # The round reads the loss settings (dapo's normaliser) from the trainer's step config.
    cfg = types.SimpleNamespace(loss=LossConfig(vllm_importance_sampling_correction=False))
    lora_scale = None  # a full model, as Policy's without LoRA
    shared_prefix = False  # TRL's row shuffle (test_split_by_groups_with_shared_prefix: on)
    replays_routing = False  # a dense model
    mesh = None  # one device: no context axis

    def __init__(self):
        self.windows: list[Batch] = []
        self.micro_batches: list[int | None] = []
        self.logps_calls = 0

    def step(self, state, batch, micro_batches=None):
        self.windows.append(batch)
        self.micro_batches.append(micro_batches)
        return State(state.params + 1, state.step + 1), {"loss": float(batch.size)}

    def logps(self, params, batch, rows=None):
        self.logps_calls += 1
        return np.full(batch.completion_ids.shape, -float(params), np.float32)

    def logps_and_mismatch(self, params, batch, rows=None):  # a dense model: no routing
        return self.logps(params, batch, rows), None

    def rollout_params(self, params):  # no LoRA: the params themselves
        return params


def plan(spg, gas, ni=1):
    return BatchPlan(data_parallel_size=1, micro_batch_size=MICRO, gradient_accumulation_steps=gas,
                     steps_per_generation=spg, generation_batch_size=MICRO * spg,
                     num_generations=G, num_iterations=ni, pad_to_multiple_of=None)
