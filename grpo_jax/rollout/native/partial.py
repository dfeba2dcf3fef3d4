"""Partial rollouts (`max_staleness >= 1` with the JAX sampler's decode slots): a round trains as
soon as prompts_per_generation whole groups have finished; rows still decoding keep their slots
and KV caches and go on in the next round under the new weights. The idea of Kimi k1.5's partial
rollouts, AReaL's interruptible generation and verl's fully-async `partial_rollout`, on one set of
devices: no slot waits for a round's longest row, as the refill sampler (refill.py) still does
at the end of every round.

The sampler keeps `group_slots` groups (G rows each) in flight: TRL AsyncGRPOConfig's
max_inflight_tasks rows (group_slots_for: by default max_staleness generation batches, at
least two; one where no row may carry over, a split run at max_staleness 1). The round's draw
fills the group slots the last round emptied, and the compiled loop decodes until
prompts_per_generation groups are whole (each of their rows stopped), which it returns (the
oldest drawn first) and empties. Rows beyond the decode slots wait for one, the oldest group's
first: past the two batches that let rows carry over, more groups keep the slots busy while a
long row decodes over several rounds, at the price of staler tokens. Everything else is
carried to the next round in `InFlight`: rows waiting for a slot, rows decoding (their slot, KV
cache and tokens so far), rows done whose group is not. Groups stay whole: a group trains
when all its rows are done.

Each completion token keeps the log-prob of the weights that drew it and their version (the
round: weights change once a round), so the trainer's importance ratio is per token (TRL's
vllm_importance_sampling_* modes on the native path: native_importance_sampling_correction).
A group with a token more than `max_staleness` versions older than the round's weights is
dropped and generated again from its prompt, before the round decodes (TRL AsyncGRPOConfig's
max_staleness; AReaL's max_head_offpolicyness). A row's cache keeps the keys and values of the
weights that wrote them (as AReaL and SGLang's continued requests do not: they re-prefill);
the log-probs recorded are those the sampler drew with, so the ratio accounts for it.

Nothing is lost: InFlight is part of the run state and of each checkpoint (its arrays, the
KV caches with them, and the dataset rows of its groups), so a resumed run continues the very
rows in flight, and no prompt is trained twice or skipped. Each row's token t is drawn with the
key fold_in(fold_in(run key, t), its group's draw number x G + its index), whatever slot or
round it decodes in.

The prompts' keys and values are computed again each round under that round's weights (each
prompt once: 1/G of running its rows), so a row admitted later reads its prompt through the
weights it decodes with. A pass computes `pass_groups` prompts, the oldest groups with rows
waiting: a round's groups, or enough to fill every decode slot, not every group slot (with 8
batches in flight, generation per round on a CPU went from 1.25x to 1.83x faster than the
refilled rounds', docs/benchmarks.md 2026-12-07). When a slot frees and every row still
waiting is outside the pass, the loop returns and the round goes on after a pass over the next
groups, under the same weights. (With tools, and
with images, a pass holds every group slot: see __init__.) One program: static shapes (the
group slots, the decode slots, the prompt width of the run's longest prompt), so it compiles
once.

Images (a vision-language model: PartialRollouts' `processor`). Each group slot keeps its
prompt's images (InFlight.pixel_values, images.PromptPixels' block; Qwen-VL's grids beside
them), drawn through the processor when its group is, so the round's prompt pass
encodes them with the prompt under that round's weights, as refill.py's does; a row admitted
into a slot starts its decode positions at its prompt's length plus its M-RoPE delta
(Qwen2.5-VL). The finished groups' rows carry their images (and M-RoPE positions) to the
trainer, and a checkpoint's rows in flight hold them. The slots' blocks hold the most images
a prompt in flight has (image_blocks: a prompt's own, then blanks; the program compiles again
when a new prompt holds more, or, Qwen-VL, a larger image).

With Sampler.record_routing (a mixture of experts: router/mismatch, routing replay) the rows
carry the experts each completion token ran across rounds, and each group its prompt's (the
latest prefill its rows were admitted from, see _admit): in InFlight, so in checkpoints too.

Tools (`turn_ends`: the tool loop's host side, rollout/tools.py PartialTurns). A row that writes
its stop token ends a turn, not its episode: it becomes TURN and keeps its slot, KV cache and
tokens, and the compiled loop returns to the host as soon as any row is TURN. The host parses the
turn, runs its tool calls (TRL's rules: max_tool_calling_iterations, the completion budget) and
either ends the row (DONE, its slot freed) or writes the tool result's tokens after it as
"forced" tokens and makes it LIVE again; the loop goes on from the same prompt pass, and the slot
feeds the forced tokens one a step in place of what it samples (log-prob 0, tool_mask 0, so no
loss), then samples the model's next turn. So a row waiting on a tool is a row in flight like any
other: it may end its episode rounds later, under newer weights, each model token keeping the
log-prob and version that drew it, and its group trains once every row's episode has ended.
Why not leave the slot and come back as a new prompt (re-prefilled, as the synchronous loop
does through decode slots)? Its prompt would be prompt + completion so far, wider than the group
prompts the program is compiled for, and its keys would be recomputed under the current
weights, unlike the rest of the row; feeding the result through the slot writes the cache
exactly where the row's next tokens read it, costs one decode step per result token (results
are short), and needs no second program. The rounds never end with a row TURN (advance resolves
every turn first), so a checkpoint holds no tool call pending: its per-row tool messages and
call counts (`InFlight.episodes`) are saved with the rows.

A tool's image (a vision-language model's, TRL 1.16's multimodal tool result) is the exception:
it can't be fed a token a step, since its placeholders take the tower's features, Gemma 3's
image tokens attend to each other both ways, and Qwen-VL's M-RoPE gives them grid positions that
move every later position. A row fed such a result prefills its context (prompt + completion +
result) again, in its own slot, with its prompt's image and every image its tools returned
(_look_again: a second program, compiled per count of such rows and images). Its episode keeps
the tools' images (PNG in a checkpoint), and its finished rows carry them, where they sit
(completion_images) and Qwen-VL's positions over prompt + completion to the trainer.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import distributed as dist
from grpo_jax import image_blocks
from grpo_jax import images as images_lib
from grpo_jax.models import KVCache, moe
from grpo_jax.rollout import row_images
from grpo_jax.rollout.base import RolloutBatch
from grpo_jax.rollout.native import sampling
from grpo_jax.rollout.native.sampler import (Sampler, as_key, cast_matrices, decode_metrics,
                                             left_pad, row_keys)
from grpo_jax.shapes import next_pow2

WAITING, LIVE, DONE, EMPTY, TURN = 0, 1, 2, 3, 4  # a row's status (TURN: with tools, see above)
_LAST = np.iinfo(np.int32).max  # sorts after every real priority


class Rows(NamedTuple):
    """The device state carried between rounds: R = group slots x G rows, S decode slots."""
    status: jax.Array      # [R] int32: WAITING, LIVE (in a slot), DONE, EMPTY (no group)
    tokens: jax.Array      # [R, C] int32, pad after the end
    mask: jax.Array        # [R, C] int32
    logp: jax.Array        # [R, C] fp32: the sampler's, under the weights that drew each token
    version: jax.Array     # [R, C] int32: the round whose weights drew each token
    slot_row: jax.Array    # [S] int32: the row each slot holds (-1: free)
    length: jax.Array      # [S] int32: tokens the slot's row has
    last: jax.Array        # [S] int32: that row's last token, fed next
    prompt_len: jax.Array  # [S] int32
    key_mask: jax.Array    # [S, P + C] int32
    cache: KVCache         # [L, S, K, P + C, Dh] per run
    seen: jax.Array | None  # [S, V] bool, with a repetition penalty
    # With Sampler.record_routing: [R, C, S_l, k] the experts each completion token ran when
    # fed (-1: never fed), and [groups, P, S_l, k] each group's prompt's (see _admit).
    routing: jax.Array | None = None
    prompt_routing: jax.Array | None = None
    # With tools: [R, C] int32, 1 on the tool-result tokens the host wrote into `tokens`, which
    # the row's slot feeds in place of what it samples.
    forced: jax.Array | None = None


class TurnEnds(Protocol):
    """The host side of multi-turn rows (rollout/tools.py PartialTurns). A row is given as
    (prompt ids, completion ids so far, forced mask of those, episode): an episode is the
    JSON-able host state of one row's tool loop (checkpointed with the rows)."""

    def start(self) -> dict:
        """The episode of a row with nothing drawn."""

    def end_turns(self, ended: list[tuple], budget: int) -> list[tuple[list[int] | None, dict]]:
        """For each row that ended a turn: the tokens to append (its tool results and the
        next turn's header) or None when its episode ends, and its episode after it. `budget`:
        max_completion_length (a row's completion holds its turns and tool results)."""

    def fields(self, rows: list[tuple]) -> dict:
        """RolloutBatch fields of finished rows: completions, tool_calls, tool_failures."""

    def images(self, episode: dict) -> tuple[list, list[tuple[int, int]]]:
        """The images the row's tool results returned (PIL), in order, and the [start, stop)
        completion spans of the results that hold them (a vision-language model's)."""


