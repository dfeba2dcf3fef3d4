"""The training configuration: one typed tree of frozen sections.

TrainConfig is the whole of it, one field per section; each section is a settings class of its own
(config/model.py, grpo.py, batch.py, rollout.py, run.py), so each field, its default, its help
line and its check exist once. Field names are TRL's GRPOConfig / TrainingArguments names and are
unique across sections, so a flat TRL-style YAML finds every key's section (grpo_jax.cli reads YAML
and the command line, and prints each field's help). Defaults follow TRL 1.16 unless a help line
says otherwise. This package imports no jax: reading a config loads no accelerator code.
"""

from __future__ import annotations

import dataclasses

import yaml

from grpo_jax.config.batch import BatchArgs, BatchPlan, OptimizerConfig
from grpo_jax.config.grpo import GRPOArgs, LossConfig
from grpo_jax.config.model import ModelArgs, Numerics, PeftArgs
from grpo_jax.config.rollout import MultiTurnArgs, RolloutArgs, SamplingParams
from grpo_jax.config.run import DataArgs, DistributedArgs, EvalArgs, MeshConfig, RunArgs
from grpo_jax.errors import check


__all__ = ["BatchArgs", "BatchPlan", "DataArgs", "DistributedArgs", "EvalArgs", "GRPOArgs",
           "LossConfig", "MeshConfig", "ModelArgs", "MultiTurnArgs", "Numerics",
           "OptimizerConfig", "PeftArgs", "RolloutArgs", "RunArgs", "SECTIONS", "SamplingParams",
           "TrainConfig"]


