"""prepare_tool_tokenizer against TRL 1.16's own start-up with tools (GRPOTrainer.__init__:
supports_tool_calling, add_response_schema, is_chat_template_prefix_preserving,
get_training_chat_template) on every chat template TRL ships (the installed trl's
chat_templates/), from the installed trl and from grpo-jax's vendored copy alike: the same
refusals, the same parser, the same template for the loop, the same tool-result tokens as TRL's
_get_tool_suffix_ids, and a tool call in each template's own format parsed as TRL's
parse_response parses it. Tokenizers only: SmolLM2's, with each template's special strings
added as special tokens (as its model's tokenizer has them). And a GRPO run on a
Qwen3-templated tokenizer that goes past its first tool call."""

import copy
import functools
import json
import os
import re
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from trl import chat_template_utils as ctu
from trl.trainer.grpo_trainer import GRPOTrainer

from grpo_jax.errors import GrpoJaxError
from grpo_jax.rollout import tool_templates, tools

TEMPLATES = sorted(p for p in ctu._CHAT_TEMPLATES_DIR.glob("*.jinja")
                   if not p.stem.endswith("_training"))
# <|im_start|>, <|eot_id|>, <|"|>, <｜Assistant｜>, Gemma 4's <|turn> and <turn|>, GLM's [gMASK]
MARKERS = re.compile(r"<\|[^<>|\s]+\|>|<｜[^｜]+｜>|<\|[\w\"]+>|<\w+\|>|\[gMASK\]|<sop>")
RESULT = [{"role": "tool", "name": "get_weather", "content": "sunny"}]
CALL = {"type": "function", "function": {"name": "get_weather",
                                         "arguments": {"city": "Paris", "days": 3}}}


def get_weather(city: str, days: int) -> str:
    """The weather to come.

    Args:
        city: The city.
        days: How many days ahead.
    """
    return "sunny"


@pytest.fixture(scope="module")
def templated(smol_tok):
    """SmolLM2's tokenizer with a template of TRL's and that template's special strings as
    special tokens, one per template. Read-only: prepare_tool_tokenizer works on a copy."""
    @functools.cache
    def make(path):
        tok = copy.deepcopy(smol_tok)
        text = path.read_text(encoding="utf-8")  # as TRL reads it
        tok.add_tokens(sorted(set(MARKERS.findall(text))), special_tokens=True)
        tok.chat_template = text
        return tok
    return make


def prepare(tok, source, monkeypatch):
    """prepare_tool_tokenizer with TRL's data from the installed trl or the vendored copy:
    the prepared tokenizer, or the one-line refusal."""
    with monkeypatch.context() as m:
        if source == "vendored":
            m.setattr(tool_templates, "table", tool_templates.VendoredTable)
        try:
            return tools.prepare_tool_tokenizer(tok)
        except GrpoJaxError as e:
            return str(e)


def trl_start(tok):
    """GRPOTrainer.__init__ with tools on `tok` (it sets tok.response_template): the chat
    template TRL's loop renders with. Raises where TRL refuses."""
    if not ctu.supports_tool_calling(tok):
        raise ValueError("The provided chat template does not support tool calling.")
    if getattr(tok, "response_template", None) is None:
        ctu.add_response_schema(tok)
    if not ctu.is_chat_template_prefix_preserving(tok):
        return ctu.get_training_chat_template(tok)
    return tok.chat_template


def trl_suffix(tok, chat_template):
    """TRL's own _get_tool_suffix_ids (it raises where the template can't take the results)."""
    trainer = SimpleNamespace(processing_class=tok, _tokenizer=tok, chat_template=chat_template,
                              _is_vlm=False, chat_template_kwargs={})
    return GRPOTrainer._get_tool_suffix_ids(trainer, copy.deepcopy(RESULT))


