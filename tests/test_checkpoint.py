"""Checkpointer: bit-exact save/restore (params, adamw state, PRNG key data, meta), retention,
async saves, restore across meshes, clear errors, and surviving SIGKILL / SIGTERM."""

import dataclasses
import os
import re
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from grpo_jax.checkpoint import Checkpointer, StopSignal

CPU0 = SingleDeviceSharding(jax.devices()[0])


def _params(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {
        "embed": jax.random.normal(k1, (8, 16), jnp.float32),
        "layers": {"w": jax.random.normal(k2, (2, 16, 8), jnp.float32).astype(jnp.bfloat16),
                   "b": jax.random.normal(k3, (2, 8), jnp.float32)},
    }


def _loss(p):
    return jnp.sum(p["embed"] ** 2) + jnp.sum(p["layers"]["w"].astype(jnp.float32) ** 3) \
        + jnp.sum(jnp.sin(p["layers"]["b"]))


def _train_state(seed=0, steps=2):
    """params + adamw state after a few real updates (non-trivial mu, nu, count) + keys."""
    tx = optax.adamw(1e-2, weight_decay=0.1)
    params = _params(seed)
    opt = tx.init(params)
    for _ in range(steps):
        updates, opt = tx.update(jax.grad(_loss)(params), opt, params)
        params = optax.apply_updates(params, updates)
    state = {"params": params, "opt": opt, "raw_rng": jax.random.PRNGKey(seed + 3),
             "step": jnp.int32(steps)}
    return tx, state


def _abstract(state, sharding_of=lambda x: x.sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(x)),
                        state)


def _assert_bit_exact(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


META = {"data": {"epoch": 1, "position": 37}, "config": {"learning_rate": 1e-6, "beta": 0.04},
        "metrics": {"reward": -0.125, "kl": [0.5, 1.5]}, "note": "é"}


@pytest.mark.slow
def test_roundtrip_bit_exact_and_resume_continues_identically(tmp_path):
    tx, state = _train_state()
    with Checkpointer(tmp_path / "ckpt", save_total_limit=None, async_save=False) as ckpt:
        assert ckpt.save(2, state, META)
        assert ckpt.latest_step() == 2
    with Checkpointer(tmp_path / "ckpt", save_total_limit=None) as ckpt:  # a fresh process' view
        restored, meta = ckpt.restore(None, _abstract(state))
    _assert_bit_exact(restored, state)
    assert meta == META
    assert type(restored["opt"][0]) is type(state["opt"][0])  # ScaleByAdamState, not a dict

    def step(s):
        updates, opt = tx.update(jax.grad(_loss)(s["params"]), s["opt"], s["params"])
        noise = jax.random.normal(s["raw_rng"], (4,))
        return optax.apply_updates(s["params"], updates), opt, noise

    _assert_bit_exact(step(restored), step(state))


def test_save_total_limit_keeps_last_n(tmp_path):
    with Checkpointer(tmp_path, save_total_limit=2, async_save=False) as ckpt:
        for s in range(1, 6):
            assert ckpt.save(s, {"x": jnp.full((3,), s)}, {"step": s})
        assert ckpt.all_steps() == [4, 5]
    assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["4", "5"]
    with Checkpointer(tmp_path, save_total_limit=2) as ckpt:
        x, meta = ckpt.restore(4, {"x": jax.ShapeDtypeStruct((3,), jnp.int32, sharding=CPU0)})
    assert meta == {"step": 4} and np.array_equal(x["x"], [4, 4, 4])


def test_repeats_and_order(tmp_path):
    s = {"x": jnp.zeros(2)}
    with Checkpointer(tmp_path, save_total_limit=None) as ckpt:
        assert ckpt.save(3, s, {})
        assert not ckpt.save(3, s, {})  # already saved: a final save is harmless
        assert ckpt.save(4, s, {})
        with pytest.raises(ValueError, match="later step 4"):
            ckpt.save(2, s, {})
        with pytest.raises(TypeError, match="JSON"):
            ckpt.save(9, s, {"reward": np.float32(1.0)})
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4]


