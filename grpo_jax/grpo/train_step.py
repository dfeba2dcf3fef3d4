"""The GRPO train step: a pure function from (state, batch) to (state, metrics), jitted and
sharded by grpo_jax.policy.

Micro-batches run under `lax.scan`; the policy loss is (numerator, denominator) sums whose
denominator depends on the masks only, so k micro-batches give the gradient of one big batch (see
loss.py for each loss_type, and for the entropy bonus's per-micro-batch mean).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from grpo_jax import image_blocks
from grpo_jax import mesh as mesh_lib
from grpo_jax.grpo import loss as loss_lib
from grpo_jax.grpo import packing
from grpo_jax.grpo.batch import Batch
from grpo_jax.grpo.logprobs import token_logprobs
from grpo_jax.models import attention, decoder, lora, moe


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the step's math needs: values taken from the run's settings, never defaults of
    their own (tests/test_config.py checks that each setting is declared once)."""
    loss: loss_lib.LossConfig
    temperature: float
    gradient_accumulation_steps: int
    logprob_chunk: int = 128  # sequence positions per log-softmax chunk (memory, not a setting)
    # LoRA dropout's masks come from this seed, the step and the micro-batch: train.py passes
    # the run's data.seed, so a resumed run draws the masks it would have drawn.
    dropout_seed: int = 0
    # A mixture of experts' load-balancing loss coefficient as resolved by
    # moe.router_aux_loss_coef (the loss's router_aux_loss_coef, else the checkpoint's); 0: off.
    aux_loss_coef: float = 0.0


class TrainState(NamedTuple):
    params: Any  # nnx.State of fp32 master params
    opt_state: Any
    step: jax.Array  # int32 scalar: optimizer steps taken (a skipped update counts too)
    # use_adaptive_entropy only (else None, no leaves): TRL's controller state, checkpointed
    # with the rest. fp32 scalars: the coefficient, and the last step's token-mean entropy.
    entropy_coef: Any = None
    last_entropy: Any = None


def init_train_state(params, opt_state, loss: loss_lib.LossConfig) -> TrainState:
    """A first step's state: step 0 and, with use_adaptive_entropy, the coefficient at
    entropy_coef and last_entropy at inf (TRL: no bonus until a step has measured entropy)."""
    state = TrainState(params, opt_state, jnp.zeros((), jnp.int32))
    if loss.use_adaptive_entropy:
        state = state._replace(entropy_coef=jnp.asarray(loss.entropy_coef, jnp.float32),
                               last_entropy=jnp.asarray(jnp.inf, jnp.float32))
    return state


def state_shardings(loss: loss_lib.LossConfig, params, opt_state, scalar) -> TrainState:
    """TrainState-shaped shardings: `params` and `opt_state` as given, `scalar` (replicated)
    for the step and, with use_adaptive_entropy, the controller's scalars."""
    extra = (scalar, scalar) if loss.use_adaptive_entropy else ()
    return TrainState(params, opt_state, scalar, *extra)


def completion_logps(model, batch: Batch, temperature: float, chunk: int, group: int = 1):
    """Per-token log-probs (and entropies) of the completion tokens under `model`. `group` > 1:
    every block of `group` consecutive rows shares its prompt (Policy.prompt_group checks it),
    which then runs once per block (Decoder.shared_prefix); the same values as group 1."""
    return completion_logps_and_router(model, batch, temperature, chunk, group)[:2]


def completion_logps_and_router(model, batch: Batch, temperature: float, chunk: int,
                                group: int = 1):
    """completion_logps, the router statistics of every row's real prompt and completion
    tokens (moe.RouterStats; None for a dense model): what transformers' load-balancing loss
    counts when TRL runs the micro-batch with its attention mask, and router/mismatch's sums
    (moe.routing_mismatch_sums: the completion tokens' expert sets that differ from the
    sampler's record; None when the batch carries no record). With a context axis the
    positions run in the decoder's `sequence_order` (split over the axis, load-balanced)
    through the log-prob head too: only the [N, C] results are put back in sequence order.

    Routing replay (numerics.router_replay R3, a batch with the sampler's record): every
    token runs the experts the sampler ran (models/moe.py)."""
    logp, entropy, stats, chosen = _forward(model, batch, temperature, chunk, group)
    if chosen is None:
        return logp, entropy, stats, None
    return logp, entropy, stats, moe.routing_mismatch_sums(chosen, batch.completion_routing,
                                                            batch.completion_mask)


