"""Reward functions: built-ins, loading by module and path, async, None, weights, errors."""

import asyncio
import textwrap

import numpy as np
import pytest

from grpo_jax.grpo.advantages import combine_rewards
from grpo_jax import rewards as rewards_lib
from grpo_jax.rewards import (RewardError, RewardFunc, accuracy,
                              completions_for_rewards, compute_rewards, load_reward_func,
                              load_reward_funcs, missing_rewards, reward_len,
                              think_format_reward)


def test_builtins():
    texts = ["x" * 20, "short", "y" * 33, ""]
    assert reward_len(texts) == [0, -15, -13, -20]
    chat = completions_for_rewards([[{"role": "user", "content": "q"}]] * 4, texts)
    assert chat[1] == [{"role": "assistant", "content": "short"}]
    assert reward_len(chat) == reward_len(texts)
    assert completions_for_rewards(["q", "r"], ["a", "b"]) == ["a", "b"]
    assert think_format_reward(["<think>\nreasoning\n</think>\nanswer", "<think>\nno close",
                                "answer <think>late</think>", "<think>a</think><think>b</think>"]
                               ) == [1.0, 0.0, 0.0, 0.0]
    comps = ["The answer is 42.", "42", "I think 41", "no idea", "1,234", "it is -7", "5 or 6.5"]
    answers = ["42", "42", "42", "42", "1234", "-7", "6.5"]
    assert accuracy(comps, answers) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]


def _write(path, body):
    path.write_text(textwrap.dedent(body))
    return path


USER_REWARDS = """
    import asyncio

    def count_a(prompts, completions, completion_ids, **kwargs):
        return [float(c.count("a")) for c in completions]

    def uses_column(completions, target, **kwargs):
        return [1.0 if c == t else None for c, t in zip(completions, target)]

    async def slow_len(completions, **kwargs):
        await asyncio.sleep(0)
        return [len(c) for c in completions]

    not_a_function = 3
"""


def test_load_by_path_and_by_module(tmp_path, monkeypatch):
    path = _write(tmp_path / "my_rewards.py", USER_REWARDS)
    by_path = load_reward_func(f"{path}:count_a")
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = load_reward_func("my_rewards:count_a")
    assert by_path.name == f"{path}:count_a" and by_module.name == "my_rewards:count_a"
    assert by_path.fn(None, ["aa", "b"], None) == by_module.fn(None, ["aa", "b"], None) == [2, 0]
    assert [f.fn for f in load_reward_funcs(["reward_len", "accuracy"])] == [reward_len, accuracy]


@pytest.mark.parametrize("spec,needle", [
    ("reward_length", "built-ins are reward_len"),
    ("org/reward-model", "could not be fetched from the Hugging Face hub"),
    ("a/b/c", "no such directory, and not a hub id"),
    ("{dir}/nope.py:f", "no such file"),
    ("{dir}/my_rewards.py:missing", r"has no function 'missing' \(it has: count_a, slow_len, "
                                    r"uses_column\)"),
    ("{dir}/my_rewards.py:not_a_function", "has no function 'not_a_function'"),
    ("{dir}/broken.py:f", "importing .* raised ZeroDivisionError"),
    ("{dir}/badsig.py:f", "must accept the keyword `completions`"),
    ("{dir}/badsig.py:g", "has no \\*\\*kwargs, but it is also called with trainer_state, "
                          "log_extra, log_metric and the dataset's columns"),
    ("no_such_module_xyz:f", "can't import module 'no_such_module_xyz'"),
])
def test_load_errors(tmp_path, spec, needle):
    _write(tmp_path / "my_rewards.py", USER_REWARDS)
    _write(tmp_path / "broken.py", "x = 1 / 0\n")
    _write(tmp_path / "badsig.py", "def f(texts):\n    return texts\n\n\n"
                                   "def g(prompts, completions, completion_ids):\n    return []\n")
    with pytest.raises(RewardError, match=needle):
        load_reward_func(spec.format(dir=tmp_path))


