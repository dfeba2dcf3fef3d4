"""LoRA adapters in and out as PEFT adapter directories, and the model a LoRA run starts from.

A PEFT adapter directory holds `adapter_config.json` and `adapter_model.safetensors` with keys
like `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ([r, in], torch's
Linear layout) and `...lora_B.weight` ([out, r]). Ours are stacked over layers with the
weight's own dims: A [L, in..., r], B [L, r, out...] (models/lora.py). On a vision-language
model the keys name the language model's modules under `model.language_model.` and, where
PEFT's rules adapt the tower's modules too (a bare `q_proj`, all-linear), the tower's under
`model.vision_tower.` (Gemma 3's SigLIP) or `model.visual.` (Qwen2.5-VL's ViT and merger).
`target_modules` is then a regular expression naming exactly the adapted modules.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from grpo_jax import hf
from grpo_jax.errors import ConfigError, AdapterError
from grpo_jax.config.model import TOWER_TARGETS
from grpo_jax.models import Decoder, build, lora
from grpo_jax.models.decoder import stack_of

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."
# Where transformers 5's vision-language wrappers (Gemma 3, Qwen2.5-VL) keep the decoder's
# "model.": PEFT's keys name live modules, not the checkpoint's tensors (hf.export_name).
VLM_TEXT_ROOT = "model.language_model."
# Where they keep the tower's modules: its checkpoint names (siglip.HF_NAMES) under "model.".
VLM_TOWER_ROOT = "model."
TOWER = "vision/"  # our name of a tower adapter's weight here: "vision/<table name>"


def adapter_dir(name_or_path: str) -> Path | None:
    """The directory when `name_or_path` is a PEFT adapter directory, else None."""
    path = Path(name_or_path).expanduser()
    return path if (path / CONFIG_NAME).is_file() else None


def read_adapter_config(path: Path) -> dict:
    conf = json.loads((path / CONFIG_NAME).read_text())
    problems = []
    if conf.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {conf['peft_type']!r} (only LORA)")
    for key, ok in (("use_dora", False), ("bias", "none"), ("modules_to_save", None),
                    ("layers_to_transform", None), ("fan_in_fan_out", False)):
        if conf.get(key, ok) not in (ok, [] if ok is None else ok):
            problems.append(f"{key}={conf[key]!r} (grpo-jax needs {ok!r})")
    if not conf.get("base_model_name_or_path"):
        problems.append("no base_model_name_or_path (set it to the base model's directory)")
    if problems:
        raise AdapterError(f"PEFT adapter {path}: {'; '.join(problems)}")
    return conf


def adapter_settings(cfg):
    """`cfg` with, when model.name_or_path is a PEFT adapter directory, the adapter's rank,
    alpha, target modules and rslora in the `peft` section (the adapter's shape decides)."""
    path = adapter_dir(cfg.model.name_or_path)
    if path is None:
        return cfg
    if not cfg.peft.use_peft:
        raise ConfigError(f"model {path} is a PEFT adapter: set use_peft: true to train it, or "
                          "export a merged model and train that")
    conf = read_adapter_config(path)
    targets = conf.get("target_modules") or list(lora.DEFAULT_TARGETS)
    if isinstance(targets, str) and targets != "all-linear":
        # A regular expression (ours on a vision-language model): the module names it spells
        # out, each alternative's last; load_adapter refuses any key of a module outside them.
        ends = [part.rsplit("\\.", 1)[-1] for part in targets.split("|")]
        targets = [n for n in lora.TARGETS if re.search(rf"\b{n}\b", targets)] + [
            e for e in ends if re.fullmatch(r"\w+", e) and e not in lora.TARGETS]
    targets = [targets] if isinstance(targets, str) else targets
    # PEFT matches a name against the end of a module's path; all-linear is saved as paths.
    targets = tuple(dict.fromkeys(t.rsplit(".", 1)[-1] for t in targets))
    if any(t not in lora.TARGETS and t not in TOWER_TARGETS and t != "all-linear"
           for t in targets):
        # A module no name of ours reaches (Qwen2.5-VL's merger, mlp.0 / mlp.2): only
        # all-linear adapts it with the rest (load_adapter checks every key).
        targets = ("all-linear",)
    peft = dataclasses.replace(
        cfg.peft, lora_r=int(conf["r"]), lora_alpha=conf.get("lora_alpha", 8),
        lora_target_modules=targets,
        use_rslora=bool(conf.get("use_rslora", False)))
    if peft != cfg.peft:
        print(f"LoRA settings from {path / CONFIG_NAME}: r={peft.lora_r}, "
              f"alpha={peft.lora_alpha}, targets={list(peft.target_modules())}, "
              f"rslora={peft.use_rslora}", file=sys.stderr)
    return dataclasses.replace(cfg, peft=peft)


def base_name(cfg) -> str:
    path = adapter_dir(cfg.model.name_or_path)
    return (read_adapter_config(path)["base_model_name_or_path"] if path
            else cfg.model.name_or_path)


def load_model(cfg, mesh):
    """(model, base model directory) for a run: the base on `mesh`; with use_peft the base
    kept in the compute dtype (it is never updated; with load_in_8bit/4bit its projections
    quantized) and fresh adapters in the param dtype, or
    the adapter's weights when model.name_or_path is a PEFT adapter directory."""
    numerics = cfg.numerics
    if not cfg.peft.use_peft:
        return hf.load_model(cfg.model.name_or_path, mesh, numerics=numerics)
    model, model_dir = hf.load_model(base_name(cfg), mesh, quant_bits=cfg.peft.quant_bits,
                                     numerics=cfg.peft.base_numerics(numerics))
    lora.add_adapters(model, cfg.peft, jax.random.key(cfg.data.seed),
                      dtype=jnp.dtype(numerics.param_dtype))
    path = adapter_dir(cfg.model.name_or_path)
    if path is not None:
        load_adapter(model, path)
    return model, model_dir


def tower_modules(peft: lora.PeftArgs, model_cfg) -> list[str]:
    """The vision tower's modules (HF names, {i}: each layer) that PEFT's rules adapt for
    `peft`'s lora_target_modules on the wrapper (...ForConditionalGeneration): a name adapts
    each module whose name ends with it, all-linear every nn.Linear. [] for a text model."""
    return list(lora.tower_linears(peft, model_cfg).values())


def _keys(model) -> dict[str, str]:
    """Our leaf ("vision/<table name>": the tower's) -> PEFT's key pattern ({i}: layer, {m}:
    lora_A or lora_B)."""
    return _keys_for(model.cfg, _adapted(model))


def _keys_for(cfg, leaves) -> dict[str, str]:
    return {leaf: PREFIX + _module(cfg, leaf) + ".{m}.weight" for leaf in leaves}


def _hf_name(cfg, leaf: str) -> str:
    """The HF tensor (hf_names: {i}, the layer) that weight `leaf` adapts."""
    if leaf.startswith(TOWER):
        return cfg.vision.hf_names()[leaf[len(TOWER):]][0]
    return hf.hf_names(cfg)[f"layers/{leaf}"]


def _module(cfg, leaf: str) -> str:
    """The path of the transformers module that weight `leaf` belongs to ({i}: the layer)."""
    name = _hf_name(cfg, leaf)[:-len(".weight")]
    if leaf.startswith(TOWER):
        # (Qwen3-VL's checkpoint names are its modules' already: "model.visual.")
        return name if name.startswith(VLM_TOWER_ROOT) else VLM_TOWER_ROOT + name
    return name if cfg.vision is None else VLM_TEXT_ROOT + name[len("model."):]


def _layers(cfg, leaf: str, stacked: int) -> tuple[int, ...]:
    """The layers whose module `leaf`'s stacked adapters (`stacked` of them) hold, in order (a
    mixture of experts' dense MLPs: only its dense layers; the tower: all of its, and a
    weight outside its layers, its stack of one, names no layer: its key has no {i})."""
    if leaf.startswith(TOWER):
        return tuple(range(stacked))
    return cfg.stack_layers(stack_of(cfg, leaf))


def _adapter_vars(model) -> dict:
    """The model's adapter variables {leaf_lora_a: A, ...}, the tower's as
    vision/<holder>/<w>_lora_a (vision/layers/wq_lora_a, vision/merger/w1_lora_a)."""
    out = {name: var for name, var in vars(model.layers).items()
           if isinstance(var, lora.LoraParam)}
    if lora.tower_adapted(model):
        for part, holder in vars(model.vision).items():
            if isinstance(holder, nnx.Module):  # layers; blocks and merger
                out.update({f"{TOWER}{part}/{name}": var for name, var in vars(holder).items()
                            if isinstance(var, lora.LoraParam)})
    return out


def _adapted(model) -> list[str]:
    return [name[:-len("_lora_a")] for name in _adapter_vars(model) if name.endswith("_lora_a")]


def adapter_tensors(model, dtype: str = "float32") -> dict[str, np.ndarray]:
    """The model's adapters under PEFT's key names and layouts."""
    return layer_adapter_tensors(model.cfg, _adapter_vars(model), dtype)


def state_adapters(params) -> dict:
    """A LoRA run's trainable params (its LoraParam state, as the trainer holds them) as
    layer_adapter_tensors takes them: the decoder's layers' {leaf_lora_a: A, ...} and the
    tower's, when it has adapters, as vision/<holder>/<w>_lora_a."""
    out = dict(params["layers"].items())
    if "vision" in params:
        out.update({f"{TOWER}{part}/{name}": var for part, holder in params["vision"].items()
                    for name, var in holder.items()})
    return out


def engine_adapter_tensors(cfg, adapters, dtype: str = "float32") -> dict[str, np.ndarray]:
    """layer_adapter_tensors keyed as the base tensors they adapt are exported (hf.export_name,
    `.weight` dropped): "<name>.lora_A" / "<name>.lora_B", for a weight server that merges them
    into the base it was given by those names. PEFT's keys name live modules instead, which on
    a vision-language model differ ("model.language_model." for Gemma 3's
    "language_model.model.")."""
    return layer_adapter_tensors(cfg, adapters, dtype, keys=_engine_keys)


def _engine_keys(cfg, leaves) -> dict[str, str]:
    return {leaf: hf.export_name(cfg, _hf_name(cfg, leaf)).removesuffix(".weight") + ".{m}"
            for leaf in leaves}


def layer_adapter_tensors(cfg, layers, dtype: str = "float32", keys=None
                          ) -> dict[str, np.ndarray]:
    """PEFT's tensors of stacked adapters {leaf_lora_a: A, leaf_lora_b: B} (arrays or
    variables: the `layers` of a model's LoraParam state, as the trainer holds them; the
    tower's as vision/<holder>/<w>_lora_a ...: state_adapters). `keys`: another naming
    (engine_adapter_tensors)."""
    out = {}
    leaves = [name[:-len("_lora_a")] for name in layers if name.endswith("_lora_a")]
    for leaf, key in (keys or _keys_for)(cfg, leaves).items():
        a, b = (np.asarray(jax.device_get(layers[f"{leaf}{m}"][...]))
                for m in ("_lora_a", "_lora_b"))
        r = a.shape[-1]
        for row, i in enumerate(_layers(cfg, leaf, len(a))):
            out[key.format(i=i, m="lora_A")] = a[row].reshape(-1, r).T.astype(dtype)
            out[key.format(i=i, m="lora_B")] = b[row].reshape(r, -1).T.astype(dtype)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def adapter_config(peft: lora.PeftArgs, base: str, model_cfg=None) -> dict:
    """adapter_config.json's content for adapters made with `peft` on model `base` (whose
    config `model_cfg` is needed for a vision-language model)."""
    targets = list(peft.target_modules())
    if model_cfg is not None and model_cfg.vision is not None:
        # The modules adapted here (the tower's as PEFT's rules select them); PEFT
        # fullmatches the pattern.
        leaves = [*lora.model_targets(peft, model_cfg),
                  *(TOWER + leaf for leaf in lora.tower_targets(peft, model_cfg))]
        targets = "|".join(re.escape(_module(model_cfg, leaf)).replace(r"\{i\}", r"\d+")
                           for leaf in leaves)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": peft.lora_r, "lora_alpha": peft.lora_alpha, "lora_dropout": peft.lora_dropout,
            "target_modules": targets, "use_rslora": peft.use_rslora,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None, "use_dora": False}