def _forward(model, batch: Batch, temperature: float, chunk: int, group: int = 1):
    """(logp, entropy, RouterStats or None, the experts each completion token ran [N, C, S, k]
    or None without the sampler's record) of completion_logps_and_router."""
    P_len, C = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    record = batch.completion_routing is not None
    replay = record and model.cfg.numerics.replay
    head = functools.partial(token_logprobs, head_w=model.head_weight(), temperature=temperature,
                             chunk_size=chunk, softcap=model.cfg.final_logit_softcapping,
                             layout=model.head_layout)
    # Position t predicts token t + 1: targets shifted left (the last one predicts nothing).
    shift = lambda ids: jnp.pad(ids[:, 1:], ((0, 0), (0, 1)))  # noqa: E731
    # LoRA dropout draws its masks per row: a shared prompt would share them.
    if batch.packing is not None and group > 1 and model.lora_dropout_key is None:
        return (*_packed_forward(model, batch, head, group), None)
    if group > 1 and model.lora_dropout_key is None:
        o_p, o_c = model.sequence_order(P_len), model.sequence_order(C)
        # Images: a group's prompt, its images with it, runs once (the tower too).
        embeds = None if batch.pixel_values is None else prompt_embeds(model, batch, group)
        positions = (None if batch.positions is None else  # M-RoPE's [N, 3, P + C]
                     (batch.positions[::group, :, :P_len].transpose(1, 0, 2),
                      batch.positions[:, :, P_len:].transpose(1, 0, 2)))
        prompt, hidden, stats, *chosen = model.shared_prefix(
            batch.prompt_ids[::group], batch.prompt_mask[::group], batch.completion_ids,
            batch.completion_mask, group, orders=(o_p, o_c), with_router=True,
            routing=(batch.prompt_routing[::group], batch.completion_routing) if replay else None,
            record_routing=record, prompt_embeds=embeds, positions=positions,
            completion_embeds=(None if batch.completion_images is None
                               else completion_embeds(model, batch)))
        chosen = chosen[0][1] if chosen else None
        at = P_len - 1 if o_p is None else int(np.flatnonzero(o_p == P_len - 1)[0])
        last = model.shard_rows(jnp.repeat(prompt[:, at:at + 1], group, axis=0))
        if o_c is None:
            hidden = jnp.concatenate([last, hidden[:, :C - 1]], axis=1)  # t predicts t + 1
            return (*head(hidden, targets=batch.completion_ids), stats, chosen)
        first = head(last, targets=batch.completion_ids[:, :1])
        rest = head(hidden, targets=shift(batch.completion_ids)[:, o_c],
                    seq_shards=mesh_lib.context_size(model.mesh))
        back = attention.inverse(o_c)
        return (*(jnp.concatenate([a, b[:, back][:, :C - 1]], axis=1)
                  for a, b in zip(first, rest)), stats, chosen)
    ids = jnp.concatenate([batch.prompt_ids, batch.completion_ids], axis=1)
    mask = jnp.concatenate([batch.prompt_mask, batch.completion_mask], axis=1)
    positions = (jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0) if batch.positions is None
                 else batch.positions.transpose(1, 0, 2))  # M-RoPE's [3, N, P + C]
    embeds = None if batch.pixel_values is None else multimodal_embeds(model, batch)
    order = model.sequence_order(P_len + C)
    routing = None
    if replay:
        routing = jnp.concatenate([batch.prompt_routing, batch.completion_routing], axis=1)
    hidden, _, stats, *chosen = model(ids, positions, mask, order=order, with_router=True,
                                      routing=routing, record_routing=record,
                                      inputs_embeds=embeds)
    chosen = chosen[0][:, P_len:] if chosen else None  # in sequence order
    if order is None:
        hidden = hidden[:, P_len - 1:P_len - 1 + C]  # position t predicts token t + 1
        return (*head(hidden, targets=batch.completion_ids), stats, chosen)
    out = head(hidden, targets=shift(ids)[:, order],
               seq_shards=mesh_lib.context_size(model.mesh))
    back = attention.inverse(order)
    return (*(x[:, back][:, P_len - 1:P_len - 1 + C] for x in out), stats, chosen)


