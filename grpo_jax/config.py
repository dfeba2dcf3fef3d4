"""The training configuration: one typed tree of frozen sections, named after TRL's GRPOConfig.

A YAML file may be sectioned (`grpo: {beta: 0.04}`) or flat with TRL's names (`beta: 0.04`):
every field name is unique across sections, so a flat key finds its section. Defaults follow
TRL 1.9 (GRPOConfig + transformers' TrainingArguments) unless a comment says otherwise.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config key or value that can't be used; the message names it and the fix."""


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


Dtype = Literal["bfloat16", "float16", "float32"]


@dataclass(frozen=True)
class ModelArgs:
    name_or_path: str = "smollm2-135m-instruct"
    dtype: Dtype = "bfloat16"  # compute dtype of matmuls
    param_dtype: Dtype = "float32"  # master weights and optimizer state
    remat: bool = True  # TRL: gradient_checkpointing (default True)
    # With remat, what each layer keeps for the backward pass: "full" only its input (least
    # memory); "dots" also its matmul outputs (no matmul recomputed; more activation memory).
    remat_policy: Literal["full", "dots"] = "full"


@dataclass(frozen=True)
class DataArgs:
    # A hub id, a local .json/.jsonl/.csv/.parquet file or directory, or a built-in
    # ('smol_prompts': the shipped Reddit-style posts; 'arithmetic': synthetic sums).
    dataset_name: str = "smol_prompts"
    dataset_config: str | None = None
    dataset_train_split: str = "train"
    prompt_column: str = "prompt"
    # TRL removed this in 0.28 ("filter your dataset"); we keep it: longer prompts lose their
    # left end, and load_prompts reports how many did.
    max_prompt_length: int | None = 512
    shuffle_dataset: bool = True
    seed: int = 42  # data order and synthetic data; the trainer derives its sampling key from it

    def __post_init__(self):
        _check(self.max_prompt_length is None or self.max_prompt_length >= 1,
               f"max_prompt_length must be >= 1 or null, got {self.max_prompt_length}")


