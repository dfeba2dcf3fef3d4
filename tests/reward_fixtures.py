"""Reward functions loaded by path in the training tests (as a user's file would be)."""


def even_tokens(prompts, completions, completion_ids, **kwargs):
    """Share of even token ids: a tiny random model starts near 0.5 and RL pushes it up."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def raises(prompts, completions, completion_ids, **kwargs):
    raise ZeroDivisionError("boom")


def wrong_length(prompts, completions, completion_ids, **kwargs):
    return [1.0]


def even_tokens_logged(prompts, completions, completion_ids, log_extra, log_metric, **kwargs):
    """even_tokens, and what it scored through TRL's log_extra and log_metric (a process sees
    only its rows: the trainer gathers both)."""
    scores = even_tokens(prompts, completions, completion_ids)
    log_extra("num_ids", [len(ids) for ids in completion_ids])
    log_metric("logged/score_mean", sum(scores) / len(scores))
    return scores


def two_turn_game(prompts, trainer):
    """A rollout_func (TRL's signature): the model writes a move, the environment answers
    '!ok' (env_mask 0: not the model's), the model writes a second move. Extra field `moves`
    goes to the reward functions."""
    tok, C = trainer.tokenizer, trainer.max_completion_length
    ids = [tok(p)["input_ids"] for p in prompts]
    # A move is at most half the budget (the environment cuts it), so every row has room for
    # the reply and a second move, whether or not the model writes its stop token early.
    first = [{k: v[:C // 2] for k, v in turn.items()} for turn in trainer.generate(ids)]
    reply = tok("!ok")["input_ids"]
    out = {"prompt_ids": ids, "completion_ids": [], "logprobs": [], "env_mask": [], "moves": []}
    contexts, rows = [], []
    for i, turn in enumerate(first):
        c, lp = turn["completion_ids"], turn["logprobs"]
        out["completion_ids"].append(c)
        out["logprobs"].append(lp)
        out["env_mask"].append([1] * len(c))
        out["moves"].append(1)
        if len(c) + len(reply) < C:
            contexts.append(ids[i] + c + reply)
            rows.append(i)
    for i, turn in zip(rows, trainer.generate(contexts)):
        room = C - len(out["completion_ids"][i]) - len(reply)
        c, lp = turn["completion_ids"][:room], turn["logprobs"][:room]
        out["completion_ids"][i] = out["completion_ids"][i] + reply + c
        out["logprobs"][i] = out["logprobs"][i] + [0.0] * len(reply) + lp
        out["env_mask"][i] = out["env_mask"][i] + [0] * len(reply) + [1] * len(c)
        out["moves"][i] = 2
    return out


def more_moves(completions, moves, **kwargs):
    return [float(m) for m in moves]


def constant(prompts, completions, **kwargs):
    """The same reward for every completion: no group has signal."""
    return [1.0] * len(completions)


def even_tokens_odd_posts(prompts, completions, completion_ids, **kwargs):
    """even_tokens on posts with an odd number ("Post number 7: ..."), 0.5 on the others: half
    the groups have no signal. With $GRPO_TEST_INTERRUPT = "N:raise|sigterm:COUNTER_FILE", the
    N-th call (counted in the file, so across runs of one process too) fails or signals."""
    import os
    import re
    import signal
    interrupt = os.environ.get("GRPO_TEST_INTERRUPT")
    if interrupt:
        at, how, counter = interrupt.split(":", 2)
        calls = int(open(counter).read() or 0) + 1 if os.path.exists(counter) else 1
        with open(counter, "w") as f:
            f.write(str(calls))
        if calls == int(at):
            if how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                raise RuntimeError("interrupted by the test")
    even = even_tokens(prompts, completions, completion_ids)
    odd = [int(re.search(r"Post number (\d+)", str(p)).group(1)) % 2 == 1 for p in prompts]
    return [e if o else 0.5 for e, o in zip(even, odd)]


def epoch_seen(completions, trainer_state, log_metric, **kwargs):
    """No reward at all (None for every completion: a NaN column, as TRL's); logs the
    trainer_state.epoch it was given."""
    log_metric("epoch_seen", trainer_state.epoch)
    return [None] * len(completions)


def even_tokens_then_stall(prompts, completions, completion_ids, trainer_state, **kwargs):
    """even_tokens; with $GRPO_JAX_TEST_STALL set (a file path), a round after two updates
    creates that file and stalls for 10 minutes first: a stop signal lands mid-round."""
    import os
    import time
    marker = os.environ.get("GRPO_JAX_TEST_STALL")
    if marker and trainer_state.global_step >= 2:
        open(marker, "w").close()
        time.sleep(600)
    return even_tokens(prompts, completions, completion_ids)


def even_tokens_then_stop(prompts, completions, completion_ids, trainer_state, **kwargs):
    """even_tokens; with $GRPO_JAX_TEST_SIGTERM_AT=N set, the round scored after N updates
    sends this process SIGTERM, once (the variable is unset): an in-process run stops after
    that round, as a scheduler's signal stops it."""
    import os
    import signal
    at = os.environ.get("GRPO_JAX_TEST_SIGTERM_AT")
    if at is not None and trainer_state.global_step >= int(at):
        del os.environ["GRPO_JAX_TEST_SIGTERM_AT"]
        os.kill(os.getpid(), signal.SIGTERM)
    return even_tokens(prompts, completions, completion_ids)


def nan_rewards(prompts, completions, completion_ids, **kwargs):
    """No finite reward for any completion: NaN, which TRL treats as None."""
    return [float("nan")] * len(completions)


def even_tokens_odd_words(prompts, completions, completion_ids, **kwargs):
    """even_tokens on prompts of an odd number of words, 0.5 on the others (no signal there).
    With $GRPO_TEST_SCORED, each completion's prompt and reward is appended to that file."""
    import json
    import os
    scores = [e if len(str(p).split()) % 2 else 0.5
              for e, p in zip(even_tokens(prompts, completions, completion_ids), prompts)]
    if os.environ.get("GRPO_TEST_SCORED"):
        with open(os.environ["GRPO_TEST_SCORED"], "a") as f:
            f.writelines(json.dumps([str(p), s]) + "\n" for p, s in zip(prompts, scores))
    return scores


def seeing_episode(prompts, trainer, blank: bool = False):
    """A vision-language model's rollout_func, as TRL 1.16 gives it the prompts: each one's
    images in its messages' image parts, rendered and expanded by trainer.processing_class (the
    processor) and sampled with its images (`blank`: black ones of the same sizes instead)."""
    from PIL import Image
    proc = trainer.processing_class
    ids, pictures = [], []
    for p in prompts:
        shown = [part["image"] for m in p if isinstance(m["content"], list)
                 for part in m["content"] if part.get("type") == "image"]
        text = proc.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        ids.append(list(proc(text=[text], images=[shown] if shown else None)["input_ids"][0]))
        pictures.append([Image.new("RGB", im.size) for im in shown] if blank else shown)
    turns = trainer.generate(ids, 1, images=pictures)
    return {"prompt_ids": ids, "completion_ids": [t["completion_ids"] for t in turns],
            "logprobs": [t["logprobs"] for t in turns]}
