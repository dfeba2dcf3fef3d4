"""`python -m grpo_jax.aot`: the real update, log-prob and sampler programs of a small model,
compiled for a 4-host TPU slice and for 8 H100s on this CPU machine, with sane memory figures.

The compiles need libtpu and jax's CUDA plugin, which live in a side venv
(`.ci/install_aot.sh DIR`; tests/run.sh sets GRPO_JAX_AOT_PYTHON=DIR/bin/python).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from grpo_jax.aot import hardware, report
from grpo_jax.aot.analyze import model_config
from grpo_jax.errors import GrpoJaxError
from grpo_jax.models import ModelConfig
from grpo_jax.models.presets import PRESETS
from grpo_jax.models.siglip import SiglipConfig

AOT_PYTHON = os.environ.get("GRPO_JAX_AOT_PYTHON")
ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
# 2 completions per chip per micro-batch, 2 micro-batches per update and per generation batch,
# prompt 64 + completion 32 tokens.
SHAPE = ["--max_prompt_length", "64", "--max_completion_length", "32", "--num_generations", "8",
         "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
         "--beta", "0.04"]


def aot_env() -> dict:
    """The aot subprocess's environment: this tree importable, and no XLA_FLAGS (the suite's 8
    host devices mean nothing to the compile)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    return env


def run_aot(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([AOT_PYTHON or sys.executable, "-m", "grpo_jax.aot", *args],
                          cwd=tmp_path, env=aot_env(), capture_output=True, text=True, timeout=900)


# `python -m grpo_jax.aot ARGS` for several ARGS in one process, one after another: the
# module's main (what __main__ runs) with each run's stdout, stderr and exit status apart, as
# run_aot's. One import of jax, libtpu and the CUDA plugin (tens of seconds on a busy 2-core
# machine) instead of one per command.
_MANY = """
import contextlib, io, json, sys, traceback
from grpo_jax.aot.cli import main
runs = []
for argv in json.loads(sys.argv[1]):
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    runs.append({"args": argv, "returncode": code, "stdout": out.getvalue(),
                 "stderr": err.getvalue()})
print("RUNS " + json.dumps(runs))
"""


def run_aot_many(cwd, *commands) -> list[subprocess.CompletedProcess]:
    """run_aot for each of `commands` (argument lists), in one process."""
    proc = subprocess.run([AOT_PYTHON or sys.executable, "-c", _MANY, json.dumps(commands)],
                          cwd=cwd, env=aot_env(), capture_output=True, text=True, timeout=1800)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RUNS ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return [subprocess.CompletedProcess(r["args"], r["returncode"], r["stdout"], r["stderr"])
            for r in json.loads(line[5:])]


def tiny_dir_in(path, name="tiny", model=TINY):
    (path / name).mkdir(exist_ok=True)
    (path / name / "config.json").write_text(json.dumps(model.to_hf()))
    return path


NEEDS_AOT = pytest.mark.skipif(not AOT_PYTHON, reason="GRPO_JAX_AOT_PYTHON is unset: install "
                               "libtpu and the CUDA plugin with `.ci/install_aot.sh DIR` and set "
                               "it to DIR/bin/python")
POD = {"v5e:4x4": ["--dp", "2", "--fsdp", "8"], "h100:8": ["--dp", "1", "--fsdp", "8"]}
# With max_num_seqs: generated through 16 decode slots. The test reads the sampler's phase
# only: the update and log-prob programs of this run are the v5e:4x4 run's above.
REFILL = ["--topology", "v5e:4x4", "--model_name_or_path", "tiny", "--quick", *SHAPE,
          *POD["v5e:4x4"], "--max_num_seqs", "16", "--phases", "generate"]


@pytest.fixture(scope="module")
def pod_runs(tmp_path_factory):
    """The pod tests' aot runs (TPU slice, GPUs, and decode slots), in one process:
    {name: (the CompletedProcess, its --json path)}."""
    cwd = tiny_dir_in(tmp_path_factory.mktemp("pod"))
    commands = {t: ["--topology", t, "--model_name_or_path", "tiny", *SHAPE, *mesh]
                for t, mesh in POD.items()}
    commands["refill"] = REFILL
    procs = run_aot_many(cwd, *[[*args, "--json", f"{i}.json"]
                                for i, args in enumerate(commands.values())])
    return {name: (proc, cwd / f"{i}.json") for i, (name, proc) in
            enumerate(zip(commands, procs))}


@pytest.mark.slow
@NEEDS_AOT
@pytest.mark.parametrize("topology,chips,hosts", [("v5e:4x4", 16, 4), ("h100:8", 8, 1)])
def test_compiles_for_a_pod_without_one(pod_runs, topology, chips, hosts):
    """A 4-host v5e slice meshed data 2 x fsdp 8, and 8 H100s meshed fsdp 8: every phase
    compiles (the sampler whole). The two runs (and test_refilled_decode_slots_for_a_pod's)
    share one process (pod_runs)."""
    proc, out = pod_runs[topology]
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r["chips"], r["hosts"]) == (chips, hosts)
    m, fsdp = r["memory_per_chip"], r["mesh"]["fsdp"]
    # fp32 params, every matrix split over fsdp (norm scales are replicated: ~1% here); AdamW's
    # two moments like them; the reference a copy in the compute dtype (bf16; beta > 0).
    expected = TINY.num_params() * 4 / fsdp / 1e9
    assert m["params_GB"] == pytest.approx(expected, rel=0.03)
    assert m["optimizer_state_GB"] == pytest.approx(2 * m["params_GB"], rel=0.01)
    assert m["reference_params_GB"] == pytest.approx(m["params_GB"] / 2)
    # The sampler's cache: 4 rows per chip (rows over data x fsdp), 96 slots, bf16.
    L, K, Dh = TINY.num_layers, TINY.num_kv_heads, TINY.head_dim
    assert r["plan"]["generation_batch_size"] == 4 * chips
    assert m["kv_cache_GB"] == pytest.approx(2 * L * 4 * K * 96 * Dh * 2 / 1e9)
    resident = m["params_GB"] + m["optimizer_state_GB"] + m["reference_params_GB"]
    for phase in m["phases"].values():
        assert resident <= phase["peak_GB"] < resident + 1.0
    assert m["fits"] and m["peak_GB"] == max(p["peak_GB"] for p in m["phases"].values())
    # The update's FLOPs per chip: fwd + bwd + the remat forward, 8 N per token, within 2x
    # (every trip of the layer and micro-batch loops counted). Shared prefixes: a prompt's
    # tokens once per micro-batch group of its 8 completions (run_facts.planned_prompt_group).
    tokens = 4 * chips * (64 / 8 + 32)
    model_flops = 8 * TINY.num_params() * tokens / chips
    assert 0.5 < r["time"]["phases"]["update"]["tflop"] * 1e12 / model_flops < 2.0
    low, high = r["time"]["round_s"]
    assert 0 < low <= high and 0 < r["time"]["mfu"][1] <= r["time"]["mfu"][0] < 1
    # FSDP: the update gathers weights and scatters gradients over the fsdp axis.
    by = r["communication"]["update"]["by"]
    assert any(k.startswith("all-gather over fsdp") for k in by), by
    assert r["communication"]["update"]["gb"] > 0


