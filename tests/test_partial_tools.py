"""Partial rollouts with tools (rollout/native/partial.py with rollout/tools.py PartialTurns):
a row that ends a turn with a tool call stays in flight, gets the tool's result as tokens
masked from the loss, and decodes its next turn in its slot, over rounds and versions.

A tiny random Llama over SmolLM2's vocabulary (its tool template and parser, the real
calculator): each prompt ends in an assistant turn that already holds a calculator call (a
prefill; the parser reads a turn after the last assistant header), so every row's first turn,
whatever random tokens end it, is a call; a sixteenth of the vocabulary stops a turn, so turns
end at different lengths and some results do not fit the budget."""

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from model_oracle import trainer_logp
from tiny_run import advances, assert_resumed_like_whole, config, history, stopped_at
from tool_rollouts import SHOTS, tool_tokenizer

from grpo_jax import data, hf
from grpo_jax import mesh as mesh_lib
from grpo_jax.checkpoint import load_checkpoint
from grpo_jax.images import from_json_bytes
from grpo_jax.calculator import calculator
from grpo_jax.models import Decoder, ModelConfig
from grpo_jax.rollout import tools
from grpo_jax.rollout.native.partial import from_arrays, staleness_metrics, to_arrays
from grpo_jax.rollout.native.rollout import JaxRollout
from grpo_jax.rollout.native.sampling import SamplingParams
from grpo_jax.train import train

C, G, K = 64, 4, 1  # completion budget, rows a group, groups a round
EXPRESSIONS = ["48213 * 9177", "66011 - 4589", "312 + 97", "7 * 8", "90000 - 1", "123 * 45",
               "5 + 5"]


@pytest.fixture(scope="module")
def tok(smol_dir):
    return tool_tokenizer(smol_dir)


def _prompt(tok, expression):
    """The calculator's few-shot prompt for `expression`, its assistant turn begun with the
    call."""
    messages = SHOTS + [{"role": "user", "content": f"What is {expression}?"}]
    ids = data.tokenize_prompts([messages], tok, tools=[calculator])[0]
    call = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n'
            "</tool_call>" % expression)
    return list(ids) + tok.encode(call, add_special_tokens=False)


