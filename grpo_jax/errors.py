"""Every failure a user can act on, in one place: the programs print one as one line naming the
problem and the fix. A module raises these; none defines its own."""

from __future__ import annotations


class GrpoJaxError(Exception):
    """A problem with the run's input or surroundings; the message names it and the fix."""


class ConfigError(GrpoJaxError, ValueError):
    """A config key or value that can't be used."""


def check(ok: bool, msg: str) -> None:
    """Raise ConfigError(msg) unless `ok`: the settings dataclasses validate with this."""
    if not ok:
        raise ConfigError(msg)


# ---------------------------------------------------------------- configuration and input

class DataError(GrpoJaxError, ValueError):
    """A dataset that can't be loaded or used; the message says what to do."""


class ModelConfigError(GrpoJaxError, ValueError):
    """A model directory or config the decoder can't represent."""


class ModelLoadError(GrpoJaxError, RuntimeError):
    """A model that can't be found or read; the message says what to do."""


class AdapterError(GrpoJaxError, ValueError):
    """A PEFT adapter that can't be used with this model."""


class RewardError(GrpoJaxError, RuntimeError):
    """A reward function that can't be loaded or returned something unusable."""


class ToolError(GrpoJaxError, ValueError):
    """A tool that can't be loaded, or a chat template that can't render tool calls."""


class RolloutFuncError(GrpoJaxError, ValueError):
    """A rollout_func that can't be loaded or returned something unusable."""


class ServeError(GrpoJaxError, ValueError):
    """A server configuration that is refused; the message says how to fix it."""


class ExportError(GrpoJaxError, ValueError):
    """An export destination that is refused; the message says why and what to do."""


# ---------------------------------------------------------------- the run

class TrainError(GrpoJaxError):
    """A run that can't start or go on as asked."""


class UpdatesSkippedError(TrainError):
    """max_consecutive_skipped_updates updates in a row were not finite and skipped: the run
    makes no progress (no final checkpoint: it would hold nothing new)."""


class NoSignalError(GrpoJaxError):
    """max_num_gen_batches generations did not fill a batch with groups that have signal."""


class SamplerProcessError(GrpoJaxError, RuntimeError):
    """The sampler's process (rollout.sampler_process) died or failed; the message says how."""


class DistributedError(GrpoJaxError, RuntimeError):
    """Processes that can't be joined, or a failure on another process."""


class StorageError(GrpoJaxError, OSError):
    """A file or directory the run needs that can't be written; the message names it."""


class CheckpointError(GrpoJaxError):
    """No usable checkpoint where one was asked for."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint written by a run whose settings give the state another shape."""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint whose files differ from the checksums written with it (a flipped bit, a
    file changed or lost since): set aside on resume, refused by export."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written; the run must stop (the message says where the
    last good one is)."""


# ---------------------------------------------------------------- the vllm server

class VLLMServerError(GrpoJaxError, RuntimeError):
    """The server is unreachable, refused a request, or failed it; the message says which."""


class ServerUnreachableError(VLLMServerError):
    """No connection to the server (it died, or is restarting): worth waiting for."""


class ServerTimeoutError(VLLMServerError):
    """The server took a request but did not answer in time: hung, not worth waiting for."""


class ModelMismatchError(VLLMServerError):
    """The server serves a model other than the trainer's."""


class WeightsLost(VLLMServerError):
    """The server answers but holds other weights than were pushed last (it was restarted)."""