@pytest.mark.slow
@NEEDS_AOT
def test_refilled_decode_slots_for_a_pod(pod_runs):
    """With max_num_seqs the run generates through that many decode slots (refilled as rows
    finish): the refill program compiles for the slice (--quick: at 2 and 3 layers), and the
    KV cache per chip is the slots' (16 over 16 chips: 1 per chip) instead of the 64 rows' (4
    per chip). Only the generate phase is compiled (--phases generate): nothing here reads the
    others, which test_compiles_for_a_pod_without_one compiles for the same slice and mesh."""
    proc, out = pod_runs["refill"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled refill" in proc.stderr and "decode slots" in proc.stdout
    r = json.loads(out.read_text())
    assert (r["plan"]["sampler_rows"], r["plan"]["decode_slots"]) == (64, 16)
    L, K, Dh = TINY.num_layers, TINY.num_kv_heads, TINY.head_dim
    m = r["memory_per_chip"]
    assert m["kv_cache_GB"] == pytest.approx(2 * L * 1 * K * 96 * Dh * 2 / 1e9)
    assert set(m["phases"]) == {"generate"}
    assert m["fits"] and m["phases"]["generate"]["peak_GB"] < m["peak_GB"] + 1e-9


# QLoRA's sampler (the NF4 base and the adapters) through --quick's 2- and 3-layer programs, as
# a large model's; LoRA's (the merged copy) compiled whole: one sampler program instead of two.
QUANT = {"lora": [], "qlora": ["--load_in_4bit", "true", "--quick"]}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """test_lora_and_qlora_memory's two aot runs, in one process: {name: (the
    CompletedProcess, its --json path)}."""
    cwd = tiny_dir_in(tmp_path_factory.mktemp("lora"))
    procs = run_aot_many(cwd, *[
        ["--topology", "v5e:2x2", "--model_name_or_path", "tiny", "--json", f"{name}.json",
         "--dp", "2", "--fsdp", "2", *SHAPE, "--use_peft", "true",
         "--lora_target_modules", "all-linear", "--lora_r", "8", *quant]
        for name, quant in QUANT.items()])
    return {name: (proc, cwd / f"{name}.json") for name, proc in zip(QUANT, procs)}


@pytest.mark.slow
@NEEDS_AOT
@pytest.mark.parametrize("name", list(QUANT))
def test_lora_and_qlora_memory(lora_runs, name):
    """With LoRA only the adapters (fp32) and their AdamW state are trained and resident beside
    the frozen base (bf16, or NF4 codes with a fp32 scale per 64 weights); the reference is the
    base with the adapters off (no copy). The sampler reads the quantized base and the adapters
    themselves, or, unquantized, a merged copy that its phase holds on top (LoRA's sampler
    compiled whole, QLoRA's at --quick's 2 and 3 layers). Both runs share one process
    (lora_runs)."""
    from grpo_jax.models import param_table
    from grpo_jax.models.quant import PROJECTIONS
    quant = name == "qlora"
    proc, out = lora_runs[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    m, fsdp = r["memory_per_chip"], 2
    table = param_table(TINY)
    size = {name: np.prod(shape) for name, (shape, _) in table.items()}
    proj = sum(v for k, v in size.items() if k.split("/")[-1] in PROJECTIONS)
    rest = TINY.num_params() - proj  # embedding, head, norms: as loaded, in bf16
    L, D, F, H, K, Dh = (TINY.num_layers, TINY.hidden_size, TINY.intermediate_size,
                         TINY.num_heads, TINY.num_kv_heads, TINY.head_dim)
    adapters = L * 8 * (3 * (D + F) + (D + H * Dh) + 2 * (D + K * Dh) + (H * Dh + D))
    assert m["params_GB"] == pytest.approx(adapters * 4 / fsdp / 1e9, rel=0.05)
    assert m["optimizer_state_GB"] == pytest.approx(2 * m["params_GB"], rel=0.01)
    assert m["reference_params_GB"] == 0
    per_weight = 0.5 + 4 / 64 if quant else 2
    assert m["frozen_base_GB"] == pytest.approx((proj * per_weight + rest * 2) / fsdp / 1e9,
                                                rel=0.05)
    assert r["lora"]["sampler"] == ("the adapters on the base" if quant else "a merged copy")
    resident = m["params_GB"] + m["optimizer_state_GB"] + m["frozen_base_GB"]
    for phase in m["phases"].values():
        assert resident <= phase["peak_GB"] < resident + 1.0
    merged = 0 if quant else (proj + rest) * 2 / fsdp / 1e9
    assert m["phases"]["generate"]["peak_GB"] >= resident + merged
    assert "LoRA r=8" in proc.stdout and "frozen base" in proc.stdout


def test_targets():
    assert hardware.parse_target("v5p-128").topology == "v5p:4x4x4"  # 128 TensorCores
    assert hardware.parse_target("v5e-256").topology == "v5e:16x16"
    assert hardware.parse_target("v5e-1").topology == "v5e:1x1"  # one chip, as QLoRA runs
    assert hardware.parse_target("h100:8").topology == "1x1x8"
    assert hardware.parse_target("h200:1").chip.hbm_bandwidth == 4.8e12
    for bad in ("v5e:16", "tpu-v9", "h100-8", "v5p-12"):
        with pytest.raises(GrpoJaxError, match="v5"):
            hardware.parse_target(bad)


def test_default_layout_adds_a_context_axis_for_long_rows():
    """No mesh settings: FSDP over a slice's chips, data parallel across slices, and a context
    axis that brings a row to 8k tokens per device or fewer (1k prompt + 7k / 15k / 31k)."""
    from grpo_jax.mesh import MeshConfig, long_row_config

    def layout(completion, chips=32, slices=1):
        got = long_row_config(1024, completion, chips, slices)
        return got and got[0]
    assert layout(7168) is None  # short enough: the estimate's choice
    assert layout(15360) == MeshConfig(dp=1, fsdp=16, tp=1, cp=2)
    assert layout(31744) == MeshConfig(dp=1, fsdp=8, tp=1, cp=4)
    assert layout(31744, chips=64, slices=2) == MeshConfig(dp=2, fsdp=8, tp=1, cp=4)
    # Zig-zag over cp devices cuts the completion in 2 x cp chunks: 31746 is no multiple of 4.
    assert layout(31746) is None


@pytest.mark.slow
@pytest.mark.skipif(not AOT_PYTHON, reason="GRPO_JAX_AOT_PYTHON is unset")
def test_long_rows_get_a_context_axis_and_linear_memory(tmp_path):
    """A long-row run on a TPU slice (issue 32), compiled: with no mesh flags aot chooses a
    context axis and says so, attention is splash; on one given layout the update's
    temporaries grow at most linearly with the row's length (no [T, T] scores)."""
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY.to_hf()))
    shape = ["--model_name_or_path", "tiny", "--max_prompt_length", "1024", "--num_generations",
             "2", "--per_device_train_batch_size", "1", "--phases", "update", "--quick"]
    proc = run_aot(tmp_path, "--topology", "v5e:2x4", *shape, "--max_completion_length", "9216",
                   "--json", "chosen.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "chosen.json").read_text())
    assert r["mesh"] == {"data": 1, "fsdp": 4, "context": 2, "tensor": 1}, r["mesh"]
    assert "--cp 2" in proc.stdout and "context axis" in proc.stdout
    assert r["attention"] == "splash"
    # The same layout given by hand, for rows of half the length (5k tokens against 10k).
    long = r["memory_per_chip"]["phases"]["update"]["temporaries_GB"]
    proc = run_aot(tmp_path, "--topology", "v5e:2x4", *shape, "--max_completion_length", "4096",
                   "--dp", "1", "--fsdp", "4", "--cp", "2", "--json", "half.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    half = json.loads((tmp_path / "half.json").read_text())
    assert half["attention"] == "splash" and half["mesh"] == r["mesh"]
    short = half["memory_per_chip"]["phases"]["update"]["temporaries_GB"]
    assert 0 < short and long <= 2.1 * short, (short, long)


def test_presets_match_published_sizes():
    billions = {"smollm2-135m": 0.13, "qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54,
                "qwen2.5-7b": 7.62, "qwen2.5-vl-7b": 8.29, "qwen3-vl-8b": 8.77,
                "qwen2.5-32b": 32.76, "qwen2.5-72b": 72.71, "qwen3-8b": 8.19, "qwen3-32b": 32.76,
                "llama-3.1-8b": 8.03, "llama-3.1-70b": 70.55, "gemma-3-270m": 0.27,
                "gemma-3-1b": 1.0, "gemma-3-4b": 3.88, "gemma-3-12b": 11.77, "gemma-3-27b": 27.01,
                "gemma-3-4b-vlm": 4.3, "gemma-3-12b-vlm": 12.19,
                "gemma-2-2b": 2.61, "gemma-2-9b": 9.24, "gemma-2-27b": 27.23,
                "qwen3-30b-a3b": 30.53, "qwen3-235b-a22b": 235.09, "mixtral-8x7b": 46.7,
                "gpt-oss-120b": 116.83, "gpt-oss-20b": 20.91}
    assert {k: round(v.num_params() / 1e9, 2) for k, v in PRESETS.items()} == billions
    # Mixtures of experts: the parameters a token runs through (published: 3.3B, 22B, 12.9B;
    # gpt-oss's 5.1B and 3.6B leave out the 0.58B embedding).
    active = {"qwen3-30b-a3b": 3.35, "qwen3-235b-a22b": 22.19, "mixtral-8x7b": 12.88,
              "gpt-oss-120b": 5.71, "gpt-oss-20b": 4.19}
    assert {k: round(PRESETS[k].num_params(active=True) / 1e9, 2) for k in active} == active
    # The hub's own config.json (transformers 4 layout), as docs/scaling.md compiles it.
    assert model_config(str(ROOT / "docs/models/qwen3-30b-a3b")) == PRESETS["qwen3-30b-a3b"]
    assert model_config("Qwen/Qwen2.5-7B") == PRESETS["qwen2.5-7b"]
    assert model_config("google/gemma-3-27b-it") == PRESETS["gemma-3-27b"]


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    proc = run_aot(tmp_path, "--topology", "v9z:4x4", "--model_name_or_path", "qwen2.5-7b")
    assert proc.returncode == 2 and proc.stderr.startswith("error: unknown topology")
    proc = run_aot(tmp_path, "--topology", "h100:8", "--model_name_or_path", "gpt-9",
                   "--max_prompt_length", "64")
    assert proc.returncode == 2 and "unknown model preset 'gpt-9'" in proc.stderr


@pytest.mark.skipif(not AOT_PYTHON, reason="GRPO_JAX_AOT_PYTHON is unset")
def test_a_mesh_the_torus_cannot_hold_is_one_line(tmp_path):
    """--fsdp 2 --tp 8 on a 4x4 slice: jax.make_mesh finds no mapping (an axis of 2 or 8 spans
    no whole torus dimensions). mesh.make_mesh, which train.py shares, says so in one line with
    the nearest meshes that map, before anything compiles."""
    proc = run_aot(tmp_path, "--topology", "v6e:4x4", "--model_name_or_path", "qwen2.5-7b",
                   "--max_prompt_length", "64", "--dp", "1", "--fsdp", "2", "--tp", "8")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith("error: mesh {'data': 1, 'fsdp': 2, 'tensor': 8} can't be laid over "
                           "16 TPU v6 lite chips (a 4x4 torus)")
    assert "--dp 1 --fsdp 4 --tp 4" in last


def test_collectives_counted_exactly():
    """A known all-gather (over fsdp), reduce-scatter (over data) and, in a 5-trip scan, another
    all-gather, on the suite's 8 CPU devices: kinds, bytes, mesh axes and trip counts as
    written, read back from the compiled program's HLO."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from grpo_jax import mesh as mesh_lib
    from grpo_jax.aot import comms

    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=2, fsdp=4), jax.devices()[:8])

    def f(x, w):  # per device: x [16, 32] f32, w [32, 32]
        g = jax.lax.all_gather(x, "fsdp", tiled=True)  # [64, 32]: 8 KiB
        s = jax.lax.psum_scatter(g @ w, "data", scatter_dimension=0, tiled=True)  # 8 KiB in
        return jax.lax.scan(lambda c, _: (c + jax.lax.all_gather(c, "fsdp", tiled=True)[:32],
                                          None), s, None, length=5)[0]  # 4 KiB -> 16 KiB, x5

    program = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("fsdp"), P()),
                                    out_specs=P(("data", "fsdp")), check_vma=False))
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    w = jax.ShapeDtypeStruct((32, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
    found, unknown = comms.collectives(program.lower(x, w).compile().as_text(), mesh)
    got = sorted((c.kind, c.size, c.group, c.axes, c.count) for c in found)
    assert unknown == 0 and got == [("all-gather", 8192, 4, ("fsdp",), 1.0),
                                    ("all-gather", 16384, 4, ("fsdp",), 5.0),
                                    ("reduce-scatter", 8192, 2, ("data",), 1.0)]
    # Ring traffic per device: 3/4 of each gathered array, 1/2 of the scattered one.
    chip = hardware.CHIPS["v5e"]
    s = comms.summary(found, chip)
    assert s["gb"] * 1e9 == pytest.approx(0.75 * 8192 + 5 * 0.75 * 16384 + 0.5 * 8192)
    # One torus dimension per axis: 100 GB/s a chip on v5e (400 GB/s over 4 ports).
    assert s["seconds"] == pytest.approx(s["gb"] * 1e9 / 100e9)


def test_replica_groups_and_trip_counts_as_the_tpu_compiler_writes_them():
    """The TPU compiler's HLO: iota and mesh-axes replica groups, and a scan's trip count left
    in its condition (no known_trip_count)."""
    from grpo_jax.aot import comms
    from grpo_jax.aot import hlo as hlo_lib

    assert comms.replica_groups("replica_groups=[4,4]<=[8,2]T(1,0), x", 16).tolist() == [
        [0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert comms.replica_groups("replica_groups=mesh['axis_0'=8,'axis_1'=2] {'axis_1'}, d",
                                16).tolist() == [[2 * i, 2 * i + 1] for i in range(8)]
    # Sub-axes of b (size 4): (1)2 its major half, (2)2 its minor half.
    assert comms.replica_groups("replica_groups=mesh['a'=2,'b'=4] {'b':(1)2}, d", 8).tolist() == [
        [0, 2], [1, 3], [4, 6], [5, 7]]
    assert comms.replica_groups("replica_groups=mesh['a'=2,'b'=4] {'b':(2)2}, d", 8).tolist() == [
        [0, 1], [2, 3], [4, 5], [6, 7]]
    assert comms.replica_groups("replica_groups={{0,4},{1,5}}, d", 8).tolist() == [[0, 4], [1, 5]]
    # A mesh over a permuted device order (iota [2,4] transposed: 0 4 1 5 2 6 3 7).
    assert comms.replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], "
                                "device_ids=([2,4]T(1,0)) {'axis_1'}, d", 8).tolist() == [
        [0, 1], [4, 5], [2, 3], [6, 7]]
    hlo = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0:T(256)} all-reduce(%x), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
  ROOT %t = (s32[]{:T(128)}, f32[8]{0}) tuple(%i, %ar)
}

%cond (q: (s32[], f32[8])) -> pred[] {
  %n = s32[]{:T(128)} constant(6)
  %q = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %j = s32[]{:T(128)} get-tuple-element(%q), index=0
  ROOT %lt = pred[]{:T(512)} compare(%j, %n), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %a)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8]{0} get-tuple-element(%w), index=1
}
"""
    comps, entry = hlo_lib.parse_module(hlo)
    mult, unknown = hlo_lib.multipliers(comps, entry)
    assert (mult["body"], unknown) == (6.0, 0)


@pytest.mark.slow
def test_auto_finds_a_layout_that_fits_where_the_default_does_not(tmp_path):
    """On the suite's 8 CPU devices with a per-device memory budget that today's default
    layout (params replicated) does not fit, --auto's search compiles candidates and returns a
    layout that fits with its margin, and the flags to run it with."""
    import dataclasses

    from grpo_jax import cli
    from grpo_jax import mesh as mesh_lib
    from grpo_jax.aot import analyze, search

    model = TINY.replace(hidden_size=256, intermediate_size=512, vocab_size=2048)
    (tmp_path / "config.json").write_text(json.dumps(model.to_hf()))
    cfg = cli.parse_cli(["--model_name_or_path", str(tmp_path), *SHAPE])
    assert not cfg.mesh.given
    target = hardware.Target("cpu:8", dataclasses.replace(hardware.CHIPS["v5e"], name="test"),
                             "cpu", "8")
    replicated = dataclasses.replace(cfg, mesh=mesh_lib.MeshConfig(dp=-1))
    default = analyze.evaluate(target, analyze.make_lowering(target, replicated))
    budget = 0.75 * default["memory"]["peak_GB"] * 1e9  # the default does not fit
    target = dataclasses.replace(target, chip=dataclasses.replace(target.chip, hbm_bytes=budget))
    r = search.auto(target, cfg, quick=True, top=1)
    m = r["memory_per_chip"]
    assert m["fits"] and m["peak_GB"] * 1e9 <= (1 - search.MARGIN) * budget
    assert r["mesh"]["data"] < 8 and r["search"]["flags"] == r["flags"]
    assert r["plan"]["rows_per_update"] == 32  # the round of the config: 2 x 8 chips x 2
    assert "run with" in report.render(r)


def test_auto_searches_context_axis_and_decode_slots(tmp_path):
    """Rows over mesh.CONTEXT_TOKENS: --auto's layouts split a row's positions over a context
    axis (powers of 2 whose zig-zag cuts the completion evenly), and the estimate sees what
    that buys: a device's share of a row's activations and scores, and of the KV cache. Decode
    slots are searched too, for what they cost and save."""
    import dataclasses

    import jax

    from grpo_jax import cli
    from grpo_jax.aot import analyze, search

    model = TINY.replace(max_position_embeddings=32768)
    (tmp_path / "config.json").write_text(json.dumps(model.to_hf()))
    devices = jax.devices()[:8]
    target = hardware.Target("cpu:8", hardware.CHIPS["v5e"], "cpu", "8")

    def layouts(completion):
        cfg = cli.parse_cli(["--model_name_or_path", str(tmp_path), "--max_prompt_length", "1024",
                             "--max_completion_length", str(completion), "--num_generations",
                             "8", "--per_device_train_batch_size", "1"])
        return cfg, search.candidates(cfg, model, devices, remat=((True, "full"),))
    _, short = layouts(1024)
    assert {lay.sizes.get("context", 1) for lay in short} == {1}
    cfg, long = layouts(15360)
    assert {lay.sizes.get("context", 1) for lay in long} == {1, 2, 4, 8}
    assert {lay.sizes.get("context", 1) for lay in layouts(15362)[1]} == {1}  # 15362 = 2 x odd
    pick = {(lay.sizes["fsdp"], lay.sizes.get("context", 1)): lay for lay in long
            if lay.per_device == 1 and lay.sizes["data"] == 1 and lay.sizes["tensor"] == 1}
    fsdp, context = (search.estimate(pick[k], cfg, model, target, 8) for k in ((8, 1), (2, 4)))
    for phase in ("logprobs", "update"):
        assert context["temporaries_GB"][phase] < fsdp["temporaries_GB"][phase]
    assert context["phases"]["update"]["comm_s"] > 0
    # Decode slots: a half or a quarter of the round's rows, where a batch shard gets whole
    # slots; a quarter of the KV cache for four waves of decode, each reading the weights
    # again (the KV reads are the same rows' either way).
    quarter = next(lay for lay in long if lay.slots == 2)
    every = dataclasses.replace(quarter, slots=None)
    assert every in long and {lay.slots for lay in long} == {None, 4, 2}
    few, all_ = (search.estimate(lay, cfg, model, target, 8) for lay in (quarter, every))
    assert few["temporaries_GB"]["generate"] < all_["temporaries_GB"]["generate"]
    assert few["phases"]["generate"]["hbm_s"] > all_["phases"]["generate"]["hbm_s"]
    assert "--max_num_seqs 2" in " ".join(analyze.flags_of(quarter.apply(cfg, 8)))


def test_quick_sampler_depth():
    """--quick's sampler at full depth from its 2- and 3-layer programs: costs linear in the
    layers, or in proportion where the deeper program costs less (never negative); memory the
    larger plus what the third layer added per layer (XLA reuses buffers across layers)."""
    from grpo_jax.aot import analyze

    assert analyze.QUICK_LAYERS == (2, 3)
    assert analyze._deeper(10.0, 13.0, 48) == 10.0 + 3.0 * 46
    assert analyze._deeper(10.0, 9.0, 48) == 9.0 * 48 / 3
    assert analyze._grown(3.80, 3.84, 64) == 3.84 + (3.84 - 3.80) * 61
    assert analyze._grown(3.84, 2.08, 64) == 3.84


def test_default_mesh_when_none_is_given():
    """No mesh: data parallel while the replicated state takes at most half of a device (or
    the memory is unknown, as on the CPU), else FSDP over every device; a given mesh is kept,
    and an unset dp takes the devices the other axes leave."""
    from grpo_jax import mesh as mesh_lib

    assert not mesh_lib.MeshConfig().given and mesh_lib.MeshConfig().shape(8) == (8, 1, 1)
    assert mesh_lib.MeshConfig(fsdp=2).shape(8) == (4, 2, 1)
    assert mesh_lib.MeshConfig(dp=-1).given
    assert mesh_lib.default_config(1e9, None)[0].shape(8) == (8, 1, 1)
    assert mesh_lib.default_config(1e9, 16e9)[0].shape(8) == (8, 1, 1)
    cfg, why = mesh_lib.default_config(287e9, 32e9)
    assert cfg.shape(16) == (1, 16, 1) and "FSDP over every device" in why
    assert mesh_lib.flags(cfg) == ["--dp", "1", "--fsdp", "-1", "--tp", "1"]


def test_costs_of_what_the_tpu_compiler_writes():
    """Two forms a TPU program has that the counting must read: a sharded matmul written as a
    convolution whose window lists its dimensions by spatial number, not in dim_labels' order
    (the q projection of SmolLM2 over fsdp 4: [8192, 288] x [288, 576]); and a Pallas kernel's
    backend config over several lines, one of which starts with "}}" (splash attention): the
    instructions after it still count."""
    from grpo_jax.aot import hlo

    conv = """HloModule m

ENTRY %main (a: bf16[8192,2,144,1], b: bf16[2,144,9,64]) -> bf16[8192,9,64,1] {
  %a = bf16[8192,2,144,1]{0,2,1,3} parameter(0)
  %b = bf16[2,144,9,64]{1,3,0,2} parameter(1)
  ROOT %c = bf16[8192,9,64,1]{0,2,3,1} convolution(%a, %b), window={size=9x2 pad=8_8x0_0 \
rhs_reversal=1x0}, dim_labels=b1f0_1i0o->b0f1
}
""".replace("\\\n", "")
    assert hlo.cost(conv).flops == 2 * 8192 * 288 * 576
    kernel = """HloModule m

ENTRY %main (x: f32[64,256], w: f32[256,256]) -> f32[64,256] {
  %x = f32[64,256]{1,0} parameter(0)
  %w = f32[256,256]{1,0} parameter(1)
  %k = f32[64,256]{1,0} custom-call(%x), custom_call_target="tpu_custom_call", backend_config={"a": {"b":
}}, metadata={op_name="splash"}
  ROOT %d = f32[64,256]{1,0} dot(%k, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    assert hlo.cost(kernel).flops == 2 * 64 * 256 * 256
    # HBM bytes as a TPU decode step moves them (Qwen2.5-7B's sampler over 16 chips): the
    # embedding's rows gathered, not the table; a weight sliced asynchronously into on-chip
    # memory (S(1)) read once from HBM, and the matmul reading that copy costs no HBM; the
    # async op's tuple type, which repeats its operand, not counted as written.
    moves = """HloModule m

%gathered (p0: bf16[152064,224], p1: s32[64,1]) -> bf16[64,224] {
  %p0 = bf16[152064,224]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = s32[64,1]{1,0} parameter(1)
  ROOT %g = bf16[64,224]{1,0:T(8,128)(2,1)} gather(%p0, %p1), offset_dims={1}, \
collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,224}
}

ENTRY %main (e: bf16[152064,224], i: s32[64,1], w: bf16[224,18944]) -> bf16[64,18944] {
  %e = bf16[152064,224]{1,0:T(8,128)(2,1)} parameter(0)
  %i = s32[64,1]{1,0} parameter(1)
  %w = bf16[224,18944]{1,0:T(8,128)(2,1)} parameter(2)
  %x = bf16[64,224]{1,0:T(8,128)(2,1)} fusion(%e, %i), kind=kCustom, calls=%gathered
  %s = ((bf16[224,18944]{1,0:T(8,128)(2,1)}), bf16[56,18944]{1,0:T(8,128)(2,1)S(1)}, \
s32[]{:S(2)}) slice-start(%w), slice={[0:56], [0:18944]}
  %d = bf16[56,18944]{1,0:T(8,128)(2,1)S(1)} slice-done(%s)
  %xs = bf16[64,56]{1,0:T(8,128)(2,1)} slice(%x), slice={[0:64], [0:56]}
  ROOT %y = bf16[64,18944]{1,0:T(8,128)(2,1)} dot(%xs, %d), lhs_contracting_dims={1}, \
rhs_contracting_dims={0}
}
""".replace("\\\n", "")
    # bf16 tiles of (8, 128) pad 224 and 56 columns to 256 and 128.
    row, ids, part, cols = 64 * 256 * 2, 64 * 4, 56 * 18944 * 2, 64 * 128 * 2
    gather, weight, sliced, dot = row + ids + row, part, 2 * cols, cols + 64 * 18944 * 2
    assert hlo.cost(moves).bytes == gather + weight + sliced + dot


def test_costs_count_every_loop_trip():
    """hlo.cost agrees with XLA's cost analysis where a program has no loop, and where it has
    one counts its body once per trip (XLA's counts it once)."""
    import jax
    import jax.numpy as jnp

    from grpo_jax.aot import hlo

    def body(c, w):
        return jnp.tanh(c @ w), None

    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    w = jax.ShapeDtypeStruct((6, 256, 256), jnp.float32)
    once = jax.jit(lambda x, w: body(x, w[0])[0]).lower(x, w).compile()
    loop = jax.jit(lambda x, w: jax.lax.scan(body, x, w)[0]).lower(x, w).compile()
    xla = [c.cost_analysis() for c in (once, loop)]
    xla = [c[0] if isinstance(c, list) else c for c in xla]
    mine = hlo.cost(once.as_text())
    assert mine.flops == pytest.approx(xla[0]["flops"], rel=0.02)
    assert mine.bytes == pytest.approx(xla[0]["bytes accessed"], rel=0.1)
    matmul = 2 * 64 * 256 * 256
    counted = hlo.cost(loop.as_text())
    assert counted.unknown_loops == 0 and xla[1]["flops"] < 2 * matmul
    assert counted.flops == pytest.approx(6 * mine.flops, rel=0.02)


# A mixture of experts with matmuls large enough to outweigh the elementwise work that XLA's
# count adds (router, norms, softmax): 4 experts, 2 per token, every layer sparse.
TINY_MOE = ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=512,
                       intermediate_size=512, num_layers=2, num_heads=8, num_kv_heads=4,
                       head_dim=64, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=512)


@pytest.mark.slow
@pytest.mark.skipif(not AOT_PYTHON, reason="GRPO_JAX_AOT_PYTHON is unset")
def test_moe_without_an_expert_axis_compiles_for_tpu_and_its_flops_are_counted(tmp_path):
    """Issue 47, item 7: a mixture of experts on a TPU slice meshed data x fsdp, no expert
    axis: megablox's gmm (a Mosaic kernel) runs in shard_map, so the update compiles (it died
    with "Mosaic kernels cannot be automatically partitioned"). Item 8: its FLOPs, with the
    Pallas kernels' (gmm's cost estimates, splash attention's by shape) counted, are the
    model's (6 N per trained token plus attention's) times the remat forward, and the MFU
    is at most 100%."""
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps(TINY_MOE.to_hf()))
    proc = run_aot(tmp_path, "--topology", "v5e:2x2", "--model_name_or_path", "moe",
                   "--max_prompt_length", "128", "--max_completion_length", "128",
                   "--num_generations", "4", "--per_device_train_batch_size", "1",
                   "--phases", "update", "--dp", "2", "--fsdp", "2", "--json", "out.json")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    r = json.loads((tmp_path / "out.json").read_text())
    assert r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1} and r["attention"] == "splash"
    assert r["experts_kernel"] == "megablox, tiles 128x128x128"
    assert "experts' grouped matmuls: megablox" in proc.stdout
    update = r["time"]["phases"]["update"]
    # Model FLOPs (report.model_flops): 3 forwards of 2 x active matmul weights per token and
    # 4 x L x q_size per (token, key seen); remat "full" runs the forward once more.
    assert not update["floored"]
    assert 4 / 3 <= update["tflop"] / update["model_tflop"] < 2.0, update
    assert 0 < update["mfu"][1] <= update["mfu"][0] <= 1