def rendered_call(tok, content):
    """A prompt and, as token ids, an assistant turn with a call written as the template
    renders it (from where the rendered call departs from the generation prompt)."""
    user = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(tools=[get_weather], tokenize=False)
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, **kw)
    full = tok.apply_chat_template(
        user + [{"role": "assistant", "content": content, "tool_calls": [CALL]}], **kw)
    turn = full[len(os.path.commonprefix([prompt, full])):]
    return (tok(prompt, add_special_tokens=False)["input_ids"],
            tok(turn, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_prepared_as_trl_prepares_it(path, templated, monkeypatch):
    """Refused (one line, with the fix) where TRL refuses or would die at the first tool
    result; else TRL's parser and template, a prefix-preserving one where TRL's is, TRL's
    tool-result tokens, and a call in the template's own format parsed as TRL parses it."""
    tok = templated(path)
    prepared = prepare(tok, "trl", monkeypatch)
    vendored = prepare(tok, "vendored", monkeypatch)  # as where trl is not installed
    if isinstance(prepared, str):
        assert vendored == prepared
    else:
        assert vendored.response_template == prepared.response_template
        assert vendored.chat_template == prepared.chat_template
    assert getattr(tok, "response_template", None) is None  # the tokenizer given is unchanged
    tok = copy.deepcopy(tok)
    try:
        chat_template = trl_start(tok)
        suffix = trl_suffix(tok, chat_template)
    except Exception:  # noqa: BLE001 - TRL refuses at start, or dies at the first tool result
        assert isinstance(prepared, str), "TRL refuses this template"
        assert "\n" not in prepared and ": set" in prepared, prepared  # one line, the fix
        return
    assert not isinstance(prepared, str), prepared
    assert prepared.response_template == tok.response_template
    assert prepared.chat_template == chat_template
    assert tools.is_prefix_preserving(prepared) == ctu.is_chat_template_prefix_preserving(prepared)
    assert tools.tool_suffix_ids(prepared, copy.deepcopy(RESULT)) == suffix
    for content in ("", "Let me look."):
        prompt, turn = rendered_call(prepared, content)
        ours = tools.parse_turn(prepared, turn, prompt, [get_weather])
        assert ours == ctu.parse_response(tok, turn, prefix=prompt, tools=[get_weather])
        assert ours["tool_calls"] == [CALL], ours


@pytest.mark.slow
def test_what_is_taken(templated, monkeypatch):
    """The templates (with their special tokens) the tool loop takes, and why others not."""
    outcome = {p.stem: prepare(templated(p), "trl", monkeypatch) for p in TEMPLATES}
    refused = {k: v for k, v in outcome.items() if isinstance(v, str)}
    for name in ("qwen2_5", "qwen3", "qwen3_5_think", "qwen3_8", "llama3_1", "llama3_2", "gptoss",
                 "glm4moe", "gemma4", "lfm2_2_5", "nemotron_3_nano"):
        assert name not in refused, refused[name]
    # Qwen3's drops the empty <think></think> of a turn a tool result follows: TRL's
    # training template in its place
    training = ctu._CHAT_TEMPLATES_DIR / "qwen3_training.jinja"
    assert outcome["qwen3"].chat_template == training.read_text(encoding="utf-8")
    for name in ("llama3", "phi3", "cohere2", "gemma3", "deepseek_r1_distill"):  # no tool turns
        assert "can't render tool calls" in refused[name]
    assert "tool-call format" in refused["deepseekv3"]  # renders tools, but no parser


def test_prefix_preserving_is_trls(templated):
    """is_prefix_preserving (ours, used where TRL is not installed) is TRL's on every template
    that can render a tool exchange."""
    for path in TEMPLATES:
        tok = templated(path)
        if ctu.supports_tool_calling(tok):
            assert tools.is_prefix_preserving(tok) == \
                ctu.is_chat_template_prefix_preserving(tok), path.stem


def test_without_trl_the_vendored_copy(monkeypatch):
    """Where trl can't be imported (it is no dependency of grpo-jax), the vendored data: from
    TRL's version and license, a parser for each template TRL's add_response_schema knows."""
    assert isinstance(tool_templates.table(), tool_templates.TrlTable)
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError
    table = tool_templates.table()
    assert isinstance(table, tool_templates.VendoredTable)
    notes = (table.dir / "README.md").read_text() + (table.dir / "LICENSE").read_text()
    assert "TRL 1.16.0" in notes and "Apache License" in notes
    qwen3 = (ctu._CHAT_TEMPLATES_DIR / "qwen3.jinja").read_text(encoding="utf-8")
    assert table.response_template(qwen3) == ctu.qwen3_template
    assert table.response_template(qwen3 + " ") is None


def test_unknown_templates_are_refused_with_the_fix(templated, smol_tok):
    """A template whose tool-call format nobody knows is refused at start, naming both fixes;
    with a response_template of its own it is taken; and the shipped chatml_tools gets its
    Hermes parser."""
    from grpo_jax import data
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = data.chat_template("chatml_tools")
    hermes = tools.prepare_tool_tokenizer(tok)
    assert hermes.response_template == tools.HERMES_RESPONSE_TEMPLATE
    tok.chat_template += "\n"  # not the shipped text any more
    with pytest.raises(tools.ToolError, match="response_template.*chat_template: chatml_tools"):
        tools.prepare_tool_tokenizer(tok)
    tok.response_template = tools.HERMES_RESPONSE_TEMPLATE
    assert tools.prepare_tool_tokenizer(tok).response_template == tools.HERMES_RESPONSE_TEMPLATE
    with pytest.raises(tools.ToolError, match="no response_template.*prepare_tool_tokenizer"):
        tools.ToolRollout(None, smol_tok, tools.Toolbox([], 1.0), None, (2,), 2)


def test_a_legacy_response_schema_is_taken_as_trl_takes_it(smol_tok, monkeypatch):
    """A tokenizer with only a legacy response_schema (one of TRL's) on a template TRL doesn't
    know: TRL 1.16 keeps it with a FutureWarning, so does this, and its calls are parsed with
    the response template TRL pairs with the schema (transformers parses nothing else now), from
    the installed trl and the vendored copy alike. A schema TRL doesn't ship: one line."""
    from grpo_jax import data
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = data.chat_template("chatml_tools") + "\n"  # Hermes calls, as Qwen3's
    tok.response_schema = ctu.qwen3_schema
    for source in ("trl", "vendored"):
        with pytest.warns(FutureWarning, match="legacy `response_schema`"):
            prepared = prepare(tok, source, monkeypatch)
        assert not isinstance(prepared, str), prepared
        assert prepared.response_template == ctu.qwen3_template
        assert prepared.response_schema == ctu.qwen3_schema  # kept, as TRL keeps it
        prompt, turn = rendered_call(prepared, "Let me look.")
        assert tools.parse_turn(prepared, turn, prompt, [get_weather])["tool_calls"] == [CALL]
    tok.response_schema = {"x-regex": "(?P<content>.*)", "type": "object"}
    for source in ("trl", "vendored"):
        refused = prepare(tok, source, monkeypatch)
        assert "legacy response_schema, not one of TRL's" in refused and "\n" not in refused


def test_the_unknown_template_error_lists_formats_as_taken(templated, smol_tok):
    """The formats the refusal names are taken (with their special tokens): Llama 3.1/3.2
    too. Without their special tokens Llama's are refused, so the line says so."""
    from grpo_jax import data
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = data.chat_template("chatml_tools") + "\n"
    with pytest.raises(tools.ToolError, match="Llama 3.1/3.2.* with their tokenizers' special "
                                              "tokens"):
        tools.prepare_tool_tokenizer(tok)
    for name in ("llama3_1", "llama3_2"):
        tools.prepare_tool_tokenizer(templated(ctu._CHAT_TEMPLATES_DIR / f"{name}.jinja"))


@pytest.mark.slow
def test_grpo_run_on_a_qwen3_template_goes_past_its_first_tool_call(tmp_path, smol_tok):
    """SmolLM2 with Qwen3's chat template, which is not prefix-preserving (the loop died with a
    ToolError at the first tool result): TRL's qwen3_training template is swapped in at start,
    the calls in Qwen3's format are parsed and run, their results appended in Qwen3's format,
    the model writes on after them, and the step trains. SmolLM2 seldom writes a well-formed
    Qwen3 call by itself, so each prompt (a string: the rendered chat) opens the call for it;
    the call and its result (~20 + 31 tokens) leave the next turn room in 96."""
    from grpo_jax.calculator import SHOTS, calculator
    from grpo_jax.cli import load_config
    from grpo_jax.train import train
    qwen3 = ctu._CHAT_TEMPLATES_DIR / "qwen3.jinja"
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = qwen3.read_text(encoding="utf-8")
    assert not ctu.is_chat_template_prefix_preserving(tok)
    prepared = tools.prepare_tool_tokenizer(tok)  # what the run's start-up makes of it
    opened = '<think>\n\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
    with open(tmp_path / "q.jsonl", "w") as f:
        for a, b in [(48213, 9177)]:
            chat = SHOTS + [{"role": "user", "content": f"What is {a} * {b}?"}]
            prompt = prepared.apply_chat_template(chat, tools=[calculator], tokenize=False,
                                                  add_generation_prompt=True)
            f.write(json.dumps({"prompt": prompt + opened, "answer": a * b}) + "\n")
    sets = {"dtype": "float32", "dataset_name": tmp_path / "q.jsonl", "chat_template": qwen3,
            "tools": "[grpo_jax.calculator:calculator]",
            "reward_funcs": "[grpo_jax.calculator:final_answer]",
            # 1 x 2 rows: the prompt opens its call, so every row calls; the shape is not the
            # point (8 rows took 11 s longer, 2 x 2 ~30% more CPU, the same assertions passing).
            "num_generations": 2, "max_completion_length": 96, "temperature": 1.0,
            "per_device_train_batch_size": 2, "steps_per_generation": 1, "learning_rate": 1e-5,
            "beta": 0.0, "output_dir": tmp_path / "out", "report_to": "[]", "max_steps": 1,
            "dp": 1, "log_completions": True, "num_completions_to_print": 0}
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
    last = train(cfg, devices=jax.devices()[:1])
    assert last["tools/call_frequency"] > 0.5 and last["tools/failure_frequency"] < 1
    assert np.isfinite(last["loss"])
    rows = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").open()]
    result = "<tool_response>\n442450701\n</tool_response>"  # 48213 * 9177, Qwen3's format
    past = [r["completion"].split(result)[1] for r in rows if result in r["completion"]]
    # What the template puts after a tool result (its end of turn, the assistant's header, an
    # empty think block) is not the model's: some row writes more than that.
    template = re.compile(r"^(\s|<\|im_end\|>|<\|im_start\|>|assistant|<think>|</think>)*")
    assert any(template.sub("", text).strip() for text in past), [r["completion"] for r in rows]