def _packed_forward(model, batch: Batch, head, group: int):
    """_forward's (logp, entropy, RouterStats or None) of a text batch whose completions run
    packed (batch.packing, grpo/packing.py): the packed rows' tokens gathered from the batch,
    their log-probs put back in [N, C] order. Each token is predicted by the one before it in
    its segment, a segment's first by its own prompt's last position; positions are the
    unpacked rows' (the prompt's length plus the completion mask's running count), so every
    token's values are the unpacked forward's up to rounding."""
    pk = batch.packing
    if (not packing.packable(batch)
            or model.sequence_order(batch.completion_ids.shape[1]) is not None):
        raise ValueError("padding_free packs text completions without a routing record or a "
                         "context axis only (grpo/packing.py plans no other)")
    N, C = batch.completion_ids.shape
    M, P_len = pk.rows, batch.prompt_ids.shape[1]
    real = pk.segment >= 0
    ids = jnp.where(real, batch.completion_ids.reshape(-1)[pk.slot], 0)
    mask = jnp.where(real, batch.completion_mask.reshape(-1)[pk.slot], 0)
    rank = jnp.cumsum(batch.completion_mask, axis=1).reshape(-1)[pk.slot]
    prompt_mask = batch.prompt_mask[::group]
    lengths = jnp.sum(prompt_mask, axis=1)[jnp.maximum(pk.segment, 0) // group]  # [M, C]
    positions = (decoder.positions_from_mask(prompt_mask), jnp.maximum(lengths + rank - 1, 0))
    prompt, hidden, stats = model.shared_prefix(
        batch.prompt_ids[::group], prompt_mask, ids, mask, group, with_router=True,
        positions=positions, packing=(pk.prompt, pk.segment))
    # The token before each slot in its row; a segment's first (row r's, at back[r, 0]) gets
    # its prompt's last position instead (an empty row's goes nowhere).
    before = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :C - 1]], axis=1)
    starts = jnp.where(jnp.any(batch.completion_mask > 0, axis=1), pk.back[:, 0], M * C)
    last = jnp.repeat(prompt[:, P_len - 1], group, axis=0)  # [N, D]
    before = before.reshape(M * C, -1).at[starts].set(last, mode="drop").reshape(hidden.shape)
    return (*(x.reshape(-1)[pk.back].reshape(N, C)
              for x in head(model.shard_rows(before), targets=ids)), stats)


def multimodal_embeds(model, batch: Batch) -> jax.Array:
    """[N, P + C, D] input embeddings of a batch with images: the prompts' through
    embed_multimodal with each row's images (the tower frozen, no gradient reaching it, unless
    it has LoRA adapters: lora.tower_adapted), the completions' through completion_embeds."""
    return jnp.concatenate([prompt_embeds(model, batch), completion_embeds(model, batch)],
                           axis=1)


def completion_embeds(model, batch: Batch) -> jax.Array:
    """[N, C, D]: the completions' embeddings, the tokens' own (a sampled placeholder id is
    text there, as the sampler fed it) but in tool results (tool_mask 0): there a placeholder
    (completion_images) takes the features of the row's next image after its prompt's, as
    transformers' forward over prompt + completion places the row's images (TRL passes the
    prompt's then the tool results'). The tower runs over every row's images for that only
    when some completion of the batch holds a tool's image (lax.cond: a tool loop's batches on
    a vision-language model carry completion_images whether or not a tool returned one)."""
    ids = batch.completion_ids
    k = image_blocks.count(batch.pixel_values)
    if batch.completion_images is None or not k:
        return model.embed_text(ids)
    image_id = model.cfg.vision.image_token_id
    is_image = batch.completion_images.astype(bool)
    before = jnp.sum((batch.prompt_ids == image_id) & (batch.prompt_mask > 0), axis=1,
                     dtype=jnp.int32)  # the prompt's placeholders: one feature each
    pv = batch.pixel_values
    grid = None if batch.image_grid is None else batch.image_grid.reshape(-1, 3)
    text = model.embed_text(ids)

    def with_images():
        return model.embed_multimodal(
            ids, pv.reshape(-1, *pv.shape[2:]), grid, frozen_tower=not lora.tower_adapted(model),
            is_image=is_image, first_image=jnp.arange(pv.shape[0], dtype=jnp.int32) * k,
            skip=before).astype(text.dtype)
    return jax.lax.cond(jnp.any(is_image), with_images, lambda: text)


def prompt_embeds(model, batch: Batch, group: int = 1) -> jax.Array:
    """[N / group, P, D]: the prompt embeddings (embed_multimodal) of every group-th row, with
    its images: of each prompt once where blocks of `group` rows share it. Each row's block of
    k images (its own, then blanks: image_blocks) feeds its own placeholders only."""
    pv, ids = batch.pixel_values[::group], batch.prompt_ids[::group]
    k = image_blocks.count(pv)
    if not k:  # no prompt of the batch holds an image
        return model.embed_text(ids)
    grid = None if batch.image_grid is None else batch.image_grid[::group].reshape(-1, 3)
    return model.embed_multimodal(ids, pv.reshape(-1, *pv.shape[2:]), grid,
                                  frozen_tower=not lora.tower_adapted(model),
                                  first_image=jnp.arange(pv.shape[0], dtype=jnp.int32) * k)