def test_compute_rewards_sync_async_none_and_columns(tmp_path):
    path = _write(tmp_path / "my_rewards.py", USER_REWARDS)
    funcs = load_reward_funcs(["reward_len", f"{path}:slow_len", f"{path}:uses_column"])
    comps = ["aaa", "bb", "x" * 20]
    out = compute_rewards(funcs, ["p"] * 3, comps, [[1], [2, 3], [4]],
                          {"target": ["aaa", "zz", "zz"]})
    want = np.array([[-17, 3, 1], [-18, 2, np.nan], [0, 20, np.nan]], np.float32)
    assert out.dtype == np.float32 and out.shape == (3, 3)
    np.testing.assert_array_equal(out, want)
    # Weighted nansum: NaN is skipped, not propagated (TRL's rule).
    total = combine_rewards(out, [1.0, 0.5, 2.0])
    np.testing.assert_allclose(total, [-17 + 1.5 + 2, -18 + 1.0, 0 + 10.0])
    all_none = RewardFunc("none", lambda completions, **kw: [None] * len(completions))
    # A completion no function could score stays NaN: group_advantages gives it advantage 0.
    assert np.isnan(combine_rewards(compute_rewards([all_none], ["p"], ["c"], [[1]]))).all()
    with pytest.raises(ValueError, match="2 reward_weights for 3"):
        combine_rewards(out, [1.0, 2.0])


def test_async_functions_run_concurrently_even_inside_a_loop():
    # Each function waits for the other's signal: run one after the other, both would time out.
    async def ping(completions, **kw):
        ping_done.set()
        await asyncio.wait_for(pong_done.wait(), 5)
        return [1.0] * len(completions)

    async def pong(completions, **kw):
        pong_done.set()
        await asyncio.wait_for(ping_done.wait(), 5)
        return [2.0] * len(completions)

    def run():
        return compute_rewards([ping, pong], ["p", "q"], ["a", "b"], [[1], [2]])

    ping_done, pong_done = asyncio.Event(), asyncio.Event()
    np.testing.assert_array_equal(run(), [[1, 2], [1, 2]])

    async def from_a_notebook_cell():  # an event loop is already running here
        return run()
    ping_done, pong_done = asyncio.Event(), asyncio.Event()
    np.testing.assert_array_equal(asyncio.run(from_a_notebook_cell()), [[1, 2], [1, 2]])


def _const(value):
    def f(completions, **kwargs):
        return value(completions) if callable(value) else value
    f.__name__ = "const"
    return f


def _raises(completions, **kwargs):
    raise KeyError("answer")


async def _async_raises(completions, **kwargs):
    raise ValueError("judge offline")


def _no_kwargs(completions):
    return [0.0] * len(completions)


@pytest.mark.parametrize("fn,needle", [
    (_raises, "'_raises' raised KeyError: 'answer'.*fix the function"),
    (_async_raises, "'_async_raises' raised ValueError: judge offline"),
    (_no_kwargs, "raised TypeError.*give it \\*\\*kwargs"),
    (_const([1.0]), "'const' returned 1 values for 2 completions"),
    (_const(0.5), "returned <class 'float'> for 2"),
    (_const(["good", 1.0]), "returned 'good' for completion 0"),
    (_const([1.0, float("inf")]), "finite number or None"),
])
def test_bad_reward_functions_raise_reward_error(fn, needle):
    with pytest.raises(RewardError, match=needle):
        compute_rewards([fn], ["p", "q"], ["a", "b"], [[1], [2]], {"answer": ["1", "2"]})


def _length(text):
    return float(len(text))


def _calls_a_helper_wrongly(completions, **kwargs):
    return [_length(c, strict=True) for c in completions]  # a TypeError of its own


@pytest.mark.parametrize("fn,needle", [
    (_raises, r"^reward function '_raises' raised KeyError: 'answer' at .*test_rewards\.py:\d+; "
              r"fix the function$"),
    (_async_raises, r"^reward function '_async_raises' raised ValueError: judge offline at "
                    r".*test_rewards\.py:\d+; fix the function$"),
    (_calls_a_helper_wrongly, r"^reward function '_calls_a_helper_wrongly' raised TypeError: "
                              r"_length\(\) got an unexpected keyword argument 'strict' at .*"),
])
def test_a_reward_function_that_raises_is_named_with_its_own_error(fn, needle):
    """Functions that have **kwargs are not told to add them: one line, their own error."""
    with pytest.raises(RewardError, match=needle) as e:
        compute_rewards([fn], ["p", "q"], ["a", "b"], [[1], [2]], {"answer": ["1", "2"]})
    assert "kwargs" not in str(e.value) and "\n" not in str(e.value)


def test_numpy_results_and_input_checks():
    arr = RewardFunc("np", lambda completions, **kw: np.arange(len(completions), dtype=np.int64))
    np.testing.assert_array_equal(compute_rewards([arr], ["p"] * 3, ["a"] * 3, [[1]] * 3),
                                  [[0], [1], [2]])
    with pytest.raises(ValueError, match="clashes"):
        compute_rewards([arr], ["p"], ["a"], [[1]], {"completions": ["x"]})
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2"):
        compute_rewards([arr], ["p"] * 2, ["a"] * 2, [[1]] * 2, {"answer": ["x"]})


