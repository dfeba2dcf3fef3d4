"""Silent damage, found: bytes flipped in a checkpoint's data files (each step carries SHA-256
checksums that a restore verifies), updates that are skipped forever (non-finite weights), and an
export of non-finite weights. Faults are real: flipped bytes in the files of a tiny model's run,
a learning rate that turns the weights to NaN."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import pytest

from fault_injection import export
from tiny_run import config


def flip_bytes(step_dir: Path, files: int = 2, count: int = 16) -> list[Path]:
    """XOR `count` bytes spread over the middle of each of the `files` largest data files of a
    step's state (what a bad disk or a cosmic ray does), in place."""
    data = sorted((p for p in (step_dir / "state").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)[-files:]
    for path in data:
        size = path.stat().st_size
        with open(path, "r+b") as f:
            for k in range(count):
                f.seek(size // 4 + k * max(size // (2 * count), 1))
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x5A]))
    return data


@pytest.fixture(scope="module")
def run3(tiny_dir, tmp_path_factory):  # noqa: F811
    """A tiny run with checkpoints 1, 2 and 3."""
    from grpo_jax.train import train
    out = tmp_path_factory.mktemp("integrity") / "run"
    train(config(tiny_dir, out, max_steps=3, save_steps=1), devices=jax.devices()[:1])
    return out


@pytest.mark.slow
def test_flipped_bytes_are_found_by_export_and_resume(run3, tiny_dir, tmp_path,  # noqa: F811
                                                      capsys):
    """16 bytes flipped in each of the two largest data files of the newest checkpoint: export
    refuses it in one line naming the others; a resume sets it aside (one line) and goes on
    from the one before; with every checkpoint damaged, resume stops in one line, exit 2."""
    from grpo_jax.errors import TrainError
    from grpo_jax.train import train
    run = tmp_path / "run"
    shutil.copytree(run3, run)
    ckpts = run / "checkpoints"
    flip_bytes(ckpts / "3")
    capsys.readouterr()
    assert export(run, tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checkpoint 3 in" in err, err
    assert "does not match its checksum" in err and "--step (complete ones: [1, 2])" in err, err
    assert not (tmp_path / "hf").exists()

    train(config(tiny_dir, run, max_steps=4, save_steps=1, resume=True),
          devices=jax.devices()[:1])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "can't be restored" in line]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("checkpoint 3 in ") and "does not match its checksum" in lines[0]
    assert "kept as 3.corrupt" in lines[0] and "resumed from step 2" in err, err[-3000:]
    assert sorted(p.name for p in ckpts.iterdir()) == ["1", "2", "3", "3.corrupt", "4"]

    for step in (1, 2, 3, 4):
        flip_bytes(ckpts / str(step))
    with pytest.raises(TrainError, match=r"^no checkpoint in \S+ can be restored \(each is kept"):
        train(config(tiny_dir, run, max_steps=6, save_steps=1, resume=True),
              devices=jax.devices()[:1])
    err = capsys.readouterr().err
    assert len([x for x in err.splitlines() if "can't be restored" in x]) == 4, err[-3000:]


def test_a_checkpoint_killed_before_its_checksums_is_restored_unverified(run3, tmp_path,
                                                                         capsys):
    """A step whose meta promises a manifest but has none (the run died, or its disk turned
    read-only, between Orbax's commit and the manifest) is often the last good one: it is taken,
    unverified, said on one line, not set aside; so is a step of an older version (no
    promise)."""
    import orbax.checkpoint as ocp

    from grpo_jax.checkpoint import Checkpointer, abstract_state
    from grpo_jax.checksums import MANIFEST
    from grpo_jax.cli import load_config
    run = tmp_path / "run"
    shutil.copytree(run3, run)
    (run / "checkpoints" / "3" / MANIFEST).unlink()
    target, *_ = abstract_state(load_config(str(run / "config.yaml")))
    with Checkpointer(run / "checkpoints", save_total_limit=None) as ckpt:
        step, state, _ = ckpt.restore_newest(target, {}, None)
    assert step == 3 and int(state.step) == 3
    err = capsys.readouterr().err
    assert f"its {MANIFEST} was not written" in err and "restored unverified" in err, err
    assert not (run / "checkpoints" / "3.corrupt").exists()

    # An older version's step: no manifest, and its meta promises none.
    with ocp.CheckpointManager(run / "checkpoints") as older:  # as the old Checkpointer did
        older.save(4, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                              meta=ocp.args.JsonSave({"round": 4})))
    with Checkpointer(run / "checkpoints", save_total_limit=None) as ckpt:
        step, _, meta = ckpt.restore_newest(target, {}, None)
    assert step == 4 and meta == {"round": 4}
    err = capsys.readouterr().err
    assert "checkpoint 4 in" in err and "no checksums (written by an older" in err, err