@dataclass(frozen=True)
class GRPOArgs:
    num_generations: int = 8
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: same as epsilon
    delta: float | None = None  # two-sided clipping bound (INTELLECT-2); None: off
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    num_iterations: int = 1
    importance_sampling_level: Literal["token", "sequence"] = "token"
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0
    reward_funcs: tuple[str, ...] = ("reward_len",)
    reward_weights: tuple[float, ...] | None = None  # None: all 1.0
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0

    def __post_init__(self):
        _check(self.num_generations >= 2, "num_generations must be >= 2: GRPO's advantage "
               f"compares completions of the same prompt (got {self.num_generations})")
        _check(self.beta >= 0, f"beta must be >= 0, got {self.beta}")
        _check(self.epsilon > 0, f"epsilon must be > 0, got {self.epsilon}")
        _check(self.epsilon_high is None or self.epsilon_high > 0,
               f"epsilon_high must be > 0 or null, got {self.epsilon_high}")
        _check(self.delta is None or self.delta > 1,
               f"delta bounds the ratio from above and must be > 1 (or null), got {self.delta}")
        _check(self.num_iterations >= 1, f"num_iterations must be >= 1, got {self.num_iterations}")
        _check(0.0 <= self.top_entropy_quantile <= 1.0,
               f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")
        _check(len(self.reward_funcs) >= 1, "reward_funcs is empty: name at least one, e.g. "
               "reward_funcs: [reward_len]")
        _check(self.reward_weights is None or len(self.reward_weights) == len(self.reward_funcs),
               f"reward_weights has {len(self.reward_weights or ())} entries but reward_funcs "
               f"has {len(self.reward_funcs)}: give one weight per function")
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        _check(lo is None or hi is None or lo < hi, f"vllm_importance_sampling_clip_min ({lo}) "
               f"must be < vllm_importance_sampling_clip_max ({hi})")
        _check(not (self.vllm_importance_sampling_correction
                    and self.vllm_importance_sampling_mode.endswith("_truncate")
                    and lo is None and hi is None),
               "a *_truncate vllm_importance_sampling_mode needs vllm_importance_sampling_clip_min "
               "or vllm_importance_sampling_clip_max")


@dataclass(frozen=True)
class GenerationArgs:
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float | None = None
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's eos

    def __post_init__(self):
        _check(self.max_completion_length >= 1,
               f"max_completion_length must be >= 1, got {self.max_completion_length}")
        _check(self.temperature > 0, f"temperature must be > 0 (GRPO needs varied samples), "
               f"got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check(self.min_p is None or 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")


@dataclass(frozen=True)
class OptimArgs:
    learning_rate: float = 1e-6
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "linear", "cosine"] = "linear"
    # transformers 5: a value < 1 is a fraction of the total steps (TRL's old warmup_ratio).
    warmup_steps: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0: no clipping

    def __post_init__(self):
        _check(self.learning_rate >= 0, f"learning_rate must be >= 0, got {self.learning_rate}")
        w = self.warmup_steps
        _check(w >= 0 and (w < 1 or float(w).is_integer()),
               f"warmup_steps must be a whole number of steps or a fraction in [0, 1), "
               f"got {self.warmup_steps}")
        _check(not (self.lr_scheduler_type == "constant" and self.warmup_steps > 0),
               "lr_scheduler_type 'constant' has no warmup: use 'constant_with_warmup'")
        _check(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
               f"adam_beta1/adam_beta2 must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}")
        _check(self.weight_decay >= 0 and self.adam_epsilon > 0 and self.max_grad_norm >= 0,
               "weight_decay and max_grad_norm must be >= 0 and adam_epsilon > 0")

    def num_warmup_steps(self, total_steps: int) -> int:
        """Warmup length in optimizer steps (transformers 5's rule)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(total_steps * self.warmup_steps)


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

    def __post_init__(self):
        _check(0 < self.vllm_server_port < 65536, f"vllm_server_port {self.vllm_server_port} "
               "is not a TCP port")
        _check(self.vllm_server_timeout > 0, "vllm_server_timeout must be > 0")

    @property
    def base_url(self) -> str:
        if self.vllm_server_base_url:
            return self.vllm_server_base_url.rstrip("/")
        return f"http://{self.vllm_server_host}:{self.vllm_server_port}"


@dataclass(frozen=True)
class MeshArgs:
    # Device-mesh axis sizes; one of them may be -1 (= all remaining devices).
    dp: int = -1
    fsdp: int = 1
    tp: int = 1

    def __post_init__(self):
        sizes = (self.dp, self.fsdp, self.tp)
        _check(all(s == -1 or s >= 1 for s in sizes) and sizes.count(-1) <= 1,
               f"mesh sizes (dp, fsdp, tp) = {sizes}: each must be >= 1, and at most one -1")

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """(dp, fsdp, tp) for `num_devices` devices, the -1 axis taking what is left."""
        sizes = [self.dp, self.fsdp, self.tp]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            _check(num_devices % known == 0, f"mesh {sizes}: {num_devices} devices are not "
                   f"divisible by the fixed axes' product {known}")
            sizes[sizes.index(-1)] = num_devices // known
        _check(math.prod(sizes) == num_devices, f"mesh (dp, fsdp, tp) = {tuple(sizes)} needs "
               f"{math.prod(sizes)} devices but {num_devices} are in use; set one size to -1")
        return tuple(sizes)


@dataclass(frozen=True)
class RunArgs:
    output_dir: str = "outputs/grpo"
    logging_steps: int = 10
    save_steps: int = 500
    save_total_limit: int | None = None  # None: keep all checkpoints
    log_completions: bool = False
    # TRL's default is 'none'; tensorboardX is a dependency here, so its log is on by default.
    report_to: tuple[Literal["tensorboard", "wandb"], ...] = ("tensorboard",)
    resume: bool = False  # continue from the newest checkpoint in output_dir

    def __post_init__(self):
        _check(self.logging_steps >= 1 and self.save_steps >= 1,
               "logging_steps and save_steps must be >= 1")
        _check(self.save_total_limit is None or self.save_total_limit >= 1,
               f"save_total_limit must be >= 1 or null, got {self.save_total_limit}")


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

    def total_steps(self, num_prompts: int, max_steps: int, num_train_epochs: float) -> int:
        """Optimizer steps in the run (TRL's rule: max_steps wins when > 0)."""
        if max_steps > 0:
            return max_steps
        rounds = num_prompts // self.prompts_per_generation
        micro = rounds * self.steps_per_generation * self.num_iterations
        return max(1, math.ceil(num_train_epochs * micro / self.gradient_accumulation_steps))


SECTIONS: dict[str, type] = {
    "model": ModelArgs, "data": DataArgs, "grpo": GRPOArgs, "generation": GenerationArgs,
    "optim": OptimArgs, "batch": BatchArgs, "rollout": RolloutArgs, "mesh": MeshArgs,
    "run": RunArgs, "distributed": DistributedArgs,
}


@dataclass(frozen=True)
class TrainConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    grpo: GRPOArgs = field(default_factory=GRPOArgs)
    generation: GenerationArgs = field(default_factory=GenerationArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    batch: BatchArgs = field(default_factory=BatchArgs)
    rollout: RolloutArgs = field(default_factory=RolloutArgs)
    mesh: MeshArgs = field(default_factory=MeshArgs)
    run: RunArgs = field(default_factory=RunArgs)
    distributed: DistributedArgs = field(default_factory=DistributedArgs)

    def __post_init__(self):
        gbs, g = self.batch.generation_batch_size, self.grpo.num_generations
        _check(gbs is None or gbs % g == 0, f"generation_batch_size ({gbs}) must be divisible "
               f"by num_generations ({g}): a generation round holds whole prompt groups")

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

    def to_dict(self) -> dict:
        """Sectioned plain data (lists for tuples): `load_config` reads it back unchanged."""
        return {name: {k: list(v) if isinstance(v, tuple) else v
                       for k, v in dataclasses.asdict(getattr(self, name)).items()}
                for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------- names and values

FIELD_SECTION: dict[str, str] = {}
for _sec, _cls in SECTIONS.items():
    for _f in dataclasses.fields(_cls):
        assert _f.name not in FIELD_SECTION and _f.name not in SECTIONS, _f.name
        FIELD_SECTION[_f.name] = _sec
_TYPES = {sec: typing.get_type_hints(cls) for sec, cls in SECTIONS.items()}

# TRL spellings of our fields: flat name -> (our name, value transform).
ALIASES: dict[str, tuple[str, Any]] = {
    "model_name_or_path": ("name_or_path", None),  # trl.ModelConfig
    "torch_dtype": ("dtype", None),
    "gradient_checkpointing": ("remat", None),
    "use_vllm": ("backend", lambda v: "vllm" if v is True else "jax" if v is False else v),
    "vllm_importance_sampling_cap": ("vllm_importance_sampling_clip_max", None),  # deprecated
    "warmup_ratio": ("warmup_steps", None),
}
# TRL options that have no counterpart here, and what to do instead.
UNSUPPORTED = {
    "bf16": "set dtype: bfloat16 (or float32)",
    "fp16": "set dtype: float16",
    "vllm_mode": "grpo-jax talks to a vLLM server only: set use_vllm: true and drop vllm_mode",
    "use_peft": "grpo-jax trains all parameters (no LoRA); drop the peft options",
    "optim": "grpo-jax always uses AdamW (optax.adamw); drop optim",
}
_NONE_WORDS = ("none", "null", "~")


def _is_none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.lower() in _NONE_WORDS)


def _err_unknown(key: str, names, where: str = "") -> ConfigError:
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r}{where}{hint}")


def resolve_key(key: str) -> tuple[str, str, Any]:
    """'beta' or 'grpo.beta' or a TRL alias -> (section, field, value transform or None)."""
    if "." in key:
        sec, name = key.split(".", 1)
        if sec not in SECTIONS:
            raise _err_unknown(key, [f"{s}.{f}" for f, s in FIELD_SECTION.items()])
        if FIELD_SECTION.get(name) != sec:
            if name in FIELD_SECTION:
                raise ConfigError(f"{name!r} is in section {FIELD_SECTION[name]!r}, not {sec!r}: "
                                  f"write {FIELD_SECTION[name]}.{name} (or just {name})")
            fields = [f.name for f in dataclasses.fields(SECTIONS[sec])]
            raise _err_unknown(key, [f"{sec}.{f}" for f in fields], f" (section {sec!r})")
        return sec, name, None
    if key in FIELD_SECTION:
        return FIELD_SECTION[key], key, None
    if key in ALIASES:
        name, transform = ALIASES[key]
        return FIELD_SECTION[name], name, transform
    if key in UNSUPPORTED:
        raise ConfigError(f"config key {key!r} is a TRL option grpo-jax doesn't have: "
                          f"{UNSUPPORTED[key]}")
    raise _err_unknown(key, [*FIELD_SECTION, *ALIASES])


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        if _is_none(value) and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise bad
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, args))}"
                          + (f"; did you mean {close[0]!r}?" if close else ""))
    if origin is tuple:
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(items))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    raise TypeError(f"unhandled config type {tp}")  # a new field type needs a case here


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is tuple:
        return f"a list of {_type_name(args[0])}"
    return getattr(tp, "__name__", str(tp))


