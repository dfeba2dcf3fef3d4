"""SmolLM2 with the calculator tool: its tool-ready tokenizer, the few-shot prompts, the tool
rollout of the native sampler and its batch for the trainer. Shared by test_tools and
test_tool_continuation (and its float64 subprocess)."""

import numpy as np
import transformers

from grpo_jax import data
from grpo_jax.calculator import SHOTS, calculator
from grpo_jax.grpo.batch import Batch
from grpo_jax.rollout import tools
from grpo_jax.rollout.native.rollout import JaxRollout
from grpo_jax.rollout.native.sampling import SamplingParams

QUESTIONS = ["What is 48213 * 9177?", "What is 66011 - 4589?"]
C = 80


def tool_tokenizer(model_dir):
    """SmolLM2's tokenizer with the shipped ChatML tool template (its own has no tools),
    prepared for tools (its Hermes parser)."""
    t = transformers.AutoTokenizer.from_pretrained(model_dir)
    t.chat_template = data.chat_template("chatml_tools")
    return tools.prepare_tool_tokenizer(t)


def prompt_ids(tok, questions=QUESTIONS):
    prompts = [SHOTS + [{"role": "user", "content": q}] for q in questions]
    return data.tokenize_prompts(prompts, tok, tools=[calculator])


def tool_rollout(model, tok, fns=(calculator,), timeout=10.0, iterations=None, temperature=1.0,
                 continued=True):
    """continued=False: each turn re-prefills its whole context (as for sliding-window
    models) instead of continuing from the KV cache."""
    sp = SamplingParams(max_completion_length=C, temperature=temperature,
                        stop_token_ids=(tok.eos_token_id,))
    inner = JaxRollout(model.cfg, sp, pad_id=tok.pad_token_id, mesh=None)
    if not continued:
        inner.turns = None
    return tools.ToolRollout(inner, tok, tools.Toolbox(list(fns), timeout), iterations,
                             (tok.eos_token_id,), tok.pad_token_id)



def tool_batch(r):
    return Batch(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.truncated,
                 np.linspace(-1, 1, len(r.truncated)).astype(np.float32),
                 sampler_logp=r.sampler_logp, tool_mask=r.tool_mask)
