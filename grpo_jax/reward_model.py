"""Neural reward models in `reward_funcs`, as TRL 1.16's GRPOTrainer takes them.

TRL loads a model id or directory named in `reward_funcs` as
`AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)` and, per completion,
scores the chat-formatted (or concatenated) prompt + completion: tokenized without special
tokens, right-padded, `.logits[:, 0]`, which transformers reads at each row's last token that is
not the padding token. Here the backbone is the JAX decoder (grpo_jax.hf loads it, sharded by
grpo_jax.mesh's rules) and the score head a [1, D] matrix on the last hidden state; batches are
padded to a few lengths and row counts, so a run compiles a handful of scoring programs.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors import safe_open

from grpo_jax import distributed as dist
from grpo_jax import hf
from grpo_jax import mesh as mesh_lib
from grpo_jax.errors import ModelConfigError, RewardError
from grpo_jax.models import ModelConfig
from grpo_jax.shapes import bucket_width, next_pow2

ARCHITECTURE_SUFFIX = "ForSequenceClassification"
SCORE_WEIGHT = "score.weight"  # transformers' GenericForSequenceClassification head, no bias
# Padded tokens (rows x length) per scoring program: bounds its activations, the [rows, T, T]
# attention scores per head above all, whatever the texts' lengths.
TOKENS_PER_BATCH = 16384
# One of them marks a directory that holds a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def log_name(spec: str) -> str:
    """TRL's name for a reward model in metrics: `config._name_or_path.split('/')[-1]`, where
    `_name_or_path` is the string given to from_pretrained. A trailing '/' is dropped first:
    TRL would log such a directory under an empty name."""
    return spec.rstrip("/").split("/")[-1]


def scoring_mesh(mesh: Mesh | None) -> Mesh:
    """Where the reward model runs. One process: the trainer's mesh, so its weights are sharded
    by the same rules as the policy's. Several processes: each scores only the rows it owns (the
    scorer in grpo_jax.train), when it likes and with its own row count, so a program over the
    global mesh would wait for peers that are not calling it; a mesh of this process's devices
    runs without them (fsdp over them, and the trainer's tensor axis where it divides them).
    No mesh (a library call): the first local device."""
    if mesh is None:
        return mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1), jax.local_devices()[:1])
    if not dist.multi_process():
        return mesh
    local = jax.local_devices()
    tp = mesh.shape["tensor"] if len(local) % mesh.shape["tensor"] == 0 else 1
    return mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=-1, tp=tp), local)


@dataclasses.dataclass(eq=False)
class RewardModel:
    """A sequence-classification reward model with TRL's reward-function signature:
    `model(prompts, completions, **kwargs) -> list[float]`, logged under `name` (also its
    `__name__`, which rewards.callable_name reads)."""
    name: str
    model_dir: Path
    tokenizer: Any  # the reward processing class, its pad token set as TRL sets it
    graphdef: Any
    params: Any  # the backbone's nnx.Param state on `mesh`
    head: jax.Array  # [D] the score row, replicated on `mesh`
    mesh: Mesh
    vocab_size: int
    chat_template_kwargs: dict | None  # the run's (DataArgs), passed to apply_chat_template

    def __post_init__(self):
        self.__name__ = self.name

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        return self.score_texts(self.texts(prompts, completions)).tolist()

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """TRL's texts: chat prompts (TRL's is_conversational, asked of the first prompt) and
        their completion messages through the tokenizer's chat template, as one conversation;
        plain prompts and completions concatenated."""
        if len(prompts) != len(completions):
            raise RewardError(f"reward model {self.name!r}: {len(prompts)} prompts for "
                              f"{len(completions)} completions")
        if not len(prompts):
            return []
        first = prompts[0]
        if not (isinstance(first, list) and first and isinstance(first[0], dict)
                and "role" in first[0]):
            return [p + c for p, c in zip(prompts, completions)]
        if not getattr(self.tokenizer, "chat_template", None):
            raise RewardError(f"reward model {self.name!r}: the prompts are chat messages "
                              "but its tokenizer has no chat template; name a tokenizer that "
                              "has one in reward_processing_classes")
        kwargs = self.chat_template_kwargs or {}
        return [self.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False, **kwargs)
                for p, c in zip(prompts, completions)]

    def score_texts(self, texts: Sequence[str]) -> np.ndarray:
        """[N] float32 scores; the texts tokenized as TRL does (no special tokens added)."""
        if not len(texts):
            return np.zeros(0, np.float32)
        ids = self.tokenizer(text=list(texts), add_special_tokens=False)["input_ids"]
        return self.score_ids(ids)

    def score_ids(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        """[N] float32 scores of token-id rows. Rows go longest first into batches padded to a
        length bucket and a power-of-two row count (a multiple of the mesh's batch axes), at
        most TOKENS_PER_BATCH tokens each: similar lengths share a batch, and every batch
        shape, hence every compiled program, comes from a small set."""
        rows = [np.asarray(r, np.int64).reshape(-1) for r in ids]
        bad = [i for i, r in enumerate(rows) if r.size and (r.min() < 0
                                                            or r.max() >= self.vocab_size)]
        if bad:
            raise RewardError(
                f"reward model {self.name!r}: text {bad[0]} has token ids outside its "
                f"vocabulary [0, {self.vocab_size}): the tokenizer is not the model's; name the "
                "model's tokenizer in reward_processing_classes (or null for its own)")
        pad = self.tokenizer.pad_token_id
        div = mesh_lib.batch_divisor(self.mesh)
        order = sorted(range(len(rows)), key=lambda i: -rows[i].size)
        out = np.zeros(len(rows), np.float32)
        start = 0
        while start < len(order):
            width = _bucket(max(rows[order[start]].size, 1))
            room = _round_up(max(TOKENS_PER_BATCH // width, 1), div)
            take = order[start:start + room]
            n = min(_round_up(next_pow2(len(take)), div), room)
            tokens = np.full((n, width), pad, np.int32)
            mask = np.zeros((n, width), np.int32)
            for j, i in enumerate(take):
                tokens[j, :rows[i].size] = rows[i]
                mask[j, :rows[i].size] = 1
            batch = mesh_lib.batch_sharding(self.mesh, 2)
            scores = _score_program(self.graphdef, self.params, self.head,
                                    jax.device_put(tokens, batch), jax.device_put(mask, batch),
                                    np.int32(pad))
            out[take] = np.asarray(jax.device_get(scores))[:len(take)]
            start += len(take)
        return out


@functools.partial(jax.jit, static_argnums=0)
def _score_program(graphdef, params, head, tokens, mask, pad_id):
    """[B] scores: the decoder over right-padded rows (positions 0, 1, ... as transformers
    counts them without position_ids), the score row applied at each row's last token that is
    not `pad_id` (transformers' rule, that TRL relies on: the rightmost non-pad token, position 0
    when there is none), in fp32."""
    model = nnx.merge(graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = model(tokens, positions, mask)
    last = jnp.argmax(jnp.arange(tokens.shape[1]) * (tokens != pad_id), axis=-1)
    h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return jnp.einsum("bd,d->b", h, head.astype(h.dtype), preferred_element_type=jnp.float32)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _bucket(length: int) -> int:
    return bucket_width(length, beyond=next_pow2)


def load_reward_model(spec: str, processing_class: str | None = None, *,
                      mesh: Mesh | None = None, dtype: str = "float32",
                      chat_template_kwargs: dict | None = None) -> RewardModel:
    """The reward model that reward_funcs entry `spec` names: a local directory or a hub id
    'org/name' of a `...ForSequenceClassification` checkpoint with one score. Its tokenizer:
    `processing_class` (a tokenizer directory or hub id) or, None, the model's own; with no
    padding token, its EOS pads (TRL's rule). Runs in `dtype`, the run's compute dtype (the
    weights are kept in it too: they are never trained), on scoring_mesh(mesh)."""
    model_dir = _model_dir(spec, "reward model")
    hf_cfg = hf.read_config(model_dir)
    archs = [str(a) for a in hf_cfg.get("architectures") or []]
    if not any(a.endswith(ARCHITECTURE_SUFFIX) for a in archs):
        kind = " / ".join(archs) or "model with no architectures in config.json"
        raise RewardError(
            f"reward model {spec!r}: {model_dir} is a {kind}, not a "
            f"...{ARCHITECTURE_SUFFIX} model (TRL loads reward models "
            "with AutoModelForSequenceClassification, num_labels=1). Name a sequence-"
            "classification checkpoint (e.g. one trained with TRL's RewardTrainer), or score "
            "with a function ('package.module:function')")
    # No LM head: the checkpoint has `score.weight` in its place; "tied" makes the loader skip it.
    overrides = dict(tie_word_embeddings=True, dtype=dtype, param_dtype=dtype, remat=False)
    try:
        cfg = ModelConfig.from_hf(hf_cfg, **overrides)
    except ModelConfigError as e:
        raise RewardError(f"reward model {spec!r} ({model_dir}): {e}") from None
    head = _read_score(spec, model_dir, hf_cfg, cfg.hidden_size)
    tokenizer = _tokenizer(spec, model_dir, processing_class)
    if not 0 <= tokenizer.pad_token_id < cfg.vocab_size:
        raise RewardError(f"reward model {spec!r}: its tokenizer's padding token id "
                          f"{tokenizer.pad_token_id} is outside the model's vocabulary [0, "
                          f"{cfg.vocab_size}); the tokenizer does not match the model")
    mesh = scoring_mesh(mesh)
    model, _ = hf.load_model(str(model_dir), mesh, **overrides)
    graphdef, params = nnx.split(model, nnx.Param)
    head = jax.device_put(head.astype(cfg.dtype), NamedSharding(mesh, P()))
    return RewardModel(log_name(spec), model_dir, tokenizer, graphdef, params, head, mesh,
                       cfg.vocab_size, chat_template_kwargs)


def _model_dir(spec: str, what: str) -> Path:
    """The local directory of a reward model or tokenizer named by path or hub id."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise RewardError(f"{what} {spec!r}: no such directory, and not a hub id "
                          "('org/name'); name a local Hugging Face model directory, or a "
                          "reward function as 'package.module:function' or "
                          "'path/to/file.py:function'")
    try:
        return hf.resolve_model_dir(spec)
    except hf.ModelLoadError:
        raise RewardError(f"{what} {spec!r}: not a local directory, and it could not be fetched "
                          f"from the Hugging Face hub. Without hub access, download it elsewhere "
                          f"(`hf download {spec} --local-dir DIR`) and name DIR instead") from None


def _read_score(spec: str, model_dir: Path, hf_cfg: dict, hidden_size: int) -> np.ndarray:
    """The score row [D] from the safetensors files, checked to be one score."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise RewardError(f"reward model {spec!r}: {model_dir} has no *.safetensors weights; "
                          "grpo_jax reads safetensors only (pickle .bin files can run code). "
                          "Convert it once where you trust it: from_pretrained(DIR)."
                          "save_pretrained(OUT, safe_serialization=True)")
    for f in files:
        with safe_open(f, framework="numpy") as st:
            if SCORE_WEIGHT not in st.keys():
                continue
            w = st.get_tensor(SCORE_WEIGHT)
        if w.ndim != 2 or w.shape[1] != hidden_size:
            raise RewardError(f"reward model {spec!r}: {SCORE_WEIGHT} has shape {list(w.shape)}"
                              f", config.json implies [1, {hidden_size}]")
        if w.shape[0] != 1:
            labels = len(hf_cfg.get("id2label") or {}) or hf_cfg.get("num_labels")
            raise RewardError(
                f"reward model {spec!r} gives {w.shape[0]} scores per text ({SCORE_WEIGHT} has "
                f"{w.shape[0]} rows; config.json num_labels {labels}); a reward model gives "
                "one score (num_labels=1, as TRL loads it). Use a checkpoint trained as a "
                "reward model, or wrap this classifier in a reward function")
        return w[0]
    raise RewardError(f"reward model {spec!r}: no {SCORE_WEIGHT} in {model_dir}'s safetensors "
                      "files; a ...ForSequenceClassification checkpoint holds its score head "
                      "there (save it with transformers' save_pretrained)")


def _tokenizer(spec: str, model_dir: Path, processing_class: str | None):
    """TRL's reward processing class: the given tokenizer or the model's own, EOS as padding
    when it has no padding token (transformers pools at the last token that is not it)."""
    from transformers import AutoTokenizer
    where = model_dir if processing_class is None else _model_dir(processing_class,
                                                                   "reward_processing_classes")
    if not any((where / f).exists() for f in TOKENIZER_FILES):
        raise RewardError(f"reward model {spec!r}: {where} has no tokenizer files ("
                          f"{', '.join(TOKENIZER_FILES)}); name the model's tokenizer in "
                          "reward_processing_classes")
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())  # transformers' messages span lines
        raise RewardError(f"reward model {spec!r}: can't load a tokenizer from {where} "
                          f"({type(e).__name__}: {reason}); name a tokenizer directory in "
                          "reward_processing_classes") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token_id is None:
        raise RewardError(f"reward model {spec!r}: its tokenizer ({where}) has neither a "
                          "padding nor an EOS token, so the scored token can't be found; set "
                          "pad_token in its tokenizer_config.json")
    return tokenizer