def test_open_r1_math_rewards():
    """open-r1's recipes name accuracy (math-verify against a LaTeX `solution`), format and
    tag_count; the numeric `answer` form of accuracy stays as it was."""
    from grpo_jax.rewards import BUILTIN_REWARDS as R
    good = "<think>\nhalf of one\n</think>\n<answer>\n$\\frac{1}{2}$\n</answer>"
    wrong = "<think>\nguess\n</think>\n<answer>\n$\\frac{1}{3}$\n</answer>"
    sloppy = "<think>half</think> so \\boxed{0.5}"
    sols = ["$\\frac{1}{2}$"] * 3
    assert R["accuracy"]([good, wrong, sloppy], solution=sols) == [1.0, 0.0, 1.0]
    assert R["accuracy"](["x"], solution=["no math here"]) == [None]  # unparsable gold: skipped
    assert R["accuracy"](["so 12", "13"], answer=[12, 12]) == [1.0, 0.0]
    assert R["format"]([good, sloppy]) == [1.0, 0.0]
    assert R["tag_count"]([good, sloppy, "<think>\n"]) == [1.0, 0.0, 0.25]
    chat = [[{"role": "assistant", "content": good}]]
    assert R["format"](chat) == [1.0] and R["accuracy"](chat, solution=sols[:1]) == [1.0]


TRL_KWARGS_REWARDS = """
    import asyncio

    def shaped(completions, trainer_state, log_extra, log_metric, **kwargs):
        progress = trainer_state.global_step / trainer_state.max_steps
        log_extra("judge", [f"len {len(c)}" for c in completions])
        log_metric("shaped/progress", progress)
        log_metric("shaped/progress", progress + 1.0)  # averaged with the first
        return [progress * len(c) + trainer_state.epoch for c in completions]

    async def judged(completions, log_metric, log_extra, **kwargs):
        await asyncio.sleep(0)
        log_metric("judge/calls", len(completions))
        log_extra("verdict", ["ok"] * len(completions))
        return [1.0] * len(completions)
"""


def test_reward_functions_get_trainer_state_log_extra_and_log_metric(tmp_path):
    """TRL 1.16 passes trainer_state, log_extra(column, values) and log_metric(name, value) to
    every reward function; extra columns join the completions table, metrics are averaged."""
    path = _write(tmp_path / "shaping.py", TRL_KWARGS_REWARDS)
    funcs = load_reward_funcs([f"{path}:shaped", f"{path}:judged"])
    state = rewards_lib.TrainerState(global_step=3, max_steps=12, epoch=0.5, num_train_epochs=1.0)
    logs = rewards_lib.RewardLogs()
    out = compute_rewards(funcs, ["p", "q"], ["ab", "abcd"], [[1], [2]], trainer_state=state,
                          logs=logs)
    np.testing.assert_allclose(out, [[0.25 * 2 + 0.5, 1.0], [0.25 * 4 + 0.5, 1.0]])
    assert logs.extra == {"judge": ["len 2", "len 4"], "verdict": ["ok", "ok"]}
    assert logs.metric_means() == {"shaped/progress": 0.75, "judge/calls": 2.0}
    # without a state or a collector: TrainerState's defaults and a collector nobody reads
    assert compute_rewards([RewardFunc("s", lambda completions, trainer_state, **kw: [
        float(trainer_state.global_step)] * len(completions))], ["p"], ["c"], [[1]]) == 0.0


def test_log_extra_needs_one_value_per_completion():
    def bad(completions, log_extra, **kwargs):
        log_extra("note", ["only one"])
        return [0.0] * len(completions)
    with pytest.raises(RewardError, match="'note' got 1 values for 2 completions"):
        compute_rewards([bad], ["p", "q"], ["a", "b"], [[1], [2]],
                        logs=rewards_lib.RewardLogs())
    with pytest.raises(ValueError, match="clashes"):
        compute_rewards([bad], ["p"], ["a"], [[1]], {"trainer_state": [1]})


def test_user_functions_are_named_by_their_function_name(tmp_path, monkeypatch):
    """TRL names a reward function by its __name__ (partials unwrapped, callable objects by
    their class) in metrics and the completions table; the config's spelling stays `name`."""
    import functools
    path = _write(tmp_path / "my_rewards.py", USER_REWARDS)
    f = load_reward_func(f"{path}:count_a")
    assert f.name == f"{path}:count_a" and f.log_name == "count_a"

    class Judge:
        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)
    funcs = [f, load_reward_func("reward_len"), RewardFunc("x", functools.partial(reward_len)),
             RewardFunc("y", Judge()), load_reward_func(f"{path}:count_a")]
    assert rewards_lib.reward_names(funcs) == ["count_a", "reward_len", "reward_len_2", "Judge",
                                               "count_a_2"]


