"""`python -m grpo_jax.train --config NAME [--key value ...]`: the GRPO training program.

The run around the rounds (grpo_jax.round.GRPORound): loading, resume, checkpoints, logging
and stopping. Everything with side effects (files, servers, the progress bar) lives here; the
math is in grpo_jax.grpo.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
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
from grpo_jax import dynamic_sampling as ds
from grpo_jax import evaluation
from grpo_jax import hf
from grpo_jax import mesh as mesh_lib
from grpo_jax import peft_io
from grpo_jax import rewards as rewards_lib
from grpo_jax import run_facts
from grpo_jax import storage
from grpo_jax.checkpoint import (BufferFiles, Checkpointer, RefCheckpoints, StopRun, StopSignal,
                                 check_writable, committed_steps, last_good,
                                 quiet_closed_loop_reports, resume_changes, settings_diff)
from grpo_jax.errors import (CheckpointWriteError, ConfigError, GrpoJaxError, NoSignalError,
                             TrainError, UpdatesSkippedError)
from grpo_jax.models import ModelConfig
from grpo_jax.rollout import tools as tools_lib
from grpo_jax.rollout.engines import make_rollout
from grpo_jax.rollout.native import disaggregated, partial, sampler_hosts
from grpo_jax.rollout.native.sampler import reference_copy
from grpo_jax.rollout.native.sampler_process import SamplerProcess, SamplerSpec
from grpo_jax.run_dir import RunDirLock
from grpo_jax.run_log import RunLog
from grpo_jax.run_state import ADAPTERS_OFF, RunState
from grpo_jax.scoring import RewardScorer
from grpo_jax.policy import Policy, step_config
from grpo_jax.round import Draw, GRPORound


EVAL_KEY_TAG = 0x4556414C  # "EVAL": evaluation's sampling keys, apart from the rounds'


def choose_mesh(cfg: config_lib.TrainConfig, devices) -> config_lib.TrainConfig:
    """The run's mesh: its own, or, when it gives none, a context axis for long rows
    (mesh.long_row_config), else mesh.default_config's choice from the model's size and the
    devices' memory (said on stderr). `python -m grpo_jax.aot --auto`
    searches layouts by compiling them; this is the estimate a run can make on its own."""
    if cfg.mesh.given:
        return cfg
    devices = list(jax.devices() if devices is None else devices)
    long = mesh_lib.long_row_config(cfg.data.max_prompt_length or 0,
                                    cfg.generation.max_completion_length, len(devices),
                                    mesh_lib.slice_count(devices))
    if long is not None:
        if dist.is_main():
            print(f"grpo_jax: no mesh given: {long[1]} ({' '.join(mesh_lib.flags(long[0]))})",
                  file=sys.stderr)
        return dataclasses.replace(cfg, mesh=long[0])
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")  # None on the CPU
    state = 0.0
    if limit is not None:
        model = ModelConfig.from_hf(hf.read_config(hf.resolve_model_dir(peft_io.base_name(cfg))))
        # The state as one device would hold it replicated, while an update runs.
        state = run_facts.state_bytes(cfg, model.num_params()).with_gradient
    mesh_cfg, why = mesh_lib.default_config(state, limit)
    if dist.is_main():
        print(f"grpo_jax: no mesh given: {why} ({' '.join(mesh_lib.flags(mesh_cfg))})",
              file=sys.stderr)
    return dataclasses.replace(cfg, mesh=mesh_cfg)


@dataclasses.dataclass
class RunCheckpoints:
    """A run's checkpoints: the state with its meta (Orbax), the generation buffer beside each
    and, with sync_ref_model, the reference. `schedule`: what a data position means (the
    dataset's size and the batch plan), kept in each checkpoint's meta and checked on resume."""
    ckpt: Checkpointer
    buffers: BufferFiles
    refs: RefCheckpoints | None
    schedule: dict = dataclasses.field(default_factory=dict)
    # Partial rollouts' rows in flight (RunState.rows_in_flight), beside each checkpoint, and
    # the dataset's record of a row, to give their groups back their prompts on resume.
    rows_in_flight: BufferFiles | None = None
    record: Any = None
    # sampler_devices: the batch the sampler finished a round ahead (RunState.queued).
    queued: BufferFiles | None = None
    # Processes whose samplers each hold their share of the rows in flight (a multi-process
    # split run: rollout/native/sampler_hosts.py); 1: the rows are every process's alike.
    hosts: int = 1
    # Async rounds on the JAX sampler: the params that generate the batch in flight
    # (RunState.generated_ahead), leaf by leaf (one process).
    ahead: BufferFiles | None = None

    @classmethod
    def open(cls, out: Path, cfg: config_lib.TrainConfig, schedule: dict | None = None,
             read_only: bool = False, record=None, hosts: int = 1) -> "RunCheckpoints":
        """`read_only`: another run's, restored from and never changed."""
        limit = None if read_only else cfg.run.save_total_limit
        ckpt = Checkpointer(out / "checkpoints", save_total_limit=limit, read_only=read_only)
        # sync_ref_model: the reference changes during the run, so it is checkpointed too.
        refs = (RefCheckpoints(out / "reference", limit, read_only) if cfg.grpo.sync_ref_model
                else None)
        return cls(ckpt, BufferFiles(out / "generation_buffer"), refs, dict(schedule or {}),
                   BufferFiles(out / "rows_in_flight", "rollouts in flight"), record,
                   BufferFiles(out / "queued", "batch sampled ahead"), hosts,
                   BufferFiles(out / "generated_ahead", "params of the batch generated ahead"))

    def resume(self, cfg: config_lib.TrainConfig, out: Path, at: RunState) -> RunState:
        """`at` as the checkpoint cfg.run.resume names left it, whole (the train state, data
        position, generation buffer, reference, ...); `at` itself when there is none to resume,
        which without --resume must be so. A checkpoint of another run (resume_from_checkpoint
        into its directory) is read from there, and this run goes on in `out`, as transformers
        does."""
        ckpt = self.ckpt
        latest = ckpt.latest_step()
        if latest is not None and not cfg.run.resume:
            raise TrainError(f"{ckpt.directory} already holds checkpoints (latest step {latest}):"
                             " pass --resume to continue that run, or choose another output_dir")
        source, source_out = self, out
        if isinstance(cfg.run.resume, str):  # TRL's resume_from_checkpoint PATH
            source_out, latest = _checkpoint_source(cfg.run.resume, out, ckpt)
            if source_out != out.resolve():
                if ckpt.latest_step() is not None:  # which would this run continue?
                    raise TrainError(
                        f"resume_from_checkpoint {cfg.run.resume} is another run's checkpoint, "
                        f"but output_dir {out} already holds checkpoints (latest step "
                        f"{ckpt.latest_step()}): resume from those, or choose an output_dir "
                        "without checkpoints")
                # Read only: nothing in the other run's directory is deleted or rotated.
                source = RunCheckpoints.open(source_out, cfg, read_only=True,
                                             record=self.record, hosts=self.hosts)
            for later in [s for s in ckpt.all_steps() if s > latest]:
                ckpt.delete(later)  # transformers overwrites them when it gets there again
                if dist.is_main():
                    print(f"resuming from step {latest}: removed the later checkpoint {later}",
                          file=sys.stderr)
        try:
            return self._restore(cfg, out, at, source, source_out, latest)
        finally:
            if source is not self:
                source.ckpt.close()
                if source.refs is not None:
                    source.refs.close()

    def _restore(self, cfg, out: Path, at: RunState, source: "RunCheckpoints",
                 source_out: Path, latest: int | None) -> RunState:
        restored = None
        ckpt = source.ckpt
        saved_settings = _saved_settings(source_out)
        if cfg.run.resume and latest is not None:
            # Onto the live state's shardings, whose buffers go first: the devices never hold
            # two training states (the initial one is of no use once a checkpoint is read).
            target = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), at.state)
            jax.tree.map(lambda x: x.delete(), at.state)
            # The newest that restores: corrupt ones are set aside; other settings are refused.
            restored = ckpt.restore_newest(target, cfg.to_dict(), saved_settings, latest)
            if restored is None:
                raise TrainError(f"no checkpoint in {ckpt.directory} can be restored (each is "
                                 "kept as <step>.corrupt): resume from a copy, or train afresh "
                                 "without --resume into another output_dir")
        if self.refs is not None:
            self.refs.drop_after(restored[0] if restored else 0)
        if restored is None:
            return at
        latest, state, meta = restored
        refused, changed = resume_changes(latest, saved_settings, cfg.to_dict(),
                                          meta.get("schedule"), self.schedule)
        if refused:
            raise TrainError(
                f"checkpoint {latest} in {ckpt.directory} was written with other data or batch "
                f"settings ({'; '.join(refused)}): its data position and buffered completions "
                "belong to those. Resume with the settings it was written with, or train afresh "
                "into another output_dir")
        reference = at.reference
        if self.refs is not None:
            reference = source.refs.restore(latest, reference, meta.get("reference", False))
        elif meta.get("reference") and dist.is_main():
            print(f"checkpoint {latest} was saved with sync_ref_model; without it the "
                  "reference is the initial model again", file=sys.stderr)
        if dist.is_main():
            print(f"resumed from step {latest} in {ckpt.directory}", file=sys.stderr)
            if changed:  # said once; config.yaml gets this run's (_write_settings)
                kept = (f"; the previous config.yaml is kept as config.step-{latest}.yaml"
                        if source is self else "")
                print(f"resumed with settings changed since checkpoint {latest} (" +
                      "; ".join(changed) + f"): they apply from here on{kept}", file=sys.stderr)
        rows_in_flight = at.rows_in_flight
        if meta.get("rows_in_flight"):
            if rows_in_flight is None:
                raise TrainError(f"checkpoint {latest} holds partial rollouts in flight "
                                 "(max_staleness > 0 with the JAX sampler): resume with those "
                                 "settings, or train afresh into another output_dir")
            arrays = source.rows_in_flight.load_arrays(latest, "partial rollouts in flight")
            hosts = meta.get("rows_in_flight_hosts", 1)
            try:
                if hosts > 1 or self.hosts > 1:  # each process's sampler its own share
                    arrays = sampler_hosts.own(arrays, hosts)
                rows_in_flight = partial.from_arrays(rows_in_flight, arrays, source.record)
            except ValueError as e:
                raise TrainError(f"checkpoint {latest}: {e}") from None
        queued = None
        if meta.get("queued"):
            if cfg.rollout.sampler_devices is None:
                raise TrainError(f"checkpoint {latest} holds a batch sampled ahead on the "
                                 "sampler's devices (sampler_devices): resume with it set")
            queued = disaggregated.from_arrays(source.queued.load_arrays(
                latest, "batch sampled ahead"), source.record)
        ahead = None
        if meta.get("generated_ahead") is not None:  # async rounds on the JAX sampler
            arrays = source.ahead.load_arrays(latest, "the params of its batch in flight")
            live = jax.tree.leaves(state.params)
            ahead = (jax.tree.unflatten(jax.tree.structure(state.params),
                                        [jax.device_put(arrays[str(i)].view(x.dtype)
                                                        .reshape(x.shape), x.sharding)
                                         for i, x in enumerate(live)]),
                     int(meta["generated_ahead"]))
        return RunState(
            state, data_lib.DataPosition(*meta["data_position"]), meta["round"],
            int(meta.get("num_tokens", 0)),
            buffer=tuple(source.buffers.load(latest, meta.get("buffered_micro_batches", 0))),
            epoch_end=meta.get("buffered_epoch_end", 0), reference=reference,
            in_flight=tuple((r, data_lib.DataPosition(e, i))
                            for r, e, i in meta.get("in_flight", ())),
            rows_in_flight=rows_in_flight, queued=queued, generated_ahead=ahead)

    def save(self, at: RunState, metrics: dict) -> None:
        """A checkpoint of the run state `at`, whole: the train state with its meta (data
        position, rounds, tokens, in-flight draws) in Orbax, the generated micro-batches not
        yet trained on beside it and, with sync_ref_model, the reference params."""
        step, buffer = at.step, at.buffer
        if step in self.ckpt.all_steps():
            return
        self.buffers.save(step, buffer)  # first: a committed checkpoint always finds its buffer
        if at.rows_in_flight is not None:
            arrays = partial.to_arrays(at.rows_in_flight)
            if self.hosts > 1:  # every process's share, written by process 0
                arrays = sampler_hosts.gathered(arrays)
            self.rows_in_flight.save_arrays(step, arrays)
        if at.queued is not None:
            self.queued.save_arrays(step, disaggregated.to_arrays(at.queued))
        if at.generated_ahead is not None:
            # As bytes: np.savez keeps no bfloat16 (the live params give each its dtype back).
            self.ahead.save_arrays(step, {str(i): np.asarray(x).reshape(-1).view(np.uint8)
                                          for i, x in
                                          enumerate(jax.tree.leaves(at.generated_ahead[0]))})
        if self.refs is not None:
            self.refs.save(step, at.reference)  # also first, committed before the state
        meta = {"data_position": list(at.position), "round": at.round,
                "num_tokens": at.tokens_seen, "buffered_micro_batches": len(buffer),
                "buffered_epoch_end": at.epoch_end, "reference": self.refs is not None,
                "in_flight": [[r, *p] for r, p in at.in_flight],
                "rows_in_flight": at.rows_in_flight is not None,
                "rows_in_flight_hosts": self.hosts,
                "queued": at.queued is not None,
                "generated_ahead": (None if at.generated_ahead is None
                                    else at.generated_ahead[1]),
                "schedule": self.schedule,
                "metrics": {k: None if v is None else float(v) for k, v in metrics.items()}}
        self.ckpt.save(step, at.state, meta)
        self.buffers.prune(self.ckpt.all_steps())
        self.rows_in_flight.prune(self.ckpt.all_steps())
        self.queued.prune(self.ckpt.all_steps())
        self.ahead.prune(self.ckpt.all_steps())


