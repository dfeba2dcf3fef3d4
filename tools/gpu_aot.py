"""Compile the bench workload for an NVIDIA GPU on a machine without one, and count kernels.

    python tools/gpu_aot.py --target-config h100.txtpb sampler      # launches per decode step
    python tools/gpu_aot.py --target-config h100.txtpb train-step --remat-policy dots

XLA compiles "devicelessly" for a GPU described by a GpuTargetConfigProto: the whole GPU
pipeline (fusion, gemm rewriting, scheduling, command buffers) runs, nothing executes. What it
tells: kernels per decode step (the decode loop is launch-bound: at batch 64 each kernel costs
a few microseconds however little it does), copies of large buffers, and the compiled
program's memory. What it can't: without a device there is no autotuning, so matmul tilings
(and split-K reduce kernels) may differ from the device's. Timings need the device.

Needs the CUDA build of the installed jax (`pip install "jax[cuda13]==<jax version>"`, ~4 GB;
a separate venv with this repo on PYTHONPATH is fine) and a target config: on a GPU machine,
`from jax._src.lib import xla_client as xc;
print(xc.get_topology_for_devices(jax.devices()).target_config)`, or XLA's
`xla/backends/gpu/target_config/specs/h100_sxm.txtpb` (drop fields your jaxlib doesn't know).
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import collections
import glob
import math
import os
import re
import sys
import tempfile
import types

import jax

jax.config.update("jax_platforms", "cpu")  # compile-only: never open a GPU runtime

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import topologies  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from grpo_jax import bench  # noqa: E402
from grpo_jax.grpo import train_step as ts  # noqa: E402
from grpo_jax.grpo.optimizer import make_optimizer  # noqa: E402
from grpo_jax.models import Decoder  # noqa: E402
from grpo_jax.models import config as model_config  # noqa: E402
from grpo_jax.rollout.sampler import Sampler  # noqa: E402
from grpo_jax.rollout.sampling import SamplingParams  # noqa: E402

LAUNCHES = ("kKernel", "kCustomKernel", "kCublasLtMatmul", "kGemm", "kCuDnn", "kCopy",
            "kMemset32BitValue", "kMemzero", "kSort", "kCustomCall")


def compile_for_gpu(fn, args, target_config: str, options: dict):
    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                        topology="1x1x1")
    sharding = jax.sharding.NamedSharding(topologies.make_mesh(topo, (1,), ("x",)),
                                          jax.sharding.PartitionSpec())
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        args)
    dump = tempfile.mkdtemp(prefix="gpu_aot_")
    compiled = jax.jit(fn).lower(*args).compile(
        compiler_options={"xla_dump_to": dump, **options})
    # The thunk sequence after command-buffer conversion, where that pass changed anything.
    for pattern in ("*thunk_sequence_after_thunk_passes.txt", "*thunk_sequence.txt"):
        files = sorted(glob.glob(os.path.join(dump, pattern)), key=os.path.getmtime)
        if files:
            return compiled, open(files[-1]).read()
    return compiled, ""


def launches_by_scope(thunks: str) -> dict[str, collections.Counter]:
    """Thunk kinds that launch GPU work, per scope: 'entry', 'while<i> body', 'while<i> cond'."""
    out: dict[str, collections.Counter] = {}
    stack, loops = [(-1, "entry")], 0
    for line in thunks.splitlines():
        indent = len(line) - len(line.lstrip())
        if line.strip() in ("body:", "condition:"):
            while stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, f"while{loops} " + ("body" if "body" in line else "cond")))
            continue
        m = re.match(r"\s*\d+: (\w+)", line)
        if not m:
            continue
        while len(stack) > 1 and stack[-1][0] >= indent:
            stack.pop()
        loops += m.group(1) == "kWhile"
        counter = out.setdefault(stack[-1][1], collections.Counter())
        if m.group(1) in LAUNCHES or m.group(1) == "kCommandBuffer":
            counter[m.group(1)] += 1
    return out


def big_copies(hlo: str, min_elements: int = 1 << 20) -> list[str]:
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]+)\]\{[^}]*\} copy\(", line)
        if m and math.prod(int(d) for d in m.group(1).split(",")) >= min_elements:
            found.append(line.strip()[:140])
    return found


def sampler_program(args, cfg):
    sampler = Sampler(cfg, SamplingParams(max_completion_length=args.completion_len,
                                          stop_token_ids=()), pad_id=0)
    params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param)[1]
    ids = jax.ShapeDtypeStruct((args.prompts * args.generations, args.prompt_len), jnp.int32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    fn = lambda p, i, m, k: sampler._generate(p, i, m, jax.random.wrap_key_data(k))  # noqa
    return fn, (params, ids, ids, key)


def train_step_program(args, cfg):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))),
                                 nnx.Param)
    step_cfg = bench.step_config(args)
    tx, schedule = make_optimizer(bench.OPTIM, 1000)
    state = jax.eval_shape(lambda p: ts.TrainState(p, tx.init(p), jnp.zeros((), jnp.int32)),
                           params)
    n = args.prompts * args.generations
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                         bench.train_batch(cfg, n, args.prompt_len, args.completion_len))
    fn = lambda s, b: ts.train_step(graphdef, tx, schedule, step_cfg, s, b)  # noqa: E731
    return fn, (state, batch)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python tools/gpu_aot.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["sampler", "train-step"])
    p.add_argument("--target-config", required=True, help="GpuTargetConfigProto text file")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--remat-policy", default="full", choices=["full", "dots"])
    p.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"],
                   help="as `bench --attention`; 'auto' picks what it picks on a GPU")
    p.add_argument("--xla", action="append", default=[], metavar="FLAG=VALUE",
                   help="an XLA debug option for this compile, e.g. "
                        "xla_gpu_enable_triton_gemm=false")
    args = p.parse_args(argv)
    if args.attention == "auto":  # the compile-only process runs on the CPU backend
        model_config.jax = types.SimpleNamespace(default_backend=lambda: "gpu")
    cfg = bench.QWEN2_0_5B.replace(remat_policy=args.remat_policy, attention_impl=args.attention)
    options = {}
    for kv in args.xla:
        k, v = kv.split("=", 1)
        options[k] = {"true": True, "false": False}.get(v.lower(), v)
    fn, fn_args = (sampler_program if args.what == "sampler" else train_step_program)(args, cfg)
    compiled, thunks = compile_for_gpu(fn, fn_args, open(args.target_config).read(), options)
    for scope, counts in launches_by_scope(thunks).items():
        total = sum(v for k, v in counts.items() if k != "kCommandBuffer")
        print(f"{scope:<14} {total:>5} launches  {dict(counts)}")
    mem = compiled.memory_analysis()
    if mem is not None:
        print(f"memory GiB: arguments {mem.argument_size_in_bytes / 2**30:.2f}, outputs "
              f"{mem.output_size_in_bytes / 2**30:.2f}, temporaries "
              f"{mem.temp_size_in_bytes / 2**30:.2f}")
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    if cost and "flops" in cost:
        print(f"XLA-counted TFLOP per call: {cost['flops'] / 1e12:.2f}")
    copies = big_copies(compiled.as_text())
    print(f"copies of >= 1M elements: {len(copies)}")
    for line in copies[:10]:
        print("   ", line)


if __name__ == "__main__":
    main()