@pytest.mark.slow
def test_non_finite_updates_stop_the_run_and_export_refuses_the_weights(
        run3, tiny_dir, tmp_path, capsys):  # noqa: F811
    """Resumed with an infinite learning rate, the run's weights turn NaN at step 4; every later
    update is skipped (its gradient is NaN), each said on a line, and after
    max_consecutive_skipped_updates of them the run stops: one line, exit 2, naming the last
    checkpoint with finite weights (3). Export refuses the NaN weights in one line, exit 2."""
    from grpo_jax.errors import GrpoJaxError, UpdatesSkippedError
    from grpo_jax.train import train
    run = tmp_path / "run"
    shutil.copytree(run3, run)
    capsys.readouterr()
    with pytest.raises(UpdatesSkippedError) as raised:  # main: one line, exit 2
        train(config(tiny_dir, run, max_steps=40, save_steps=1, learning_rate="inf",
                     resume=True, max_consecutive_skipped_updates=3), devices=jax.devices()[:1])
    line, err = str(raised.value), capsys.readouterr().err
    assert isinstance(raised.value, GrpoJaxError) and "\n" not in line, line
    assert "3 updates in a row (steps 5-7) were skipped" in line, line
    assert "not finite since step 4's update" in line, line
    assert f"last good checkpoint: {run / 'checkpoints' / '3'}:" in line, line
    skipped = [x for x in err.splitlines() if "update was skipped" in x]
    assert len(skipped) == 3 and "step 5's" in skipped[0], err[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [*"123456"]

    assert export(run, tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not finite (NaN or inf in " in err, err
    assert err.startswith("grpo_jax.export: error: checkpoint 6 of "), err
    assert "--step (complete ones: [1, 2, 3, 4, 5])" in err, err
    assert not (tmp_path / "hf").exists()


def test_skipped_updates_with_finite_weights_name_the_newest_checkpoint(tmp_path, capsys):
    """Skips that leave finite weights (a non-finite loss from the data) make every checkpoint
    since as good as the one before: the newest is named; an applied update resets the count."""
    import jax.numpy as jnp

    from grpo_jax.metrics import Logged
    from grpo_jax.run_log import SkippedUpdates
    for step in (3, 4):
        (tmp_path / str(step)).mkdir()
    skips, skip, ok = SkippedUpdates(2), Logged(count={"skipped_updates": 1}), Logged()
    for step, logged in ((1, skip), (2, ok), (3, skip)):
        skips.note(step, logged)
        assert not skips.exceeded
    skips.note(4, skip)
    assert skips.exceeded and capsys.readouterr().err.count("update was skipped") == 3
    line = str(skips.error({"w": jnp.ones(3)}, tmp_path))
    assert "2 updates in a row (steps 3-4)" in line and "the weights are finite" in line, line
    assert line.endswith(f"last good checkpoint: {tmp_path / '4'}"), line
    assert not SkippedUpdates(0).exceeded


def test_export_refuses_weights_beyond_the_dtype_or_not_finite():
    """A finite weight beyond float16's range would be written as inf: refused for float16,
    written in bfloat16; a NaN is refused in every dtype."""
    import jax.numpy as jnp
    from flax import nnx

    from grpo_jax.errors import ExportError
    from grpo_jax.export import check_weights
    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    layer.kernel.set_value(jnp.full((2, 2), 1e5))
    with pytest.raises(ExportError, match=r"kernel holds 1e\+05, beyond float16's range .* "
                                          r"export with --dtype bfloat16 or float32"):
        check_weights(layer, "float16", "checkpoint 2 of run", [1])
    check_weights(layer, "bfloat16", "checkpoint 2 of run", [1])
    layer.bias.set_value(jnp.array([0.0, jnp.nan]))
    with pytest.raises(ExportError, match=r"not finite \(NaN or inf in bias\); nothing was "
                                          r"written: export another with --step \(complete "
                                          r"ones: \[1\]\)"):
        check_weights(layer, "float32", "checkpoint 2 of run", [1])
