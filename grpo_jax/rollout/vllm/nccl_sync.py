"""`vllm_weight_sync: nccl`: the trainer's weights broadcast GPU to GPU through vLLM's own NCCL
weight-transfer engine (server: `grpo_jax.serve ... --weight-transfer-config
'{"backend": "nccl"}'`). Built against vLLM 0.32's API; not run here (no machine of this project
has vLLM and a GPU): `tools/vllm_gpu_check.py` is the check for the first one that has.

vLLM's trainer-side engine (`NCCLTrainerWeightTransferEngine`, which needs torch and vLLM in the
trainer's environment) does the rendezvous, runs `/update_weights` beside the packed broadcast
and checks that what is sent matches what was announced. Ours supplies its two inputs: the
control client (our VLLMClient implements vLLM's VLLMWeightSyncClient, with the API key), and
`JaxSource`, vLLM's WeightSource protocol over the trainer's params: HF-named tensors made on the
device (the layout change and the cast are jitted there) and handed to torch by DLPack, no host
copy, one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

import jax
import jax.numpy as jnp

from grpo_jax import hf


@dataclasses.dataclass(frozen=True)
class Meta:
    """vLLM's ParamMeta, duck-typed: the trainer need not import vLLM to describe its weights."""
    name: str
    dtype: Any  # torch.dtype
    shape: tuple[int, ...]


def hf_parts(cfg, dtype, tower: bool = True) -> dict[str, list]:
    """Exported tensor name (hf.export_name, as the other transports send it) -> its parts
    [(table name, layer or None, expert or None)], in vLLM's layerwise order
    (layerwise_order): embeddings, layer 0 .. L-1, then the final norm and the head (the tied
    head too: vLLM keeps its own copy). A vision-language model's tower (vision/*) only with
    `tower`: a push leaves a frozen one out, as http's does."""
    parts = {hf.export_name(cfg, k): v[0]
             for k, v in hf.hf_tensor_parts(cfg, jnp.dtype(dtype)).items()
             if tower or not v[0][0][0].startswith("vision/")}
    if cfg.tie_word_embeddings:
        parts[hf.export_name(cfg, "lm_head.weight")] = parts[
            hf.export_name(cfg, "model.embed_tokens.weight")]
    return {k: parts[k] for k in layerwise_order(parts)}


def layerwise_order(names) -> list[str]:
    """vLLM's layerwise_groups (vllm.distributed.weight_transfer.base), flattened: the names
    without an integer segment that come before the first one with, then each stack (the
    prefix before a name's outermost integer segment) in the order its prefix first appears,
    index ascending, then the other names without. Its own here: the trainer describes its
    weights without importing vLLM (JaxSource runs in the test venv, which has none);
    tests/test_vllm_nccl_plan.py holds it to vLLM's."""
    pre, post, stacks = [], [], {}
    for name in names:
        parts = name.split(".")
        at = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if at is None:
            (post if stacks else pre).append(name)
            continue
        stacks.setdefault((".".join(parts[:at]), int(parts[at])), []).append(name)
    rank: dict[str, int] = {}
    for prefix, _ in stacks:
        rank.setdefault(prefix, len(rank))
    order = sorted(stacks, key=lambda key: (rank[key[0]], key[1]))
    return [*pre, *(n for key in order for n in stacks[key]), *post]


def hf_tensor(cfg, params, parts, dtype) -> jax.Array:
    """One HF tensor on the device from table-layout params (as the trainer holds them)."""
    def leaf(name, i, expert):
        node = params
        for p in name.split("/"):
            node = node[p]
        w = node[...] if i is None else node[...][i]
        return (w if expert is None else w[expert]).astype(dtype)
    return hf.assemble(cfg, parts, leaf)


class JaxSource:
    """vLLM's WeightSource over the trainer's current params (`set` before each send)."""

    def __init__(self, cfg, dtype: str, device=None, tower: bool = True):
        import torch
        self.cfg, self.parts = cfg, hf_parts(cfg, dtype, tower)
        self.dtype, self.torch_dtype = jnp.dtype(dtype), getattr(torch, dtype)
        self.device = device or jax.devices()[0]  # the sender's GPU
        specs = {hf.export_name(cfg, k): v[1]
                 for k, v in hf.hf_tensor_parts(cfg, self.dtype).items()}
        embed = hf.export_name(cfg, "model.embed_tokens.weight")  # a tied head's shape
        self.shapes = {k: tuple(specs[k if k in specs else embed].shape) for k in self.parts}
        self.params, self.alive = None, []

    def set(self, params) -> None:
        self.params, self.alive = params, []

    def metadata(self) -> list[Meta]:
        return [Meta(k, self.torch_dtype, self.shapes[k]) for k in self.parts]

    def __iter__(self):
        import torch
        for key, parts in self.parts.items():
            array = jax.device_put(hf_tensor(self.cfg, self.params, parts, self.dtype), self.device)
            array.block_until_ready()  # DLPack hands torch the buffer, not the pending work
            # torch does not own it, and vLLM's packer copies it on its own CUDA streams later:
            # JAX must not reuse the buffer before the send ends (costs one copy of the model in
            # the wire dtype; a bounded ring is for the first GPU session to try).
            self.alive.append(array)
            yield key, torch.from_dlpack(array)

    def held_names(self):
        return None

    def groups(self):
        return [[k] for k in self.parts]


def connect(client, source: JaxSource, master_address: str | None = None):
    """vLLM's trainer engine, joined with the server's workers (rank 0 = this process)."""
    from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                              NCCLTrainerWeightTransferEngine)
    world = int(client.world_size())
    address = master_address or socket.gethostbyname(socket.gethostname())
    with socket.socket() as s:  # a free port for the rendezvous store
        s.bind(("", 0))
        port = s.getsockname()[1]
    info = NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=world + 1,
                               rank=0)
    return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)


def push(client, engine, source: JaxSource, params, version: str) -> None:
    """One update: pause (requests in flight finish first), broadcast, name it, resume."""
    source.set(params)
    client.pause()
    try:
        engine.send_weights()
        client.set_weight_version(version)
    finally:
        client.resume()
        source.set(None)