@pytest.mark.parametrize("max_len,cache", [(8, 3), (8, 8), (8, 0), (20, 5)])
def test_soft_overlong_punishment_is_trls(max_len, cache):
    """The built-in equals TRL's get_soft_overlong_punishment(max_completion_len,
    soft_punish_cache) on every length from 0 to past the maximum, under TRL's metric name."""
    from trl.rewards import get_soft_overlong_punishment
    f = load_reward_func("soft_overlong_punishment", max_completion_length=max_len,
                         soft_punish_cache=cache)
    ids = [[7] * n for n in range(max_len + 3)]
    got = compute_rewards([f], ["p"] * len(ids), ["c"] * len(ids), ids)[:, 0]
    want = get_soft_overlong_punishment(max_len, cache)(ids)
    np.testing.assert_array_equal(got, np.float32(want))
    assert rewards_lib.reward_names([f]) == [get_soft_overlong_punishment(8, 3).__name__]
    with pytest.raises(RewardError, match="set soft_punish_cache"):
        load_reward_func("soft_overlong_punishment", max_completion_length=max_len)


def test_soft_overlong_punishment_counts_completion_ids_as_trl():
    """Through the run's scorer, a completion's length is TRL's: its tokens up to and including
    the first EOS (TRL's completion_mask rule, written out from its _generate), all of them when
    there is none."""
    import jax

    from hf_oracle import char_tokenizer
    from grpo_jax import mesh as mesh_lib
    from grpo_jax.rollout.native.sampler import RolloutBatch
    from grpo_jax.scoring import RewardScorer
    from trl.rewards import get_soft_overlong_punishment
    tok, C, eos = char_tokenizer(), 8, 2
    raw = np.random.default_rng(0).integers(4, 99, (8, C)).astype(np.int32)
    for row, at in enumerate([0, 2, 4, 5, 7, None, None, 3]):
        if at is not None:
            raw[row, at] = eos
            raw[row, at + 1:] = tok.pad_token_id  # the sampler's layout after the stop token
    is_eos = raw == eos  # TRL: eos_idx = first EOS (or the width), mask = index <= eos_idx
    eos_idx = np.where(is_eos.any(1), is_eos.argmax(1), C)
    trl_mask = np.arange(C)[None] <= eos_idx[:, None]
    trl_ids = [r[m].tolist() for r, m in zip(raw, trl_mask)]
    ones = np.ones((8, 1), np.int32)
    ours = (raw != tok.pad_token_id).astype(np.int32)  # the sampler's: through the stop token
    r = RolloutBatch(ones, ones, raw, ours, ~is_eos.any(1), np.zeros((8, C), np.float32))
    f = load_reward_func("soft_overlong_punishment", max_completion_length=C, soft_punish_cache=6)
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(1, 1, 1), jax.devices()[:1])
    scores = RewardScorer([f], tok, mesh, num_generations=4)([{"prompt": "p"}] * 2, r)
    want = get_soft_overlong_punishment(C, 6)(trl_ids)
    np.testing.assert_array_equal(scores.per_func[:, 0], np.float32(want))
    assert len(set(want)) >= 5  # the ramp's values, 0 and -1 all occur


def test_nan_is_none_and_missing_rewards_are_said():
    """TRL 1.16's _calculate_rewards: None becomes NaN and a NaN returned stays NaN, so both
    mean "no reward"; TRL warns when every function gave none to a completion. Here also when a
    function gave none to a whole batch, and loudly when no completion has any reward."""
    nan = RewardFunc("nan", lambda completions, **kw: [float("nan"), None, 1.0])
    none = RewardFunc("none", lambda completions, **kw: [None] * len(completions))
    out = compute_rewards([nan, none], ["p"] * 3, ["a", "b", "c"], [[1]] * 3)
    np.testing.assert_array_equal(np.isnan(out), [[True, True], [True, True], [False, True]])
    funcs, rows = missing_rewards(out, ["nan", "none"], ["p0", "p1", "p2"], ["a", "b", "c"])
    assert list(funcs) == ["none"] and "'none' gave no reward (None or NaN) to any of the 3" \
        in funcs["none"]
    assert len(rows) == 1 and "for 2 of 3 completions (e.g. completion 0: 'p0' -> 'a')" in rows[0]
    funcs, rows = missing_rewards(out[:2], ["nan", "none"])
    assert list(funcs) == ["nan", "none"]
    assert len(rows) == 1 and "no completion of this batch has a reward" in rows[0]
    assert missing_rewards(np.ones((2, 1), np.float32), ["f"]) == ({}, [])
