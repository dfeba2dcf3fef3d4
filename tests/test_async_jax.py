"""Async rounds on the JAX sampler (max_staleness 1 with a rollout_func,
grpo_jax/rollout/async_rounds.py): a round's whole episodes (the function's generate calls)
run one round ahead in a worker thread on one weight version's copy, as vLLM's do on a server.
The first round is the synchronous run's; every later one trains a batch one version old whose
sampler log-probs equal the trainer's under the weights that drew it; a run resumed from a
checkpoint ends as the uninterrupted one, each prompt trained once; on a sampler device of its
own (sampler_devices) it trains as on the trainer's."""

import json

import jax
import pytest
from tiny_run import HERE, assert_resumed_like_whole, config, history, stopped_at

from grpo_jax.train import train

# even_tokens_then_stop: even_tokens, and a SIGTERM where a test asks for one.
GAME = dict(rollout_func=f"{HERE / 'reward_fixtures.py'}:two_turn_game",
            reward_funcs=f"[{HERE / 'reward_fixtures.py'}:even_tokens_then_stop, "
                         f"{HERE / 'reward_fixtures.py'}:more_moves]",
            max_completion_length=24, log_completions="true", num_completions_to_print=0,
            shuffle_dataset="false")
ASYNC = dict(max_steps=4, save_steps=2, max_staleness=1)


def _run(tiny_dir, out, devices=1, **extra) -> list[dict]:
    train(config(tiny_dir, out, **{**GAME, **extra}), devices=jax.devices()[:devices])
    return history(out)


def _completions(out) -> list[dict]:
    return [json.loads(line) for line in (out / "completions.jsonl").open()]


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory):
    """The async run's directory `full` (checkpoints at steps 2 and 4), beside which the
    tests write theirs."""
    root = tmp_path_factory.mktemp("async_jax")
    _run(tiny_dir, root / "full", **ASYNC)
    return root


@pytest.mark.slow
def test_a_rollout_funcs_episodes_run_a_round_ahead_on_the_jax_sampler(tiny_dir, runs):
    tmp_path = runs
    sync = _run(tiny_dir, tmp_path / "sync", max_steps=4)
    hist = history(tmp_path / "full")
    assert [h["step"] for h in hist] == [1, 2, 3, 4]
    assert [h["async/staleness"] for h in hist] == [0, 1, 1, 1]
    assert all(h["async/discarded"] == 0 for h in hist)
    assert "async/staleness" not in sync[0]
    # Round 1 has nothing to overlap with: generated when asked, as the synchronous run's.
    first = [c for c in _completions(tmp_path / "sync") if c["step"] == 1]
    assert first and first == [c for c in _completions(tmp_path / "full") if c["step"] == 1]
    for name in ("reward", "rewards/more_moves/mean", "num_tokens", "completions/mean_length"):
        assert hist[0][name] == sync[0][name], name
    # The loss weighs tokens by TRL's importance-sampling correction, which async rounds keep
    # on (their batches are stale) and the synchronous JAX sampler turns off: on the first
    # round, same weights, the weights are 1 up to float noise.
    assert abs(hist[0]["loss"] - sync[0]["loss"]) < 1e-6
    assert hist[0]["grad_norm"] == pytest.approx(sync[0]["grad_norm"], rel=1e-5)
    assert max(h["rewards/more_moves/mean"] for h in hist) > 1.0  # second turns were played
    # Both model turns of each episode drawn with one version's weights, the one kept for it.
    engine = [h["sampling/engine_logp_difference/max"] for h in hist[1:]]
    assert max(engine) < 1e-4, engine
    # ... not the current weights: the update between shows against them.
    assert min(h["sampling/sampling_logp_difference/mean"] for h in hist[1:]) > 1e-3
    # Every round trains its own prompts, in data order, as the synchronous run's.
    prompts = lambda out: [c["prompt"] for c in _completions(out)]  # noqa: E731
    assert prompts(tmp_path / "full") == prompts(tmp_path / "sync")
    assert all(h["timeline/next_generate_start"] <= h["timeline/train_start"] for h in hist[1:])