def _set(tree: dict, key: str, value: Any, raw: str | None = None) -> None:
    sec, name, transform = resolve_key(key)
    tp = _TYPES[sec][name]
    if raw is not None and isinstance(value, (int, float)) and str in (tp, *typing.get_args(tp)):
        value = raw  # keep '007' a string rather than the number YAML reads
    if transform is not None:
        value = transform(value)
    if name == "scale_rewards" and isinstance(value, bool):  # TRL accepts True/False
        value = "group" if value else "none"
    if name == "top_k" and _is_none(value):
        value = 0
    if name == "report_to" and _is_none(value):
        value = []
    if key == "warmup_ratio":
        _check(isinstance(value, (int, float)) and 0 <= value < 1,
               f"warmup_ratio must be in [0, 1), got {value!r}")
    tree.setdefault(sec, {})[name] = _coerce(value, tp, key)


# ---------------------------------------------------------------- building and loading

def config_from_dict(mapping: dict | None, overrides: typing.Sequence[str] = (),
                     source: str = "") -> TrainConfig:
    """A TrainConfig from a flat or sectioned mapping plus `key=value` overrides."""
    tree: dict[str, dict] = {}
    try:
        for key, value in (mapping or {}).items():
            if key in SECTIONS:
                _check(isinstance(value, dict) or value is None,
                       f"section {key!r} must be a mapping, got {value!r}")
                for sub, v in (value or {}).items():
                    _set(tree, f"{key}.{sub}", v)
            else:
                _set(tree, str(key), value)
    except ConfigError as e:
        raise ConfigError(f"{e} (in {source})" if source else str(e)) from None
    for item in overrides:
        key, sep, text = item.partition("=")
        _check(bool(sep) and bool(key.strip()), f"override {item!r} must look like key=value")
        _set(tree, key.strip(), _parse_scalar(text), raw=text)
    return TrainConfig(**{sec: cls(**tree.get(sec, {})) for sec, cls in SECTIONS.items()})


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def builtin_configs() -> list[str]:
    root = resources.files("grpo_jax") / "configs"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_config(name_or_path: str | None = None,
                overrides: typing.Sequence[str] = ()) -> TrainConfig:
    """NAME (grpo_jax/configs/NAME.yaml) or a YAML path, then `key=value` overrides."""
    mapping: dict = {}
    if name_or_path:
        packaged = resources.files("grpo_jax") / "configs" / f"{name_or_path}.yaml"
        path = Path(name_or_path).expanduser()
        if "/" not in name_or_path and packaged.is_file():
            text = packaged.read_text()
        elif path.is_file():
            text = path.read_text()
        else:
            raise ConfigError(f"config {name_or_path!r} not found: not a built-in "
                              f"({', '.join(builtin_configs())}) and no such file")
        try:
            mapping = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config {name_or_path!r} is not valid YAML: {e}") from None
        _check(isinstance(mapping, dict), f"config {name_or_path!r} must be a YAML mapping")
    return config_from_dict(mapping, overrides, source=name_or_path or "")