def test_pallas_kernels_are_counted():
    """Item 8: XLA's cost analysis counts a TPU Pallas kernel (tpu_custom_call) as no work.
    hlo.cost counts megablox's gmm by its cost estimate (a backend config over one line, its
    numbers strings) and splash attention's dq kernel by its shapes (q [4, 128, 32], k
    [2, 256, 32]: 6 FLOPs per query, key and head dim) and the share of blocks it visits
    (attention.splash's scope), in a 3-trip loop, as the TPU compiler writes them."""
    from grpo_jax.aot import hlo

    text = """HloModule m

%body (p: (s32[], bf16[256,128])) -> (s32[], bf16[256,128]) {
  %p = (s32[], bf16[256,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[256,128]{1,0} get-tuple-element(%p), index=1
  %sizes = s32[5]{0} constant({64, 64, 64, 64, 0})
  %w = bf16[4,128,128]{2,1,0} constant({...})
  %gmm.1 = bf16[256,128]{1,0:T(8,128)(2,1)S(1)} custom-call(%sizes, %x, %w), \
custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={}}, \
metadata={op_name="jit(f)/while/body/shard_map/jit(gmm)/pallas_call"}, backend_config=\
{"flag_configs":[],"custom_call_config":{"body":"TUzvUg==","cost_estimate":{"flops":"8388608",\
"transcendentals":"0","bytes_accessed":"294912","remote_bytes_transferred":"0"},\
"needs_layout_passes":true}}
  %mask = s8[1,1,1]{2,1,0} constant({...})
  %q = bf16[4,128,32]{2,1,0} constant({...})
  %k = bf16[2,256,32]{2,1,0} constant({...})
  %dq = (f32[128,32]{1,0:T(8,128)}, bf16[4,128,32]{2,1,0}) custom-call(%mask, %mask, %q, \
%k, %k), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q_dq\\": 128}"
}}, metadata={op_name="jit(f)/transpose(jvp())/splash_visits_0.750000/shard_map/\
splash_mha_dq_segmented_no_residuals/pallas_call"}, backend_config={"custom_call_config":\
{"body":"TUzvUg=="}}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[256,128]{1,0}) tuple(%next, %gmm.1)
}

%cond (q: (s32[], bf16[256,128])) -> pred[] {
  %q = (s32[], bf16[256,128]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (a: bf16[256,128]) -> bf16[256,128] {
  %a = bf16[256,128]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[256,128]{1,0}) tuple(%zero, %a)
  %loop = (s32[], bf16[256,128]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[256,128]{1,0} get-tuple-element(%loop), index=1
}
""".replace("\\\n", "")
    splash = 6 * 4 * 128 * 256 * 32 * 0.75
    # + the counter's add per trip and the condition's compare per test (4)
    assert hlo.cost(text).flops == 3 * (8388608 + splash + 1) + 4
    from grpo_jax.models.attention import visited_share
    # The share: 128 queries at key indices 128..255 in blocks of 64 over 256 keys in blocks
    # of 64: each query block sees the key blocks up to its last query's (3 of 4, then 4).
    q_idx = np.arange(128, 256, dtype=np.int32)
    assert visited_share(q_idx, 256, None, 64, 64) == (3 + 4) / 8
    assert visited_share(q_idx, 256, 64, 64, 64) == (2 + 2) / 8  # and a 64-token window