@dataclasses.dataclass
class Run:
    """One training run, built once (build_run): its settings, data, programs, rollout, reward
    scoring, round, evaluation and checkpoints, and where it stands (`at`)."""
    cfg: config_lib.TrainConfig
    out: Path
    plan: config_lib.BatchPlan
    total_steps: int
    dataset: Any  # data.Prompts
    rollout: Any  # rollout.base.Rollout
    scorer: RewardScorer
    round: GRPORound
    evaluator: Any  # evaluation.Evaluator, or None
    eval_scorer: RewardScorer
    schedule: Any  # evaluation.EvalSchedule
    checkpoints: RunCheckpoints
    at: RunState
    lock: RunDirLock  # output_dir held by this run (and still the directory it opened)

    @property
    def data_epochs(self) -> int | None:
        """dynamic_sampling reads prompts until a batch fills, but never past the run's epochs
        (Draws); None without it."""
        return (self.plan.num_train_epochs(len(self.dataset), self.total_steps)
                if self.cfg.grpo.dynamic_sampling else None)

    def trainer_state(self, step: int) -> rewards_lib.TrainerState:
        """transformers' state after `step` optimizer steps (the epoch is optimizer progress),
        what reward functions get as trainer_state."""
        return rewards_lib.TrainerState(
            global_step=step, max_steps=self.total_steps,
            epoch=self.plan.epoch(step, len(self.dataset)),
            num_train_epochs=self.plan.num_train_epochs(len(self.dataset), self.total_steps))