def write_adapter(out_dir, tensors: dict[str, np.ndarray], conf: dict) -> Path:
    """A PEFT adapter directory of `tensors` (adapter_tensors) and `conf` (adapter_config)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(tensors, out / WEIGHTS_NAME, metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(conf, indent=2))
    return out


def save_adapter(model, peft: lora.PeftArgs, out_dir, base: str,
                 dtype: str = "float32") -> Path:
    """A PEFT adapter directory that `peft.PeftModel.from_pretrained(base_model, out_dir)`
    loads."""
    return write_adapter(out_dir, adapter_tensors(model, dtype),
                         adapter_config(peft, base, model.cfg))


def load_adapter(model, path: Path) -> None:
    """Set `model`'s adapters (made with the adapter's settings) from a PEFT directory."""
    file = Path(path) / WEIGHTS_NAME
    if not file.is_file():
        raise AdapterError(f"{path} has no {WEIGHTS_NAME} (only safetensors adapters are read)")
    tensors = safetensors.numpy.load_file(file)
    base = read_adapter_config(Path(path))["base_model_name_or_path"]
    variables = _adapter_vars(model)
    for leaf, key in _keys(model).items():
        for m, suffix in (("lora_A", "_lora_a"), ("lora_B", "_lora_b")):
            var = variables[leaf + suffix]
            shape = var.shape[1:]
            expected = (shape[-1], int(np.prod(shape[:-1]))) if m == "lora_A" else (
                int(np.prod(shape[1:])), shape[0])
            layers = []
            for i in _layers(model.cfg, leaf, var.shape[0]):
                name = key.format(i=i, m=m)
                if name not in tensors:
                    raise AdapterError(f"PEFT adapter {path} has no {name}: grpo-jax adapts "
                                       "every layer of a targeted module")
                if tensors[name].shape != expected:
                    found = tensors[name].shape
                    raise AdapterError(
                        f"PEFT adapter {path} does not fit base model {base}: {name} is "
                        f"{found}, the base needs {expected}. The adapter was trained on "
                        "another base model; use that one")
                w = tensors[name].T
                layers.append(w.reshape(*shape[:-1], -1) if m == "lora_A"
                              else w.reshape(shape))
            var.set_value(jax.device_put(np.stack(layers).astype(var.dtype),
                                         var.get_value().sharding))
    extra = set(tensors) - {key.format(i=i, m=m) for leaf, key in _keys(model).items()
                            for i in _layers(model.cfg, leaf, variables[leaf + "_lora_a"].shape[0])
                            for m in ("lora_A", "lora_B")}
    if extra:
        raise AdapterError(f"PEFT adapter {path} has weights for modules the settings don't "
                           f"adapt or the base lacks, e.g. {sorted(extra)[0]}: it was trained "
                           "on another base model")


def merged_model(model) -> Decoder:
    """A plain Decoder (no adapters) whose weights are the base with the adapters merged in."""
    graphdef, adapters, base = nnx.split(model, lora.LoraParam, nnx.Param)
    merged = lora.merge_into_base(base, adapters, model.lora_scale)
    plain = nnx.graphdef(build.abstract_model(model.cfg))
    return nnx.merge(plain, merged)
