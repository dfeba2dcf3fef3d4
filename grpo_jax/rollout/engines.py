"""Where each rollout is built (make_rollout), and process 0's server rollout in a multi-process
run. The contract: rollout/base.py."""

from __future__ import annotations

import jax

from grpo_jax import distributed as dist
from grpo_jax import hf
from grpo_jax import images
from grpo_jax import mesh as mesh_lib
from grpo_jax.errors import ConfigError, VLLMServerError
from grpo_jax.rollout import row_images
from grpo_jax.rollout.base import Rollout, RolloutBatch, RolloutWrapper, WeightMode, sampling_params
from grpo_jax.rollout.native.partial import group_slots_for
from grpo_jax.rollout.native.rollout import JaxRollout
from grpo_jax.rollout.padding import pad_id


class MainProcessRollout(RolloutWrapper):
    """A server's rollouts in a multi-process run: process 0 alone talks to the server (`inner`,
    its VLLMRollout; None on the other processes) and every process gets the same results; a
    server error there is raised on every process. What the wrapper forwards is answered here
    for every process alike: a server's rollout generates when asked, on the weights pushed."""

    generates_ahead = False  # async rounds wrap this one (AsyncRollout), never the reverse
    turns = None
    takes_records = False  # set per run below (RolloutWrapper's would ask `inner`, process 0's)

    def __init__(self, make, takes_records: bool = False, processor=None, model_cfg=None,
                 pad: int | None = None):
        """`make`: process 0's rollout; a server's, or with async rounds a round's whole
        episodes of it (its rollout_func, when `takes_records`, or its tool loop).
        `processor`, `model_cfg`, `pad`: a vision-language model's, whose tool loop runs on
        every process and places its tool results' images on each (with_row_images)."""
        self.inner, self.takes_records = None, takes_records
        self.processor, self.model_cfg, self.pad = processor, model_cfg, pad
        self.image_token_id = None if processor is None else model_cfg.vision.image_token_id

        def build():
            self.inner = make()
            return self.inner.weight_mode.value
        # Every process must hand update_weights the same kind of params (merging is SPMD).
        self._weight_mode = WeightMode(dist.from_main(build, VLLMServerError))

    @property
    def weight_mode(self) -> WeightMode:
        return self._weight_mode

    def generate(self, weights, prompt_ids, num_generations, key, records=None) -> RolloutBatch:
        return dist.from_main(
            lambda: self.inner.generate(weights, prompt_ids, num_generations, key, records),
            VLLMServerError)

    def update_weights(self, weights, params) -> float:
        host = dist.to_host(weights)  # the params are spread over every process's devices
        return dist.from_main(lambda: self.inner.update_weights(host, None), VLLMServerError)

    @property
    def sync_metrics(self) -> dict:  # logged by process 0, the one that holds them
        return self.inner.sync_metrics if self.inner is not None else {}

    def prefetch(self, records, num_generations, key) -> None:
        return None

    def generated_with(self):
        return None

    def with_row_images(self, batch: RolloutBatch, records) -> RolloutBatch:
        if self.processor is None:
            return super().with_row_images(batch, records)
        return row_images.with_row_images(self.processor, self.model_cfg, self.pad, batch,
                                          records)


def make_rollout(cfg, model_cfg, tokenizer, mesh, model_dir, tools=(), *,
                 batch_divisor: int | None = None, hosts: int = 1) -> Rollout:
    """The config's backend; with `tools` (functions), inside the multi-turn tool loop. The
    part of the contract an ABC can't check (weight_mode is set by the constructor) is checked
    here, before the run starts. `batch_divisor`: the trainer mesh's, when the rollout runs on
    a mesh of its own (sampler_devices; default: `mesh`'s). `hosts`: the processes whose
    samplers each take a share of a batch's groups (rollout/native/sampler_hosts.py)."""
    rollout = _build(cfg, model_cfg, tokenizer, mesh, model_dir, tools, batch_divisor, hosts)
    if not isinstance(rollout.weight_mode, WeightMode):
        raise TypeError(f"{type(rollout).__name__}.weight_mode is {rollout.weight_mode!r}, "
                        "not a rollout.base.WeightMode")
    return rollout


