"""The two rollout back-ends behind one interface: `generate` and `update_weights`."""

from __future__ import annotations

from grpo_jax import distributed as dist
from grpo_jax.rollout.sampler import RolloutBatch, Sampler
from grpo_jax.rollout.sampling import SamplingParams


def sampling_params(cfg, tokenizer) -> SamplingParams:
    g = cfg.generation
    stops = tuple(dict.fromkeys([tokenizer.eos_token_id, *g.stop_token_ids]))
    return SamplingParams(max_completion_length=g.max_completion_length,
                          temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                          min_p=g.min_p, repetition_penalty=g.repetition_penalty,
                          stop_token_ids=tuple(t for t in stops if t is not None))


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


class JaxRollout:
    """The native sampler: it reads the trainer's params directly, so there is nothing to sync."""

    def __init__(self, cfg, model_cfg, tokenizer, mesh):
        self.sampler = Sampler(model_cfg, sampling_params(cfg, tokenizer), pad_id=pad_id(tokenizer),
                               mesh=mesh)

    def generate(self, params, prompt_ids, num_generations, key) -> RolloutBatch:
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
        dist.from_main(build, self.error)

    def generate(self, params, prompt_ids, num_generations, key) -> RolloutBatch:
        return dist.from_main(
            lambda: self.inner.generate(params, prompt_ids, num_generations, key), self.error)

    def update_weights(self, params) -> float:
        host = dist.to_host(params)  # the params are spread over every process's devices
        return dist.from_main(lambda: self.inner.update_weights(host), self.error)


def make_rollout(cfg, model_cfg, tokenizer, mesh, model_dir):
    if cfg.rollout.backend == "jax":
        return JaxRollout(cfg, model_cfg, tokenizer, mesh)  # SPMD over every process's devices
    from grpo_jax.rollout.vllm_rollout import VLLMRollout

    def make():
        return VLLMRollout(cfg, model_cfg, tokenizer, model_dir)
    return MainProcessRollout(make) if dist.multi_process() else make()