def _micro_loss(params, graphdef, cfg: StepConfig, mb: Batch, frozen=(),
                dropout_key=None, group: int = 1) -> loss_lib.MicroLoss:
    model = lora.with_dropout(nnx.merge(graphdef, params, *frozen), dropout_key)
    logp, entropy, stats, mismatch = completion_logps_and_router(model, mb, cfg.temperature,
                                                                 cfg.logprob_chunk, group)
    out = loss_lib.micro_loss_terms(logp, entropy, mb, cfg.loss)
    if mismatch is not None:  # per generation, as the sampling/* metrics (loss.PER_GENERATION)
        out = out._replace(sums={**out.sums, "mean": {**out.sums["mean"],
                                                      moe.ROUTER_MISMATCH: mismatch}})
    if stats is None:
        return out
    aux = moe.aux_loss(stats) if cfg.aux_loss_coef else None
    return out._replace(aux_loss=aux, sums=moe.router_metric_sums(
        out.sums, stats, aux, model.cfg.num_experts_per_tok))


def loss_and_grads(graphdef, cfg: StepConfig, params, batch: Batch,
                   constrain: Callable[[jax.Array], jax.Array] = lambda x: x,
                   entropy_coef=None, frozen=(), dropout_key=None, group: int = 1,
                   micro_batches: int | None = None):
    """Exact (loss, grads, per-micro-batch metric sums) of the model's params over `batch`,
    split into `micro_batches` (default gradient_accumulation_steps) micro-batches
    (accumulate). `entropy_coef`: the entropy bonus's
    coefficient to apply (None: the config's). `constrain` lays out each [k, rows, ...] split
    (the trainer keeps rows on the batch axes). `frozen`: states of the model that are not
    trained (with LoRA, the base's params), merged with `params` into the model.
    `dropout_key`: LoRA dropout on (micro-batch j draws from fold_in(dropout_key, j)); None:
    off. `group`: rows per shared prompt in each micro-batch (completion_logps)."""
    def micro(p, mb, j):
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, j)
        return _micro_loss(p, graphdef, cfg, mb, frozen, key, group)
    return accumulate(micro, cfg, params, batch, constrain, entropy_coef, micro_batches)


