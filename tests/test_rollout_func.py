"""TRL's rollout_func: a user function makes the rollouts (here a two-turn game with the
environment's reply masked), the trainer trains on them."""

import json

import jax
import pytest
from tiny_run import HERE, REWARD, config

from grpo_jax.rollout.custom import RolloutFuncError, rollout_batch
from grpo_jax.train import train

GAME = f"{HERE / 'reward_fixtures.py'}:two_turn_game"


@pytest.mark.slow
def test_a_two_turn_game_trains(tiny_dir, tmp_path):  # noqa: F811
    """The environment's tokens carry no loss (tool_mask from env_mask), the sampler's
    log-probs of both turns equal the trainer's over the whole sequence, and the function's
    extra field reaches the reward functions."""
    cfg = config(tiny_dir, tmp_path / "out", rollout_func=GAME, max_completion_length=24,
                 reward_funcs=f"[{REWARD}, {HERE / 'reward_fixtures.py'}:more_moves]",
                 max_steps=2, log_completions="true", num_completions_to_print=0)
    last = train(cfg, devices=jax.devices()[:1])
    assert last["sampling/sampling_logp_difference/max"] < 1e-4
    assert last["rewards/more_moves/mean"] > 1.0  # some rows made two moves
    rows = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").open()]
    assert any("!ok" in r["completion"] for r in rows)


def test_bad_outputs_are_one_clear_error():
    ok = {"prompt_ids": [[1, 2]], "completion_ids": [[3, 2]], "logprobs": [[-1.0, -2.0]]}
    r = rollout_batch(ok, 1, 4, 0, {2})
    assert r.completion_ids.tolist() == [[3, 2, 0, 0]] and not r.truncated[0]
    for bad, match in [
            ([1], "returned list"), ({"prompt_ids": [[1]]}, r"keys \['completion_ids'"),
            ({**ok, "completion_ids": [[3] * 5]}, "more than max_completion_length=4"),
            ({**ok, "logprobs": [[-1.0]]}, "one value per completion token"),
            ({**ok, "moves": [1, 2]}, "'moves' has 2 entries for 1 rows")]:
        with pytest.raises(RolloutFuncError, match=match):
            rollout_batch(bad, 1, 4, 0, {2})
