"""Keeping the vLLM server's weights equal to the trainer's: the transport (`vllm_weight_sync`),
the version each push is named with, and the full re-sync of a server that was restarted.

Every push ends by naming the server's weight version (`/finish_weight_update`, or
`/update_weight_version` for the file transport) `grpo-<client id>-<n>`. A restarted server says
"default", so `current()` (GET /weight_info, cheap) tells whether the server still holds what was
pushed last; `resync()` pushes it again: the whole model, and the adapters on top with LoRA.
"""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np

from grpo_jax import hf
from grpo_jax.rollout.vllm import http_sync
from grpo_jax.errors import VLLMServerError
from grpo_jax.rollout.server.wire import HTTP_BACKEND


def resolve_transport(setting: str, client) -> str:
    """`auto`: http when the server runs our engine grpo_http (grpo_jax.serve's default), nccl
    when it runs vLLM's NCCL engine, else the file in shared memory (a server started before
    those engines existed)."""
    if setting != "auto":
        return setting
    backend = client.model_info().get("weight_transfer_backend")
    return {HTTP_BACKEND: "http", "nccl": "nccl"}.get(backend, "shm")


def transfer_metrics(moved: int, seconds: float, **extra) -> dict[str, float]:
    return {"weight_sync/bytes": float(moved),
            "weight_sync/bytes_per_s": moved / max(seconds, 1e-9),
            **{f"weight_sync/{k}": float(v) for k, v in extra.items()}}


class ServerWeights:
    """Pushes weights to one server with one transport and remembers the last push."""

    def __init__(self, client, transport: str, model_cfg, lora_scaling: float | None = None,
                 tower: bool = True):
        """tower: a vision-language model's tower goes with each push (nccl's plan; the other
        transports send what they are given: VLLMRollout._pushed)."""
        self.client, self.transport, self.model_cfg = client, transport, model_cfg
        self.lora_scaling = lora_scaling  # set: push LoRA adapters alone (http), else full
        self.dtype = client.model_info()["dtype"]
        self.prefix, self.count = f"grpo-{uuid.uuid4().hex[:8]}", 0
        self.base: dict[str, np.ndarray] | None = None  # HF tensors the server was given last
        self.adapters: dict[str, np.ndarray] | None = None
        self.metrics: dict[str, float] = {}
        self.restarts = 0
        # One push at a time: async rounds may find a restarted server from their background
        # thread while the trainer pushes.
        self.lock = threading.RLock()
        if transport == "http":
            http_sync.connect(client, keep_base=lora_scaling is not None)
        if transport == "nccl":
            from grpo_jax.rollout.vllm import nccl_sync
            self.source = nccl_sync.JaxSource(model_cfg, self.dtype, tower=tower)
            self.engine = nccl_sync.connect(client, self.source)

    @property
    def version(self) -> str:
        return f"{self.prefix}-{self.count}"

    def push_full(self, table: dict[str, np.ndarray]) -> float:
        """Table-layout params (hf.params_from_state) -> the whole model on the server."""
        tensors = hf.hf_state_dict(self.model_cfg, table, dtype=self.dtype,
                                   include_tied_head=True)
        self.base, self.adapters = tensors, None
        return self._push(tensors, "full")

    def push_adapters(self, base_table, tensors: dict[str, np.ndarray]) -> float:
        """LoRA (http): the adapters alone (peft_io.engine_adapter_tensors), once the server
        holds the frozen base (`base_table()`: its table-layout params, asked for at the first
        push only), which the server merges them into by name."""
        if self.base is None:
            self.push_full(base_table())
        stems = {name.removesuffix(".weight") for name in self.base}
        unmatched = sorted(k for k in tensors if k.rsplit(".", 1)[0] not in stems)
        if unmatched:  # the server would skip them, and sample from the base alone
            raise VLLMServerError(
                f"{len(unmatched)} LoRA tensors (e.g. {unmatched[0]}) adapt no weight pushed "
                "to the server; set vllm_lora_sync: merged (a grpo-jax defect: please report)")
        self.adapters = tensors
        return self._push(self.adapters, "lora")

    def _push(self, tensors, kind: str) -> float:
        with self.lock:
            return self._push_locked(tensors, kind)

    def _push_locked(self, tensors, kind: str) -> float:
        self.count += 1
        if self.transport == "http":
            stats = http_sync.push(self.client, tensors, self.version, kind,
                                   lora_scaling=self.lora_scaling or 1.0)
            self.metrics = transfer_metrics(stats.bytes, stats.seconds, buckets=stats.buckets)
            return stats.seconds
        start = time.perf_counter()
        self.client.sync_tensors(tensors)  # shm: one file in a private dir in /dev/shm
        self.client.set_weight_version(self.version)
        seconds = time.perf_counter() - start
        self.metrics = transfer_metrics(sum(a.nbytes for a in tensors.values()), seconds)
        return seconds

    def push_device(self, params) -> float:
        """nccl: the params as the trainer holds them, broadcast from its GPU (nothing kept for
        a re-sync: a restarted server would need a new NCCL group, not built)."""
        from grpo_jax.rollout.vllm import nccl_sync
        start = time.perf_counter()
        self.count += 1
        nccl_sync.push(self.client, self.engine, self.source, params, self.version)
        seconds = time.perf_counter() - start
        moved = sum(int(np.prod(m.shape)) * self.source.dtype.itemsize
                    for m in self.source.metadata())
        self.metrics = transfer_metrics(moved, seconds)
        return seconds

    def current(self) -> bool:
        return self.client.weight_version() == self.version

    def held(self) -> int | None:
        """Which of our pushes the server holds (None: none, it was restarted)."""
        prefix, _, n = self.client.weight_version().rpartition("-")
        return int(n) if prefix == self.prefix and n.isdigit() else None

    def resync(self, timeout: float) -> None:
        """Wait for the server to be healthy again, then push everything pushed so far."""
        self.client.wait_healthy(timeout)
        with self.lock:
            self._resync_locked()

    def _resync_locked(self) -> None:
        if self.current():
            return
        self.restarts += 1
        if self.transport == "nccl":
            raise VLLMServerError(f"{self.client.base_url} was restarted: re-syncing over NCCL "
                                  "(a new group) is not built; resume the run (--resume)")
        if self.transport == "http":
            http_sync.connect(self.client, keep_base=self.lora_scaling is not None)
        if self.base is None:
            raise VLLMServerError(f"{self.client.base_url} restarted before the first push")
        self._push(self.base, "full")
        if self.adapters is not None:
            self._push(self.adapters, "lora")