def _build(cfg, model_cfg, tokenizer, mesh, model_dir, tools, batch_divisor, hosts):
    sp = sampling_params(cfg, tokenizer, hf.generation_eos_ids(model_dir) if model_dir else ())
    if cfg.rollout.backend == "jax":
        # SPMD over every process's devices
        partial = None
        # A rollout_func's whole episodes run a round ahead instead (async rounds, as with vLLM).
        ahead = bool(cfg.rollout.max_staleness and cfg.multi_turn.rollout_func)
        if cfg.rollout.max_staleness and not ahead:  # partial rollouts of a batch's groups
            divisor = (batch_divisor if batch_divisor is not None
                       else 1 if mesh is None else mesh_lib.batch_divisor(mesh))
            # A split run's sampler decodes with weights one version older than those that
            # train its tokens: its bound, checked against its own version, is one less.
            split = cfg.rollout.sampler_devices is not None
            g = cfg.grpo.num_generations
            groups = cfg.batch_plan(divisor).prompts_per_generation // hosts
            # max_inflight_tasks counts the run's rows: each host's sampler holds its share.
            tasks = cfg.rollout.max_inflight_tasks
            partial = (g, groups, cfg.rollout.max_staleness - split, group_slots_for(
                tasks if tasks < 0 else -(-tasks // hosts), cfg.rollout.max_staleness, g,
                groups, split))
        rollout = JaxRollout(model_cfg, sp, pad_id=pad_id(tokenizer), mesh=mesh,
                             peft=cfg.peft, partial_rollouts=partial,
                             processor=(None if model_cfg.vision is None
                                        else images.load_processor(model_dir)))
        if ahead:  # the sampler colocated with the trainer (config validation), one process
            if dist.multi_process():  # SPMD programs in a thread would misorder collectives
                raise ConfigError("max_staleness > 0 with a rollout_func on the JAX sampler "
                                  "runs in one process: launch one, or set max_staleness 0")
            from grpo_jax.rollout.async_rounds import AsyncRollout
            episodes = _episodes(cfg, rollout, tokenizer, tools, sp)
            # sampler_devices: `mesh` is the sampler's own, the weights copied onto it.
            place = (None if cfg.rollout.sampler_devices is None else
                     lambda w: jax.device_put(w, mesh_lib.param_shardings(w, mesh)))
            return AsyncRollout(episodes, cfg.rollout.max_staleness, ahead=episodes,
                                place=place)
    else:
        from grpo_jax.rollout.vllm.rollout import VLLMRollout

        vision = model_cfg is not None and model_cfg.vision is not None
        processor = images.load_processor(model_dir) if vision else None

        def make():
            return VLLMRollout(cfg, model_cfg, sp, pad_id(tokenizer), processor=processor)
        if cfg.rollout.max_staleness:
            return _async_rounds(cfg, make, tokenizer, tools, sp, vision)
        # Every process runs the tool loop, so every process places a tool's images.
        rollout = (MainProcessRollout(make, takes_records=vision, processor=processor,
                                      model_cfg=model_cfg, pad=pad_id(tokenizer))
                   if dist.multi_process() else make())
    return _episodes(cfg, rollout, tokenizer, tools, sp)


def _async_rounds(cfg, make, tokenizer, tools, sp, vision: bool):
    """A server's async rounds (the JAX sampler's, a rollout_func's: _build). Outermost: a
    round's whole episodes (every tool turn, the rollout_func's calls) run ahead on one weight
    version, since a push waits for the generation in flight. In a multi-process
    run they run on process 0 alone, in its background thread (tools too: no broadcast there),
    and the finished batch goes to every process as the round takes it."""
    from grpo_jax.rollout.async_rounds import AsyncRollout
    if not dist.multi_process():
        rollout = _episodes(cfg, make(), tokenizer, tools, sp)
        return AsyncRollout(rollout, cfg.rollout.max_staleness, ahead=rollout)
    shared = MainProcessRollout(
        lambda: _episodes(cfg, make(), tokenizer, tools, sp, shared=False),
        takes_records=bool(cfg.multi_turn.rollout_func) or vision)
    return AsyncRollout(shared, cfg.rollout.max_staleness, ahead=shared.inner)


def _episodes(cfg, rollout, tokenizer, tools, sp, shared: bool = True):
    """`rollout` inside what makes a round's episodes of it: a rollout_func, or the tool loop
    (`shared`: every process runs it, process 0 the tools; else this process alone)."""
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
                       cfg.data.chat_template_kwargs, shared=shared)
