"""Multi-turn tool calling, as TRL 1.16's `GRPOTrainer(tools=...)` runs it, for either backend.

At start, `prepare_tool_tokenizer` readies the tokenizer as TRL's GRPOTrainer does: it refuses
a chat template that can't render a tool exchange, gives it the parser of its model's tool-call
format (`response_template`: TRL's for the templates TRL knows, Hermes for the shipped
`chatml_tools`), and swaps in TRL's training template where the original is not
prefix-preserving (rollout/tool_templates.py); a template whose calls nothing can parse is
refused, never read as another format. After a turn, each completion is parsed into a message
through transformers' `parse_response`; its tool calls run, each with a timeout; the results
become `tool` messages whose tokens the chat template renders (computed once per turn from a
dummy conversation, as TRL does, so the model's own tokens are never re-tokenized); and the
model continues from prompt + completion + results, until a turn makes no call, the completion
budget (max_completion_length) would be exceeded, or max_tool_calling_iterations. A tool that
raises, times out, is unknown or is called with malformed arguments returns TRL's
`{"error": ...}` to the model and is counted in `tools/failure_frequency`; the run goes on.

The tool-result tokens stay in the sequence (the model attends to them) but carry no loss, KL
or entropy: `tool_mask` 0 (TRL's name). The native sampler continues follow-up turns from its KV
cache, prefilling only the tool-result tokens (rollout/native/continuation.py); other backends get
prompt + completion so far as a new prompt through their own `generate`, as does the native
sampler with images: the rows' records (`records`, a vision-language model's) go with each turn,
so that its prompt's images fill its placeholders again (a vLLM server's: sent with each turn).

A tool may return an image to a vision-language model, as TRL 1.16 takes it:
a list of content blocks ([{"type": "image", "image": <PIL image>}, {"type": "text", ...}]) is
the tool message's content; its tokens are the processor's chat template's (tool_suffix_ids,
each placeholder expanded to its image's tokens), tool_mask 0 and marked in the batch's
`completion_images`; the image joins the row's images (its prompt's, then its tools', in order:
the row's record grows by them, _Row.record), the next turn is re-prefilled seeing all of them,
and the batch's pixels (and Qwen-VL's M-RoPE positions over prompt + completion) are the rows'
final images (the backend's with_row_images, rollout/row_images.py), which the trainer places at
the prompt's and then the completion's placeholders (train_step.completion_embeds). Under partial
rollouts the row's episode keeps them (PartialTurns.images) and its slot prefills its context
again with all of them (rollout/native/partial.py). Refused in one line (tool_messages) by a
rollout without a processor, a text model's (NO_PROCESSOR).

With partial rollouts (max_staleness >= 1 on the native sampler) the same loop runs row by row
inside the sampler's rounds (rollout/native/partial.py): `PartialTurns` is its host side, the
turns of a row decoded in its decode slot, possibly over several rounds and weight versions.
With sampler_devices those rounds run in the sampler's worker thread
(rollout/native/disaggregated.py), and the tools with them: nothing here needs the main thread
(a call's timeout is Toolbox's thread pool's, not a signal's, and every call runs in that pool
whatever thread asks for it). With sampler_process they run in the sampler's process, which
builds the same PartialTurns from a TurnsSpec (rollout/native/sampler_process.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import functools
import inspect
import json
import warnings
from importlib import resources
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from grpo_jax import distributed as dist
from grpo_jax.errors import ToolError
from grpo_jax.rollout.base import RolloutBatch, RolloutWrapper
from grpo_jax.rollout.native.sampler import merge_decode_metrics
from grpo_jax.config.rollout import MultiTurnArgs  # noqa: F401 (this module's API)


# transformers' response-template format for Hermes-style tool calls, as the shipped
# `chatml_tools` template renders them (for ChatML models such as SmolLM2).
HERMES_RESPONSE_TEMPLATE = {
    "start_anchor": "<|im_start|>assistant\n", "defaults": {"role": "assistant"},
    "fields": {"content": {"content": "text"},
               "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json",
                              "repeats": True,
                              "transform": {"type": "function", "function": "{content}"}}}}


def load_tools(specs: Sequence[str]) -> list[Callable]:
    """The functions `specs` name, each checked to have the JSON schema the chat template
    needs (transformers' get_json_schema: type hints and a docstring with Args)."""
    from transformers.utils import get_json_schema

    from grpo_jax.rewards import import_callable
    fns = []
    for spec in specs:
        if ":" not in spec:
            raise ToolError(f"tool {spec!r}: name it as 'package.module:function' or "
                            "'path/to/file.py:function'")
        fn = import_callable(spec, "tool", ToolError)
        try:
            get_json_schema(fn)
        except Exception as e:
            raise ToolError(f"tool {spec!r} has no JSON schema ({type(e).__name__}: {e}); give "
                            "every argument a type hint and document it under 'Args:' in the "
                            "docstring, as transformers' get_json_schema needs") from None
        fns.append(fn)
    names = [fn.__name__ for fn in fns]
    if len(set(names)) != len(names):
        raise ToolError(f"tools {names}: two tools share a name; the model calls them by name")
    return fns


@dataclasses.dataclass
class Toolbox:
    """The run's tools by name; `call` runs one call as TRL does, never raising."""
    fns: list[Callable]
    timeout: float

    def __post_init__(self):
        self.by_name = {fn.__name__: fn for fn in self.fns}
        # Threads, so a call can time out; a timed-out call's thread runs on (Python can't
        # stop it) but its result is dropped.
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)

    def call(self, tool_call: Any) -> tuple[str, Any, bool]:
        """(name, result, failed) of one parsed tool call."""
        if not isinstance(tool_call, dict) or tool_call.get("type") != "function":
            kind = tool_call.get("type") if isinstance(tool_call, dict) else type(tool_call)
            return "unknown", {"error": f"Unsupported tool call type: {kind}"}, True
        function = tool_call.get("function") or {}
        name, args = function.get("name", "unknown"), function.get("arguments") or {}
        if name not in self.by_name:
            return name, {"error": f"Tool {name} not found."}, True
        if not isinstance(args, dict):
            return name, {"error": f"Tool {name}: arguments must be a JSON object, got "
                                   f"{args!r}"}, True
        fn = self.by_name[name]

        def run():
            out = fn(**args)
            return asyncio.run(out) if inspect.isawaitable(out) else out
        try:
            return name, self.pool.submit(run).result(timeout=self.timeout), False
        except concurrent.futures.TimeoutError:
            return name, {"error": f"Tool {name} timed out after {self.timeout:g} s"}, True
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's to read
            return name, {"error": str(e)}, True


