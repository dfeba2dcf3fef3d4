"""Decode slots refilled as rows finish (continuous batching) for the native sampler.

`max_num_seqs` rows decode at once, each in a slot holding its KV cache; a round's other rows
wait in a queue (prompt i's G rows consecutive). When a row stops, its slot takes the next
waiting row, so no slot idles until the round's longest row is done, as in a static batch.

One compiled program per (rows bucket, prompt bucket), shapes fixed by the number of slots:
1. the prompts' pass (Sampler.prompt_pass): each prompt once, its keys and values, last
   logits and (with a repetition penalty) token set kept as a store of [prompts, ...];
2. one while loop, each iteration
   - admitting rows when a slot is free and a row waits (a `lax.cond`, skipped otherwise): the
     free slots take the next rows in order, each gets its prompt's keys and values copied
     from the store (a scatter of the prompt's slots: the shared prefix is never recomputed)
     and samples its first token from the prompt's logits;
   - then one decode step for every slot: each feeds its row's last token at its own cache
     index (Decoder with a per-row cache_index) and samples with its row's keys;
   - and it stops when no row waits and no slot is live.
Admission sits inside the compiled loop rather than in host round trips between chunks of
decode steps: no step waits on the host, and no slot idles to the end of a chunk. The store
costs prompts x prompt width of KV, next to slots x (prompt width + completion) for the slots.

A slot's cache is laid out as a static batch row's: its prompt left-padded to the bucket P,
its token t at slot P + t (a sliding layer's ring: position % window). A reused slot's stale
keys beyond its new row's tokens are hidden by the causal mask until overwritten.

Row r draws its token t with the key fold_in(fold_in(round key, t), r) (sampler.row_keys), as
`Sampler.generate` does, so a row's tokens do not depend on its slot nor on its neighbours;
the floating-point sums do (a batch of other size may round differently), which is why tokens
equal the static batch's almost always rather than always (tests/test_refill.py).

With Sampler.record_routing (a mixture of experts: router/mismatch, routing replay) the round
also returns what a static batch records: each prompt's experts from its one prompt pass (every
row admits that pass's keys and values) and each completion token's, written by the decode step
of the slot that fed it.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import distributed as dist
from grpo_jax import mesh as mesh_lib
from grpo_jax.models import KVCache, moe
from grpo_jax.rollout.native import sampling
from grpo_jax.rollout.native.sampler import (RolloutBatch, Sampler, as_key, decode_metrics,
                                             left_pad, merge_decode_metrics, row_keys)


class _Store(NamedTuple):
    """What the prompts' pass leaves for admissions, one entry per prompt."""
    cache: KVCache           # [L, prompts, K, P (a sliding layer's: min(window, P)), Dh] per run
    logits: jax.Array        # [prompts, V] fp32: the first token's
    mask: jax.Array          # [prompts, P] int32
    seen: jax.Array | None   # [prompts, V] bool: its tokens, with a repetition penalty
    prompt_len: jax.Array    # [prompts] int32: real tokens (+ Qwen2.5-VL's M-RoPE delta)


class _Slots(NamedTuple):
    """The while loop's state: the slots, the queue and the round's output."""
    step: jax.Array          # [] int32: decode steps taken
    queued: jax.Array        # [] int32: the next row to admit
    busy: jax.Array          # [] int32: slot-steps that decoded a live row
    row: jax.Array           # [S] int32: the row each slot holds
    length: jax.Array        # [S] int32: tokens that row has
    free: jax.Array          # [S] bool: the slot's row ended (or it never had one)
    last: jax.Array          # [S] int32: the row's last token, fed next
    prompt_len: jax.Array    # [S] int32: the row's first decode position (_Store.prompt_len)
    key_mask: jax.Array      # [S, P + C] int32: which cache slots hold real keys
    cache: KVCache           # [L, S, K, P + C (sliding: at most the window), Dh] per run
    seen: jax.Array | None   # [S, V] bool, with a repetition penalty
    tokens: jax.Array        # [N, C] int32: the round's completions, pad after the end
    mask: jax.Array          # [N, C] int32
    logp: jax.Array          # [N, C] fp32
    # [N, C, S, k] the experts each completion token ran when fed (Sampler.record_routing; -1:
    # never fed, as a row's last token), written by the slot that decodes the row.
    routing: jax.Array | None = None