def test_gpu_triton_decode_kernel_is_counted():
    """A GPU Pallas kernel (Triton's custom call, which XLA counts as no work, as the H100
    compile writes models/decode_attention.py's): its operands and result as bytes, 4 FLOPs per
    query head, key and head dim (q [2, 2, 7, 64] over k [2, 2, 512, 64])."""
    from grpo_jax.aot import hlo

    text = """HloModule m

ENTRY %main (q: bf16[2,2,7,64], k: bf16[2,2,512,64], v: bf16[2,2,512,64], m: s8[2,512]) -> \
bf16[2,2,7,64] {
  %q = bf16[2,2,7,64]{3,2,1,0} parameter(0)
  %k = bf16[2,2,512,64]{3,2,1,0} parameter(1)
  %v = bf16[2,2,512,64]{3,2,1,0} parameter(2)
  %m = s8[2,512]{1,0} parameter(3)
  ROOT %pallas_call.1 = bf16[2,2,7,64]{3,2,1,0} custom-call(%q, %k, %v, %m), \
custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI, \
metadata={op_name="jit(f)/decode_attention/pallas_call"}, backend_config={grid_x = 2 : i32}
}
"""
    counted = hlo.cost(text)
    assert counted.flops == 4 * 2 * 2 * 7 * 512 * 64
    assert counted.bytes == 2 * (2 * 2 * 7 * 64 * 2) + 2 * (2 * 2 * 512 * 64 * 2) + 2 * 512


