"""`python -m grpo_jax.train --config NAME [--key value ...]`: the GRPO training program.

The run around the rounds (grpo_jax.trainer.GRPORound): loading, resume, checkpoints, logging
and stopping. Everything with side effects (files, servers, the progress bar) lives here; the
math is in grpo_jax.grpo.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import numpy as np
from transformers import AutoTokenizer

from grpo_jax import cli
from grpo_jax import config as config_lib
from grpo_jax import data as data_lib
from grpo_jax import distributed as dist
from grpo_jax import evaluation
from grpo_jax import hf
from grpo_jax import mesh as mesh_lib
from grpo_jax import peft_io
from grpo_jax import rewards as rewards_lib
from grpo_jax.checkpoint import BufferFiles, Checkpointer, RefCheckpoints, StopSignal
from grpo_jax.errors import GrpoJaxError
from grpo_jax.grpo.train_step import StepConfig
from grpo_jax.logger import MetricsLogger
from grpo_jax.models import ModelConfig
from grpo_jax.rollout import tools as tools_lib
from grpo_jax.rollout.engines import make_rollout
from grpo_jax.rollout.sampler import reference_copy
from grpo_jax.trainer import ADAPTERS_OFF, GRPORound, Scores, Trainer, aggregate


EVAL_KEY_TAG = 0x4556414C  # "EVAL": evaluation's sampling keys, apart from the rounds'


class TrainError(GrpoJaxError):
    """A run that can't start or go on as asked."""


def step_config(cfg: config_lib.TrainConfig, plan: config_lib.BatchPlan) -> StepConfig:
    loss = cfg.loss
    if cfg.rollout.backend != "vllm":
        # The JAX sampler runs the trainer's own weights: its log-probs only feed the metrics.
        loss = dataclasses.replace(loss, vllm_importance_sampling_correction=False)
    return StepConfig(loss=loss, temperature=cfg.generation.temperature,
                      gradient_accumulation_steps=plan.gradient_accumulation_steps,
                      dropout_seed=cfg.data.seed)


def replicated_state_bytes(cfg: config_lib.TrainConfig, model) -> float:
    """Bytes a device would hold of the training state with params replicated: the params and
    AdamW's two moments in the param dtype, a gradient, and the reference copy in the compute
    dtype when beta > 0; with LoRA, the frozen base (in the compute dtype or quantized)."""
    n = model.num_params()
    if cfg.peft.use_peft:
        bits = cfg.peft.quant_bits or 8 * jax.numpy.dtype(cfg.numerics.dtype).itemsize
        return n * bits / 8
    param = jax.numpy.dtype(cfg.numerics.param_dtype).itemsize
    return n * (4 * param + (jax.numpy.dtype(cfg.numerics.dtype).itemsize if cfg.loss.beta else 0))


def choose_mesh(cfg: config_lib.TrainConfig, devices) -> config_lib.TrainConfig:
    """The run's mesh: its own, or, when it gives none, mesh.default_config's choice from the
    model's size and the devices' memory (said on stderr). `python -m grpo_jax.aot --auto`
    searches layouts by compiling them; this is the estimate a run can make on its own."""
    if cfg.mesh.given:
        return cfg
    devices = list(jax.devices() if devices is None else devices)
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")  # None on the CPU
    state = 0.0
    if limit is not None:
        model = ModelConfig.from_hf(hf.read_config(hf.resolve_model_dir(peft_io.base_name(cfg))))
        state = replicated_state_bytes(cfg, model)
    mesh_cfg, why = mesh_lib.default_config(state, limit)
    if dist.is_main():
        print(f"grpo_jax: no mesh given: {why} ({' '.join(mesh_lib.flags(mesh_cfg))})",
              file=sys.stderr)
    return dataclasses.replace(cfg, mesh=mesh_cfg)


