"""Push trainer weights into a running vLLM server through a file in shared memory.

The server (started by `grpo_jax.serve`, same machine) is asked over /collective_rpc to load an
HF-named safetensors file into its running model; then its prefix cache, which holds KV computed
with the old weights, is dropped (`vllm_weight_sync: shm`). The transport with no shared
filesystem is grpo_jax.rollout.vllm.http_sync; both are documented in docs/vllm_weight_sync.md.

With LoRA the server may instead run vLLM's own LoRA (`grpo_jax.serve --lora-rank R`): only the
PEFT adapter is written, and the server loads it under a new name each time (`sync_adapter`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import safetensors.numpy

from grpo_jax import peft_io
from grpo_jax.hf import hf_state_dict

FILE_NAME = "weights.safetensors"
ADAPTER_DIR = "adapter-{}"


def private_dir(parent: str | None = None, needed_bytes: int = 0) -> Path:
    """A fresh directory only this user can read (mkdtemp: mode 0700 whatever the umask).

    /dev/shm keeps the round trip in memory; when it is missing or too small (containers often
    give it 64 MB) the system temp directory is used instead.
    """
    if parent is None:
        parent = tempfile.gettempdir()
        if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > needed_bytes:
            parent = "/dev/shm"
    path = Path(tempfile.mkdtemp(prefix="grpo_jax-weights-", dir=parent))
    os.chmod(path, 0o700)
    return path


def write_weights(cfg, params: dict[str, np.ndarray], directory: Path,
                  dtype: str = "float32") -> Path:
    """HF-named safetensors of `params` (table layout) in `directory`, replaced atomically."""
    # Tied models need lm_head.weight too: vLLM keeps a separate (repacked) head tensor that
    # the embedding alone would leave stale.
    return write_tensors(hf_state_dict(cfg, params, dtype=dtype, include_tied_head=True),
                         directory)


def write_tensors(tensors: dict[str, np.ndarray], directory: Path) -> Path:
    """HF-named tensors as one safetensors file in `directory`, replaced atomically."""
    final = Path(directory) / FILE_NAME
    tmp = final.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
    old_umask = os.umask(0o077)
    try:
        safetensors.numpy.save_file(tensors, tmp, metadata={"format": "pt"})
    finally:
        os.umask(old_umask)
    os.replace(tmp, final)  # the server never sees a half-written file
    return final


def sync_weights(client, cfg, params: dict[str, np.ndarray], directory: Path,
                 dtype: str = "float32") -> float:
    """Write, reload on every server worker, drop the prefix cache; returns seconds taken."""
    start = time.perf_counter()
    path = write_weights(cfg, params, directory, dtype)
    reload_file(client, path)
    return time.perf_counter() - start


def reload_file(client, path: Path) -> None:
    client.reload_weights_from_file(path)
    client.reset_prefix_cache()


def param_bytes(params: dict[str, np.ndarray], dtype: str = "float32") -> int:
    per = 2 if dtype in ("bfloat16", "float16") else 4
    return sum(int(np.prod(np.shape(v))) * per for v in params.values())


def sync_adapter(client, tensors: dict[str, np.ndarray], conf: dict, directory: Path,
                 name: str) -> float:
    """Write a PEFT adapter directory and have the server load it as `name`; returns seconds
    taken. Each version needs a new name (and so gets a new vLLM LoRA id, part of every
    prefix-cache key): nothing cached under an older adapter can be served for it. The
    directories of older adapters are removed once the new one is loaded."""
    start = time.perf_counter()
    old_umask = os.umask(0o077)
    try:
        path = peft_io.write_adapter(Path(directory) / ADAPTER_DIR.format(name), tensors, conf)
    finally:
        os.umask(old_umask)
    client.load_adapter(name, path)
    for old in Path(directory).glob(ADAPTER_DIR.format("*")):
        if old != path:
            shutil.rmtree(old, ignore_errors=True)
    return time.perf_counter() - start