def accumulate(micro_loss: Callable[[Any, Batch, jax.Array], loss_lib.MicroLoss],
               cfg: StepConfig, params, batch: Batch,
               constrain: Callable[[jax.Array], jax.Array] = lambda x: x, entropy_coef=None,
               micro_batches: int | None = None):
    """(loss, grads w.r.t. params, metric sums stacked [k, ...], one per micro-batch) over
    `batch` split into k micro-batches (default gradient_accumulation_steps; fewer for the
    partial window that ends an epoch, as transformers' current_gradient_accumulation_steps);
    micro_loss(params, micro_batch, j) gives the j-th micro-batch's MicroLoss. The policy loss's
    denominator depends on the masks only, never on the params, so it is summed over all
    micro-batches first; each micro-batch then adds numerator / denominator - entropy_coef *
    entropy_mean / k (see loss.py) to the loss and its gradient to the sum: k micro-batches give
    one big batch's loss and gradient. A mixture of experts' load-balancing loss is added per
    micro-batch as TRL adds it, coef * aux / k: the mean of the micro-batches' aux losses (each
    one's own routing statistics, as transformers computes it per forward), so k micro-batches
    give TRL's k-micro-batch loss and gradient."""
    k = micro_batches or cfg.gradient_accumulation_steps
    micro = jax.tree.map(lambda x: constrain(x.reshape(k, x.shape[0] // k, *x.shape[1:])), batch)
    dens = jax.vmap(lambda mask, trunc, items: loss_lib.loss_denominator(
        mask, trunc, cfg.loss, items))(micro.model_mask(), micro.truncated, micro.num_items)
    denom = jnp.maximum(dens.sum(), 1e-8)
    coef = cfg.loss.entropy_coef if entropy_coef is None else entropy_coef

    def objective(p, mb, j):
        out = micro_loss(p, mb, j)
        value = out.numerator / denom
        if out.entropy_mean is not None:
            value = value - coef * out.entropy_mean / k
        if out.aux_loss is not None:  # TRL: coef * the micro-batch's aux loss / k
            value = value + cfg.aux_loss_coef * out.aux_loss / k
        return value, loss_lib.with_step_denominator(out.sums, denom, cfg.loss)

    value_and_grad = jax.value_and_grad(objective, has_aux=True)

    def step(carry, xs):
        grads, loss = carry
        (v, s), g = value_and_grad(params, *xs)
        return (jax.tree.map(jnp.add, grads, g), loss + v), s

    init = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
    (grads, loss), sums = jax.lax.scan(step, init, (micro, jnp.arange(k)))
    return loss, grads, sums


def batch_loss(graphdef, cfg: StepConfig, state: TrainState, batch: Batch, frozen=(),
               group: int = 1):
    """TRL's evaluation loss: `batch` as one micro-batch (no accumulation), no gradients, with
    the entropy bonus the next step would apply (evaluation never moves its controller).
    Returns the metrics of a step (TRL's names), "loss" among them."""
    lc = cfg.loss
    coef = loss_lib.applied_entropy_coef(state.entropy_coef, state.last_entropy, lc)
    out = _micro_loss(state.params, graphdef, cfg, batch, frozen, group=group)
    den = loss_lib.loss_denominator(batch.model_mask(), batch.truncated, lc, batch.num_items)
    loss = out.numerator / jnp.maximum(den, 1e-8)
    if out.entropy_mean is not None:
        loss = loss - coef * out.entropy_mean
    if out.aux_loss is not None:
        loss = loss + cfg.aux_loss_coef * out.aux_loss
    metrics = loss_lib.finalize_metrics(out.sums)
    metrics.pop(loss_lib.ADAPTIVE_ENTROPY, None)
    return {**metrics, "loss": loss}


def finish_entropy_control(state: TrainState, metrics: dict, loss: loss_lib.LossConfig):
    """After a step's update: with use_adaptive_entropy, move the carried coefficient by the
    step's token-mean entropy (taken out of `metrics`) and remember that entropy; with any entropy
    bonus, log the coefficient ("entropy_coef", after the move, as TRL). Returns (state,
    metrics)."""
    metrics = dict(metrics)
    if loss.use_adaptive_entropy:
        step_entropy = metrics.pop(loss_lib.ADAPTIVE_ENTROPY).astype(jnp.float32)
        state = state._replace(
            entropy_coef=loss_lib.update_entropy_coef(state.entropy_coef, step_entropy, loss),
            last_entropy=step_entropy)
    if loss.entropy_bonus:
        metrics["entropy_coef"] = (state.entropy_coef if loss.use_adaptive_entropy
                                   else jnp.asarray(loss.entropy_coef, jnp.float32))
    return state, metrics


def train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule,
               cfg: StepConfig, state: TrainState, batch: Batch,
               constrain: Callable[[jax.Array], jax.Array] = lambda x: x, frozen=(),
               group: int = 1, micro_batches: int | None = None):
    """One optimizer update over `batch` ([N, ...] arrays, N = micro-batches x micro size).
    `tx` skips non-finite updates (grpo.optimizer); the step counts them all the same, as
    TRL's global_step does, and reports the skip. With use_adaptive_entropy the entropy
    coefficient moves once per step (a skipped update too, as in TRL), from the step's
    token-mean entropy. `frozen`, `group`, `micro_batches`: see loss_and_grads; only
    state.params are trained. Metrics: the step's scalars (loss, grad_norm, learning_rate,
    skipped_updates, entropy_coef) and each loss metric as [micro_batches] values
    (loss.step_metrics)."""
    lc = cfg.loss
    if lc.use_adaptive_entropy and state.entropy_coef is None:
        raise ValueError("use_adaptive_entropy carries its coefficient in TrainState: build the "
                         "state with init_train_state (and its shardings with state_shardings)")
    coef = loss_lib.applied_entropy_coef(state.entropy_coef, state.last_entropy, lc)
    # Per step (the state's count, so a resumed run continues the sequence) and micro-batch.
    dropout_key = jax.random.fold_in(jax.random.key(cfg.dropout_seed), state.step)
    loss, grads, sums = loss_and_grads(graphdef, cfg, state.params, batch, constrain, coef,
                                       frozen, dropout_key, group, micro_batches)
    updates, new_opt = tx.update(grads, state.opt_state, state.params)
    new_state = TrainState(optax.apply_updates(state.params, updates), new_opt, state.step + 1,
                           state.entropy_coef, state.last_entropy)
    new_state, metrics = finish_entropy_control(new_state, loss_lib.step_metrics(sums), lc)
    metrics.update(loss=loss, grad_norm=optax.tree.norm(grads),
                   skipped_updates=(new_opt.notfinite_count > 0).astype(jnp.int32),
                   # The rate applied: the schedule inside adamw counts applied updates only (a
                   # skipped one leaves apply_if_finite's inner state as it was, as transformers
                   # skips lr_scheduler.step()), while state.step counts skips too.
                   learning_rate=schedule(state.step - state.opt_state.total_notfinite))
    return new_state, metrics
