"""One round (grpo_jax.round.GRPORound) as TRL's generation buffer: every completion is
trained on, windows of gradient_accumulation_steps micro-batches span generations, the
generation batch is shuffled before it is split, and the logged learning rate is the applied one.
The round runs here with a stub sampler and a stub trainer (no model) unless a test needs one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from round_stubs import C, G, MICRO, State, StubRollout, StubTrainer, plan

from grpo_jax import run_facts
from grpo_jax.config import BatchArgs, BatchPlan, GRPOArgs
from grpo_jax.data import DataPosition
from grpo_jax.grpo.batch import Batch
from grpo_jax.grpo.loss import LossConfig
from grpo_jax.rollout.base import RolloutBatch
from grpo_jax.scoring import Scores
from grpo_jax.round import (Draw, GRPORound, completion_metrics, generation_order,
                            update_logged, window_sizes)
from grpo_jax.run_state import RunState


def make_round(p, rollout=None, score=None, names=("r",), trainer=None, **grpo):
    """A round of the stub trainer and rollout; `grpo`: GRPOArgs fields (scale_rewards group)."""
    scorer = score or (lambda records, r: Scores(
        np.arange(r.truncated.size, dtype=np.float32)[:, None] % 3))
    return GRPORound(trainer or StubTrainer(), rollout or StubRollout(), p, scorer, list(names),
                     GRPOArgs(**grpo))


def draw(p, ends_epoch=False, more=None, k=0):
    """Generation k's prompts (their data position: k + 1 batches on)."""
    return Draw([{"prompt_ids": [1, 2]}] * p.prompts_per_generation, DataPosition(0, k + 1),
                ends_epoch, more)


def start(step=0, **fields):
    return RunState(State(step, step), **fields)


def run_rounds(rnd, n, max_updates=None, epoch_rounds=None, at=None, stop=None):
    """n rounds from `at` (default: a fresh run); every epoch_rounds-th ends an epoch (None:
    none does). Returns the run state after them and each round's result."""
    at, results = at or start(), []
    for k in range(n):
        ends = epoch_rounds is not None and (k + 1) % epoch_rounds == 0
        at, result = rnd(at, draw(rnd.plan, ends, k=k), jax.random.key(k),
                         max_updates=max_updates, stop=stop)
        results.append(result)
    return at, results


def row_ids(batch):
    return batch.completion_ids[:, 0].tolist()


@pytest.mark.parametrize("spg,gas,ni", [(3, 2, 1), (1, 2, 1), (2, 3, 1), (2, 4, 1), (1, 2, 2),
                                        (2, 1, 2), (4, 1, 1)])
def test_every_completion_is_trained_on_in_windows_of_gas(spg, gas, ni):
    """TRL trains on every micro-batch: generation every spg * ni micro-steps, an update every
    gas micro-steps, so a window may span two generations (spg=3, gas=2: 2 generations make 3
    updates; spg=1, gas=2: an update every second generation)."""
    p = plan(spg, gas, ni)
    rnd = make_round(p)
    rounds = int(np.lcm(spg * ni, gas)) // (spg * ni) * 2  # ends with an empty buffer
    at, results = run_rounds(rnd, rounds)
    fed = rnd.policy.windows
    assert all(w.size == gas * MICRO for w in fed)
    assert at.round == rounds and at.position == DataPosition(0, rounds)
    assert at.step == len(fed) == rounds * spg * ni // gas
    # The micro-step sequence: each generation's shuffled micro-batches, ni times, in order.
    want = []
    for k, r in enumerate(rnd.rollout.generated):
        n = r.truncated.size
        order = generation_order(jax.random.key(k), n) if spg > 1 else np.arange(n)
        want += (order + k * n).reshape(spg, MICRO).tolist() * ni
    got = [row_ids(w)[i * MICRO:(i + 1) * MICRO] for w in fed for i in range(gas)]
    assert got == want
    # Every completion exactly ni times; its prompt comes along (left-padded to the window).
    ids = sorted(sum((row_ids(w) for w in fed), []))
    assert ids == sorted(list(range(rounds * spg * MICRO)) * ni)
    for w in fed:
        assert (w.prompt_ids[:, -1] == w.completion_ids[:, 0]).all()
        assert (w.prompt_mask.sum(1) == 1).all()


def test_windows_span_generations_with_the_expected_rows():
    """spg=3, gas=2: update 2 = the last micro-batch of generation 0 + the first of 1."""
    rnd = make_round(plan(3, 2))
    _, results = run_rounds(rnd, 2)
    assert [r.updates for r in results] == [1, 2]
    w = rnd.policy.windows
    gen0 = generation_order(jax.random.key(0), 12)
    gen1 = generation_order(jax.random.key(1), 12) + 12
    assert row_ids(w[0]) == gen0[:8].tolist()
    assert row_ids(w[1]) == gen0[8:].tolist() + gen1[:4].tolist()
    assert row_ids(w[2]) == gen1[4:].tolist()
    assert w[1].prompt_ids.shape[1] == 4  # generation 0's width 2 padded to generation 1's 4


