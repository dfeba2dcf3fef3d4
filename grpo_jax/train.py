"""`python -m grpo_jax.train --config NAME [--key value ...]`: the GRPO training program.

One round: generate -> reward -> advantages -> num_iterations x optimizer steps -> new weights to
the sampler. Everything with side effects (files, servers, the progress bar) lives here; the math
is in grpo_jax.grpo.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from transformers import AutoTokenizer

from grpo_jax import config as config_lib
from grpo_jax import data as data_lib
from grpo_jax import distributed as dist
from grpo_jax import hf
from grpo_jax import mesh as mesh_lib
from grpo_jax import rewards as rewards_lib
from grpo_jax.checkpoint import Checkpointer, StopSignal
from grpo_jax.grpo import advantages as adv_lib
from grpo_jax.grpo.loss import LossConfig
from grpo_jax.grpo.train_step import StepConfig, Trainer, TrainState
from grpo_jax.logger import MetricsLogger
from grpo_jax.rollout.engines import make_rollout
from grpo_jax.rollout.vllm_client import VLLMServerError


class TrainError(RuntimeError):
    """A failure the user can act on; main() prints it as one line."""


def build_mesh(cfg: config_lib.TrainConfig, devices=None):
    devices = jax.devices() if devices is None else devices
    data, fsdp, tensor = cfg.mesh.shape(len(devices))
    return mesh_lib.make_mesh(mesh_lib.MeshConfig(data, fsdp, tensor), devices)


def loss_config(cfg: config_lib.TrainConfig) -> LossConfig:
    names = {f.name for f in dataclasses.fields(LossConfig)}
    kw = {k: v for k, v in dataclasses.asdict(cfg.grpo).items() if k in names}
    kw["max_completion_length"] = cfg.generation.max_completion_length
    # The JAX sampler runs the trainer's own weights: its log-probs only feed the metrics.
    kw["vllm_importance_sampling_correction"] = (
        cfg.rollout.backend == "vllm" and cfg.grpo.vllm_importance_sampling_correction)
    return LossConfig(**kw)


def rollout_to_batch(r) -> dict:
    return {"prompt_ids": r.prompt_ids, "prompt_mask": r.prompt_mask,
            "completion_ids": r.completion_ids, "completion_mask": r.completion_mask,
            "truncated": r.truncated, "sampler_logp": r.sampler_logp}


def completion_metrics(batch: dict) -> dict:
    lengths = batch["completion_mask"].sum(1)
    done = ~batch["truncated"]
    term = lengths[done] if done.any() else np.zeros(1)
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(batch["truncated"].mean()),
        "completions/mean_terminated_length": float(term.mean()),
        "num_tokens": float(batch["prompt_mask"].sum() + lengths.sum()),
    }


def train(cfg: config_lib.TrainConfig, *, resume: bool = False, devices=None) -> dict:
    """Run (or resume) training on `devices` (default: all). Returns the last metrics."""
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    mesh = build_mesh(cfg, devices)
    model, model_dir = hf.load_model(cfg.model.name_or_path, dtype=jnp.dtype(cfg.model.dtype),
                                     param_dtype=jnp.dtype(cfg.model.param_dtype),
                                     remat=cfg.model.remat,
                                     remat_policy=cfg.model.remat_policy)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = data_lib.load_prompts(cfg.data, tokenizer)
    if dataset.num_truncated and dist.is_main():
        print(f"{dataset.num_truncated} of {len(dataset)} prompts were longer than "
              f"max_prompt_length={cfg.data.max_prompt_length} and lost their left end",
              file=sys.stderr)
    funcs = rewards_lib.load_reward_funcs(cfg.grpo.reward_funcs)
    plan = cfg.batch_plan(mesh_lib.batch_divisor(mesh))
    total_steps = plan.total_steps(len(dataset), cfg.batch.max_steps,
                                   cfg.batch.num_train_epochs)
    step_cfg = StepConfig(loss=loss_config(cfg), temperature=cfg.generation.temperature,
                          gradient_accumulation_steps=plan.gradient_accumulation_steps)
    trainer = Trainer(model, step_cfg, cfg.optim, total_steps, mesh)
    state = trainer.init_state
    # beta = 0: no reference model is kept at all.
    ref_params = (jax.tree.map(lambda x: x.copy(), state.params) if cfg.grpo.beta else None)
    del model
    rollout = make_rollout(cfg, trainer.model_config, tokenizer, mesh, model_dir)

    ckpt = Checkpointer(out / "checkpoints", save_total_limit=cfg.run.save_total_limit)
    position, round_idx = data_lib.DataPosition(), 0
    latest = ckpt.latest_step()
    if latest is not None and not (resume or cfg.run.resume):
        raise TrainError(f"{ckpt.directory} already holds checkpoints (latest step {latest}): "
                         "pass --resume to continue that run, or choose another output_dir")
    if resume or cfg.run.resume:
        if latest is not None:
            state, meta = ckpt.restore(latest, state)  # onto the live state's shardings
            position = data_lib.DataPosition(*meta["data_position"])
            round_idx = meta["round"]
            if dist.is_main():
                print(f"resumed from step {latest} in {ckpt.directory}", file=sys.stderr)
    if dist.is_main():  # without this process's id: the file serves every process of a resume
        (out / "config.yaml").write_text(dataclasses.replace(
            cfg, distributed=dataclasses.replace(cfg.distributed, process_id=None)).to_yaml())
    logger = MetricsLogger(out, cfg.run, total_steps=total_steps, start_step=int(state.step),
                           enabled=dist.is_main())
    rollout.update_weights(state.params)
    base_key = jax.random.key(cfg.data.seed)
    last: dict = {}
    saved_block = int(state.step) // max(cfg.run.save_steps, 1)
    failure = None
    with StopSignal() as stop:
        try:
            # Every process stops at the same round, also when only one got the signal.
            while int(state.step) < total_steps and not dist.any_process(stop.should_stop()):
                t0 = time.perf_counter()
                records, next_position = dataset.batch_prompts(position,
                                                               plan.prompts_per_generation)
                metrics, state = _round(cfg, plan, trainer, rollout, state, ref_params, records,
                                        funcs, tokenizer,
                                        jax.random.fold_in(base_key, round_idx), logger)
                position, round_idx = next_position, round_idx + 1  # the round is complete
                metrics["step_time"] = time.perf_counter() - t0
                # What the accelerator does not do: prompts, decoding text, rewards, metrics.
                metrics["timing/host"] = metrics["step_time"] - sum(
                    metrics.get(f"timing/{k}", 0.0)
                    for k in ("generate", "logprobs", "update", "weight_sync"))
                last = logger.log(int(state.step), metrics)
                if cfg.run.save_steps and int(state.step) // cfg.run.save_steps > saved_block:
                    saved_block = int(state.step) // cfg.run.save_steps
                    _save(ckpt, state, position, round_idx, metrics)
        except BaseException as e:
            failure = e
            raise
        finally:
            if dist.failed_alone(failure):
                # A checkpoint is written by all processes together; the others are not here.
                print("this process failed alone: no final checkpoint, the last periodic one "
                      "stands", file=sys.stderr)
            else:
                # Ends with a checkpoint whether finished, interrupted or failed mid-round: the
                # state saved is the last completed update, never a half-applied one.
                try:
                    if int(state.step) not in ckpt.all_steps() and int(state.step) > 0:
                        _save(ckpt, state, position, round_idx, last)
                except Exception as e:  # e.g. buffers donated to a step that failed
                    print(f"no final checkpoint ({type(e).__name__}: {e}); the last periodic "
                          "one stands", file=sys.stderr)
                ckpt.wait()
                ckpt.close()
            logger.close()
        if stop.should_stop():
            print(f"stopped by signal {stop.received}; checkpoint at step {int(state.step)}",
                  file=sys.stderr)
    return last


def _save(ckpt, state, position, round_idx, metrics):
    meta = {"data_position": list(position), "round": round_idx,
            "metrics": {k: float(v) for k, v in metrics.items()}}
    ckpt.save(int(state.step), state, meta, force=True)


def _round(cfg, plan, trainer, rollout, state: TrainState, ref_params, records, funcs,
           tokenizer, key, logger):
    """One generation round and its optimizer steps."""
    g = cfg.grpo.num_generations
    t0 = time.perf_counter()
    r = rollout.generate(state.params, [rec["prompt_ids"] for rec in records], g, key)
    gen_time = time.perf_counter() - t0
    batch = rollout_to_batch(r)
    ids = [row[m.astype(bool)].tolist() for row, m in zip(r.completion_ids, r.completion_mask)]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    prompts, columns = data_lib.reward_inputs(records, g)
    completions = rewards_lib.completions_for_rewards(prompts, texts)
    per_func = _rewards(funcs, prompts, completions, ids, columns, trainer.mesh)
    rewards = adv_lib.combine_rewards(per_func, cfg.grpo.reward_weights)
    advantages, stats = adv_lib.group_advantages(rewards, g, cfg.grpo.scale_rewards)
    batch["advantages"] = np.asarray(advantages, np.float32)
    t1 = time.perf_counter()
    if ref_params is not None:
        batch["ref_logp"] = np.asarray(trainer.logps(ref_params, batch))
    if plan.num_iterations > 1 or plan.steps_per_generation > plan.gradient_accumulation_steps:
        batch["old_logp"] = np.asarray(trainer.logps(state.params, batch))
    t2 = time.perf_counter()

    step_metrics = []
    per_step = plan.micro_batch_size * plan.gradient_accumulation_steps
    n_steps = plan.generation_batch_size // per_step
    for _ in range(plan.num_iterations):
        for s in range(n_steps):
            sl = slice(s * per_step, (s + 1) * per_step)
            sub = {k: v[sl] for k, v in batch.items()}
            state, m = trainer.step(state, sub)
            step_metrics.append(jax.device_get(m))
    t3 = time.perf_counter()
    sync_time = rollout.update_weights(state.params)

    metrics = {k: float(np.mean([m[k] for m in step_metrics])) for k in step_metrics[0]}
    metrics["skipped_updates"] = float(sum(m["skipped_updates"] for m in step_metrics))
    metrics.update(stats)
    for name, col in zip([f.name for f in funcs], per_func.T):
        metrics[f"rewards/{name}/mean"] = float(np.nanmean(col)) if np.isfinite(col).any() else 0.0
        metrics[f"rewards/{name}/std"] = float(np.nanstd(col)) if np.isfinite(col).any() else 0.0
    metrics.update(completion_metrics(batch))
    metrics["timing/generate"] = gen_time
    metrics["timing/logprobs"] = t2 - t1  # reference and old log-probs (0 when neither runs)
    metrics["timing/update"] = t3 - t2
    if sync_time is not None:
        metrics["timing/weight_sync"] = sync_time
    if cfg.run.log_completions:
        logger.log_completions(int(state.step), prompts, texts, rewards, advantages)
    return metrics, state


def _rewards(funcs, prompts, completions, ids, columns, mesh) -> np.ndarray:
    """[N, F] rewards. Each process scores the rows its devices hold in the train batch; the
    scores are then gathered, since advantages compare a prompt's whole group. A reward function
    that fails on one process fails the round on all."""
    rows = dist.owned_rows(mesh_lib.batch_sharding(mesh, 1), len(ids))

    def score():
        if not rows.size:
            return np.zeros((0, len(funcs)), np.float32)
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        return rewards_lib.compute_rewards(funcs, pick(prompts), pick(completions), pick(ids),
                                           {k: pick(v) for k, v in columns.items()})
    return dist.gather_rows(dist.together(score, rewards_lib.RewardError), rows, len(ids))


def abstract_state(cfg: config_lib.TrainConfig, device=None):
    """The TrainState's shapes on one device: a restore target that needs no training setup."""
    from flax import nnx

    from grpo_jax.grpo.train_step import make_optimizer
    from grpo_jax.models import Decoder, ModelConfig
    model_dir = hf.resolve_model_dir(cfg.model.name_or_path)
    model_cfg = ModelConfig.from_hf(hf.read_config(model_dir),
                                    param_dtype=jnp.dtype(cfg.model.param_dtype))
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0))),
                                 nnx.Param)
    tx, _ = make_optimizer(cfg.optim, 1)
    state = jax.eval_shape(lambda p: TrainState(p, tx.init(p), jnp.zeros((), jnp.int32)),
                           params)
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                         state)
    return state, graphdef, model_cfg, model_dir


