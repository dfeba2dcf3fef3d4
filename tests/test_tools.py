"""Multi-turn tool calling with SmolLM2 and a real calculator tool: the turns, the masks
(tool results carry no loss and no gradient), the sampler's log-probs against the trainer's over
the whole multi-turn sequence, TRL's error messages for failing tools, and a GRPO run."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from tool_rollouts import C, prompt_ids, tool_batch, tool_rollout, tool_tokenizer
from vllm_server import API_KEY, needs_vllm

from grpo_jax.calculator import SHOTS, calculator
from grpo_jax.grpo import loss as loss_lib
from grpo_jax.grpo.train_step import completion_logps
from grpo_jax.rollout import tools
from grpo_jax.rollout.native.rollout import JaxRollout
from grpo_jax.rollout.native.sampling import SamplingParams


@pytest.fixture(scope="module")
def tok(smol_dir):
    return tool_tokenizer(smol_dir)


@pytest.fixture(scope="module")
def rollout(smol_model, tok):
    """4 completions of each question, sampled (temperature 1): several call the tool."""
    r = tool_rollout(smol_model, tok).generate(smol_model, prompt_ids(tok), 4, jax.random.key(0))
    assert r.tool_calls.sum() >= 2, r.tool_calls  # the model does call it
    return r


@pytest.fixture(scope="module")
def reprefilled(smol_model, tok):
    """The same rollout with every turn re-prefilled through Sampler.generate."""
    return tool_rollout(smol_model, tok, continued=False).generate(smol_model, prompt_ids(tok), 4,
                                                                   jax.random.key(0))


@pytest.fixture(scope="module")
def trainer_logp(rollout, smol_model):
    """The trainer's per-token log-probs of `rollout`'s sequences (one SmolLM2 forward for the
    tests whose other rollouts are asserted to hold the same tokens: the values are theirs too)."""
    logp, _ = completion_logps(smol_model, tool_batch(rollout), 1.0, 128)
    return np.asarray(logp)


def _same_sequences(r, ref):
    """`r` holds `ref`'s tokens and masks: the trainer's log-probs of one are the other's."""
    for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask",
                  "truncated", "tool_calls"):
        np.testing.assert_array_equal(getattr(r, field), getattr(ref, field))

@pytest.mark.slow
def test_turns_and_tool_mask(rollout, tok):
    """A row that called the tool holds: its call, the rendered result (tool_mask 0: exactly
    the template's tokens for the tool message and the next assistant header), then the
    model's next turn."""
    called = [i for i, n in enumerate(rollout.tool_calls) if n]
    assert any(len(rollout.completions[i]) > 2 for i in called)
    for i in called:
        turns = rollout.completions[i]
        results = [t for t in turns if t["role"] == "tool"]
        if not results:  # TRL: results that would overrun max_completion_length are dropped
            assert len(turns) == 1 and (rollout.tool_mask[i] == 1).all()
            continue
        # Whatever the model called (it sometimes names a tool 'math'), the result is the
        # toolbox's answer to that call.
        again = [tools.Toolbox([calculator], 10.0).call(c) for c in turns[0]["tool_calls"]]
        assert [r["content"] for r in results[:len(again)]] == [str(out) for _, out, _ in again]
        m = rollout.completion_mask[i].astype(bool)
        ids, tmask = rollout.completion_ids[i][m], rollout.tool_mask[i][m]
        want = tools.tool_suffix_ids(tok, results[:len(turns[0]["tool_calls"])])
        first_gap = np.flatnonzero(tmask == 0)
        assert ids[first_gap[:len(want)]].tolist() == want
        assert tok.decode(want).startswith("\n<|im_start|>tool\n" + results[0]["content"])
        assert (rollout.sampler_logp[i][m][tmask == 0] == 0).all()
    uncalled = [i for i, n in enumerate(rollout.tool_calls) if not n]
    for i in uncalled:
        assert (rollout.tool_mask[i] == 1).all() and len(rollout.completions[i]) == 1


@pytest.mark.slow
def test_multi_turn_logprobs_equal_the_trainers(rollout, trainer_logp):
    """The trainer's per-token log-probs over prompt + calls + results + answers equal the
    sampler's at every model-written token, later turns continued from the KV cache. fp32 on
    SmolLM2: the sampler's single-turn tokens already differ by up to ~3e-5 where log-probs
    reach -14 (a relative 2e-6: its KV-cache attention sums in another order), so the bound is
    that of one turn: the turns after a tool result add no error of their own. In float64 the
    difference is below 1e-5 (test_tool_continuation)."""
    batch = tool_batch(rollout)
    model = np.asarray(batch.model_mask(), bool)
    diff = np.abs(trainer_logp - rollout.sampler_logp)
    assert diff[model].max() < 5e-5, diff[model].max()
    after = model & (np.cumsum(rollout.tool_mask == 0, axis=1) > 0)  # later turns' tokens
    assert after.any() and diff[after].max() < 5e-5
    assert (batch.model_mask() != batch.completion_mask).any()  # tool results are in there


