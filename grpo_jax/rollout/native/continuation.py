"""Multi-turn generation that continues from the native sampler's KV cache.

A tool-calling rollout (grpo_jax.rollout.tools) appends a few tool-result tokens to each row
and lets the model write its next turn. Re-prefilling prompt + every earlier turn for that costs
a pass over the whole context per turn; here each row's keys and values stay on the device
after a turn and the next turn prefills only the tokens the cache lacks (the tool suffix, and
a last generated token the decode loop never fed), then decodes as the sampler does.

Layout. The cache shares one write index across rows (`Decoder.__call__`) while rows end their
turns at different lengths. Leaving the gaps in place (masked in `key_mask`) would grow the
cache by the longest row's turn plus a suffix bucket every turn; instead each turn starts by
re-aligning the rows: one gather copies every row's real slots, in order, right-aligned to a
common width `base` (a row's keys already carry their RoPE positions, so only the mask and the
next positions care where a key sits). The suffix, left-padded to a bucket of Tb tokens, is
written at [base, base + Tb) and the turn decodes from base + Tb over C more slots, as the
sampler's decode step expects (its `width` is the cache's length less C). So a turn's cache
holds bucket(longest kept context + Tb) + C slots whatever the number of turns, and a run
compiles one program per (batch, context bucket, suffix bucket) and one copy per cache shape.

Sliding-window models (Gemma, Mistral) keep a ring of `window` slots per sliding layer; their
slots can't be re-aligned nor several tokens written at once (`decoder._write`), so they fall
back to re-prefilling the whole context (`supported`).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import distributed as dist
from grpo_jax import mesh as mesh_lib
from grpo_jax.models import moe
from grpo_jax.rollout.native.sampler import (DecodeContext, DecodeState, RolloutBatch, Sampler,
                                             as_key, cast_matrices, decode_metrics, left_pad)
from grpo_jax.shapes import next_pow2

MIN_SUFFIX_BUCKET = 8  # suffixes pad to 8, 16, 32, ... tokens: a handful of programs


class Session(NamedTuple):
    """The device cache after a turn and, per cache row, which tokens it holds where."""
    cache: object               # KVCache [L, B, K, S, Dh] per run of layers
    tokens: list[np.ndarray]    # [row] the tokens whose keys and values are cached, in order
    slots: list[np.ndarray]     # [row] the cache slot of each of those tokens


def supported(sampler: Sampler) -> bool:
    """False for models with sliding-window layers: their ring caches re-prefill instead."""
    return not any(sampler.cfg.sliding_layers)


class Continuation:
    """`first_turn` samples like `Sampler.generate` and keeps the cache; `next_turn` extends
    chosen rows by their new context tokens and samples their next turn from the cache. A
    sampler that records routing (a mixture of experts) records it in every turn: the tokens
    a turn prefills as its prompt_routing, those it decodes as its completion_routing
    (rollout/tools.py places them in the rows)."""

    def __init__(self, sampler: Sampler):
        if not supported(sampler):
            raise NotImplementedError("continuing from a sliding-window ring cache; re-prefill "
                                      "the context with Sampler.generate")
        self.sampler = sampler
        self._first = jax.jit(self._first_program, static_argnames=("num_generations", "rows"))
        self._align = jax.jit(self._align_program, static_argnames=("width",))
        self._next = jax.jit(self._next_program, donate_argnums=(1,))

    # ------------------------------------------------------------------ host side

    def first_turn(self, params, prompt_token_ids, num_generations: int,
                   rng) -> tuple[RolloutBatch, Session]:
        """`Sampler.generate`'s rollout (the same tokens for the same rng), and its cache."""
        s = self.sampler
        params, prompts, g, n, rows = s.inputs(params, prompt_token_ids, num_generations)
        width = s.bucket(max(map(len, prompts)))
        ids, mask = left_pad(prompts, 1, width, s.pad_id, rows=s.prompt_rows(rows, g))
        params, (ids_d, mask_d) = self._place(params, ids, mask)
        *out, step, cache, routing = self._first(params, ids_d, mask_d, as_key(rng),
                                                 num_generations=g, rows=rows)
        tokens, cmask, logp, done, step, routing = dist.to_host((*out, step, routing))
        lengths = cmask.sum(axis=1)
        ids, mask = np.repeat(ids, g, axis=0)[:n], np.repeat(mask, g, axis=0)[:n]
        held, slots = [], []
        for r in range(rows):
            fed = min(lengths[r], int(step) - 1)  # the loop never fed its last sampled token
            p = prompts[r // g] if r < n else np.zeros(0, np.int32)
            held.append(np.concatenate([p, tokens[r, :fed]]))
            slots.append(np.concatenate([np.arange(width - len(p), width), width + np.arange(fed)]))
        batch = RolloutBatch(ids, mask, tokens[:n], cmask[:n], ~done[:n], logp[:n],
                             metrics=_metrics(step, cmask), **_routing(routing, n))
        return batch, Session(cache, held, slots)

    def next_turn(self, params, session: Session, rows: Sequence[int],
                  contexts: Sequence[Sequence[int]], limits: Sequence[int],
                  rng) -> tuple[RolloutBatch, Session]:
        """Sample one more turn for each context j: the whole sequence so far (prompt, turns,
        tool results), which extends session row rows[j]. limits[j]: the most tokens row j may
        write (the completion budget left). Row j of the result is context j's; its sampling
        keys are those `Sampler.generate(contexts, 1, rng)` would use for row j.

        The returned batch's prompt_ids / prompt_mask are the tokens this turn prefilled
        (each row's uncached context tail, left-padded to the suffix bucket), not the contexts,
        and with a routing record its prompt_routing is theirs; a row that wrote its limit
        counts as done (not truncated).
        """
        s = self.sampler
        params = s.check_params(params)
        contexts = s.check_prompts(contexts)
        if not len(rows) == len(contexts) == len(limits):
            raise ValueError(f"{len(rows)} rows, {len(contexts)} contexts and {len(limits)} "
                             "limits: give one row and one limit per context")
        n, B = len(contexts), s.batch_size(len(contexts))
        # The context's prefix the row's cache holds; at least the last token is fed, since its
        # logits start the turn.
        cached = [min(_common_prefix(session.tokens[r], c), len(c) - 1)
                  for r, c in zip(rows, contexts)]
        suffixes = [c[k:] for c, k in zip(contexts, cached)]
        T = max(MIN_SUFFIX_BUCKET, next_pow2(max(map(len, suffixes))))
        width = s.bucket(max(cached) + T)
        base = width - T
        src_row, src_slot = np.zeros(B, np.int32), np.zeros((B, base), np.int32)
        content = np.zeros((B, base), np.int32)
        for j, (r, k) in enumerate(zip(rows, cached)):
            src_row[j] = r
            src_slot[j, base - k:] = session.slots[r][:k]
            content[j, base - k:] = 1
        ids, mask = left_pad(suffixes, 1, T, s.pad_id, rows=B)
        start = np.zeros(B, np.int32)
        start[:n] = cached
        limit = np.zeros(B, np.int32)
        limit[:n] = limits
        seen = None
        if s.sampling_params.repetition_penalty != 1.0:
            seen = np.zeros((B, s.cfg.vocab_size), bool)
            for j, c in enumerate(contexts):
                seen[j, c] = True
        params, placed = self._place(params, src_row, src_slot, content, ids, mask, start, limit,
                                     *([] if seen is None else [seen]))
        cache = self._align(session.cache, *placed[:2],
                            width=width + s.sampling_params.max_completion_length)
        *out, step, cache, routing = self._next(params, cache, *placed[2:7],
                                                None if seen is None else placed[7],
                                                as_key(rng))
        tokens, cmask, logp, done, step, routing = dist.to_host((*out, step, routing))
        held, slots = [], []
        for j in range(B):
            c = contexts[j] if j < n else np.zeros(0, np.int32)
            k, fed = int(start[j]), min(int(cmask[j].sum()), int(step) - 1)
            held.append(np.concatenate([c, tokens[j, :fed]]))
            slots.append(np.concatenate([np.arange(base - k, base),
                                         np.arange(width - (len(c) - k), width),
                                         width + np.arange(fed)]))
        batch = RolloutBatch(ids[:n], mask[:n], tokens[:n], cmask[:n], ~done[:n], logp[:n],
                             metrics=_metrics(step, cmask), **_routing(routing, n))
        return batch, Session(cache, held, slots)

    def _place(self, params, *arrays):
        """The params and the [B, ...] host arrays where the programs want them: with a mesh,
        rows over the batch axes (each process placing its own devices' rows)."""
        s = self.sampler
        if s.mesh is None:
            return params, tuple(jnp.asarray(x) for x in arrays)
        params = jax.device_put(params, mesh_lib.param_shardings(params, s.mesh))
        return params, tuple(dist.shard_host_array(x, mesh_lib.logical_sharding(
            s.mesh, "batch", *[None] * (x.ndim - 1), shape=x.shape)) for x in arrays)

    # ------------------------------------------------------------------ compiled programs

    def _first_program(self, params, prompt_ids, prompt_mask, key, *, num_generations: int,
                       rows: int):
        s = self.sampler
        ctx, state = s.prefill(params, prompt_ids, prompt_mask, key, num_generations, rows)
        state = self._decode(ctx, state, key, lambda st: st)
        routing = None if state.routing is None else (ctx.prompt_routing, state.routing)
        return state.tokens, state.mask, state.logp, state.done, state.step, state.cache, routing

    def _align_program(self, cache, src_row, src_slot, *, width: int):
        """Row j of the new cache: old row src_row[j]'s slots src_slot[j] (right-aligned real
        keys; masked filler elsewhere), then zeros up to `width` slots."""
        def one(x):  # [L, B, K, S, Dh]
            x = jnp.take_along_axis(x[:, src_row], src_slot[None, :, None, :, None], axis=3)
            return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, width - x.shape[3]), (0, 0)))
        return self.sampler.constrain_cache(jax.tree.map(one, cache))

    def _next_program(self, params, cache, content_mask, ids, mask, start, limit, seen, key):
        """Prefill the suffix ids [B, T] into the re-aligned cache at slot base =
        content_mask.shape[1], then decode. start: each row's cached tokens (its suffix's first
        position); limit: the most tokens each row may write."""
        s = self.sampler
        cfg, C = s.cfg, s.sampling_params.max_completion_length
        cast = cast_matrices(params, cfg.dtype)
        model = s.decoder(cast)
        layers = model.decode_layers()
        B = ids.shape[0]
        positions = start[:, None] + jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        key_mask = jnp.concatenate([content_mask, mask, jnp.ones((B, C), jnp.int32)], axis=1)
        record = s.record_routing
        hidden, cache, *chosen = model(ids, positions, key_mask, cache=cache,
                                       cache_index=content_mask.shape[1], layers=layers,
                                       record_routing=record)
        logits = model.logits(hidden[:, -1:])[:, 0]  # left padding: the last slot is real
        routing = None
        if record:
            # The prefilled tokens' experts (-1 on the suffix's padding), as the sampler's
            # prompt pass records the prompt's: training forwards a tool result's tokens too.
            dtype = moe.routing_dtype(cfg.num_experts)
            routing = s.constrain(jnp.full((B, C, *chosen[0].shape[2:]), -1, dtype),
                                  "batch", None, None, None)
            suffix = jnp.where(mask.astype(bool)[:, :, None, None], chosen[0], -1).astype(dtype)
        ctx = DecodeContext(cast, layers, key_mask, start + jnp.sum(mask, axis=1))
        rows = lambda x: s.constrain(x, "batch", None)  # noqa: E731
        state = DecodeState(step=jnp.zeros((), jnp.int32), rows=jnp.arange(B, dtype=jnp.int32),
                       tokens=rows(jnp.full((B, C), s.pad_id, jnp.int32)),
                       mask=rows(jnp.zeros((B, C), jnp.int32)),
                       logp=rows(jnp.zeros((B, C), jnp.float32)),
                       done=~jnp.any(mask.astype(bool), axis=1) | (limit <= 0),
                       cache=s.constrain_cache(cache), seen=seen, routing=routing)
        # A row that has written its budget is done: the loop ends when the longest allowed
        # row does, not after C tokens.
        cap = lambda st: st._replace(done=st.done | (st.step >= limit))  # noqa: E731
        state = self._decode(ctx, cap(s.emit(state, logits, key)), key, cap)
        routing = (suffix, state.routing) if record else None
        return state.tokens, state.mask, state.logp, state.done, state.step, state.cache, routing

    def _decode(self, ctx: DecodeContext, state: DecodeState, key, cap) -> DecodeState:
        C = self.sampler.sampling_params.max_completion_length
        return jax.lax.while_loop(lambda st: (st.step < C) & ~jnp.all(st.done),
                                  lambda st: cap(self.sampler.decode_step(ctx, st, key)), state)


def _metrics(step, cmask) -> dict:
    """decode_metrics of a turn: the prefill sampled each row's first token, the loop the rest."""
    return decode_metrics(max(int(step) - 1, 0), int(np.maximum(cmask.sum(axis=1) - 1, 0).sum()),
                          len(cmask))


def _routing(routing, n: int) -> dict:
    """A turn's routing record as RolloutBatch fields, its first n rows (none without one)."""
    if routing is None:
        return {}
    prompt, completion = routing
    return dict(prompt_routing=prompt[:n], completion_routing=completion[:n])


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    k = min(len(a), len(b))
    differ = np.flatnonzero(a[:k] != b[:k])
    return int(differ[0]) if differ.size else k