def parse_turn(tokenizer, ids: Sequence[int], context: Sequence[int],
               tools: Sequence[Callable]) -> dict:
    """One turn's tokens as an assistant message, as TRL's parse_response makes it with the
    tokenizer's response_template (prepare_tool_tokenizer): tool calls parsed when well-formed,
    else the decoded text as content. `context`: the tokens before the turn (the parser skips
    past the last assistant header in them)."""
    try:
        parsed = tokenizer.parse_response(list(ids), prefix=list(context),
                                          tools=list(tools) or None)
        if parsed is None:
            raise ValueError("nothing parsed")
        content = parsed.get("content")
        if isinstance(content, str) and tokenizer.eos_token:
            content = content.removesuffix(tokenizer.eos_token)
        parsed["content"] = content or ""
        for call in parsed.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f"malformed tool call {call!r}")
            if function.get("arguments") is None:  # TRL: a call without arguments has {}
                function["arguments"] = {}
    except (ValueError, TypeError, KeyError):
        parsed = {"role": "assistant", "content": tokenizer.decode(list(ids),
                                                                  skip_special_tokens=True)}
    return parsed


def tool_suffix_ids(tokenizer, tool_messages: list[dict], chat_template_kwargs=None,
                    processor=None) -> list[int]:
    """The tokens the chat template puts after an assistant turn that ended in its EOS: the
    tool messages and the next assistant header. From a dummy conversation rendered with and
    without them (TRL's _get_tool_suffix_ids). Tool messages holding images (message_images)
    are rendered as TRL renders a vision-language model's: multimodal messages through its
    `processor`, with the tokenizer's chat template, each image's placeholder expanded to its
    image's tokens."""
    kw = dict(tokenize=True, return_dict=False, **(chat_template_kwargs or {}))
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"],
                                               "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": calls}]
    render = tokenizer.apply_chat_template
    if processor is not None and message_images(tool_messages):
        from grpo_jax import images
        dummy = images.multimodal_messages(dummy, [], 0)
        tool_messages = images.multimodal_messages(tool_messages, [], 0)
        render = functools.partial(processor.apply_chat_template,
                                   chat_template=tokenizer.chat_template)
    prefix = _ids(render(dummy, add_generation_prompt=False, **kw))
    full = _ids(render(dummy + tool_messages, add_generation_prompt=True, **kw))
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:  # the turn ended at EOS; what the template adds after it belongs to the suffix
        prefix = prefix[:eos[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ToolError("the chat template renders an assistant turn differently once tool "
                        "messages follow it, so tool results can't be appended to the "
                        "model's tokens; use a prefix-preserving chat template")
    return full[len(prefix):]


def _ids(out) -> list[int]:
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def check_chat_template(tokenizer, chat_template_kwargs=None) -> None:
    """Refuse a chat template that can't render a tool exchange (user, assistant with a tool
    call, tool result) with the call's name, arguments and the result all in the text: TRL's
    supports_tool_calling rule, naming the fix."""
    name, key, value, result = ("tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2",
                                "tool_arg_val_d6e7a9f3", "tool_content_c4f9a8e2")  # TRL's
    calls = [{"type": "function", "function": {"name": name, "arguments": {key: value}}}]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "name": name, "content": result}]
    kw = dict(tokenize=False, **(chat_template_kwargs or {}))
    try:
        try:
            text = tokenizer.apply_chat_template(messages, **kw)
        except TypeError:  # as TRL: templates that want JSON-string arguments (DeepSeek-V3)
            calls[0]["function"]["arguments"] = json.dumps({key: value})
            text = tokenizer.apply_chat_template(messages, **kw)
    except Exception as e:  # noqa: BLE001 - any failure means the same to the user
        text = f"error {e}"
    missing = [w for w in (name, key, value, result) if w not in text]
    if missing:
        raise ToolError("the chat template can't render tool calls and tool results (it drops "
                        f"{', '.join(missing)}): set chat_template to one that can, e.g. "
                        "chatml_tools (shipped) for a ChatML model such as SmolLM2")


