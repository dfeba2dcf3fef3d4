"""The benchmark entry point keeps working on CPU (tiny model, the suite's 8 host devices);
its figures are not asserted."""

import pytest

from grpo_jax.bench import main


@pytest.mark.slow
def test_bench_all_runs_on_cpu_tiny(tmp_path):
    out = main(["all", "--tiny", "--prompts", "4", "--generations", "2", "--prompt-len", "16",
                "--completion-len", "8", "--repeats", "1", "--json", str(tmp_path / "b.json")])
    for key in ("train_tokens_per_s", "generated_tokens_per_s", "grpo_step_s",
                "grpo_step/generate_s", "grpo_step/update_s"):
        assert out[key] and out[key] > 0, key
    assert (tmp_path / "b.json").stat().st_size > 100


def test_gpu_aot_tool_builds_and_lowers_its_programs():
    """tools/gpu_aot.py needs a CUDA jaxlib to compile; here its two programs must still build
    and lower (StableHLO) on the CPU, so the tool keeps up with the code it compiles."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).parent.parent
    script = (
        "import argparse, jax, sys\n"
        "sys.path.insert(0, 'tools')\n"
        "import gpu_aot as g\n"
        "a = argparse.Namespace(prompts=2, generations=2, prompt_len=16, completion_len=8,\n"
        "                       grad_accum=1)\n"
        "cfg = g.bench.QWEN2_0_5B.replace(num_layers=2, remat_policy='dots')\n"
        "for build in (g.sampler_program, g.train_step_program):\n"
        "    fn, args = build(a, cfg)\n"
        "    print(build.__name__, len(jax.jit(fn).lower(*args).as_text()) > 1000)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["sampler_program", "True", "train_step_program", "True"]
