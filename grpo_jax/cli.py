"""Reading a TrainConfig from YAML and the command line, with TRL's names.

A YAML file may be sectioned (`loss: {beta: 0.04}`) or flat with TRL's names (`beta: 0.04`):
every field name is unique across sections, so a flat key finds its section. TRL spellings and
the few values TRL writes differently go through one alias table.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Literal, NamedTuple

import yaml

from grpo_jax.config import SECTIONS, TrainConfig
from grpo_jax.config.fields import help_of
from grpo_jax.errors import ConfigError, check as _check


FIELD_SECTION: dict[str, str] = {}
for _sec, _cls in SECTIONS.items():
    for _f in dataclasses.fields(_cls):
        assert _f.name not in FIELD_SECTION and _f.name not in SECTIONS, _f.name
        FIELD_SECTION[_f.name] = _sec
_TYPES = {sec: typing.get_type_hints(cls) for sec, cls in SECTIONS.items()}

class Alias(NamedTuple):
    field: str | None  # our field; None: none here (the value is checked, then dropped)
    transform: Callable[[Any], Any] | None = None  # the value as TRL writes it -> ours
    boolean: bool = False  # a bare --key means true


_SKIP = object()  # a transform's answer for "this value sets nothing"

# TrainingArguments' mixed-precision flags -> the compute dtype they select. TRL's bf16 defaults
# to `not fp16`: neither flag true computes in float32 (`bf16: false`), `fp16: false` alone
# leaves TRL's default, bf16 (here: the config's dtype).
_PRECISION = {"bf16": "bfloat16", "fp16": "float16"}
# A key of the tree of settings being read, not a section: flags that select one field
# together, in any order (the precision flags; use_vllm with vllm_mode).
_FLAGS = "_flags"


def _precision(tree: dict, flag: str, value: Any) -> Any:
    """The dtype the flags set so far select (flags are kept in the tree, so `bf16: false,
    fp16: true` gives float16 in either order), or _SKIP."""
    _check(isinstance(value, bool), f"{flag}: expected true or false, got {value!r}")
    flags = tree.setdefault(_FLAGS, {})
    flags[flag] = value
    _check(not (flags.get("bf16") and flags.get("fp16")), "bf16 and fp16 are both true: set "
           "one (as transformers, which refuses both)")
    on = [f for f, v in flags.items() if v]
    if on:
        return _PRECISION[on[0]]
    return "float32" if flags.get("bf16") is False else _SKIP


# transformers' optim names for torch.optim.AdamW (or its fused / XLA / NPU / apex builds, and
# transformers 4's own AdamW): the same update as optax.adamw here.
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused",
               "adamw_apex_fused", "adamw_hf")


def _optim(v):  # TrainingArguments' optim: the optimizer's name
    _check(v in ADAMW_NAMES, f"optim {v!r}: grpo-jax trains with AdamW (optax.adamw, "
           f"transformers' adamw_torch); set optim to one of {', '.join(ADAMW_NAMES)} or drop it")
    return _SKIP


def _one_config(v):  # open-r1's dataset_configs: a list of dataset configs
    items = v if isinstance(v, list) else [v]
    _check(len(items) == 1, f"dataset_configs {items}: grpo-jax loads one dataset config; "
           "pick one (dataset_config: NAME)")
    return items[0]


def _mesh_fsdp(v):  # transformers' fsdp is a string of options; here it is a mesh axis size
    _check(not isinstance(v, str) or v.lstrip("-").isdigit(), f"fsdp {v!r}: here fsdp is the "
           "size of the mesh's FSDP axis (e.g. fsdp: -1 shards over every device); drop "
           "transformers' fsdp options")
    return int(v) if isinstance(v, str) else v


def _model_init_kwargs(v):  # TRL: kwargs of from_pretrained; only the dtype means something
    _check(isinstance(v, dict), f"model_init_kwargs must be a mapping, got {v!r}")
    ignored = {"attn_implementation", "use_cache", "device_map", "low_cpu_mem_usage"}
    other = set(v) - {"dtype", "torch_dtype"} - ignored
    _check(not other, f"model_init_kwargs {sorted(other)}: only dtype (torch_dtype) applies "
           f"here; {', '.join(sorted(ignored))} are accepted and change nothing")
    dtype = v.get("dtype", v.get("torch_dtype"))
    return _SKIP if dtype in (None, "auto") else dtype


def _main_revision(v):
    _check(v in (None, "main"), f"model_revision {v!r}: download that revision to a directory "
           "(`hf download MODEL --revision REV --local-dir DIR`) and pass model_name_or_path DIR")
    return _SKIP


def _resume_from_checkpoint(v):  # transformers: true or a checkpoint path
    return False if _is_none(v) else v


def _head_fp32(v):  # TRL's default (false) is what happens here
    _check(v in (False, None), "cast_lm_head_to_fp32: the head's matmul accumulates in fp32 "
           "from compute-dtype inputs; for fp32 inputs too set dtype: float32")
    return _SKIP


VLLM_MODES = ("server", "colocate")


def _vllm(tree: dict, key: str, value: Any) -> Any:
    """The backend use_vllm and vllm_mode select together (in either order), or _SKIP. TRL's
    colocate mode generates on the training devices, in the trainer's process: here that is
    the native JAX sampler; its server mode is the vLLM server. A backend name is taken as is."""
    flags = tree.setdefault(_FLAGS, {})
    if key == "vllm_mode":
        _check(value in VLLM_MODES, f"vllm_mode {value!r}: expected one of "
               f"{', '.join(VLLM_MODES)}")
        if value == "colocate" and key not in _NOTED:
            _NOTED.add(key)
            print("grpo_jax: vllm_mode colocate: generation runs on the training devices in "
                  "the native JAX sampler (grpo-jax's colocated engine)", file=sys.stderr)
    flags[key] = value
    use = flags.get("use_vllm")
    if not isinstance(use, bool):
        return _SKIP if use is None else use
    return "vllm" if use and flags.get("vllm_mode") != "colocate" else "jax"


def _scale_rewards(v):  # TRL also takes a bool
    return ("group" if v else "none") if isinstance(v, bool) else v


def _warmup_ratio(v):
    _check(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1,
           f"warmup_ratio must be in [0, 1), got {v!r}")
    return v


# Keys as TRL (or an older grpo-jax) writes them: name -> our field and value transform. A field's
# own name appears here when TRL accepts values for it that ours does not.
ALIASES: dict[str, Alias] = {
    "model_name_or_path": Alias("name_or_path"),  # trl.ModelConfig
    "torch_dtype": Alias("dtype"),
    "gradient_checkpointing": Alias("remat"),
    "use_vllm": Alias("backend", boolean=True),  # with vllm_mode: _vllm
    "vllm_mode": Alias("backend"),
    "vllm_importance_sampling_cap": Alias("vllm_importance_sampling_clip_max"),  # deprecated
    "warmup_ratio": Alias("warmup_steps", _warmup_ratio),
    "scale_rewards": Alias("scale_rewards", _scale_rewards),
    "report_to": Alias("report_to", lambda v: [] if _is_none(v) else v),
    "bf16": Alias("dtype", boolean=True),  # mixed precision: _precision
    "fp16": Alias("dtype", boolean=True),
    "optim": Alias(None, _optim),
    "dataset_configs": Alias("dataset_config", _one_config),  # open-r1
    "model_revision": Alias(None, _main_revision),
    "fsdp": Alias("fsdp", _mesh_fsdp),
    "model_init_kwargs": Alias("dtype", _model_init_kwargs),
    "resume_from_checkpoint": Alias("resume", _resume_from_checkpoint, boolean=True),
    "cast_lm_head_to_fp32": Alias(None, _head_fp32, boolean=True),
}
# Keys of TRL, transformers' TrainingArguments and open-r1 recipes that change nothing here:
# accepted, and each one met is named once on stderr with the reason.
NO_EFFECT = {
    "model_revision": "the model directory is used as it is",
    "attn_implementation": "attention runs in XLA (cuDNN on GPUs), whatever the torch backend",
    "gradient_checkpointing_kwargs": "JAX's remat has no reentrant variant to choose",
    "overwrite_output_dir": "nothing is deleted: an output_dir with checkpoints needs --resume "
                            "or another output_dir",
    "push_to_hub": "not supported: nothing is uploaded (python -m grpo_jax.export writes an HF "
                   "directory to upload yourself)",
    "hub_model_id": "not supported: nothing is uploaded", "hub_strategy": "not supported: "
    "nothing is uploaded", "hub_private_repo": "not supported: nothing is uploaded",
    "log_level": "grpo-jax logs metrics at every logging_steps",
    "torch_empty_cache_steps": "JAX frees device buffers when their arrays go; there is no "
                               "allocator cache to empty",
    "vllm_device": "set on the vLLM server (python -m grpo_jax.serve)",
    "vllm_gpu_memory_utilization": "set on the vLLM server (python -m grpo_jax.serve)",
    "vllm_tensor_parallel_size": "set on the vLLM server (python -m grpo_jax.serve)",
    "vllm_model_impl": "set on the vLLM server (python -m grpo_jax.serve)",
    "vllm_max_model_length": "set on the vLLM server (python -m grpo_jax.serve)",
    "vllm_enable_sleep_mode": "grpo-jax uses a vLLM server, not colocated vLLM",
    "use_liger_kernel": "a PyTorch kernel library; the JAX step compiles its own",
    "torch_compile": "the JAX step is always compiled", "dataloader_num_workers": "prompts are "
    "tokenized once up front", "dataloader_pin_memory": "no PyTorch data loader here",
    "ddp_find_unused_parameters": "JAX's SPMD replaces DDP", "ddp_timeout": "JAX's SPMD "
    "replaces DDP (see heartbeat_timeout)", "ddp_backend": "JAX's SPMD replaces DDP",
    "trust_remote_code": "only the built-in architectures load; no remote code runs",
    "disable_dropout": "the decoder has no dropout", "remove_unused_columns": "every column "
    "goes to the reward functions, as in TRL",
    "use_transformers_paged": "generation runs in the JAX sampler or a vLLM server",
    "cache_implementation": "generation runs in the JAX sampler or a vLLM server",
    "wandb_project": "set $WANDB_PROJECT (report_to: [wandb] reads it)",
    "wandb_entity": "set $WANDB_ENTITY (report_to: [wandb] reads it)",
    "do_eval": "evaluation runs when eval_strategy is not 'no' (or with eval_on_start)",
    "do_train": "the program trains", "do_predict": "there is no prediction loop",
    "run_name": "a run is named by its output_dir", "disable_tqdm": "the progress bar is on "
    "stderr (redirect it)", "use_cpu": "JAX picks the platform: set JAX_PLATFORMS=cpu",
    "tf32": "XLA picks the matmul precision (JAX_DEFAULT_MATMUL_PRECISION)",
    "data_seed": "the data order follows seed", "full_determinism": "a run is deterministic "
    "given seed (the sampler's keys derive from it)", "include_num_input_tokens_seen":
    "num_tokens is always logged", "skip_memory_metrics": "no memory metrics are logged",
    "log_on_each_node": "process 0 logs", "save_only_model": "checkpoints hold the whole "
    "training state, for exact resume", "use_cache": "the sampler always keeps a KV cache",
    "ds3_gather_for_generation": "JAX shards params with the mesh; no DeepSpeed ZeRO-3",
    "cast_lm_head_to_fp32": "off, as TRL's default: the head's matmul accumulates in fp32",
    "dataloader_drop_last": "an epoch's tail too short for a generation batch "
    "is skipped, as TRL's sampler does",
    "eval_accumulation_steps": "eval metrics are reduced per eval batch",
    "deepspeed": "JAX shards params, gradients and optimizer state with the mesh (dp, fsdp, tp)",
    "fsdp_config": "JAX shards params, gradients and optimizer state with the mesh (fsdp)",
    "use_transformers_continuous_batching": "generation runs in the JAX sampler or a vLLM "
                                            "server", "transformers_continuous_batching_config":
    "generation runs in the JAX sampler or a vLLM server",
    "vllm_group_port": "weights reach the server over HTTP / shared memory (see README)",
    "log_multimodal": "text models only", "log_completions_hub_repo": "not supported: nothing "
    "is uploaded (completions.jsonl holds them)",
}
_NOTED: set[str] = set()
# A field of ours is never shadowed (accelerate's num_processes, say, is our process count).
assert not set(NO_EFFECT) & set(FIELD_SECTION), set(NO_EFFECT) & set(FIELD_SECTION)
# TRL options that have no counterpart here, and what to do instead.
UNSUPPORTED = {
    "use_dora": "grpo-jax's adapters are LoRA (no DoRA); drop use_dora",
    "lora_modules_to_save": "only the LoRA adapters are trained; drop lora_modules_to_save",
    "use_bnb_nested_quant": "the 4-bit base keeps fp32 scales (no nested quantization); drop "
                            "use_bnb_nested_quant",
    "lora_target_parameters": "LoRA on a mixture of experts' stacked expert parameters (PEFT's "
                              "target_parameters, e.g. gpt-oss's mlp.experts.gate_up_proj) is "
                              "not supported: adapt attention with lora_target_modules, or "
                              "train the experts fully (no use_peft)",
}
_NONE_WORDS = ("none", "null", "~")


def _is_none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.lower() in _NONE_WORDS)


def _err_unknown(key: str, names, where: str = "") -> ConfigError:
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r}{where}{hint}")


def resolve_key(key: str) -> tuple[str | None, str | None, Alias | None]:
    """'beta', 'loss.beta' or a TRL alias -> (section, field, alias or None); (None, None,
    alias) for a key that has no field here."""
    sec, _, name = key.rpartition(".")
    if sec and sec not in SECTIONS:
        raise _err_unknown(key, [f"{s}.{f}" for f, s in FIELD_SECTION.items()])
    alias = ALIASES.get(name, Alias(None) if name in NO_EFFECT else None)
    field = alias.field if alias else name
    if alias and field is None:
        return None, None, alias
    if field not in FIELD_SECTION:
        if name in UNSUPPORTED:
            raise ConfigError(f"config key {name!r} is a TRL option grpo-jax doesn't have: "
                              f"{UNSUPPORTED[name]}")
        if sec:
            fields = [f.name for f in dataclasses.fields(SECTIONS[sec])]
            raise _err_unknown(key, [f"{sec}.{f}" for f in fields], f" (section {sec!r})")
        raise _err_unknown(key, [*FIELD_SECTION, *ALIASES])
    if sec and FIELD_SECTION[field] != sec:
        raise ConfigError(f"{field!r} is in section {FIELD_SECTION[field]!r}, not {sec!r}: "
                          f"write {FIELD_SECTION[field]}.{field} (or just {field})")
    return FIELD_SECTION[field], field, alias


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
        if value is False and "no" in args:  # YAML 1.1 reads a bare `no` as false
            return "no"
        if value in args and not isinstance(value, bool):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, args))}"
                          + (f"; did you mean {close[0]!r}?" if close else ""))
    if origin is tuple:
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(items))
    if tp is dict:
        if isinstance(value, dict):
            return dict(value)
        raise bad
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
    sec, name, alias = resolve_key(key)
    bare = key.rpartition(".")[2]
    if sec is None:  # no field here: check the value, say why it changes nothing
        if alias.transform:
            alias.transform(value)
        if bare in NO_EFFECT and bare not in _NOTED:
            _NOTED.add(bare)
            print(f"grpo_jax: {bare} has no effect: {NO_EFFECT[bare]}", file=sys.stderr)
        return
    tp = _TYPES[sec][name]
    if (raw is not None and isinstance(value, (int, float)) and not isinstance(value, bool)
            and str in (tp, *typing.get_args(tp))):
        value = raw  # keep '007' a string rather than the number YAML reads
    if bare in _PRECISION:
        value = _precision(tree, bare, value)
        if value is _SKIP:
            return
    elif bare in ("use_vllm", "vllm_mode"):
        value = _vllm(tree, bare, value)
        if value is _SKIP:
            return
    elif alias and alias.transform:
        value = alias.transform(value)
        if value is _SKIP:
            return
    tree.setdefault(sec, {})[name] = _coerce(value, tp, key)


# ---------------------------------------------------------------- building and loading

def config_from_dict(mapping: dict | None, overrides: typing.Sequence[str] = (),
                     source: str = "") -> TrainConfig:
    """A TrainConfig from a flat or sectioned mapping plus `key=value` overrides."""
    tree: dict[str, dict] = {}
    try:
        for key, value in (mapping or {}).items():
            if key in SECTIONS and (isinstance(value, dict) or value is None):
                for sub, v in (value or {}).items():
                    _set(tree, f"{key}.{sub}", v)
            elif key in SECTIONS and key not in ALIASES:  # `optim: adamw_torch` is TRL's key
                raise ConfigError(f"section {key!r} must be a mapping, got {value!r}")
            else:
                _set(tree, str(key), value)
    except ConfigError as e:
        raise ConfigError(f"{e} (in {source})" if source else str(e)) from None
    for item in overrides:
        key, sep, text = item.partition("=")
        _check(bool(sep) and bool(key.strip()), f"override {item!r} must look like key=value")
        _set(tree, key.strip(), _parse_scalar(text), raw=text)
    tree.pop(_FLAGS, None)
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

def parse_cli(argv: typing.Sequence[str]) -> TrainConfig:
    """`--config NAME`, `--set key=value` (repeatable), `--key value` / `--key=value` for any
    field or TRL alias, bare `--flag` for booleans (`--resume`)."""
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
            flag = key not in ("config", "set") and _is_bool(key)
            # A bool-or-path field (resume) takes the next argument unless it is an option.
            text = i < len(args) and not args[i].startswith("--")
            bare = i >= len(args) or (args[i].lower() not in _BOOL_WORDS
                                      and not (text and flag == "or text"))
            if flag and bare:
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
    return load_config(name, overrides)


_BOOL_WORDS = ("true", "false", "yes", "no", "on", "off", "1", "0")


def _is_bool(key: str) -> bool | str:
    """Whether --key may stand alone for true: True, "or text" for a bool-or-string field
    (resume: true or a checkpoint path), False."""
    sec, name, alias = resolve_key(key)
    tp = _TYPES[sec][name] if sec is not None else None
    if bool in typing.get_args(tp) and str in typing.get_args(tp):
        return "or text"
    return tp is bool or bool(alias and alias.boolean)


def cli_help() -> str:
    lines = ["usage: grpo-jax-train [--config NAME|PATH] [--set key=value ...] [--key value ...]",
             f"built-in configs: {', '.join(builtin_configs())}", ""]
    for sec, cls in SECTIONS.items():
        lines.append(f"{sec}:")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  --{f.name} ({_type_name(_TYPES[sec][f.name])}, default {default!r})")
            lines.append(f"      {help_of(f)}")
    return "\n".join(lines)