def build_run(cfg: config_lib.TrainConfig, devices=None) -> Run:
    """Everything a run needs, built once, from the checkpoint to resume when there is one."""
    # A PEFT adapter directory as the model: its base, its settings, its weights to start from.
    cfg = peft_io.adapter_settings(cfg)
    out = Path(cfg.run.output_dir)
    # Before any work: a run that can't write its checkpoints stops now, not at the first save.
    storage.check_writable(out, "output_dir")
    # One run per output_dir, before anything of this run is written there (config.yaml too).
    lock = RunDirLock.acquire(out)
    try:
        return _build_run(cfg, out, lock, devices)
    except BaseException:
        lock.release()  # a run that did not start leaves no stale lock behind
        raise


def _build_run(cfg: config_lib.TrainConfig, out: Path, lock: RunDirLock, devices) -> Run:
    """build_run's work, with output_dir held."""
    check_writable(out / "checkpoints")
    cfg, mesh, sampler_mesh = _meshes(cfg, devices)
    eval_prompts = (cfg.eval_prompts_per_batch(mesh_lib.batch_divisor(mesh)) if cfg.eval.enabled
                    else 0)
    # Each weight is read straight onto its sharding: no device holds a whole copy.
    model, model_dir = peft_io.load_model(cfg, mesh)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools = tools_lib.load_tools(cfg.multi_turn.tools)
    data_args = cfg.data
    if tools:  # as TRL: a parser, a prefix-preserving template, which the prompts use too
        tokenizer = tools_lib.prepare_tool_tokenizer(
            data_lib.set_chat_template(tokenizer, data_args), data_args.chat_template_kwargs)
        data_args = dataclasses.replace(data_args, chat_template=None)  # the tokenizer has it
    dataset = data_lib.load_prompts(data_args, tokenizer, tools=tools, model_dir=model_dir)
    if dataset.num_truncated and dist.is_main():
        print(f"{dataset.num_truncated} of {len(dataset)} prompts were longer than "
              f"max_prompt_length={cfg.data.max_prompt_length} and lost their left end",
              file=sys.stderr)
    eval_dataset = (data_lib.load_prompts(data_args, tokenizer, test=True, tools=tools,
                                          model_dir=model_dir)
                    if eval_prompts else None)
    # Reward models run on the trainer's mesh (in multi-process runs on this process's devices:
    # reward_model.scoring_mesh), in the run's compute dtype.
    funcs = rewards_lib.load_reward_funcs(
        cfg.grpo.reward_funcs, cfg.grpo.reward_processing_classes, mesh=mesh,
        dtype=cfg.numerics.dtype, chat_template_kwargs=cfg.data.chat_template_kwargs,
        max_completion_length=cfg.generation.max_completion_length,
        soft_punish_cache=cfg.grpo.soft_punish_cache)
    plan = cfg.batch_plan(mesh_lib.batch_divisor(mesh))
    # A multi-process split run: each host's sampler decodes its share of each batch.
    hosts = jax.process_count() if sampler_mesh is not None and dist.multi_process() else 1
    if hosts > 1:  # refused on every process together: none is left inside a collective
        model_cfg = model.cfg
        dist.together(lambda: _refuse_hosts(hosts, plan, model_cfg))
    total_steps = run_facts.total_steps(cfg.batch, plan, len(dataset))
    policy = Policy(model, step_config(cfg, plan, model.cfg), cfg.optim, total_steps, mesh)
    state = policy.init_state
    del model
    rollout = make_rollout(cfg, policy.model_config, tokenizer, sampler_mesh or mesh, model_dir,
                           tools, batch_divisor=mesh_lib.batch_divisor(mesh), hosts=hosts)
    # Partial rollouts' rows in flight start empty, for prompts up to the data's longest.
    width = None if rollout.partial is None else int(max(np.diff(dataset.offsets)))
    split = _split(cfg, rollout, sampler_mesh, width)
    scorer = RewardScorer(funcs, tokenizer, mesh, cfg.grpo.num_generations)
    run_round = GRPORound(policy, rollout, plan, scorer, scorer.names, cfg.grpo, split)
    # beta = 0: no reference model is kept at all.
    reference = (None if not run_facts.has_reference(cfg)
                 else reference_copy(state.params, policy.model_config.dtype)
                 if run_facts.keeps_reference_copy(cfg) else ADAPTERS_OFF)
    g_eval = cfg.eval.num_generations_eval or cfg.grpo.num_generations
    eval_scorer = dataclasses.replace(scorer, num_generations=g_eval)
    evaluator = (evaluation.Evaluator(run_round, eval_dataset, eval_scorer, g_eval, eval_prompts,
                                      mesh_lib.batch_divisor(mesh)) if eval_prompts else None)
    schedule = evaluation.schedule(cfg.eval, cfg.run.logging_steps, total_steps,
                                   plan.gradient_accumulation_steps,
                                   plan.micro_steps_per_epoch(len(dataset)))
    # What a data position means, kept in each checkpoint (the data-parallel size is free).
    positions = {"num_prompts": len(dataset), **{
        k: v for k, v in dataclasses.asdict(plan).items() if k != "data_parallel_size"}}
    checkpoints = RunCheckpoints.open(out, cfg, positions, record=dataset.record,
                                      hosts=hosts)
    rows_in_flight = None if rollout.partial is None else rollout.partial.empty(width)
    at = checkpoints.resume(cfg, out, RunState(state, reference=reference,
                                               rows_in_flight=rows_in_flight))
    if dist.is_main():  # without this process's id: the file serves every process of a resume
        _write_settings(out, dataclasses.replace(
            cfg, distributed=dataclasses.replace(cfg.distributed, process_id=None)), at.step)
    return Run(cfg, out, plan, total_steps, dataset, rollout, scorer, run_round, evaluator,
               eval_scorer, schedule, checkpoints, at, lock)


