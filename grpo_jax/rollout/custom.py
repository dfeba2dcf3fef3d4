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

A vision-language model's rollout_func gets each prompt as TRL 1.16 gives it, its images in its
messages' image parts; `trainer.processing_class` is the model's processor (TRL's name), whose
ids (each image's placeholder expanded) the function returns as prompt_ids, and
`trainer.generate(..., images=...)` samples prompts with their images. The rows train with
their prompts' images, as TRL's forward takes the dataset's; the completions are text.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from grpo_jax import images
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

    @property
    def processing_class(self):
        """TRL's name: a vision-language model's processor, else the tokenizer."""
        processor = self.backend.processor
        return self.tokenizer if processor is None else processor

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int = 1,
                 images: Sequence[Sequence[Any]] | None = None) -> list[dict]:
        """Completions of each prompt (token ids), `num_generations` each, consecutive: per
        completion {"completion_ids", "logprobs"} (the model's tokens up to and including its
        stop token, and the sampler's log-probs of them). `images`: a vision-language model's
        images of each prompt, in the order of its placeholders (the processor's ids hold
        each one's expanded placeholder)."""
        import jax
        if not prompt_ids:  # e.g. no row of the episode goes on
            return []
        if images is not None and self.backend.processor is None:
            raise RolloutFuncError("rollout_func passed images to trainer.generate, but the "
                                   "model is text only; pass none")
        records = None
        if self.backend.processor is not None:
            images = images if images is not None else [[]] * len(prompt_ids)
            if len(images) != len(prompt_ids):
                raise RolloutFuncError(f"trainer.generate got images for {len(images)} "
                                       f"prompts and {len(prompt_ids)} prompts; give one list "
                                       "per prompt")
            records = [{"prompt": [{"role": "user", "content": [
                {"type": "image", "image": im} for im in ims]}], "prompt_ids": list(p)}
                for p, ims in zip(prompt_ids, images)]
            for i, rec in enumerate(records):
                check_placeholders(rec, self.backend.image_token_id,
                                   f"trainer.generate's prompt {i}", "images")
        self.calls += 1
        r = self.backend.generate(self.params, [list(p) for p in prompt_ids], num_generations,
                                  jax.random.fold_in(self.key, self.calls), records)
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
        batch = rollout_batch(out, len(prompts), self.args.generation.max_completion_length,
                              self.pad_id, set(self.stop_token_ids))
        if self.inner.processor is None:
            return batch
        # The rows train with their prompts' images, at the placeholders of the ids returned.
        rows = [{"prompt": prompt, "prompt_ids": list(ids)}
                for prompt, ids in zip(prompts, out["prompt_ids"])]
        for i, row in enumerate(rows):
            check_placeholders(row, self.inner.image_token_id,
                               f"rollout_func's prompt_ids of row {i}", "prompt's images")
        return self.inner.with_row_images(batch, rows)


def check_placeholders(record: dict, image_token_id: int, what: str, whose: str) -> None:
    """A record's ids hold one image's placeholder (a run of image_token_id) per image."""
    ids = np.asarray(record["prompt_ids"]) == image_token_id
    placed = int(ids[0]) + int(np.sum(ids[1:] & ~ids[:-1])) if ids.size else 0
    wanted = len(images.record_images(record))
    if placed != wanted:
        raise RolloutFuncError(f"{what} holds {placed} images' placeholders for {wanted} "
                               f"{whose}; give the processor's ids (trainer.processing_class "
                               "expands each image's placeholder)")


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
