"""Partial rollouts (grpo_jax.rollout.native.partial, max_staleness >= 1 with decode slots): rows
carried from round to round draw what one static batch draws from the same keys, log-probs equal
the trainer's, each token's version is the round that drew it, stale groups start over; in a
run, every prompt is trained exactly once, in draw order of completion, and a run stopped with
rows in flight (in process, SIGTERM and SIGKILL) resumes to the uninterrupted run's result."""

import dataclasses
import signal
import time

import jax
import numpy as np
import pytest
from flax import nnx

from model_oracle import trainer_logp
from tiny_run import ODD_POSTS, advances, cli_args, config, history, run_cli, stopped_at

from grpo_jax import hf
from grpo_jax import mesh as mesh_lib
from grpo_jax.checkpoint import Checkpointer, load_checkpoint
from grpo_jax.config import TrainConfig
from grpo_jax.errors import ConfigError
from grpo_jax.models import Decoder, ModelConfig
from grpo_jax.rollout.native.partial import (PartialRollouts, from_arrays, group_slots_for,
                                             to_arrays)
from grpo_jax.rollout.native.sampler import Sampler
from grpo_jax.rollout.native.sampling import SamplingParams
from grpo_jax.train import train

CFG = ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=2, num_kv_heads=2, head_dim=16).replace(dtype="float32")
# Many stop tokens: rows end after 1 to 12 tokens, a long tail.
SP = SamplingParams(max_completion_length=12, temperature=1.0, top_k=40, repetition_penalty=1.3,
                    stop_token_ids=(2, 3, 4, 5))
G, K = 4, 2  # rows a group, groups a round
# A mixture of experts (4 experts, 2 a token, both layers sparse): the rows record routing.
MOE = CFG.replace(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, norm_topk_prob=True)


def _prompts(count, seed=0):
    rng = np.random.default_rng(seed)  # 2 to 19 tokens: one prompt width (32) for all
    return [rng.integers(6, 64, int(k)).tolist() for k in rng.integers(2, 20, count)]


def _rounds(partial, params_of, prompts, rounds, key=7):
    """`rounds` rounds of partial rollouts, each drawing the prompts for the group slots the
    last emptied; params_of(round) the weights. Returns [(round, Advanced)] and the state."""
    at, drawn, out = partial.empty(20), 0, []
    for r in range(rounds):
        n = at.empty_groups
        records = [{"prompt_ids": p, "i": drawn + j} for j, p in enumerate(prompts[drawn:drawn + n])]
        done = partial.advance(params_of(r), at, records, list(range(drawn, drawn + n)), r,
                               jax.random.key(key))
        drawn, at = drawn + n, done.in_flight
        out.append((r, done))
    return out, at