@pytest.mark.slow
def test_continued_turns_equal_re_prefilled_ones(rollout, reprefilled, trainer_logp):
    """Turns continued from the KV cache sample the same tokens from the same keys as turns
    that re-prefill the whole context, with log-probs within fp32 noise of each other; and the
    re-prefilled ones (the sliding-window models' path) meet the trainer's as well."""
    _same_sequences(reprefilled, rollout)
    np.testing.assert_array_equal(rollout.tool_failures, reprefilled.tool_failures)
    assert rollout.completions == reprefilled.completions
    assert (rollout.tool_mask == 0).any()  # a result and a turn after it are in there
    np.testing.assert_allclose(rollout.sampler_logp, reprefilled.sampler_logp, rtol=0, atol=5e-5)
    model = np.asarray(tool_batch(reprefilled).model_mask(), bool)
    assert np.abs(trainer_logp - reprefilled.sampler_logp)[model].max() < 5e-5


@pytest.mark.slow
def test_tool_turns_through_refilled_decode_slots(rollout, smol_model, tok, trainer_logp):
    """With 3 decode slots for the 8 rows (max_num_seqs), a row whose turn ends in a tool call
    leaves its slot to the next row, and each later turn re-prefills its contexts through the
    slots: the same turns as continuing one batch from its KV cache, log-probs at the
    trainer's, the decode steps of every turn counted."""
    sp = SamplingParams(max_completion_length=C, temperature=1.0,
                        stop_token_ids=(tok.eos_token_id,), max_num_seqs=3)
    inner = JaxRollout(smol_model.cfg, sp, pad_id=tok.pad_token_id, mesh=None)
    assert inner.turns is None  # no row keeps its slot (and cache) while its tools run
    slots = tools.ToolRollout(inner, tok, tools.Toolbox([calculator], 10.0), None,
                              (tok.eos_token_id,), tok.pad_token_id).generate(
        smol_model, prompt_ids(tok), 4, jax.random.key(0))
    _same_sequences(slots, rollout)
    model = np.asarray(tool_batch(slots).model_mask(), bool)
    assert np.abs(trainer_logp - slots.sampler_logp)[model].max() < 5e-5
    # Each turn's longest row takes as many steps in 3 slots as in one batch, the others more.
    assert slots.metrics["generate/decode_steps"] >= rollout.metrics["generate/decode_steps"]


def test_tool_results_carry_no_loss_and_no_gradient(rollout):
    """The loss counts the model's tokens only; its gradient w.r.t. the log-probs and
    entropies at tool-result positions is exactly zero (with KL and an entropy bonus on)."""
    batch = tool_batch(rollout)
    n, T = batch.completion_ids.shape
    rng = np.random.default_rng(0)
    batch = batch.replace(ref_logp=rollout.sampler_logp - 0.1,
                          old_logp=rollout.sampler_logp + 0.05)
    cfg = loss_lib.LossConfig(beta=0.04, entropy_coef=0.01, loss_type="grpo")
    model_tokens = sum(int((rollout.tool_mask[i][:k] == 1).sum())
                       for i, k in enumerate(rollout.completion_mask.sum(1)))
    assert float(loss_lib.loss_mask(batch.model_mask(), batch.truncated, cfg).sum()) == \
        model_tokens
    logp = jnp.asarray(rollout.sampler_logp + rng.normal(0, 0.01, (n, T)), jnp.float32)
    entropy = jnp.asarray(rng.uniform(0.5, 2.0, (n, T)), jnp.float32)

    def loss(lp, ent):
        out = loss_lib.micro_loss_terms(lp, ent, batch, cfg)
        den = loss_lib.loss_denominator(batch.model_mask(), batch.truncated, cfg)
        return out.numerator / den - cfg.entropy_coef * out.entropy_mean
    g_logp, g_ent = jax.grad(loss, argnums=(0, 1))(logp, entropy)
    tool = (rollout.tool_mask == 0) & (rollout.completion_mask == 1)
    assert tool.any()
    assert (np.asarray(g_logp)[tool] == 0).all() and (np.asarray(g_ent)[tool] == 0).all()
    written = np.asarray(batch.model_mask(), bool)
    assert (np.asarray(g_logp)[written] != 0).mean() > 0.9


def _failing(expression: str) -> str:
    """Fails: raises on a product, sleeps past the timeout on anything else.

    Args:
        expression: what to fail on.
    """
    if "*" in expression:
        raise RuntimeError("division by zebra")
    time.sleep(3)
    return "late"


