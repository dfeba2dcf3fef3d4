"""Where a run reads, writes and runs: data, evaluation, the device mesh, outputs, and its
processes."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from grpo_jax.config.fields import arg
from grpo_jax.errors import check


@dataclasses.dataclass(frozen=True)
class DataArgs:
    dataset_name: str = arg(
        "smol_prompts",
        "A hub id, a local .json/.jsonl/.csv/.parquet file or directory, or a built-in "
        "('smol_prompts': the shipped Reddit-style posts; 'arithmetic': synthetic sums; "
        "'squares': drawn images, how many red squares).")
    dataset_config: str | None = arg(None, "The dataset's config name (a hub dataset's subset).")
    dataset_train_split: str = arg("train", "The split trained on.")
    dataset_test_split: str = arg(
        "test",
        "The split evaluated on (with eval_strategy / eval_on_start).")
    eval_dataset_name: str | None = arg(
        None,
        "Evaluate on another dataset (same forms as dataset_name); None: dataset_name's test "
        "split.")
    prompt_column: str = arg("prompt", "The column holding the prompts (text or chat messages).")
    max_prompt_length: int | None = arg(
        None,
        "TRL removed this in 0.28 (\"filter your dataset\") and no longer truncates (the default "
        "here too); set it to cut longer prompts' left end (load_prompts reports how many).")
    shuffle_dataset: bool = arg(True, "Shuffle the prompts each epoch (seeded by seed).")
    seed: int = arg(
        42,
        "Seeds the data order and synthetic data; the trainer derives its sampling key from it.")
    system_prompt: str | None = arg(
        None,
        "A system message that leads every prompt's chat (open-r1).")
    chat_template: str | None = arg(None, "A Jinja chat template that replaces the tokenizer's.")
    chat_template_kwargs: dict | None = arg(
        None,
        "To apply_chat_template, e.g. {enable_thinking: false} (Qwen3).")
    image_buckets: tuple[str, ...] | None = arg(
        None,
        "Image sizes ('HxW' pixels, e.g. [448x448, 336x448, 448x336]) each image is scaled "
        "(aspect kept) and padded to, the closest in aspect, so a batch's largest image, "
        "whose patch count its programs are compiled for, takes one of these sizes "
        "(grpo_jax.images); null: the processor's own sizing.")

    def __post_init__(self):
        check(self.max_prompt_length is None or self.max_prompt_length >= 1,
              f"max_prompt_length must be >= 1 or null, got {self.max_prompt_length}")
        check(self.image_buckets is None or len(self.image_buckets) >= 1,
              "image_buckets must name at least one HxW size, or be null")


STRATEGIES = ("no", "steps", "epoch")


@dataclasses.dataclass(frozen=True)
class EvalArgs:
    eval_strategy: Literal["no", "steps", "epoch"] = arg(
        "no",
        "When to evaluate: no, every eval_steps steps, or each epoch.")
    eval_steps: float | None = arg(
        None,
        "Optimizer steps between evaluations (null: logging_steps; < 1: that fraction of the "
        "run).")
    eval_delay: float = arg(
        0.0,
        "Steps (epochs with eval_strategy 'epoch') before the first evaluation.")
    eval_on_start: bool = arg(False, "Also evaluate before the first step (a sanity check).")
    per_device_eval_batch_size: int = arg(8, "Completions per eval batch per data-parallel shard.")
    num_generations_eval: int | None = arg(
        None,
        "Completions per eval prompt (null: num_generations).")

    def __post_init__(self):
        check(self.eval_strategy in STRATEGIES, f"eval_strategy must be one of {STRATEGIES}, "
              f"got {self.eval_strategy!r}")
        check(self.eval_steps is None or (self.eval_steps > 0 and (
            self.eval_steps < 1 or self.eval_steps == int(self.eval_steps))),
            f"eval_steps must be a whole number of steps, or a fraction in (0, 1) of the run's "
            f"steps, got {self.eval_steps}")
        check(self.eval_delay >= 0, f"eval_delay must be >= 0, got {self.eval_delay}")
        check(self.per_device_eval_batch_size >= 1, "per_device_eval_batch_size must be >= 1")
        check(self.num_generations_eval is None or self.num_generations_eval >= 1,
              f"num_generations_eval must be >= 1 or null, got {self.num_generations_eval}")

    @property
    def enabled(self) -> bool:
        return self.eval_strategy != "no" or self.eval_on_start


AXES = ("data", "fsdp", "tensor")
EXPERT = "expert"  # only in meshes with ep > 1, between fsdp and tensor
CONTEXT = "context"  # only in meshes with cp > 1, between expert and tensor


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes (data, fsdp, tensor; expert for a mixture of experts, context
    for long sequences), the
    config's `mesh` section; one may be -1 (= all remaining devices). An unset axis is 1,
    except `dp`, which takes the devices left when no axis is -1. With no size set at all the
    run has given no mesh (`given` is False): train and aot then choose one
    (`default_config`), pure data parallelism when that fits."""

    dp: int | None = arg(
        None,
        "Data-parallel devices: params replicated (unset: the devices left over).")
    fsdp: int | None = arg(
        None,
        "Fully sharded data-parallel devices: params, grads and optimizer state split over them.")
    tp: int | None = arg(None, "Tensor-parallel devices: heads and MLP columns split over them.")
    ep: int | None = arg(
        None,
        "Expert-parallel devices: a mixture of experts' experts split over them.")
    cp: int | None = arg(
        None,
        "Context-parallel devices: each row's positions split over them (long rows).")

    def __post_init__(self):
        sizes = [s for s in dataclasses.astuple(self) if s is not None]
        check(all(s == -1 or s >= 1 for s in sizes) and sizes.count(-1) <= 1,
              f"mesh sizes (dp, fsdp, tp, ep, cp) = {dataclasses.astuple(self)}: each must be "
              ">= 1, and at most one -1")

    @property
    def given(self) -> bool:
        return any(s is not None for s in dataclasses.astuple(self))

    def sizes(self) -> tuple[int, ...]:
        """The sizes (dp, fsdp, tp, ep, cp) with the unset ones filled in (one may still be -1)."""
        sizes = dataclasses.astuple(self)
        rest = -1 if -1 not in sizes else 1
        return tuple((rest if i == 0 else 1) if s is None else s for i, s in enumerate(sizes))

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's axis names: `expert` only when ep is not 1, `context` when cp is not 1."""
        return tuple(a for a, s in zip(_ORDER, self._ordered()) if s != 1 or a in AXES)

    def _ordered(self) -> list[int]:
        dp, fsdp, tp, ep, cp = self.sizes()
        return [dp, fsdp, ep, cp, tp]

    def shape(self, num_devices: int) -> tuple[int, ...]:
        """Axis sizes for `num_devices` devices (in `axes` order), the -1 axis taking what is
        left."""
        sizes = [s for a, s in zip(_ORDER, self._ordered()) if s != 1 or a in AXES]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            check(num_devices % known == 0, f"mesh {dict(zip(self.axes, sizes))}: {num_devices} "
                  f"devices are not divisible by the fixed axes' product {known}")
            sizes[sizes.index(-1)] = num_devices // known
        check(math.prod(sizes) == num_devices, f"mesh {dict(zip(self.axes, sizes))} needs "
              f"{math.prod(sizes)} devices but {num_devices} are in use; set one size to -1")
        return tuple(sizes)


