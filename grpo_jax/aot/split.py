"""A round colocated against split (`--split`, and every `--auto`): before launch, whether to
give some chips to the sampler and the rest to the trainer (#49's disaggregated rounds).

Colocated, the chips generate and then train: a round is the two one after the other. Split,
a sampler mesh decodes the next generation batch while a trainer mesh trains on the one before
(one version stale: each trained token was drawn by the weights of the update before last),
and the trainer's new weights then move to the sampler mesh. In the steady state a round is

    max(generate on the sampler chips + the weights' move, log-probs and updates on the rest)

and the faster side idles for the difference (the timing/idle_sampler and timing/idle_trainer
a run logs). Both sides are laid out and timed by search.estimate (no compile, the same rough
clock for colocated and split, so the comparison is like for like): each side's best fitting
layout for the round's rows per update and generation batch, unchanged; a sampler mesh holds
no training state, only the weights it decodes with. The weights' move: each sampler chip
receives its share of the compute-dtype weights over the ICI (on GPUs, NVLink) at the
bandwidth of a ring over all the chips.
"""

from __future__ import annotations

import dataclasses

from grpo_jax.aot import search
from grpo_jax.errors import GrpoJaxError

# The sampler's share of the chips tried (of 8ths), where it is a whole number of chips.
SHARES = (1, 2, 3, 4, 5, 6)
TRAIN = ("logprobs", "update")


def pinned(cfg, rows: int, gen: int, chips: int):
    """`cfg` planned on `chips` with the colocated round's rows per update and generation
    batch: candidates() keeps whatever its plan holds, so the split changes no training."""
    from grpo_jax import mesh as mesh_lib
    d = max(n for n in search.divisors(chips) if rows % n == 0 and gen % n == 0)
    for accumulation in search.divisors(rows // d):
        per_device = rows // d // accumulation
        if gen % (per_device * d) == 0:
            break
    return dataclasses.replace(
        cfg, mesh=mesh_lib.config_for({mesh_lib.AXES[0]: d, mesh_lib.AXES[2]: chips // d}),
        batch=dataclasses.replace(cfg.batch, per_device_train_batch_size=per_device,
                                  gradient_accumulation_steps=accumulation,
                                  generation_batch_size=gen, steps_per_generation=None))


def _best(cfg, model, target, devices, phases, image_tokens: int = 0,
          margin: float = search.MARGIN, images: int | None = None):
    try:
        scored = search.ranked(cfg, model, target, devices, phases=phases,
                               image_tokens=image_tokens, margin=margin, images=images)
    except GrpoJaxError:
        return None
    lay, est = scored[0]
    return (lay, est) if est["fits"] else None


def _decoding(lay) -> str:
    """A sampler mesh's layout: its mesh and decode slots (it trains nothing)."""
    return (" x ".join(f"{a} {s}" for a, s in lay.mesh if s > 1) or "1 chip") + (
        f"; {lay.slots} decode slots" if lay.slots else "")


def _phase_s(est: dict, phases) -> float:
    return sum(sum(est["phases"][p].values()) for p in phases)


def forecast(cfg, model, target, devices, image_tokens: int = 0,
             margin: float = search.MARGIN, images: int | None = None) -> dict:
    """The colocated round and every split of `devices` (SHARES) that fits with `margin` of
    HBM to spare, by estimate (a vision-language model's with `image_tokens` per prompt, in
    `images` images); the
    best of them and why."""
    fit = dict(image_tokens=image_tokens, margin=margin, images=images)
    chips = len(devices)
    if target.platform == "tpu":  # so that the first n chips are a box of the torus (a slab)
        devices = sorted(devices, key=lambda d: tuple(reversed(d.coords)))
    both = _best(cfg, model, target, devices, search.PHASES, **fit)
    if both is None:
        raise GrpoJaxError(f"no layout of {chips} chips fits the round, colocated: nothing "
                           "to compare a split with")
    lay, est = both
    plan = lay.apply(cfg, cfg.batch_plan(search.batch_size(cfg, chips)).generation_batch_size
                     ).batch_plan(search.data_parallel(lay))
    rows = plan.micro_batch_size * plan.gradient_accumulation_steps
    gen = plan.generation_batch_size
    colocated = {"layout": lay.describe(), "generate_s": _phase_s(est, ("generate",)),
                 "train_s": _phase_s(est, TRAIN), "round_s": est["seconds"],
                 "peak_GB": est["peak_GB"]}
    splits = []
    for s in sorted({chips * k // 8 for k in SHARES if chips * k % 8 == 0}):
        if not 0 < s < chips:
            continue
        sampler = _best(pinned(cfg, rows, gen, s), model, target, devices[:s], ("generate",),
                        **fit)
        trainer = _best(pinned(cfg, rows, gen, chips - s), model, target, devices[s:], TRAIN,
                        **fit)
        if sampler is None or trainer is None:
            continue
        g_s, t_s = _phase_s(sampler[1], ("generate",)), _phase_s(trainer[1], TRAIN)
        move = sampler[1]["weights_GB"] * 1e9 / search.bandwidth(target, chips)
        round_s = max(g_s + move, t_s)
        splits.append({"sampler_chips": s, "trainer_chips": chips - s,
                       "sampler": _decoding(sampler[0]), "trainer": trainer[0].describe(),
                       "sampler_peak_GB": sampler[1]["peak_GB"],
                       "trainer_peak_GB": trainer[1]["peak_GB"],
                       "generate_s": g_s, "train_s": t_s, "weights_move_s": move,
                       "round_s": round_s, "idle_sampler_s": max(round_s - g_s - move, 0.0),
                       "idle_trainer_s": round_s - t_s, "max_staleness": 1})
    best = min(splits, key=lambda x: x["round_s"], default=None)
    if best is None:
        why = f"no split of {chips} chips fits both sides: colocated"
    elif best["round_s"] < colocated["round_s"]:
        why = (f"split {best['sampler_chips']} sampler + {best['trainer_chips']} trainer chips: "
               f"{best['round_s']:.3g} s a round against {colocated['round_s']:.3g} s "
               f"colocated ({colocated['round_s'] / best['round_s']:.2f}x), trained one "
               "version stale (max_staleness 1)")
    else:
        why = (f"colocated: {colocated['round_s']:.3g} s a round against the best split's "
               f"{best['round_s']:.3g} s ({best['sampler_chips']} sampler + "
               f"{best['trainer_chips']} trainer chips): the halves do not balance")
    return {"colocated": colocated, "splits": splits, "best_split": best,
            "choice": "split" if best and best["round_s"] < colocated["round_s"]
            else "colocated", "why": why}
