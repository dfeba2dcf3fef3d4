"""vLLM weight-transfer engine `grpo_http`, run *inside* the vLLM server (imports torch and vLLM).

The weights travel in the bodies of vLLM's own weight-sync routes: `/start_weight_update`, then one
`/update_weights` per bucket (many tensors packed into one base64 string), then
`/finish_weight_update`. So the server needs no filesystem shared with the trainer and no NCCL:
a server on another host, or a CPU server, takes weights through the HTTP port it already has.
vLLM 0.32's own backends can't do this: `nccl`, `sparse_nccl` and `nccl_m2n` need NCCL (CUDA),
`ipc` sends CUDA IPC handles, `sharded_rdt` needs Ray with NIXL, `modelexpress` a separate service.
Its `ipc` backend also ships its payload as base64 inside update_info: the same wire convention.

Loading follows vLLM's layerwise-reload lifecycle, as its NCCL engine does (start: move the layers
to meta and defer processing; update: `model.load_weights`; finish: re-run the kernel processing,
e.g. the CPU repacking of linear weights), so layers can arrive over several buckets.

`kind: "lora"` buckets carry LoRA adapters only: the worker keeps the base weights of the last
full sync in memory and loads base + scaling * B @ A for every adapted weight (and the base for
the rest of the model), so the wire carries only the adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pybase64
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from grpo_jax.rollout.server.wire import PROTOCOL
# The dtypes a bucket may carry, by the names the trainer sends (numpy's): looked up here, never
# with getattr(torch, <request data>).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def update_bytes(info) -> int:
    """The bytes a bucket's tensors need, from its names / dtype_names / shapes (an
    HTTPUpdateInfo or its JSON dict), which are checked first: ValueError if malformed."""
    get = info.get if isinstance(info, dict) else lambda k: getattr(info, k, None)
    names, dtypes, shapes = get("names"), get("dtype_names"), get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)
            and all(isinstance(n, str) for n in names)):
        raise ValueError("update_info needs names, dtype_names and shapes: lists of one entry "
                         "per tensor")
    total = 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        if dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {str(dtype)[:40]!r} is not one of {sorted(DTYPES)}")
        if not (isinstance(shape, list) and all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise ValueError(f"{name}: shape {str(shape)[:80]} is not a list of sizes >= 0")
        total += DTYPES[dtype].itemsize * math.prod(shape)
    return total


@dataclass
class HTTPInitInfo(WeightTransferInitInfo):
    protocol: int = 0
    keep_base: bool = False  # a LoRA run: keep full syncs in memory as the adapters' base


@dataclass
class HTTPUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    # The tensors' little-endian bytes, concatenated in `names` order: raw (our route,
    # worker.RAW_UPDATE_ROUTE) or base64 (a JSON body to vLLM's /update_weights).
    data: bytes | str
    kind: str = "full"  # or "lora": names are "<weight>.lora_A" / "<weight>.lora_B" pairs
    lora_scaling: float = 1.0
    last: bool = False  # the update's last bucket (a LoRA update merges then)
    extra: dict = field(default_factory=dict)


def unpack(info: HTTPUpdateInfo) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors: views of one decoded buffer (which the views keep alive)."""
    need = update_bytes(info)
    raw = bytearray(info.data if isinstance(info.data, (bytes, bytearray))
                    else pybase64.b64decode(info.data, validate=True))
    if need != len(raw):
        raise ValueError(f"bucket holds {len(raw)} bytes but its tensors need {need}")
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    out, offset = [], 0
    for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
        dtype = DTYPES[dtype_name]
        n = dtype.itemsize * math.prod(shape)
        out.append((name, flat[offset:offset + n].view(dtype).reshape(shape)))
        offset += n
    return out


class HTTPWeightTransferEngine(WeightTransferEngine[HTTPInitInfo, HTTPUpdateInfo]):
    init_info_cls = HTTPInitInfo
    update_info_cls = HTTPUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.base: dict[str, torch.Tensor] = {}  # last full sync, HF names: the LoRA base
        self.adapters: dict[str, torch.Tensor] = {}  # a LoRA update's buckets so far
        self.scaling = 1.0
        self.keep_base = False

    def init_transfer_engine(self, init_info: HTTPInitInfo) -> None:
        if init_info.protocol != PROTOCOL:
            raise ValueError(f"trainer speaks grpo_http protocol {init_info.protocol}, this "
                             f"server {PROTOCOL}: use the same grpo_jax on both sides")
        self.keep_base = init_info.keep_base
        if not self.keep_base:
            self.base = {}

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.adapters = {}
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # Not the base class's: it ends with torch.accelerator.synchronize(), which a CPU
        # server has no accelerator for; loading here is synchronous anyway.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: HTTPUpdateInfo) -> None:
        tensors = unpack(info)
        if info.kind == "full":
            if self.keep_base:  # copies: the decoded buffer is freed with the request
                self.base.update((n, t.clone()) for n, t in tensors)
            self.model.load_weights(tensors)
        elif info.kind == "lora":
            if not self.base:
                raise RuntimeError("a LoRA update needs the base weights first (one full sync)")
            self.adapters.update(tensors)
            self.scaling = info.lora_scaling
            if info.last:
                self.model.load_weights(self.merged())
        else:
            raise ValueError(f"unknown update kind {info.kind!r}")

    def merged(self):
        """Every base weight, with scaling * B @ A added where an adapter targets it."""
        for name, w in self.base.items():
            stem = name.removesuffix(".weight")
            a, b = self.adapters.get(f"{stem}.lora_A"), self.adapters.get(f"{stem}.lora_B")
            if a is None:
                yield name, w
            else:
                delta = (b.float() @ a.float()) * self.scaling
                yield name, (w.float() + delta).to(w.dtype)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self.adapters = {}

    def shutdown(self) -> None:
        self.base, self.adapters = {}, {}