@pytest.mark.slow
def test_a_resumed_run_generates_its_batch_in_flight_again_as_it_was(tiny_dir, runs,
                                                                     monkeypatch):
    """Stopped after its step-2 checkpoint (stopped_at: the uninterrupted run's own), or by
    SIGTERM during round 3 (it trains that round, checkpoints and stops), the run resumes to
    the uninterrupted one's metrics, completions and weights: the batch that was in flight is
    generated again on the params that generated it (kept in the checkpoint), one version old
    as it was, and each prompt trains once, in data order."""
    from grpo_jax.checkpoint import StopRun
    tmp_path, settings = runs, ASYNC
    full = history(tmp_path / "full")
    assert sorted(p.name for p in (tmp_path / "full" / "generated_ahead").iterdir()) == [
        "2.npz", "4.npz"]
    stopped_at(tmp_path / "full", tmp_path / "cut", 2)
    cut = _run(tiny_dir, tmp_path / "cut", resume="true", **settings)
    assert [h["step"] for h in cut] == [1, 2, 3, 4]
    assert [h["async/staleness"] for h in cut] == [0, 1, 1, 1]
    assert_resumed_like_whole(tmp_path, full, cut)
    trained = _completions(tmp_path / "cut")
    assert trained == _completions(tmp_path / "full")
    groups = [(c["step"], c["prompt"]) for c in trained]
    prompts = [p for _, p in dict.fromkeys(groups)]  # each step's prompts, in order
    data = [json.loads(line)["prompt"] for line in (tiny_dir / "prompts.jsonl").open()]
    assert prompts == data[:len(prompts)] and len(prompts) == 16

    monkeypatch.setenv("GRPO_JAX_TEST_SIGTERM_AT", "1")
    with pytest.raises(StopRun):
        _run(tiny_dir, tmp_path / "sig", **settings)
    assert (tmp_path / "sig" / "generated_ahead" / "1.npz").exists()
    sig = _run(tiny_dir, tmp_path / "sig", resume="true", **settings)
    assert [h["step"] for h in sig] == [1, 2, 3, 4]
    for a, b in zip(full, sig):
        assert {k: v for k, v in a.items() if not k.startswith(("timing/", "step_time",
                                                                  "timeline/"))} == {
            k: v for k, v in b.items() if not k.startswith(("timing/", "step_time",
                                                            "timeline/"))}, a["step"]
    assert _completions(tmp_path / "sig") == trained


@pytest.mark.slow
def test_on_a_sampler_device_of_its_own_it_trains_as_colocated(tiny_dir, runs):
    """sampler_devices 1 of 2: the episodes a round ahead run on the sampler's device (each
    version's weights copied there, device to device), the trainer on the other; the run's
    metrics and completions are the colocated run's (the same programs, on another device)."""
    full = history(runs / "full")
    split = _run(tiny_dir, runs / "split", devices=2, sampler_devices=1, **ASYNC)
    drop = ("timing/", "step_time", "timeline/")
    assert [{k: v for k, v in h.items() if not k.startswith(drop)} for h in split] == [
        {k: v for k, v in h.items() if not k.startswith(drop)} for h in full]
    assert _completions(runs / "split") == _completions(runs / "full")


@pytest.mark.slow
def test_dynamic_sampling_stopped_mid_fill_resumes_to_the_same_run(tiny_dir, runs,
                                                                  monkeypatch):
    """dynamic_sampling with the episodes a round ahead: posts with an even number score alike
    (no signal), so each fill reads a second batch, prefetched when the first is drawn. A
    SIGTERM while round 3's fill scores its first batch stops the run with step 2's
    checkpoint, which keeps the params that generated that batch (one version old); resumed,
    the run equals the one that never stopped in every metric, completion and weight, and
    trains each odd post it read once, in data order."""
    from grpo_jax.checkpoint import StopRun
    settings = dict(ASYNC, save_steps=100, dynamic_sampling="true",
                    reward_funcs=f"[{HERE / 'reward_fixtures.py'}:even_tokens_odd_posts]")
    full = _run(tiny_dir, runs / "ds_full", **settings)
    assert [h["dynamic_sampling/num_gen_batches"] for h in full] == [2, 2, 2, 2]
    assert [h["async/staleness"] for h in full] == [0, 1, 1, 1]
    # Reward calls count across the run: 2 a round, so the 5th is round 3's first batch.
    monkeypatch.setenv("GRPO_TEST_INTERRUPT", f"5:sigterm:{runs / 'ds_calls'}")
    with pytest.raises(StopRun):
        _run(tiny_dir, runs / "ds_cut", **settings)
    monkeypatch.delenv("GRPO_TEST_INTERRUPT")
    assert (runs / "ds_cut" / "generated_ahead" / "2.npz").exists()
    cut = _run(tiny_dir, runs / "ds_cut", resume="true", **settings)
    assert_resumed_like_whole(runs, full, cut, ("ds_full", "ds_cut"))
    trained = _completions(runs / "ds_cut")
    assert trained == _completions(runs / "ds_full")
    prompts = [p for _, p in dict.fromkeys((c["step"], c["prompt"]) for c in trained)]
    data = [json.loads(line)["prompt"] for line in (tiny_dir / "prompts.jsonl").open()]
    assert prompts == [p for p in data[:32] if int(p.split()[2].rstrip(":")) % 2]
