"""Prompt datasets: hub ids, local files and built-ins, tokenized once at load, served in
generation batches from a position (epoch, index) that a checkpoint stores to resume exactly."""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np

from grpo_jax import images as images_lib
from grpo_jax.config import DataArgs
from grpo_jax.errors import DataError
from grpo_jax.scoring import NOT_REWARD_COLUMNS

logger = logging.getLogger(__name__)

BUILTIN_DATASETS = ("smol_prompts", "arithmetic", "calculator", "calculator_plain", "squares")
FILE_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
ARITHMETIC_SIZE = 2000
ARITHMETIC_TEST = 32  # held-out questions of the built-in 'arithmetic' (of 126)


class DataPosition(NamedTuple):
    """Where the next generation batch starts: index into epoch `epoch`'s order."""
    epoch: int = 0
    index: int = 0


@dataclass
class PromptDataset:
    prompts: list[Any]  # as in the dataset: strings or chat-message lists
    columns: dict[str, list]  # the other columns, handed to reward functions
    token_ids: np.ndarray  # all prompts' token ids, concatenated (int32)
    offsets: np.ndarray  # prompt i is token_ids[offsets[i]:offsets[i + 1]]
    shuffle: bool  # the data section's shuffle_dataset
    seed: int  # the data section's seed
    num_truncated: int = 0
    # Each prompt's images as the model sees them (decoded, RGB, bucketed), also in the
    # prompt's image parts; None for a text dataset. The image column stays in `columns` as the
    # dataset holds it: TRL hands reward functions that.
    images: list[list[Any]] | None = None
    _order: tuple[int, np.ndarray] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.prompts)

    def prompt_ids(self, i: int) -> list[int]:
        return self.token_ids[self.offsets[i]:self.offsets[i + 1]].tolist()

    def record(self, i: int) -> dict:
        return {"prompt": self.prompts[i], "prompt_ids": self.prompt_ids(i),
                **{k: v[i] for k, v in self.columns.items()}}

    def order(self, epoch: int) -> np.ndarray:
        """The row order of an epoch: a permutation seeded by (seed, epoch), or 0..N-1."""
        if self._order is None or self._order[0] != epoch:
            n = len(self)
            perm = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                    else np.arange(n))
            self._order = (epoch, perm)
        return self._order[1]

    def batch_prompts(self, position: DataPosition, num_prompts: int
                      ) -> tuple[list[dict], DataPosition]:
        """`num_prompts` unique prompt records from `position`, and the position after them.

        An epoch's tail too short for a whole batch is skipped, as TRL's sampler does.
        """
        rows, after = self.batch_rows(position, num_prompts)
        return [self.record(i) for i in rows], after

    def batch_rows(self, position: DataPosition, num_prompts: int
                   ) -> tuple[list[int], DataPosition]:
        """batch_prompts' dataset rows."""
        n = len(self)
        if num_prompts > n:
            raise DataError(f"the dataset has {n} prompts but one generation batch needs "
                            f"{num_prompts} unique ones; lower generation_batch_size or add data")
        epoch, index = DataPosition(*position)
        if index + num_prompts > n:
            epoch, index = epoch + 1, 0
        rows = self.order(epoch)[index:index + num_prompts]
        return [int(i) for i in rows], DataPosition(epoch, index + num_prompts)

    def ends_epoch(self, position: DataPosition, num_prompts: int) -> bool:
        """Whether a batch that ended at `position` was its epoch's last (the next one of
        num_prompts would not fit: batch_prompts skips the tail)."""
        return position.index + num_prompts > len(self)


# ---------------------------------------------------------------- loading

