"""Reward functions: the built-ins, user functions and reward models named in the config
(models: grpo_jax.reward_model), and their evaluation.

A reward function has TRL 1.16's signature, `f(prompts, completions, completion_ids,
trainer_state, log_extra, log_metric, **columns) -> list[float | None]`, sync or async:
`columns` are the dataset's extra columns, one value per completion; `trainer_state` has
transformers' TrainerState progress fields (`TrainerState`); `log_extra(column, values)` adds a
column (one value per completion) to the completions table and `log_metric(name, value)` a
scalar metric, averaged over the round (both collected by a `RewardLogs`). None means "no
opinion" and becomes NaN, which the weighted sum skips; a NaN returned is the same (as in TRL).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from grpo_jax import math_rewards
from grpo_jax.math_rewards import completion_text as _text
from grpo_jax.errors import RewardError


def reward_len(completions, **kwargs) -> list[float]:
    """TRL's quick-start toy reward: completions close to 20 characters score highest."""
    return [-abs(20 - len(_text(c))) for c in completions]


_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL)


def think_format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion opens with one <think>...</think> block (TRL's format reward)."""
    return [1.0 if _THINK.match(_text(c)) else 0.0 for c in completions]


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def accuracy(completions, answer=None, solution=None, **kwargs) -> list[float | None]:
    """1.0 for a right answer. With an `answer` column (a number): the completion's last number
    equals it. With a `solution` column (LaTeX, as open-r1's datasets): math-verify says the
    completion's final answer equals the solution's."""
    if answer is not None:
        return [1.0 if last_number(_text(c)) == float(a) else 0.0
                for c, a in zip(completions, answer)]
    if solution is not None:
        return math_rewards.math_accuracy(completions, solution)
    raise RewardError("accuracy needs an `answer` (a number) or `solution` (LaTeX) column")


def soft_overlong_punishment_reward(completion_ids, *, max_completion_length: int,
                                    soft_punish_cache: int, **kwargs) -> list[float]:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), as TRL's
    `get_soft_overlong_punishment(max_completion_length, soft_punish_cache)`: 0 up to
    max_completion_length - soft_punish_cache tokens, then a linear ramp down to -1 at
    max_completion_length, -1 beyond. Lengths are len(completion_ids), as TRL counts them (the
    stop token included). Named after TRL's function, so its metrics are TRL's."""
    start = max_completion_length - soft_punish_cache
    return [0.0 if len(ids) <= start
            else (start - len(ids)) / soft_punish_cache if len(ids) <= max_completion_length
            else -1.0 for ids in completion_ids]


BUILTIN_REWARDS: dict[str, Callable] = {
    "reward_len": reward_len, "think_format_reward": think_format_reward, "accuracy": accuracy,
    "format": math_rewards.format_reward, "tag_count": math_rewards.tag_count_reward,
    # Takes the run's max_completion_length and soft_punish_cache (load_reward_func).
    "soft_overlong_punishment": soft_overlong_punishment_reward,
}


@dataclasses.dataclass(frozen=True)
class RewardFunc:
    name: str  # the config's spelling, used in errors
    fn: Callable

    @property
    def log_name(self) -> str:
        """TRL's name for the function in metrics and the completions table: its __name__
        (functools.partial unwrapped; a callable object: its class name)."""
        return callable_name(self.fn)


def callable_name(fn: Callable) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def reward_names(funcs: Sequence[RewardFunc | Callable]) -> list[str]:
    """The functions' log names (`RewardFunc.log_name`), made unique: a repeated name gets _2,
    _3, ... (TRL would merge two functions' metrics under one name)."""
    out: list[str] = []
    for f in funcs:
        base = f.log_name if isinstance(f, RewardFunc) else callable_name(f)
        name, k = base, 1
        while name in out:
            k += 1
            name = f"{base}_{k}"
        out.append(name)
    return out


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """What a reward function reads from TRL's `trainer_state` (transformers.TrainerState's
    names) to shape rewards by training progress. `global_step`: optimizer steps done before
    this round's updates; `epoch`: epochs done, a float; `max_steps`: the run's total steps.
    Values of the run, not settings: no defaults (NOT_STARTED stands for no run)."""
    global_step: int
    epoch: float
    max_steps: int
    num_train_epochs: float


NOT_STARTED = TrainerState(global_step=0, epoch=0.0, max_steps=0, num_train_epochs=0.0)


@dataclasses.dataclass
class RewardLogs:
    """Collects what reward functions log through TRL's `log_extra` and `log_metric`.

    `extra`: column -> values, one per scored completion in scoring order (TRL adds these
    columns to its completions table). `metrics`: name -> every value logged; TRL logs their
    mean (`metric_means`) with the round's metrics. Use one per round (or per scoring call).
    """
    extra: dict[str, list] = dataclasses.field(default_factory=dict)
    metrics: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        self.extra.setdefault(str(column), []).extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))

    def metric_means(self) -> dict[str, float]:
        return {k: sum(v) / len(v) for k, v in self.metrics.items() if v}

    @classmethod
    def merged(cls, parts: Sequence[tuple[Sequence[int], "RewardLogs"]],
               num_rows: int) -> "RewardLogs":
        """One batch's logs from the parts that scored its rows (each process's rows and
        logs): log_extra columns over all `num_rows` in batch order (None where a part logged
        nothing), log_metric values pooled, so their mean is TRL's total / count over
        processes."""
        out = cls()
        for rows, logs in parts:
            for column, values in logs.extra.items():
                full = out.extra.setdefault(column, [None] * num_rows)
                for i, v in zip(rows, values):
                    full[i] = v
            for name, values in logs.metrics.items():
                out.metrics.setdefault(name, []).extend(values)
        return out