# MeshConfig's fields, in order, and the mesh axis each sizes
FIELD_AXES = {"dp": "data", "fsdp": "fsdp", "tp": "tensor", "ep": EXPERT, "cp": CONTEXT}
_ORDER = ("data", "fsdp", EXPERT, CONTEXT, "tensor")  # the mesh's axis order


def _steps_or_ratio(value: float, total_steps: int) -> int:
    """transformers' logging_steps / save_steps / eval_steps: a whole number of optimizer steps,
    or a fraction < 1 of the run's: ceil(total_steps * fraction)."""
    return max(math.ceil(total_steps * value) if value < 1 else int(value), 1)


@dataclasses.dataclass(frozen=True)
class RunArgs:
    output_dir: str = arg(
        "outputs/grpo",
        "Where checkpoints, metrics, logs and the run's config.yaml go.")
    logging_steps: float = arg(
        10,
        "Optimizer steps per metrics record (TRL averages its metrics over them); < 1: a fraction "
        "of the run's steps, as transformers.")
    logging_strategy: Literal["no", "steps", "epoch"] = arg(
        "steps",
        "When metrics records are written: every logging_steps, at each epoch's end, or 'no' "
        "(none during the run; the run's last steps are still logged once at its end, as "
        "transformers logs its final summary).")
    logging_first_step: bool = arg(False, "Also write a metrics record after the first step.")
    save_strategy: Literal["no", "steps", "epoch"] = arg(
        "steps",
        "When checkpoints are written: every save_steps (also inside a generation round: its "
        "micro-batches not yet trained on go into the checkpoint), at each epoch's end, or 'no': "
        "no periodic ones. Unlike transformers, 'no' still checkpoints the run's end and a stop "
        "(signal or failure): export and --resume read the state from there.")
    save_steps: float = arg(500, "< 1: a fraction of the run's steps, as transformers")
    save_total_limit: int | None = arg(None, "Checkpoints kept, the newest (null: all).")
    log_completions: bool = arg(
        False,
        "Write completions.jsonl (and a W&B table) and print a sample of each round's.")
    num_completions_to_print: int | None = arg(
        None,
        "How many of each round's completions to print (null: all, as TRL).")
    log_unique_prompts: bool = arg(
        False,
        "The W&B completions table keeps one row per prompt (TRL).")
    report_to: tuple[Literal["tensorboard", "wandb"], ...] = arg(
        ("tensorboard",),
        "TRL's default is 'none'; tensorboardX is a dependency here, so its log is on by default.")
    max_consecutive_skipped_updates: int = arg(
        5,
        "Optimizer updates in a row skipped because their loss or gradients were not finite "
        "(NaN/inf: the weights stay as they were) after which the run stops with an error "
        "naming its last good checkpoint (0: never stop). Not in TRL, whose run goes on.")
    resume: bool | str = arg(
        False,
        "Continue from the newest checkpoint in output_dir (true), or from a checkpoint "
        "directory (RUN/checkpoints/STEP, TRL's resume_from_checkpoint PATH; another run's is "
        "read, never changed, and this run goes on in output_dir) or a run's output_dir.")

    def __post_init__(self):
        for name in ("logging_strategy", "save_strategy"):
            check(getattr(self, name) in STRATEGIES, f"{name} must be one of {STRATEGIES}, got "
                  f"{getattr(self, name)!r}")
        for name in ("logging_steps", "save_steps"):
            v = getattr(self, name)
            check(v > 0 and (v < 1 or float(v).is_integer()), f"{name} must be a whole number "
                  f"of steps, or a fraction in (0, 1) of the run's steps, got {v}")
        check(self.save_total_limit is None or self.save_total_limit >= 1,
              f"save_total_limit must be >= 1 or null, got {self.save_total_limit}")
        check(self.max_consecutive_skipped_updates >= 0,
              f"max_consecutive_skipped_updates must be >= 0 (0: never stop), got "
              f"{self.max_consecutive_skipped_updates}")
        check(self.num_completions_to_print is None or self.num_completions_to_print >= 0,
              f"num_completions_to_print must be >= 0 or null, got "
              f"{self.num_completions_to_print}")

    def steps_of(self, total_steps: int) -> tuple[int, int]:
        """(logging, saving) intervals in optimizer steps for a run of total_steps."""
        return (_steps_or_ratio(self.logging_steps, total_steps),
                _steps_or_ratio(self.save_steps, total_steps))


@dataclasses.dataclass(frozen=True)
class DistributedArgs:
    coordinator_address: str | None = arg(
        None,
        "One of several processes (grpo_jax.distributed; docs/multihost.md). Unset: from "
        "$GRPO_JAX_COORDINATOR / $JAX_COORDINATOR_ADDRESS, $GRPO_JAX_NUM_PROCESSES and "
        "$GRPO_JAX_PROCESS_ID, else detected under srun and on Cloud TPU pods, else one process. "
        "host:port of process 0")
    num_processes: int | None = arg(
        None,
        "How many processes the run has (unset: from the environment, else 1).")
    process_id: int | None = arg(
        None,
        "This process's rank, 0 to num_processes - 1 (unset: from the environment).")
    heartbeat_timeout: int = arg(
        100,
        "Seconds without a peer's heartbeat before every process ends.")

    def __post_init__(self):
        check(self.num_processes is None or self.num_processes >= 1,
              f"num_processes must be >= 1, got {self.num_processes}")
        check(self.process_id is None or self.process_id >= 0,
              f"process_id must be >= 0, got {self.process_id}")
        check(self.heartbeat_timeout >= 1,
              f"heartbeat_timeout must be >= 1 second, got {self.heartbeat_timeout}")