def test_max_updates_stops_mid_round_and_buffers_the_rest():
    rnd = make_round(plan(4, 1))
    at, results = run_rounds(rnd, 1, max_updates=1)
    assert at.step == 1 and results[0].updates == 1 and len(at.buffer) == 3
    assert rnd.windows_buffered(at) == 3
    # No generation: what is buffered is trained on first.
    after, result = rnd(at, None, jax.random.key(9), max_updates=2)
    assert result.updates == 2 and result.scores is None and len(after.buffer) == 1
    assert len(rnd.rollout.generated) == 1 and result.num_tokens == 0
    assert (after.round, after.position, after.tokens_seen) == (at.round, at.position,
                                                                at.tokens_seen)
    assert len(at.buffer) == 3  # the run state taken is a value: unchanged


class StopAfter:
    """A stop request (round.Stop) that arrives after `updates` updates, or (`during_generation`)
    while the round generates: what checkpoint.StopSignal does with a signal."""

    def __init__(self, trainer, updates=None, during_generation=False):
        self.trainer, self.updates, self.during_generation = trainer, updates, during_generation

    def should_stop(self):
        return self.updates is not None and len(self.trainer.windows) >= self.updates

    def interruptible(self):
        import contextlib

        from grpo_jax.checkpoint import StopRun
        if self.during_generation:
            raise StopRun(15)
        return contextlib.nullcontext()


def test_stop_ends_the_updates_and_keeps_the_rest_buffered():
    """A stop between updates: the round returns after the update in progress, its other
    windows buffered (the checkpoint takes them), and the server is not synced."""
    rnd = make_round(plan(4, 1))
    synced = []
    rnd.rollout.update_weights = lambda weights, params: synced.append(weights)
    at, results = run_rounds(rnd, 1, stop=StopAfter(rnd.policy, updates=1))
    assert at.step == 1 and results[0].updates == 1 and rnd.windows_buffered(at) == 3
    assert synced == []
    # resumed: the buffered windows first, as after max_steps
    at, result = rnd(at, None, jax.random.key(9), stop=StopAfter(rnd.policy))
    assert result.updates == 3 and not at.buffer and len(synced) == 1


def test_stop_during_generation_drops_it_and_changes_nothing():
    from grpo_jax.checkpoint import StopRun
    rnd = make_round(plan(4, 1))
    at, _ = run_rounds(rnd, 1, max_updates=1)  # 3 windows left in the buffer
    with pytest.raises(StopRun):
        rnd(at, draw(rnd.plan, k=1), jax.random.key(1),
            stop=StopAfter(rnd.policy, during_generation=True))
    assert rnd.windows_buffered(at) == 3 and len(rnd.policy.windows) == 1


def test_generation_batch_is_shuffled_before_it_is_split():
    """TRL shuffles the generation batch, then splits it into steps_per_generation parts: a step
    does not see whole prompt groups in order. Seeded by the round's key (exact resume)."""
    rnd = make_round(plan(2, 1))
    run_rounds(rnd, 1)
    first, second = (row_ids(w) for w in rnd.policy.windows)
    assert first != list(range(MICRO)) and sorted(first + second) == list(range(2 * MICRO))
    groups = [first[i:i + G] for i in range(0, MICRO, G)]
    assert not all(gr == list(range(gr[0], gr[0] + G)) for gr in groups)
    np.testing.assert_array_equal(generation_order(jax.random.key(0), 64),
                                  generation_order(jax.random.key(0), 64))
    assert (generation_order(jax.random.key(0), 64) != generation_order(jax.random.key(1), 64)
            ).any()