def test_mfu_is_never_above_100_percent():
    """Item 8: where a program's counted FLOPs are below the model's (work the count can't
    see), the forecast's compute is the model's: MFU at most 100%, said with a mark."""
    chip = hardware.CHIPS["v5p"]
    low = report.phase_time(report.Cost(1e12, 1e9), 0.0, chip, model_flops=2e12)
    assert low["floored"] and low["compute_s"] == 2e12 / chip.peak_flops
    assert low["mfu"][0] == pytest.approx(1.0) and low["mfu"][1] <= 1.0
    high = report.phase_time(report.Cost(3e12, 1e9), 0.0, chip, model_flops=2e12)
    assert not high["floored"] and high["mfu"][0] == pytest.approx(2 / 3)


@pytest.mark.skipif(not AOT_PYTHON, reason="GRPO_JAX_AOT_PYTHON is unset")
def test_a_refusal_in_terabytes_is_read(tmp_path):
    """Item 9: the TPU compiler's refusal of a program needing terabytes ("HLO temporaries
    (8.00T)") is read as what it asks for (it was a traceback: the parse knew G, M and K);
    every unit reads; a refusal aot can't read is one line (a GrpoJaxError: exit 2)."""
    import jax

    from grpo_jax.aot import analyze

    script = """
import jax, jax.numpy as jnp
jax.config.update("jax_platforms", "cpu")
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from grpo_jax.aot import analyze, hardware
mesh = Mesh(hardware.devices(hardware.parse_target("v5e:2x2"))[:1], ("x",))
x = jax.ShapeDtypeStruct((2**20,), jnp.float32, sharding=NamedSharding(mesh, P()))
out = analyze._compile("sort", jax.jit(lambda x: jnp.sort(jnp.outer(x, x), axis=0)[0]).lower(x))
print("TEMP", out.temp_bytes, out.refused)
"""
    proc = subprocess.run([AOT_PYTHON, "-c", script], cwd=tmp_path, env=aot_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TEMP"))
    assert float(line.split()[1]) == 8 * 2**40 and "(8.00T)" in line  # [2^20, 2^20] f32
    sizes = {"512B": 512, "1.50K": 1.5 * 2**10, "11.17T": 11.17 * 2**40, "2P": 2 * 2**50,
             "3.2GiB": 3.2 * 2**30, "4096": 4096, "1E": 2**60}
    assert {k: analyze.parse_size(k) for k in sizes} == sizes
    assert analyze.parse_size("lots") is None and analyze.parse_size("1.2.3G") is None

    class Lowered:  # what the compiler raises, with a size no unit reads
        def compile(self):
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm: HLO temporaries "
                "(12.5Q) exceed available HBM (15.75G).\nmore\nlines")
    with pytest.raises(GrpoJaxError, match=r"^the compiler refused the update program: "
                       r"RESOURCE_EXHAUSTED: .*\(12.5Q\).*more chips") as e:
        analyze._compile("update", Lowered())
    assert "\n" not in str(e.value)


def test_routing_record_memory_of_qwen3_30b_a3b():
    """The routing a mixture of experts' sampler records (routing replay, router/mismatch):
    Qwen3-30B-A3B's 48 sparse layers x 8 experts per token, int16 indices (128 experts: past
    int8), 8k tokens a row: 6 MiB a row; nothing for a dense model."""
    from grpo_jax.aot import report
    from grpo_jax.models.presets import preset
    m = preset("qwen3-30b-a3b")
    assert report.routing_record_bytes(m, 1, 8192) == 8192 * 48 * 8 * 2
    assert report.routing_record_bytes(TINY_MOE, 2, 10) == 2 * 10 * 2 * 2 * 1
    assert report.routing_record_bytes(preset("smollm2-135m"), 64, 8192) == 0


def test_split_forecast_keeps_the_round_and_balances_the_halves(tmp_path):
    """aot/split.py, no compile: each split of 8 chips lays the sampler and the trainer out for
    the colocated round's generation batch and rows per update (the same training), its round
    is the slower half (generate + the weights' move, or train) with the other half idle for
    the difference, and the choice is the shortest round."""
    import jax

    from grpo_jax import cli
    from grpo_jax.aot import search, split

    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf()))
    target = hardware.Target("cpu:8", hardware.CHIPS["v5e"], "cpu", "8")
    cfg = cli.parse_cli(["--model_name_or_path", str(tmp_path), *SHAPE])
    f = split.forecast(cfg, TINY, target, jax.devices()[:8])
    c = f["colocated"]
    assert c["round_s"] == pytest.approx(c["generate_s"] + c["train_s"])
    assert f["splits"], "the even split of 8 chips lays out"
    for s in f["splits"]:
        assert s["sampler_chips"] + s["trainer_chips"] == 8
        assert s["round_s"] == pytest.approx(max(s["generate_s"] + s["weights_move_s"],
                                                 s["train_s"]))
        assert min(s["idle_sampler_s"], s["idle_trainer_s"]) == pytest.approx(0, abs=1e-12)
        assert s["weights_move_s"] > 0
    best = min([c["round_s"]] + [s["round_s"] for s in f["splits"]])
    assert (f["choice"] == "split") == (best < c["round_s"])
    # The trainer half keeps the colocated plan: rows per update and the generation batch.
    lay, _ = search.ranked(cfg, TINY, target, jax.devices()[:8])[0]
    gen = cfg.batch_plan(search.batch_size(cfg, 8)).generation_batch_size
    plan = lay.apply(cfg, gen).batch_plan(search.data_parallel(lay))
    pinned = split.pinned(cfg, plan.micro_batch_size * plan.gradient_accumulation_steps,
                           plan.generation_batch_size, 4)
    half = search.ranked(pinned, TINY, target, jax.devices()[4:], phases=split.TRAIN)[0][0]
    again = half.apply(pinned, plan.generation_batch_size).batch_plan(search.data_parallel(half))
    assert (again.micro_batch_size * again.gradient_accumulation_steps,
            again.generation_batch_size) == (plan.micro_batch_size
                                             * plan.gradient_accumulation_steps,
                                             plan.generation_batch_size)
    assert "choice:" in "\n".join(report.render_split(f))


