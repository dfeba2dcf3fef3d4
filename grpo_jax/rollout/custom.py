"""TRL's `rollout_func`: a user function that makes the rollouts, for multi-turn environments
that are not tool calls (a game, a simulator, a judge in the loop).

TRL 1.16 calls `rollout_func(prompts, trainer)` with every completion's prompt (a prompt's
num_generations copies consecutive) and reads back a dict: `prompt_ids`, `completion_ids` and
`logprobs` (one list per row), optionally `env_mask` (1 on tokens the model wrote, 0 on the
environment's: no loss, as tool results), and any other key, a list with one value per row,
which the reward functions get as a keyword argument. Here `trainer` is a `RolloutContext`:
TRL's handle reaches into torch and vLLM objects that a JAX program has no use for; this one
offers what a rollout needs, `generate` with the run's backend and current weights, the
tokenizer and the settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from grpo_jax.errors import RolloutFuncError
from grpo_jax.rollout.base import RolloutBatch, RolloutWrapper
from grpo_jax.rollout.padding import bucketed_prompts


def load_rollout_func(spec: str) -> Callable:
    from grpo_jax.rewards import import_callable
    if ":" not in spec:
        raise RolloutFuncError(f"rollout_func {spec!r}: name it as 'package.module:function' "
                               "or 'path/to/file.py:function'")
    return import_callable(spec, "rollout_func", RolloutFuncError)


@dataclasses.dataclass
class RolloutContext:
    """What `rollout_func(prompts, trainer)` gets as `trainer`."""
    backend: Any  # the run's rollout backend (JAX sampler or vLLM server)
    params: Any  # the weights it generates with this round
    key: Any  # this round's PRNG key; each generate call folds in a counter
    tokenizer: Any
    args: Any  # the run's TrainConfig
    calls: int = 0

    @property
    def max_completion_length(self) -> int:
        return self.args.generation.max_completion_length

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int = 1
                 ) -> list[dict]:
        """Completions of each prompt (token ids), `num_generations` each, consecutive: per
        completion {"completion_ids", "logprobs"} (the model's tokens up to and including its
        stop token, and the sampler's log-probs of them)."""
        import jax
        if not prompt_ids:  # e.g. no row of the episode goes on
            return []
        self.calls += 1
        r = self.backend.generate(self.params, [list(p) for p in prompt_ids], num_generations,
                                  jax.random.fold_in(self.key, self.calls))
        out = []
        for ids, m, lp in zip(r.completion_ids, r.completion_mask, r.sampler_logp):
            m = m.astype(bool)
            out.append({"completion_ids": ids[m].tolist(), "logprobs": lp[m].tolist()})
        return out


@dataclasses.dataclass
class CustomRollout(RolloutWrapper):
    """The backend driven by a rollout_func; `generate` returns its rows as a RolloutBatch."""
    inner: Any
    fn: Callable
    tokenizer: Any
    args: Any
    stop_token_ids: tuple[int, ...]
    pad_id: int
    takes_records = True  # GRPORound passes the raw prompts (the function reads them)

    def generate(self, weights, prompt_ids, num_generations, key, records=None) -> RolloutBatch:
        prompts = [r["prompt"] for r in records for _ in range(num_generations)]
        context = RolloutContext(self.inner, weights, key, self.tokenizer, self.args)
        out = self.fn(prompts, context)
        return rollout_batch(out, len(prompts), self.args.generation.max_completion_length,
                             self.pad_id, set(self.stop_token_ids))


def rollout_batch(out: Any, n: int, C: int, pad: int, stops: set) -> RolloutBatch:
    """rollout_func's dict as a RolloutBatch of `n` rows; one clear error for each way it can
    be wrong."""
    if not isinstance(out, dict):
        raise RolloutFuncError(f"rollout_func returned {type(out).__name__}; return a dict with "
                               "prompt_ids, completion_ids and logprobs")
    missing = sorted({"prompt_ids", "completion_ids", "logprobs"} - set(out))
    if missing:
        raise RolloutFuncError(f"rollout_func must return keys {missing} in its output dict")
    for key, values in out.items():
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise RolloutFuncError(f"rollout_func's {key!r} has {got} entries for {n} rows (one "
                                   "per prompt it was given)")
    completions, logps = out["completion_ids"], out["logprobs"]
    env_mask = out.get("env_mask")
    for i, c in enumerate(completions):
        if len(c) > C:
            raise RolloutFuncError(f"rollout_func's completion {i} has {len(c)} tokens, more than "
                                   f"max_completion_length={C}; cut it, or raise the setting")
        if len(logps[i]) != len(c) or (env_mask is not None and len(env_mask[i]) != len(c)):
            raise RolloutFuncError(f"rollout_func's row {i}: logprobs and env_mask need one "
                                   f"value per completion token ({len(c)})")
    prompt_ids = [list(p) for p in out["prompt_ids"]]
    ids, mask = bucketed_prompts(prompt_ids, 1, pad)
    comp = np.full((n, C), pad, np.int32)
    cmask, tool_mask = np.zeros((n, C), np.int32), np.ones((n, C), np.int32)
    logp = np.zeros((n, C), np.float32)
    for i, c in enumerate(completions):
        k = len(c)
        comp[i, :k], cmask[i, :k] = c, 1
        # vLLM writes an unscorable log-prob as None (TRL: NaN, left out of the IS correction).
        logp[i, :k] = [np.nan if v is None else v for v in logps[i]]
        if env_mask is not None:
            tool_mask[i, :k] = env_mask[i]
    truncated = np.array([not c or c[-1] not in stops | {pad} for c in completions])
    extra = {k: list(v) for k, v in out.items()
             if k not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
    return RolloutBatch(ids, mask, comp, cmask, truncated, logp,
                        tool_mask=None if env_mask is None else tool_mask, extra=extra)
