"""The training program end to end on a tiny model: it learns, resumes exactly, exports, and
fails cleanly on bad input."""

import json
import shutil
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from tiny_run import HERE, ODD_POSTS, REWARD, cli_args, config, run_cli, stopped_at

from grpo_jax import hf
from grpo_jax.checkpoint import Checkpointer
from grpo_jax.train import train

def records(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]


def rewards_of(out):
    return [h["reward"] for h in records(out)]


@pytest.mark.slow
def test_tiny_model_learns_synthetic_reward(tiny_dir, tmp_path):
    cfg = config(tiny_dir, tmp_path / "run")
    train(cfg, devices=jax.devices()[:1])
    r = rewards_of(tmp_path / "run")
    first, last = np.mean(r[:3]), np.mean(r[-3:])
    assert len(r) == 14
    print(f"reward first 3 steps {first:.3f}, last 3 steps {last:.3f}")
    # Chance is 0.5: measured first 0.557 (the bound allows 0.15 over chance), last 1.000 (a
    # gain of 0.44, 3x the bound).
    assert first < 0.65 and last > first + 0.15, (first, last, r)
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", save_total_limit=None)
    assert ckpt.latest_step() == 14
    assert (tmp_path / "run" / "reward_kl.png").stat().st_size > 1000


@pytest.mark.slow
def test_later_rounds_compile_nothing(tiny_dir, tmp_path, monkeypatch):
    """Every program (sampler, train step, log-probs, host-side helpers) compiles during the
    first two rounds; later rounds only run them (a recompile costs seconds on a GPU)."""
    from grpo_jax.policy import Policy
    log = []
    original = Policy.step
    monkeypatch.setattr(Policy, "step", lambda self, s, b: log.append("step") or original(
        self, s, b))

    def on_event(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            log.append("compile")
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:  # beta > 0 and two updates per round: reference and old log-probs run too
        train(config(tiny_dir, tmp_path / "run", max_steps=8, beta=0.04, num_iterations=2),
              devices=jax.devices()[:1])
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    steps = [i for i, e in enumerate(log) if e == "step"]
    assert len(steps) == 8 and "compile" in log[:steps[0]]
    assert "compile" not in log[steps[3]:], log  # from the second update of round 2 on


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.slow
def test_reference_model_only_when_beta_positive(tiny_dir, tmp_path, monkeypatch, beta):
    """beta = 0: no reference params are kept, stored or run (TRL's behaviour)."""
    from grpo_jax.policy import Policy
    from grpo_jax.checkpoint import abstract_state
    calls = []
    original = Policy.logps
    monkeypatch.setattr(Policy, "logps", lambda self, p, b, rows=None: calls.append(1) or
                        original(self, p, b, rows))
    cfg = config(tiny_dir, tmp_path / "run", max_steps=2, beta=beta)
    last = train(cfg, devices=jax.devices()[:1])
    assert (len(calls) > 0) == (beta > 0) and ("kl" in last) == (beta > 0)
    # What a checkpoint holds: params, optimizer state and the step; nothing else.
    target, *_ = abstract_state(cfg)
    state, _ = Checkpointer(tmp_path / "run" / "checkpoints", save_total_limit=None).restore(
        None, target)
    n_params = len(jax.tree.leaves(state.params))
    assert state._fields[:3] == ("params", "opt_state", "step")
    assert state.entropy_coef is None and state.last_entropy is None  # no adaptive entropy
    # Adam moments + scalar counters (apply_if_finite 3, Adam 1, the schedule 1)
    assert len(jax.tree.leaves(state.opt_state)) <= 2 * n_params + 5


def _record_rounds(monkeypatch):
    """Rows generated (by the JAX sampler) and windows fed to Policy.step, as host arrays."""
    from grpo_jax.rollout.native.rollout import JaxRollout
    from grpo_jax.policy import Policy
    generated, fed = [], []
    generate, step = JaxRollout.generate, Policy.step
    monkeypatch.setattr(JaxRollout, "generate", lambda self, *a: generated.append(
        generate(self, *a)) or generated[-1])
    monkeypatch.setattr(Policy, "step", lambda self, s, b, **kw: fed.append(b) or step(
        self, s, b, **kw))
    return generated, fed


def _rows(prompt_ids, prompt_mask, completion_ids, completion_mask):
    return [(tuple(p[m > 0]), tuple(c[k > 0])) for p, m, c, k in
            zip(prompt_ids, prompt_mask, completion_ids, completion_mask)]


@pytest.mark.slow
def test_update_pads_completions_to_the_bucket_of_the_longest(tiny_dir, tmp_path, monkeypatch):
    """TRL pads a batch's completions to its longest; the trainer pads them to the length
    bucket that holds it (shapes.completion_width), and its update equals the one padded to
    max_completion_length (pad_to_multiple_of: 64), dr_grpo's B x max_completion_length
    denominator included."""
    from grpo_jax.shapes import completion_width
    runs = {}
    for pad in (None, 64):  # a quarter of the vocabulary stops a row: rows end early
        generated, fed = _record_rounds(monkeypatch)
        extra = {} if pad is None else {"pad_to_multiple_of": pad}
        train(config(tiny_dir, tmp_path / f"pad{pad}", max_steps=1, max_completion_length=64,
                     loss_type="dr_grpo", stop_token_ids=list(range(4, 99, 4)), **extra),
              devices=jax.devices()[:1])
        monkeypatch.undo()
        runs[pad] = generated[0], fed[0], records(tmp_path / f"pad{pad}")[-1]
    (gen, cut, m), (gen64, full, m64) = runs[None], runs[64]
    assert np.array_equal(gen.completion_ids, gen64.completion_ids)
    longest = int(gen.completion_mask.sum(1).max())
    assert cut.completion_ids.shape[1] == completion_width(longest, 64) < 64, longest
    assert full.completion_ids.shape[1] == 64
    assert np.array_equal(cut.completion_ids, full.completion_ids[:, :cut.completion_ids.shape[1]])
    for name in ("loss", "grad_norm", "entropy"):
        np.testing.assert_allclose(m[name], m64[name], rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("per_device,gbs,gas,max_steps,rounds", [
    (4, 12, 2, 3, 2),  # steps_per_generation 3: two generations make three updates
    (4, 4, 2, 2, 4),   # steps_per_generation 1 < 2: an update every second generation
])
@pytest.mark.slow
def test_every_completion_trained_on_when_spg_is_not_a_multiple_of_gas(
        tiny_dir, tmp_path, monkeypatch, per_device, gbs, gas, max_steps, rounds):
    """TRL trains on every micro-batch; an accumulation window may span two generations. A
    second reward function returns None for all (its metrics log null; the reward is the
    first's) and logs the trainer_state.epoch it gets: TRL's, the optimizer's progress."""
    from collections import Counter
    generated, fed = _record_rounds(monkeypatch)
    train(config(tiny_dir, tmp_path / "run", max_steps=max_steps, save_steps=1,
                 per_device_train_batch_size=per_device, generation_batch_size=gbs,
                 gradient_accumulation_steps=gas,
                 reward_funcs=f"[{REWARD}, {HERE / 'reward_fixtures.py'}:epoch_seen]"),
          devices=jax.devices()[:1])
    assert len(generated) == rounds and len(fed) == max_steps
    assert all(b.size == per_device * gas for b in fed)
    made = Counter(r for g in generated for r in _rows(g.prompt_ids, g.prompt_mask,
                                                         g.completion_ids, g.completion_mask))
    used = Counter(r for b in fed for r in _rows(b.prompt_ids, b.prompt_mask, b.completion_ids,
                                                   b.completion_mask))
    assert made == used and sum(used.values()) == rounds * gbs
    history = records(tmp_path / "run")
    assert [h["step"] for h in history] == list(range(1, max_steps + 1))  # one per update
    tokens = sum(int(g.prompt_mask.sum() + g.completion_mask.sum()) for g in generated)
    # TRL sets num_tokens at each generation: the records of steps that generated hold it
    assert [h["num_tokens"] for h in history if "num_tokens" in h][-1] == tokens
    # transformers' epoch: micro-steps done / micro-steps per epoch (64 prompts, gbs / 4 each)
    per_epoch = 64 // (gbs // 4) * (gbs // per_device)
    assert history[-1]["epoch"] == pytest.approx(max_steps * gas / per_epoch)
    for key in ("completions/min_terminated_length", "completions/max_terminated_length"):
        assert any(key in h for h in history)
    # Each generation's trainer_state.epoch: the epoch after the steps done before it.
    seen = [(h["epoch_seen"], history[i - 1]["epoch"] if i else 0.0)
            for i, h in enumerate(history) if "epoch_seen" in h]
    assert seen and all(a == pytest.approx(b) for a, b in seen), seen
    generating = [h for h in history if "reward" in h]
    assert all(h["rewards/epoch_seen/mean"] is None and h["rewards/epoch_seen/std"] is None
               and h["rewards/even_tokens/mean"] is not None for h in generating)


@pytest.mark.slow
def test_an_epoch_ends_with_a_partial_window(tiny_dir, tmp_path, monkeypatch):
    """3 prompts: an epoch is one generation of 3 micro-batches; with gas 2 transformers takes
    windows of 2 and 1 micro-batches (none spans two epochs) and logs the epoch as optimizer
    progress."""
    generated, fed = _record_rounds(monkeypatch)
    train(config(tiny_dir, tmp_path / "run", max_steps=4, per_device_train_batch_size=4,
                 generation_batch_size=12, gradient_accumulation_steps=2,
                 dataset_train_split="train[:3]"), devices=jax.devices()[:1])
    assert len(generated) == 2 and [b.size for b in fed] == [8, 4, 8, 4]
    assert [h["epoch"] for h in records(tmp_path / "run")] == pytest.approx([2 / 3, 1, 5 / 3, 2])


@pytest.mark.slow
def test_max_steps_is_exact_mid_round_and_resume_trains_the_rest(tiny_dir, tmp_path,
                                                                  monkeypatch):
    """Four updates per generation (steps_per_generation 4), max_steps 3, logging_steps 1:
    exactly 3 updates, 3 records (steps 1, 2, 3: one per optimizer step, as TRL logs) and a
    checkpoint at 3; the fourth micro-batch is checkpointed with it, so resuming to 5 equals a
    run to 5 (also the cumulative num_tokens)."""
    generated, fed = _record_rounds(monkeypatch)
    four = dict(per_device_train_batch_size=4, steps_per_generation=4)
    train(config(tiny_dir, tmp_path / "cut", max_steps=3, **four), devices=jax.devices()[:1])
    assert len(fed) == 3 and len(generated) == 1
    assert Checkpointer(tmp_path / "cut" / "checkpoints", save_total_limit=None
                        ).all_steps() == [3]
    history = records(tmp_path / "cut")
    assert [h["step"] for h in history] == [1, 2, 3]
    for h in history:  # each step's own loss metrics, grad_norm and learning rate
        assert {"loss", "grad_norm", "learning_rate", "entropy", "clip_ratio/region_mean",
                "step_time", "epoch"} <= set(h), h
    # The generation's metrics go into TRL's buffer once, so into the record of the step that
    # generated (TRL clears its buffer at every log).
    assert "reward" in history[0] and "num_tokens" in history[0]
    assert not any("reward" in h or "completions/mean_length" in h for h in history[1:])
    assert len({h["loss"] for h in history}) == 3
    # TRL's resume_from_checkpoint PATH: that checkpoint of the run
    train(config(tiny_dir, tmp_path / "cut", max_steps=5,
                 resume_from_checkpoint=tmp_path / "cut" / "checkpoints" / "3", **four),
          devices=jax.devices()[:1])
    assert len(fed) == 5 and len(generated) == 2  # the buffered micro-batch first, then one more
    train(config(tiny_dir, tmp_path / "full", max_steps=5, **four), devices=jax.devices()[:1])
    from grpo_jax.checkpoint import load_checkpoint
    a, _, step_a = load_checkpoint(tmp_path / "full")
    b, _, step_b = load_checkpoint(tmp_path / "cut")
    assert step_a == step_b == 5
    for name, pa in hf.params_numpy(a).items():
        assert np.abs(pa - hf.params_numpy(b)[name]).max() < 1e-6, name
    last = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").open()][-1]
    full = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").open()][-1]
    assert last["step"] == full["step"] == 5 and last["num_tokens"] == full["num_tokens"] > 0


def test_resume_from_checkpoint_path_names_a_run_and_step(tmp_path):
    from grpo_jax.train import TrainError, _checkpoint_source
    run, other = tmp_path / "run", tmp_path / "other"
    for out in (run, other):
        ckpt = Checkpointer(out / "checkpoints", save_total_limit=None, async_save=False)
        for step in (2, 4):
            ckpt.save(step, {"x": np.zeros(2, np.float32)}, {})
        ckpt.close()
    ckpt = Checkpointer(run / "checkpoints", save_total_limit=None)
    assert _checkpoint_source(str(run / "checkpoints" / "2"), run, ckpt) == (run, 2)
    assert _checkpoint_source(str(run), run, ckpt) == (run, 4)  # the run's directory: its newest
    # another run's checkpoint, or its directory, as transformers accepts any checkpoint
    assert _checkpoint_source(str(other / "checkpoints" / "2"), run, ckpt) == (other, 2)
    assert _checkpoint_source(str(other), run, ckpt) == (other, 4)
    for missing in (other / "checkpoints" / "3", run / "checkpoints" / "3", tmp_path / "none"):
        with pytest.raises(TrainError, match="not a checkpoint"):
            _checkpoint_source(str(missing), run, ckpt)
    ckpt.close()


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(tiny_dir, tmp_path):
    from grpo_jax.checkpoint import load_checkpoint
    full = run_cli(cli_args(tiny_dir, tmp_path / "full"))
    assert full.wait(timeout=600) == 0, full.stderr.read()[-3000:]

    killed = run_cli(cli_args(tiny_dir, tmp_path / "killed"))
    ckpts = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 600
    while not (ckpts / "4").is_dir() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    done = Checkpointer(ckpts, save_total_limit=None).all_steps()
    assert done and max(done) < 10, done

    resumed = run_cli(cli_args(tiny_dir, tmp_path / "killed") + ["--resume"])
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resumed from step {max(done)}" in err
    a, _, step_a = load_checkpoint(tmp_path / "full")
    b, _, step_b = load_checkpoint(tmp_path / "killed")
    assert step_a == step_b == 10
    for name in ("embed", "layers/wq", "layers/w_down", "final_norm"):
        pa, pb = hf.params_numpy(a)[name], hf.params_numpy(b)[name]
        assert np.abs(pa - pb).max() < 1e-6, name
    steps = [json.loads(line)["step"] for line in (tmp_path / "killed" / "metrics.jsonl").open()]
    assert steps == sorted(set(steps)) and steps[-1] == 10


@pytest.mark.slow
def test_export_loads_in_transformers(tiny_dir, tmp_path):
    import jax.numpy as jnp
    import torch
    import transformers

    from grpo_jax.export import main as export_main
    from grpo_jax.models import positions_from_mask
    from grpo_jax.checkpoint import load_checkpoint
    train(config(tiny_dir, tmp_path / "run", max_steps=2), devices=jax.devices()[:1])
    assert export_main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf"),
                        "--dtype", "float32"]) == 0
    model, _, _ = load_checkpoint(tmp_path / "run")
    model.cfg = model.cfg.replace(dtype=jnp.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = np.array([tok("TL;DR: hello there")["input_ids"]])
    mask = np.ones_like(ids)
    hidden, _ = model(jnp.asarray(ids), positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask))
    with torch.no_grad():
        want = ref(input_ids=torch.as_tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(model.logits(hidden)) - want).max() < 1e-4