class PromptImages(NamedTuple):
    """A round's prompt images as Sampler.generate takes them (keyword names its own): blocks
    of images_per_prompt images per prompt, prompt after prompt."""
    # Gemma 3: [prompts x K, C, H, W]; Qwen-VL: [prompts x K, P, V]
    pixel_values: np.ndarray
    image_grid_thw: np.ndarray | None  # Qwen-VL: [prompts x K, 3]
    image_tokens: Sequence | None  # per prompt
    images_per_prompt: int

    def of(self, prompts: Sequence[int], n: int) -> dict:
        """generate's image arguments for these of the n prompts (repeated where named
        twice)."""
        which, k = np.asarray(prompts, np.int64), self.images_per_prompt
        def take(a):
            a = np.asarray(a)
            return a.reshape(n, -1, *a.shape[1:])[which].reshape(-1, *a.shape[1:])
        return dict(pixel_values=take(self.pixel_values),
                    image_grid_thw=(None if self.image_grid_thw is None
                                    else take(self.image_grid_thw)),
                    image_tokens=(None if self.image_tokens is None
                                  else [self.image_tokens[i] for i in which]),
                    images_per_prompt=k)


class Refill:
    """A Sampler's rounds through `sampler.sampling_params.max_num_seqs` decode slots (rounded
    up to the mesh's batch axes, over which they are split). `generate` is Sampler.generate's:
    a round that fits the slots runs as one static batch; a larger one refills slots as rows
    finish (continuous_batching) or runs in static sub-batches of at most that many rows."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        sp = sampler.sampling_params
        if sp.max_num_seqs is None:
            raise ValueError("Refill needs sampling_params.max_num_seqs (the decode slots)")
        div = 1 if sampler.mesh is None else mesh_lib.batch_divisor(sampler.mesh)
        self.slots = -(-sp.max_num_seqs // div) * div
        self.program = jax.jit(self._refill, static_argnames=("num_generations", "rows"))

    # ------------------------------------------------------------------ host side

    def generate(self, params, prompt_token_ids: Sequence[Sequence[int]],
                 num_generations: int = 1, rng: int | jax.Array = 0, pixel_values=None,
                 image_grid_thw=None, image_tokens=None,
                 images_per_prompt: int | None = None) -> RolloutBatch:
        """pixel_values, image_grid_thw, image_tokens, images_per_prompt: the prompts'
        images, as Sampler.generate takes them;
        the prompts' pass encodes each prompt's images once, its rows admit its keys and
        values (and, Qwen2.5-VL, its M-RoPE delta) into whichever slot they decode in."""
        s = self.sampler
        n = len(prompt_token_ids) * int(num_generations)
        if n <= self.slots:
            return s.generate(params, prompt_token_ids, num_generations, rng,
                              pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                              image_tokens=image_tokens, images_per_prompt=images_per_prompt)
        if not s.sampling_params.continuous_batching:
            images = None
            if pixel_values is not None:
                if images_per_prompt is None:  # HF's order: a part's images can't be told
                    raise ValueError("static sub-batches take images in blocks per prompt "
                                     "(images_per_prompt)")
                images = PromptImages(pixel_values, image_grid_thw, image_tokens,
                                      images_per_prompt)
            return self.sub_batches(params, prompt_token_ids, num_generations, rng, images)
        params, prompts, g, n, rows = s.inputs(params, prompt_token_ids, num_generations)
        ids, mask = left_pad(prompts, 1, s.bucket(max(map(len, prompts))), s.pad_id,
                             rows=s.prompt_rows(rows, g))
        args = (ids, mask)
        images = s.image_inputs(ids, mask, pixel_values, image_grid_thw, image_tokens,
                                images_per_prompt)
        if s.mesh is not None:  # as Sampler.generate: each process places its own rows
            args = tuple(dist.shard_host_array(x, mesh_lib.logical_sharding(
                s.mesh, "batch", None, shape=x.shape)) for x in args)
            params = jax.device_put(params, mesh_lib.param_shardings(params, s.mesh))
        tokens, cmask, logp, steps, busy, *routing = dist.to_host(self.program(
            params, *args, as_key(rng), np.int32(n), images, num_generations=g, rows=rows))
        tokens, cmask, logp = tokens[:n], cmask[:n], logp[:n]
        stopped = (np.isin(tokens, s.sampling_params.stop_token_ids) & (cmask > 0)).any(axis=1)
        ids, mask = np.repeat(ids, g, axis=0)[:n], np.repeat(mask, g, axis=0)[:n]
        # Every row of a prompt admits its keys and values from the one prompt pass: its record.
        prompt_routing, completion_routing = ((np.repeat(routing[0], g, axis=0)[:n],
                                               routing[1][:n]) if routing else (None, None))
        return RolloutBatch(ids, mask, tokens, cmask, ~stopped, logp,
                            metrics=decode_metrics(int(steps), int(busy), self.slots),
                            prompt_routing=prompt_routing, completion_routing=completion_routing)

    def sub_batches(self, params, prompt_token_ids, num_generations: int,
                    rng, images: "PromptImages | None" = None) -> RolloutBatch:
        """The round as consecutive static batches of at most `slots` rows (whole groups when
        they fit, so each prompt is prefilled once), each decoding until its longest row is
        done: the way without refill. Rows draw their own keys, as in one batch; each part
        takes its prompts' images (`images`: generate's, in blocks of images_per_prompt)."""
        s, g = self.sampler, int(num_generations)
        prompts = s.check_prompts(prompt_token_ids)
        fits = lambda rows: s.batch_size(rows) <= self.slots  # noqa: E731 - padded too

        def part(which: Sequence[int], n: int, first_row: int) -> RolloutBatch:
            extra = {} if images is None else images.of(which, len(prompts))
            return s.generate(params, [prompts[i] for i in which], n, rng, first_row=first_row,
                              **extra)

        per = max((k for k in range(1, len(prompts) + 1) if fits(k * g)), default=0)
        if per:  # whole groups
            parts = [part(range(i, min(i + per, len(prompts))), g, i * g)
                     for i in range(0, len(prompts), per)]
        else:  # a group is larger than the slots: each row with its own copy of the prompt
            each = [i for i in range(len(prompts)) for _ in range(g)]
            per = max(k for k in range(1, self.slots + 1) if fits(k))
            parts = [part(each[r:r + per], 1, r) for r in range(0, len(each), per)]
        width = s.bucket(max(map(len, prompts)))  # as one batch would pad the prompts
        widen = lambda x: np.pad(x, ((0, 0), (width - x.shape[1], 0)))  # noqa: E731
        cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
        routing = (None, None)
        if s.record_routing:  # a prompt's record padded like its ids: -1, nothing ran there
            routing = (np.concatenate([np.pad(p.prompt_routing, (
                (0, 0), (width - p.prompt_routing.shape[1], 0), (0, 0), (0, 0)),
                constant_values=-1) for p in parts]), cat("completion_routing"))
        wide = lambda name: np.concatenate([widen(getattr(p, name)) for p in parts])  # noqa: E731
        return RolloutBatch(wide("prompt_ids"), wide("prompt_mask"),
                            cat("completion_ids"), cat("completion_mask"), cat("truncated"),
                            cat("sampler_logp"),
                            metrics=merge_decode_metrics([p.metrics for p in parts]),
                            prompt_routing=routing[0], completion_routing=routing[1])

    # ------------------------------------------------------------------ compiled program

    def _refill(self, params, prompt_ids, prompt_mask, key, n, images=None, *,
                num_generations: int, rows: int):
        s, sp, cfg = self.sampler, self.sampler.sampling_params, self.sampler.cfg
        prompt_ids = s.constrain(prompt_ids, "batch", None)
        prompt_mask = s.constrain(prompt_mask, "batch", None)
        cast, layers, cache, logits, *prompt_routing = s.prompt_pass(
            params, prompt_ids, prompt_mask, s.record_routing, images)
        seen = None
        if sp.repetition_penalty != 1.0:
            seen = jnp.zeros((prompt_ids.shape[0], cfg.vocab_size), bool)
            seen = seen.at[jnp.arange(prompt_ids.shape[0])[:, None], prompt_ids].max(
                prompt_mask.astype(bool))
        # a row's decode positions follow its prompt's real tokens (+ its M-RoPE delta)
        prompt_len = jnp.sum(prompt_mask, axis=1) + (0 if images is None else images.deltas)
        store = _Store(cache, logits, prompt_mask, seen, prompt_len)
        model = s.decoder(cast)
        state = self._empty(prompt_ids.shape[1], rows, seen is not None)

        def admit(st):
            return self._admit(store, st, key, n, num_generations)

        def step(st):
            st = jax.lax.cond(jnp.any(st.free) & (st.queued < n), admit, lambda x: x, st)
            return self._decode(model, layers, st, key)
        state = jax.lax.while_loop(lambda st: (st.queued < n) | ~jnp.all(st.free), step, state)
        out = state.tokens, state.mask, state.logp, state.step, state.busy
        if state.routing is None:
            return out
        return (*out, prompt_routing[0], state.routing)

    def _empty(self, width: int, rows: int, penalty: bool) -> _Slots:
        s = self.sampler
        S, C, cfg = self.slots, s.sampling_params.max_completion_length, s.cfg
        slot = lambda x: s.constrain(x, "batch", *[None] * (x.ndim - 1))  # noqa: E731
        zeros = lambda shape, dtype=jnp.int32: slot(jnp.zeros(shape, dtype))  # noqa: E731
        out = lambda x: s.constrain(x, None, None)  # noqa: E731 - rows from every slot
        return _Slots(
            step=jnp.zeros((), jnp.int32), queued=jnp.zeros((), jnp.int32),
            busy=jnp.zeros((), jnp.int32), row=zeros((S,)), length=zeros((S,)),
            free=slot(jnp.ones((S,), bool)), last=zeros((S,)), prompt_len=zeros((S,)),
            key_mask=slot(jnp.concatenate([jnp.zeros((S, width), jnp.int32),
                                           jnp.ones((S, C), jnp.int32)], axis=1)),
            cache=s.constrain_cache(KVCache.zeros(cfg, S, width + C, s.cache_dtype)),
            seen=zeros((S, cfg.vocab_size), bool) if penalty else None,
            tokens=out(jnp.full((rows, C), s.pad_id, jnp.int32)),
            mask=out(jnp.zeros((rows, C), jnp.int32)),
            logp=out(jnp.zeros((rows, C), jnp.float32)),
            routing=s.constrain(jnp.full((rows, C, sum(cfg.moe_layers), cfg.num_experts_per_tok),
                                         -1, moe.routing_dtype(cfg.num_experts)),
                                None, None, None, None) if s.record_routing else None)

    def _admit(self, store: _Store, st: _Slots, key, n, g: int) -> _Slots:
        """The free slots take the next waiting rows: their prompts' keys and values, masks
        and token sets from the store, and their first tokens from the prompts' logits."""
        s, S = self.sampler, self.slots
        new = st.queued + jnp.cumsum(st.free) - 1  # the k-th free slot takes the k-th waiting row
        admit = st.free & (new < n)
        row = jnp.where(admit, new, st.row)
        prompt = jnp.where(admit, new // g, 0)
        at = jnp.where(admit, jnp.arange(S), S)  # S: out of range, the write is dropped
        width = store.mask.shape[1]

        def copy(buf, src):  # the prompt's slots of one run's buffer
            return buf.at[:, at, :, :src.shape[3]].set(src[:, prompt], mode="drop")
        cache = KVCache(*(tuple(map(copy, part, src)) for part, src in zip(st.cache, store.cache)))
        seen = None if st.seen is None else st.seen.at[at].set(store.seen[prompt], mode="drop")
        st = st._replace(
            queued=st.queued + jnp.sum(admit), row=row, free=st.free & ~admit,
            length=jnp.where(admit, 0, st.length),
            prompt_len=jnp.where(admit, store.prompt_len[prompt], st.prompt_len),
            key_mask=st.key_mask.at[at, :width].set(store.mask[prompt], mode="drop"),
            cache=s.constrain_cache(cache), seen=seen)
        token, logp = sampling.sample(row_keys(key, 0, row), store.logits[prompt],
                                      s.sampling_params, seen)
        return self._record(st, admit, token, logp)

    def _decode(self, model, layers, st: _Slots, key) -> _Slots:
        """Every slot feeds its last token at its own cache index and samples the next."""
        s = self.sampler
        live = ~st.free
        width = st.key_mask.shape[1] - s.sampling_params.max_completion_length
        hidden, cache, *chosen = model(
            st.last[:, None], (st.prompt_len + st.length - 1)[:, None], st.key_mask,
            cache=st.cache, cache_index=width + st.length - 1, layers=layers,
            record_routing=st.routing is not None)
        if chosen:  # the experts of the token each live slot fed: its row's token length - 1
            at = jnp.where(live, st.row, st.routing.shape[0])  # a slot not live writes nowhere
            st = st._replace(routing=st.routing.at[at, jnp.maximum(st.length - 1, 0)].set(
                chosen[0][:, 0].astype(st.routing.dtype), mode="drop"))
        token, logp = sampling.sample(row_keys(key, st.length, st.row),
                                      model.logits(hidden)[:, 0], s.sampling_params, st.seen)
        st = st._replace(step=st.step + 1, busy=st.busy + jnp.sum(live),
                         cache=s.constrain_cache(cache))
        return self._record(st, live, token, logp)

    def _record(self, st: _Slots, live, token, logp) -> _Slots:
        """The live slots' new tokens into their rows' outputs; a row that stops (a stop
        token, or max_completion_length tokens) frees its slot."""
        sp = self.sampler.sampling_params
        at = jnp.where(live, st.row, st.tokens.shape[0])  # a slot not live writes nowhere
        put = lambda buf, x: buf.at[at, st.length].set(x.astype(buf.dtype), mode="drop")  # noqa
        length = st.length + live
        ends = length >= sp.max_completion_length
        if sp.stop_token_ids:
            ends = ends | jnp.isin(token, jnp.asarray(sp.stop_token_ids))
        seen = st.seen
        if seen is not None:
            seen = seen.at[jnp.arange(self.slots), token].max(live)
        return st._replace(tokens=put(st.tokens, token), mask=put(st.mask, live),
                           logp=put(st.logp, logp), length=length,
                           last=jnp.where(live, token, st.last),
                           free=st.free | (live & ends), seen=seen)