@pytest.mark.parametrize("case", ["plain", "mesh", "moe", "wide"])
def test_carried_rows_draw_what_one_batch_does(case, compiled):
    """Fixed weights, 3 decode slots (fewer than a group), 2 groups a round: rows span rounds,
    yet every returned group equals one static batch of its prompt from its keys (rows
    group x G + j); log-probs equal the trainer's; versions are the rounds that drew the tokens;
    each prompt comes back once, the oldest first among those done; one program. A mixture of
    experts records the static batch's routing, carried across rounds with the rows. "wide":
    three batches of groups in flight (max_inflight_tasks), their rows queued for the slots."""
    cfg, record = (MOE, True) if case == "moe" else (CFG, False)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    mesh = (mesh_lib.make_mesh(mesh_lib.MeshConfig(2, 2, 2), jax.devices()[:8])
            if case == "mesh" else None)
    sampler = Sampler(cfg, dataclasses.replace(SP, max_num_seqs=3), pad_id=0, mesh=mesh,
                      record_routing=record)
    slots = 4 if mesh else 3  # rounded up to the 4 batch shards
    partial = PartialRollouts(sampler, slots, G, K, max_staleness=100,
                              group_slots=3 * K if case == "wide" else None)
    assert partial.pass_groups == K  # a round's groups fill the slots: not every group slot
    program, passes = partial.program, []
    partial.program = lambda *a, **k: passes.append(1) or program(*a, **k)
    prompts = _prompts(16)
    rounds, left = _rounds(partial, lambda r: params, prompts, 5)
    assert len(passes) > len(rounds)  # some rounds went on after a pass over the next groups
    static = Sampler(cfg, SP, pad_id=0, record_routing=record)
    seen, spanned = [], 0
    for r, done in rounds:
        assert len(done.records) == K and done.dropped == 0
        ids = [rec["i"] for rec in done.records]
        seen += ids
        versions = done.rollout.versions[done.rollout.completion_mask > 0]
        assert versions.max() == r and versions.min() >= 0
        spanned += sum(len(set(v[m > 0])) > 1 for v, m in
                       zip(done.rollout.versions, done.rollout.completion_mask))
        for k, i in enumerate(ids):
            one = static.generate(params, [prompts[i]], G, jax.random.key(7), first_row=i * G)
            rows = slice(k * G, (k + 1) * G)
            for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                         "truncated"):
                np.testing.assert_array_equal(getattr(done.rollout, name)[rows],
                                              getattr(one, name), name)
            np.testing.assert_allclose(done.rollout.sampler_logp[rows], one.sampler_logp,
                                       rtol=0, atol=2e-6)
            if record:  # every token fed: the prompt, each completion token but the last
                got = done.rollout
                np.testing.assert_array_equal(got.prompt_routing[rows], one.prompt_routing)
                fed = np.arange(SP.max_completion_length) < one.completion_mask.sum(1)[:, None] - 1
                assert (got.completion_routing[rows][fed] >= 0).all()
                assert (got.completion_routing[rows][~fed] == -1).all()
                np.testing.assert_array_equal(got.completion_routing[rows][fed],
                                              one.completion_routing[fed])
        m = done.rollout.completion_mask.astype(bool)
        assert np.abs(done.rollout.sampler_logp - trainer_logp(model, done.rollout, 1.0))[m].max() < 5e-5
    assert spanned > 0  # some rows did decode over two rounds
    assert len(set(seen)) == len(seen)  # no group twice
    in_flight = set(left.data_rows[left.data_rows >= 0].tolist())
    drawn = partial.group_slots + 4 * K  # every group slot, then a round's K each round
    assert partial.group_slots == (3 if case == "wide" else 2) * K
    assert not in_flight & set(seen) and in_flight | set(seen) == set(range(drawn))
    assert compiled.count("jit(_advance)") == 1, compiled
    if case == "wide":  # resumed with another max_inflight_tasks: one line naming the setting
        narrow = PartialRollouts(sampler, slots, G, K, max_staleness=100)
        with pytest.raises(ValueError, match=f"max_inflight_tasks: {3 * K * G} "):
            from_arrays(narrow.empty(20), to_arrays(left), lambda i: {"i": i})
    if record:  # a checkpoint's rows in flight keep the records of the rows carried
        assert (np.asarray(left.rows.routing) >= 0).any()
        back = from_arrays(partial.empty(20), to_arrays(left), lambda i: {"i": i})
        for a, b in zip(jax.tree.leaves(left.rows), jax.tree.leaves(back.rows), strict=True):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_stale_groups_start_over():
    """A round four versions after the last, with max_staleness 1: every carried group with a
    token drawn is dropped and drawn again, so what the round returns is all of its version."""
    params = nnx.state(Decoder(CFG, rngs=nnx.Rngs(0)), nnx.Param)
    other = nnx.state(Decoder(CFG, rngs=nnx.Rngs(1)), nnx.Param)
    sampler = Sampler(CFG, dataclasses.replace(SP, max_num_seqs=3), pad_id=0)
    partial = PartialRollouts(sampler, 3, G, K, max_staleness=1)
    prompts = _prompts(8, seed=1)
    at = partial.empty(20)
    first = partial.advance(params, at, [{"prompt_ids": p} for p in prompts[:2 * K]],
                            list(range(2 * K)), 0, jax.random.key(3))
    carried = first.in_flight
    started = (np.asarray(carried.rows.mask).reshape(2 * K, G, -1).sum((1, 2)) > 0)
    stale = int((started & (carried.seq >= 0)).sum())
    assert stale > 0
    later = partial.advance(other, carried, [{"prompt_ids": p} for p in prompts[2 * K:3 * K]],
                            list(range(2 * K, 3 * K)), 4, jax.random.key(3))
    assert later.dropped == stale
    assert (later.rollout.versions[later.rollout.completion_mask > 0] == 4).all()


