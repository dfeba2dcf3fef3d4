"""The benchmark entry point keeps working on CPU (tiny model, the suite's 8 host devices);
its figures are not asserted."""

import pytest

from grpo_jax.bench import TINY, main


@pytest.mark.slow
def test_bench_all_runs_on_cpu_tiny(tmp_path):
    out = main(["all", "--tiny", "--prompts", "4", "--generations", "2", "--prompt-len", "16",
                "--completion-len", "8", "--repeats", "1", "--json", str(tmp_path / "b.json")])
    for key in ("train_tokens_per_s", "generated_tokens_per_s", "grpo_step_s",
                "grpo_step/generate_s", "grpo_step/update_s"):
        assert out[key] and out[key] > 0, key
    assert (tmp_path / "b.json").stat().st_size > 100



@pytest.mark.slow
def test_bench_refill_runs_on_cpu_tiny():
    out = main(["refill", "--tiny", "--num-layers", "1", "--dtype", "float32", "--prompts", "4",
                "--generations", "4", "--prompt-len", "16", "--completion-len", "16",
                "--max-num-seqs", "8", "--stop-fraction", "0.1", "--repeats", "1"])
    assert out["params_M"] == TINY.with_layers(1).num_params() / 1e6 < TINY.num_params() / 1e6
    assert out["same_completions"] and out["rows"] == 16 and out["decode_slots"] == 8
    for key in ("static_tokens_per_s", "refilled_tokens_per_s", "refill_speedup"):
        assert out[key] > 0, key


@pytest.mark.slow
def test_bench_partial_runs_on_cpu_tiny():
    """`bench partial`: refilled rounds and partial rollouts over the same rounds; the partial
    rounds keep every slot busy (rows carry over) and train on tokens one version old."""
    out = main(["partial", "--tiny", "--num-layers", "1", "--dtype", "float32", "--prompts", "2",
                "--generations", "4", "--prompt-len", "8", "--completion-len", "16",
                "--max-num-seqs", "8", "--stop-fraction", "0.1", "--rounds", "2"])
    assert out["partial_slot_occupancy"] > out["refill_slot_occupancy"]
    assert out["partial_staleness_mean"] > 0 == out["refill_staleness_mean"]
    for key in ("refill_groups_per_s", "partial_groups_per_s", "partial_speedup"):
        assert out[key] > 0, key


def test_bench_mismatch_runs_on_cpu_tiny():
    """`bench mismatch`: the sampler's log-probs against the trainer's over every completion
    token; in float32 the two forwards agree to rounding (the figure itself is the bench's)."""
    out = main(["mismatch", "--tiny", "--num-layers", "1", "--dtype", "float32", "--prompts",
                "2", "--generations", "2", "--prompt-len", "8", "--completion-len", "8"])
    assert out["mismatch/tokens"] == 32
    assert out["sampling/sampling_logp_difference/mean"] < 1e-5


def test_bench_mismatch_on_a_tiny_moe_replay_off_and_on():
    """`bench mismatch --tiny-moe`: the router's figures with routing replay off and on; in
    float32 both forwards route alike, and replay makes router/mismatch 0 by construction."""
    out = main(["mismatch", "--tiny-moe", "--num-layers", "1", "--dtype", "float32",
                "--prompts", "2", "--generations", "2", "--prompt-len", "8",
                "--completion-len", "8"])
    for mode in ("disabled", "R3"):
        assert out[f"replay_{mode}/router/mismatch"] == 0.0
        assert out[f"replay_{mode}/sampling/sampling_logp_difference/mean"] < 1e-5