@pytest.mark.parametrize("micro", [8, 2])
def test_split_by_groups_with_shared_prefix(micro):
    """numerics.shared_prefix: whole groups are shuffled (seeded by the round's key, like TRL's
    row shuffle), so a micro-batch holds whole groups (micro 8: 2 groups of 4) or a block of
    one (micro 2), each prompt in consecutive rows."""
    p = BatchPlan(data_parallel_size=1, micro_batch_size=micro, gradient_accumulation_steps=1,
                  steps_per_generation=16 // micro, generation_batch_size=16, num_generations=G,
                  num_iterations=1, pad_to_multiple_of=None)
    rnd = make_round(p)
    rnd.policy.shared_prefix = True
    run_rounds(rnd, 1)
    groups = generation_order(jax.random.key(0), 16 // G)
    want = (groups[:, None] * G + np.arange(G)).ravel().reshape(-1, micro).tolist()
    assert [row_ids(w) for w in rnd.policy.windows] == want
    assert groups.tolist() != list(range(16 // G))  # shuffled


def test_prompt_blocks_tell_same_text_with_other_images_apart():
    """Two groups of 2 rows with the same prompt text (squares' "how many red squares?")
    share a block of 4 only where their images are equal too: the shared prefix runs a
    block's first image for all its rows."""
    from grpo_jax.grpo.batch import Batch
    from grpo_jax.policy import prompt_blocks
    ids = np.tile(np.array([[0, 5, 9, 9, 7]], np.int32), (4, 1))
    rows = np.ones((4, 3), np.int32)
    pixels = np.repeat(np.arange(2, dtype=np.float32)[:, None, None], 2, axis=0) * np.ones(
        (4, 2, 3), np.float32)
    text = Batch(ids, (ids > 0).astype(np.int32), rows, rows, np.zeros(4, bool),
                 np.zeros(4, np.float32))
    assert prompt_blocks(text) == 4
    assert prompt_blocks(text.replace(pixel_values=pixels)) == 2
    assert prompt_blocks(text.replace(pixel_values=np.zeros_like(pixels))) == 4


def test_generations_with_different_numbers_of_images_stack():
    """Rows of two generations whose prompts' image blocks hold 1 and 2 images (Qwen-VL's
    patch rows: a (1, 2, 2) image's 4, a (1, 2, 4) image's 8) stack into one batch, the
    fewer padded with a blank and every image's patches to the most, as the trainer's windows
    (round.concat_rows) and dynamic sampling (ds.concat_rows) join them; the grids say which
    patches are real."""
    from grpo_jax import dynamic_sampling as ds
    from grpo_jax.round import concat_rows

    def rows(k, n=2, grid=(1, 2, 2)):
        ids = np.ones((n, 3), np.int32)
        patches = int(np.prod(grid))
        pixels = np.arange(n * k * patches * 5, dtype=np.float32).reshape(n, k, patches, 5) + 1
        grids = np.tile(np.asarray(grid, np.int32), (n, k, 1))
        return (Batch(ids, ids, ids, ids, np.zeros(n, bool), np.zeros(n, np.float32),
                      pixel_values=pixels, image_grid=grids),
                RolloutBatch(ids, ids, ids, ids, np.zeros(n, bool), np.zeros((n, 3), np.float32),
                             pixel_values=pixels, image_grid=grids))
    (b1, r1), (b2, r2) = rows(1), rows(2, grid=(1, 2, 4))
    for out in (concat_rows([b1, b2]), ds.concat_rows([r1, r2])):
        assert out.pixel_values.shape == (4, 2, 8, 5)
        np.testing.assert_array_equal(out.image_grid, [[[1, 2, 2], [0, 0, 0]]] * 2
                                      + [[[1, 2, 4]] * 2] * 2)
        np.testing.assert_array_equal(out.pixel_values[:2, :1, :4], b1.pixel_values)
        assert not out.pixel_values[:2, 1:].any() and not out.pixel_values[:2, :, 4:].any()
        np.testing.assert_array_equal(out.pixel_values[2:], b2.pixel_values)


def test_completions_cut_to_the_trainers_width_and_windows_padded_back():
    """A generation batch's completions are cut to the trainer's width (padding only; the
    M-RoPE positions and the routing record with them), and a window of micro-batches of two
    generations cut to different widths pads the narrower on the right, masked."""
    from grpo_jax.rollout.padding import trim_completions
    from grpo_jax.round import concat_rows
    n, p, c = 2, 3, 8
    mask = np.zeros((n, c), np.int32)
    mask[0, :5], mask[1, :2] = 1, 1
    ids = np.arange(n * c, dtype=np.int32).reshape(n, c) * mask
    r = RolloutBatch(np.ones((n, p), np.int32), np.ones((n, p), np.int32), ids, mask,
                     np.zeros(n, bool), mask * 0.5, versions=mask * 3,
                     completion_routing=np.where(mask[..., None, None] > 0, 1, -1),
                     positions=np.tile(np.arange(p + c), (n, 3, 1)))
    cut = trim_completions(r, 5)
    assert cut.completion_ids.shape == (n, 5) and cut.completion_routing.shape == (n, 5, 1, 1)
    assert cut.positions.shape == (n, 3, p + 5) and cut.versions.shape == (n, 5)
    np.testing.assert_array_equal(cut.completion_ids, ids[:, :5])
    with pytest.raises(ValueError, match="would cut completion tokens"):
        trim_completions(r, 4)

    def batch(b):
        return Batch(b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                     b.truncated, np.zeros(n, np.float32), sampler_logp=b.sampler_logp,
                     completion_routing=b.completion_routing, positions=b.positions)
    out = concat_rows([batch(cut), batch(r)])
    assert out.completion_ids.shape == (2 * n, c) and out.positions.shape == (2 * n, 3, p + c)
    np.testing.assert_array_equal(out.completion_ids[:n], ids)
    np.testing.assert_array_equal(out.completion_mask[:n], mask)
    assert (out.completion_routing[:n, 5:] == -1).all() and not out.sampler_logp[:n, 5:].any()


@pytest.mark.parametrize("spg,gas,ni,want", [
    (1, 1, 1, False), (2, 1, 1, True), (3, 2, 1, True), (1, 2, 1, False), (2, 4, 1, False),
    (2, 3, 1, True), (1, 2, 2, False), (1, 1, 2, True)])
def test_old_logps_follow_trl_rule(spg, gas, ni, want):
    """TRL: old log-probs when gradient_accumulation_steps % (spg * num_iterations) != 0."""
    p = plan(spg, gas, ni)
    rnd = make_round(p)
    run_rounds(rnd, 1)
    assert (rnd.policy.logps_calls > 0) == want
    assert p.needs_old_logps == want


def test_completion_metrics():
    batch = Batch(np.ones((4, 2), np.int32), np.ones((4, 2), np.int32),
                  np.ones((4, 5), np.int32),
                  (np.arange(5)[None] < np.array([[2], [5], [3], [4]])).astype(np.int32),
                  np.array([False, True, False, False]), np.zeros(4, np.float32))
    m = completion_metrics(batch)
    assert m["completions/min_terminated_length"] == 2
    assert m["completions/max_terminated_length"] == 4
    assert m["completions/mean_terminated_length"] == 3
    assert m["completions/max_length"] == 5
    none_done = batch.replace(truncated=np.ones(4, bool))
    assert completion_metrics(none_done)["completions/min_terminated_length"] == 0


def test_epoch_is_optimizer_progress_with_a_partial_last_window():
    """transformers: an epoch's micro-steps in windows of gas, the last one partial (75
    micro-steps, gas 2: 37 whole windows and one of 1, 38 updates); state.epoch after a step
    = epoch + micro-steps done in it / its micro-steps."""
    # 100 prompts, 4 per generation: 25 generations x 3 micro-steps x 1 = 75 micro-steps / epoch
    p = BatchPlan(1, 4, 2, 3, 12, 3, 1, None)
    assert p.micro_steps_per_epoch(100) == 75 and p.updates_per_epoch(100) == 38
    assert p.epoch(3, 100) == pytest.approx(6 / 75)
    assert p.epoch(37, 100) == pytest.approx(74 / 75)
    assert p.epoch(38, 100) == 1.0 and p.epoch(76, 100) == 2.0
    assert p.epoch(39, 100) == pytest.approx(1 + 2 / 75)
    two, one_and_half = BatchArgs(num_train_epochs=2.0), BatchArgs(num_train_epochs=1.5)
    assert (run_facts.total_steps(two, p, 100) == 76
            and run_facts.total_steps(one_and_half, p, 100) == 57)
    assert p.num_train_epochs(100, 57) == 2 and p.num_train_epochs(100, 76) == 2


def test_window_sizes_stop_at_the_epoch_end():
    assert window_sizes(5, 2) == [2, 2]
    assert window_sizes(5, 2, epoch_end=5) == [2, 2, 1]
    assert window_sizes(7, 2, epoch_end=3) == [2, 1, 2, 2]
    assert window_sizes(3, 4, epoch_end=3) == [3] and window_sizes(3, 4) == []


def test_the_round_that_ends_an_epoch_trains_a_partial_window():
    """No window spans two epochs: an epoch's last is partial when its micro-steps are not a
    multiple of gas, and is taken as that many micro-batches (transformers'
    current_gradient_accumulation_steps). spg 3, gas 4, epochs of 2 generations (6 micro-steps):
    windows of 4 and 2; gas 2, epochs of 1 generation: windows of 2 and 1."""
    rnd = make_round(plan(3, 4))
    at, results = run_rounds(rnd, 4, epoch_rounds=2)
    assert [r.updates for r in results] == [0, 2, 0, 2] and at.step == 4
    assert rnd.policy.micro_batches == [None, 2] * 2 and not at.buffer
    rnd = make_round(plan(3, 2))
    at, results = run_rounds(rnd, 4, epoch_rounds=1)
    assert [r.updates for r in results] == [2, 2, 2, 2] and at.step == 8
    assert rnd.policy.micro_batches == [None, 1] * 4 and not at.buffer
    assert [w.size for w in rnd.policy.windows] == [2 * MICRO, MICRO] * 4
    # Stopped before the partial window: it waits in the buffer, then is trained alone.
    rnd = make_round(plan(3, 2))
    at, (result,) = run_rounds(rnd, 1, max_updates=1, epoch_rounds=1)
    assert result.updates == 1 and rnd.windows_buffered(at) == 1 and at.epoch_end == 1
    at, result = rnd(at, None, jax.random.key(5))
    assert result.updates == 1 and rnd.policy.micro_batches[-1] == 1 and at.epoch_end == 0


def test_update_logged_is_trls_per_micro_batch_buffer():
    """A step's device metrics -> what TRL's buffer gets: each micro-batch's loss metrics, the
    step's loss once, grad_norm / learning_rate as read at the log, the skips counted; the
    PER_GENERATION metrics merged over each generation's micro-batches (block of 2 here)."""
    from grpo_jax.grpo.loss import GENERATION_SUMS
    sums = {"mean": {"sampling/sampling_logp_difference/mean":
                     np.array([[1.0, 2.0], [3.0, 2.0], [0.0, 0.0], [0.0, 0.0]])},
            "min": {"sampling/importance_sampling_ratio/min": np.array([0.5, 0.7, np.inf,
                                                                        np.inf])},
            "max": {}}
    got = update_logged({"loss": 1.5, "grad_norm": 2.0, "learning_rate": 1e-3,
                         "skipped_updates": 0, "kl": np.array([0.1, 0.3, 0.2, 0.4]),
                         GENERATION_SUMS: sums}, block=2)
    assert got.put == {"grad_norm": 2.0, "learning_rate": 1e-3}
    assert got.count == {"skipped_updates": 0}
    assert got.append["loss"] == [1.5] and got.append["kl"] == pytest.approx([0.1, 0.3, 0.2, 0.4])
    # generation 1: (1 + 3) / 4 tokens; generation 2 has no valid token: 0, as TRL logs
    assert got.append["sampling/sampling_logp_difference/mean"] == [1.0, 0.0]
    assert got.append["sampling/importance_sampling_ratio/min"] == [0.5, 0.0]
    assert "sampling/importance_sampling_ratio/min" not in update_logged(
        {"loss": 1.0, GENERATION_SUMS: sums}, block=None).append


@pytest.mark.slow
def test_logged_learning_rate_is_the_applied_one_after_a_skipped_update():
    """apply_if_finite leaves adamw's schedule count alone on a skipped update (transformers
    does not step its scheduler either): the logged rate must follow that count, not the step."""
    from grpo_jax import mesh as mesh_lib
    from grpo_jax.grpo.optimizer import OptimizerConfig, make_schedule
    from grpo_jax.grpo.train_step import StepConfig
    from grpo_jax.models import Decoder, ModelConfig
    from grpo_jax.policy import Policy

    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                      tie_word_embeddings=True).replace(dtype=jnp.float32)
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(1, 1, 1), jax.devices()[:1])
    optim = OptimizerConfig(learning_rate=1e-2, lr_scheduler_type="linear")
    step_cfg = StepConfig(loss=LossConfig(vllm_importance_sampling_correction=False),
                          temperature=1.0, gradient_accumulation_steps=1)
    rng = np.random.default_rng(0)
    good = Batch(rng.integers(0, 32, (4, 3)).astype(np.int32), np.ones((4, 3), np.int32),
                 rng.integers(0, 32, (4, 5)).astype(np.int32), np.ones((4, 5), np.int32),
                 np.zeros(4, bool), np.array([1.0, -1.0, 0.5, -0.5], np.float32))
    bad = good.replace(advantages=np.array([np.nan, 1, 1, 1], np.float32))
    schedule = make_schedule(optim, 10)

    skipped = Policy(Decoder(cfg, rngs=nnx.Rngs(0)), step_cfg, optim, 10, mesh)
    s, m0 = skipped.step(skipped.init_state, bad)
    s, m1 = skipped.step(s, good)
    fresh = Policy(Decoder(cfg, rngs=nnx.Rngs(0)), step_cfg, optim, 10, mesh)
    f, n0 = fresh.step(fresh.init_state, good)
    assert int(m0["skipped_updates"]) == 1 and int(s.step) == 2
    assert float(m1["learning_rate"]) == pytest.approx(float(schedule(0)))
    assert float(m1["learning_rate"]) == float(n0["learning_rate"])
    for a, b in zip(jax.tree.leaves(s.params), jax.tree.leaves(f.params)):  # applied the same
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class MixTrainer(StubTrainer):
    """Params are a number; the mix records (step reached, params, ref before) and mixes."""

    def __init__(self):
        super().__init__()
        self.mixes = []
        self.ref_seen = []  # params handed to logps: the reference (and old) of each generation
        self.steps_done = 0

    def step(self, state, batch):
        self.steps_done += 1
        return super().step(state, batch)

    def mix_ref(self, params, ref, alpha):
        self.mixes.append((self.steps_done, params, ref))
        return alpha * params + (1 - alpha) * ref

    def logps(self, params, batch, rows=None):
        self.ref_seen.append(params)
        return super().logps(params, batch, rows)


@pytest.mark.parametrize("spg,gas,start", [(3, 1, 0), (2, 2, 0), (1, 1, 5), (3, 2, 1)])
def test_ref_sync_after_every_step_reaching_a_multiple(spg, gas, start):
    """TRL's SyncRefModelCallback.on_step_end: after the optimizer step that makes global_step
    a multiple of ref_model_sync_steps, ref = alpha * policy + (1 - alpha) * ref, with the
    policy just updated; the count goes on from a resumed step. A generation's reference
    log-probs use the reference as it is when it is generated."""
    p = plan(spg, gas)
    rnd = make_round(p, trainer=MixTrainer(), sync_ref_model=True, ref_model_sync_steps=2,
                     ref_model_mixup_alpha=0.25)
    at = RunState(State(start, start), reference=100.0)  # params == step count in the stub
    ref, want_mixes, want_seen = 100.0, [], []
    for k in range(4):
        want_seen += [ref, at.state.params] if p.needs_old_logps else [ref]  # ref, then old
        after, _ = rnd(at, draw(p, k=k), jax.random.key(k))
        for s in range(at.step + 1, after.step + 1):
            if s % 2 == 0:
                want_mixes.append((s - start, s, ref))
                ref = 0.25 * s + 0.75 * ref
        at = after
    assert rnd.policy.mixes == want_mixes and len(want_mixes) >= 2
    assert at.reference == ref
    assert rnd.policy.ref_seen == want_seen


def test_ref_sync_needs_a_reference():
    p = plan(1, 1)
    rnd = make_round(p, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.6)
    with pytest.raises(ValueError, match="beta 0"):
        rnd(start(), draw(p), jax.random.key(0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mix_ref_is_trls_rule_on_the_params_shardings(dtype):
    """Policy.mix_ref = TRL's `ref.mul_(1 - alpha).add_(policy, alpha=alpha)` in the params'
    dtype, jitted on the params' shardings (an FSDP mesh here), the old reference donated."""
    torch = pytest.importorskip("torch")
    from grpo_jax import mesh as mesh_lib
    from grpo_jax.grpo.optimizer import OptimizerConfig
    from grpo_jax.grpo.train_step import StepConfig
    from grpo_jax.models import Decoder, ModelConfig
    from grpo_jax.policy import Policy

    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                      tie_word_embeddings=True).replace(dtype=jnp.float32)
    n = min(len(jax.devices()), 2)
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(1, n, 1), jax.devices()[:n])
    step_cfg = StepConfig(loss=LossConfig(vllm_importance_sampling_correction=False),
                          temperature=1.0, gradient_accumulation_steps=1)
    t = Policy(Decoder(cfg, rngs=nnx.Rngs(0)), step_cfg, OptimizerConfig(), 10, mesh)
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)  # noqa: E731
    params = cast(t.init_state.params)
    ref = cast(jax.tree.map(lambda x: x * 0.5 + 0.3, t.init_state.params))
    want_ref = {i: torch.tensor(np.asarray(x.astype(jnp.float32))).to(getattr(torch, dtype))
                for i, x in enumerate(jax.tree.leaves(ref))}
    old = jax.tree.leaves(ref)[0]
    mixed = t.mix_ref(params, ref, 0.6)
    for i, (p, m, s) in enumerate(zip(jax.tree.leaves(params), jax.tree.leaves(mixed),
                                      jax.tree.leaves(t.param_shardings))):
        assert m.dtype == p.dtype and m.sharding.is_equivalent_to(s, m.ndim)
        pt = torch.tensor(np.asarray(p.astype(jnp.float32))).to(getattr(torch, dtype))
        want = want_ref[i].mul_(1.0 - 0.6).add_(pt, alpha=0.6).float().numpy()
        got = np.asarray(m.astype(jnp.float32))
        # float32: to an ulp (torch may fuse the add into an FMA); bfloat16: one bf16 rounding
        tol = 1e-6 if dtype == "float32" else 2 ** -8
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert old.is_deleted()


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_round_uses_multi_objective_aggregation(aggregation):
    """The round's advantages (trained on and returned) and logged reward stats come from
    compute_advantages with its aggregation; `rewards` are the raw weighted sums either way."""
    from grpo_jax.grpo.advantages import combine_rewards, compute_advantages
    p = plan(2, 2)
    per_func = np.random.default_rng(0).standard_normal((MICRO * 2, 2)).astype(np.float32)
    per_func[3, 1] = np.nan
    rnd = make_round(p, score=lambda records, r: Scores(per_func), names=["a", "b"],
                     scale_rewards="batch", reward_funcs=("a", "b"), reward_weights=(1.0, 2.0),
                     multi_objective_aggregation=aggregation)
    _, (result,) = run_rounds(rnd, 1)
    _, want, stats = compute_advantages(per_func, G, "batch", [1.0, 2.0], aggregation)
    np.testing.assert_array_equal(result.advantages, want)
    np.testing.assert_array_equal(result.rewards, combine_rewards(per_func, [1.0, 2.0]))
    fed = np.concatenate([w.advantages for w in rnd.policy.windows])
    assert sorted(fed.tolist()) == sorted(want.tolist())
    for k, v in stats.items():
        assert result.metrics[k] == v


