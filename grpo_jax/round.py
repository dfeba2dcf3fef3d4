"""One GRPO round (`GRPORound`), shared by `train`, `evaluation` and `bench e2e`.

A round: generate -> score -> advantages -> reference / old log-probs -> optimizer updates ->
new weights to the sampler. The host never waits inside the update loop: the step metrics are
fetched once, after the round's last update, and handed on per update as TRL logs them
(grpo_jax.metrics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, ContextManager, NamedTuple, Protocol, Sequence

import jax
import numpy as np

from grpo_jax import dynamic_sampling as ds
from grpo_jax import image_blocks
from grpo_jax import mesh as mesh_lib
from grpo_jax import run_facts
from grpo_jax.grpo import advantages as adv_lib
from grpo_jax.grpo import loss as loss_lib
from grpo_jax.grpo.batch import Batch
from grpo_jax.config.grpo import GRPOArgs
from grpo_jax.data import DataPosition
from grpo_jax.metrics import Logged, timing
from grpo_jax.models import moe
from grpo_jax.policy import Policy
from grpo_jax.rollout import padding
from grpo_jax.rollout.base import Rollout, WeightMode
from grpo_jax.rollout.native.disaggregated import Split
from grpo_jax.rollout.native.partial import staleness_metrics
from grpo_jax.run_state import RunState
from grpo_jax.scoring import Scores
from grpo_jax.shapes import completion_width




class Stop(Protocol):
    """A run's stop request (checkpoint.StopSignal): polled between updates; a stop inside
    `interruptible()` aborts the block at once (StopRun)."""

    def should_stop(self) -> bool: ...

    def interruptible(self) -> ContextManager: ...


class NeverStop:
    def should_stop(self) -> bool:
        return False

    def interruptible(self) -> ContextManager:
        return contextlib.nullcontext()


class RoundResult(NamedTuple):
    """What a round did (its new RunState is returned beside it)."""
    metrics: dict  # the generation's (TRL logs them once per generation) and the round's timing
    scores: Scores | None  # None (and rewards, advantages): the call generated nothing
    rewards: np.ndarray | None
    advantages: np.ndarray | None
    updates: int = 0  # optimizer steps this call took
    num_tokens: int = 0  # prompt + completion tokens generated this round (TRL's count)
    step_metrics: tuple[Logged, ...] = ()  # each update's, as TRL logs them (update_logged)


class Generated(NamedTuple):
    """A scored generation batch (GRPORound.generate_and_score)."""
    batch: Batch
    scores: Scores
    rewards: np.ndarray  # [N] weighted sums (NaN: unscorable)
    advantages: np.ndarray  # [N]
    metrics: dict
    # (rows, trainer params that generated them) of the batch's rows in order, when a filled
    # batch's generations come from different weight versions (async rounds); () : one call's
    # (Rollout.generated_with).
    made_with: tuple = ()


def generation_order(key, n: int) -> np.ndarray:
    """The row order a generation batch is split into micro-batches in (TRL shuffles the batch
    before splitting it into steps_per_generation parts): a permutation seeded by the round's
    key, so a resumed run draws the same one."""
    words = np.asarray(jax.random.key_data(key), np.uint32).ravel().tolist()
    return np.random.default_rng([*words, 0x5348554646]).permutation(n)  # tag: "SHUFF"


# Batch's fields laid out [N, C, ...] over the completion's positions, with their padding.
_COMPLETION_PAD = {"completion_ids": 0, "completion_mask": 0, "old_logp": 0, "ref_logp": 0,
                   "sampler_logp": 0, "tool_mask": 1, "completion_routing": -1,
                   "completion_images": False}


def concat_rows(parts: Sequence[Batch]) -> Batch:
    """One batch of `parts`' rows in order. Parts from different generations may have prompts
    and completions padded to different widths (shapes.completion_width): the narrower are
    padded (masked) to the widest, prompts on the left, completions on the right."""
    width = max(p.prompt_ids.shape[1] for p in parts)
    long = max(p.completion_ids.shape[1] for p in parts)

    def widen(p: Batch) -> Batch:
        more = long - p.completion_ids.shape[1]
        if more:
            pad = {f: np.pad(v, ((0, 0), (0, more)) + ((0, 0),) * (v.ndim - 2),
                             constant_values=_COMPLETION_PAD[f])
                   for f in _COMPLETION_PAD if (v := getattr(p, f)) is not None}
            if p.positions is not None:  # M-RoPE [N, 3, P + C]: padding's are 0
                pad["positions"] = np.pad(p.positions, ((0, 0), (0, 0), (0, more)))
            p = p.replace(**pad)
        extra = width - p.prompt_ids.shape[1]
        if not extra:
            return p
        pad = lambda x, fill=0: np.pad(  # noqa: E731
            x, ((0, 0), (extra, 0)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)
        routing = None if p.prompt_routing is None else pad(p.prompt_routing, -1)
        # M-RoPE positions [N, 3, P + C]: the padding's are 0, as rope_index's.
        positions = (None if p.positions is None else np.pad(
            p.positions, ((0, 0), (0, 0), (extra, 0))))
        return p.replace(prompt_ids=pad(p.prompt_ids), prompt_mask=pad(p.prompt_mask),
                         prompt_routing=routing, positions=positions)
    if len(parts) == 1:
        return parts[0]
    if parts[0].pixel_values is not None:  # image blocks padded to the most per prompt
        blocks = image_blocks.common([(p.pixel_values, p.image_grid) for p in parts])
        parts = [p.replace(pixel_values=v, image_grid=g) for p, (v, g) in zip(parts, blocks)]
    return jax.tree.map(lambda *xs: np.concatenate(xs), *map(widen, parts))


class Draw(NamedTuple):
    """A generation's prompts as the data gives them: `records`, the data position after them,
    whether they are the last of their epoch and, with dynamic sampling, `more()`: the next
    prompts (a Draw) while the batch fills, or None to stop. With partial
    rollouts the records are the new groups' prompts, which join the rows in flight. `key`:
    the generation's sampling key when it is not the round's (async rounds with dynamic
    sampling: dynamic_sampling.key_at its data position, which the prefetch used too)."""
    records: Sequence[dict]
    after: DataPosition
    ends_epoch: bool = False
    more: Callable[[], "Draw | None"] | None = None
    rows: Sequence[int] = ()  # the records' dataset rows (partial rollouts checkpoint them)
    key: Any = None


@dataclasses.dataclass(frozen=True)
class GRPORound:
    """One round's wiring: `round(run_state, draw, key) -> (run_state, result)`. `score(records,
    rollout_batch) -> Scores`; `reward_names` name its columns in the metrics; `plan` is the
    config's BatchPlan; `args` the config's grpo section (GRPOArgs), whole: scale_rewards,
    reward_weights, multi_objective_aggregation, sync_ref_model, dynamic_sampling.

    With sync_ref_model, after every optimizer step that brings the step count to a multiple of
    ref_model_sync_steps, reference = alpha * params + (1 - alpha) * reference (TRL's
    SyncRefModelCallback.on_step_end). The reference log-probs of a generation batch are taken
    when it is generated, so a sync shows from the next generation on (as TRL).

    TRL's generation buffer: a round generates one generation batch, shuffles its rows and
    splits them into steps_per_generation micro-batches (num_iterations times over), appended to
    the run state's `buffer`; then every whole window of gradient_accumulation_steps
    micro-batches in the buffer is one optimizer update. A window may span two generations: the
    micro-batches left over stay in the buffer for the next round (and in a checkpoint). A draw
    that ends an epoch sets `epoch_end`: the window reaching it stops there, a partial one when
    the epoch's micro-steps are not a multiple of gradient_accumulation_steps (transformers'
    last window of an epoch; window_sizes).

    dynamic_sampling (DAPO; grpo_jax.dynamic_sampling): the generation batch keeps only groups
    whose rewards differ, generating from `draw.more()` until it holds prompts_per_generation
    of them (at most max_num_gen_batches generations; <= 0: no limit).

    `stop`: a stop request aborts the generation (nothing of it is kept: the run state's data
    position stays) or ends the updates after the current one (the windows left stay
    buffered); either way the run state returned is whole, so a checkpoint of it resumes
    exactly. A round that fails returns nothing: its caller's run state is the last whole one
    (its buffers may be donated to a step that failed: no checkpoint after a failure)."""
    policy: Policy
    rollout: Rollout
    plan: Any
    score: Callable[[Sequence[dict], Any], Scores]
    reward_names: Sequence[str]
    args: GRPOArgs
    # sampler_devices: partial rollouts on a sampler mesh of their own, a round ahead
    # (rollout/native/disaggregated.py Split); None: the sampler and trainer take turns.
    split_rollouts: Split | None = None

    @property
    def ref_sync(self) -> tuple[int, float] | None:
        a = self.args
        return (a.ref_model_sync_steps, a.ref_model_mixup_alpha) if a.sync_ref_model else None

    def windows_buffered(self, at: RunState) -> int:
        """Update windows already in `at`'s buffer: when > 0 (a run that stopped at max_steps
        mid-round), TRL trains on them before it generates again (pass draw=None)."""
        return len(window_sizes(len(at.buffer), self.plan.gradient_accumulation_steps,
                                at.epoch_end))

    def __call__(self, at: RunState, draw: Draw | None, key, *, max_updates: int | None = None,
                 stop: Stop | None = None) -> tuple[RunState, RoundResult]:
        """Generate one batch from `draw` (None: no generation), then update on every window in
        the buffer, at most `max_updates` times (None: no limit). A stop while dynamic sampling
        fills the batch returns at once, with nothing generated or trained."""
        plan, policy, stop = self.plan, self.policy, stop or NeverStop()
        if self.ref_sync is not None and at.reference is None:
            raise ValueError("sync_ref_model needs a reference model: with beta 0 there is "
                             "none to synchronize")
        metrics: dict = {}
        buffer, scores, rewards, advantages, num_tokens = list(at.buffer), None, None, None, 0
        epoch_end, position, rounds = at.epoch_end, at.position, at.round
        rows_in_flight, queued = at.rows_in_flight, at.queued
        if draw is not None:
            weights = self.rollout_weights(at.state.params)
            # changes nothing yet: a stop drops the generation (a split run's only starts the
            # sampler's next advance, at once: no stop inside it)
            with (contextlib.nullcontext() if self.split_rollouts is not None
                  else stop.interruptible()):
                if self.split_rollouts is not None:  # the next advance runs beside the update
                    gen, after = self.generate_split(weights, at, draw, key)
                    queued = None  # the next batch's, until settle() collects it
                elif self.rollout.partial is not None:
                    gen, rows_in_flight, after = self.generate_partial(weights, at, draw, key)
                elif not self.args.dynamic_sampling:
                    gen, after = self.generate_and_score(weights, draw.records, key,
                                                         reference=at.reference), draw.after
                else:
                    gen, after = self.generate_filled(weights, draw, key, at.reference)
            if gen is None:
                return at, RoundResult({}, None, None, None)
            batch, scores, rewards, advantages = gen.batch, gen.scores, gen.rewards, gen.advantages
            metrics.update(gen.metrics)
            t1 = time.perf_counter()
            metrics.update(self.engine_mismatch(batch, gen.made_with))
            if plan.needs_old_logps:
                old, mismatch = policy.logps_and_mismatch(at.state.params, batch,
                                                          plan.micro_batch_size)
                batch = batch.replace(old_logp=old)
                if batch.sampler_logp is not None:  # over the generation batch, as TRL
                    metrics.update(self.sampling_metrics(batch))
                if mismatch is not None:  # under the weights that sampled the batch
                    metrics[moe.ROUTER_MISMATCH] = mismatch
                if not policy.replays_routing:
                    # Measured: the updates need the record only to replay it.
                    batch = batch.replace(prompt_routing=None, completion_routing=None)
            metrics[timing("logprobs")] += time.perf_counter() - t1
            buffer = buffer + self.split(batch, key) * plan.num_iterations
            if draw.ends_epoch:
                epoch_end = len(buffer)
            num_tokens = int(batch.prompt_mask.sum() + batch.model_mask().sum())
            position, rounds = after, rounds + 1
        t3 = time.perf_counter()

        gas = plan.gradient_accumulation_steps
        sizes = window_sizes(len(buffer), gas, epoch_end)
        if max_updates is not None:
            sizes = sizes[:max(max_updates, 0)]
        n, bounds = len(sizes), np.cumsum([0, *sizes]).tolist()
        # Windows are assembled before the first dispatch: the loop below only enqueues work.
        windows = [concat_rows(buffer[a:b]) for a, b in zip(bounds, bounds[1:])]
        step_metrics, ref, state = [], at.reference, at.state
        # The step count on the host (read once; each update adds 1, a skipped one too).
        step = int(state.step) if self.ref_sync is not None and n else 0
        for window, size in zip(windows, sizes):
            if stop.should_stop():  # the windows left stay buffered (and checkpointed)
                break
            state, m = (policy.step(state, window) if size == gas
                        else policy.step(state, window, micro_batches=size))
            step_metrics.append(m)
            step += 1
            if self.ref_sync is not None and step % self.ref_sync[0] == 0:
                ref = policy.mix_ref(state.params, ref, self.ref_sync[1])
        n, done = len(step_metrics), bounds[len(step_metrics)]
        # Without old log-probs a generation's micro-batches are all in one window: its
        # PER_GENERATION metrics come from the step (else from sampling_metrics, above).
        block = None if plan.needs_old_logps else plan.steps_per_generation * plan.num_iterations
        logged = tuple(update_logged(m, block) for m in jax.device_get(step_metrics))
        after_round = at.replace(state=state, position=position, round=rounds,
                                 tokens_seen=at.tokens_seen + num_tokens,
                                 buffer=tuple(buffer[done:]), epoch_end=max(epoch_end - done, 0),
                                 reference=ref, rows_in_flight=rows_in_flight, queued=queued)
        t4 = time.perf_counter()
        stopping = stop.should_stop()  # the server's weights won't be used again
        # (The JAX sampler's async rounds keep the version even so: a copy, for the checkpoint.)
        sync_time = (self.sync_weights(state.params)
                     if n and (not stopping or not self.rollout.weight_mode.pushed) else None)

        metrics.setdefault(timing("generate"), 0.0)
        metrics.setdefault(timing("logprobs"), 0.0)  # reference and old log-probs
        metrics[timing("update")] = t4 - t3
        if (self.rollout.partial is not None and draw is not None
                and self.split_rollouts is None):
            # One set of devices: the sampler waits while the trainer works, and the reverse.
            metrics[timing("idle_sampler")] = t4 - t1
            metrics[timing("idle_trainer")] = metrics[timing("generate")]
        if n and self.rollout.generates_ahead:  # wall clock, to line the update up with the
            # generation of the next round beside it (grpo_jax.rollout.async_rounds)
            metrics["timeline/update_start"] = time.time() - (time.perf_counter() - t3)
            metrics["timeline/update_end"] = metrics["timeline/update_start"] + t4 - t3
        if sync_time is not None:
            metrics[timing("weight_sync")] = sync_time
            metrics.update(self.rollout.sync_metrics)  # bytes/s, ...
        return after_round, RoundResult(metrics, scores, rewards, advantages, n, num_tokens,
                                        logged)

    def sampling_metrics(self, batch: Batch) -> dict:
        """TRL's sampling/* metrics of a generation batch with old log-probs: |old - sampler|
        and the importance weight over all its tokens; with rollout_rs, its rejection
        fractions (loss.PER_GENERATION)."""
        lc = self.policy.cfg.loss
        m = loss_lib.loss_mask(batch.model_mask(), batch.truncated, lc)
        w = loss_lib.sampler_is_weight(batch.old_logp, batch.sampler_logp, m, lc)
        keep = (None if lc.rollout_rs is None
                else loss_lib.rollout_rs_mask(batch.old_logp, batch.sampler_logp, m, lc))
        sums = jax.device_get(loss_lib.sampling_metric_sums(batch.old_logp, batch.sampler_logp,
                                                             w, m, keep))
        per_gen = loss_lib.per_generation_metrics(jax.tree.map(lambda x: x[None], sums), 1)
        return {k: v[0] for k, v in per_gen.items()}

    def weights_for(self, params, mode: WeightMode):
        """The trainer's params in the form `mode` names: the full model's params (with LoRA,
        the adapters merged in: one fused program) or the pair (LoRA adapters, frozen base).
        Without LoRA both are the params themselves."""
        form = run_facts.sampler_weights(mode, self.policy.lora_scale is not None)
        if form == run_facts.ADAPTERS_AND_BASE:
            return params, self.policy.frozen[0]
        return self.policy.rollout_params(params)

    def rollout_weights(self, params):
        """What rollout.generate reads, made once for every generate of a round: None for a
        rollout that holds its own weights (they come from sync_weights)."""
        mode = self.rollout.weight_mode
        return None if mode.pushed else self.weights_for(params, mode)

    def sync_weights(self, params) -> float | None:
        """Push `params` in the rollout's form to a rollout that holds its own weights, a vLLM
        server, or to async rounds; the seconds it took. None for the JAX sampler otherwise: it
        reads them at generate."""
        mode = self.rollout.weight_mode
        if not mode.pushed and not self.rollout.generates_ahead:
            return None
        # Async rounds on the JAX sampler: the version's weights kept for the next round's
        # generation (rollout/async_rounds.py), the seconds the copies took.
        return self.rollout.update_weights(self.weights_for(params, mode), params)

    def engine_mismatch(self, batch: Batch, made_with: Sequence = ()) -> dict:
        """Async rounds: the sampler's log-probs against the trainer's under the weights that
        generated the batch (a one-version-old batch's: rollout.generated_with), so the
        engines' numerical mismatch alone; TRL's sampling/sampling_logp_difference compares
        with the current weights and so also holds the policy change of the updates between.
        `made_with`: (rows, params) in row order when the batch's generations differ (a filled
        batch's): each part is scored with its own version's params."""
        made_with = made_with or [(batch.size, self.rollout.generated_with())]
        if batch.sampler_logp is None:
            return {}
        diff = np.full(batch.completion_ids.shape, np.nan, np.float32)
        logps, start = {}, 0  # per version: one forward over the batch, its rows taken
        for n, params in made_with:
            rows, start = slice(start, start + n), start + n
            if params is None or not n:
                continue
            if id(params) not in logps:
                logps[id(params)] = self.policy.logps(params, batch, self.plan.micro_batch_size)
            diff[rows] = np.abs(logps[id(params)][rows] - batch.sampler_logp[rows])
        valid = (batch.model_mask() > 0) & np.isfinite(diff)
        if not valid.any():
            return {}
        name = "sampling/engine_logp_difference/"
        return {name + "mean": float(diff[valid].mean()), name + "max": float(diff[valid].max())}

    def generate_and_score(self, weights, records: Sequence[dict], key, *, reference=None,
                           num_generations: int | None = None,
                           score: Callable | None = None) -> Generated:
        """Generate `num_generations` (default: the plan's) completions per record with
        `weights` (rollout_weights of the params), score them (`score`, default: the round's),
        and make their training batch: advantages, TRL's num_items and, with a `reference`
        (RunState.reference), the reference log-probs. The metrics are TRL's per generation
        batch, with timing/generate and timing/logprobs."""
        g = num_generations or self.plan.num_generations
        r, scores, took, wall = self._generate_scored(weights, records, key, g, score)
        return self._training_batch(r, scores, g, took, wall, reference)

    def generate_partial(self, weights, at: RunState, draw: Draw, key):
        """Partial rollouts (rollout/native/partial.py): `draw`'s groups join the rows in
        flight, and the sampler decodes until a generation batch of whole groups is done: its
        training batch (as generate_and_score's) with staleness/* metrics (versions: rounds),
        the rows left in flight and the data position after the prompts read. With dynamic
        sampling, groups without reward signal are
        dropped and the sampler goes on, `draw.more()`'s prompts filling the group slots each
        pass empties, until the batch is full (as generate_filled). (None, rows in flight) when
        draw.more() returns None first: the round is dropped, the run state's rows stay."""
        # (Generated | None, InFlight, DataPosition)
        g, partial, a = self.plan.num_generations, self.rollout.partial, self.args
        filled = ds.Filled(self.plan.prompts_per_generation, g) if a.dynamic_sampling else None
        in_flight, dropped, took, more = at.rows_in_flight, 0, 0.0, draw.more
        while True:
            t0 = time.perf_counter()
            done = partial.advance(weights, in_flight, draw.records, draw.rows, at.round, key)
            took, wall = took + time.perf_counter() - t0, time.time()
            in_flight, dropped = done.in_flight, dropped + done.dropped
            scores = self.score(done.records, done.rollout)
            if filled is None:
                r = done.rollout
                break
            filled.add(done.rollout, scores, a.reward_weights)
            if filled.full:
                r, scores = filled.batch()
                break
            if 0 < a.max_num_gen_batches <= filled.generations:
                raise filled.no_signal()
            draw = more()
            if draw is None:
                return None, at.rows_in_flight, at.position
        gen = self._training_batch(r, scores, g, took, wall, at.reference)
        gen.metrics.update(staleness_metrics(r.versions, gen.batch.model_mask(), at.round,
                                             partial.max_staleness))
        gen.metrics["staleness/dropped_groups"] = float(dropped)
        if filled is not None:
            gen.metrics.update(filled.metrics())
        return gen, in_flight, draw.after

    def generate_split(self, weights, at: RunState, draw: Draw, key
                       ) -> tuple[Generated | None, DataPosition]:
        """Disaggregated rounds (rollout/native/disaggregated.py): the training batch of the
        groups the sampler finished a round ahead (`at.queued`), and the sampler started on the
        next round's with `weights` (version at.round) and `draw`'s new groups; with the data
        position after the prompts read.

        With dynamic sampling the queued groups without reward signal are dropped and, while
        the batch is not full, the sampler's next advance runs now (the trainer waits for it:
        `draw`'s groups join the rows in flight, decoded with the current weights), its groups
        filtered in turn, `draw.more()`'s prompts filling the slots each advance empties; once
        full, the advance with the next prompts runs beside the update as without it. So each
        prompt read is generated once, in data order, and the surplus groups with signal are
        dropped as generate_filled's. (None, the position) when draw.more() returns None first:
        nothing of the round is kept, the run state's queued batch and rows in flight stay (a
        resume regenerates the same advances: same weights, keys and rows)."""
        q, split, a = at.queued, self.split_rollouts, self.args
        if q is None:
            raise ValueError("sampler_devices: nothing sampled ahead; settle() and prime() the "
                             "run state before the round")
        g = self.plan.num_generations
        scores = self.score(q.records, q.rollout)
        filled = ds.Filled(self.plan.prompts_per_generation, g) if a.dynamic_sampling else None
        in_flight, took, waited, dropped = at.rows_in_flight, q.took, q.waited, q.dropped
        more = draw.more  # the draws it returns have none of their own
        if filled is not None:
            filled.add(q.rollout, scores, a.reward_weights)
        while filled is not None and not filled.full:
            if 0 < a.max_num_gen_batches <= filled.generations:
                raise filled.no_signal()
            # The advance that would have run beside the update runs now, with this round's
            # weights: its tokens train as version at.round (staleness 0).
            split.start(weights, in_flight, draw.records, draw.rows, at.round,
                        ds.key_for(key, filled.generations))
            done = split.collect()
            in_flight, d = done.in_flight, done.queued
            took, waited, dropped = took + d.took, waited + d.waited, dropped + d.dropped
            filled.add(d.rollout, self.score(d.records, d.rollout), a.reward_weights)
            draw = more()
            if draw is None:
                return None, at.position
        idle = split.start(weights, in_flight, draw.records, draw.rows, at.round,
                           key if filled is None else ds.key_for(key, filled.generations))
        r = q.rollout
        if filled is not None:
            r, scores = filled.batch()
        gen = self._training_batch(r, scores, g, took, time.time(), at.reference)
        gen.metrics.update(staleness_metrics(r.versions, gen.batch.model_mask(), at.round,
                                             split.max_staleness))
        gen.metrics["staleness/dropped_groups"] = float(dropped)
        if filled is not None:
            gen.metrics.update(filled.metrics())
        # Measured: the sampler waiting for weights, the trainer waiting for the sampler.
        gen.metrics[timing("idle_sampler")] = idle
        gen.metrics[timing("idle_trainer")] = waited
        return gen, draw.after

    def settle(self, at: RunState) -> RunState:
        """`at` whole with sampler_devices: the sampler's running advance collected (waiting
        for it) into rows_in_flight and queued, as a checkpoint and the next round need it."""
        if self.split_rollouts is None or not self.split_rollouts.running:
            return at
        done = self.split_rollouts.collect()
        if at.queued is not None:  # started by a round that failed: `at` is from before it
            return at
        return at.replace(rows_in_flight=done.in_flight, queued=done.queued)

    def prime(self, at: RunState, draw: Draw, key) -> RunState:
        """A split run's first batch, sampled with the current weights before the first round
        (later ones are sampled a round ahead, beside the update)."""
        self.split_rollouts.start(self.rollout_weights(at.state.params), at.rows_in_flight,
                                  draw.records, draw.rows, at.round, key)
        return self.settle(at).replace(position=draw.after)

    def generate_filled(self, weights, draw: Draw, key, reference
                        ) -> tuple[Generated | None, DataPosition]:
        """generate_and_score with DAPO's dynamic sampling: generations from `draw.records`,
        then from `draw.more()`, keep their groups with reward std > 0 until the batch holds
        prompts_per_generation of them; its advantages, num_items and reference log-probs are
        the filled batch's (with scale_rewards group or none a group's advantages are its own,
        which filtering leaves as they were; batch scales by the filled batch's std); with the
        data position after the last prompts read. None when draw.more() returns None (a stop,
        or the run's data used up) before the batch is full; NoSignalError after
        max_num_gen_batches generations that did not fill it. A draw's own `key` (async rounds:
        the one its prefetch used) replaces the round's for its generation."""
        g, limit = self.plan.num_generations, self.args.max_num_gen_batches
        filled, took, now = ds.Filled(self.plan.prompts_per_generation, g), 0.0, draw
        while True:
            k = now.key if now.key is not None else ds.key_for(key, filled.generations)
            r, scores, t, wall = self._generate_scored(weights, now.records, k, g)
            filled.add(r, scores, self.args.reward_weights, self.rollout.generated_with())
            took += t
            if filled.full:
                break
            if 0 < limit <= filled.generations:
                raise filled.no_signal()
            more = draw.more()
            if more is None:
                return None, now.after
            now = more
        gen = self._training_batch(*filled.batch(), g, took, wall, reference)
        gen.metrics.update(filled.metrics())
        return gen._replace(made_with=tuple(filled.batch_made_with())), now.after

    def _generate_scored(self, weights, records: Sequence[dict], key, g: int,
                         score: Callable | None = None):
        """The rollout of `records` and its Scores, the seconds generating took and the wall
        clock when it ended."""
        t0 = time.perf_counter()
        ids = [rec["prompt_ids"] for rec in records]
        # A rollout_func reads the raw prompts (grpo_jax.rollout.custom).
        r = self.rollout.generate(weights, ids, g, key,
                                  records if self.rollout.takes_records else None)
        t1, wall1 = time.perf_counter(), time.time()
        return r, (score or self.score)(records, r), t1 - t0, wall1

    def _training_batch(self, r, scores: Scores, g: int, took: float, wall1: float,
                        reference) -> Generated:
        """generate_and_score's batch, advantages and metrics from a scored rollout."""
        a = self.args
        full_width = r.completion_ids.shape[1]  # max_completion_length: dr_grpo's divisor
        r = padding.trim_completions(r, self.completion_width(r.completion_mask))
        rewards, advantages, stats = adv_lib.compute_advantages(
            scores.per_func, g, a.scale_rewards, a.reward_weights, a.multi_objective_aggregation)
        # num_items: TRL's loss normaliser for dapo-style losses is the generation batch's
        # tokens, shared out over its rows, whatever step a row lands in.
        batch = Batch(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                      r.truncated, np.asarray(advantages, np.float32),
                      sampler_logp=r.sampler_logp, tool_mask=r.tool_mask,
                      prompt_routing=r.prompt_routing, completion_routing=r.completion_routing,
                      pixel_values=r.pixel_values, positions=r.positions,
                      completion_images=r.completion_images, image_grid=r.image_grid)
        batch = batch.replace(num_items=loss_lib.num_items_per_row(
            batch.model_mask(), r.truncated, self.policy.cfg.loss, width=full_width))
        t2 = time.perf_counter()
        if reference is not None:
            batch = batch.replace(ref_logp=self.policy.logps(reference, batch,
                                                             self.plan.micro_batch_size))
        metrics = dict(stats)
        for name, col in zip(self.reward_names, scores.per_func.T):
            # NaN for a function that returned None for every completion (as TRL; the log
            # leaves it out of its averages)
            metrics[f"rewards/{name}/mean"], metrics[f"rewards/{name}/std"] = (
                adv_lib.logged_mean_std(col))
        metrics.update(scores.metrics)
        metrics.update(completion_metrics(batch))
        metrics.update(r.metrics or {})  # the JAX sampler's decode steps and slot occupancy
        if r.tool_calls is not None:  # TRL: calls per completion, failures per call
            calls = int(r.tool_calls.sum())
            metrics["tools/call_frequency"] = calls / len(r.tool_calls)
            metrics["tools/failure_frequency"] = (int(r.tool_failures.sum()) / calls
                                                  if calls else 0.0)
        metrics[timing("generate")] = took
        metrics[timing("logprobs")] = time.perf_counter() - t2
        if self.rollout.generates_ahead:  # the trainer's work on the batch begins: the
            # next round generates beside it from here on (grpo_jax.rollout.async_rounds)
            metrics["timeline/train_start"] = wall1
        return Generated(batch, scores, rewards, advantages, metrics)

    def completion_width(self, completion_mask: np.ndarray) -> int:
        """The width a generation batch's completions are padded to for the trainer (TRL pads to
        the longest; here rounded up by pad_to_multiple_of or the length buckets, a multiple of
        2 x the context axis, which cuts a completion into equal chunks)."""
        used = np.flatnonzero(np.asarray(completion_mask).any(axis=0))
        cp = mesh_lib.context_size(self.policy.mesh)
        return completion_width(int(used[-1]) + 1 if used.size else 1,
                                completion_mask.shape[1], self.plan.pad_to_multiple_of,
                                2 * cp if cp > 1 else 1)

    def split(self, batch: Batch, key) -> list[Batch]:
        """The generation batch as steps_per_generation micro-batches of shuffled rows. With one
        micro-batch per generation the order can't matter (a window sums over its rows), so it
        is kept."""
        spg, size = self.plan.steps_per_generation, self.plan.micro_batch_size
        if spg == 1:
            return [batch]
        g = self.plan.num_generations
        if self.policy.shared_prefix:
            # Whole groups shuffled, so micro-batches hold whole groups (or, when smaller than
            # a group, parts of one) and each prompt runs once per micro-batch.
            order = (generation_order(key, batch.size // g)[:, None] * g + np.arange(g)).ravel()
        else:
            order = generation_order(key, batch.size)
        return [batch.rows(order[i * size:(i + 1) * size]) for i in range(spg)]


def window_sizes(buffered: int, gas: int, epoch_end: int = 0) -> list[int]:
    """The micro-batches of each update the first `buffered` buffered ones make, in order: whole
    windows of `gas`; the window that reaches `epoch_end` (the micro-batches up to an epoch's
    end; 0: none buffered) stops there, partial if need be, as transformers' last window of an
    epoch (current_gradient_accumulation_steps = the micro-batches it holds)."""
    sizes, start = [], 0
    while True:
        stop = epoch_end if start < epoch_end else buffered
        size = min(gas, stop - start)
        if size <= 0 or (size < gas and stop != epoch_end):
            return sizes
        sizes.append(size)
        start += size


def update_logged(m: dict, block: int | None) -> Logged:
    """One update's host metrics (train_step's) as TRL logs them: each micro-batch's loss
    metrics appended, the step's loss and entropy_coef appended once, grad_norm and
    learning_rate put (transformers reads them at the log), skipped_updates counted. `block`:
    micro-batches per generation batch when the step's PER_GENERATION metric sums are to be
    merged per generation (None: they are taken at generation, GRPORound.sampling_metrics)."""
    m = dict(m)
    sums = m.pop(loss_lib.GENERATION_SUMS, None)
    put = {k: m.pop(k) for k in ("grad_norm", "learning_rate") if k in m}
    count = {k: m.pop(k) for k in ("skipped_updates",) if k in m}
    append = {k: np.ravel(v).tolist() for k, v in m.items()}
    if sums is not None and block:
        append.update(loss_lib.per_generation_metrics(sums, block))
    return Logged(append, put, count)


def completion_metrics(batch: Batch) -> dict:
    lengths = batch.model_mask().sum(1)  # TRL: the tokens the model wrote
    done = ~batch.truncated
    term = lengths[done] if done.any() else np.zeros(1)  # TRL: 0 when none terminated
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(batch.truncated.mean()),
        "completions/mean_terminated_length": float(term.mean()),
        "completions/min_terminated_length": float(term.min()),
        "completions/max_terminated_length": float(term.max()),
    }
