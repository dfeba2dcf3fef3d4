"""The training configuration's schema: one typed tree of frozen sections.

Each section is the settings dataclass of the module that uses it (the loss, sampling, mesh and
optimizer settings live beside their code; the rest are here), so each field, its default and
its check exist once. Field names are TRL's GRPOConfig / TrainingArguments names and are unique
across sections, so a flat TRL-style YAML finds every key's section (grpo_jax.cli reads YAML and
the command line). Defaults follow TRL 1.16 unless a comment says otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

import yaml

from grpo_jax.errors import check as _check
from grpo_jax.evaluation import EvalArgs
from grpo_jax.grpo.loss import LossConfig
from grpo_jax.grpo.optimizer import OptimizerConfig
from grpo_jax.mesh import MeshConfig
from grpo_jax.models.config import Numerics
from grpo_jax.models.lora import PeftArgs
from grpo_jax.rollout.sampling import SamplingParams
from grpo_jax.rollout.tools import MultiTurnArgs

@dataclass(frozen=True)
class ModelArgs:
    name_or_path: str = "smollm2-135m-instruct"


@dataclass(frozen=True)
class DataArgs:
    # A hub id, a local .json/.jsonl/.csv/.parquet file or directory, or a built-in
    # ('smol_prompts': the shipped Reddit-style posts; 'arithmetic': synthetic sums).
    dataset_name: str = "smol_prompts"
    dataset_config: str | None = None
    dataset_train_split: str = "train"
    dataset_test_split: str = "test"  # the eval split (with eval_strategy / eval_on_start)
    # Evaluate on another dataset (same forms as dataset_name); None: dataset_name's test split.
    eval_dataset_name: str | None = None
    prompt_column: str = "prompt"
    # TRL removed this in 0.28 ("filter your dataset") and no longer truncates (the default
    # here too); set it to cut longer prompts' left end (load_prompts reports how many).
    max_prompt_length: int | None = None
    shuffle_dataset: bool = True
    seed: int = 42  # data order and synthetic data; the trainer derives its sampling key from it
    # open-r1: every prompt becomes a chat led by this system message.
    system_prompt: str | None = None
    chat_template: str | None = None  # replaces the tokenizer's (a Jinja string)
    # To apply_chat_template, e.g. {enable_thinking: false} (Qwen3).
    chat_template_kwargs: dict | None = None

    def __post_init__(self):
        _check(self.max_prompt_length is None or self.max_prompt_length >= 1,
               f"max_prompt_length must be >= 1 or null, got {self.max_prompt_length}")


@dataclass(frozen=True)
class GRPOArgs:
    """Groups, rewards and how often a generation batch is reused."""
    num_generations: int = 8
    scale_rewards: Literal["group", "batch", "none"] = "group"
    num_iterations: int = 1
    # Built-in names, 'package.module:function', 'path/to/file.py:function', or reward models:
    # a directory or hub id of a ...ForSequenceClassification checkpoint (grpo_jax.reward_model).
    reward_funcs: tuple[str, ...] = ("reward_len",)
    # TRL's GRPOTrainer argument: one tokenizer (directory or hub id) per reward function, used
    # for a reward model (null: the model's own), ignored for a function. None: all null.
    reward_processing_classes: tuple[str | None, ...] | None = None
    reward_weights: tuple[float, ...] | None = None  # None: all 1.0
    # How several reward functions make one advantage (grpo_jax.grpo.advantages).
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = (
        "sum_then_normalize")
    # TR-DPO: every ref_model_sync_steps optimizer steps, ref = alpha * policy + (1 - alpha) * ref
    # (needs beta > 0: with beta 0 there is no reference model).
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    # The reward soft_overlong_punishment (DAPO, TRL's get_soft_overlong_punishment): its
    # penalty starts this many tokens before max_completion_length. Needed when it is named.
    soft_punish_cache: int | None = None
    # DAPO's dynamic sampling (verl: algorithm.filter_groups): groups whose rewards all agree
    # (std 0) are dropped and more prompts are generated until the generation batch is full of
    # groups with signal, at most max_num_gen_batches generations per batch (<= 0: no limit;
    # 10 as DAPO's recipe, verl's default is 0), then the run stops with an error.
    dynamic_sampling: bool = False
    max_num_gen_batches: int = 10

    def __post_init__(self):
        _check(self.num_generations >= 2, "num_generations must be >= 2: GRPO's advantage "
               f"compares completions of the same prompt (got {self.num_generations})")
        _check(self.num_iterations >= 1, f"num_iterations must be >= 1, got {self.num_iterations}")
        _check(len(self.reward_funcs) >= 1, "reward_funcs is empty: name at least one, e.g. "
               "reward_funcs: [reward_len]")
        _check(self.reward_weights is None or len(self.reward_weights) == len(self.reward_funcs),
               f"reward_weights has {len(self.reward_weights or ())} entries but reward_funcs "
               f"has {len(self.reward_funcs)}: give one weight per function")
        _check(self.reward_processing_classes is None
               or len(self.reward_processing_classes) == len(self.reward_funcs),
               f"reward_processing_classes has {len(self.reward_processing_classes or ())} "
               f"entries but reward_funcs has {len(self.reward_funcs)}: give one per function "
               "(null for a reward model's own tokenizer; functions ignore theirs)")
        _check(self.multi_objective_aggregation in ("sum_then_normalize", "normalize_then_sum"),
               "multi_objective_aggregation must be 'sum_then_normalize' or "
               f"'normalize_then_sum', got {self.multi_objective_aggregation!r}")
        _check(0.0 <= self.ref_model_mixup_alpha <= 1.0, "ref_model_mixup_alpha must be in "
               f"[0, 1], got {self.ref_model_mixup_alpha}")
        _check(self.ref_model_sync_steps >= 1,
               f"ref_model_sync_steps must be >= 1, got {self.ref_model_sync_steps}")
        _check(self.soft_punish_cache is None or self.soft_punish_cache >= 0,
               f"soft_punish_cache must be >= 0 tokens, got {self.soft_punish_cache}")
        _check(self.soft_punish_cache is not None
               or "soft_overlong_punishment" not in self.reward_funcs,
               "soft_overlong_punishment needs soft_punish_cache: the penalty ramps from 0 at "
               "max_completion_length - soft_punish_cache tokens to -1 at max_completion_length "
               "(DAPO: 4096 of 20480)")


@dataclass(frozen=True)
class BatchArgs:
    per_device_train_batch_size: int = 8  # completions per micro-step per data-parallel shard
    gradient_accumulation_steps: int = 1
    generation_batch_size: int | None = None  # completions per generation round; set this
    steps_per_generation: int | None = None   # ... or this, not both
    max_steps: int = -1  # > 0 overrides num_train_epochs
    num_train_epochs: float = 3.0

    def __post_init__(self):
        _check(self.per_device_train_batch_size >= 1 and self.gradient_accumulation_steps >= 1,
               "per_device_train_batch_size and gradient_accumulation_steps must be >= 1")
        _check(self.generation_batch_size is None or self.steps_per_generation is None,
               "generation_batch_size and steps_per_generation can't both be set: set one "
               "(generation_batch_size = per_device_train_batch_size * data-parallel size * "
               "steps_per_generation)")
        _check((self.generation_batch_size or 1) >= 1 and (self.steps_per_generation or 1) >= 1,
               "generation_batch_size and steps_per_generation must be >= 1 when set")
        _check(self.max_steps == -1 or self.max_steps >= 1,
               f"max_steps must be -1 (use num_train_epochs) or >= 1, got {self.max_steps}")
        _check(self.num_train_epochs > 0,
               f"num_train_epochs must be > 0, got {self.num_train_epochs}")


@dataclass(frozen=True)
class RolloutArgs:
    backend: Literal["jax", "vllm"] = "jax"  # TRL: use_vllm (server mode)
    vllm_server_base_url: str | None = None  # overrides host and port
    vllm_server_host: str = "127.0.0.1"  # TRL: 0.0.0.0; `grpo_jax.serve` binds loopback
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0  # seconds to wait for the server to come up
    # Needed when the server binds a non-loopback address; default: $VLLM_API_KEY.
    vllm_server_api_key: str | None = None
    # vLLM backend: more sampling options for the server's requests (vLLM's names), and
    # structured outputs constrained to a regex. The JAX sampler has neither.
    generation_kwargs: dict | None = None
    vllm_structured_outputs_regex: str | None = None
    # LoRA runs: after each update push only the adapter, which the server loads with vLLM's
    # LoRA (started with `grpo_jax.serve --lora-rank R`), or the base with the adapters merged
    # (full weights). A server without run-time LoRA gets merged weights, with a notice.
    vllm_lora_sync: Literal["adapter", "merged"] = "adapter"
    # How weights reach the server after each update (docs/vllm_weight_sync.md): `http` in the
    # bodies of vLLM's weight-sync routes (no shared filesystem: a server on another host),
    # `shm` through a file in /dev/shm (same machine only), `nccl` GPU to GPU through vLLM's
    # NCCL engine (untested: no GPU with vLLM here), `auto` the server's engine (grpo_http or
    # nccl), else shm.
    vllm_weight_sync: Literal["auto", "http", "shm", "nccl"] = "auto"
    weight_sync_timeout: float = 1800.0  # TRL AsyncGRPOConfig: seconds a weight update may take
    # Async rounds (grpo_jax.rollout.async_rounds): 0 generates each round with the weights of
    # the update just before it (TRL GRPOTrainer); >= 1 generates round n+1 during round n's
    # update and discards a batch more than this many weight versions old (TRL AsyncGRPOConfig:
    # max_staleness, 4 there).
    max_staleness: int = 0

    def __post_init__(self):
        _check(0 < self.vllm_server_port < 65536, f"vllm_server_port {self.vllm_server_port} "
               "is not a TCP port")
        _check(self.vllm_server_timeout > 0, "vllm_server_timeout must be > 0")
        _check(self.weight_sync_timeout > 0, "weight_sync_timeout must be > 0")
        _check(self.max_staleness >= 0, f"max_staleness must be >= 0, got {self.max_staleness}")
        _check(not self.max_staleness or self.backend == "vllm", "max_staleness (async rounds) "
               "needs vLLM rollouts (use_vllm: true): the JAX sampler shares the trainer's devices")
        for name in ("generation_kwargs", "vllm_structured_outputs_regex"):
            _check(self.backend == "vllm" or not getattr(self, name), f"{name} applies to vLLM "
                   "rollouts (use_vllm: true); the JAX sampler's options are the generation "
                   "settings (temperature, top_p, top_k, min_p, repetition_penalty)")
        own = set(dataclasses.asdict(SamplingParams())) | {"max_tokens", "n", "seed", "logprobs"}
        clash = sorted(own & set(self.generation_kwargs or {}))
        _check(not clash, f"generation_kwargs {clash}: these are settings of their own (the "
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


def _steps_or_ratio(value: float, total_steps: int) -> int:
    """transformers' logging_steps / save_steps / eval_steps: a whole number of optimizer steps,
    or a fraction < 1 of the run's: ceil(total_steps * fraction)."""
    return max(math.ceil(total_steps * value) if value < 1 else int(value), 1)