# ---------------------------------------------------------------- command line

def parse_cli(argv: typing.Sequence[str]) -> tuple[TrainConfig, dict]:
    """`--config NAME`, `--set key=value` (repeatable), `--key value` / `--key=value` for any
    field or TRL alias, bare `--flag` for booleans (`--resume`). Returns the config and
    {'config': NAME or None, 'overrides': [key=value, ...]} for logging."""
    name, overrides, args = None, [], list(argv)
    i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        if arg in ("-h", "--help"):
            print(cli_help())
            raise SystemExit(0)
        _check(arg.startswith("--"), f"unexpected argument {arg!r}: options look like --key value")
        key, eq, val = arg[2:].partition("=")
        if not eq:
            bare = i >= len(args) or args[i].lower() not in _BOOL_WORDS
            if key not in ("config", "set") and _is_bool(key) and bare:
                val = "true"
            else:
                _check(i < len(args), f"--{key} needs a value")
                val, i = args[i], i + 1
        if key == "config":
            name = val
        elif key == "set":
            overrides.append(val)
        else:
            overrides.append(f"{key}={val}")
    return load_config(name, overrides), {"config": name, "overrides": overrides}


_BOOL_WORDS = ("true", "false", "yes", "no", "on", "off", "1", "0")


def _is_bool(key: str) -> bool:
    sec, name, _ = resolve_key(key)
    return _TYPES[sec][name] is bool or key == "use_vllm"


def cli_help() -> str:
    lines = ["usage: grpo-jax-train [--config NAME|PATH] [--set key=value ...] [--key value ...]",
             f"built-in configs: {', '.join(builtin_configs())}", ""]
    for sec, cls in SECTIONS.items():
        lines.append(f"{sec}:")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  --{f.name} ({_type_name(_TYPES[sec][f.name])}) default {default!r}")
    return "\n".join(lines)
