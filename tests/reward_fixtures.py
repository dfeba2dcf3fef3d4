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