@dataclass(frozen=True)
class RunArgs:
    output_dir: str = "outputs/grpo"
    # Optimizer steps per metrics record (TRL averages its metrics over them); < 1: a fraction
    # of the run's steps, as transformers.
    logging_steps: float = 10
    logging_first_step: bool = False  # also a record after the first step
    save_steps: float = 500  # < 1: a fraction of the run's steps, as transformers
    save_total_limit: int | None = None  # None: keep all checkpoints
    log_completions: bool = False  # completions.jsonl (and a W&B table), a sample printed
    num_completions_to_print: int | None = None  # of each round's; None: all (TRL)
    log_unique_prompts: bool = False  # the W&B table keeps one row per prompt (TRL)
    # TRL's default is 'none'; tensorboardX is a dependency here, so its log is on by default.
    report_to: tuple[Literal["tensorboard", "wandb"], ...] = ("tensorboard",)
    # Continue from the newest checkpoint in output_dir (true), or from a checkpoint of this run
    # (its directory, output_dir/checkpoints/STEP: TRL's resume_from_checkpoint PATH).
    resume: bool | str = False

    def __post_init__(self):
        for name in ("logging_steps", "save_steps"):
            v = getattr(self, name)
            _check(v > 0 and (v < 1 or float(v).is_integer()), f"{name} must be a whole number "
                   f"of steps, or a fraction in (0, 1) of the run's steps, got {v}")
        _check(self.save_total_limit is None or self.save_total_limit >= 1,
               f"save_total_limit must be >= 1 or null, got {self.save_total_limit}")
        _check(self.num_completions_to_print is None or self.num_completions_to_print >= 0,
               f"num_completions_to_print must be >= 0 or null, got "
               f"{self.num_completions_to_print}")

    def steps_of(self, total_steps: int) -> tuple[int, int]:
        """(logging, saving) intervals in optimizer steps for a run of total_steps."""
        return (_steps_or_ratio(self.logging_steps, total_steps),
                _steps_or_ratio(self.save_steps, total_steps))


