"""Turns continued from the native sampler's KV cache (grpo_jax.rollout.native.continuation) against
`Sampler.generate` re-prefilling the whole context (fp32): the same tokens from the same keys,
prefills of the uncached tokens only, a bounded number of programs. Where the point is the two
code paths agreeing, a tiny random model (SmolLM2's tokenizer and tool prompts where real
contexts matter); SmolLM2 itself where it must write real tool calls (the float64 check)."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tool_rollouts import prompt_ids, tool_tokenizer

from grpo_jax import mesh as mesh_lib
from grpo_jax.grpo.batch import Batch
from grpo_jax.grpo.train_step import completion_logps_and_router
from grpo_jax.models import Decoder, ModelConfig
from grpo_jax.rollout import tools
from grpo_jax.rollout.native import continuation
from grpo_jax.rollout.native.rollout import JaxRollout
from grpo_jax.rollout.native.sampler import Sampler
from grpo_jax.rollout.native.sampling import SamplingParams

C = 24
ATOL = 1e-5


@pytest.fixture(scope="module")
def tok(smol_dir):
    return tool_tokenizer(smol_dir)


def _suffix(tok, content):
    return tools.tool_suffix_ids(tok, [{"role": "tool", "name": "calculator",
                                        "content": content}])


def _same_turn(more, ref, limits=None):
    """`more` (continued) samples what `ref` (re-prefilled) does, up to each row's limit."""
    for j in range(len(ref.completion_ids)):
        k = int(ref.completion_mask[j].sum()) if limits is None else min(
            int(ref.completion_mask[j].sum()), limits[j])
        assert int(more.completion_mask[j].sum()) == k, j
        np.testing.assert_array_equal(more.completion_ids[j, :k], ref.completion_ids[j, :k])
        # fp32: the cache's attention sums in another order than the full prefill's. Measured
        # on `tool_model`: at most 9.5e-7; the bound is ~10x that (SmolLM2's was 5e-5).
        np.testing.assert_allclose(more.sampler_logp[j, :k], ref.sampler_logp[j, :k],
                                   rtol=0, atol=ATOL)


@pytest.fixture(scope="module")
def tool_model(tok):
    """A tiny random Llama (fp32) over SmolLM2's vocabulary, for the tool prompts' real token
    ids: the continued and the re-prefilled paths are what is compared, not what SmolLM2 writes,
    and its programs compile in seconds, not minutes."""
    cfg = ModelConfig("llama", vocab_size=len(tok), hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=16).replace(dtype="float32")
    return Decoder(cfg, rngs=nnx.Rngs(0))


def _compiles(caplog, name):
    """The argument shapes of each compile of the jitted function `name` so far."""
    return [re.findall(r"ShapedArray\((\w+\[[\d,]*\])", r.getMessage()) for r in caplog.records
            if f"Compiling jit({name})" in r.getMessage()]


