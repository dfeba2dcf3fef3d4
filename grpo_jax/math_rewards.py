"""open-r1's reward functions for math reasoning, by the names its recipes use: `accuracy`
(math-verify on LaTeX answers), `format` and `tag_count` (the <think>/<answer> layout).

math-verify is optional (`pip install 'grpo-jax[math]'`); only `accuracy` against a LaTeX
`solution` column needs it.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from grpo_jax.errors import RewardError

_LAYOUT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$",
                     re.DOTALL | re.MULTILINE)


def completion_text(completion: Any) -> str:
    # Conversational datasets get completions as [{"role": "assistant", "content": ...}] (TRL).
    if isinstance(completion, list):
        return completion[0]["content"] if completion else ""
    return completion


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion is exactly <think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>."""
    return [1.0 if _LAYOUT.match(completion_text(c)) else 0.0 for c in completions]


def tag_count_reward(completions, **kwargs) -> list[float]:
    """0.25 for each of the four layout tags present exactly once (a smooth `format`)."""
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return [sum(0.25 for t in tags if completion_text(c).count(t) == 1) for c in completions]


def math_accuracy(completions, solution, **kwargs) -> list[float | None]:
    """1.0 when math-verify finds the completion's final (boxed or LaTeX) answer equal to the
    `solution` column's; None (skipped, as TRL does) where the solution itself can't be parsed."""
    try:
        from math_verify import LatexExtractionConfig, parse, verify
        from math_verify.parser import NormalizationConfig
    except ImportError as e:
        raise RewardError("accuracy against a `solution` column needs math-verify: "
                          "pip install 'grpo-jax[math]'") from e
    # math-verify's timeout uses signals, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    answer_config = [LatexExtractionConfig(
        normalization_config=NormalizationConfig(nits=False, malformed_operators=False,
                                                 basic_latex=True, equations=True, boxed="all",
                                                 units=True),
        boxed_match_priority=0, try_extract_without_anchor=False)]
    out: list[float | None] = []
    for completion, sol in zip(completions, solution):
        gold = parse(sol, extraction_mode="first_match", parsing_timeout=timeout)
        if not gold:
            out.append(None)
            continue
        pred = parse(completion_text(completion), extraction_config=answer_config,
                     extraction_mode="first_match", parsing_timeout=timeout)
        out.append(float(verify(gold, pred, timeout_seconds=timeout)))
    return out