def _meshes(cfg: config_lib.TrainConfig, devices):
    """The run's settings with its mesh chosen, the trainer's mesh and, with sampler_devices,
    the sampler's (the first N devices; the trainer takes the rest), each laid out by
    choose_mesh's rules for its own devices (the sampler's: never the run's given mesh)."""
    n = cfg.rollout.sampler_devices
    if n is None:
        cfg = choose_mesh(cfg, devices)
        return cfg, mesh_lib.make_mesh(cfg.mesh, devices), None
    pod = dist.multi_process()  # processes from the environment, not num_processes
    if pod and not cfg.rollout.sampler_process:
        raise ConfigError("sampler_devices in a multi-process run needs sampler_process: each "
                          "process's sampler runs in a process of its own on its host's "
                          "sampler_devices; set sampler_process true")
    devices = list(jax.local_devices() if devices is None else devices)
    if cfg.rollout.sampler_process and devices[0].platform != "cpu":
        raise ConfigError(f"sampler_process runs on CPU hosts only for now (this run's devices "
                          f"are {devices[0].platform}): unset sampler_process to split the "
                          "devices within this process (sampler_devices)")
    if n >= len(devices):
        raise ConfigError(f"sampler_devices {n} leaves no device to train on: this process "
                          f"has {len(devices)}")
    if pod:
        unset = [name for name, on in (("eval_strategy", cfg.eval.enabled),
                                       ("tools", bool(cfg.multi_turn.tools))) if on]
        if unset:
            raise ConfigError("a multi-process split run (sampler_devices) does not run "
                              f"{', '.join(unset)} yet: unset it")
    # Multi-process: each host keeps its first n devices for its sampler, the trainer's mesh
    # spans the rest of every host's (rollout/native/sampler_hosts.py).
    trainer = devices[n:] if not pod else [
        d for p in range(jax.process_count())
        for d in sorted((d for d in jax.devices() if d.process_index == p),
                        key=lambda d: d.id)[n:]]
    own = choose_mesh(dataclasses.replace(cfg, mesh=config_lib.MeshConfig()), devices[:n])
    cfg = choose_mesh(cfg, trainer)
    return (cfg, mesh_lib.make_mesh(cfg.mesh, trainer),
            mesh_lib.make_mesh(own.mesh, devices[:n]))


