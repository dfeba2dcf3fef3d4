"""Which tool-call parser and which training template a chat template gets, as TRL 1.16 knows
them: from the installed `trl` when it is importable, else from the same data copied into
grpo_jax/assets/trl/ (tools/vendor_trl_templates.py; TRL is Apache-2.0, its LICENSE is there).
TRL is no dependency of grpo-jax; tests/test_tool_templates.py checks the copy against it.

TRL recognises a chat template by its exact text (the copy, by the sha256 of it): Qwen2.5/3/3.5/
3.6/3.8 and their VL/2507 variants, Llama 3.1/3.2, gpt-oss, GLM-4-MoE, Gemma 4, LFM2, Nemotron 3,
the DeepSeek-R1 distills get a response template (transformers' response parsing); those whose
template is not prefix-preserving get a training template that is (Qwen3, GLM-4-MoE, gpt-oss...).
"""

from __future__ import annotations

import copy
import hashlib
import json
from importlib import resources
from types import SimpleNamespace
from typing import Any, Protocol


class TemplateTable(Protocol):
    def response_template(self, chat_template: Any) -> dict | None:
        """The parser of the model's replies for `chat_template` (TRL's add_response_schema),
        None for a template TRL doesn't know."""

    def training_template(self, tokenizer) -> str | None:
        """The prefix-preserving template TRL trains with in place of the tokenizer's
        (get_training_chat_template), None where TRL has none."""

    def legacy_response_template(self, schema: dict) -> dict | None:
        """The response template TRL pairs with `schema`, one of its legacy `response_schema`s
        (add_response_schema sets `<name>_schema` on transformers < 5.13, `<name>_template`
        after): None for a schema TRL doesn't ship."""


class TrlTable:
    """The installed TRL's own functions."""

    def __init__(self, chat_template_utils):
        self.ctu = chat_template_utils

    def response_template(self, chat_template):
        holder = SimpleNamespace(chat_template=chat_template)  # what add_response_schema reads
        try:
            self.ctu.add_response_schema(holder)
        except ValueError:  # "Unrecognized chat template"
            return None
        return copy.deepcopy(holder.response_template)

    def training_template(self, tokenizer):
        try:
            return self.ctu.get_training_chat_template(tokenizer)
        except ValueError:  # "patching is not supported for this template"
            return None

    def legacy_response_template(self, schema):
        for name, value in vars(self.ctu).items():
            if name.endswith("_schema") and value == schema:
                return copy.deepcopy(vars(self.ctu).get(name.removesuffix("_schema") + "_template"))
        return None


class VendoredTable:
    """TRL's data as copied into grpo_jax/assets/trl/."""

    def __init__(self):
        self.dir = resources.files("grpo_jax") / "assets" / "trl"
        data = json.loads((self.dir / "index.json").read_text(encoding="utf-8"))
        self.parsers, self.known = data["response_templates"], data["chat_templates"]
        self.legacy = data["legacy_schemas"]

    def _entry(self, chat_template) -> dict:
        if not isinstance(chat_template, str):
            return {}
        return self.known.get(hashlib.sha256(chat_template.encode()).hexdigest(), {})

    def response_template(self, chat_template):
        name = self._entry(chat_template).get("response_template")
        return copy.deepcopy(self.parsers[name]) if name else None

    def training_template(self, tokenizer):
        chat_template = tokenizer.chat_template
        if isinstance(chat_template, dict):  # named variants: TRL patches the default one
            chat_template = chat_template["default"]
        name = self._entry(chat_template).get("training")
        return (self.dir / name).read_text(encoding="utf-8") if name else None

    def legacy_response_template(self, schema):
        name = next((n for n, s in self.legacy.items() if s == schema), None)
        return copy.deepcopy(self.parsers[name]) if name else None


def table() -> TemplateTable:
    """TRL's own where it is installed, else the vendored copy."""
    try:
        from trl import chat_template_utils
    except ImportError:
        return VendoredTable()
    return TrlTable(chat_template_utils)