def test_settings():
    with pytest.raises(ConfigError, match="set max_num_seqs"):
        TrainConfig(rollout=dataclasses.replace(TrainConfig().rollout, max_staleness=2))
    partial = dict(generation=SamplingParams(max_num_seqs=8),
                   rollout=dataclasses.replace(TrainConfig().rollout, max_staleness=2))
    # a rollout_func's whole episodes run a round ahead instead (test_async_jax.py)
    TrainConfig(**partial, multi_turn=dataclasses.replace(TrainConfig().multi_turn,
                                                          rollout_func="x.py:f"))
    # tools run row by row in the partial rollouts (test_partial_tools.py)
    TrainConfig(**partial, multi_turn=dataclasses.replace(TrainConfig().multi_turn,
                                                          tools=("math.sqrt",)))
    # max_inflight_tasks (TRL AsyncGRPOConfig's): rows in flight, in whole generation
    # batches; -1 is TRL's rule, max_staleness batches (at least two on shared devices)
    wide = dict(generation=SamplingParams(max_num_seqs=8), rollout=dataclasses.replace(
        TrainConfig().rollout, max_staleness=2, max_inflight_tasks=40))
    assert TrainConfig(**wide).rollout.max_inflight_tasks == 40
    with pytest.raises(ConfigError, match="max_inflight_tasks must be >= 1"):
        dataclasses.replace(TrainConfig().rollout, max_inflight_tasks=0)
    with pytest.raises(ConfigError, match="unset max_inflight_tasks"):  # vLLM's async rounds
        TrainConfig(rollout=dataclasses.replace(TrainConfig().rollout, max_staleness=1,
                                                backend="vllm", max_inflight_tasks=16))
    assert [group_slots_for(-1, s, 8, 4, split=False) for s in (1, 2, 3, 8)] == [8, 8, 12, 32]
    assert [group_slots_for(-1, s, 8, 4, split=True) for s in (1, 2, 3)] == [4, 8, 12]
    assert [group_slots_for(n, 2, 8, 4, split=False) for n in (1, 32, 33, 80)] == [4, 4, 8, 12]


PARTIAL = dict(max_staleness=2, max_num_seqs=8, max_completion_length=12)


@pytest.mark.slow
def test_each_prompt_trained_once_and_resume_equals_uninterrupted(tiny_dir, tmp_path,
                                                                   monkeypatch):
    """6 rounds of 4 groups with 8 slots: no prompt trained twice, the prompts trained plus
    those in flight are exactly those drawn, in the data's order; resumed from its step-3
    checkpoint (which holds the rows in flight), the same prompts trained in the same order,
    the same metrics, the same weights as the run that never stopped; max_staleness 0 keeps
    today's rounds (no rows in flight, no staleness metrics)."""
    got, drawn = advances(monkeypatch)
    devices = jax.devices()[:1]
    train(config(tiny_dir, tmp_path / "full", max_steps=6, save_steps=3, **PARTIAL),
          devices=devices)
    full, got[:], full_drawn, drawn[:] = list(got), [], list(drawn), []
    stopped_at(tmp_path / "full", tmp_path / "cut", 3)
    assert len((tmp_path / "cut" / "rows_in_flight" / "3.npz").read_bytes()) > 0
    train(config(tiny_dir, tmp_path / "cut", max_steps=6, save_steps=3, resume=True, **PARTIAL),
          devices=devices)
    # Rounds 4 to 6's advances, from the rows in flight: 4 new groups each (8 drawn first)
    assert got == full[3:] and drawn == full_drawn[16:]
    trained = [p for group in full for p in group]
    # 28 drawn (8 groups first, then 4 a round), 24 trained, each once; 4 left in flight
    assert len(trained) == 24 and len(set(trained)) == 24 and len(set(full_drawn)) == 28
    assert set(trained) <= set(full_drawn)
    a, b = history(tmp_path / "full"), history(tmp_path / "cut")
    assert [h["step"] for h in b] == [1, 2, 3, 4, 5, 6]
    for ha, hb in zip(a, b):
        for name in ("reward", "loss", "staleness/mean", "staleness/max", "num_tokens",
                     "sampling/sampling_logp_difference/mean"):
            assert (ha.get(name) == hb.get(name)), (ha["step"], name, ha.get(name), hb.get(name))
    assert max(h["staleness/max"] for h in a) >= 1  # rows did carry over
    pa, _, _ = load_checkpoint(tmp_path / "full")
    pb, _, _ = load_checkpoint(tmp_path / "cut")
    for name, x in hf.params_numpy(pa).items():
        np.testing.assert_array_equal(x, hf.params_numpy(pb)[name], name)
    # Off: the synchronous rounds, no state carried.
    got[:] = []
    train(config(tiny_dir, tmp_path / "off", max_steps=1, max_num_seqs=8), devices=devices)
    assert got == [] and "staleness/mean" not in history(tmp_path / "off")[0]
    assert not (tmp_path / "off" / "rows_in_flight").exists()


