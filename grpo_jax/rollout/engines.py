"""The two rollout back-ends behind one interface: `generate` and `update_weights`."""

from __future__ import annotations

import dataclasses

from grpo_jax import distributed as dist
from grpo_jax import hf
from grpo_jax.errors import ConfigError
from grpo_jax.rollout import continuation, refill
from grpo_jax.rollout.sampler import RolloutBatch, Sampler
from grpo_jax.rollout.sampling import SamplingParams


def sampling_params(cfg, tokenizer, model_dir=None) -> SamplingParams:
    """The config's generation settings with TRL's EOS set added to the stop tokens: the
    tokenizer's EOS, then every `eos_token_id` of the model's generation_config.json (when
    `model_dir` is given), then the config's own stop_token_ids."""
    gen_eos = hf.generation_eos_ids(model_dir) if model_dir is not None else ()
    stops = dict.fromkeys([tokenizer.eos_token_id, *gen_eos, *cfg.generation.stop_token_ids])
    return dataclasses.replace(cfg.generation,
                               stop_token_ids=tuple(t for t in stops if t is not None))


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


class JaxRollout:
    """The native sampler: it reads the trainer's params directly, so there is nothing to sync.

    With LoRA (`peft`) it takes the adapters and the frozen base (`takes_adapters`) where
    PeftArgs.sampler_takes_adapters says so (a quantized base); else GRPORound hands it the
    base with the adapters merged, once per round.

    With `max_num_seqs` set, rounds run through that many decode slots (rollout/refill.py)."""

    syncs_weights = False  # GRPORound need not build weights for update_weights

    def __init__(self, model_cfg, params: SamplingParams, *, pad_id: int, mesh, peft=None):
        self.takes_adapters = bool(peft and peft.sampler_takes_adapters)
        self.sampler = Sampler(model_cfg, params, pad_id=pad_id, mesh=mesh,
                               peft=peft if self.takes_adapters else None)
        self.slots = refill.Refill(self.sampler) if params.max_num_seqs is not None else None
        # Multi-turn rollouts continue from the KV cache (None: sliding-window models, which
        # re-prefill every turn's context; and with decode slots, since continuing needs every
        # row's cache kept between turns: there each turn re-prefills its context, and a row
        # waiting for its tools has left its slot to the next row).
        self.turns = (continuation.Continuation(self.sampler)
                      if continuation.supported(self.sampler) and self.slots is None else None)

    def generate(self, params, prompt_ids, num_generations, key) -> RolloutBatch:
        if self.slots is not None:
            return self.slots.generate(params, prompt_ids, num_generations, key)
        return self.sampler.generate(params, prompt_ids, num_generations, key)

    def update_weights(self, params) -> float | None:
        return None


class MainProcessRollout:
    """A server's rollouts in a multi-process run: process 0 alone talks to the server and every
    process gets the same results; a server error there is raised on every process."""

    def __init__(self, make):
        from grpo_jax.rollout.vllm_client import VLLMServerError
        self.error = VLLMServerError
        self.inner = None

        def build():
            self.inner = make()
            return getattr(self.inner, "takes_adapters", False)
        # Every process must hand update_weights the same kind of params (merging is SPMD).
        self.takes_adapters = dist.from_main(build, self.error)

    def generate(self, params, prompt_ids, num_generations, key) -> RolloutBatch:
        return dist.from_main(
            lambda: self.inner.generate(params, prompt_ids, num_generations, key), self.error)

    def update_weights(self, params) -> float:
        host = dist.to_host(params)  # the params are spread over every process's devices
        return dist.from_main(lambda: self.inner.update_weights(host), self.error)

    @property
    def sync_metrics(self) -> dict:  # logged by process 0, the one that holds them
        return getattr(self.inner, "sync_metrics", None) or {}


def make_rollout(cfg, model_cfg, tokenizer, mesh, model_dir, tools=()):
    """The config's backend; with `tools` (functions), inside the multi-turn tool loop."""
    sp = sampling_params(cfg, tokenizer, model_dir)
    if cfg.rollout.backend == "jax":
        # SPMD over every process's devices
        rollout = JaxRollout(model_cfg, sp, pad_id=pad_id(tokenizer), mesh=mesh,
                             peft=cfg.peft)
    else:
        from grpo_jax.rollout.vllm_rollout import VLLMRollout

        def make():
            return VLLMRollout(cfg, model_cfg, tokenizer, model_dir)
        rollout = MainProcessRollout(make) if dist.multi_process() else make()
        if cfg.rollout.max_staleness:
            from grpo_jax.rollout.async_rounds import AsyncRollout
            if dist.multi_process() or tools or cfg.multi_turn.rollout_func:
                raise ConfigError("max_staleness (async rounds) is built for single-process runs "
                                  "without tools or rollout_func; set max_staleness: 0")
            return AsyncRollout(rollout, cfg.rollout.max_staleness)
    t = cfg.multi_turn
    if t.rollout_func:
        from grpo_jax.rollout.custom import CustomRollout, load_rollout_func
        return CustomRollout(rollout, load_rollout_func(t.rollout_func), tokenizer, cfg,
                             sp.stop_token_ids, pad_id(tokenizer))
    if not tools:
        return rollout
    from grpo_jax.rollout.tools import Toolbox, ToolRollout
    return ToolRollout(rollout, tokenizer, Toolbox(list(tools), t.tool_timeout),
                       t.max_tool_calling_iterations, sp.stop_token_ids, pad_id(tokenizer),
                       cfg.data.chat_template_kwargs)