def load_reward_func(spec: str, processing_class: str | None = None, *, mesh=None,
                     dtype: str = "float32", chat_template_kwargs: dict | None = None,
                     max_completion_length: int | None = None,
                     soft_punish_cache: int | None = None) -> RewardFunc:
    """A built-in name, 'package.module:function', 'path/to/file.py:function', or a reward
    model: a directory or hub id 'org/name' of a ...ForSequenceClassification checkpoint
    (grpo_jax.reward_model), scored with the tokenizer `processing_class` (None: its own) in
    compute `dtype` on `mesh` (the trainer's), chat prompts rendered with
    `chat_template_kwargs`. TRL ignores a processing class given for a function; so does this.
    `soft_overlong_punishment` takes the run's `max_completion_length` and `soft_punish_cache`."""
    if spec == "soft_overlong_punishment":
        if max_completion_length is None or soft_punish_cache is None:
            raise RewardError("soft_overlong_punishment needs max_completion_length and "
                              "soft_punish_cache (the tokens before it where the penalty "
                              "starts; DAPO: 4096 of 20480): set soft_punish_cache")
        return RewardFunc(spec, functools.partial(
            soft_overlong_punishment_reward, max_completion_length=max_completion_length,
            soft_punish_cache=soft_punish_cache))
    if spec in BUILTIN_REWARDS:
        return RewardFunc(spec, BUILTIN_REWARDS[spec])
    if names_a_model(spec):
        from grpo_jax import reward_model  # jax and the model code: only when a model is named
        return RewardFunc(spec, reward_model.load_reward_model(
            spec, processing_class, mesh=mesh, dtype=dtype,
            chat_template_kwargs=chat_template_kwargs))
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise RewardError(
            f"unknown reward function {spec!r}: built-ins are {', '.join(BUILTIN_REWARDS)}; "
            "name your own as 'package.module:function' or 'path/to/file.py:function', or a "
            "reward model by its directory or hub id 'org/name'")
    fn = import_callable(spec, "reward function", RewardError)
    _check_signature(spec, fn)
    return RewardFunc(spec, fn)