@pytest.mark.slow
def test_sigterm_and_sigkill_with_rows_in_flight_resume_to_the_same_run(tiny_dir, tmp_path):
    """A real run stopped by SIGTERM (it checkpoints the rows in flight and exits), resumed,
    killed by SIGKILL after its next checkpoint, resumed again: the uninterrupted run's weights
    and metrics."""
    extra = dict(PARTIAL, max_steps=8, save_steps=2)
    full = run_cli(cli_args(tiny_dir, tmp_path / "full", **extra))
    assert full.wait(timeout=600) == 0, full.stderr.read()[-3000:]
    out = tmp_path / "cut"
    ckpts = out / "checkpoints"

    def stop_after(proc, step, sig):
        deadline = time.time() + 600
        while not (ckpts / str(step)).is_dir() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(sig)
        proc.wait(timeout=300)
        done = Checkpointer(ckpts, save_total_limit=None).all_steps()
        assert done and max(done) < 8, (done, proc.stderr.read()[-3000:])
        return max(done)

    first = run_cli(cli_args(tiny_dir, out, **extra))
    at = stop_after(first, 2, signal.SIGTERM)
    assert first.returncode != 0 and (out / "rows_in_flight" / f"{at}.npz").exists()
    second = run_cli(cli_args(tiny_dir, out, **extra) + ["--resume"])
    at2 = stop_after(second, at + 2, signal.SIGKILL)
    assert second.returncode == -signal.SIGKILL and at2 > at
    third = run_cli(cli_args(tiny_dir, out, **extra) + ["--resume"])
    _, err = third.communicate(timeout=600)
    assert third.returncode == 0, err[-3000:]
    assert f"resumed from step {at2}" in err
    pa, _, _ = load_checkpoint(tmp_path / "full")
    pb, _, _ = load_checkpoint(out)
    for name, x in hf.params_numpy(pa).items():
        np.testing.assert_array_equal(x, hf.params_numpy(pb)[name], name)
    a, b = history(tmp_path / "full"), history(out)
    assert [h["step"] for h in b] == list(range(1, 9))
    assert [h["reward"] for h in a] == [h["reward"] for h in b]


@pytest.mark.slow
def test_dynamic_sampling_keeps_decoding_until_the_batch_has_signal(tiny_dir, tmp_path,
                                                                    monkeypatch):
    """DAPO's dynamic sampling with partial rollouts: posts with an even number score alike
    (no signal), so each round drops their groups and decodes on, new prompts filling the
    group slots, until 4 groups with signal are whole; only odd posts train, each once; the
    run resumed from its step-2 checkpoint ends as the one that did not stop. Three batches
    in flight (max_inflight_tasks 48 of 16-row batches: 12 group slots, in checkpoints too)."""
    got, drawn = advances(monkeypatch)
    settings = dict(ODD_POSTS, **PARTIAL, max_inflight_tasks=48)
    train(config(tiny_dir, tmp_path / "full", **settings), devices=jax.devices()[:1])
    with np.load(tmp_path / "full" / "rows_in_flight" / "2.npz") as held:
        assert held["seq"].shape == (12,)
    full = history(tmp_path / "full")
    assert [h["step"] for h in full] == [1, 2, 3]
    assert max(h["dynamic_sampling/num_gen_batches"] for h in full) >= 2
    passes = list(got)
    stopped_at(tmp_path / "full", tmp_path / "cut", 2)
    train(config(tiny_dir, tmp_path / "cut", resume=True, **settings),
          devices=jax.devices()[:1])
    again = got[len(passes):]  # the full run's last passes, those of step 3
    assert again and again == passes[len(passes) - len(again):] and len(again) < len(passes)
    cut = history(tmp_path / "cut")
    for a, b in zip(full, cut):
        for name in ("reward", "loss", "dynamic_sampling/num_gen_batches", "staleness/mean"):
            assert a[name] == b[name], (a["step"], name)
    returned = [p for group in passes for p in group]
    assert len(set(returned)) == len(returned)
    numbers = [int(p.split()[2].rstrip(":")) for p in returned]
    assert any(n % 2 == 0 for n in numbers)  # returned, filtered out