@dataclasses.dataclass
class RewardScorer:
    """Decodes a round's completions and scores them. Each process scores the rows its devices
    hold in the train batch; the scores are then gathered, since advantages compare a prompt's
    whole group. A reward function that fails on one process fails the round on all."""
    funcs: list
    tokenizer: Any
    mesh: Any
    num_generations: int

    trainer_state: Any = rewards_lib.NOT_STARTED  # set before each round (TRL's trainer_state)

    @property
    def names(self) -> list[str]:
        return rewards_lib.reward_names(self.funcs)

    def __call__(self, records, r) -> Scores:
        ids = [row[m.astype(bool)].tolist() for row, m in zip(r.completion_ids, r.completion_mask)]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        prompts, columns = data_lib.reward_inputs(records, self.num_generations)
        columns.update(r.extra or {})  # a rollout_func's fields, as TRL passes them
        # With tools, TRL's completions: each row's turns as messages (calls and results too).
        completions = (r.completions if r.completions is not None
                       else rewards_lib.completions_for_rewards(prompts, texts))
        rows = dist.owned_rows(mesh_lib.batch_sharding(self.mesh, 1), len(ids))
        logs = rewards_lib.RewardLogs()

        def score():
            if not rows.size:
                return np.zeros((0, len(self.funcs)), np.float32)
            pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
            return rewards_lib.compute_rewards(self.funcs, pick(prompts), pick(completions),
                                               pick(ids), {k: pick(v) for k, v in columns.items()},
                                               trainer_state=self.trainer_state, logs=logs)
        per_func = dist.gather_rows(dist.together(score, rewards_lib.RewardError), rows, len(ids))
        # What the functions logged, from every process (TRL gathers both too).
        logs = rewards_lib.RewardLogs.merged(dist.gather_objects((rows.tolist(), logs)), len(ids))
        return Scores(per_func, prompts, texts, logs.extra, logs.metric_means())