def import_callable(spec: str, what: str, error: type[Exception]) -> Callable:
    """The callable 'package.module:name' or 'path/to/file.py:name' names (a file is imported
    once per path). `what` names it in errors, raised as `error`."""
    where, _, attr = spec.rpartition(":")
    if where.endswith(".py") or "/" in where:
        path = Path(where).expanduser()
        if not path.is_file():
            raise error(f"{what} {spec!r}: no such file {str(path)!r}")
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
        mod_name = f"grpo_jax_user_{path.stem}_{digest}"
        module = sys.modules.get(mod_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[mod_name] = module
            try:
                module_spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[mod_name]
                raise error(f"{what} {spec!r}: importing {path} raised "
                            f"{type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise error(f"{what} {spec!r}: can't import module {where!r} "
                        f"({type(e).__name__}: {e}); is it on PYTHONPATH?") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise error(f"{what} {spec!r}: {where} has no function {attr!r} "
                    f"(it has: {', '.join(sorted(names)) or 'none'})")
    return fn


def _check_signature(name: str, fn: Callable) -> None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # some builtins have no signature; the call will tell
    params = list(params)
    signature = "f(prompts, completions, completion_ids, **kwargs)"
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    if not any(p.name == "completions" for p in params):
        raise RewardError(f"reward function {name!r} must accept the keyword `completions` "
                          f"(signature: {signature})")
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [a for a in REWARD_ARGS if a not in names]
    if missing:
        raise RewardError(f"reward function {name!r} has no **kwargs, but it is also called "
                          f"with {', '.join(missing)} and the dataset's columns (as TRL does); "
                          f"give it **kwargs (signature: {signature})")


def names_a_model(spec: str) -> bool:
    """Whether a reward_funcs entry names a reward model: a directory, or a '/' without ':'
    (a hub id; a function is 'module:function' or 'file.py:function')."""
    return Path(spec).expanduser().is_dir() or ("/" in spec and ":" not in spec)


def load_reward_funcs(specs: Sequence[str], processing_classes: Sequence[str | None] | None = None,
                      **model_options) -> list[RewardFunc]:
    """`load_reward_func` of each spec, with its entry of `processing_classes` (TRL's
    reward_processing_classes: one per function, None for a model's own tokenizer)."""
    if processing_classes is not None and len(processing_classes) != len(specs):
        raise RewardError(f"reward_processing_classes has {len(processing_classes)} entries "
                          f"but reward_funcs has {len(specs)}: give one per function (null "
                          "for a reward model's own tokenizer; ignored for functions)")
    classes = [None] * len(specs) if processing_classes is None else processing_classes
    return [load_reward_func(s, c, **model_options) for s, c in zip(specs, classes)]


def completions_for_rewards(prompts: Sequence[Any], texts: Sequence[str]) -> list[Any]:
    """Completions in TRL's form: assistant messages for chat prompts, else plain strings."""
    return [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
            for p, t in zip(prompts, texts)]


# Arguments every reward function gets besides the dataset's columns (TRL 1.16).
REWARD_ARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra",
               "log_metric")


def compute_rewards(funcs: Sequence[RewardFunc | Callable], prompts: Sequence[Any],
                    completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
                    columns: dict[str, Sequence[Any]] | None = None, *,
                    trainer_state: Any = None, logs: RewardLogs | None = None) -> np.ndarray:
    """Every function on every completion: float32 [N, F], NaN where a function said None.

    Async functions run concurrently on one event loop; sync ones run in order. Each gets
    `trainer_state` (default: NOT_STARTED) and `logs`' log_extra / log_metric (default: a
    collector nobody reads); a column given to log_extra in this call must end up with one
    value per completion.
    """
    funcs = [f if isinstance(f, RewardFunc) else RewardFunc(callable_name(f), f) for f in funcs]
    columns = dict(columns or {})
    logs = RewardLogs() if logs is None else logs
    before = {k: len(v) for k, v in logs.extra.items()}
    n = len(completions)
    if len(prompts) != n or len(completion_ids) != n:
        raise ValueError(f"compute_rewards: {len(prompts)} prompts, {n} completions and "
                         f"{len(completion_ids)} completion_ids must be aligned")
    for key, values in columns.items():
        if key in REWARD_ARGS:
            raise ValueError(f"dataset column {key!r} clashes with a reward-function argument; "
                             "rename the column")
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    kwargs = dict(prompts=list(prompts), completions=list(completions),
                  completion_ids=[list(c) for c in completion_ids],
                  trainer_state=NOT_STARTED if trainer_state is None else trainer_state,
                  log_extra=logs.log_extra, log_metric=logs.log_metric,
                  **{k: list(v) for k, v in columns.items()})
    out = np.full((n, len(funcs)), np.nan, np.float32)
    pending = {}
    for j, f in enumerate(funcs):
        try:
            result = f.fn(**kwargs)
        except Exception as e:
            for c in pending.values():  # don't leave started coroutines un-awaited
                getattr(c, "close", lambda: None)()
            raise _call_error(f, e, kwargs, columns) from e
        if inspect.isawaitable(result):
            pending[j] = result
        else:
            out[:, j] = _as_rewards(f.name, result, n)
    if pending:
        for j, result in zip(pending, _run_async(list(pending.values()))):
            if isinstance(result, BaseException):
                raise _call_error(funcs[j], result, kwargs, columns) from result
            out[:, j] = _as_rewards(funcs[j].name, result, n)
    for column, values in logs.extra.items():
        got = len(values) - before.get(column, 0)
        if got not in (0, n):
            raise RewardError(f"log_extra column {column!r} got {got} values for {n} "
                              "completions; log one value per completion (once per column)")
    return out