def load_checkpoint(output_dir, step: int | None = None):
    """(model with the checkpoint's params, source model dir, step) from a run's output_dir."""
    from flax import nnx
    cfg_path = Path(output_dir) / "config.yaml"
    if not cfg_path.exists():
        raise TrainError(f"{output_dir} has no config.yaml: not a grpo_jax output_dir")
    cfg = config_lib.load_config(str(cfg_path))
    target, graphdef, model_cfg, model_dir = abstract_state(cfg)
    ckpt = Checkpointer(Path(output_dir) / "checkpoints", save_total_limit=None)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise TrainError(f"no checkpoint in {ckpt.directory}: train first, or pass the "
                             "output_dir of a run that saved one")
        state, _ = ckpt.restore(step, target)
    except FileNotFoundError as e:
        raise TrainError(str(e)) from None
    finally:
        ckpt.close()
    return nnx.merge(graphdef, state.params), model_dir, step


USER_ERRORS = (config_lib.ConfigError, hf.ModelLoadError, data_lib.DataError,
               rewards_lib.RewardError, VLLMServerError, TrainError, dist.DistributedError)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg, flags = config_lib.parse_cli(argv)
        dist.initialize(cfg.distributed)
        last = train(cfg)
    except USER_ERRORS as e:
        print(f"grpo_jax.train: error: {e}", file=sys.stderr)
        return dist.exit_code(2, e)
    except KeyboardInterrupt as e:
        print("grpo_jax.train: interrupted; the last completed step was checkpointed",
              file=sys.stderr)
        return dist.exit_code(130, e)
    except Exception as e:
        if not dist.failed_alone(e):
            raise
        traceback.print_exc()
        return dist.exit_code(1, e)
    if dist.is_main():
        print(json.dumps({k: round(v, 6) for k, v in last.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