def is_prefix_preserving(tokenizer) -> bool:
    """TRL's is_chat_template_prefix_preserving: a tool call renders as the same tokens whether
    or not a tool result and the next assistant header follow it."""
    calls = [{"type": "function", "function": {"name": "dummy", "arguments": {}}}]
    call = [{"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "", "tool_calls": calls}]
    result = [{"role": "tool", "name": "dummy", "content": "dummy"}]

    def both():
        return (_ids(tokenizer.apply_chat_template(call, tokenize=True, return_dict=False)),
                _ids(tokenizer.apply_chat_template(call + result, tokenize=True,
                                                   return_dict=False, add_generation_prompt=True)))
    try:
        alone, followed = both()
    except TypeError:  # as TRL: JSON-string arguments (DeepSeek-V3)
        calls[0]["function"]["arguments"] = "{}"
        alone, followed = both()
    return followed[:len(alone)] == alone


# The shipped chatml_tools template writes Hermes calls: its parser is ours, not TRL's.
_OWN_PARSERS = {(resources.files("grpo_jax") / "assets" / "chatml_tools.jinja").read_text():
                HERMES_RESPONSE_TEMPLATE}


def prepare_tool_tokenizer(tokenizer, chat_template_kwargs=None):
    """A copy of `tokenizer` ready for tool calling, as TRL 1.16's GRPOTrainer(tools=...)
    prepares it at start (the tokenizer given is left as it is):

    - a chat template that can't render a tool exchange is refused (TRL's supports_tool_calling);
    - with no `response_template` of its own, it gets the parser of its template's tool-call
      format (TRL's add_response_schema; Hermes for the shipped chatml_tools), and a template
      nobody knows is refused: its model's calls would never be parsed;
    - a template that is not prefix-preserving is replaced by TRL's training template for it
      (get_training_chat_template), or refused where TRL has none;
    - beyond TRL, the template the run will use must let tool results be appended to the
      model's tokens (tool_suffix_ids, with `chat_template_kwargs`): refused at start where
      TRL would fail at the first tool result.

    Render the prompts with the returned tokenizer: TRL renders them with the swapped template.
    Raises ToolError naming the fix."""
    import transformers
    from packaging.version import Version

    from grpo_jax.rollout import tool_templates
    if Version(transformers.__version__) < Version("5.15"):
        raise ToolError(f"tools need transformers >= 5.15 (response templates with tools in "
                        f"parse_response); this is {transformers.__version__}")
    check_chat_template(tokenizer)
    tok = copy.deepcopy(tokenizer)
    table = tool_templates.table()
    # TRL's own checks (GRPOTrainer.__init__): the legacy response_schema is no attribute of
    # transformers' tokenizers any more, only set by hand.
    legacy = getattr(tok, "response_schema", None)
    if getattr(tok, "response_template", None) is None:
        own = _OWN_PARSERS.get(tok.chat_template) if isinstance(tok.chat_template, str) else None
        tok.response_template = (copy.deepcopy(own) if own
                                 else table.response_template(tok.chat_template))
        if legacy is not None:
            tok.response_template = _from_legacy(table, legacy, tok.response_template)
        if tok.response_template is None:
            raise ToolError(
                "TRL 1.16 knows no tool-call format for this chat template (it knows those of "
                "Qwen2.5/3/3.5/3.6/3.8, Llama 3.1/3.2, gpt-oss, GLM-4-MoE, Gemma 4, LFM2 and "
                "Nemotron 3, with their tokenizers' special tokens), so the model's tool calls "
                "could not be parsed: set the tokenizer's response_template to its format "
                "(transformers' response parsing), or set chat_template: chatml_tools "
                "(shipped; Hermes <tool_call> JSON) for a ChatML model")
    try:
        preserving = is_prefix_preserving(tok)
    except Exception as e:  # noqa: BLE001 - a template that fails on TRL's own probe
        raise ToolError(f"the chat template fails to render a tool exchange ({type(e).__name__}"
                        f": {e}): set chat_template to one that can, e.g. chatml_tools") from None
    if not preserving:
        training = table.training_template(tok)
        if training is None:
            raise ToolError("the chat template renders a tool call differently once its result "
                            "follows (not prefix-preserving) and TRL has no training template "
                            "for it: set chat_template to a prefix-preserving one")
        tok.chat_template = training
    try:
        tool_suffix_ids(tok, [{"role": "tool", "name": "dummy", "content": "dummy"}],
                        chat_template_kwargs)
    except Exception:  # noqa: BLE001 - ToolError, or the template failing on a tool message
        raise ToolError("with this tokenizer the chat template renders a tool call as other "
                        "tokens once its result follows, so tool results can't be appended to "
                        "the model's tokens: set chat_template to a prefix-preserving one "
                        "whose special strings are this tokenizer's tokens") from None
    return tok


def _from_legacy(table, schema: dict, known: dict | None) -> dict:
    """The response template to parse with for a tokenizer that has only a legacy
    `response_schema` (`known`: its chat template's parser, if TRL knows the template). TRL
    1.16 keeps such a tokenizer with a FutureWarning, but transformers >= 5.13 parses only
    response templates (TRL's parse_response then fails on every turn): the template TRL pairs
    with the schema parses instead (add_response_schema's pairs), else the chat template's.
    Refused when neither exists: nothing here could read the model's calls."""
    import transformers
    template = table.legacy_response_template(schema)
    if template is None and known is None:
        raise ToolError(f"the tokenizer has only a legacy response_schema, not one of TRL's, and "
                        f"transformers {transformers.__version__} parses only response_template: "
                        "set the tokenizer's response_template to its format (transformers' "
                        "response parsing)")
    which = ("the response_template TRL pairs with it" if template is not None
             else "its chat template's response_template (the schema is not one of TRL's)")
    warnings.warn(f"The tokenizer has a legacy `response_schema` set but no `response_template`;"
                  f" tool calls are parsed with {which}. Consider migrating, as "
                  "`response_schema` support will eventually be removed (TRL 1.16's warning).",
                  FutureWarning, stacklevel=3)
    return template if template is not None else known


@dataclasses.dataclass
class ToolRollout(RolloutWrapper):
    """A backend (`JaxRollout`, `VLLMRollout`, ...) with the tool loop around its `generate`.
    The RolloutBatch it returns has the whole multi-turn completion, `tool_mask`, the parsed
    messages (`completions`, what TRL passes to reward functions) and per-row call counts."""
    inner: Any
    tokenizer: Any
    toolbox: Toolbox
    max_iterations: int | None
    stop_token_ids: tuple[int, ...]  # the backend's: a completion ending in none is truncated
    pad_id: int
    template_kwargs: dict | None = None  # the run's chat_template_kwargs
    # Every process runs the loop and process 0 the tools (False: this process runs the whole
    # episode alone, process 0 in a multi-process run's async rounds, in a background thread).
    shared: bool = True

    def __post_init__(self):
        if getattr(self.tokenizer, "response_template", None) is None:
            raise ToolError("the tokenizer has no response_template to parse tool calls with: "
                            "prepare it with grpo_jax.rollout.tools.prepare_tool_tokenizer")
        # The native sampler's partial rollouts run this loop row by row (PartialTurns); the
        # round drives them instead of generate.
        self.partial = None if self.inner.partial is None else self.inner.partial.with_turns(
            partial_turns(self.toolbox, self.tokenizer, self.max_iterations,
                          self.template_kwargs, self.shared, self.inner.processor))

    def process_parts(self, tools: Sequence[str]) -> tuple[dict, "TurnsSpec"]:
        """The inner sampler's settings and this tool loop, for the sampler's process to build
        the same (rollout.sampler_process)."""
        return self.inner.process_parts(tools)[0], TurnsSpec(
            tuple(tools), self.toolbox.timeout, self.tokenizer, self.max_iterations,
            self.template_kwargs, self.shared, self.inner.processor)

    def generate(self, weights, prompt_ids, num_generations, key, records=None) -> RolloutBatch:
        import jax

        # The native sampler continues each turn from its KV cache (rollout/native/continuation.py);
        # other backends get the whole context as a new prompt (vLLM's prefix cache reuses it).
        turns = self.inner.turns
        if turns is not None:
            first, session = turns.first_turn(weights, prompt_ids, num_generations, key)
        else:
            first = self.inner.generate(weights, prompt_ids, num_generations, key, records)
        # A vision-language model's turns re-prefill prompt + completion so far as a prompt with
        # its row's images (JaxRollout.turns is None with images): its record's, then those its
        # tools returned (TRL appends them to the row's images), the tool results' placeholders
        # expanded to their tokens by the processor. The batch keeps the first turn's pixels and
        # positions (prompt + the whole completion) unless a tool returned an image.
        row_records = (None if records is None
                       else [records[i // num_generations] for i in range(len(prompt_ids)
                                                                          * num_generations)])
        processor = self.inner.processor if records is not None else None
        refused = NO_PROCESSOR if processor is None else None
        where = list(range(len(first.completion_ids)))  # row i's row in the session's cache
        n, C = first.completion_ids.shape
        prompts = [row[m.astype(bool)].tolist() for row, m in zip(first.prompt_ids,
                                                                 first.prompt_mask)]
        rows = [_Row(ids[m.astype(bool)].tolist(), lp[m.astype(bool)].tolist())
                for ids, m, lp in zip(first.completion_ids, first.completion_mask,
                                      first.sampler_logp)]
        for row, prompt in zip(rows, prompts):
            row.messages.append(parse_turn(self.tokenizer, row.ids, prompt, self.toolbox.fns))
        # A mixture of experts' routing record (routing replay, router/mismatch), filled turn
        # by turn at each row's completion positions. Past a row's first turn the record held
        # the pad tokens the decode loop fed after the row ended: not the row's tokens.
        routing = first.completion_routing
        if routing is not None:
            routing = routing.copy()
            for i, row in enumerate(rows):
                routing[i, len(row.ids):] = -1
        active = [i for i, row in enumerate(rows) if row.messages[-1].get("tool_calls")]
        turn, decoded = 0, [first.metrics]
        while active and turn < (self.max_iterations if self.max_iterations is not None
                                 else np.iinfo(np.int64).max):
            # Process 0 runs the tools and every process gets its results: a tool that answers
            # differently per host must not split the processes' batches.
            def call():
                return [[self.toolbox.call(c) for c in rows[i].messages[-1]["tool_calls"]]
                        for i in active]
            results = dist.from_main(call, ToolError) if self.shared else call()
            contexts, kept = [], []
            for i, calls in zip(active, results):
                msgs = tool_messages(calls, refused)
                rows[i].calls += len(calls)
                rows[i].failures += sum(failed for _, _, failed in calls)
                suffix = tool_suffix_ids(self.tokenizer, msgs, self.template_kwargs, processor)
                if len(rows[i].ids) + len(suffix) > C:  # TRL: the row ends here, results dropped
                    continue
                shown = message_images(msgs)
                rows[i].add(suffix, model=False,
                            image_id=self.inner.image_token_id if shown else None)
                rows[i].images += shown
                rows[i].messages.extend(msgs)
                contexts.append(prompts[i] + rows[i].ids)
                kept.append(i)
            if not kept:
                break
            turn_key = jax.random.fold_in(key, turn + 1)
            if turns is not None:
                more, session = turns.next_turn(weights, session, [where[i] for i in kept],
                                                contexts, [C - len(rows[i].ids) for i in kept],
                                                turn_key)
                where = {i: j for j, i in enumerate(kept)}
            else:
                more = self.inner.generate(weights, contexts, 1, turn_key,
                                           None if row_records is None
                                           else [rows[i].record(row_records[i]) for i in kept])
            decoded.append(more.metrics)
            for j, (i, context) in enumerate(zip(kept, contexts)):
                m = more.completion_mask[j].astype(bool)
                ids, lp = more.completion_ids[j][m].tolist(), more.sampler_logp[j][m].tolist()
                room = C - len(rows[i].ids)  # TRL: the last turn is cut to the budget
                if routing is not None:
                    record_turn_routing(routing[i], more, j, len(rows[i].ids), len(ids[:room]))
                rows[i].add(ids[:room], lp[:room])
                if ids[:room]:
                    rows[i].messages.append(parse_turn(self.tokenizer, ids[:room], context,
                                                       self.toolbox.fns))
            active = [i for i in kept if rows[i].messages[-1].get("tool_calls")]
            turn += 1
        out = _assemble(first._replace(metrics=merge_decode_metrics(decoded),
                                       completion_routing=routing), rows,
                        self.pad_id, set(self.stop_token_ids), images=processor is not None)
        if any(row.images for row in rows):  # the trainer's forwards take every row's images
            out = self.inner.with_row_images(out, [row.record(rec) for row, rec
                                                   in zip(rows, row_records)])
        return out


# Why a tool's image is refused where the loop can't feed it to the model.
NO_PROCESSOR = ("images in tool results need a vision-language model, whose processor "
                "expands them as TRL 1.16's does; return text")


def tool_messages(calls: list[tuple[str, Any, bool]], refused: str | None = None) -> list[dict]:
    """The `tool` messages of a turn's calls (Toolbox.call's results), as TRL makes them: a
    list result as its content blocks (e.g. [{"type": "image", "image": <PIL image>},
    {"type": "text", "text": ...}]), anything else as its str. `refused`: why a result holding
    an image part can't be taken here (NO_PROCESSOR), raised as a ToolError; None: images
    taken."""
    for name, out, _ in calls:
        parts = [p for p in out if isinstance(p, dict) and p.get("type") == "image"] \
            if isinstance(out, list) else []
        if parts and refused is not None:
            raise ToolError(f"tool {name!r} returned an image ({{'type': 'image'}} part): "
                            + refused)
        if any(p.get("image") is None for p in parts):
            raise ToolError(f"tool {name!r} returned an image part without its image: give it "
                            "as {'type': 'image', 'image': <PIL image>}, as TRL 1.16 reads it")
    return [{"role": "tool", "name": name, "content": out if isinstance(out, list) else str(out)}
            for name, out, _ in calls]


def message_images(messages: Sequence[dict]) -> list[Any]:
    """The images of tool messages' image parts, in order (TRL's tool_images)."""
    return [part["image"] for m in messages if isinstance(m["content"], list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"]


def record_turn_routing(routing: np.ndarray, turn: RolloutBatch, j: int, start: int,
                        written: int) -> None:
    """Write row j of a later turn's routing record into one row's completion record `routing`
    [C, S, k] (-1: none), whose first `start` tokens came before the turn: the experts of the
    tokens the turn prefilled (its prompt_mask's, the context's last tokens, ending at
    `start`) where the row has no record yet, and those of the first `written` tokens the turn
    wrote. Continued from the KV cache, a turn prefills exactly the tokens no forward ran yet
    (a tool result, and the last token of the turn before when the decode loop never fed it);
    re-prefilled (sliding-window models), it runs the whole context again, and an earlier
    token keeps the experts it ran when the tokens after it in its own turn were sampled."""
    fed = turn.prompt_routing[j][turn.prompt_mask[j].astype(bool)]
    at = start - len(fed)
    fed = fed[max(-at, 0):]  # the prompt's own tokens: the first turn's prompt_routing has them
    at = max(at, 0)
    window = routing[at:start]
    empty = window[:, 0, 0] < 0
    window[empty] = fed[empty]
    routing[start:start + written] = turn.completion_routing[j, :written]


@dataclasses.dataclass
class _Row:
    ids: list[int]
    logp: list[float]
    model: list[int] = None  # 1 for a token the model wrote
    messages: list[dict] = dataclasses.field(default_factory=list)
    calls: int = 0
    failures: int = 0
    images: list = dataclasses.field(default_factory=list)  # those its tools returned
    placed: list[bool] = None  # True for a placeholder of one of `images`

    def __post_init__(self):
        self.model = [1] * len(self.ids)
        self.placed = [False] * len(self.ids)

    def record(self, prompt_record: dict) -> dict:
        """The row's record for a turn after its prompt's (its context: prompt + completion so
        far): its prompt's images then its tools', whose placeholders are in the tool
        results (images.with_tool_images)."""
        from grpo_jax import images
        return images.with_tool_images(prompt_record, self.images, self.placed)

    def add(self, ids, logp=None, model: bool = True, image_id: int | None = None):
        """`image_id`: the image placeholder's id where `ids` hold images (a tool result's)."""
        self.ids += list(ids)
        self.logp += list(logp) if logp is not None else [0.0] * len(ids)
        self.model += [int(model)] * len(ids)
        self.placed += [image_id is not None and t == image_id for t in ids]


def _assemble(first: RolloutBatch, rows: list[_Row], pad: int, stops: set,
              images: bool = False) -> RolloutBatch:
    """`images`: the batch says where its completions hold images (completion_images)."""
    n, C = first.completion_ids.shape
    ids = np.full((n, C), pad, np.int32)
    mask, tool_mask = np.zeros((n, C), np.int32), np.ones((n, C), np.int32)
    logp = np.zeros((n, C), np.float32)
    truncated = np.zeros(n, bool)
    placed = np.zeros((n, C), bool)
    for i, row in enumerate(rows):
        k = len(row.ids)
        ids[i, :k], mask[i, :k], tool_mask[i, :k], logp[i, :k] = row.ids, 1, row.model, row.logp
        placed[i, :k] = row.placed
        # TRL: truncated when the last token is neither a stop token nor padding.
        truncated[i] = not k or row.ids[-1] not in stops | {pad}
    return first._replace(completion_ids=ids, completion_mask=mask, truncated=truncated,
                          sampler_logp=logp, tool_mask=tool_mask,
                          completions=[row.messages for row in rows],
                          tool_calls=np.array([r.calls for r in rows], np.int32),
                          tool_failures=np.array([r.failures for r in rows], np.int32),
                          completion_images=placed if images else None)


@dataclasses.dataclass
class PartialTurns:
    """The tool loop's host side for partial rollouts (rollout/native/partial.py TurnEnds): a
    row that ended a turn is parsed and its calls run as ToolRollout does (every call of the
    rows that ended a turn together, on process 0 when `shared`), and its completion gets the
    results' tokens unless max_iterations tool turns were run or they would pass the budget
    (TRL: the row ends there). An episode: the tool messages appended after each turn, the
    row's call and failure counts and the completion spans of the results that hold images
    (`images`); the assistant messages are parsed from the tokens at the end. `processor`: a
    vision-language model's, which renders a tool's image as ToolRollout's does (None: a text
    model's, which refuses one: NO_PROCESSOR)."""
    tokenizer: Any
    toolbox: Toolbox
    max_iterations: int | None
    template_kwargs: dict | None = None
    shared: bool = True
    processor: Any = None

    def start(self) -> dict:
        return {"results": [], "calls": 0, "failures": 0, "image_spans": []}

    def images(self, episode: dict) -> tuple[list, list[tuple[int, int]]]:
        """The images the row's tools returned, in order, and the [start, stop) completion
        spans of the results that hold them (their placeholders are the image tokens there)."""
        return ([im for msgs in episode["results"] for im in message_images(msgs)],
                [tuple(span) for span in episode.get("image_spans", ())])

    def end_turns(self, ended: list[tuple], budget: int) -> list[tuple[list[int] | None, dict]]:
        todo = []
        for prompt, ids, forced, episode in ended:
            turn = _turns(ids, forced)[-1]
            room = self.max_iterations is None or len(episode["results"]) < self.max_iterations
            if turn.stop == turn.start or not room:  # a result filled the budget, or the cap
                todo.append([])
                continue
            msg = parse_turn(self.tokenizer, ids[turn], prompt + ids[:turn.start],
                             self.toolbox.fns)
            todo.append(msg.get("tool_calls") or [])

        def call():
            return [[self.toolbox.call(c) for c in calls] for calls in todo]
        results = dist.from_main(call, ToolError) if self.shared and any(todo) else call()
        out = []
        for (_, ids, _, episode), calls in zip(ended, results):
            if not calls:
                out.append((None, episode))
                continue
            msgs = tool_messages(calls, NO_PROCESSOR if self.processor is None else None)
            episode = dict(episode, calls=episode["calls"] + len(calls),
                           failures=episode["failures"] + sum(f for _, _, f in calls))
            suffix = tool_suffix_ids(self.tokenizer, msgs, self.template_kwargs, self.processor)
            if len(ids) + len(suffix) > budget:  # TRL: the row ends here, results dropped
                out.append((None, episode))
                continue
            spans = list(episode.get("image_spans", ()))
            if message_images(msgs):
                spans.append([len(ids), len(ids) + len(suffix)])
            out.append((suffix, dict(episode, results=episode["results"] + [msgs],
                                     image_spans=spans)))
        return out

    def fields(self, rows: list[tuple]) -> dict:
        completions = []
        for prompt, ids, forced, episode in rows:
            messages = []
            for k, turn in enumerate(_turns(ids, forced)):
                if turn.stop > turn.start:
                    messages.append(parse_turn(self.tokenizer, ids[turn], prompt + ids[:turn.start],
                                               self.toolbox.fns))
                if k < len(episode["results"]):
                    messages.extend(episode["results"][k])
            completions.append(messages)
        return dict(completions=completions,
                    tool_calls=np.array([r[3]["calls"] for r in rows], np.int32),
                    tool_failures=np.array([r[3]["failures"] for r in rows], np.int32))


def partial_turns(toolbox: Toolbox, tokenizer, max_iterations: int | None,
                  template_kwargs: dict | None, shared: bool, processor=None) -> PartialTurns:
    """The tool loop's host side for partial rollouts, as ToolRollout and the sampler's process
    (TurnsSpec) build it. With sampler_devices it runs in the sampler's thread beside the
    trainer's, which uses the run's tokenizer: a tokenizer of its own, since a fast tokenizer
    keeps truncation and padding as state each call sets before it encodes (transformers'
    set_truncation_and_padding), which two threads would mix."""
    return PartialTurns(copy.deepcopy(tokenizer), toolbox, max_iterations, template_kwargs,
                        shared, processor)


class TurnsSpec(NamedTuple):
    """A ToolRollout's PartialTurns as the sampler's process builds it again
    (rollout.sampler_process; ToolRollout.process_parts), picklable: the tools by the names
    load_tools loads them by (a function from a file pickles as a reference to a module that
    process lacks), the tokenizer whole as prepare_tool_tokenizer left it (its chat template
    and response_template pickle with it), and a vision-language model's processor."""
    tools: tuple[str, ...]
    timeout: float
    tokenizer: Any
    max_iterations: int | None
    template_kwargs: dict | None
    shared: bool
    processor: Any = None

    def build(self) -> PartialTurns:
        return partial_turns(Toolbox(load_tools(self.tools), self.timeout), self.tokenizer,
                             self.max_iterations, self.template_kwargs, self.shared,
                             self.processor)


def _turns(ids: list[int], forced: list[int]) -> list[slice]:
    """The model's turns in a completion: the runs of tokens between the forced (tool result)
    ones; the last may be empty (a result that filled the budget)."""
    edges = np.flatnonzero(np.diff(np.concatenate([[1], forced, [1]])) != 0)
    # runs of 0s start where forced falls to 0 and stop where it rises to 1
    turns = [slice(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]
    if not turns or turns[-1].stop < len(ids):
        turns.append(slice(len(ids), len(ids)))
    return turns