def test_async_save_then_wait_and_buffers_may_be_deleted(tmp_path):
    _, state = _train_state(seed=1)
    expected = jax.tree.map(np.asarray, state)
    target = _abstract(state)
    with Checkpointer(tmp_path, save_total_limit=None, async_save=True) as ckpt:
        assert ckpt.save(5, state, {"a": 1})
        # A train step may donate the state right after save returns.
        for x in jax.tree.leaves(state):
            x.delete()
        ckpt.wait()
        assert os.path.isdir(tmp_path / "5") and ckpt.all_steps() == [5]
        restored, _ = ckpt.restore(5, target)
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        assert np.asarray(x).tobytes() == y.tobytes()


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest)")
def test_restore_onto_other_mesh_and_single_device(tmp_path):
    devices = np.array(jax.devices()[:8])
    mesh24 = Mesh(devices.reshape(2, 4), ("data", "model"))
    mesh42 = Mesh(devices[::-1].reshape(4, 2), ("x", "y"))

    def shard_24(x):
        spec = {1: P("data"), 2: P("data", "model"), 3: P(None, "model", "data")}.get(x.ndim, P())
        return NamedSharding(mesh24, spec)

    def shard_42(x):
        spec = {1: P("y"), 2: P("y", "x"), 3: P("y", "x", None)}.get(x.ndim, P())
        return NamedSharding(mesh42, spec)

    _, state = _train_state(seed=2)
    state["counts"] = jnp.arange(4, dtype=jnp.uint32) * 7  # a per-data-shard vector, sharded too
    state = jax.tree.map(lambda x: jax.device_put(x, shard_24(x)), state)
    assert not state["params"]["embed"].sharding.is_fully_replicated
    with Checkpointer(tmp_path, save_total_limit=None) as ckpt:
        ckpt.save(1, state, {})
        for sharding_of in (lambda x: CPU0, shard_42):
            restored, _ = ckpt.restore(1, _abstract(state, sharding_of))
            _assert_bit_exact(restored, state)
            for x, t in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
                assert x.sharding.is_equivalent_to(sharding_of(t), x.ndim)


def test_missing_directory_or_step_is_a_clear_error(tmp_path):
    target = {"x": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=CPU0)}
    missing = tmp_path / "never_written"
    with Checkpointer(missing, save_total_limit=None) as ckpt:
        with pytest.raises(FileNotFoundError, match=f"no checkpoint in {re.escape(str(missing))}.*none"):
            ckpt.restore(None, target)
    with Checkpointer(tmp_path / "c", save_total_limit=None) as ckpt:
        ckpt.save(1, {"x": jnp.ones(2)}, {})
        ckpt.save(2, {"x": jnp.ones(2)}, {})
        with pytest.raises(FileNotFoundError, match=r"step 7 in .*/c; .*\[1, 2\]"):
            ckpt.restore(7, target)
        with pytest.raises(ValueError, match=r"\['x'\] has no sharding"):
            ckpt.restore(2, {"x": np.zeros(2, np.float32)})


CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import jax, jax.numpy as jnp
    from grpo_jax.checkpoint import Checkpointer, StopSignal

    mode, directory = sys.argv[1], sys.argv[2]
    if mode == "kill":
        ckpt = Checkpointer(directory, save_total_limit=1, async_save=True)
        ckpt.save(1, {"x": jnp.arange(1000.0)}, {"step": 1})
        ckpt.wait()
        # Big enough that the background write is still running when we die.
        ckpt.save(2, {"x": jnp.ones((48, 1024, 1024))}, {"step": 2})
        print(sorted(os.listdir(directory)), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        ckpt = Checkpointer(directory, save_total_limit=2)
        x, step = jnp.zeros(3), 0
        with StopSignal() as stop:
            while not stop.should_stop():
                step += 1
                x = x + 1
                if step % 5 == 0:
                    ckpt.save(step, {"x": x}, {"step": step})
                if step == 2:
                    print("ready", flush=True)
                time.sleep(0.02)
            ckpt.save(step, {"x": x}, {"step": step})
        ckpt.close()
        print("stopped", step, flush=True)
""")


def _child(tmp_path, mode):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.Popen([sys.executable, str(script), mode, str(tmp_path / "ckpt")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def test_sigkill_mid_async_save_leaves_last_complete_checkpoint(tmp_path):
    proc = _child(tmp_path, "kill")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert "2.orbax-checkpoint-tmp" in out  # the kill landed while step 2 was being written
    with Checkpointer(tmp_path / "ckpt", save_total_limit=1) as ckpt:
        assert ckpt.all_steps() == [1]
        target = {"x": jax.ShapeDtypeStruct((1000,), jnp.float32, sharding=CPU0)}
        state, meta = ckpt.restore(None, target)
        assert meta == {"step": 1} and np.array_equal(state["x"], np.arange(1000.0))
        assert ckpt.save(2, {"x": jnp.ones(1000)}, {"step": 2})  # the partial step is gone
        ckpt.wait()
        assert ckpt.all_steps() == [2]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["2"]


def test_sigterm_makes_the_loop_save_and_exit_cleanly(tmp_path):
    proc = _child(tmp_path, "term")
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    stopped = int(out.split()[-1])
    with Checkpointer(tmp_path / "ckpt", save_total_limit=2) as ckpt:
        assert ckpt.latest_step() == stopped
        state, meta = ckpt.restore(None, {"x": jax.ShapeDtypeStruct((3,), jnp.float32,
                                                                    sharding=CPU0)})
    assert meta == {"step": stopped} and np.array_equal(state["x"], np.full(3, float(stopped)))


def test_stop_signal_flags_then_restores_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with StopSignal() as stop:
        assert not stop.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.should_stop() and stop.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # first SIGINT: just the flag
        assert stop.received == signal.SIGINT
        if before[signal.SIGINT] is signal.default_int_handler:
            with pytest.raises(KeyboardInterrupt):  # second one: the original behaviour
                os.kill(os.getpid(), signal.SIGINT)
    assert {s: signal.getsignal(s) for s in before} == before


def test_run_state_is_checkpointed_and_restored_whole(tmp_path, tiny_dir):
    """Everything a resume needs is one RunState, and a run's checkpoint holds it whole: the
    train state bit-exact, the data position, rounds and tokens, the generation buffer (two
    micro-batches of different prompt widths, an epoch window), the draws in flight and, with
    sync_ref_model, the reference params, and the partial rollouts' rows in flight (their
    device arrays, draw numbers and keys; their records read again from the dataset's rows)
    and, with sampler_devices, the batch sampled ahead (its rollout arrays, versions, decode
    metrics, the tool loop's fields and its groups' records), and with a rollout_func's async
    rounds on the JAX sampler the params that generate the batch in flight; the restore fills
    each field from the checkpoint, none from the live run it is given."""
    from tiny_run import config

    from grpo_jax.models import ModelConfig
    from grpo_jax.rollout.base import RolloutBatch
    from grpo_jax.rollout.native.disaggregated import Queued
    from grpo_jax.rollout.native.partial import PartialRollouts
    from grpo_jax.rollout.native.sampler import Sampler
    from grpo_jax.rollout.native.sampling import SamplingParams

    from grpo_jax.data import DataPosition
    from grpo_jax.grpo.batch import Batch
    from grpo_jax.grpo.loss import LossConfig
    from grpo_jax.grpo.train_step import init_train_state
    from grpo_jax.run_state import RunState
    from grpo_jax.train import RunCheckpoints

    def micro(width, seed):
        r = np.random.default_rng(seed)
        return Batch(r.integers(0, 9, (4, width)).astype(np.int32), np.ones((4, width), np.int32),
                     r.integers(0, 9, (4, 3)).astype(np.int32), np.ones((4, 3), np.int32),
                     np.zeros(4, bool), r.standard_normal(4).astype(np.float32),
                     ref_logp=r.standard_normal((4, 3)).astype(np.float32))

    def state_of(seed):
        tx, s = _train_state(seed)
        return init_train_state(s["params"], s["opt"], LossConfig())._replace(
            step=jnp.int32(7 + seed))

    cfg = config(tiny_dir, tmp_path, beta=0.04, sync_ref_model=True, resume=True,
                 sampler_devices=1, max_staleness=1, max_num_seqs=3)
    schedule = {"num_prompts": 16}
    model = ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                        num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16)
    partial = PartialRollouts(Sampler(model, SamplingParams(max_completion_length=4,
                                                            max_num_seqs=3), pad_id=0),
                              3, num_generations=2, groups=2, max_staleness=1)
    empty = partial.empty(20)
    r = np.random.default_rng(0)
    rows = empty.rows._replace(
        tokens=jnp.asarray(r.integers(0, 64, empty.rows.tokens.shape), jnp.int32),
        logp=jnp.asarray(r.standard_normal(empty.rows.logp.shape), jnp.float32),
        cache=jax.tree.map(lambda x: jnp.asarray(r.standard_normal(x.shape), x.dtype),
                           empty.rows.cache))
    record = lambda i: {"prompt": f"row {i}"}  # noqa: E731 - the dataset's record of row i
    rows_in_flight = empty._replace(rows=rows, data_rows=np.array([3, -1, 9, 4]),
                                    seq=np.array([0, -1, 2, 1]),
                                    records=(record(3), None, record(9), record(4)), drawn=3,
                                    key=jax.random.key(11))
    ids = r.integers(0, 64, (4, 5)).astype(np.int32)
    queued = Queued(RolloutBatch(ids, np.ones_like(ids), ids[:, ::-1].copy(), np.ones_like(ids),
                                 np.array([True, False, False, True]),
                                 r.standard_normal((4, 5)).astype(np.float32),
                                 metrics={"sampler/decode_steps": 7.0},
                                 versions=np.full((4, 5), 4, np.int32),
                                 prompt_routing=r.integers(-1, 8, (4, 5, 2, 2)).astype(np.int8),
                                 completion_routing=r.integers(-1, 8, (4, 5, 2, 2)
                                                               ).astype(np.int8),
                                 tool_mask=r.integers(0, 2, (4, 5)).astype(np.int32),
                                 completions=[[{"role": "assistant", "content": f"{i}",
                                                "tool_calls": [{"type": "function", "function": {
                                                    "name": "calc", "arguments": {"x": i}}}]},
                                               {"role": "tool", "name": "calc",
                                                "content": str(i)}] for i in range(4)],
                                 tool_calls=np.array([1, 0, 2, 1], np.int32),
                                 tool_failures=np.array([0, 0, 1, 0], np.int32)),
                    (record(5), record(1)), np.array([5, 1]), dropped=2, took=1.5, waited=0.5)
    saved = RunState(state_of(0), DataPosition(1, 8), round=5, tokens_seen=1234,
                     buffer=(micro(2, 0), micro(5, 1)), epoch_end=1,
                     reference=_params(5), in_flight=((6, DataPosition(1, 12)),),
                     rows_in_flight=rows_in_flight, queued=queued,
                     generated_ahead=(state_of(2).params, 1))
    checkpoints = RunCheckpoints.open(tmp_path, cfg, schedule, record=record)
    checkpoints.save(saved, {"reward": 0.5})
    checkpoints.ckpt.close()
    checkpoints.refs.close()
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())

    # a new run's: nothing of it may stay
    fresh = RunState(state_of(1), reference=_params(9), rows_in_flight=empty)
    checkpoints = RunCheckpoints.open(tmp_path, cfg, schedule, record=record)
    try:
        back = checkpoints.resume(cfg, tmp_path, fresh)
    finally:
        checkpoints.ckpt.close()
        checkpoints.refs.close()
    assert back.step == 7
    _assert_bit_exact(back.state, saved.state)
    _assert_bit_exact(back.reference, saved.reference)
    assert (back.position, back.round, back.tokens_seen, back.epoch_end, back.in_flight) == (
        DataPosition(1, 8), 5, 1234, 1, ((6, DataPosition(1, 12)),))
    assert len(back.buffer) == 2
    for got, want in zip(back.buffer, saved.buffer):
        _assert_bit_exact(got, want)
    got, want = back.rows_in_flight, saved.rows_in_flight
    _assert_bit_exact(got.rows, want.rows)
    for name in ("prompt_ids", "prompt_mask", "data_rows", "seq"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), name)
    assert (got.records, got.drawn) == (want.records, 3)
    np.testing.assert_array_equal(jax.random.key_data(got.key), jax.random.key_data(want.key))
    got, want = back.queued, saved.queued
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated",
                 "sampler_logp", "versions", "prompt_routing", "completion_routing",
                 "tool_mask", "tool_calls", "tool_failures"):
        np.testing.assert_array_equal(getattr(got.rollout, name), getattr(want.rollout, name),
                                      name)
        assert getattr(got.rollout, name).dtype == getattr(want.rollout, name).dtype, name
    np.testing.assert_array_equal(got.data_rows, want.data_rows)
    assert (got.records, got.dropped, got.rollout.metrics, got.rollout.completions) == (
        want.records, 2, {"sampler/decode_steps": 7.0}, want.rollout.completions)
    # Async rounds on the JAX sampler: the params that generate the batch in flight, and the
    # versions since.
    _assert_bit_exact(back.generated_ahead[0], saved.generated_ahead[0])
    assert back.generated_ahead[1] == 1
    assert {f.name for f in dataclasses.fields(RunState)} == {
        "state", "position", "round", "tokens_seen", "buffer", "epoch_end", "reference",
        "in_flight", "rows_in_flight", "queued", "generated_ahead"}, (
            "a new RunState field: save and restore it in RunCheckpoints, test it here")
