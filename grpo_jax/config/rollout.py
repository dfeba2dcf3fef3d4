"""How completions are made: the sampling settings (both back-ends), the vLLM server's, and
multi-turn tools."""

from __future__ import annotations

import dataclasses
from typing import Literal

from grpo_jax.config.fields import arg
from grpo_jax.errors import check


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Generation settings with TRL GRPOConfig names (the config's `generation` section).
    0/None/1.0 switch a filter off."""

    max_completion_length: int = arg(
        512,
        "The most tokens a completion may have; longer ones are cut (truncated).")
    temperature: float = arg(1.0, "The sampling temperature (0: greedy).")
    top_p: float = arg(
        1.0,
        "Nucleus sampling: keep the smallest set of tokens with this much probability (1.0: off).")
    top_k: int | None = arg(0, "Keep the k most likely tokens (0 or null: off).")
    min_p: float | None = arg(
        None,
        "Keep tokens at least this fraction of the top token's probability (null: off).")
    repetition_penalty: float = arg(
        1.0,
        "transformers' penalty on tokens already in the sequence (1.0: off).")
    stop_token_ids: tuple[int, ...] = arg(
        (),
        "Tokens that end a completion (kept in it). The trainer adds the tokenizer's EOS.")
    prefill_chunk_size: int = arg(
        2048,
        "grpo-jax's own: prompts longer than this are prefilled this many tokens at a time "
        "(Decoder.prefill), so a long prompt's activations are one chunk's (0: never).")
    max_num_seqs: int | None = arg(
        None,
        "The JAX sampler's decode slots (vLLM's name): at most this many rows in flight, each "
        "holding a KV cache. None: every row of a round at once, in one batch. Fewer than a "
        "round's rows: with continuous_batching a finished row's slot takes the next waiting row "
        "(rollout/native/refill.py); without, the round runs in sub-batches of this many rows, "
        "each until its longest row is done.")
    continuous_batching: bool = arg(
        True,
        "With max_num_seqs: a finished row's slot takes the next waiting row (false: "
        "sub-batches).")

    def __post_init__(self):
        object.__setattr__(self, "top_k", int(self.top_k or 0))
        object.__setattr__(self, "min_p", float(self.min_p) if self.min_p else None)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        check(self.max_completion_length >= 1,
              f"max_completion_length={self.max_completion_length} must be >= 1")
        check(self.temperature >= 0, f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        check(0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1] (1.0 = off)")
        check(self.top_k >= 0, f"top_k={self.top_k} must be >= 0 (0 or None = off)")
        check(self.min_p is None or 0 <= self.min_p <= 1,
              f"min_p={self.min_p} must be in [0, 1] (None = off)")
        check(self.prefill_chunk_size >= 0,
              f"prefill_chunk_size={self.prefill_chunk_size} must be >= 0 (0 = never chunk)")
        check(self.repetition_penalty > 0,
              f"repetition_penalty={self.repetition_penalty} must be > 0 (1.0 = off)")
        check(self.max_num_seqs is None or self.max_num_seqs >= 1,
              f"max_num_seqs={self.max_num_seqs} must be >= 1 (null: a round's rows at once)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class RolloutArgs:
    backend: Literal["jax", "vllm"] = arg(
        "jax",
        "Where completions come from: the JAX sampler, or a vLLM server (TRL: use_vllm, server "
        "mode).")
    vllm_server_base_url: str | None = arg(
        None,
        "The vLLM server's URL; overrides vllm_server_host and vllm_server_port.")
    vllm_server_host: str = arg("127.0.0.1", "TRL: 0.0.0.0; `grpo_jax.serve` binds loopback")
    vllm_server_port: int = arg(
        8000,
        "The vLLM server's port (vllm_server_base_url overrides host and port).")
    vllm_server_timeout: float = arg(240.0, "Seconds to wait for the server to come up.")
    vllm_server_api_key: str | None = arg(
        None,
        "Needed when the server binds a non-loopback address; default: $VLLM_API_KEY.")
    generation_kwargs: dict | None = arg(
        None,
        "vLLM backend: more sampling options for the server's requests (vLLM's names), and "
        "structured outputs constrained to a regex. The JAX sampler has neither.")
    vllm_structured_outputs_regex: str | None = arg(
        None,
        "vLLM backend: constrain completions to this regex (structured outputs).")
    vllm_lora_sync: Literal["adapter", "merged"] = arg(
        "adapter",
        "LoRA runs: after each update push only the adapter, which the server loads with vLLM's "
        "LoRA (started with `grpo_jax.serve --lora-rank R`), or the base with the adapters merged "
        "(full weights). A server without run-time LoRA gets merged weights, with a notice.")
    vllm_weight_sync: Literal["auto", "http", "shm", "nccl"] = arg(
        "auto",
        "How weights reach the server after each update (docs/vllm_weight_sync.md): `http` in the "
        "bodies of vLLM's weight-sync routes (no shared filesystem: a server on another host), "
        "`shm` through a file in /dev/shm (same machine only), `nccl` GPU to GPU through vLLM's "
        "NCCL engine (untested: no GPU with vLLM here), `auto` the server's engine (grpo_http or "
        "nccl), else shm.")
    weight_sync_timeout: float = arg(
        1800.0,
        "TRL AsyncGRPOConfig: seconds a weight update may take")
    max_staleness: int = arg(
        0,
        "0 generates each round with the weights of the update just before it (TRL "
        "GRPOTrainer). >= 1 with vLLM: async rounds (rollout/async_rounds.py), round n+1 "
        "generated during round n's update. >= 1 with the JAX sampler and max_num_seqs: partial "
        "rollouts (rollout/native/partial.py), a round trains as soon as a generation batch of "
        "whole groups is done and the rows still decoding (or waiting on a tool) go on under the "
        "next weights; with a rollout_func, async rounds as vLLM's (whole episodes a round ahead, "
        "one process, on sampler_devices or the trainer's). Either "
        "way a batch or group with tokens more than this many weight versions old is generated "
        "again (TRL AsyncGRPOConfig: max_staleness, 4 there).")
    max_inflight_tasks: int = arg(
        -1,
        "Partial rollouts (max_staleness >= 1 on the JAX sampler): the most rows in flight, "
        "waiting for a decode slot (max_num_seqs), decoding, or done and waiting for their "
        "group; rounded up to whole generation batches. Past the two batches that let rows "
        "carry over, more keep the decode slots busy while long rows decode over several "
        "rounds, at the price of staler tokens. -1: max_staleness generation batches (TRL "
        "AsyncGRPOConfig: max_inflight_tasks, the same rule), at least two without "
        "sampler_devices.")
    sampler_devices: int | None = arg(
        None,
        "Partial rollouts on devices of their own (rollout/native/disaggregated.py): the first "
        "N local devices decode, the rest train, each mesh laid out by the usual rules; round "
        "n+1's rows decode with round n's weights while round n trains, so every token is at "
        "least one version old and max_staleness counts that version (with dynamic_sampling, "
        "a round short of groups with signal waits for the sampler's next advances, decoded "
        "with its own weights). With a rollout_func: its async rounds' episodes run there. "
        "Unset: one set of devices, the sampler and the trainer taking turns.")
    sampler_process: bool = arg(
        False,
        "With sampler_devices: the sampler in a process of its own "
        "(rollout/native/sampler_process.py), on sampler_devices host devices, started and "
        "ended by the run; the trainer's weights reach it through host memory each round. In a "
        "multi-process run each process starts its own on its host's sampler_devices, each "
        "decoding its share of every batch (rollout/native/sampler_hosts.py). CPU hosts only "
        "for now.")

    def __post_init__(self):
        check(0 < self.vllm_server_port < 65536, f"vllm_server_port {self.vllm_server_port} "
              "is not a TCP port")
        check(self.vllm_server_timeout > 0, "vllm_server_timeout must be > 0")
        check(self.weight_sync_timeout > 0, "weight_sync_timeout must be > 0")
        check(self.max_staleness >= 0, f"max_staleness must be >= 0, got {self.max_staleness}")
        check(self.max_inflight_tasks == -1 or self.max_inflight_tasks >= 1,
              f"max_inflight_tasks must be >= 1 (or -1: max_staleness generation batches), got "
              f"{self.max_inflight_tasks}")
        check(self.sampler_devices is None or self.sampler_devices >= 1,
              f"sampler_devices must be >= 1, got {self.sampler_devices}")
        check(not self.sampler_process or self.sampler_devices is not None,
              "sampler_process runs the sampler of a split run (sampler_devices) in a process "
              "of its own: set sampler_devices too")
        for name in ("generation_kwargs", "vllm_structured_outputs_regex"):
            check(self.backend == "vllm" or not getattr(self, name), f"{name} applies to vLLM "
                  "rollouts (use_vllm: true); the JAX sampler's options are the generation "
                  "settings (temperature, top_p, top_k, min_p, repetition_penalty)")
        own = set(dataclasses.asdict(SamplingParams())) | {"max_tokens", "n", "seed", "logprobs"}
        clash = sorted(own & set(self.generation_kwargs or {}))
        check(not clash, f"generation_kwargs {clash}: these are settings of their own (the "
              "trainer reads them too); set them directly, e.g. temperature: 0.7")

    def request_extras(self) -> dict:
        """Fields added to every vLLM completion request."""
        extras = dict(self.generation_kwargs or {})
        if self.vllm_structured_outputs_regex:
            extras["structured_outputs"] = {"regex": self.vllm_structured_outputs_regex}
        return extras

    @property
    def base_url(self) -> str:
        if self.vllm_server_base_url:
            return self.vllm_server_base_url.rstrip("/")
        return f"http://{self.vllm_server_host}:{self.vllm_server_port}"


@dataclasses.dataclass(frozen=True)
class MultiTurnArgs:
    """The config's `multi_turn` section: TRL's GRPOTrainer arguments `tools` and
    `rollout_func`, GRPOConfig's `max_tool_calling_iterations`."""
    tools: tuple[str, ...] = arg(
        (),
        "'package.module:function' or 'path/to/file.py:function': plain functions with type hints "
        "and a Google-style docstring (their JSON schema is what the chat template shows).")
    max_tool_calling_iterations: int | None = arg(
        None,
        "Tool-calling turns per completion at most (null: until a turn makes no call, as TRL).")
    tool_timeout: float = arg(
        30.0,
        "Seconds per tool call; a slower call returns an error to the model.")
    rollout_func: str | None = arg(
        None,
        "'package.module:function' making the rollouts itself (grpo_jax.rollout.custom).")

    def __post_init__(self):
        check(self.max_tool_calling_iterations is None or self.max_tool_calling_iterations >= 0,
              f"max_tool_calling_iterations must be >= 0 or null, got "
              f"{self.max_tool_calling_iterations}")
        check(self.tool_timeout > 0, f"tool_timeout must be > 0 seconds, got {self.tool_timeout}")
        check(not (self.tools and self.rollout_func), "tools and rollout_func are both set: a "
              "rollout_func makes the whole rollout, so run its tools inside it")
