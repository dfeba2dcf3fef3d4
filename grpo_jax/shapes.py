"""The prompt widths a run compiles for, shared by everything that pads prompts (the rollouts,
reward models, aot's forecast), so a run compiles a handful of programs, not one per length."""

from __future__ import annotations

# 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512, ... 16384 prompt tokens: 2^i, 1.25 x
# 2^i and 1.5 x 2^i, so padding is at most a quarter of the width (tldr-like posts of 260-320
# tokens pad to 320, not 384) while a run still compiles only a handful of programs.
DEFAULT_BUCKETS = tuple(sorted({2 ** i for i in range(5, 15)} | {3 * 2 ** i for i in range(4, 13)}
                               | {5 * 2 ** i for i in range(4, 12)}))


def bucket_width(length: int, buckets=DEFAULT_BUCKETS, beyond=None) -> int:
    """The smallest bucket that holds `length` tokens; past the last, beyond(length) (default:
    the length itself)."""
    return next((b for b in buckets if b >= length),
                beyond(length) if beyond is not None else length)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def completion_width(longest: int, limit: int, multiple: int | None = None,
                     divisor: int = 1) -> int:
    """The completion width of a training batch whose longest completion has `longest` tokens
    (TRL pads to the longest; a compiled step wants few shapes): rounded up to a multiple of
    `multiple` (TRL's pad_to_multiple_of), or without one to the length buckets, then to a
    multiple of `divisor` (a context axis cuts the completion into equal chunks); at most
    `limit`, the rollout's own width (max_completion_length), which is kept whenever the
    rounding reaches it."""
    n = max(int(longest), 1)
    width = -(-n // multiple) * multiple if multiple else bucket_width(n, beyond=lambda _: limit)
    width = -(-width // divisor) * divisor
    return min(width, limit)