SHARDED = dict(max_steps=2, dp=-1, per_device_train_batch_size=2)


@pytest.fixture(scope="module")
def two_sharded_steps(tiny_dir, tmp_path_factory):
    """A 2-step run through `python -m grpo_jax.train`'s main, in-process: the suite's 8 CPU
    devices, so this also runs the loop on a sharded mesh. test_bad_input_one_clear_error_and_
    checkpoints_intact's cases each resume a copy of it."""
    from grpo_jax.train import main
    out = tmp_path_factory.mktemp("sharded") / "run"
    assert main(cli_args(tiny_dir, out, **SHARDED)) == 0
    return out


@pytest.mark.parametrize("args,message", [
    (["--learning_rat", "1e-5"], "learning_rate"),
    (["--set", "model.name_or_path=/nonexistent/model"], "not found"),
    (["--set", "data.prompt_column=text"], "text"),
    (["--set", f"reward_funcs=[{HERE / 'reward_fixtures.py'}:raises]"], "raises"),
    (["--set", f"reward_funcs=[{HERE / 'reward_fixtures.py'}:wrong_length]"], "wrong_length"),
])
@pytest.mark.slow
def test_bad_input_one_clear_error_and_checkpoints_intact(tiny_dir, two_sharded_steps, tmp_path,
                                                          capsys, args, message):
    """A resume with bad input, of a copy of one 2-step run (two_sharded_steps: the same run
    for each case, made once), exits 2 with one error line and the checkpoints intact."""
    from grpo_jax.train import main
    shutil.copytree(two_sharded_steps, tmp_path / "run")
    cfg_args = cli_args(tiny_dir, tmp_path / "run", **SHARDED)
    before = Checkpointer(tmp_path / "run" / "checkpoints", save_total_limit=None).all_steps()
    capsys.readouterr()
    assert main(cfg_args + ["--resume", "--max_steps", "4"] + args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("grpo_jax.train: error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err[-2000:]
    assert Checkpointer(tmp_path / "run" / "checkpoints", save_total_limit=None).all_steps()[
        :len(before)] == before


def test_tldr_without_hub_fails_fast_with_advice(tmp_path, capsys):
    from grpo_jax.train import main
    start = time.time()
    assert main(["--config", "tldr", "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Qwen/Qwen2-0.5B-Instruct" in err and "--local-dir" in err and "Traceback" not in err
    assert time.time() - start < 60


def _ref_at(out, cfg, step):
    """The reference params a sync_ref_model run checkpointed with `step`, as numpy leaves."""
    from grpo_jax.checkpoint import abstract_state
    target, *_ = abstract_state(cfg)
    ckpt = Checkpointer(Path(out) / "reference", save_total_limit=None)
    try:
        ref, meta = ckpt.restore(step, target.params)
    finally:
        ckpt.close()
    assert meta["step"] == step
    return [np.asarray(x) for x in jax.tree.leaves(ref)]


@pytest.mark.slow
def test_sync_ref_model_mixes_every_sync_steps(tiny_dir, tmp_path, monkeypatch):
    """TR-DPO as TRL's SyncRefModelCallback: after optimizer steps 2 and 4 (of 5; one update a
    round), ref = 0.6 * policy + 0.4 * ref, starting from the initial params; the next
    generation's reference log-probs come from the mixed reference."""
    from grpo_jax.policy import Policy
    after, mixes, refs_used = [], [], []
    step, mix, logps = Policy.step, Policy.mix_ref, Policy.logps

    def record_step(self, s, b):
        if not after:
            after.append([np.asarray(x) for x in jax.tree.leaves(s.params)])  # initial
        s, m = step(self, s, b)
        after.append([np.asarray(x) for x in jax.tree.leaves(s.params)])
        return s, m

    def record_logps(self, p, b, rows=None):
        refs_used.append([np.asarray(x) for x in jax.tree.leaves(p)])
        return logps(self, p, b, rows)
    monkeypatch.setattr(Policy, "step", record_step)
    monkeypatch.setattr(Policy, "mix_ref", lambda self, p, r, a: mixes.append(
        (len(after) - 1, a)) or mix(self, p, r, a))
    monkeypatch.setattr(Policy, "logps", record_logps)
    cfg = config(tiny_dir, tmp_path / "run", max_steps=5, beta=0.04, sync_ref_model=True,
                 ref_model_sync_steps=2, ref_model_mixup_alpha=0.6)
    train(cfg, devices=jax.devices()[:1])
    assert mixes == [(2, 0.6), (4, 0.6)]
    want = after[0]
    history = [want]  # the reference before each generation (round k generates before step k+1)
    for k in range(1, 5):
        if k % 2 == 0:
            want = [0.6 * p + 0.4 * r for p, r in zip(after[k], want)]
        history.append(want)
    got = _ref_at(tmp_path / "run", cfg, 5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    assert max(np.abs(g - a).max() for g, a in zip(got, after[0])) > 1e-3  # it did move
    assert len(refs_used) == 5  # one reference pass per generation, no old log-probs
    for used, w in zip(refs_used, history):
        for u, x in zip(used, w):
            np.testing.assert_allclose(u, x, rtol=1e-6, atol=1e-7)


def test_sync_ref_model_needs_beta(tiny_dir, tmp_path):
    from grpo_jax.errors import ConfigError
    with pytest.raises(ConfigError, match="while beta is 0"):  # at load, before any work
        config(tiny_dir, tmp_path / "run", sync_ref_model=True, beta=0.0)


@pytest.mark.slow
def test_sync_ref_model_resume_equals_uninterrupted(tiny_dir, tmp_path):
    """The reference is checkpointed with the state: stopped at step 3 (after the sync at 2;
    the run straight to 6's directory as the stop left it, `stopped_at`) and resumed to 6, the
    run has the params and reference of the run straight to 6."""
    from grpo_jax.checkpoint import load_checkpoint
    sync = dict(beta=0.04, sync_ref_model=True, ref_model_sync_steps=2, save_steps=3)
    train(config(tiny_dir, tmp_path / "full", max_steps=6, **sync), devices=jax.devices()[:1])
    # The full run's directory as a run stopped after its step-3 checkpoint left it: its
    # reference of step 6 is still there (a killed run's), and the resume drops it.
    stopped_at(tmp_path / "full", tmp_path / "cut", 3)
    assert (tmp_path / "cut" / "reference" / "6").is_dir()
    cfg = config(tiny_dir, tmp_path / "cut", max_steps=6, resume=True, **sync)
    train(cfg, devices=jax.devices()[:1])
    a, _, step_a = load_checkpoint(tmp_path / "full")
    b, _, step_b = load_checkpoint(tmp_path / "cut")
    assert step_a == step_b == 6
    diffs = {name: np.abs(pa - hf.params_numpy(b)[name]).max()
             for name, pa in hf.params_numpy(a).items()}
    print("max |full - resumed| params:", max(diffs.values()))
    assert max(diffs.values()) < 1e-6, diffs
    for ra, rb in zip(_ref_at(tmp_path / "full", cfg, 6), _ref_at(tmp_path / "cut", cfg, 6)):
        assert np.abs(ra - rb).max() < 1e-6
    kl = [[json.loads(line)["kl"] for line in (tmp_path / run / "metrics.jsonl").open()][-1]
          for run in ("full", "cut")]
    assert kl[0] == pytest.approx(kl[1], rel=1e-4, abs=1e-9)




@pytest.fixture(scope="module")
def odd_posts_run(tiny_dir, tmp_path_factory):
    """A dynamic_sampling run of 3 steps where posts with an even number score 0.5 whatever
    the completion (their groups have no signal): (output_dir, the windows its updates saw)."""
    from grpo_jax.policy import Policy
    out, fed = tmp_path_factory.mktemp("odd_posts") / "run", []
    step = Policy.step
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Policy, "step", lambda self, s, b: fed.append(b) or step(self, s, b))
        train(config(tiny_dir, out, **ODD_POSTS), devices=jax.devices()[:1])
    return out, fed


def _history(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]


@pytest.mark.slow
def test_dynamic_sampling_trains_only_on_groups_with_signal(tiny_dir, odd_posts_run):
    """No group of an even-numbered post reaches an update, and every group an update sees has
    rewards that differ; the batches take more than one generation, which the metrics count."""
    import re

    from transformers import AutoTokenizer
    out, fed = odd_posts_run
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(fed) == 3 and all(b.size == 16 for b in fed)
    for b in fed:
        for i in range(0, b.size, 4):  # one group: 4 rows of one prompt
            posts = {int(re.search(r"Post number (\d+)", tok.decode(
                b.prompt_ids[j][b.prompt_mask[j] > 0])).group(1)) for j in range(i, i + 4)}
            even = [np.mean(b.completion_ids[j][b.completion_mask[j] > 0] % 2 == 0)
                    for j in range(i, i + 4)]
            assert len(posts) == 1 and posts.pop() % 2 == 1 and np.std(even) > 0
            assert np.abs(b.advantages[i:i + 4]).max() > 0
    history = _history(out)
    assert sum(h["dynamic_sampling/num_gen_batches"] for h in history) > 3
    assert all(h["frac_reward_zero_std"] == 0.0 for h in history)
    assert all(0.25 <= h["dynamic_sampling/filtered_frac"] < 1.0 for h in history), history


@pytest.mark.slow
def test_dynamic_sampling_constant_reward_stops_with_one_line(tiny_dir, tmp_path):
    run = run_cli(cli_args(tiny_dir, tmp_path / "run", max_steps=2, dynamic_sampling=True,
                             max_num_gen_batches=2,
                             reward_funcs=f"[{HERE / 'reward_fixtures.py'}:constant]"))
    out, err = run.communicate(timeout=600)
    errors = [line for line in err.splitlines() if line.startswith("grpo_jax.train: error:")]
    assert run.returncode == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert "2 generation batches" in errors[0] and "the reward gives no signal" in errors[0]


@pytest.mark.slow
def test_dynamic_sampling_resume_mid_batch_equals_uninterrupted(tiny_dir, tmp_path,
                                                              monkeypatch, odd_posts_run):
    """Interrupted twice while a batch is half filled: by SIGTERM in batch 2's first generation
    (it aborts the generation at once: the batch is dropped), then, resumed, by a failure in
    batch 3's second generation (as a SIGKILL ends a run: the last checkpoint stands; the first
    generation's kept groups are lost). Each resume starts from the data position before the
    batch and regenerates it with the same keys: params and metrics equal a run straight
    through."""
    from grpo_jax.checkpoint import StopRun, load_checkpoint
    from grpo_jax.errors import GrpoJaxError
    full, _ = odd_posts_run
    gens = [int(h["dynamic_sampling/num_gen_batches"]) for h in _history(full)]
    assert gens[1] >= 2 and gens[2] >= 2, gens  # batches 2 and 3 take two generations or more
    out = tmp_path / "run"
    for how, call, saved in [("sigterm", gens[0] + 1, [1]), ("raise", gens[1] + 2, [1, 2])]:
        counter = tmp_path / f"{how}.calls"  # reward calls of this run
        monkeypatch.setenv("GRPO_TEST_INTERRUPT", f"{call}:{how}:{counter}")
        cfg = config(tiny_dir, out, resume=how == "raise", **ODD_POSTS)
        if how == "raise":
            with pytest.raises(GrpoJaxError, match="interrupted by the test"):
                train(cfg, devices=jax.devices()[:1])
        else:  # the signal aborts the generation at once: the run stops with StopRun
            with pytest.raises(StopRun):
                train(cfg, devices=jax.devices()[:1])
        assert int(counter.read_text()) == call
        ckpt = Checkpointer(out / "checkpoints", save_total_limit=None)
        assert ckpt.all_steps() == saved, (how, ckpt.all_steps())
        ckpt.close()
    monkeypatch.delenv("GRPO_TEST_INTERRUPT")
    train(config(tiny_dir, out, resume=True, **ODD_POSTS), devices=jax.devices()[:1])
    a, _, step_a = load_checkpoint(full)
    b, _, step_b = load_checkpoint(out)
    assert step_a == step_b == 3
    for name, pa in hf.params_numpy(a).items():
        assert np.abs(pa - hf.params_numpy(b)[name]).max() < 1e-6, name
    resumed = _history(out)
    assert [h["step"] for h in resumed] == [1, 2, 3]
    for h, want in zip(resumed, _history(full)):
        for key in ("reward", "dynamic_sampling/num_gen_batches", "num_tokens"):
            assert h[key] == pytest.approx(want[key], rel=1e-6), key