def _refuse_hosts(hosts: int, plan: config_lib.BatchPlan, model_cfg) -> None:
    """What a multi-process split run (sampler_hosts.py) does not run, one ConfigError."""
    if model_cfg.vision is not None:
        raise ConfigError("a multi-process split run (sampler_devices) does not train a "
                          "vision-language model yet: run it in one process")
    if plan.prompts_per_generation % hosts:
        raise ConfigError(f"a multi-process split run shares each batch's "
                          f"{plan.prompts_per_generation} prompts between its {hosts} "
                          "processes' samplers: make prompts_per_generation a multiple of them")


def _split(cfg: config_lib.TrainConfig, rollout, sampler_mesh, width: int | None
           ) -> disaggregated.Split | None:
    """With sampler_devices, the sampler a round ahead: in this process on `sampler_mesh`, or
    (sampler_process) in a process of its own laid out the same."""
    if sampler_mesh is None or rollout.generates_ahead:  # (a rollout_func's episodes a round
        return None  # ahead on the sampler's mesh: rollout/async_rounds.py)
    r = cfg.rollout
    if not r.sampler_process:
        return disaggregated.SplitRollouts(rollout.partial, sampler_mesh, r.max_staleness)
    settings, turns = rollout.process_parts(cfg.multi_turn.tools)
    spec = SamplerSpec(settings, dict(sampler_mesh.shape), width, turns)
    if not dist.multi_process():
        return SamplerProcess(spec, r.sampler_devices, r.max_staleness)
    sampler = SamplerProcess(sampler_hosts.host_spec(spec), r.sampler_devices, r.max_staleness)
    return sampler_hosts.SamplerHosts(sampler, cfg.grpo.num_generations)


def train(cfg: config_lib.TrainConfig, *, devices=None) -> dict:
    """Run (or resume) training on `devices` (default: all). Returns the last metrics."""
    run = build_run(cfg, devices)
    try:
        return run_rounds(run)
    finally:
        if run.round.split_rollouts is not None:
            run.round.split_rollouts.close()  # after _finish collected its last advance
        run.lock.release()  # after _finish: the run writes nothing more in output_dir