def load_prompts(cfg: DataArgs, tokenizer, *, test: bool = False,
                 tools: Sequence[Any] = (), model_dir: str | Path | None = None
                 ) -> PromptDataset:
    """Load, template and tokenize the prompts of `cfg`'s train split (`test`: its eval split,
    dataset_test_split of eval_dataset_name or else dataset_name); truncation is from the
    left. `tools`: functions whose schemas the chat template shows (TRL's `tools`). The eval
    split is always shuffled with the seed, as TRL's eval sampler (RepeatSampler, shuffle on).
    A dataset with an `image` / `images` column needs `model_dir` to be a vision-language
    model's: its processor makes the prompts' token ids, each image's tokens expanded."""
    name = (cfg.eval_dataset_name or cfg.dataset_name) if test else cfg.dataset_name
    split = cfg.dataset_test_split if test else cfg.dataset_train_split
    if test and cfg.eval_dataset_name and _single_file(name) and split == "test":
        split = "train"  # a separate eval file: the whole of it
    columns = _load_columns(name, cfg.dataset_config, split, cfg.seed)
    if cfg.prompt_column not in columns:
        raise DataError(f"dataset {name!r} has no column {cfg.prompt_column!r}; its "
                        f"columns are {sorted(columns)}. Set prompt_column to one of them.")
    prompts = with_system_prompt(columns.pop(cfg.prompt_column), cfg.system_prompt)
    column = images_lib.image_column(columns, prompts, name)
    columns = {k: v for k, v in columns.items() if k not in NOT_REWARD_COLUMNS}
    if not prompts:
        raise DataError(f"dataset {name!r} split {split!r} is empty")
    set_chat_template(tokenizer, cfg)  # decoding's too
    images = None
    if column is None:
        ids = tokenize_prompts(prompts, tokenizer, cfg.chat_template_kwargs, tools=tools)
    else:
        # The images first: a column that holds no images is the dataset's fault, whatever
        # the model.
        buckets = images_lib.parse_buckets(cfg.image_buckets or ())
        images = [images_lib.model_images(v, column, i, buckets)
                  for i, v in enumerate(columns[column])]
        if model_dir is None:
            raise DataError(f"dataset {name!r} has images (column {column!r}) but no model "
                            "was given to read them with")
        images_lib.require_vision(str(model_dir), model_dir, column)
        prompts, ids = _image_prompts(prompts, images, cfg, model_dir, tools, tokenizer)
    limit = cfg.max_prompt_length
    truncated = 0
    if limit is not None:
        truncated = sum(len(x) > limit for x in ids)
        if truncated and images is not None:
            # A cut prompt loses image tokens the vision tower's features must fill.
            raise DataError(f"{truncated} prompts with images are longer than "
                            f"max_prompt_length={limit} tokens (their image tokens included); "
                            "raise max_prompt_length or set it to null (TRL's advice for "
                            "vision-language models)")
        ids = [x[-limit:] for x in ids]
    empty = [i for i, x in enumerate(ids) if not x]
    if empty:
        raise DataError(f"prompt {empty[0]} (and {len(empty) - 1} others) tokenizes to nothing; "
                        "remove empty prompts from the dataset")
    if truncated:
        logger.warning("%d of %d prompts (%.1f%%) were longer than max_prompt_length=%d tokens "
                       "and lost their beginning; raise max_prompt_length or filter the dataset",
                       truncated, len(ids), 100 * truncated / len(ids), limit)
    lengths = np.array([len(x) for x in ids], np.int64)
    return PromptDataset(
        prompts=list(prompts), columns=columns,
        token_ids=np.fromiter((t for x in ids for t in x), np.int32, int(lengths.sum())),
        offsets=np.concatenate([[0], np.cumsum(lengths)]), num_truncated=truncated,
        shuffle=cfg.shuffle_dataset or test, seed=cfg.seed, images=images)


def _image_prompts(prompts: Sequence[Any], images: Sequence[list[Any]], cfg: DataArgs,
                   model_dir: str | Path, tools: Sequence[Any], tokenizer, chunk: int = 64
                   ) -> tuple[list[Any], list[list[int]]]:
    """(multimodal prompts, their token ids) of an image dataset: each row's images put in the
    prompt's image parts (TRL's prepare_multimodal_messages), and the prompts through the
    model's processor. With tools the processor renders with the template the tool loop
    parses and extends (the tokenizer's, as rollout/tools.py prepare_tool_tokenizer left it:
    TRL renders with its swapped training template too)."""
    prompts = [images_lib.multimodal_messages(p, im, i)
               for i, (p, im) in enumerate(zip(prompts, images))]
    processor = images_lib.load_processor(model_dir)
    if tools:
        processor.chat_template = tokenizer.chat_template
    elif cfg.chat_template:
        processor.chat_template = chat_template(cfg.chat_template)
    ids = []
    for start in range(0, len(prompts), chunk):
        batch = images_lib.process(processor, prompts[start:start + chunk],
                                   cfg.chat_template_kwargs, tools)
        ids += [batch.prompt_ids(i) for i in range(len(batch.input_ids))]
    return prompts, ids


def with_system_prompt(prompts: Sequence[Any], system_prompt: str | None) -> list[Any]:
    """open-r1's conversation form: [system, user] for a plain prompt, the system message
    first for chat messages (None: the prompts as they are)."""
    if system_prompt is None:
        return list(prompts)
    system = {"role": "system", "content": system_prompt}
    out = []
    for i, p in enumerate(prompts):
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
        if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
            raise DataError(f"prompt {i} already starts with a system message; drop "
                            "system_prompt or the dataset's system messages")
        out.append([system, *messages])
    return out


def set_chat_template(tokenizer, cfg: DataArgs):
    """`tokenizer`, its chat template replaced by the chat_template setting where there is one."""
    if cfg.chat_template:
        tokenizer.chat_template = chat_template(cfg.chat_template)
    return tokenizer