class LengthsRollout(StubRollout):
    """StubRollout whose row r has 1 + r % C completion tokens, and which records its keys."""

    def __init__(self):
        super().__init__()
        self.keys = []

    def generate(self, weights, prompts, g, key, records=None):
        self.keys.append(key)
        r = super().generate(weights, prompts, g, key)
        lengths = 1 + r.completion_ids[:, 0] % C
        mask = (np.arange(C)[None] < lengths[:, None]).astype(np.int32)
        r = r._replace(completion_mask=mask)
        self.generated[-1] = r
        return r


def signal_scorer(no_signal):
    """Rewards by the run's group number q (row // G): all 1.0 where no_signal(q), else 0 and 1
    by the row's parity (std > 0)."""
    def score(records, r):
        rows = r.completion_ids[:, 0]
        reward = np.where(no_signal(rows // G), 1.0, rows % 2)
        return Scores(reward[:, None].astype(np.float32))
    return score


def filling_round(no_signal, max_gen_batches=10, spg=4, scale="group"):
    p = plan(spg, 1)
    rnd = make_round(p, rollout=LengthsRollout(), score=signal_scorer(no_signal),
                     scale_rewards=scale, dynamic_sampling=True,
                     max_num_gen_batches=max_gen_batches)
    return rnd, Prompts(p)


class Prompts:
    """The data as dynamic sampling reads it: generation batches of prompts, each with the
    data position after it."""

    def __init__(self, p):
        self.p, self.read = p, 0

    def more(self):
        self.read += 1
        return Draw([{"prompt_ids": [1, 2]}] * self.p.prompts_per_generation,
                    DataPosition(0, self.read), more=self.more)

    def draw(self):
        return self.more()


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_dynamic_sampling_fills_the_batch_with_groups_with_signal(scale):
    """Groups 0, 4, 8, ... score alike: each generation of 4 groups keeps 3, so a batch takes
    two generations and the first 4 kept groups in order (verl drops the surplus). The update
    sees only those; their advantages, num_items (TRL's dapo normaliser) and the reward stats
    are the filled batch's; the first generation uses the round's key."""
    from grpo_jax.grpo.advantages import compute_advantages
    from grpo_jax.grpo.loss import num_items_per_row
    rnd, prompts = filling_round(lambda q: q % 4 == 0, scale=scale)
    at = start()
    for k, want_groups in enumerate([[1, 2, 3, 5], [9, 10, 11, 13]]):
        at, result = rnd(at, prompts.draw(), jax.random.key(k))
        assert at.position == DataPosition(0, 2 * k + 2)  # both generations' prompts read
        fed = np.concatenate([row_ids(w) for w in rnd.policy.windows[-4:]])
        assert sorted(set((fed // G).tolist())) == want_groups
        assert sorted(fed.tolist()) == [q * G + i for q in want_groups for i in range(G)]
        rows = np.array([q * G + i for q in want_groups for i in range(G)])
        kept = rnd.score(None, rnd.rollout.generated[0]._replace(
            completion_ids=np.repeat(rows[:, None], C, 1))).per_func
        _, want_adv, stats = compute_advantages(kept, G, scale)
        np.testing.assert_array_equal(result.advantages, want_adv)
        by_row = {int(r): a for w in rnd.policy.windows[-4:]
                  for r, a in zip(row_ids(w), w.advantages)}
        assert [by_row[int(r)] for r in rows] == want_adv.tolist()
        lengths = 1 + rows % C
        mask = (np.arange(C)[None] < lengths[:, None]).astype(np.int32)
        want_items = num_items_per_row(mask, np.zeros(rows.size, bool), rnd.policy.cfg.loss)
        for w in rnd.policy.windows[-4:]:
            np.testing.assert_array_equal(w.num_items, want_items[:w.size])
        assert result.metrics["frac_reward_zero_std"] == 0.0
        assert result.metrics["reward"] == stats["reward"]
        assert result.metrics["dynamic_sampling/num_gen_batches"] == 2
        assert result.metrics["dynamic_sampling/filtered_frac"] == 0.25
        assert result.num_tokens == int(rows.size + lengths.sum())  # 1 prompt token a row
    keys = [np.asarray(jax.random.key_data(k)) for k in rnd.rollout.keys]
    for k in range(2):
        np.testing.assert_array_equal(keys[2 * k], jax.random.key_data(jax.random.key(k)))
        np.testing.assert_array_equal(
            keys[2 * k + 1], jax.random.key_data(jax.random.fold_in(jax.random.key(k), 1)))
    if scale == "group":  # a group's advantages are its own: as in its generation, unfiltered
        gen0 = rnd.score(None, rnd.rollout.generated[0]).per_func
        _, adv0, _ = compute_advantages(gen0, G, "group")
        np.testing.assert_array_equal(adv0[4:16], compute_advantages(
            gen0[4:16], G, "group")[1])


def test_dynamic_sampling_with_signal_everywhere_is_the_plain_round():
    a, prompts = filling_round(lambda q: np.zeros_like(q, bool))
    b = make_round(a.plan, rollout=LengthsRollout(), score=a.score)
    for k in range(2):
        _, ra = a(start(k), prompts.draw(), jax.random.key(k))
        _, rb = b(start(k), draw(a.plan, k=k), jax.random.key(k))
        assert ra.metrics["dynamic_sampling/num_gen_batches"] == 1
        np.testing.assert_array_equal(ra.advantages, rb.advantages)
    for wa, wb in zip(a.policy.windows, b.policy.windows, strict=True):
        assert jax.tree.all(jax.tree.map(np.array_equal, wa, wb))


def test_dynamic_sampling_gives_up_after_max_num_gen_batches():
    from grpo_jax.dynamic_sampling import NoSignalError
    rnd, prompts = filling_round(lambda q: np.ones_like(q, bool), max_gen_batches=3)
    with pytest.raises(NoSignalError, match="3 generation batches .* gave 0 of the 4 prompt "
                       "groups .* the reward gives no signal"):
        rnd(start(), prompts.draw(), jax.random.key(0))
    assert len(rnd.rollout.generated) == 3 and not rnd.policy.windows
    # 0: no limit (verl's). Groups 0-19 (five generations) have none, the sixth fills it.
    rnd, prompts = filling_round(lambda q: q < 20, max_gen_batches=0)
    _, result = rnd(start(), prompts.draw(), jax.random.key(0))
    assert result.metrics["dynamic_sampling/num_gen_batches"] == 6
    assert result.metrics["dynamic_sampling/filtered_frac"] == 20 / 24


def test_dynamic_sampling_stopped_mid_fill_changes_nothing():
    """draw.more() None (a stop signal): the round returns with nothing trained, buffered or
    counted, so the checkpoint's data position is the batch's start."""
    rnd, prompts = filling_round(lambda q: q % 2 == 0)
    at = start(3)
    after, result = rnd(at, prompts.draw()._replace(more=lambda: None), jax.random.key(0))
    assert after is at and result.scores is None and result.updates == 0
    assert result.num_tokens == 0 and not after.buffer and not rnd.policy.windows
    assert len(rnd.rollout.generated) == 1


class Rows:
    """A dataset as train.Draws reads it, in row order: prompt i is [i + 1]."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def batch_rows(self, position, k):
        epoch, index = position
        if index + k > self.n:
            epoch, index = epoch + 1, 0
        return list(range(index, index + k)), DataPosition(epoch, index + k)

    def record(self, i):
        return {"prompt_ids": [i + 1]}

    def ends_epoch(self, position, k):
        return position.index + k > self.n


class PromptRollout(StubRollout):
    """Prompt [i + 1]'s completions are rows i * G ... i * G + G - 1, whichever call (or
    thread) generates them; each call's dataset rows and key are recorded."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def generate(self, weights, prompts, g, key, records=None):
        data_rows = [p[0] - 1 for p in prompts]
        self.calls.append((data_rows, key))
        ids = (np.repeat(data_rows, g) * g + np.tile(np.arange(g), len(prompts))).astype(np.int32)
        n = ids.size
        p_ids = np.stack([np.zeros(n, np.int32), ids], 1)
        return RolloutBatch(p_ids, np.ones((n, 2), np.int32), np.repeat(ids[:, None], C, 1),
                            np.ones((n, C), np.int32), np.zeros(n, bool),
                            np.zeros((n, C), np.float32))


def test_dynamic_sampling_fills_from_batches_generated_ahead():
    """Async rounds (AsyncRollout) with dynamic sampling, the prompts drawn by train.Draws: each
    batch drawn starts the next one's generation, keyed by its data position, so a fill that
    needs more takes it under way and the next round starts where this one stopped reading. Each
    data batch is generated once, in data order; a round's first batch is one version old, the
    rest of its fill current; the engine mismatch scores each part with its own version."""
    from grpo_jax import dynamic_sampling as ds
    from grpo_jax.round import NeverStop
    from grpo_jax.rollout.async_rounds import AsyncRollout
    from grpo_jax.train import Draws
    p = plan(4, 1)  # 4 prompts a generation, 4 updates a round
    inner = PromptRollout()
    rollout = AsyncRollout(inner, max_staleness=1, ahead=inner)  # one process: itself
    # Groups without signal: batch 0 keeps 3 (and batch 1 fills it, its last 3 dropped), batch 2
    # fills at once, batches 3-5 keep 1, 2 and 4.
    rnd = make_round(p, rollout=rollout, score=signal_scorer(lambda q: np.isin(
        q, [0, 12, 13, 14, 16, 17])), dynamic_sampling=True)
    base = jax.random.key(7)
    draws = Draws(Rows(64), p, 1, NeverStop(), rollout.prefetch, base)
    at = start()
    rnd.sync_weights(at.state.params)  # version 1: params 0
    want = [([1, 2, 3, 4], 8, 2, 0.0), ([8, 9, 10, 11], 12, 1, 1.0),
            ([15, 18, 19, 20], 24, 3, 1.0)]
    for groups, position, gens, staleness in want:
        at, result = rnd(at, draws.draw(at.position), jax.random.fold_in(base, at.round))
        fed = np.concatenate([row_ids(w) for w in rnd.policy.windows[-4:]])
        assert sorted(fed.tolist()) == [q * G + i for q in groups for i in range(G)]
        assert at.position == DataPosition(0, position)
        assert result.metrics["dynamic_sampling/num_gen_batches"] == gens
        sync = rollout.sync_metrics  # (the stub's push takes no time: not in the round's)
        assert sync["async/staleness"] == staleness
        assert sync["async/discarded"] == 0 and len(rollout.pending) == 1
    # Round 3's rows: 4 of batch 3 on version 2 (params 4), 12 of batches 4-5 on version 3 (8).
    assert result.metrics["sampling/engine_logp_difference/mean"] == (4 * 4 + 12 * 8) / 16
    calls = sorted(rollout.inner.calls, key=lambda c: c[0])  # round 0's first two ran at once
    assert [c[0] for c in calls] == [list(range(4 * b, 4 * b + 4)) for b in range(7)]
    for b, (_, key) in enumerate(calls):
        np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(
            ds.key_at(base, DataPosition(0, 4 * b))))
    # Drawn elsewhere (the run asked for other prompts): batch 6, prefetched, is dropped.
    rnd(at, draws.draw(DataPosition(0, 28)), jax.random.fold_in(base, at.round))
    assert rollout.discarded == 1 and len(rollout.pending) == 1
