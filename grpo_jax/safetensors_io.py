"""Read and write the safetensors format with numpy alone (bf16 through ml_dtypes).

The format is an 8-byte little-endian header length, a JSON header, then raw tensor bytes; doing
it by hand avoids a torch/flax dependency and handles bf16, which numpy lacks.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_BY_STR = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def load(path, dtype=np.float32) -> dict[str, np.ndarray]:
    """All tensors in one file, floating ones converted to `dtype` (None keeps the stored one)."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    (n,) = struct.unpack("<Q", raw[:8].tobytes())
    header = json.loads(raw[8:8 + n].tobytes())
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        arr = raw[base + start:base + end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
        is_float = arr.dtype.kind == "f" or arr.dtype == _DTYPES["BF16"]
        if is_float and dtype is not None:
            arr = arr.astype(dtype)
        out[name] = np.array(arr)
    return out


def save(tensors: dict[str, np.ndarray], path) -> None:
    header, offset = {}, 0
    for name, arr in tensors.items():
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the spec asks for 8-byte alignment of the data
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def save_sharded(tensors: dict[str, np.ndarray], out_dir: Path, *, dtype: str = "float32",
                 max_shard_bytes: int = 2 * 1024**3) -> list[Path]:
    """model.safetensors, or model-0000k-of-0000n.safetensors + index when over the limit."""
    np_dtype = _DTYPES[_BY_STR[dtype]]
    cast = {k: np.asarray(v).astype(np_dtype) if np.asarray(v).dtype.kind == "f" else v
            for k, v in tensors.items()}
    shards: list[dict] = [{}]
    size = 0
    for k, v in cast.items():
        if shards[-1] and size + v.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    if len(shards) == 1:
        path = out_dir / "model.safetensors"
        save(shards[0], path)
        return [path]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save(shard, out_dir / name)
        paths.append(out_dir / name)
        weight_map.update({k: name for k in shard})
    total = sum(v.nbytes for v in cast.values())
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths
