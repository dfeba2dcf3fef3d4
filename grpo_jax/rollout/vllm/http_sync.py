"""Trainer side of `vllm_weight_sync: http`: weights pushed through vLLM's own weight-sync routes.

One update is: `POST /pause?mode=wait` (requests in flight finish first, then the prefix cache,
which holds KV of the old weights, is dropped; nothing runs while layers are half loaded),
`/start_weight_update`, one bucket per request, `/finish_weight_update` with the trainer step as
the weight version, `/resume`. The server runs our engine `grpo_http`
(grpo_jax.rollout.server.http_engine), which reads the tensors out of each bucket, so nothing is
written to any filesystem on either side. A bucket goes to our route `/grpo/update_weights`
(worker.RAW_UPDATE_ROUTE) as raw bytes, which hands it to the engine client's own
`update_weights` exactly as vLLM's `/update_weights` would: that route takes JSON only, and
base64 plus parsing cost more than the transfer (docs/vllm_weight_sync.md). With LoRA only the
adapters travel (`kind: lora`): the server merges them into the base it kept from the last full
sync.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import time

import numpy as np

from grpo_jax.errors import ServerTimeoutError, VLLMServerError
from grpo_jax.rollout.server.wire import HTTP_BACKEND, PROTOCOL

# Bucket size bound. Each bucket is one request; the server briefly holds its body, the parsed
# string and the decoded bytes (~3.7x the bucket), so this bounds its transient memory while
# keeping the per-request overhead (a few ms) small against the bytes moved. A tensor bigger
# than a bucket travels alone.
BUCKET_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class SyncStats:
    seconds: float
    bytes: int  # tensor bytes moved (the base64 on the wire is 4/3 of it)
    buckets: int

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9)


def plan_buckets(sizes: dict[str, int], bucket_bytes: int = BUCKET_BYTES) -> list[list[str]]:
    """Consecutive names (in the given order, which the server loads in) packed into buckets of
    at most `bucket_bytes`, except that a tensor bigger than that fills a bucket alone."""
    buckets: list[list[str]] = []
    used = bucket_bytes  # forces a first bucket
    for name, n in sizes.items():
        if used + n > bucket_bytes or not buckets:
            buckets.append([])
            used = 0
        buckets[-1].append(name)
        used += n
    return buckets


def encode(tensors: dict[str, np.ndarray], names: list[str], **extra) -> tuple[dict, bytes]:
    """One bucket: its update_info without the data, and the packed little-endian bytes."""
    arrays = [np.ascontiguousarray(tensors[n]) for n in names]
    for n, a in zip(names, arrays):
        if a.dtype.byteorder == ">":
            raise ValueError(f"{n}: big-endian array; the wire is little-endian")
    meta = {"names": list(names), "dtype_names": [a.dtype.name for a in arrays],
            "shapes": [list(a.shape) for a in arrays], **extra}
    return meta, b"".join(a.tobytes() for a in arrays)


def connect(client, keep_base: bool) -> None:
    """Initialise the server's engine; fails clearly when the server runs another backend."""
    backend = client.model_info().get("weight_transfer_backend")
    if backend != HTTP_BACKEND:
        raise VLLMServerError(
            f"vllm_weight_sync http needs the server's weight-transfer backend grpo_http, but "
            f"{client.base_url} runs {backend!r}; start it with `python -m grpo_jax.serve` "
            "(which sets --weight-transfer-config '{\"backend\": \"grpo_http\"}')")
    client.init_weight_transfer_engine({"protocol": PROTOCOL, "keep_base": keep_base})


def push(client, tensors: dict[str, np.ndarray], version: str, kind: str = "full",
         lora_scaling: float = 1.0, bucket_bytes: int = BUCKET_BYTES) -> SyncStats:
    """One update with `tensors` (HF names, the server's dtype); returns its stats."""
    start = time.perf_counter()
    buckets = plan_buckets({n: a.nbytes for n, a in tensors.items()}, bucket_bytes)
    extra = {"kind": kind, "lora_scaling": float(lora_scaling)}
    try:
        client.pause()
        _send(client, tensors, buckets, extra)
        client.finish_weight_update(version)
    except ServerTimeoutError as e:
        # Hung (a stalled network, a frozen server): the routes would hang again, so no clean-up;
        # a restarted server is re-synced in full (vllm.sync.ServerWeights.resync).
        raise ServerTimeoutError(f"weight sync to {client.base_url} hung: {e} "
                                 "(weight_sync_timeout)") from None
    except VLLMServerError:
        # Leave the server serving: close the update (layers not reached keep their weights)
        # and resume; the caller pushes everything again or stops.
        with contextlib.suppress(VLLMServerError):
            client.finish_weight_update(None)
        with contextlib.suppress(VLLMServerError):
            client.resume()
        raise
    client.resume()
    moved = sum(a.nbytes for a in tensors.values())
    return SyncStats(time.perf_counter() - start, moved, len(buckets))


def _send(client, tensors, buckets, extra) -> None:
    client.start_weight_update()
    # Packing bucket k+1 overlaps sending bucket k (the copies and the socket release the GIL).
    with cf.ThreadPoolExecutor(1) as pool:
        nxt = pool.submit(encode, tensors, buckets[0], last=len(buckets) == 1, **extra)
        for i in range(len(buckets)):
            body = nxt.result()
            if i + 1 < len(buckets):
                nxt = pool.submit(encode, tensors, buckets[i + 1], last=i + 2 == len(buckets),
                                  **extra)
            client.update_weights_raw(*body)
            del body
