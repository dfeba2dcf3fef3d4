"""Count the kernels of the bench workload's programs compiled for an NVIDIA GPU, without one.

    python tools/gpu_aot.py sampler                       # launches per decode step
    python tools/gpu_aot.py train-step --remat_policy dots --xla xla_gpu_enable_triton_gemm=false

The programs are `python -m grpo_jax.aot`'s (its h100 target, one GPU); memory and roofline
time are that tool's report. What this adds: kernels per decode step (the decode loop is
launch-bound: at batch 64 each kernel costs a few microseconds however little it does) and
copies of large buffers. Without a device there is no autotuning, so matmul tilings (and
split-K reduce kernels) may differ from the device's. Timings need the device.

Needs jax's CUDA plugin (.ci/install_aot.sh DIR; run with DIR/bin/python and this repo on
PYTHONPATH). Options besides `--target-config FILE` (a GpuTargetConfigProto; default: the
H100 in grpo_jax.aot.hardware) and `--xla FLAG=VALUE` are training options with TRL's names;
the defaults are the bench workload (Qwen2-0.5B shapes, 8 x 8 completions, 256 + 256 tokens).
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

import jax

jax.config.update("jax_platforms", "cpu")  # compile-only: never open a GPU runtime

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from grpo_jax import cli  # noqa: E402
from grpo_jax.aot import analyze, hardware, programs  # noqa: E402

BENCH = ["--model_name_or_path", "qwen2.5-0.5b", "--max_prompt_length", "256",
         "--max_completion_length", "256", "--num_generations", "8",
         "--per_device_train_batch_size", "64", "--loss_type", "dapo"]
LAUNCHES = ("kKernel", "kCustomKernel", "kCublasLtMatmul", "kGemm", "kCuDnn", "kCopy",
            "kMemset32BitValue", "kMemzero", "kSort", "kCustomCall")


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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python tools/gpu_aot.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["sampler", "train-step"])
    p.add_argument("--target-config", help="GpuTargetConfigProto text file")
    p.add_argument("--xla", action="append", default=[], metavar="FLAG=VALUE",
                   help="an XLA debug option for this compile, e.g. "
                        "xla_gpu_enable_triton_gemm=false")
    p.add_argument("--num-layers", type=int, help="compile this many of the model's layers")
    args, rest = p.parse_known_args(argv)
    target = hardware.parse_target("h100:1")
    config = open(args.target_config).read() if args.target_config else hardware.H100_TARGET
    run = analyze.make_lowering(target, cli.parse_cli(BENCH + rest), gpu_target_config=config)
    if args.num_layers:
        run = run.with_layers(args.num_layers)
    options = {}
    for kv in args.xla:
        k, v = kv.split("=", 1)
        options[k] = {"true": True, "false": False}.get(v.lower(), v)
    dump = tempfile.mkdtemp(prefix="gpu_aot_")
    with analyze.backend_of(target):
        lowered = programs.build(run).lowered["generate" if args.what == "sampler" else "update"]
        compiled = lowered.compile({"xla_dump_to": dump, **options})
    # The thunk sequence after command-buffer conversion, where that pass changed anything.
    thunks = ""
    for pattern in ("*thunk_sequence_after_thunk_passes.txt", "*thunk_sequence.txt"):
        files = sorted(glob.glob(os.path.join(dump, pattern)), key=os.path.getmtime)
        if files:
            thunks = open(files[-1]).read()
            break
    for scope, counts in launches_by_scope(thunks).items():
        total = sum(v for k, v in counts.items() if k != "kCommandBuffer")
        print(f"{scope:<14} {total:>5} launches  {dict(counts)}")
    mem = compiled.memory_analysis()
    print(f"temporaries {mem.temp_size_in_bytes / 2**30:.2f} GiB, arguments "
          f"{mem.argument_size_in_bytes / 2**30:.2f} GiB")
    copies = big_copies(compiled.as_text())
    print(f"copies of >= 1M elements: {len(copies)}")
    for line in copies[:10]:
        print("   ", line)


if __name__ == "__main__":
    main()