def train(cfg: config_lib.TrainConfig, *, devices=None) -> dict:
    """Run (or resume) training on `devices` (default: all). Returns the last metrics."""
    # A PEFT adapter directory as the model: its base, its settings, its weights to start from.
    cfg = peft_io.adapter_settings(cfg)
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = choose_mesh(cfg, devices)
    mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    eval_prompts = (cfg.eval_prompts_per_batch(mesh_lib.batch_divisor(mesh)) if cfg.eval.enabled
                    else 0)
    # Each weight is read straight onto its sharding: no device holds a whole copy.
    model, model_dir = peft_io.load_model(cfg, mesh)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools = tools_lib.load_tools(cfg.multi_turn.tools)
    dataset = data_lib.load_prompts(cfg.data, tokenizer, tools=tools)
    if tools:
        tools_lib.check_chat_template(tokenizer, cfg.data.chat_template_kwargs)
    if dataset.num_truncated and dist.is_main():
        print(f"{dataset.num_truncated} of {len(dataset)} prompts were longer than "
              f"max_prompt_length={cfg.data.max_prompt_length} and lost their left end",
              file=sys.stderr)
    eval_dataset = (data_lib.load_prompts(cfg.data, tokenizer, test=True, tools=tools)
                    if eval_prompts else None)
    # Reward models run on the trainer's mesh (in multi-process runs on this process's devices:
    # reward_model.scoring_mesh), in the run's compute dtype.
    funcs = rewards_lib.load_reward_funcs(
        cfg.grpo.reward_funcs, cfg.grpo.reward_processing_classes, mesh=mesh,
        dtype=cfg.numerics.dtype, chat_template_kwargs=cfg.data.chat_template_kwargs)
    plan = cfg.batch_plan(mesh_lib.batch_divisor(mesh))
    total_steps = plan.total_steps(len(dataset), cfg.batch.max_steps,
                                   cfg.batch.num_train_epochs)
    trainer = Trainer(model, step_config(cfg, plan), cfg.optim, total_steps, mesh)
    state = trainer.init_state
    del model
    rollout = make_rollout(cfg, trainer.model_config, tokenizer, mesh, model_dir, tools)
    scorer = RewardScorer(funcs, tokenizer, mesh, cfg.grpo.num_generations)
    g = cfg.grpo
    run_round = GRPORound(
        trainer, rollout, plan, scorer, scorer.names, g.scale_rewards, g.reward_weights,
        # beta = 0: no reference model is kept at all.
        ref_params=(None if not cfg.loss.beta else ADAPTERS_OFF if cfg.peft.use_peft
                    else reference_copy(state.params, trainer.model_config.dtype)),
        aggregation=g.multi_objective_aggregation,
        ref_sync=(g.ref_model_sync_steps, g.ref_model_mixup_alpha) if g.sync_ref_model else None)
    g_eval = cfg.eval.num_generations_eval or g.num_generations
    eval_scorer = dataclasses.replace(scorer, num_generations=g_eval)
    evaluator = (evaluation.Evaluator(run_round, eval_dataset, eval_scorer, g_eval, eval_prompts,
                                      mesh_lib.batch_divisor(mesh)) if eval_prompts else None)
    schedule = evaluation.schedule(cfg.eval, cfg.run.logging_steps, total_steps,
                                   plan.gradient_accumulation_steps,
                                   plan.micro_steps_per_epoch(len(dataset)))

    ckpt = Checkpointer(out / "checkpoints", save_total_limit=cfg.run.save_total_limit)
    # sync_ref_model: the reference changes during the run, so it is checkpointed too.
    refs = (RefCheckpoints(out / "reference", cfg.run.save_total_limit) if g.sync_ref_model
            else None)
    position, round_idx, tokens_seen = data_lib.DataPosition(), 0, 0
    buffers = BufferFiles(out / "generation_buffer")
    latest = ckpt.latest_step()
    if latest is not None and not cfg.run.resume:
        raise TrainError(f"{ckpt.directory} already holds checkpoints (latest step {latest}): "
                         "pass --resume to continue that run, or choose another output_dir")
    if refs is not None:
        refs.drop_after(latest or 0)
    if cfg.run.resume:
        if latest is not None:
            # Onto the live state's shardings, whose buffers go first: the devices never hold
            # two training states (the initial one is of no use once a checkpoint is read).
            target = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
            jax.tree.map(lambda x: x.delete(), state)
            state, meta = ckpt.restore(latest, target)
            position = data_lib.DataPosition(*meta["data_position"])
            round_idx = meta["round"]
            tokens_seen = int(meta.get("num_tokens", 0))
            run_round.buffer = buffers.load(latest, meta.get("buffered_micro_batches", 0))
            if refs is not None:
                run_round.ref_params = refs.restore(latest, run_round.ref_params,
                                                    meta.get("reference", False))
            elif meta.get("reference") and dist.is_main():
                print(f"checkpoint {latest} was saved with sync_ref_model; without it the "
                      "reference is the initial model again", file=sys.stderr)
            if dist.is_main():
                print(f"resumed from step {latest} in {ckpt.directory}", file=sys.stderr)
    if dist.is_main():  # without this process's id: the file serves every process of a resume
        (out / "config.yaml").write_text(dataclasses.replace(
            cfg, distributed=dataclasses.replace(cfg.distributed, process_id=None)).to_yaml())
    logger = MetricsLogger(out, cfg.run, total_steps=total_steps, start_step=int(state.step),
                           enabled=dist.is_main())
    run_round.sync_weights(state.params)
    prefetch = getattr(rollout, "prefetch", None)  # grpo_jax.rollout.async_rounds
    base_key = jax.random.key(cfg.data.seed)
    eval_key = jax.random.fold_in(base_key, EVAL_KEY_TAG)

    def trainer_state(step: int, position) -> rewards_lib.TrainerState:
        return rewards_lib.TrainerState(
            global_step=step, max_steps=total_steps,
            epoch=position.epoch + position.index / len(dataset),
            num_train_epochs=cfg.batch.num_train_epochs)

    def evaluate(state):
        step = int(state.step)
        eval_scorer.trainer_state = trainer_state(step, position)
        metrics = evaluator(state, jax.random.fold_in(eval_key, step), tokens_seen)
        metrics["epoch"] = plan.epoch(step, len(dataset))
        logger.log_eval(step, metrics)

    if evaluator is not None and cfg.eval.eval_on_start:
        evaluate(state)
    last: dict = {}
    unlogged: list[dict] = []  # rounds without an update (steps_per_generation < accumulation)
    saved_block = int(state.step) // max(cfg.run.save_steps, 1)
    failure = None
    with StopSignal() as stop:
        try:
            # Every process stops at the same round, also when only one got the signal.
            while int(state.step) < total_steps and not dist.any_process(stop.should_stop()):
                t0 = time.perf_counter()
                records = None  # whole windows still buffered: train on them first, as TRL
                if not run_round.windows_buffered:
                    records, next_position = dataset.batch_prompts(position,
                                                                   plan.prompts_per_generation)
                    if prefetch is not None:  # async rounds: the next round's, in the background
                        ahead, _ = dataset.batch_prompts(next_position, plan.prompts_per_generation)
                        prefetch(ahead, plan.num_generations,
                                 jax.random.fold_in(base_key, round_idx + 1))
                scorer.trainer_state = trainer_state(int(state.step), position)
                # Stops at max_steps exactly, and at the next evaluation, also mid-round (the
                # rest stays buffered).
                stop_at = min(total_steps, schedule.next_due(int(state.step)) or total_steps)
                result = run_round(state, records, jax.random.fold_in(base_key, round_idx),
                                   max_updates=stop_at - int(state.step))
                state, metrics = result.state, result.metrics
                if records is not None:  # the round is complete
                    position, round_idx = next_position, round_idx + 1
                tokens_seen += result.num_tokens
                if cfg.run.log_completions and result.scores is not None:
                    logger.log_completions(int(state.step), result.scores.prompts,
                                           result.scores.texts, result.rewards, result.advantages,
                                           extra=result.scores.extra)
                metrics["step_time"] = time.perf_counter() - t0
                # What the accelerator does not do: prompts, decoding text, rewards, metrics.
                metrics["timing/host"] = metrics["step_time"] - sum(
                    metrics.get(f"timing/{k}", 0.0)
                    for k in ("generate", "logprobs", "update", "weight_sync"))
                unlogged.append(metrics)
                if not result.updates:
                    continue  # logged with the next update, as TRL logs per optimizer step
                metrics, unlogged = aggregate(unlogged), []
                metrics["num_tokens"] = float(tokens_seen)
                metrics["epoch"] = plan.epoch(int(state.step), len(dataset))
                last = logger.log(int(state.step), metrics)
                if evaluator is not None and schedule.due(int(state.step)):
                    evaluate(state)
                if cfg.run.save_steps and int(state.step) // cfg.run.save_steps > saved_block:
                    saved_block = int(state.step) // cfg.run.save_steps
                    _save(ckpt, buffers, state, position, round_idx, tokens_seen,
                          run_round, metrics, refs)
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
                        _save(ckpt, buffers, state, position, round_idx, tokens_seen,
                              run_round, last, refs)
                except Exception as e:  # e.g. buffers donated to a step that failed
                    print(f"no final checkpoint ({type(e).__name__}: {e}); the last periodic "
                          "one stands", file=sys.stderr)
                ckpt.wait()
                ckpt.close()
                if refs is not None:
                    refs.close()
            logger.close()
        if stop.should_stop():
            print(f"stopped by signal {stop.received}; checkpoint at step {int(state.step)}",
                  file=sys.stderr)
    return last


def _save(ckpt, buffers, state, position, round_idx, tokens_seen, run_round, metrics,
          refs=None):
    """A checkpoint of the state and what resumes the run exactly: the data position, the
    round, the tokens seen, the generated micro-batches not yet trained on and, with
    sync_ref_model, the reference params."""
    step, buffer = int(state.step), run_round.buffer
    if step in ckpt.all_steps():
        return
    buffers.save(step, buffer)  # first: a committed checkpoint always finds its buffer
    if refs is not None:
        refs.save(step, run_round.ref_params)  # also first, and committed before the state
    meta = {"data_position": list(position), "round": round_idx, "num_tokens": tokens_seen,
            "buffered_micro_batches": len(buffer), "reference": refs is not None,
            "metrics": {k: float(v) for k, v in metrics.items()}}
    ckpt.save(step, state, meta)
    buffers.prune(ckpt.all_steps())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    dist.default_xla_flags()
    try:
        cfg = cli.parse_cli(argv)
        dist.initialize(cfg.distributed)
        last = train(cfg)
    except GrpoJaxError as e:
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