# A tiny Gemma 3 with its SigLIP tower: images of 4 tokens (28 px, 7 px patches pooled 2 x 2);
# three layers, so that --quick's 3-layer sampler has its layer types.
TINY_GEMMA3 = PRESETS["gemma-3-270m"].replace(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=32, sliding_window=16, max_position_embeddings=512,
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    vision=SiglipConfig(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                        image_size=28, patch_size=7, mm_tokens_per_image=4))


@pytest.mark.skipif(not AOT_PYTHON, reason="GRPO_JAX_AOT_PYTHON is unset (see the module doc)")
def test_vision_language_models_compile_with_their_images(tmp_path):
    """A Qwen2.5-VL model under QLoRA with two 16-token images per prompt (--image-tokens 32
    --images-per-prompt 2, a batch's blocks of two): the update and log-prob programs take each
    row's pixels, M-RoPE positions and two grids, the sampler's and its 4 decode slots' prompt
    passes the prompts' images; the report names the vision tower's share of the memory, its
    linears counted as NF4 codes and scales (load_in_4bit quantizes them, as bitsandbytes).
    A Gemma 3 with two 4-token images per prompt through --auto: the search lays out and
    compiles its images ([rows, 2, 3, 28, 28] pixels), and the header gives its params as
    language model + tower."""
    import jax

    from grpo_jax.models import quant, qwen_vl
    vlm = TINY.replace(model_type=qwen_vl.MODEL_TYPE, mrope_section=(4, 6, 6), qkv_bias=True,
                       vision=qwen_vl.QwenVisionConfig(
                           depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                           out_hidden_size=TINY.hidden_size, patch_size=4, window_size=16,
                           fullatt_block_indexes=(1,)))
    tiny_dir_in(tiny_dir_in(tmp_path, "vlm", vlm), "gemma", TINY_GEMMA3)
    qwen, gemma = run_aot_many(
        tmp_path, ["--topology", "v5e:2x2", "--model_name_or_path", "vlm", "--json", "q.json",
                   "--image-tokens", "32", "--images-per-prompt", "2", *SHAPE, "--dp", "1",
                   "--fsdp", "4", "--max_num_seqs", "4", "--phases", "generate,update",
                   "--use_peft", "true", "--load_in_4bit", "true",
                   "--lora_target_modules", "q_proj"],  # logprobs: the
        # update's forward, compiled by the tests above
        ["--topology", "v5e:2x2", "--model_name_or_path", "gemma", "--json", "g.json",
         "--image-tokens", "8", *SHAPE, "--auto", "--quick"])
    assert qwen.returncode == 0, qwen.stderr[-3000:]
    r = json.loads((tmp_path / "q.json").read_text())
    # the refill program too, its prompt pass taking the images
    assert "compiled refill" in qwen.stderr and r["plan"]["decode_slots"] == 4
    assert r["image"] == {"tokens": 32, "images": 2, "patches": 64, "grid": [1, 8, 8]}
    m = r["memory_per_chip"]
    assert set(m["phases"]) == {"generate", "update"}
    # The tower in the frozen base over fsdp 4: its linears NF4 codes (half a byte) with a
    # fp32 scale per block and output (those of a weight of fewer than 64 inputs: one block,
    # which does not split 4 ways), the rest as loaded (the base's compute dtype, bf16; biases
    # and norms replicated); no adapters on it (q_proj: its attention is one fused qkv).
    # Unquantized, bf16 over 4 chips would be twice the codes' share or more.
    table, linears = vlm.vision.param_table(TINY.hidden_size), quant.tower_linears(vlm.vision)
    codes = sum(np.prod(table[n][0]) for n in linears)
    scales = sum(np.prod(jax.eval_shape(  # [L, blocks, out] (the merger's a stack of one)
        lambda w, n_in=n_in: quant.quantize(w, n_in, 4)[1], jax.ShapeDtypeStruct(
            table[n][0] if "{i}" in hf else (1, *table[n][0]), np.float32)).shape)
        for n, (hf, n_in) in linears.items())
    rest = sum(np.prod(s) for n, (s, _) in table.items() if n not in linears)
    got = m["vision_tower_GB"] * 1e9
    assert (codes / 2 + 4 * scales + 2 * rest) / 4 <= got <= codes / 2 / 4 + 4 * scales + 2 * rest
    assert got < 0.6 * (codes + rest) * 2 / 4
    assert m["optimizer_state_GB"] == pytest.approx(2 * m["params_GB"], rel=0.05)
    assert "of which the vision tower" in qwen.stdout and m["fits"]

    assert gemma.returncode == 0, gemma.stderr[-3000:]
    r = json.loads((tmp_path / "g.json").read_text())
    assert r["image"] == {"tokens": 8, "images": 2, "patches": 16}
    assert r["search"]["compiled"][0]["fits"] and r["memory_per_chip"]["fits"]
    m = r["memory_per_chip"]
    assert m["vision_tower_GB"] > 0 and m["optimizer_state_GB"] == pytest.approx(
        2 * (m["params_GB"] - m["vision_tower_GB"]), rel=0.05)
    head = gemma.stdout.splitlines()[0]
    assert "B language model + " in head and "vision tower" in head
    assert "active" not in gemma.stdout  # a mixture of experts' label
    assert r["vision_params_B"] == pytest.approx(TINY_GEMMA3.vision_params() / 1e9)