@pytest.mark.parametrize("tool_call,want", [
    ({"type": "function", "function": {"name": "calculator", "arguments": {"x": "1"}}},
     "calculator() got an unexpected keyword argument 'x'"),
    ({"type": "function", "function": {"name": "calculator", "arguments": "2 + 2"}},
     "Tool calculator: arguments must be a JSON object, got '2 + 2'"),
    ({"type": "function", "function": {"name": "abacus", "arguments": {}}},
     "Tool abacus not found."),
    ({"type": "code", "code": "1 + 1"}, "Unsupported tool call type: code"),
])
def test_tool_failures_are_trls_error_messages(tool_call, want):
    name, result, failed = tools.Toolbox([calculator], 5.0).call(tool_call)
    assert failed and result == {"error": want}


@pytest.mark.slow
def test_timeouts_and_exceptions_go_back_to_the_model(smol_model, tok):
    """A tool that raises (on the product question's call) and times out (on the other's), in
    one rollout: the model reads TRL's {'error': ...} for each, the failures are counted, and
    generation continues after them."""
    _failing.__name__ = "calculator"  # the name the model calls
    r = tool_rollout(smol_model, tok, (_failing,), timeout=0.5, iterations=1).generate(
        smol_model, prompt_ids(tok), 4, jax.random.key(0))
    called = r.tool_calls > 0
    assert called.any()
    assert (r.tool_failures[called] == r.tool_calls[called]).all()
    seen = set()
    for i in np.flatnonzero(called):
        results = [t for t in r.completions[i] if t["role"] == "tool"]
        if not results:
            continue  # dropped: past the completion budget
        call = r.completions[i][0]["tool_calls"][0]["function"]
        if call["name"] != "calculator":
            want = f"Tool {call['name']} not found."
        elif "*" in str(call["arguments"].get("expression", "")):
            want = "division by zebra"
        else:
            want = "timed out after 0.5 s"
        assert want in results[0]["content"]
        assert results[0]["content"].startswith("{'error': ")
        assert len(r.completions[i]) >= 3  # call, error, the model's next turn
        seen.add(want)
    assert {"division by zebra", "timed out after 0.5 s"} <= seen, seen


def test_parse_turn(tok):
    good = tok('<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 3"}}'
               '</tool_call><|im_end|>')["input_ids"]
    msg = tools.parse_turn(tok, good, [], [calculator])
    assert msg["tool_calls"] == [{"type": "function", "function": {
        "name": "calculator", "arguments": {"expression": "2 * 3"}}}]
    bad = tok('<tool_call>{"name": "calculator", "arguments": {"expression": 2 * 3}}'
              '</tool_call><|im_end|>')["input_ids"]
    msg = tools.parse_turn(tok, bad, [], [calculator])
    assert "tool_calls" not in msg and msg["content"].startswith("<tool_call>{")
    plain = tools.parse_turn(tok, tok("It is 6.<|im_end|>")["input_ids"], [], [calculator])
    assert plain == {"role": "assistant", "content": "It is 6."}


@pytest.mark.slow
def test_iteration_cap(smol_model, tok):
    """max_tool_calling_iterations 0: calls are parsed but never run (TRL's loop does not
    start), so every completion is one turn."""
    r = tool_rollout(smol_model, tok, iterations=0).generate(smol_model, prompt_ids(tok), 4,
                                                              jax.random.key(0))
    assert (r.tool_calls == 0).all() and (r.tool_mask == 1).all()


def test_templates_that_cannot_show_tools_are_refused(smol_dir, tok):
    own = transformers.AutoTokenizer.from_pretrained(smol_dir)  # SmolLM2's: drops tool calls
    with pytest.raises(tools.ToolError, match="can't render tool calls.*chatml_tools"):
        tools.check_chat_template(own)
    tools.check_chat_template(tok)


def test_tool_loading_errors(tmp_path):
    path = tmp_path / "mytools.py"
    path.write_text("def no_doc(x):\n    return x\n")
    with pytest.raises(tools.ToolError, match="no JSON schema.*type hint"):
        tools.load_tools([f"{path}:no_doc"])
    with pytest.raises(tools.ToolError, match="has no function 'nope'"):
        tools.load_tools([f"{path}:nope"])
    with pytest.raises(tools.ToolError, match="package.module:function"):
        tools.load_tools(["calculator"])
    assert tools.load_tools(["grpo_jax.calculator:calculator"])[0]("2*3") == "6"


