"""Chips and topologies to compile for, without the hardware.

TPU slices come from libtpu (`jax.experimental.topologies`, with TPU_SKIP_MDS_QUERY=1 so it does
not ask a metadata server); NVIDIA GPUs from the CUDA plugin and a GpuTargetConfigProto. Peaks
are public dense bf16 specs; HBM is in GB (1e9 bytes), which errs on the safe side.

Interconnect, per chip, as published:
- TPU v5e: bidirectional ICI 400 GB/s over 4 ports (2-D torus); data-center network 6.4 Tbps per
  256-chip pod, 25 Gbps a chip (cloud.google.com/tpu/docs/v5e).
- TPU v5p: bidirectional ICI 1200 GB/s over 6 ports (3-D torus); DCN 50 Gbps a chip
  (cloud.google.com/tpu/docs/v5p).
- TPU v6e: bidirectional ICI 800 GB/s over 4 ports (2-D torus) (cloud.google.com/tpu/docs/v6e);
  DCN 4 x 200 Gbps NICs per 8-chip host, 100 Gbps a chip (the same page's host table).
- H100 SXM: NVLink 4 at 900 GB/s bidirectional to the NVSwitch (any GPU of the host at full
  rate); one 400 Gb/s NIC per GPU between hosts (NVIDIA H100 and DGX H100 datasheets).
- H200 SXM: the H100's compute and NVLink with 141 GB of HBM3e at 4.8 TB/s (NVIDIA H200
  datasheet); compiled as an H100 with that memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from grpo_jax.errors import GrpoJaxError


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: float
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s, bidirectional, all of a chip's ICI / NVLink ports together
    ici_ports: int | None  # torus links per chip; None: a switch (NVLink)
    dcn_bandwidth: float  # bytes/s a chip sends between slices / hosts


CHIPS = {
    "v5e": Chip("TPU v5e", 16e9, 197e12, 819e9, 400e9, 4, 25e9 / 8),
    "v5p": Chip("TPU v5p", 95e9, 459e12, 2765e9, 1200e9, 6, 50e9 / 8),
    "v6e": Chip("TPU v6e", 32e9, 918e12, 1640e9, 800e9, 4, 100e9 / 8),
    "h100": Chip("H100 SXM", 80e9, 989e12, 3350e9, 900e9, None, 400e9 / 8),
    "h200": Chip("H200 SXM", 141e9, 989e12, 4800e9, 900e9, None, 400e9 / 8),
}
GPUS = ("h100", "h200")

# Chips per slice -> the slice's shape, for names that count chips (v5e-16) or, for v5p,
# TensorCores (v5p-128 = 64 chips; two TensorCores per chip).
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
              256: "16x16"}
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8"}

# An H100 SXM as XLA's GPU compiler needs to know it (public specs: 132 SMs, compute
# capability 9.0, 80 GB HBM3 at 3.35 TB/s, 50 MB L2, 228 KB shared memory per SM).
H100_TARGET = """gpu_device_info {
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: 233472  threads_per_core_limit: 2048  core_count: 132
  fpus_per_core: 128  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535
  block_dim_limit_z: 65535  memory_bandwidth: 3350000000000  l2_cache_size: 52428800
  clock_rate_ghz: 1.98  device_memory_size: 85520809984
  shared_memory_per_block_optin: 232448  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
# The same chip as XLA sees it, with the H200's memory (same SMs, clocks and compute capability).
H200_TARGET = (H100_TARGET
               .replace("memory_bandwidth: 3350000000000", "memory_bandwidth: 4800000000000")
               .replace("device_memory_size: 85520809984", "device_memory_size: 150754820096")
               .replace("NVIDIA H100 80GB HBM3", "NVIDIA H200"))
_GPU_TARGETS = {CHIPS["h100"]: H100_TARGET, CHIPS["h200"]: H200_TARGET}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as given
    chip: Chip
    platform: str  # "tpu", "cuda" (or "cpu": this host's devices)
    topology: str  # libtpu's name (v5e:4x4), the GPU count as "1x1xN" (CPU: the count)
    num_slices: int = 1


def parse_target(name: str, num_slices: int = 1) -> Target:
    """`v5e:4x4`, `v5p:4x4x4`, `v6e:8x8` (libtpu topology names), `v5e-16`, `v5p-128` (Cloud
    TPU names), or `h100:8` / `h200:8` (GPUs in one host)."""
    text = name.strip().lower()
    m = re.fullmatch(r"(v5e|v5p|v6e|h100|h200)([:-])(\d+(?:x\d+)*)", text)
    if not m or (m.group(1) in GPUS and (m.group(2) != ":" or "x" in m.group(3))):
        raise GrpoJaxError(
            f"unknown topology {name!r}: use a TPU slice such as v5e:4x4, v5p:4x4x4, v6e:8x8, "
            "a Cloud TPU name such as v5e-16 or v5p-128, or h100:N / h200:N (N GPUs in one host)")
    kind, sep, dims = m.groups()
    if num_slices < 1 or (kind in GPUS and num_slices != 1):
        raise GrpoJaxError(f"--num-slices {num_slices}: must be >= 1, and 1 for GPUs")
    if kind in GPUS:
        return Target(name, CHIPS[kind], "cuda", f"1x1x{int(dims)}")
    if sep == "-":  # a Cloud TPU name: a count, not a shape
        count = int(dims) // (2 if kind == "v5p" else 1)
        shapes = _SHAPES_3D if kind == "v5p" else _SHAPES_2D
        if count not in shapes:
            raise GrpoJaxError(f"unknown slice {name!r}: {kind} slices here are "
                               + ", ".join(f"{kind}-{n * (2 if kind == 'v5p' else 1)}"
                                           for n in shapes))
        dims = shapes[count]
    if len(dims.split("x")) != (3 if kind == "v5p" else 2):
        raise GrpoJaxError(f"topology {name!r}: {kind} slices are "
                           f"{'3-D (e.g. v5p:4x4x4)' if kind == 'v5p' else '2-D (e.g. v5e:4x4)'}")
    return Target(name, CHIPS[kind], "tpu", f"{kind}:{dims}", num_slices)


def devices(target: Target, gpu_target_config: str | None = None) -> list:
    """The target's devices, as the compiler sees them (no runtime is opened). A "cpu" target
    (tests, trying the tool out) is this host's CPU devices."""
    import jax
    from jax.experimental import topologies

    if target.platform == "cpu":
        return jax.devices("cpu")[:int(target.topology)]
    if target.platform == "cuda":
        try:
            config = gpu_target_config or _GPU_TARGETS[target.chip]
            topo = topologies.get_topology_desc(platform="cuda", target_config=config,
                                                topology=target.topology)
        except Exception as e:  # noqa: BLE001 - jax raises several kinds here
            raise GrpoJaxError(f"can't describe {target.name}: {e}. Compiling for NVIDIA GPUs "
                               "needs the CUDA plugin: pip install --no-deps "
                               "jax-cuda13-plugin jax-cuda13-pjrt (the installed jax's version)"
                               ) from None
        return list(topo.devices)
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server to ask
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no TPU for processes to share
    dims = tuple(int(d) for d in target.topology.split(":")[1].split("x"))
    # A slice smaller than a host (v5e-1: one chip) is one host with those chips; libtpu's
    # default host is 2x2 chips, which it refuses to fit into the slice.
    small = dict(chips_per_host_bounds=(*dims, 1)[:3]) if math.prod(dims) < 4 else {}
    try:
        topo = topologies.get_topology_desc(topology_name=target.topology, platform="tpu",
                                            num_slices=target.num_slices, **small)
    except Exception as e:  # noqa: BLE001
        raise GrpoJaxError(f"can't describe {target.name}: {e}. Compiling for TPUs needs "
                           "libtpu beside jax: .ci/install_aot.sh DIR, then run with "
                           "DIR/bin/python") from None
    return list(topo.devices)