def test_the_estimate_counts_a_frozen_tower_and_its_images():
    """No compile: the layout estimate of Qwen2.5-VL-7B on v5e-16 with a 1024-token image
    (docs/scaling.md's run: fsdp 4 x tensor 4, 1 row per chip x 2, beta 0.04) against what that
    run compiled to: resident 6.93 GB (the tower frozen: no moments), peak 14.62 GB (update).
    Images cost memory a text prompt of the same length does not; Gemma 3 takes whole
    images only. With LoRA on the tower the estimate counts its adapters' state and the
    activations its backward keeps."""
    import dataclasses

    from grpo_jax import cli
    from grpo_jax.aot import search
    from grpo_jax.models import lora

    target = hardware.parse_target("v5e-16", 1)
    cfg = cli.parse_cli(["--model_name_or_path", "qwen2.5-vl-7b", "--max_prompt_length", "1536",
                         "--max_completion_length", "1024", "--num_generations", "8",
                         "--beta", "0.04", "--dp", "1", "--fsdp", "4", "--tp", "4",
                         "--per_device_train_batch_size", "1",
                         "--gradient_accumulation_steps", "2", "--generation_batch_size", "8"])
    model = PRESETS["qwen2.5-vl-7b"]
    lay = search.current(cfg, 16)
    images = search.estimate(lay, cfg, model, target, 16, image_tokens=1024)
    text = search.estimate(lay, cfg, model, target, 16)
    # (AdamW's moments of the 0.17 GB tower would add 0.34 GB: 5%.)
    assert images["resident_GB"] == pytest.approx(2.08 + 3.81 + 1.04, rel=0.02)
    assert images["peak_GB"] == pytest.approx(14.62, rel=0.1)
    for phase in search.PHASES:
        assert images["temporaries_GB"][phase] > text["temporaries_GB"][phase]
    assert images["phases"]["update"]["compute_s"] > text["phases"]["update"]["compute_s"]
    assert not images["fits"]  # 14.4 GB with 10% to spare; with 5% it does
    assert search.estimate(lay, cfg, model, target, 16, image_tokens=1024, margin=0.05)["fits"]
    with pytest.raises(GrpoJaxError, match="multiple"):
        PRESETS["gemma-3-4b-vlm"].vision.encoded(300)
    # --images-per-prompt 2: the 1024 tokens as two 512-token images (two 32 x 64 grids),
    # whose full-attention scores are per image: half the one image's (compiled: 7.24 GB of
    # update temporaries against 7.64, docs/scaling.md). Images of one size only.
    two = search.estimate(lay, cfg, model, target, 16, image_tokens=1024, images=2)
    assert two["resident_GB"] == images["resident_GB"]
    assert text["temporaries_GB"]["update"] < two["temporaries_GB"]["update"] < images[
        "temporaries_GB"]["update"]
    assert model.vision.encoded(1024, 2).patches == 2048
    for vision, tokens, k in ((model.vision, 1024, 3), (PRESETS["gemma-3-4b-vlm"].vision, 512, 3)):
        with pytest.raises(GrpoJaxError, match="multiple"):
            vision.encoded(tokens, k)
    from grpo_jax.aot import analyze
    with pytest.raises(GrpoJaxError, match="--image-tokens too"):
        analyze.check_images(cfg, model, 0, 2)
    # LoRA: all-linear adapts the tower too (its adapters trained, the tower differentiated:
    # its activations kept for the update's backward); q_proj / v_proj reach no tower module
    # of Qwen2.5-VL's (its attention is one fused qkv), which then stays frozen.
    lora_runs = {t: search.estimate(lay, dataclasses.replace(cfg, peft=dataclasses.replace(
        cfg.peft, use_peft=True, lora_target_modules=t)), model, target, 16, image_tokens=1024)
        for t in (("q_proj", "v_proj"), ("all-linear",))}
    frozen, adapted = lora_runs[("q_proj", "v_proj")], lora_runs[("all-linear",)]
    adapters = lora.tower_adapter_params(
        dataclasses.replace(cfg.peft, use_peft=True, lora_target_modules=("all-linear",)), model)
    assert 0 < adapters < 0.05 * model.vision_params()
    assert adapted["resident_GB"] - frozen["resident_GB"] == pytest.approx(3 * 4 * adapters / 1e9)
    kept = adapted["temporaries_GB"]["update"] - frozen["temporaries_GB"]["update"]
    assert kept > 10 * 4 * adapters / 1e9  # the tower's activations, beyond its gradients
    assert adapted["phases"]["update"]["compute_s"] > frozen["phases"]["update"]["compute_s"]
    for phase in ("generate", "logprobs"):
        assert adapted["temporaries_GB"][phase] == frozen["temporaries_GB"][phase]