class InFlight(NamedTuple):
    """RunState.in_flight of a run with partial rollouts: the rows on the devices and, per group
    slot, what the host needs to score and to checkpoint them."""
    rows: Rows
    prompt_ids: np.ndarray  # [groups, P] int32, left-padded
    prompt_mask: np.ndarray  # [groups, P] int32
    data_rows: np.ndarray  # [groups] int64: the dataset row of each group's prompt (-1: empty)
    seq: np.ndarray  # [groups] int64: each group's draw number (-1: empty)
    records: tuple  # [groups] the prompts' dataset records (None: empty)
    drawn: int = 0  # groups drawn so far: the next one's draw number
    key: Any = None  # the run's sampling key (a jax key), set by the first round
    episodes: tuple | None = None  # with tools: [R] each row's TurnEnds episode
    # A vision-language model: each group slot's prompt images (images.PromptPixels' block of
    # its prompt, zeros until a prompt with images fills it), fed to every round's prompt pass
    # and to the trainer with its rows; Qwen-VL's grids of each slot's images [groups, K, 3].
    # None: no images.
    pixel_values: np.ndarray | None = None
    image_grid: np.ndarray | None = None

    @property
    def empty_groups(self) -> int:
        return int((self.seq < 0).sum())


def group_slots_for(max_inflight_tasks: int, max_staleness: int, num_generations: int,
                    groups: int, split: bool) -> int:
    """Groups in flight for TRL AsyncGRPOConfig's max_inflight_tasks rows, rounded up to whole
    generation batches (`groups` each: the data is read a batch at a time); -1: TRL's rule,
    the run's max_staleness batches, at least two on shared devices (one trains while the
    next decodes and carries over). A split run's sampler bounds its rows one version less
    (its tokens train a version late), so at max_staleness 1 one batch, whose rows may not
    carry over."""
    if max_inflight_tasks < 0:
        return max(max_staleness, 1 if split else 2) * groups
    rows = groups * num_generations
    return max(1, -(-max_inflight_tasks // rows)) * groups


class Advanced(NamedTuple):
    """A round's finished groups (rollout: G rows each, the oldest drawn first, with the
    version of each token) and the state left in flight."""
    in_flight: InFlight
    rollout: RolloutBatch
    records: list  # the finished groups' prompt records, one per group
    dropped: int  # groups dropped this round for max_staleness and generated again


class PartialRollouts:
    """The sampler's partial rollouts: `num_generations` rows a group, `groups` (=
    prompts_per_generation) whole groups a round, through `slots` decode slots."""

    def __init__(self, sampler: Sampler, slots: int, num_generations: int, groups: int,
                 max_staleness: int, turn_ends: TurnEnds | None = None, processor=None,
                 numbering: tuple[int, int] = (1, 0), group_slots: int | None = None):
        """`processor`: a vision-language model's HF processor; the records' multimodal
        prompts (their "prompt") then give each group's images. `numbering` (stride, offset):
        the k-th group these rollouts draw is the run's draw number stride x k + offset, which
        keys its rows (a host's share of a multi-process split run, sampler_hosts.py: one
        group in `stride`, so each row draws what it would in one sampler). `group_slots`:
        the groups in flight (group_slots_for; None: the fewest that let rows carry over)."""
        self.sampler, self.slots, self.g, self.groups = sampler, slots, num_generations, groups
        self.max_staleness, self.turn_ends = max_staleness, turn_ends
        self.processor, self.numbering = processor, numbering
        if group_slots is None:  # the fewest that let rows carry over (at a bound of 0, none)
            group_slots = groups if max_staleness == 0 else 2 * groups
        self.group_slots = group_slots
        if self.group_slots < groups:
            raise ValueError(f"{self.group_slots} group slots hold less than a round's "
                             f"{groups} groups")
        # The groups a prompt pass computes: a round's, or enough to fill every slot. With
        # tools the round's later passes reuse its first (store), and a vision-language
        # model's images are laid out per group slot on the host: both pass every group slot.
        self.pass_groups = group_slots if turn_ends is not None or processor is not None \
            else min(group_slots, max(groups, -(-slots // num_generations)))
        self.program = jax.jit(self._advance, static_argnames=("width",))
        self._again_program = jax.jit(self._again)
        self._empty_program = jax.jit(self._empty_rows, static_argnames=("width", "penalty"))

    def with_turns(self, turn_ends: TurnEnds) -> "PartialRollouts":
        """These partial rollouts, their rows multi-turn episodes (the tool loop's)."""
        return PartialRollouts(self.sampler, self.slots, self.g, self.groups, self.max_staleness,
                               turn_ends, self.processor, self.numbering, self.group_slots)

    def empty(self, prompt_width: int) -> InFlight:
        """Nothing in flight, for prompts up to `prompt_width` tokens (the run's longest)."""
        s, gs = self.sampler, self.group_slots
        width = s.bucket(prompt_width)
        return InFlight(
            rows=self._empty_program(width=width,
                                     penalty=s.sampling_params.repetition_penalty != 1.0),
            prompt_ids=np.full((gs, width), s.pad_id, np.int32),
            prompt_mask=np.zeros((gs, width), np.int32),
            data_rows=np.full(gs, -1, np.int64), seq=np.full(gs, -1, np.int64),
            records=(None,) * gs, episodes=None if self.turn_ends is None else
            (self.turn_ends.start(),) * (gs * self.g))

    def advance(self, params, at: InFlight, records: Sequence[dict], data_rows: Sequence[int],
                version: int, key) -> Advanced:
        """The new groups of `records` (their dataset rows `data_rows`) into the group slots
        emptied last round, then decode under `params` (version `version`) until `groups`
        whole groups are done."""
        s, g = self.sampler, self.g
        params = s.check_params(params)
        free = np.flatnonzero(at.seq < 0)
        if len(records) > len(free):
            raise ValueError(f"{len(records)} new groups but {len(free)} group slots free")
        prompts = s.check_prompts([r["prompt_ids"] for r in records])
        width = at.prompt_ids.shape[1]
        if prompts and max(map(len, prompts)) > width:
            raise ValueError(f"a prompt of {max(map(len, prompts))} tokens exceeds the partial "
                             f"rollouts' prompt width {width}")
        ids, pmask, data, seq = (at.prompt_ids.copy(), at.prompt_mask.copy(),
                                 at.data_rows.copy(), at.seq.copy())
        recs, fresh = list(at.records), np.zeros(self.group_slots, bool)
        if prompts:
            new_ids, new_mask = left_pad(prompts, 1, width, s.pad_id)
            put = free[:len(prompts)]
            ids[put], pmask[put], data[put] = new_ids, new_mask, np.asarray(data_rows)
            stride, offset = self.numbering
            seq[put] = (at.drawn + np.arange(len(prompts))) * stride + offset
            fresh[put] = True
            for i, rec in zip(put, records):
                recs[i] = rec
        pixels, grid = self._pixels(at, records, free[:len(prompts)])
        images = self._images(ids, pmask, pixels, grid)
        run_key = as_key(key) if at.key is None else at.key
        rows, store, ends, steps, busy, dropped = at.rows, None, None, 0, 0, None
        episodes = None if at.episodes is None else list(at.episodes)
        args = jnp.asarray(ids), jnp.asarray(pmask), jnp.asarray(seq, jnp.int32)
        while True:  # without tools once; with tools until no row waits on its tool calls
            rows, chosen, n, live, stale, starved, *kept = self.program(
                params, rows, *args, jnp.asarray(fresh), run_key, np.int32(version), store,
                ends, images, width=width)
            chosen, n, live, stale, starved = dist.to_host((chosen, n, live, stale, starved))
            steps, busy = steps + int(n), busy + int(live)
            if store is None:  # a prompt pass: the round's first admitted and restarted groups
                dropped = stale if dropped is None else dropped | stale
                if episodes is not None:
                    for i in np.flatnonzero(np.repeat(fresh | stale, g)):
                        episodes[i] = self.turn_ends.start()
                fresh = np.zeros_like(fresh)
            if starved:  # slots free, the rows waiting outside the pass: pass their prompts
                continue
            if episodes is None:
                break
            store = kept[0]  # the round's prompt pass, for the passes after tool calls
            ended = self._end_turns(rows, ids, pmask, episodes)
            if ended is None:
                break
            ends, seeing = ended
            if seeing:  # rows fed a tool's image: their contexts prefilled again in their slots
                rows, ends = self._look_again(params, rows, ends, seeing, ids, pmask, recs,
                                              episodes, version), None
            else:
                ends = tuple(map(jnp.asarray, ends))
        chosen = chosen[chosen >= 0]
        out_rows = (chosen[:, None] * g + np.arange(g)).ravel()
        tokens, cmask, logp, versions = dist.to_host(
            (rows.tokens[out_rows], rows.mask[out_rows], rows.logp[out_rows],
             rows.version[out_rows]))
        fields, stopped, row_records = {}, None, None
        if episodes is not None:
            forced = dist.to_host(rows.forced[out_rows])
            turns = _turn_rows(ids, pmask, tokens, cmask, forced, episodes, out_rows, g)
            fields = dict(self.turn_ends.fields(turns),
                          tool_mask=np.where(cmask > 0, 1 - forced, 1).astype(np.int32))
            if self.processor is not None:  # where the completions hold a tool's image
                shown = [self._tool_images(episodes[i], tokens[k])
                         for k, i in enumerate(out_rows)]
                fields["completion_images"] = np.stack([placed for _, placed in shown])
                if any(images for images, _ in shown):
                    row_records = [images_lib.with_tool_images(
                        recs[i // g], images, placed[cmask[k] > 0].tolist())
                        for k, (i, (images, placed)) in enumerate(zip(out_rows, shown))]
            # The tool loop's rule (TRL's): truncated unless the last token is a stop (a tool
            # result holds the chat template's end-of-turn token too).
            stopped = np.array([bool(t[1]) and t[1][-1] in set(s.sampling_params.stop_token_ids)
                                | {s.pad_id} for t in turns])
            for i in out_rows:
                episodes[i] = self.turn_ends.start()
        prompt_routing = completion_routing = None
        if rows.routing is not None:
            prompt_routing, completion_routing = dist.to_host(
                (rows.prompt_routing[chosen], rows.routing[out_rows]))
            prompt_routing = np.repeat(prompt_routing, g, axis=0)
        # What the round returned leaves its group slots (the program emptied their rows).
        done_records = [recs[i] for i in chosen]
        seq[chosen], data[chosen] = -1, -1
        for i in chosen:
            recs[i] = None
        stops = s.sampling_params.stop_token_ids
        if stopped is None:
            stopped = (np.isin(tokens, stops) & (cmask > 0)).any(axis=1)
        out_ids, out_mask = np.repeat(ids[chosen], g, axis=0), np.repeat(pmask[chosen], g, axis=0)
        if pixels is not None:  # the rows' images for the trainer's forwards, as refill's
            grids = None if grid is None else np.repeat(grid[chosen], g, axis=0)
            fields.update(pixel_values=np.repeat(pixels[chosen], g, axis=0), image_grid=grids,
                          positions=s.row_positions(out_ids, out_mask, grids, tokens.shape[1]))
        batch = RolloutBatch(out_ids, out_mask, tokens, cmask, ~stopped, logp,
                             metrics=decode_metrics(steps, busy, self.slots),
                             versions=np.where(cmask > 0, versions, 0).astype(np.int32),
                             prompt_routing=prompt_routing, completion_routing=completion_routing,
                             **fields)
        if row_records is not None:  # each row's prompt images, then its tools'
            batch = row_images.with_row_images(self.processor, s.cfg, s.pad_id, batch,
                                               row_records)
        left = at._replace(rows=rows, prompt_ids=ids, prompt_mask=pmask, data_rows=data,
                           seq=seq, records=tuple(recs), drawn=at.drawn + len(prompts),
                           key=run_key, episodes=None if episodes is None else tuple(episodes),
                           pixel_values=pixels, image_grid=grid)
        return Advanced(left, batch, done_records, int(dropped.sum()))

    def _pixels(self, at: InFlight, records, put):
        """(pixel_values, image_grid) of the group slots after `records`' groups fill the slots
        `put`: their images through the processor, the other slots' kept (an emptied slot's
        stay with its prompt ids, which the prompt pass still reads)."""
        if self.processor is None or not len(records):
            return at.pixel_values, at.image_grid
        px = images_lib.prompt_pixels(self.processor, [rec["prompt"] for rec in records])
        pixels, grid = at.pixel_values, at.image_grid
        if pixels is None:
            pixels = np.zeros((self.group_slots, *px.pixel_values.shape[1:]),
                              px.pixel_values.dtype)
            grid = (None if px.image_grid is None else
                    np.zeros((self.group_slots, *px.image_grid.shape[1:]), np.int32))
        # The slots' blocks and the new prompts' padded to the most images per prompt (and
        # Qwen-VL's patches per image) of both.
        (pixels, grid), (new, new_grid) = image_blocks.common(
            [(pixels, grid), (px.pixel_values, px.image_grid)])
        pixels = pixels.copy()
        pixels[put] = new
        if grid is not None:
            grid = grid.copy()
            grid[put] = new_grid
        return pixels, grid

    def _images(self, ids, pmask, pixels, grid):
        """The program's `images` (Sampler.image_inputs) for the group slots: each slot's
        block of images (its prompt's, then blanks; a slot never filled holds blanks only), its
        placeholders taking its own block's (images_per_prompt)."""
        k = 0 if pixels is None else image_blocks.count(pixels)
        if not k:
            return None
        flat = pixels.reshape(-1, *pixels.shape[2:])
        thw = None if grid is None else grid.reshape(-1, 3)
        return self.sampler.image_inputs(ids, pmask, flat, thw, images_per_prompt=k)

    def _end_turns(self, rows: Rows, ids, pmask, episodes: list):
        """The rows that ended a turn (TURN) through the host's tool loop: the program's
        `ends` argument (which end, which go on, the tokens they are fed) and, for the rows
        that go on after a result holding images, (row, its completion's length with the
        result), to prefill again (_look_again); None when no row ended a turn. Updates
        `episodes`."""
        status = dist.to_host(rows.status)
        ended = np.flatnonzero(status == TURN)
        if not ended.size:
            return None
        tokens, mask, forced = dist.to_host((rows.tokens, rows.mask, rows.forced))
        g, C = self.g, tokens.shape[1]
        turns = _turn_rows(ids, pmask, tokens[ended], mask[ended], forced[ended], episodes,
                           ended, g)
        resume, seeing = np.zeros(len(status), bool), []
        put, put_mask = np.zeros_like(tokens), np.zeros_like(forced)
        for i, (_, done, _, before), (more, episode) in zip(
                ended, turns, self.turn_ends.end_turns(turns, C)):
            episodes[i] = episode
            if more is not None and len(done) + len(more) <= C:
                resume[i] = True
                put[i, len(done):len(done) + len(more)] = more
                put_mask[i, len(done):len(done) + len(more)] = 1
                spans = self.turn_ends.images(episode)[1]
                if len(spans) > len(self.turn_ends.images(before)[1]):
                    seeing.append((int(i), len(done) + len(more)))
        finish = np.zeros(len(status), bool)
        finish[ended] = ~resume[ended]
        return (finish, resume, put, put_mask), seeing

    def _tool_images(self, episode: dict, tokens: np.ndarray) -> tuple[list, np.ndarray]:
        """(the images a row's tools returned, [C] bool: their placeholders in its completion
        `tokens`)."""
        images, spans = self.turn_ends.images(episode)
        placed = np.zeros(len(tokens), bool)
        for start, stop in spans:
            placed[start:stop] = True
        return images, placed & (tokens == self.sampler.cfg.vision.image_token_id)

    def _look_again(self, params, rows: Rows, ends, seeing, ids, pmask, recs, episodes,
                    version: int) -> Rows:
        """`ends` resolved, and the rows of `seeing` ((row, completion length n)), which go on
        after a tool result holding images, prefilled again in their slots: prompt + their
        first n - 1 completion tokens (the result's last is fed by the next decode step, as a
        forced token is) with the prompt's images and every image their tools returned, under
        this round's weights. A result's image can't be fed a token a step as text is: its
        placeholders take the tower's features, Gemma 3's attend to each other both ways, and
        Qwen-VL's M-RoPE gives them grid positions that move every later position. The row's
        earlier keys and values are recomputed too (under these weights, as the round's
        prompt pass recomputes the prompts'); the log-probs of its tokens stay the sampler's
        that drew them."""
        s, g = self.sampler, self.g
        put, put_mask = ends[2:]
        tokens = dist.to_host(rows.tokens)
        tokens = np.where(put_mask > 0, put, tokens)
        slot_row = dist.to_host(rows.slot_row)
        width, C = ids.shape[1], tokens.shape[1]
        n = next_pow2(len(seeing))
        ctx_ids = np.full((n, width + C), s.pad_id, np.int32)
        ctx_mask = np.zeros_like(ctx_ids)
        slots, which = np.full(n, self.slots, np.int32), np.full(n, len(tokens), np.int32)
        lengths, marks, shown = np.ones(n, np.int32), [0] * n, [[] for _ in range(n)]
        for j, (i, length) in enumerate(seeing):
            group = i // g
            ctx = np.concatenate([ids[group], tokens[i, :length - 1]])  # the slot's layout
            ctx_ids[j, -len(ctx):] = ctx
            ctx_mask[j, -len(ctx):] = np.concatenate([pmask[group], np.ones(length - 1)])
            images, placed = self._tool_images(episodes[i], tokens[i])
            record = images_lib.with_tool_images(recs[group], images,
                                                 placed[:length - 1].tolist())
            marks[j], shown[j] = images_lib.image_tokens(record), images_lib.record_images(record)
            slots[j], which[j], lengths[j] = np.flatnonzero(slot_row == i)[0], i, length
        px = images_lib.row_pixels(self.processor, shown)
        k = image_blocks.count(px.pixel_values)
        flat = px.pixel_values.reshape(-1, *px.pixel_values.shape[2:])
        grid = None if px.image_grid is None else px.image_grid.reshape(-1, 3)
        images = s.image_inputs(ctx_ids, ctx_mask, flat, grid, marks, images_per_prompt=k)
        return self._again_program(params, rows, tuple(map(jnp.asarray, ends)),
                                   jnp.asarray(ctx_ids), jnp.asarray(ctx_mask),
                                   jnp.asarray(slots), jnp.asarray(which), jnp.asarray(lengths),
                                   np.int32(version), images)

    # ------------------------------------------------------------------ compiled program

    def _advance(self, params, rows: Rows, prompt_ids, prompt_mask, seq, fresh, key, version,
                 store=None, ends=None, images=None, *, width: int):
        """Decode until `groups` whole groups are done (then returned, `chosen`) or nothing is
        left to decode; with tools also until a row ends a turn (then nothing is chosen: the
        host resolves the turns, `ends`, and runs the program again with the round's prompt
        pass, `store`, which it returns). `images`: the group slots' (Sampler.image_inputs),
        encoded by the prompt pass each round."""
        s, g = self.sampler, self.g
        if ends is not None:
            rows = self._resolve(rows, *ends)
        # Groups too stale to train (a token more than max_staleness versions old) start over.
        oldest = jnp.min(jnp.where(rows.mask > 0, rows.version, _LAST), axis=1)
        stale = jnp.any((oldest < version - self.max_staleness).reshape(-1, g), axis=1)
        stale = stale & (seq >= 0) & ~fresh
        rows = self._restart(rows, jnp.repeat(fresh | stale, g))
        n = seq.shape[0]
        if self.pass_groups == n:  # every group slot, in place
            passed = jnp.arange(n, dtype=jnp.int32)
        else:  # the oldest groups with rows waiting (they are admitted first)
            waits = jnp.any((rows.status == WAITING).reshape(-1, g), axis=1)
            passed = jnp.argsort(jnp.where(waits, seq, _LAST))[:self.pass_groups]
        # entry[group slot]: its place in the pass (pass_groups: not in it)
        entry = jnp.full(n, self.pass_groups, jnp.int32).at[passed].set(
            jnp.arange(self.pass_groups, dtype=jnp.int32))
        prompt_ids, prompt_mask = prompt_ids[passed], prompt_mask[passed]
        if store is None:
            cast, layers, cache, logits, *routing = s.prompt_pass(
                params, s.constrain(prompt_ids, "batch", None),
                s.constrain(prompt_mask, "batch", None), s.record_routing, images)
        else:  # a later pass of the round: its prompts' keys and values as the first computed
            cast = cast_matrices(params, s.cfg.dtype)
            layers = s.decoder(cast).decode_layers()
            cache, logits, *routing = store
        pen = None
        if rows.seen is not None:
            pen = jnp.zeros((prompt_ids.shape[0], s.cfg.vocab_size), bool)
            pen = pen.at[jnp.arange(prompt_ids.shape[0])[:, None], prompt_ids].max(
                prompt_mask.astype(bool))
        kept = (cache, logits, *routing)
        # a row's decode positions follow its prompt's real tokens (+ its M-RoPE delta)
        prompt_len = jnp.sum(prompt_mask, axis=1) + (0 if images is None else images.deltas)
        store = (cache, logits, prompt_mask, pen, prompt_len, *routing)
        model = s.decoder(cast)
        gid = jnp.repeat(seq, g) * g + jnp.tile(jnp.arange(g, dtype=jnp.int32), seq.shape[0])
        in_pass = jnp.repeat(entry < self.pass_groups, g)

        def whole(st):  # groups whose every row is done
            return jnp.all((st[0].status == DONE).reshape(-1, g), axis=1) & (seq >= 0)

        def starved(r):  # a slot free, and every row waiting for one outside this pass
            waiting = r.status == WAITING
            return jnp.any(r.slot_row < 0) & jnp.any(waiting) & ~jnp.any(waiting & in_pass)

        def going(st):
            r = st[0]
            pending = jnp.any(r.status == WAITING) | jnp.any(r.slot_row >= 0)
            return ((jnp.sum(whole(st)) < self.groups) & pending & ~jnp.any(r.status == TURN)
                    & ~starved(r))

        def step(st):
            r, steps, busy = st
            r = jax.lax.cond(jnp.any(r.slot_row < 0) & jnp.any((r.status == WAITING) & in_pass),
                             lambda r: self._admit(store, r, gid, entry, in_pass, key, version),
                             lambda r: r, r)
            r, live = self._decode(model, layers, r, gid, key, version, width)
            return r, steps + 1, busy + jnp.sum(live)
        rows, steps, busy = jax.lax.while_loop(
            going, step, (rows, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)))
        short = starved(rows) & (jnp.sum(whole((rows,))) < self.groups)
        # no choice while turns wait, nor while the round goes on after another prompt pass
        done = whole((rows,)) & ~jnp.any(rows.status == TURN) & ~short
        order = jnp.argsort(jnp.where(done, seq, _LAST))[:self.groups]
        chosen = jnp.where(done[order], order, -1)
        # (-1 would index the last group: out of range instead, so the write is dropped)
        taken = jnp.zeros(seq.shape[0], bool).at[jnp.where(chosen >= 0, chosen, seq.shape[0])
                                                 ].set(True, mode="drop")
        rows = rows._replace(status=jnp.where(jnp.repeat(taken, g), EMPTY, rows.status))
        out = self._laid_out(rows), chosen, steps, busy, stale, short
        return out if self.turn_ends is None else (*out, kept)

    def _resolve(self, rows: Rows, finish, resume, tokens, forced) -> Rows:
        """The host's word on the rows that ended a turn: `finish` ([R] bool) end their episode
        and free their slots; `resume` decode on, fed the `tokens` where `forced` ([R, C])."""
        turn = rows.status == TURN
        freed = (rows.slot_row >= 0) & finish[jnp.maximum(rows.slot_row, 0)]
        status = jnp.where(turn & finish, DONE, jnp.where(turn & resume, LIVE, rows.status))
        return rows._replace(status=status, slot_row=jnp.where(freed, -1, rows.slot_row),
                             tokens=jnp.where(forced > 0, tokens, rows.tokens),
                             forced=jnp.maximum(rows.forced, forced))

    def _again(self, params, rows: Rows, ends, ctx_ids, ctx_mask, slots, which, lengths,
               version, images) -> Rows:
        """_look_again's program: `ends` resolved, then each context (ctx_ids [n, P + C], the
        slot's layout left-padded to its width) prefilled into slot slots[j] (S: none) of row
        which[j], whose completion then holds lengths[j] tokens, the last to be fed next."""
        s = self.sampler
        rows = self._resolve(rows, *ends)
        # No routing record: no mixture of experts here takes images.
        _, _, cache, _ = s.prompt_pass(params, ctx_ids, ctx_mask, False, images)
        # The context ends at slot P + length - 2 of its row's slot, at the end of ctx_ids:
        # shifted left by the padding after it in the slot. A sliding layer's ring (slot =
        # position % window) holds the context's last `window` positions: rolled alike.
        shift = s.sampling_params.max_completion_length - lengths + 1

        def place(buf, new):
            at = (jnp.arange(new.shape[3])[None] + shift[:, None]) % new.shape[3]
            new = jnp.take_along_axis(new, at[None, :, None, :, None], axis=3)
            return buf.at[:, slots].set(new.astype(buf.dtype), mode="drop")
        cache = KVCache(*(tuple(map(place, part, new)) for part, new in zip(rows.cache, cache)))
        row = jnp.minimum(which, rows.tokens.shape[0] - 1)
        written = jnp.arange(rows.tokens.shape[1])[None] < lengths[:, None]  # [n, C]
        fed = written & (rows.mask[row] == 0)  # the result's tokens, as _record writes them
        put = lambda buf, x: buf.at[which].set(  # noqa: E731
            jnp.where(fed, x, buf[row]).astype(buf.dtype), mode="drop")
        tokens = rows.tokens[row]
        seen = rows.seen
        if seen is not None:
            seen = seen.at[slots[:, None], tokens].max(fed, mode="drop")
        # decode positions after the context: its real prompt tokens + its M-RoPE delta
        prompt_len = jnp.sum(ctx_mask, axis=1) - (lengths - 1) + images.deltas
        at = lambda buf, x: buf.at[slots].set(x, mode="drop")  # noqa: E731
        return self._laid_out(rows._replace(
            mask=put(rows.mask, 1), version=put(rows.version, version),
            length=at(rows.length, lengths), prompt_len=at(rows.prompt_len, prompt_len),
            last=at(rows.last, tokens[jnp.arange(len(row)), lengths - 1]),
            cache=s.constrain_cache(cache), seen=seen))

    def _laid_out(self, rows: Rows) -> Rows:
        """The rows' layout, the same out of every program (so the next round's input matches
        the program's, and it compiles once): slots over the batch axes, rows replicated."""
        s = self.sampler
        slot = lambda x: s.constrain(x, "batch", *[None] * (x.ndim - 1))  # noqa: E731
        whole = lambda x: s.constrain(x, *[None] * x.ndim)  # noqa: E731
        maybe = lambda f, x: None if x is None else f(x)  # noqa: E731
        return Rows(*map(whole, rows[:5]), *map(slot, rows[5:10]), s.constrain_cache(rows.cache),
                    maybe(slot, rows.seen), maybe(whole, rows.routing),
                    maybe(whole, rows.prompt_routing), maybe(whole, rows.forced))

    def _empty_rows(self, *, width: int, penalty: bool) -> Rows:
        s = self.sampler
        S, C, cfg = self.slots, s.sampling_params.max_completion_length, s.cfg
        R = self.group_slots * self.g
        unrecorded = lambda *shape: jnp.full(  # noqa: E731
            (*shape, sum(cfg.moe_layers), cfg.num_experts_per_tok), -1,
            moe.routing_dtype(cfg.num_experts)) if s.record_routing else None
        return self._laid_out(Rows(
            status=jnp.full((R,), EMPTY, jnp.int32),
            tokens=jnp.full((R, C), s.pad_id, jnp.int32), mask=jnp.zeros((R, C), jnp.int32),
            logp=jnp.zeros((R, C), jnp.float32), version=jnp.zeros((R, C), jnp.int32),
            slot_row=jnp.full((S,), -1, jnp.int32), length=jnp.zeros((S,), jnp.int32),
            last=jnp.zeros((S,), jnp.int32), prompt_len=jnp.zeros((S,), jnp.int32),
            key_mask=jnp.zeros((S, width + C), jnp.int32),
            cache=KVCache.zeros(cfg, S, width + C, s.cache_dtype),
            seen=jnp.zeros((S, cfg.vocab_size), bool) if penalty else None,
            routing=unrecorded(R, C), prompt_routing=unrecorded(self.group_slots, width),
            forced=None if self.turn_ends is None else jnp.zeros((R, C), jnp.int32)))

    def _restart(self, rows: Rows, restart) -> Rows:
        """Rows `restart` ([R] bool) back to waiting with nothing drawn; their slots freed."""
        evict = (rows.slot_row >= 0) & restart[jnp.maximum(rows.slot_row, 0)]
        keep = ~restart[:, None]
        return rows._replace(
            status=jnp.where(restart, WAITING, rows.status),
            tokens=jnp.where(keep, rows.tokens, self.sampler.pad_id),
            mask=jnp.where(keep, rows.mask, 0), logp=jnp.where(keep, rows.logp, 0.0),
            version=jnp.where(keep, rows.version, 0),
            slot_row=jnp.where(evict, -1, rows.slot_row),
            routing=None if rows.routing is None else jnp.where(keep[..., None, None],
                                                                rows.routing, -1),
            forced=None if rows.forced is None else jnp.where(keep, rows.forced, 0))

    def _admit(self, store, r: Rows, gid, entry, in_pass, key, version) -> Rows:
        """Free slots take the waiting rows, oldest group first: their prompts' keys and values
        from this round's prompt pass, and their first tokens.

        A group's prompt record is the prompt pass of the last round that admitted one of its
        rows. Each round recomputes the prompts under its weights, so a group whose rows were
        admitted over several rounds decoded from several prefills, while the trainer runs its
        prompt once (shared by the group's rows under numerics.shared_prefix) and can replay
        one record of it. The latest is the prefill whose keys and values the group's last
        decoded tokens read, the one closest to the weights that train on them."""
        s, S, g = self.sampler, self.slots, self.g
        cache, logits, pmask, pen, prompt_len, *routing = store
        waiting = (r.status == WAITING) & in_pass  # [R]: its prompt in the pass
        priority = jnp.where(waiting, gid, _LAST)
        order = jnp.argsort(priority)
        free = r.slot_row < 0
        pick = order[jnp.clip(jnp.cumsum(free) - 1, 0, order.shape[0] - 1)]
        admit = free & (priority[pick] < _LAST)
        row = jnp.where(admit, pick, r.slot_row)
        group = jnp.where(admit, pick // g, 0)  # its group slot
        prompt = jnp.minimum(entry[group], pmask.shape[0] - 1)  # its place in the pass
        at = jnp.where(admit, jnp.arange(S), S)  # S: out of range, the write is dropped
        width = pmask.shape[1]

        def copy(buf, src):
            return buf.at[:, at, :, :src.shape[3]].set(src[:, prompt], mode="drop")
        kv = KVCache(*(tuple(map(copy, part, src)) for part, src in zip(r.cache, cache)))
        seen = None if r.seen is None else r.seen.at[at].set(pen[prompt], mode="drop")
        mask_rows = jnp.concatenate([pmask[prompt], jnp.ones((S, r.key_mask.shape[1] - width),
                                                            jnp.int32)], axis=1)
        status = r.status.at[jnp.where(admit, pick, r.status.shape[0])].set(LIVE, mode="drop")
        if routing:
            r = r._replace(prompt_routing=r.prompt_routing.at[
                jnp.where(admit, group, r.prompt_routing.shape[0])].set(routing[0][prompt],
                                                                         mode="drop"))
        r = r._replace(status=status, slot_row=row, length=jnp.where(admit, 0, r.length),
                       prompt_len=jnp.where(admit, prompt_len[prompt], r.prompt_len),
                       key_mask=jnp.where(admit[:, None], mask_rows, r.key_mask),
                       cache=s.constrain_cache(kv), seen=seen)
        token, logp = sampling.sample(row_keys(key, 0, gid[row]), logits[prompt],
                                      s.sampling_params, seen)
        return self._record(r, admit, token, logp, version)

    def _decode(self, model, layers, r: Rows, gid, key, version, width: int):
        """Every live slot feeds its row's last token and samples the next."""
        s = self.sampler
        live = (r.slot_row >= 0) & (r.status[jnp.maximum(r.slot_row, 0)] == LIVE)  # not TURN
        hidden, cache, *chosen = model(
            r.last[:, None], (r.prompt_len + r.length - 1)[:, None], r.key_mask, cache=r.cache,
            cache_index=width + r.length - 1, layers=layers, record_routing=r.routing is not None)
        if chosen:  # the experts of the token each live slot fed: its row's token length - 1
            at = jnp.where(live, r.slot_row, r.routing.shape[0])  # a free slot writes nowhere
            r = r._replace(routing=r.routing.at[at, jnp.maximum(r.length - 1, 0)].set(
                chosen[0][:, 0].astype(r.routing.dtype), mode="drop"))
        row = jnp.maximum(r.slot_row, 0)
        token, logp = sampling.sample(row_keys(key, r.length, gid[row]),
                                      model.logits(hidden)[:, 0], s.sampling_params, r.seen)
        r = r._replace(cache=s.constrain_cache(cache))
        return self._record(r, live, token, logp, version), live

    def _record(self, r: Rows, live, token, logp, version) -> Rows:
        """The live slots' new tokens into their rows; a row that stops (a stop token, or
        max_completion_length tokens) is done and frees its slot. With tools a forced token
        (a tool result's) replaces the one sampled, and the row ends a turn instead (TURN: it
        keeps its slot until the host has seen its tool calls)."""
        sp = self.sampler.sampling_params
        C = sp.max_completion_length
        at = jnp.where(live, r.slot_row, r.tokens.shape[0])  # a slot not live writes nowhere
        forced = jnp.zeros(live.shape, bool)
        if r.forced is not None:
            row, pos = jnp.maximum(r.slot_row, 0), jnp.minimum(r.length, C - 1)
            forced = live & (r.forced[row, pos] > 0)
            token = jnp.where(forced, r.tokens[row, pos], token)
            logp = jnp.where(forced, 0.0, logp)
        put = lambda buf, x: buf.at[at, r.length].set(  # noqa: E731
            jnp.broadcast_to(x, live.shape).astype(buf.dtype), mode="drop")
        length = r.length + live
        stop = jnp.zeros(live.shape, bool)
        if sp.stop_token_ids:
            stop = jnp.isin(token, jnp.asarray(sp.stop_token_ids)) & ~forced
        seen = r.seen
        if seen is not None:
            seen = seen.at[jnp.arange(self.slots), token].max(live)
        ends = live & ((length >= C) | stop)
        # With tools the host sees every turn's end, also one cut by the budget (whose calls
        # TRL's loop still runs and counts).
        finished, turn = (ends, ends & False) if r.forced is None else (ends & False, ends)
        status = r.status.at[jnp.where(finished, r.slot_row, r.status.shape[0])].set(
            DONE, mode="drop")
        status = status.at[jnp.where(turn, r.slot_row, r.status.shape[0])].set(TURN, mode="drop")
        return r._replace(tokens=put(r.tokens, token), mask=put(r.mask, 1),
                          logp=put(r.logp, logp), version=put(r.version, version),
                          status=status, length=length, last=jnp.where(live, token, r.last),
                          slot_row=jnp.where(finished, -1, r.slot_row), seen=seen)


def staleness_metrics(versions: np.ndarray, mask: np.ndarray, version: int,
                      max_staleness: int) -> dict:
    """staleness/*: how many versions older than the training weights each trained token's
    are: mean, max and the share of tokens at each staleness 0..max_staleness. `mask` may be
    narrower than `versions` (the trainer's width: shapes.completion_width; past it, padding)."""
    ages = (version - versions[:, :mask.shape[1]])[mask > 0]
    if not ages.size:
        return {}
    out = {"staleness/mean": float(ages.mean()), "staleness/max": float(ages.max())}
    for k in range(max_staleness + 1):
        out[f"staleness/tokens_{k}"] = float((ages == k).mean())
    return out


def to_arrays(at: InFlight) -> dict[str, np.ndarray]:
    """InFlight as named host arrays for a checkpoint (the records as their dataset rows)."""
    leaves = dist.to_host(jax.tree.leaves(at.rows))
    out = {f"rows/{i}": np.asarray(x) for i, x in enumerate(leaves)}
    out.update(prompt_ids=at.prompt_ids, prompt_mask=at.prompt_mask, data_rows=at.data_rows,
               seq=at.seq, drawn=np.int64(at.drawn))
    if at.key is not None:
        out["key"] = np.asarray(jax.random.key_data(at.key))
    if at.episodes is not None:  # the tool loop's messages and counts, as JSON text
        out["episodes"] = images_lib.json_bytes(at.episodes)
    if at.pixel_values is not None:  # each group slot's images, its prompt ids' placeholders'
        out["pixel_values"] = at.pixel_values
        if at.image_grid is not None:
            out["image_grid"] = np.asarray(at.image_grid, np.int32)
    return out


def from_arrays(template: InFlight, arrays: dict, record) -> InFlight:
    """A checkpoint's InFlight, its device arrays placed as `template`'s (an empty one of the
    same run); `record(i)`: the dataset's record of row i."""
    leaves, tree = jax.tree.flatten(template.rows)
    if sum(k.startswith("rows/") for k in arrays) != len(leaves):
        raise ValueError("the checkpoint's rollouts in flight were written by another sampler "
                         "layout (model, max_num_seqs, num_generations or batch size)")
    held, holds = len(arrays["seq"]), len(template.seq)
    if held != holds:
        g = template.rows.status.shape[0] // holds
        raise ValueError(f"the checkpoint holds {held} groups in flight where this run holds "
                         f"{holds}: resume with max_inflight_tasks: {held * g} (the run that "
                         "wrote it), or from a checkpoint of this layout")
    placed = []
    for i, like in enumerate(leaves):
        x = np.asarray(arrays[f"rows/{i}"])
        if x.dtype.kind == "V" and x.dtype.itemsize == like.dtype.itemsize:
            x = x.view(like.dtype)  # npz keeps bfloat16 (a KV cache's) as raw 2-byte records
        if x.shape != like.shape or x.dtype != like.dtype:
            raise ValueError(f"the checkpoint's rollouts in flight have {x.shape} {x.dtype} "
                             f"where this run holds {like.shape} {like.dtype}: another sampler "
                             "layout (model, max_num_seqs, num_generations, prompt width)")
        placed.append(dist.shard_host_array(x, like.sharding))
    data = np.asarray(arrays["data_rows"])
    key = arrays.get("key")
    return InFlight(jax.tree.unflatten(tree, placed), np.asarray(arrays["prompt_ids"]),
                    np.asarray(arrays["prompt_mask"]), data, np.asarray(arrays["seq"]),
                    tuple(None if i < 0 else record(int(i)) for i in data),
                    int(arrays["drawn"]),
                    None if key is None else jax.random.wrap_key_data(np.asarray(key)),
                    template.episodes if "episodes" not in arrays
                    else tuple(images_lib.from_json_bytes(arrays["episodes"])),
                    None if "pixel_values" not in arrays else np.asarray(arrays["pixel_values"]),
                    None if "image_grid" not in arrays
                    else np.asarray(arrays["image_grid"], np.int32))


def _turn_rows(ids, pmask, tokens, mask, forced, episodes, rows, g: int) -> list[tuple]:
    """TurnEnds' rows: for each row index in `rows` (its group's prompt is ids[row // g]) and
    the k-th of `tokens`/`mask`/`forced` ([len(rows), C]), (prompt ids, completion ids so far,
    forced mask of those, episode)."""
    return [(ids[i // g][pmask[i // g] > 0].tolist(), tokens[k][mask[k] > 0].tolist(),
             forced[k][mask[k] > 0].tolist(), episodes[i]) for k, i in enumerate(rows)]