@pytest.mark.slow
def test_turns_continue_as_re_prefills_do(tool_model, tok, caplog):
    """Two continued turns give `generate`'s tokens on the whole context, for rows picked from
    the cache in any order, turns ending at different lengths, a context that rewrites part of
    a cached turn (only its tail is cached), and a row held to a smaller budget; each turn's
    program takes only the uncached tokens (a suffix bucket of 8 or 16), and new turns of
    known shapes compile nothing. The tool prompts' real contexts (SmolLM2's tokenizer) on a
    tiny random model (`tool_model`); a sixteenth of its vocabulary stops a turn, so turns
    end at different lengths, as SmolLM2's do."""
    model = tool_model
    stops = (tok.eos_token_id, *range(1000, 1000 + len(tok) // 16))
    sp = SamplingParams(max_completion_length=C, temperature=1.0, stop_token_ids=stops)
    sampler = Sampler(model.cfg, sp, pad_id=tok.pad_token_id)
    turns = continuation.Continuation(sampler)
    prompts = prompt_ids(tok)
    first, session = turns.first_turn(model, prompts, 2, 0)
    ref = sampler.generate(model, prompts, 2, 0)
    np.testing.assert_array_equal(first.completion_ids, ref.completion_ids)
    np.testing.assert_array_equal(first.sampler_logp, ref.sampler_logp)
    # Turns end at different lengths; row 1's first turn is longer than the part of it that
    # its rewritten context keeps below.
    assert len(set(first.completion_mask.sum(axis=1).tolist())) > 2, first.completion_mask
    assert first.completion_mask[1].sum() > 2

    def done(batch, j):
        return batch.completion_ids[j][batch.completion_mask[j].astype(bool)].tolist()
    ctx = [list(prompts[j // 2]) + done(first, j) for j in range(4)]
    rows = [3, 0, 1]
    contexts = [ctx[3] + _suffix(tok, "441824601"),
                ctx[0] + _suffix(tok, "{'error': 'Tool calculator timed out after 10 s'}"),
                ctx[1][:len(prompts[0]) + 2] + _suffix(tok, "61422")]
    limits = [C, 2, C]
    caplog.set_level(logging.WARNING)
    with jax.log_compiles():
        more, session = turns.next_turn(model, session, rows, contexts, limits, 1)
        ref = sampler.generate(model, contexts, 1, 1)
        assert ref.completion_mask[1].sum() > limits[1]  # the smaller budget bites
        _same_turn(more, ref, limits)
        # What the cache lacked: the tool result, and the turn's last token when the decode
        # loop ended before feeding it; for the rewritten context, all after the kept prefix.
        tails = more.prompt_mask.sum(axis=1).tolist()
        fresh = [len(_suffix(tok, "441824601")),
                 len(_suffix(tok, "{'error': 'Tool calculator timed out after 10 s'}")),
                 len(contexts[2]) - len(prompts[0]) - 2]
        assert all(f <= t <= f + 1 for t, f in zip(tails[:2], fresh[:2])), (tails, fresh)
        assert tails[2] <= fresh[2]
        T = max(8, 1 << (max(tails) - 1).bit_length())
        assert more.prompt_ids.shape[1] == T < min(map(len, contexts)) // 10
        assert more.prompt_ids.shape == more.prompt_mask.shape
        # and the cache moved to a larger context bucket than the first turn's
        cached = max(len(c) - t for c, t in zip(contexts, tails))
        assert sampler.bucket(cached + T) > first.prompt_ids.shape[1], (cached, T)

        contexts2 = [contexts[j] + done(more, j) + _suffix(tok, "7") for j in (2, 0)]
        more2, session2 = turns.next_turn(model, session, [2, 0], contexts2, [C, C], 2)
        _same_turn(more2, sampler.generate(model, contexts2, 1, 2))
        assert more2.prompt_ids.shape[1] <= 16
        # Another turn of the same shapes (other sampling keys) reuses the programs.
        before = (turns._next._cache_size(), turns._align._cache_size())
        turns.next_turn(model, session, [2, 0], contexts2, [C, C], 3)
        assert (turns._next._cache_size(), turns._align._cache_size()) == before
    compiled = _compiles(caplog, "_next_program")
    assert len(compiled) == 2 == turns._next._cache_size()  # batches of 4 and of 2
    for shapes, B, T in zip(compiled, (4, 2), (more.prompt_ids.shape[1],
                                               more2.prompt_ids.shape[1])):
        ints = [s for s in shapes if s.startswith("int32")]
        # content mask [B, base], suffix ids and mask [B, T], start and limit [B]: no
        # argument spans the context's tokens
        assert len(ints) == 5 and ints[1] == ints[2] == f"int32[{B},{T}]", ints


def test_sliding_window_models_re_prefill():
    """A model with sliding-window layers keeps ring caches, which can't be re-aligned nor
    take several tokens at once: its rollout has no continuation and ToolRollout re-prefills
    each turn's context through `generate`."""
    cfg = ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, sliding_window=4,
                      layer_types=("sliding_attention", "full_attention"))
    rollout = JaxRollout(cfg, SamplingParams(max_completion_length=4), pad_id=0, mesh=None)
    assert rollout.turns is None
    with pytest.raises(NotImplementedError, match="sliding-window ring cache"):
        continuation.Continuation(rollout.sampler)
    assert JaxRollout(cfg.replace(sliding_window=None, layer_types=None),
                      SamplingParams(max_completion_length=4), pad_id=0, mesh=None).turns


FP64_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np, transformers
sys.path.insert(0, {tests!r})
from tool_rollouts import prompt_ids, tool_rollout, tool_batch
from grpo_jax import data, hf
from grpo_jax.rollout import tools
from grpo_jax.grpo.train_step import completion_logps
model, path = hf.load_model(hf.SMOL_ALIAS, dtype=jnp.float64, param_dtype=jnp.float64)
assert model.embed[...].dtype == jnp.float64
tok = transformers.AutoTokenizer.from_pretrained(path)
tok.chat_template = data.chat_template("chatml_tools")
tok = tools.prepare_tool_tokenizer(tok)
# 2 x 2 rows (not 2 x 4: float64 decoding dominates); with key 1 a row goes on after its tool
# result and an unlikely token is written (key 0 wrote none below -10)
r = tool_rollout(model, tok).generate(model, prompt_ids(tok), 2, jax.random.key(1))
batch = tool_batch(r)
# one program, as the train step runs it (op by op it compiled dozens of small ones)
logp, _ = jax.jit(lambda m, b: completion_logps(m, b, 1.0, 128))(model, batch)
model_tokens = np.asarray(batch.model_mask(), bool)
later = model_tokens & (np.cumsum(r.tool_mask == 0, axis=1) > 0)
diff = np.abs(np.asarray(logp) - r.sampler_logp)
print("RESULT", diff[model_tokens].max(), diff[later].max(), later.sum(),
      r.sampler_logp[model_tokens].min())
"""


@pytest.mark.slow
def test_multi_turn_logprobs_in_float64_meet_1e5():
    """The 5e-5 bound of test_tools' fp32 parity is summation-order noise, not a different
    function: in float64 (x64 on, in a process of its own) the continued sampler's log-probs of
    every model-written token, later turns included, equal the trainer's within 1e-5; what is
    left is both sides' fp32 log-softmax (token_logprob, token_logprobs round there). SmolLM2,
    as it must write real tool calls for there to be later turns; 4 rows, and the trainer's
    log-probs as one jitted program, as the train step has them."""
    from x64 import run_x64
    worst, later, n_later, lowest = map(float, run_x64(FP64_SCRIPT))
    assert n_later > 0 and lowest < -10  # later turns, and unlikely tokens, are in there
    assert worst < 1e-5 and later < 1e-5, (worst, later)


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
@pytest.mark.slow
def test_three_turns_with_a_repetition_penalty_on_a_small_model(mesh_shape):
    """On a small random model (fast to compile), on one device and on a (2, 2, 2) mesh: three
    continued turns with a repetition penalty and top-k sample what `generate` does on the
    whole context (the penalty sees every context token, cached or not), rows dropping out and
    budgets shrinking between turns. Shapes are held so that the turns share their programs:
    one context bucket, tool results of 8 to 15 tokens (a suffix bucket of 16), and after the
    first turn's 6 rows 4, 3 and 3, in another order (batches of 4 each: one continuation
    program and one `generate` program for the three turns, not three of each). Moving to a
    larger bucket between turns is test_turns_continue_as_re_prefills_do's (384 -> 512)."""
    cfg = ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=2, num_kv_heads=2,
                      head_dim=16).replace(dtype="float32")
    params = nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    sp = SamplingParams(max_completion_length=6, temperature=0.8, top_k=20,
                        repetition_penalty=1.5, stop_token_ids=(2,))
    mesh = mesh_shape and mesh_lib.make_mesh(mesh_lib.MeshConfig(*mesh_shape),
                                             jax.devices()[:8])
    sampler = Sampler(cfg, sp, pad_id=0, buckets=(128,), mesh=mesh)
    turns = continuation.Continuation(sampler)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 64, n).tolist() for n in (5, 11, 3)]
    batch, session = turns.first_turn(params, prompts, 2, 0)
    contexts = [prompts[j // 2] + batch.completion_ids[j][batch.completion_mask[j] == 1].tolist()
                for j in range(6)]
    for turn, keep in enumerate(([5, 0, 2, 3], [3, 1, 0], [2, 0, 1])):
        contexts = [contexts[j] + rng.integers(3, 64, rng.integers(8, 16)).tolist()
                    for j in keep]
        limits = rng.integers(1, 7, len(keep)).tolist()
        more, session = turns.next_turn(params, session, keep, contexts, limits, turn + 1)
        ref = sampler.generate(params, contexts, 1, turn + 1)
        assert more.prompt_ids.shape[1] == 16
        for j, limit in enumerate(limits):
            k = min(int(ref.completion_mask[j].sum()), limit)
            assert int(more.completion_mask[j].sum()) == k
            np.testing.assert_array_equal(more.completion_ids[j, :k], ref.completion_ids[j, :k])
            np.testing.assert_allclose(more.sampler_logp[j, :k], ref.sampler_logp[j, :k],
                                       rtol=0, atol=1e-5)
        contexts = [c + more.completion_ids[j][more.completion_mask[j] == 1].tolist()
                    for j, c in enumerate(contexts)]


@pytest.mark.slow
def test_tool_turns_record_the_routing_that_replay_runs():
    """A tiny random mixture of experts (fp32) through two continued tool turns, assembled as
    ToolRollout assembles its rows (tools.record_turn_routing): every token the trainer
    forwards has the experts the sampler ran, tool results included, except a row's last
    token, which no forward took. Under the sampling weights the trainer's forward routes
    every recorded token as recorded (router/mismatch 0 without replay: the record sits at
    the right positions) and gives the sampler's log-probs, and so does R3 replaying it."""
    cfg = ModelConfig("qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=24).replace(dtype="float32")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    C = 32
    # Stop tokens an eighth of the vocabulary: turns of a few tokens, with room for more.
    sp = SamplingParams(max_completion_length=C, temperature=1.0,
                        stop_token_ids=tuple(range(2, 10)))
    # One context bucket: both turns run one program.
    sampler = Sampler(cfg, sp, pad_id=0, buckets=(64,), record_routing=True)
    turns = continuation.Continuation(sampler)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 64, n).tolist() for n in (5, 11)]
    first, session = turns.first_turn(model, prompts, 2, 0)
    n = len(first.completion_ids)
    ids = [first.completion_ids[j][first.completion_mask[j] == 1].tolist() for j in range(n)]
    logp = [first.sampler_logp[j][first.completion_mask[j] == 1].tolist() for j in range(n)]
    written = [[1] * len(x) for x in ids]
    routing = first.completion_routing.copy()
    for j in range(n):
        routing[j, len(ids[j]):] = -1
    where = list(range(n))
    for turn, keep in enumerate(([3, 0, 1], [1, 3, 0])):
        keep = [i for i in keep if len(ids[i]) + 6 < C]
        for i in keep:  # a tool result of 1 to 5 tokens, no loss on it
            result = rng.integers(10, 64, rng.integers(1, 6)).tolist()
            ids[i], logp[i], written[i] = (ids[i] + result, logp[i] + [0.0] * len(result),
                                           written[i] + [0] * len(result))
        contexts = [prompts[i // 2] + ids[i] for i in keep]
        more, session = turns.next_turn(model, session, [where[i] for i in keep], contexts,
                                        [C - len(ids[i]) for i in keep], turn + 1)
        where = {i: j for j, i in enumerate(keep)}
        for j, i in enumerate(keep):
            m = more.completion_mask[j] == 1
            tools.record_turn_routing(routing[i], more, j, len(ids[i]), int(m.sum()))
            ids[i] += more.completion_ids[j][m].tolist()
            logp[i] += more.sampler_logp[j][m].tolist()
            written[i] += [1] * int(m.sum())
    assert sum(0 in w for w in written) >= 2, written
    cids, cmask = np.zeros((n, C), np.int32), np.zeros((n, C), np.int32)
    tool_mask, sampler_logp = np.ones((n, C), np.int32), np.zeros((n, C), np.float32)
    for j in range(n):
        k = len(ids[j])
        cids[j, :k], cmask[j, :k], tool_mask[j, :k] = ids[j], 1, written[j]
        sampler_logp[j, :k] = logp[j]
    recorded = routing[..., 0, 0] >= 0
    # Every forwarded token has its record, tool results included; a row's last one may not.
    last = cmask.sum(axis=1) - 1
    for j in range(n):
        assert recorded[j, :last[j]].all() and not recorded[j, last[j] + 1:].any(), j
    batch = Batch(*map(jnp.asarray, (first.prompt_ids, first.prompt_mask, cids, cmask)),
                  jnp.zeros(n, bool), jnp.zeros(n), tool_mask=jnp.asarray(tool_mask),
                  prompt_routing=jnp.asarray(first.prompt_routing),
                  completion_routing=jnp.asarray(routing))
    model_tokens = (cmask * tool_mask).astype(bool)

    forward = nnx.jit(lambda m: completion_logps_and_router(m, batch, 1.0, 8))
    for replay in ("disabled", "R3"):
        model.cfg = cfg.replace(router_replay=replay)
        logps, _, _, (differ, counted) = forward(model)
        assert differ == 0 and counted == sum(cfg.moe_layers) * recorded[cmask == 1].sum()
        np.testing.assert_allclose(np.asarray(logps)[model_tokens], sampler_logp[model_tokens],
                                   rtol=0, atol=1e-5)