def _runs(mask):
    """[(start, stop)] of the runs of 1s in `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2], edges[1::2]))


@pytest.mark.parametrize("case", ["fixed", "mesh", "new weights"])
def test_tool_turns_carry_over_rounds(tok, case):
    """Rounds of one group each, 4 rows a group through 3 slots, a version a round and
    max_staleness 1 (the last round three versions on, so the groups carried start over):
    each returned row made its call, its result (when it fit the budget) is in the row as the
    chat template's tokens for the calculator's answer, masked from the loss, and the model's
    next turn follows it; rows span versions. With fixed weights every model token's sampler
    log-prob is the trainer's, rows carried over too (the bookkeeping: cache, fed results,
    keys); with other weights each version ("new weights": two models in turn), the tokens
    of a row drawn in one round are that version's trainer's (a row spanning two read keys
    of both). The rows in flight, tool messages included, survive a checkpoint's arrays. On
    a 2x2x2 mesh too (4 slots: rounded up to the batch shards)."""
    cfg = ModelConfig("llama", vocab_size=len(tok), hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=16).replace(dtype="float32")
    models = [Decoder(cfg, rngs=nnx.Rngs(0)), Decoder(cfg, rngs=nnx.Rngs(1))]
    model_of = (lambda v: models[v % 2]) if case == "new weights" else (lambda v: models[0])
    stops = (tok.eos_token_id, *range(1000, 1000 + len(tok) // 16))
    sp = SamplingParams(max_completion_length=C, temperature=1.0, stop_token_ids=stops,
                        max_num_seqs=3)
    inner = JaxRollout(cfg, sp, pad_id=tok.pad_token_id, partial_rollouts=(G, K, 1),
                       mesh=mesh_lib.make_mesh(mesh_lib.MeshConfig(2, 2, 2), jax.devices()[:8])
                       if case == "mesh" else None)
    rollout = tools.ToolRollout(inner, tok, tools.Toolbox([calculator], 10.0), None, stops,
                                tok.pad_token_id)
    partial = rollout.partial
    assert partial is not None and inner.partial.turn_ends is None
    prompts = [_prompt(tok, e) for e in EXPRESSIONS]
    at, drawn, spanned, resumed, staleness, dropped = partial.empty(
        max(map(len, prompts))), 0, 0, 0, 0.0, 0
    for version in (0, 1, 2, 3, 4, 7):  # the last round drops the groups carried (stale)
        n = at.empty_groups
        records = [{"prompt_ids": p, "i": drawn + j} for j, p in enumerate(prompts[drawn:drawn + n])]
        done = partial.advance(nnx.state(model_of(version), nnx.Param), at, records, list(range(drawn, drawn + n)), version,
                               jax.random.key(0))
        drawn, at, dropped = drawn + n, done.in_flight, dropped + done.dropped
        r = done.rollout
        assert len(done.records) == K and r.tool_mask is not None
        model_mask = r.completion_mask * r.tool_mask
        np.testing.assert_array_equal(r.sampler_logp[r.tool_mask == 0], 0)
        for row in range(G):
            expression = EXPRESSIONS[done.records[row // G]["i"]]
            messages, m = r.completions[row], r.completion_mask[row]
            assert r.tool_calls[row] == 1 and r.tool_failures[row] == 0  # the prefilled call
            assert messages[0]["tool_calls"][0]["function"]["arguments"] == {
                "expression": expression}
            results = _runs((r.tool_mask[row] == 0) & (m > 0))
            assert len(results) <= 1
            if not results:  # the result did not fit: the episode ended with the call
                assert len(messages) == 1
                assert m.sum() + len(tools.tool_suffix_ids(tok, [{
                    "role": "tool", "name": "calculator", "content": calculator(expression)}])) > C
                continue
            (a, b), = results
            assert messages[1] == {"role": "tool", "name": "calculator",
                                   "content": calculator(expression)}
            assert r.completion_ids[row, a:b].tolist() == tools.tool_suffix_ids(tok,
                                                                                [messages[1]])
            resumed += m[b:].sum() > 0  # the model's next turn, after the result
            assert (model_mask[row, :a] == 1).all() and (model_mask[row, b:] == m[b:]).all()
        versions = r.versions[model_mask > 0]
        assert versions.max() <= version and versions.min() >= version - 1
        spanned += sum(len(set(v[k > 0])) > 1 for v, k in zip(r.versions, model_mask))
        staleness = max(staleness, staleness_metrics(r.versions, model_mask, version,
                                                     1)["staleness/max"])
        diff = np.abs(trainer_logp(model_of(version), r, 1.0) - r.sampler_logp)
        one = (r.versions == version) | (model_mask == 0)  # rows drawn in this round alone
        check = (model_mask > 0) & (one.all(axis=1, keepdims=True) | (case != "new weights"))
        assert check.sum() > 10 and diff[check].max() < 1e-4
    assert resumed > 0 and spanned > 0 and staleness >= 1, (resumed, spanned, staleness)
    assert done.dropped > 0 and (r.versions[model_mask > 0] == 7).all()
    assert any(e["results"] for e in at.episodes)  # rows left in flight after their call
    back = from_arrays(partial.empty(max(map(len, prompts))), to_arrays(at),
                       lambda i: {"i": i})
    assert back.episodes == at.episodes
    for x, y in zip(jax.tree.leaves(at.rows), jax.tree.leaves(back.rows), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory, tok):
    """A tiny random Llama with SmolLM2's tokenizer, and 24 plain-text prompts: the calculator's
    few-shot chat rendered, its assistant turn begun with the call (as `_prompt`)."""
    from hf_oracle import tiny_hf_model
    out = tmp_path_factory.mktemp("tools")
    tiny_hf_model("llama", tie=True, vocab=len(tok), seed=0,
                  max_position_embeddings=2048).save_pretrained(out)
    tok.save_pretrained(out)
    with open(out / "prompts.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"prompt": tok.decode(_prompt(tok, f"{1000 + 37 * i} * {i}"))})
                    + "\n")
    return out


def _tool_sets(tok, split: bool) -> dict:
    """The tool runs' settings: 4 steps, checkpoints at 2 and 4; with `split` the sampler on 1
    of 2 devices."""
    stops = [tok.eos_token_id, *range(1000, 1000 + len(tok) // 16)]
    sets = dict(chat_template="chatml_tools", tools="[grpo_jax.calculator:calculator]",
                max_staleness=1 + split, max_num_seqs=6, max_completion_length=48,
                per_device_train_batch_size=8, stop_token_ids=json.dumps(stops), max_steps=4,
                save_steps=2)
    if split:
        sets["sampler_devices"] = 1
    return sets


@pytest.fixture(scope="module")
def split_tool_run(tool_dir, tok, tmp_path_factory):
    """The uninterrupted one-process split run with tools (_tool_sets with split), made once:
    (its directory, its advances' finished prompts, the prompts drawn).
    test_training_with_tool_turns_in_flight_and_resume[sampler_devices] resumes it from step
    2; test_sampler_process_with_tools_equals_the_one_process_split holds its sampler process's
    run against its first 2 steps."""
    out = tmp_path_factory.mktemp("split_tools") / "full"
    with pytest.MonkeyPatch.context() as mp:
        got, drawn = advances(mp)
        train(config(tool_dir, out, **_tool_sets(tok, True)), devices=jax.devices()[:2])
    return out, list(got), list(drawn)


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True], ids=["shared", "sampler_devices"])
def test_training_with_tool_turns_in_flight_and_resume(tool_dir, tok, tmp_path, monkeypatch,
                                                       request, split):
    """A run with the calculator and partial rollouts: every row's call is made and counted,
    groups train with tokens of max_staleness versions (rows carried over rounds), each prompt
    once; resumed from its step-2 checkpoint, which holds tool-calling rows in flight (their
    messages), the same prompts, metrics and weights as the run that did not stop.

    With sampler_devices (1 of 2 devices; max_staleness 2, since every token is a version
    behind) the tools run in the sampler's thread, a round ahead: the batch sampled ahead in
    the checkpoint holds the tool loop's fields (results masked from the loss, the messages the
    rewards read), and its first batch trains at staleness 0 (the run that did not stop: the
    module's split_tool_run)."""
    sets = _tool_sets(tok, split)
    devices = jax.devices()[:1 + split]
    if split:
        made, full, full_drawn = request.getfixturevalue("split_tool_run")
        shutil.copytree(made, tmp_path / "full")
    got, drawn = advances(monkeypatch)
    if not split:
        train(config(tool_dir, tmp_path / "full", **sets), devices=devices)
        full, got[:], full_drawn, drawn[:] = list(got), [], list(drawn), []
    stopped_at(tmp_path / "full", tmp_path / "cut", 2)
    episodes = from_json_bytes(np.load(tmp_path / "cut" / "rows_in_flight" / "2.npz")[
        "episodes"])
    assert any(e["results"] for e in episodes)  # rows in flight after a tool's result
    if split:  # the batch sampled ahead: its tool results masked, its messages kept
        queued = np.load(tmp_path / "cut" / "queued" / "2.npz")
        assert ((queued["tool_mask"] == 0) & (queued["completion_mask"] > 0)).any()
        assert queued["tool_calls"].min() >= 1
        assert any(m["role"] == "tool" for row in from_json_bytes(queued["completions"])
                   for m in row)
    train(config(tool_dir, tmp_path / "cut", resume=True, **sets), devices=devices)
    # The resumed run's advances: the full run's after step 2 (a split run's third batch came
    # from the checkpoint, sampled ahead)
    assert got == full[2 + split:] and drawn and drawn == full_drawn[-len(drawn):]
    assert len(full) == 4 + split  # a split run's last advance is sampled ahead, never trained
    trained = [p for group in full[:4] for p in group]
    assert len(trained) == 8 and len(set(trained)) == 8  # 2 groups a step, each prompt once
    a, b = history(tmp_path / "full"), history(tmp_path / "cut")
    assert [h["step"] for h in b] == [1, 2, 3, 4]
    for ha, hb in zip(a, b):
        for name in ("reward", "loss", "staleness/mean", "staleness/max", "num_tokens",
                     "tools/call_frequency", "tools/failure_frequency"):
            assert ha.get(name) == hb.get(name), (ha["step"], name, ha.get(name), hb.get(name))
    assert all(h["tools/call_frequency"] > 0 and np.isfinite(h["loss"]) for h in a)
    assert max(h["staleness/max"] for h in a) == sets["max_staleness"]
    if split:
        assert a[0]["staleness/max"] == 0 and min(h["staleness/max"] for h in a[1:]) >= 1
    pa, _, _ = load_checkpoint(tmp_path / "full")
    pb, _, _ = load_checkpoint(tmp_path / "cut")
    for name, x in hf.params_numpy(pa).items():
        np.testing.assert_array_equal(x, hf.params_numpy(pb)[name], name)


@pytest.mark.slow
def test_sampler_process_with_tools_equals_the_one_process_split(tool_dir, tok, split_tool_run,
                                                                 tmp_path):
    """rollout.sampler_process with the calculator: the sampler's process builds the same tool
    loop (TurnsSpec: the tools by name, the prepared tokenizer) and calls the tools itself.
    Stopped at step 1 with tool-calling rows in flight (their episodes cross to a fresh sampler
    process on resume) and resumed to step 2, it logs what the one-process split logs, tool
    calls counted, and ends with its weights bit for bit (the one-process split: the module's
    split_tool_run, its directory as at its step-2 checkpoint)."""
    sets = dict(_tool_sets(tok, True), max_steps=2)
    del sets["save_steps"]
    devices = jax.devices()[:2]
    stopped_at(split_tool_run[0], tmp_path / "full", 2)
    own = dict(sets, sampler_process=True)
    train(config(tool_dir, tmp_path / "cut", **dict(own, max_steps=1)), devices=devices)
    episodes = from_json_bytes(np.load(tmp_path / "cut" / "rows_in_flight" / "1.npz")[
        "episodes"])
    assert any(e["results"] for e in episodes)  # rows in flight after a tool's result
    queued = np.load(tmp_path / "cut" / "queued" / "1.npz")  # the tool loop's fields came back
    assert ((queued["tool_mask"] == 0) & (queued["completion_mask"] > 0)).any()
    assert any(m["role"] == "tool" for row in from_json_bytes(queued["completions"])
               for m in row)
    train(config(tool_dir, tmp_path / "cut", resume=True, **own), devices=devices)
    a = [h for h in history(tmp_path / "full") if h["step"] <= 2]
    b = history(tmp_path / "cut")
    assert [h["step"] for h in a] == [h["step"] for h in b] == [1, 2]
    assert all(h["tools/call_frequency"] > 0 for h in b)
    assert_resumed_like_whole(tmp_path, a, b)