@dataclass(frozen=True)
class DistributedArgs:
    # One of several processes (grpo_jax.distributed; docs/multihost.md). Unset: from
    # $GRPO_JAX_COORDINATOR / $JAX_COORDINATOR_ADDRESS, $GRPO_JAX_NUM_PROCESSES and
    # $GRPO_JAX_PROCESS_ID, else detected under srun and on Cloud TPU pods, else one process.
    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout: int = 100  # seconds without a peer's heartbeat before all processes end

    def __post_init__(self):
        _check(self.num_processes is None or self.num_processes >= 1,
               f"num_processes must be >= 1, got {self.num_processes}")
        _check(self.process_id is None or self.process_id >= 0,
               f"process_id must be >= 0, got {self.process_id}")
        _check(self.heartbeat_timeout >= 1,
               f"heartbeat_timeout must be >= 1 second, got {self.heartbeat_timeout}")


@dataclass(frozen=True)
class BatchPlan:
    """How one generation round splits into micro-steps, resolved for a data-parallel size."""
    data_parallel_size: int
    micro_batch_size: int  # completions per micro-step over all shards
    gradient_accumulation_steps: int
    steps_per_generation: int
    generation_batch_size: int
    num_generations: int
    num_iterations: int

    @property
    def prompts_per_generation(self) -> int:
        return self.generation_batch_size // self.num_generations

    @property
    def needs_old_logps(self) -> bool:
        """TRL's rule: a generation batch is trained on by more than one optimizer update (or
        not from the start of one) unless gradient_accumulation_steps is a multiple of the
        micro-steps it feeds (steps_per_generation * num_iterations); only then can params
        change between generating and training, and the old log-probs differ."""
        return self.gradient_accumulation_steps % (self.steps_per_generation
                                                    * self.num_iterations) != 0

    def micro_steps_per_epoch(self, num_prompts: int) -> int:
        """transformers' steps_in_epoch: micro-steps (batches of TRL's dataloader) per epoch;
        an epoch's tail too short for a generation batch is skipped."""
        rounds = num_prompts // self.prompts_per_generation
        return rounds * self.steps_per_generation * self.num_iterations

    def updates_per_epoch(self, num_prompts: int) -> int:
        """transformers' num_update_steps_per_epoch: an epoch's micro-steps in windows of
        gradient_accumulation_steps, the last one partial when they do not divide."""
        return max(-(-self.micro_steps_per_epoch(num_prompts)
                     // self.gradient_accumulation_steps), 1)

    def total_steps(self, num_prompts: int, max_steps: int, num_train_epochs: float) -> int:
        """Optimizer steps in the run (TRL's rule: max_steps wins when > 0)."""
        if max_steps > 0:
            return max_steps
        return max(1, math.ceil(num_train_epochs * self.updates_per_epoch(num_prompts)))

    def num_train_epochs(self, num_prompts: int, total_steps: int) -> int:
        """transformers' state.num_train_epochs: the epochs the run's steps touch."""
        return -(-total_steps // self.updates_per_epoch(num_prompts))

    def epoch(self, step: int, num_prompts: int) -> float:
        """The fractional epoch transformers logs after optimizer step `step`: whole epochs
        plus micro-steps done / micro-steps of the epoch (an epoch ends with its own window,
        partial when its micro-steps are not a multiple of gradient_accumulation_steps)."""
        micro = max(self.micro_steps_per_epoch(num_prompts), 1)
        done, rest = divmod(step, self.updates_per_epoch(num_prompts))
        return done + min(rest * self.gradient_accumulation_steps, micro) / micro


class _TrainConfig:
    """TrainConfig's checks and helpers; its fields are the SECTIONS below."""

    def __post_init__(self):
        _check(self.generation.temperature > 0, "temperature must be > 0 (GRPO needs varied "
               f"samples), got {self.generation.temperature}")
        _check(self.generation.max_num_seqs is None or self.rollout.backend == "jax",
               "max_num_seqs sets the JAX sampler's decode slots; a vLLM server schedules its "
               "own rows (start it with --max-num-seqs): set max_num_seqs: null")
        gbs, g = self.batch.generation_batch_size, self.grpo.num_generations
        _check(gbs is None or gbs % g == 0, f"generation_batch_size ({gbs}) must be divisible "
               f"by num_generations ({g}): a generation round holds whole prompt groups")
        _check(not (self.grpo.sync_ref_model and not self.loss.beta),  # TRL raises it too
               "sync_ref_model is set while beta is 0: with beta 0 no reference model is kept, "
               "so there is nothing to synchronize. Set sync_ref_model false, or beta > 0")
        _check(not (self.grpo.sync_ref_model and self.peft.use_peft), "sync_ref_model with "
               "use_peft: the reference is the base model with the adapters off, which never "
               "changes; set sync_ref_model false")
        cache = self.grpo.soft_punish_cache
        _check(cache is None or cache <= self.generation.max_completion_length,
               f"soft_punish_cache ({cache}) must be at most max_completion_length "
               f"({self.generation.max_completion_length}): the penalty starts that many tokens "
               "before it")
        _check(not (self.grpo.dynamic_sampling and self.rollout.max_staleness),
               "dynamic_sampling with max_staleness > 0: async rounds generate the next batch's "
               "prompts before this batch knows how many prompts it takes to fill with groups "
               "that have reward signal; set max_staleness 0 (or dynamic_sampling false)")

    def batch_plan(self, data_parallel_size: int = 1) -> BatchPlan:
        """TRL's batch relations for `data_parallel_size` shards (TRL: num_processes)."""
        b, g = self.batch, self.grpo.num_generations
        micro = b.per_device_train_batch_size * data_parallel_size
        if b.generation_batch_size is not None:
            _check(b.generation_batch_size % micro == 0,
                   f"generation_batch_size ({b.generation_batch_size}) must be divisible by the "
                   f"global micro-batch per_device_train_batch_size * data-parallel size = {micro}")
            spg = b.generation_batch_size // micro
        else:
            spg = b.steps_per_generation or b.gradient_accumulation_steps
        gbs = micro * spg
        _check(gbs % g == 0, f"generation batch {gbs} (per_device_train_batch_size "
               f"{b.per_device_train_batch_size} x data-parallel {data_parallel_size} x "
               f"steps_per_generation {spg}) must be divisible by num_generations ({g}): adjust "
               f"one of them or set generation_batch_size")
        return BatchPlan(data_parallel_size, micro, b.gradient_accumulation_steps, spg, gbs, g,
                         self.grpo.num_iterations)

    def eval_prompts_per_batch(self, data_parallel_size: int = 1) -> int:
        """Prompts per eval batch: per_device_eval_batch_size completions per shard, in groups
        of num_generations_eval (TRL's check)."""
        rows = self.eval.per_device_eval_batch_size * data_parallel_size
        g = self.eval.num_generations_eval or self.grpo.num_generations
        _check(rows % g == 0, f"the global eval batch size (per_device_eval_batch_size "
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


# Section name -> its settings dataclass. TrainConfig is a frozen dataclass with one field per
# section, in this order, each defaulting to its dataclass's defaults.
SECTIONS: dict[str, type] = {
    "model": ModelArgs, "peft": PeftArgs, "numerics": Numerics, "data": DataArgs, "grpo": GRPOArgs,
    "loss": LossConfig, "generation": SamplingParams, "optim": OptimizerConfig,
    "batch": BatchArgs, "eval": EvalArgs, "rollout": RolloutArgs, "multi_turn": MultiTurnArgs,
    "mesh": MeshConfig,
    "run": RunArgs, "distributed": DistributedArgs,
}
TrainConfig = dataclasses.make_dataclass(
    "TrainConfig", [(name, cls, field(default_factory=cls)) for name, cls in SECTIONS.items()],
    bases=(_TrainConfig,), frozen=True, namespace={"__module__": __name__})
