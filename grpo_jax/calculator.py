"""The multi-turn tool-calling example (`--config calculator`): a calculator tool, questions
with operands too big for SmolLM2-135M to multiply in its head, and an exact-answer reward.

SmolLM2's chat template has no tools; with the shipped `chatml_tools` template and two worked
exchanges before each question (call, result, answer) it calls the calculator by itself."""

import ast
import operator
import re

import numpy as np

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with integers, +, - and *.

    Args:
        expression: The expression, e.g. "48213 * 9177".
    """
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not an integer expression: {expression!r}")
    return str(value(ast.parse(expression, mode="eval").body))


def _call(expression: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator",
                                          "arguments": {"expression": expression}}}]}


# Two worked exchanges (call, result, answer) that lead every question.
SHOTS = [{"role": "user", "content": "What is 5123 * 311?"}, _call("5123 * 311"),
         {"role": "tool", "name": "calculator", "content": "1593253"},
         {"role": "assistant", "content": "5123 * 311 = 1593253"},
         {"role": "user", "content": "What is 7781 + 90412?"}, _call("7781 + 90412"),
         {"role": "tool", "name": "calculator", "content": "98193"},
         {"role": "assistant", "content": "7781 + 90412 = 98193"}]
# The same exchanges answered without the tool: the baseline's prompts (dataset
# 'calculator_plain'), so a run without tools is not shown calls it can't make.
PLAIN_SHOTS = [SHOTS[0], SHOTS[3], SHOTS[4], SHOTS[7]]
TEST_QUESTIONS = 32  # the 'test' split: drawn from a seed of their own, never trained on


def columns(seed: int, split: str, size: int = 512, shots=SHOTS) -> dict[str, list]:
    """The built-in dataset 'calculator': `shots` then "What is a op b?" with 3- to 5-digit
    operands (op: +, - or *), and the answer column."""
    rng = np.random.default_rng([seed, split == "test"])
    rows = {"prompt": [], "answer": []}
    for _ in range(TEST_QUESTIONS if split == "test" else size):
        a, b = (int(x) for x in rng.integers(100, 100000, 2))
        op = "+-*"[int(rng.integers(3))]
        rows["prompt"].append(shots + [{"role": "user", "content": f"What is {a} {op} {b}?"}])
        rows["answer"].append(str(calculator(f"{a} {op} {b}")))
    return rows


def final_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last assistant turn's last number is the answer (the turns after the
    tool's result count, not the call)."""
    out = []
    for turns, want in zip(completions, answer):
        text = turns[-1]["content"] if isinstance(turns, list) else turns
        if isinstance(turns, list):
            said = [t for t in turns if t["role"] == "assistant" and t.get("content")]
            text = said[-1]["content"] if said else ""
        numbers = re.findall(r"-?\d[\d,]*", text)
        out.append(1.0 if numbers and int(numbers[-1].replace(",", "")) == int(want) else 0.0)
    return out