def _call_error(f: RewardFunc, e: BaseException, kwargs: dict, columns: dict) -> RewardError:
    """One line naming the function and its own exception (and where it was raised). The
    advice to add **kwargs only when the call itself failed: the function's signature does
    not take the arguments it is called with (a TypeError raised inside it is its own bug)."""
    what = " ".join(f"{type(e).__name__}: {e}".split())
    if isinstance(e, TypeError) and not _binds(f.fn, kwargs):
        return RewardError(
            f"reward function {f.name!r} raised {what}: it is called as "
            f"f(prompts=..., completions=..., completion_ids=..., trainer_state=..., "
            f"log_extra=..., log_metric=..., **columns) with dataset columns "
            f"{sorted(columns) or 'none'}; give it **kwargs to accept the arguments it "
            "doesn't use")
    frames = traceback.extract_tb(e.__traceback__)
    where = (f" at {frames[-1].filename}:{frames[-1].lineno}"
             if frames and frames[-1].filename != __file__ else "")
    return RewardError(f"reward function {f.name!r} raised {what}{where}; fix the function")


def _binds(fn: Callable, kwargs: dict) -> bool:
    """Whether `fn`'s signature takes `kwargs` (True where it has none to check)."""
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins)
        return True
    return True


def _run_async(awaitables: list) -> list:
    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    # Called from inside a running loop (a notebook): asyncio.run needs a thread of its own.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def _as_rewards(name: str, result: Any, n: int) -> np.ndarray:
    if isinstance(result, np.ndarray):
        result = result.tolist()
    if not isinstance(result, (list, tuple)) or len(result) != n:
        got = f"{len(result)} values" if isinstance(result, (list, tuple)) else repr(type(result))
        raise RewardError(f"reward function {name!r} returned {got} for {n} completions; "
                          "return a list with one float (or None) per completion")
    values = np.empty(n, np.float32)
    for i, r in enumerate(result):
        if r is None:
            values[i] = np.nan
        elif isinstance(r, numbers.Real) and not math.isinf(r):
            values[i] = float(r)
        else:
            raise RewardError(f"reward function {name!r} returned {r!r} for completion {i}; "
                              "each reward must be a finite number or None (NaN counts as "
                              "None: no reward for that completion)")
    return values


def missing_rewards(per_func: np.ndarray, names: Sequence[str], prompts: Sequence[Any] = (),
                    texts: Sequence[str] = ()) -> tuple[dict[str, str], list[str]]:
    """What a batch's [N, F] rewards (NaN: None or NaN returned) lack, as warning lines:
    ({name: line} of the functions that gave no reward to any completion, lines about the
    completions no function scored). TRL
    warns about the second (all reward functions returned None for a completion: its
    advantage is 0); when that is every completion, the update learns nothing from rewards."""
    missing = np.isnan(per_func)
    funcs = {name: f"reward function {name!r} gave no reward (None or NaN) to any of the "
                   f"{len(per_func)} completions of this batch"
             for name, col in zip(names, missing.T) if col.all()}
    rows = np.flatnonzero(missing.all(axis=1))
    if not rows.size:
        return funcs, []
    if rows.size == len(per_func):
        return funcs, [f"no completion of this batch has a reward: every reward function "
                       f"returned None or NaN for all {len(per_func)}, so every advantage is 0 "
                       "and this batch teaches the policy nothing; fix the reward functions"]
    i = int(rows[0])
    example = (f" (e.g. completion {i}: {str(prompts[i])[:80]!r} -> {str(texts[i])[:80]!r})"
               if len(prompts) > i and len(texts) > i else "")
    return funcs, [f"all reward functions returned None or NaN for {rows.size} of "
                   f"{len(per_func)} completions{example}: their advantage is 0"]