def run_rounds(run: Run) -> dict:
    """The rounds until max_steps, a stop signal or an error, each of which ends with a
    checkpoint. Returns the last metrics."""
    cfg, plan = run.cfg, run.plan
    ckpt, total_steps = run.checkpoints.ckpt, run.total_steps
    log = RunLog.open(run.out, cfg.run, plan, total_steps, len(run.dataset), run.at.step)
    run.round.sync_weights(run.at.state.params)
    base_key = jax.random.key(cfg.data.seed)
    if run.at.generated_ahead is not None and run.rollout.generates_ahead:  # resumed: the
        # batch in flight generated again as it was (async rounds on the JAX sampler)
        params, staleness = run.at.generated_ahead
        run.rollout.resume_ahead(params, run.round.weights_for(params, run.rollout.weight_mode),
                                 staleness, *_in_flight(run))
        run.at = run.at.replace(generated_ahead=None)
    eval_key = jax.random.fold_in(base_key, EVAL_KEY_TAG)
    saves = log.saves
    if cfg.run.save_strategy == "no" and dist.is_main():
        print("grpo_jax: save_strategy 'no': no periodic checkpoints; the run's end and a stop "
              "are still checkpointed (export and --resume read the state from there)",
              file=sys.stderr)
    failure = None
    # One process alone can't abort a round its peers are inside: with several, every process
    # stops after the same round.
    with StopSignal(interrupt=not dist.multi_process()) as stop:
        # Async rounds with dynamic sampling: each batch drawn starts the next one's prefetch.
        ahead = (run.rollout.prefetch if run.rollout.generates_ahead
                 and cfg.grpo.dynamic_sampling else None)
        draws = Draws(run.dataset, plan, run.data_epochs, stop, ahead, base_key,
                      run.checkpoints.hosts)

        def evaluate():
            # A split run evaluates on the sampler's devices once its advance has ended: one
            # program there at a time, and the next round collects the same advance.
            run.at = run.round.settle(run.at)
            step = run.at.step
            run.eval_scorer.trainer_state = run.trainer_state(step)
            with stop.interruptible():  # changes nothing a checkpoint holds
                metrics = run.evaluator(run.at, jax.random.fold_in(eval_key, step))
            log.evaluation(step, metrics)

        try:
            if run.evaluator is not None and cfg.eval.eval_on_start:
                evaluate()
            # Every process stops at the same round, also when only one got the signal.
            while (run.at.step < total_steps and not draws.used_up
                   and not dist.any_process(stop.should_stop())):
                t0 = time.perf_counter()
                at, draw = run.at, None
                if not run.round.windows_buffered(at):  # windows buffered: train first, as TRL
                    if run.round.split_rollouts is not None:  # the batch sampled ahead, collected
                        at = run.round.settle(at)
                        if at.queued is None:  # the first round's: sampled here, once
                            first = draws.draw(at.position, at.rows_in_flight)
                            if first is None:
                                break
                            at = run.round.prime(at, first, jax.random.fold_in(base_key, at.round))
                    draw = draws.draw(at.position, at.rows_in_flight)
                    if draw is None:  # dynamic sampling read the run's last prompts
                        break
                    if run.rollout.generates_ahead:  # async rounds: the next round's, beside
                        if not cfg.grpo.dynamic_sampling:  # (else started by the draw)
                            ahead, _ = run.dataset.batch_prompts(draw.after,
                                                                 plan.prompts_per_generation)
                            run.rollout.prefetch(ahead, plan.num_generations,
                                                 jax.random.fold_in(base_key, at.round + 1))
                        at = at.replace(in_flight=((at.round + 1, draw.after),))
                first = at.step
                run.scorer.trainer_state = run.trainer_state(first)
                # Stops at max_steps exactly, and at the next evaluation or checkpoint, also
                # mid-round (the rest stays buffered, and goes into the checkpoint).
                stop_at = min(total_steps, run.schedule.next_due(first) or total_steps,
                              saves.next_due(first) or total_steps)
                run.at, result = run.round(at, draw, jax.random.fold_in(base_key, at.round),
                                           max_updates=stop_at - first, stop=stop)
                if draw is not None and result.scores is None:
                    continue  # stopped while dynamic sampling filled the batch
                if ahead is not None and draw is not None:  # the fill may have read on: the
                    # batch prefetched is the one after the last prompts it read
                    run.at = run.at.replace(in_flight=((run.at.round, run.at.position),))
                log.round(run.at, result, first, generated=draw is not None, started=t0)
                ckpt.poll()  # a background checkpoint write that failed stops the run now
                if log.skips.exceeded:  # every process saw the same updates skipped
                    ckpt.wait()  # the checkpoint named is committed
                    raise dist.raised_on_all(log.skips.error(run.at.state.params,
                                                             ckpt.directory))
                dist.together(run.lock.check)  # output_dir vanished (unmounted): stop, save not
                if not result.updates:
                    continue
                if run.evaluator is not None and run.schedule.due(run.at.step):
                    evaluate()
                if saves.due(run.at.step):
                    run.at = run.round.settle(run.at)  # the sampler's advance in it, whole
                    run.checkpoints.save(_with_ahead(run), log.last)
            log.flush(run.at.step)  # the steps since the last log (TRL: in its final summary)
            if draws.used_up and run.at.step < total_steps:
                _data_used_up(run)
            elif run.at.step < total_steps:  # stopped: by this process's signal or a peer's
                raise dist.raised_on_all(StopRun(stop.received or signal.SIGTERM))
        except BaseException as e:
            failure = e
            raise
        finally:
            _finish(run, failure, log)
    return log.last