def _section(cls):
    return dataclasses.field(default_factory=cls)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A run's settings, by section (the YAML's and --help's order)."""

    model: ModelArgs = _section(ModelArgs)
    peft: PeftArgs = _section(PeftArgs)
    numerics: Numerics = _section(Numerics)
    data: DataArgs = _section(DataArgs)
    grpo: GRPOArgs = _section(GRPOArgs)
    loss: LossConfig = _section(LossConfig)
    generation: SamplingParams = _section(SamplingParams)
    optim: OptimizerConfig = _section(OptimizerConfig)
    batch: BatchArgs = _section(BatchArgs)
    eval: EvalArgs = _section(EvalArgs)
    rollout: RolloutArgs = _section(RolloutArgs)
    multi_turn: MultiTurnArgs = _section(MultiTurnArgs)
    mesh: MeshConfig = _section(MeshConfig)
    run: RunArgs = _section(RunArgs)
    distributed: DistributedArgs = _section(DistributedArgs)

    def __post_init__(self):
        check(self.generation.temperature > 0, "temperature must be > 0 (GRPO needs varied "
              f"samples), got {self.generation.temperature}")
        check(self.generation.max_num_seqs is None or self.rollout.backend == "jax",
              "max_num_seqs sets the JAX sampler's decode slots; a vLLM server schedules its "
              "own rows (start it with --max-num-seqs): set max_num_seqs: null")
        replay = self.numerics.router_replay
        # vLLM 0.32 returns routed experts (--enable-return-routed-experts) only from its Model
        # Runner V2, which needs Triton; its CPU build has none (config validation raises "Model
        # Runner V2 requires Triton"), so the path cannot run, or be tested, where this project
        # tests, and is not built: refuse rather than train on unreplayed routing.
        check(replay == "disabled" or self.rollout.backend == "jax", f"router_replay {replay} "
              "with vLLM rollouts: grpo-jax does not read vLLM's routed experts (vLLM 0.32 returns "
              "them only from Model Runner V2, which needs Triton: CPU builds cannot); use the "
              "JAX sampler (use_vllm: false) or router_replay: disabled")
        # Tool turns record their routing (rollout/tools.py); a rollout_func returns token
        # lists it assembled itself, which no sampler call's record can be matched to.
        check(replay == "disabled" or not self.multi_turn.rollout_func,
              f"router_replay {replay} with a rollout_func: the function builds its rows' "
              "tokens itself, so no routing the sampler recorded can be matched to them; set "
              "router_replay: disabled")
        gbs, g = self.batch.generation_batch_size, self.grpo.num_generations
        check(gbs is None or gbs % g == 0, f"generation_batch_size ({gbs}) must be divisible "
              f"by num_generations ({g}): a generation round holds whole prompt groups")
        check(not (self.grpo.sync_ref_model and not self.loss.beta),  # TRL raises it too
              "sync_ref_model is set while beta is 0: with beta 0 no reference model is kept, "
              "so there is nothing to synchronize. Set sync_ref_model false, or beta > 0")
        check(not (self.grpo.sync_ref_model and self.peft.use_peft), "sync_ref_model with "
              "use_peft: the reference is the base model with the adapters off, which never "
              "changes; set sync_ref_model false")
        cache = self.grpo.soft_punish_cache
        check(cache is None or cache <= self.generation.max_completion_length,
              f"soft_punish_cache ({cache}) must be at most max_completion_length "
              f"({self.generation.max_completion_length}): the penalty starts that many tokens "
              "before it")
        jax_async = self.rollout.max_staleness and self.rollout.backend == "jax"
        # A rollout_func's whole episodes are generated a round ahead (async rounds, as with
        # vLLM: rollout/async_rounds.py); anything else runs partial rollouts.
        ahead = jax_async and bool(self.multi_turn.rollout_func)
        partial = jax_async and not ahead
        check(not partial or (self.generation.max_num_seqs is not None
                              and self.generation.continuous_batching),
              "max_staleness > 0 with the JAX sampler runs partial rollouts through its decode "
              "slots: set max_num_seqs (and continuous_batching true), or max_staleness 0")
        check(self.rollout.max_inflight_tasks == -1 or partial, "max_inflight_tasks bounds "
              "the rows in flight of partial rollouts (max_staleness >= 1 on the JAX sampler, "
              "no rollout_func); vLLM's async rounds and a rollout_func's generate one batch "
              "ahead: unset max_inflight_tasks")
        split = self.rollout.sampler_devices is not None
        check(not ahead or not self.rollout.sampler_process,
              "max_staleness > 0 with a rollout_func on the JAX sampler generates its episodes "
              "a round ahead in a thread of this process (on sampler_devices of their own, or "
              "the trainer's), not in a sampler process: unset sampler_process")
        check(not ahead or (self.distributed.num_processes or 1) == 1,
              "max_staleness > 0 with a rollout_func on the JAX sampler generates a round ahead "
              "in a thread of one process: unset num_processes (one process), or set "
              "max_staleness 0")
        check(not split or ahead or partial and self.generation.max_num_seqs is not None,
              "sampler_devices runs partial rollouts (or a rollout_func's episodes a round "
              "ahead) on devices of their own: it needs max_staleness >= 1, the JAX sampler "
              "(use_vllm false) and max_num_seqs (or a rollout_func)")
        check(not split or (self.distributed.num_processes or 1) == 1
              or self.rollout.sampler_process,
              "sampler_devices in a multi-process run needs sampler_process: each process's "
              "sampler runs in a process of its own on its host's sampler_devices; set "
              "sampler_process true")

    def batch_plan(self, data_parallel_size: int = 1) -> BatchPlan:
        """TRL's batch relations for `data_parallel_size` shards (TRL: num_processes)."""
        b, g = self.batch, self.grpo.num_generations
        micro = b.per_device_train_batch_size * data_parallel_size
        if b.generation_batch_size is not None:
            check(b.generation_batch_size % micro == 0,
                  f"generation_batch_size ({b.generation_batch_size}) must be divisible by the "
                  f"global micro-batch per_device_train_batch_size * data-parallel size = {micro}")
            spg = b.generation_batch_size // micro
        else:
            spg = b.steps_per_generation or b.gradient_accumulation_steps
        gbs = micro * spg
        check(gbs % g == 0, f"generation batch {gbs} (per_device_train_batch_size "
              f"{b.per_device_train_batch_size} x data-parallel {data_parallel_size} x "
              f"steps_per_generation {spg}) must be divisible by num_generations ({g}): adjust "
              f"one of them or set generation_batch_size")
        return BatchPlan(data_parallel_size, micro, b.gradient_accumulation_steps, spg, gbs, g,
                         self.grpo.num_iterations, b.pad_to_multiple_of)

    def eval_prompts_per_batch(self, data_parallel_size: int = 1) -> int:
        """Prompts per eval batch: per_device_eval_batch_size completions per shard, in groups
        of num_generations_eval (TRL's check)."""
        rows = self.eval.per_device_eval_batch_size * data_parallel_size
        g = self.eval.num_generations_eval or self.grpo.num_generations
        check(rows % g == 0, f"the global eval batch size (per_device_eval_batch_size "
              f"{self.eval.per_device_eval_batch_size} x data-parallel {data_parallel_size}) "
              f"must be divisible by the number of generations used for evaluation ({g}): "
              "adjust per_device_eval_batch_size or num_generations_eval")
        return rows // g

    def to_dict(self) -> dict:
        """Sectioned plain data (lists for tuples): `load_config` reads it back unchanged."""
        return {name: {k: list(v) if isinstance(v, tuple) else v
                       for k, v in dataclasses.asdict(getattr(self, name)).items()}
                for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# Section name -> its settings class, in TrainConfig's order.
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}