def chat_template(value: str) -> str:
    """The chat_template setting: a Jinja string, the path of a .jinja file, or a shipped
    template by name (`chatml_tools`: ChatML with Hermes tool calls, for SmolLM2)."""
    shipped = resources.files("grpo_jax") / "assets" / f"{value}.jinja"
    if "\n" not in value and "{" not in value and shipped.is_file():
        return shipped.read_text()
    if value.endswith(".jinja"):
        path = Path(value).expanduser()
        if not path.is_file():
            raise DataError(f"chat_template {value!r}: no such file")
        return path.read_text()
    return value


def tokenize_prompts(prompts: Sequence[Any], tokenizer, chat_template_kwargs=None,
                     chunk: int = 1024, tools: Sequence[Any] = ()) -> list[list[int]]:
    """Token ids of each prompt, as TRL 1.16 makes them: a plain string with the tokenizer's
    special tokens (`tokenizer(text=...)`, e.g. a BOS), chat messages as their rendered template
    without any (`apply_chat_template(tokenize=True)` adds none: the template holds them)."""
    texts = render_prompts(prompts, tokenizer, chat_template_kwargs, tools)
    plain = [isinstance(p, str) for p in prompts]
    ids: list[list[int] | None] = [None] * len(texts)
    for kind in (True, False):
        rows = [i for i, is_plain in enumerate(plain) if is_plain is kind]
        for start in range(0, len(rows), chunk):
            part = rows[start:start + chunk]
            out = tokenizer([texts[i] for i in part], add_special_tokens=kind)["input_ids"]
            for i, x in zip(part, out):
                ids[i] = list(x)
    return ids


def render_prompts(prompts: Sequence[Any], tokenizer, chat_template_kwargs=None,
                   tools: Sequence[Any] = ()) -> list[str]:
    """Strings as they are; chat messages through the tokenizer's chat template (with TRL's
    chat_template_kwargs, e.g. Qwen3's enable_thinking, and the `tools`' schemas)."""
    texts = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            texts.append(p)
        elif isinstance(p, list) and p and all(isinstance(m, dict) and "role" in m and
                                                "content" in m for m in p):
            if not getattr(tokenizer, "chat_template", None):
                raise DataError("the prompts are chat messages but the tokenizer has no chat "
                                "template; use an instruct/chat model or plain-string prompts")
            # `or None`, as TRL: some templates render tool boilerplate for tools=[].
            texts.append(tokenizer.apply_chat_template(p, tokenize=False,
                                                       add_generation_prompt=True,
                                                       tools=list(tools) or None,
                                                       **(chat_template_kwargs or {})))
        else:
            raise DataError(f"prompt {i} is {type(p).__name__} {str(p)[:80]!r}; a prompt must "
                            "be a string or a list of {'role', 'content'} messages")
    return texts


def _single_file(name: str) -> bool:
    return Path(name).expanduser().is_file()


def _load_columns(name: str, config: str | None, split: str, seed: int) -> dict[str, list]:
    if name in BUILTIN_DATASETS:
        splits = ("train",) if name == "smol_prompts" else ("train", "test")
        if split not in splits:
            raise DataError(f"built-in dataset {name!r} has the splits {list(splits)}, not "
                            f"{split!r}" + ("" if len(splits) > 1 else
                                            "; evaluate on a file of your own: eval_dataset_name"))
        if name == "arithmetic":
            return arithmetic_columns(seed, split)
        if name == "squares":
            from grpo_jax import squares
            return squares.columns(seed, split)
        if name.startswith("calculator"):
            from grpo_jax import calculator
            return calculator.columns(seed, split, shots=calculator.PLAIN_SHOTS
                                      if name == "calculator_plain" else calculator.SHOTS)
        text = (resources.files("grpo_jax") / "assets" / "smol_prompts.jsonl").read_text()
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        # As chat messages: the embedded model is an instruct model, and answering in a chat
        # turn lets it end (EOS) on its own, so reward_len has lengths to choose between.
        return {"prompt": [[{"role": "user", "content": _post_body(r["prompt"])
                             + "\n\nTL;DR in a few words:"}] for r in rows]}
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir():
            return _load_local(path, str(path), config, split=split)
        loader = FILE_LOADERS.get(path.suffix.lower())
        if loader is None:
            raise DataError(f"can't read {path}: supported files are "
                            f"{', '.join(FILE_LOADERS)} (by extension)")
        if not split.startswith("train"):
            raise DataError(f"a single file holds one split, 'train', not {split!r}: slices "
                            "split it (dataset_train_split: 'train[:90%]', dataset_test_split: "
                            "'train[90%:]'), or name an eval file in eval_dataset_name")
        if path.stat().st_size == 0:
            raise DataError(f"dataset file {path} is empty")
        return _load_local(path, loader, data_files=str(path), split=split)
    if name.startswith((".", "/", "~")) or path.suffix.lower() in FILE_LOADERS:
        raise DataError(f"dataset file {name!r} not found")
    return _load_hub(name, config, split)


