"""Reward functions loaded by path in the training tests (as a user's file would be)."""


def even_tokens(prompts, completions, completion_ids, **kwargs):
    """Share of even token ids: a tiny random model starts near 0.5 and RL pushes it up."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def raises(prompts, completions, completion_ids, **kwargs):
    raise ZeroDivisionError("boom")


def wrong_length(prompts, completions, completion_ids, **kwargs):
    return [1.0]
