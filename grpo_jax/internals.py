"""The one place grpo-jax reaches into libraries' private modules (`_src`), each use said why.
A library version that moves one of these breaks here alone, and each function degrades to doing
nothing (never to masking the error it helps report). tests/test_architecture.py holds every
other module to public APIs.

- Orbax (0.12): a failed asynchronous save leaves writer threads waiting up to 300 s for a
  signal the failed step will never send; Orbax has no public call to end them, so the
  Checkpointer notes each save's operation id and releases that save's threads itself.
- JAX: whether this is a Cloud TPU VM (a pod slice's hosts join by themselves) is known only to
  `jax._src.cloud_tpu_init`.
"""

from __future__ import annotations

import threading


def orbax_operation_id() -> str | None:
    """The Orbax operation id of the save just started (its writer threads carry it)."""
    try:
        from orbax.checkpoint._src.futures import synchronization
        return synchronization.OperationIdGenerator.get_current_operation_id()
    except Exception:  # noqa: BLE001 - another Orbax: nothing to release later
        return None


def release_orbax_writers(operation_ids: set[str]) -> None:
    """End Orbax's writer threads of the failed saves `operation_ids`: each is cancelled, then
    sent the signal it waits for, so it returns at once instead of after Orbax's coordination
    timeout (and the interpreter, which joins them at exit, is not held either)."""
    try:
        from orbax.checkpoint._src.futures import future
        for t in threading.enumerate():
            if (isinstance(t, future._SignalingThread) and t.is_alive()
                    and t._operation_id in operation_ids):
                t.cancel()
                future.set_signals(t._receive_signals, operation_id=t._operation_id)
    except Exception:  # noqa: BLE001 - best effort: never mask the write error itself
        pass


def running_in_cloud_tpu_vm() -> bool:
    """Whether `import jax` found a Cloud TPU VM (set by jax on such a host)."""
    try:
        from jax._src import cloud_tpu_init
        return bool(cloud_tpu_init.running_in_cloud_tpu_vm)
    except (ImportError, AttributeError):  # another jax: taken as no TPU VM
        return False