@pytest.mark.slow
def test_grpo_run_with_a_calculator(tmp_path):
    """Two GRPO steps with the calculator: TRL's tool metrics are logged, the reward sees the
    turns as messages, and checkpoints hold the tool mask of buffered micro-batches."""
    from grpo_jax.cli import load_config
    from grpo_jax.train import train
    # 2 prompts x 4 rows: 2 steps' batches of 4, one trained and one buffered (16 rows took
    # 7 s longer, the same assertions passing).
    with open(tmp_path / "q.jsonl", "w") as f:
        for a, b in [(48213, 9177), (66011, 4589)]:
            f.write(json.dumps({"prompt": SHOTS + [{"role": "user",
                                                    "content": f"What is {a} * {b}?"}],
                                "answer": a * b}) + "\n")
    sets = {"dtype": "float32", "dataset_name": tmp_path / "q.jsonl",
            "tools": "[grpo_jax.calculator:calculator]", "chat_template": "chatml_tools",
            "reward_funcs": "[grpo_jax.calculator:final_answer]",
            "num_generations": 4, "max_completion_length": 40, "temperature": 1.0,
            "per_device_train_batch_size": 4, "steps_per_generation": 2, "learning_rate": 1e-5,
            "beta": 0.0, "output_dir": tmp_path / "out", "report_to": "[]", "max_steps": 1,
            "dp": 1, "log_completions": True, "num_completions_to_print": 0, "save_steps": 1}
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
    last = train(cfg, devices=jax.devices()[:1])
    assert last["tools/call_frequency"] > 0 and 0 <= last["tools/failure_frequency"] <= 1
    assert np.isfinite(last["loss"])
    rows = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").open()]
    assert any("<tool_call>" in r["completion"] for r in rows)
    buffered = list((tmp_path / "out").rglob("*.npz"))
    assert buffered and any(k.endswith("/tool_mask") for k in np.load(buffered[0]).files)


@needs_vllm
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_multi_turn_on_the_vllm_server(smol_dir, smol_model, tok, smol_vllm_server,
                                       max_staleness):
    """The same loop with rollouts from a real vLLM CPU server serving SmolLM2 (the session's,
    tests/conftest.py): the follow-up turns are requests of prompt + completion + results, and
    the server's log-probs of every model-written token equal the trainer's over the whole
    sequence (< 1e-4). With async rounds (max_staleness 1) the whole episodes, tool turns
    included, are generated ahead in the background (prefetch) and the round takes them."""
    from grpo_jax.cli import load_config
    from grpo_jax.hf import params_numpy
    from grpo_jax.rollout.async_rounds import AsyncRollout
    from grpo_jax.rollout.vllm.client import VLLMClient
    from grpo_jax.rollout.engines import make_rollout
    srv, _ = smol_vllm_server
    with VLLMClient(srv.base_url, api_key=API_KEY) as client:  # whatever a test pushed before
        client.sync_weights(smol_model.cfg, params_numpy(smol_model))
    cfg = load_config(None, [f"{k}={v}" for k, v in {
        "name_or_path": smol_dir, "backend": "vllm", "vllm_server_base_url": srv.base_url,
        "vllm_server_api_key": API_KEY, "max_completion_length": C,
        "temperature": 1.0, "max_staleness": max_staleness}.items()])
    rollout = make_rollout(cfg, smol_model.cfg, tok, None, smol_dir, tools=[calculator])
    if max_staleness:
        assert isinstance(rollout, AsyncRollout) and isinstance(rollout.inner, tools.ToolRollout)
        rollout.prefetch([{"prompt_ids": ids} for ids in prompt_ids(tok)], 4, jax.random.key(0))
    else:
        assert isinstance(rollout, tools.ToolRollout)
    r = rollout.generate(None, prompt_ids(tok), 4, jax.random.key(0))
    if max_staleness:  # the background's batch, not a second generation
        assert not rollout.pending and r is rollout.latest.result()[0]
        assert rollout.sync_metrics["async/staleness"] == 0
    assert any(len(turns) > 2 for turns in r.completions)  # a call, a result, another turn
    batch = tool_batch(r)
    logp, _ = completion_logps(smol_model, batch, 1.0, 128)
    model = np.asarray(batch.model_mask(), bool)
    after = model & (np.cumsum(r.tool_mask == 0, axis=1) > 0)
    diff = np.abs(np.asarray(logp) - r.sampler_logp)
    assert after.any() and diff[model].max() < 1e-4, diff[model].max()
    if max_staleness:
        return

    def picture(expression: str) -> list:
        """The calculator's answer with a picture.

        Args:
            expression: The expression.
        """
        from PIL import Image
        return [{"type": "image", "image": Image.new("RGB", (28, 28))},
                {"type": "text", "text": calculator(expression)}]
    picture.__name__ = "calculator"
    # A text model takes no images: a tool's image is refused in one line.
    seeing = make_rollout(cfg, smol_model.cfg, tok, None, smol_dir, tools=[picture])
    with pytest.raises(tools.ToolError, match="tool 'calculator' returned an image .* need a "
                       "vision-language model, whose processor") as e:
        seeing.generate(None, prompt_ids(tok), 4, jax.random.key(0))
    assert "\n" not in str(e.value)