class Draws:
    """The rounds' prompts, read from `dataset` a generation batch at a time. With dynamic
    sampling a batch fills from as many prompts as it takes, but never past the run's
    `epochs` (transformers' num_train_epochs; with max_steps, the epochs its steps touch):
    there the run ends, as verl's ends with its dataloader, endless mode
    (max_num_gen_batches 0) too. `epochs` None: no such bound (without dynamic sampling the
    steps end the run).

    `prefetch` (async rounds with dynamic sampling: Rollout.prefetch): every batch handed out
    first starts generating the one after it in data order, keyed by its data position
    (dynamic_sampling.key_at over `key`), as is the batch handed out: the fill that asks for
    more finds it under way, and so does the next round when this one's fill is done."""

    def __init__(self, dataset, plan: config_lib.BatchPlan, epochs: int | None, stop,
                 prefetch=None, key=None, hosts: int = 1):
        """`hosts`: the processes whose samplers share each batch's groups (a multi-process
        split run), each holding its share of the rows in flight."""
        self.dataset, self.plan, self.epochs, self.stop = dataset, plan, epochs, stop
        self.hosts = hosts
        self.prefetch, self.key = prefetch, key
        self.used_up = False

    def _ahead(self, draw: Draw | None) -> Draw | None:
        """`draw`, the prefetch of the batch after it started (none past the run's epochs)."""
        if draw is None or self.prefetch is None:
            return draw
        rows, after = self.dataset.batch_rows(draw.after, self.plan.prompts_per_generation)
        if self.epochs is None or after.epoch < self.epochs:
            self.prefetch([self.dataset.record(i) for i in rows], self.plan.num_generations,
                          ds.key_at(self.key, draw.after))
        return draw

    def _past(self, position: data_lib.DataPosition) -> bool:
        self.used_up = self.used_up or (self.epochs is not None and position.epoch >= self.epochs)
        return self.used_up

    def draw(self, position: data_lib.DataPosition, rows_in_flight=None) -> Draw | None:
        """The generation batch at `position` (None: past the run's data). With partial
        rollouts (`rows_in_flight`), the prompts of the group slots the last round emptied:
        every group slot's at first (max_inflight_tasks: whole generation batches), one batch
        a round after; their epochs' ends don't end an update window (the groups trained are
        others)."""
        n = self.plan.prompts_per_generation
        batches = 1 if rows_in_flight is None else rows_in_flight.empty_groups * self.hosts // n
        draw = self._ahead(self._read(position, batches))
        if draw is not None and rows_in_flight is None:
            draw = draw._replace(ends_epoch=self.dataset.ends_epoch(draw.after, n))
        if draw is None or self.epochs is None:
            return draw
        cursor = draw.after

        def more():
            nonlocal cursor
            if dist.any_process(self.stop.should_stop()):
                return None  # the batch is dropped; a resume regenerates it from the position
            nxt = self._ahead(self._read(cursor, 1))
            if nxt is not None:
                cursor = nxt.after
            return nxt  # None: the batch being filled is dropped, the run ends with its data
        return draw._replace(more=more)

    def _read(self, position: data_lib.DataPosition, batches: int) -> Draw | None:
        """`batches` generation batches of prompts from `position`, or None past the run's
        epochs."""
        n, rows, after = self.plan.prompts_per_generation, [], position
        for _ in range(batches):
            more, after = self.dataset.batch_rows(after, n)
            rows += more
        if self._past(after):
            return None
        key = None if self.prefetch is None else ds.key_at(self.key, position)
        return Draw([self.dataset.record(i) for i in rows], after, rows=tuple(rows), key=key)


def _data_used_up(run: Run) -> None:
    """dynamic_sampling read the run's last prompts before max_steps: as verl, the run ends
    there (exit 0, its end checkpointed), said once; with no update at all the reward gave no
    signal in the whole data: NoSignalError."""
    step, total, cfg = run.at.step, run.total_steps, run.cfg
    why = (f"dynamic_sampling used up the run's {run.data_epochs} epoch(s) of prompts "
           f"({len(run.dataset)} prompts each; num_train_epochs"
           f"{', or the epochs max_steps takes unfiltered' if cfg.batch.max_steps > 0 else ''})")
    if not step:
        raise NoSignalError(
            f"{why} without filling one batch with {run.plan.prompts_per_generation} prompt "
            "groups with reward std > 0: the reward gives no signal, every completion of a "
            "prompt scores the same. Check the reward functions and the data's difficulty")
    if dist.is_main():
        print(f"grpo_jax.train: {why} at step {step} of {total}: the run ends here with its "
              "data, as verl's does (step checkpointed; the batch being filled is dropped); "
              "raise num_train_epochs to train on more", file=sys.stderr)


def _in_flight(run: Run) -> tuple[list[dict], int, Any]:
    """The records, group size and key of the run state's batch in flight (async rounds:
    train.run_rounds prefetches it so; with dynamic sampling keyed by its data position,
    as Draws prefetches it)."""
    (r, position), = run.at.in_flight
    records, _ = run.dataset.batch_prompts(position, run.plan.prompts_per_generation)
    base = jax.random.key(run.cfg.data.seed)
    key = (ds.key_at(base, position) if run.cfg.grpo.dynamic_sampling
           else jax.random.fold_in(base, r))
    return records, run.plan.num_generations, key


def _with_ahead(run: Run) -> RunState:
    """The run state a checkpoint holds: with async rounds on the JAX sampler, the params of
    the batch in flight (one batch ahead; with dynamic sampling the batch at the data
    position, the first the next fill reads, or the one a stopped fill began with: the fill's
    later batches are prefetched on the state's weights either way)."""
    if len(run.at.in_flight) != 1:
        return run.at
    return run.at.replace(generated_ahead=run.rollout.generated_ahead(*_in_flight(run)))