def _post_body(prompt: str) -> str:
    """The POST part of a TL;DR-style prompt ("SUBREDDIT: ..., TITLE: ..., POST: ..., TL;DR:")."""
    body = prompt.split("POST:", 1)[-1]
    return body.removesuffix("TL;DR:").strip()


def _datasets_load(*args, **kwargs) -> dict[str, list]:
    import datasets
    ds = datasets.load_dataset(*args, **kwargs)
    out = ds.to_dict()
    # to_dict leaves an Image feature's values as {'bytes', 'path'} dicts; TRL reads rows, which
    # datasets decodes to PIL images, and hands those to reward functions.
    for column, feature in ds.features.items():
        if isinstance(feature, datasets.Image) or (
                isinstance(feature, datasets.List) and isinstance(feature.feature,
                                                                  datasets.Image)):
            out[column] = list(ds[column])
    return out


def _load_local(what: Path, *args, **kwargs) -> dict[str, list]:
    """`_datasets_load` of the user's own file or directory `what`: one it can't read
    (malformed JSON lines, no rows, a bad split) is a DataError with the innermost reason,
    and datasets' own log of it is not printed too."""
    quiet = logging.getLogger("datasets")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        return _datasets_load(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - ArrowInvalid (with the row), no rows, a bad split
        root = e  # the reason under datasets' own wrappers ("An error occurred while ...")
        while type(root).__module__.startswith("datasets") and (root.__cause__ or
                                                                root.__context__):
            root = root.__cause__ or root.__context__
        reason = " ".join(f"{type(root).__name__}: {root}".split())[:300]
        raise DataError(f"can't read dataset {what} (split {kwargs.get('split')!r}): "
                        f"{reason}") from None
    finally:
        quiet.setLevel(level)


def _offline() -> bool:
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub can't be reached, or None. datasets itself retries for ~25 s."""
    url = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout)
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError) as e:
        return f"{url} unreachable: {getattr(e, 'reason', e)}"
    return None


def _load_hub(name: str, config: str | None, split: str) -> dict[str, list]:
    offline = _offline()
    fix = ("HF_HUB_OFFLINE is set, so only your Hugging Face cache is read and this dataset is "
           "not in it" if offline else "Without hub access: set HF_HUB_OFFLINE=1 if the dataset "
           "is in your Hugging Face cache") + (
        f"; or save it where you have access (`datasets.load_dataset({name!r}, split={split!r})"
        ".to_json('data.jsonl')`) and pass the file's path as dataset_name.")
    reason = None if offline else _hub_unreachable()
    if reason:
        raise DataError(f"can't load dataset {name!r}: {reason}. {fix}")
    try:
        return _datasets_load(name, config, split=split)
    except (ConnectionError, OSError) as e:
        raise DataError(f"can't load dataset {name!r} from the Hugging Face hub "
                        f"({type(e).__name__}: {e}). {fix}") from None
    except ValueError as e:  # unknown split or config
        raise DataError(f"can't load dataset {name!r} (config {config!r}, split {split!r}): "
                        f"{e}") from None


def arithmetic_questions() -> list[tuple[str, str]]:
    """Every (question, answer): a + b and a - b for 9 >= a >= b >= 1, a x b for 9 >= a >= b >= 2.

    Single-digit operands: a 135M model gets some of these right, so a group of completions has
    reward variance to learn from (on two-digit sums it scores 0 and GRPO has no signal).
    """
    out = []
    for op, low in (("+", 1), ("-", 1), ("x", 2)):
        for a in range(low, 10):
            for b in range(low, a + 1):
                value = {"+": a + b, "-": a - b, "x": a * b}[op]
                out.append((f"What is {a} {op} {b}? Answer with just the number.", str(value)))
    return out


def arithmetic_columns(seed: int, split: str = "train",
                       size: int = ARITHMETIC_SIZE) -> dict[str, list]:
    """Questions as chat prompts, with the answer as a string column. The seed holds
    ARITHMETIC_TEST questions out: they are the 'test' split, once each, and never in 'train'
    (`size` draws from the others), so evaluation measures questions the run never saw."""
    pool = arithmetic_questions()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(pool))
    rows = (order[:ARITHMETIC_TEST] if split == "test"
            else rng.choice(order[ARITHMETIC_TEST:], size=size))
    return {"prompt": [[{"role": "user", "content": pool[i][0]}] for i in rows],
            "answer": [pool[i][1] for i in rows]}