def _finish(run: Run, failure: BaseException | None, log: RunLog) -> None:
    """A run's end, however it ends: the final checkpoint (whether finished, interrupted or
    failed mid-round: the state saved is the last completed update, never a half-applied one;
    not after a failed checkpoint write, nor by a process that failed alone), the writes waited
    for, the logs closed; a stop said on one line."""
    ckpt, refs = run.checkpoints.ckpt, run.checkpoints.refs
    final_error = None
    moved = run.lock.moved()  # output_dir is gone: no final checkpoint into what is there now
    if dist.failed_alone(failure):
        # A checkpoint is written by all processes together; the others are not here.
        print("this process failed alone: no final checkpoint, the last periodic one "
              "stands", file=sys.stderr)
    else:
        try:  # the step is read here: a step that failed may have taken the state's buffers
            # The sampler's advance (sampler_devices) ended, and in the state saved, whole.
            run.at = run.round.settle(run.at)
            step = run.at.step
            if (moved is None and ckpt.failed is None and step not in ckpt.all_steps()
                    and step > 0 and not isinstance(failure, UpdatesSkippedError)):
                # A failed round's versions may be half-kept: its batch in flight is generated
                # again on the state's weights.
                whole = failure is None or isinstance(failure, StopRun)
                run.checkpoints.save(_with_ahead(run) if whole else run.at, log.last)
        except CheckpointWriteError as e:
            final_error = e
        except Exception as e:  # e.g. buffers donated to a step that failed
            why = "" if e is failure else f" ({type(e).__name__}: {e})"  # said once, below
            print(f"no final checkpoint{why}; the last periodic one stands", file=sys.stderr)
        try:
            ckpt.close()  # waits for the last write
        except CheckpointWriteError as e:
            final_error = final_error or e
        if refs is not None:
            refs.close()
    log.close()
    if moved is not None:  # what else failed (a checkpoint write in flight) followed from it
        if str(moved) != str(failure):
            raise moved from None
    elif final_error is not None and final_error is not failure:
        raise final_error  # the run's end (or its failure) could not be checkpointed
    if isinstance(failure, StopRun) and dist.is_main():  # a stop leaves the state whole
        step = run.at.step
        done = (f"the last completed update, step {step}, is checkpointed in "
                f"{ckpt.directory}; --resume continues the run" if step
                else "no update was completed, so there is nothing to checkpoint")
        print(f"grpo_jax.train: stopped by {signal.Signals(failure.signum).name}: "
              f"{done}", file=sys.stderr)


def _checkpoint_source(path: str, out: Path, ckpt: Checkpointer) -> tuple[Path, int]:
    """(the run directory, step) of resume_from_checkpoint `path`: a checkpoint directory
    RUN/checkpoints/STEP of this run or another, or a run's output_dir (its newest)."""
    p = Path(path).expanduser().resolve()
    if p == out.resolve() and ckpt.latest_step() is not None:
        return p, ckpt.latest_step()
    if p.parent.name == "checkpoints" and p.name.isdigit() and int(p.name) in committed_steps(
            p.parent):
        return p.parent.parent, int(p.name)
    if p != out.resolve() and committed_steps(p / "checkpoints"):
        return p, committed_steps(p / "checkpoints")[-1]
    raise TrainError(f"resume_from_checkpoint {path}: not a checkpoint; give a checkpoint "
                     "directory (OUTPUT_DIR/checkpoints/STEP, of this run or another) or a run's "
                     f"output_dir (its newest). This run's checkpoints: {ckpt.directory}/STEP "
                     f"({ckpt.all_steps() or 'none yet'})")


def _write_settings(out: Path, cfg: config_lib.TrainConfig, step: int) -> None:
    """The run's config.yaml. One with other settings is kept as config.step-<STEP>.yaml (the
    settings the run had up to that step; a resume has said so, a fresh run says it here)."""
    path = out / "config.yaml"
    if settings_diff(_saved_settings(out), cfg.to_dict()):
        kept = path.replace(out / f"config.step-{step}.yaml")
        if not step:
            print(f"{path} held another run's settings: kept as {kept}", file=sys.stderr)
    path.write_text(cfg.to_yaml())


def _saved_settings(out: Path) -> dict | None:
    """The settings of the run whose checkpoints are in `out` (its config.yaml), or None."""
    import yaml
    try:
        saved = yaml.safe_load((out / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    dist.default_xla_flags()
    cfg = None
    try:
        cfg = cli.parse_cli(argv)
        dist.initialize(cfg.distributed)
        last = train(cfg)
    except GrpoJaxError as e:
        print(f"grpo_jax.train: error: {e}", file=sys.stderr)
        return dist.exit_code(2, e)
    except OSError as e:
        cause = storage.storage_cause(e)
        if cause is None or cfg is None:
            raise
        # A full or read-only disk under the logs, the buffer files, ...: the checkpoints
        # written before it stand.
        out = Path(cfg.run.output_dir)
        print(f"grpo_jax.train: error: can't write the run's files in {out}: "
              f"{storage.describe(cause)}; {last_good(out / 'checkpoints')}. Free space or fix "
              "the directory, then resume with --resume", file=sys.stderr)
        return dist.exit_code(2, e)
    except StopRun as e:  # checkpointed and said so: the exit code tells schedulers it stopped
        return dist.exit_code(128 + e.signum, e)
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
        # Significant digits, not decimals: a learning rate of 3.3e-7 is not 0.0.
        print(json.dumps({k: v if v is None else float(f"{v:.6g}") for k, v in last.items()}))
    return 0


def _exit(code: int) -> None:
    """Exit with `code`. After a failure, writer threads a failed checkpoint left behind (Orbax's,
    waiting out its 300 s timeout: internals.release_orbax_writers frees those it can find) must
    not hold the process: it ends without joining them, its output flushed. Nor does it finalize
    the interpreter then: tensorstore's writes still completing would print their reports
    through a sys.excepthook finalization has already removed (checkpoint.quiet_closed_loop_reports)."""
    if code:  # the run's end is checkpointed (or said not to be) and its logs closed by now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    quiet_closed_loop_reports()
    _exit(main())
