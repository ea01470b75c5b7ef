"""Longest common prefixes: how far a history-keyed state (a matcher, a KV cache) is still valid, and bringing a
``ModelRunner``'s cache to a wanted token sequence by trimming to that prefix and feeding the rest."""

from __future__ import annotations

from typing import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if isinstance(a, list) and isinstance(b, list) and a[:n] == b[:n]:
        return n  # the common case (one extends the other), compared in C: a history synced every step
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def sync_runner(runner, want: Sequence[int]) -> None:
    """Make ``runner`` (a ``block.ModelRunner``) hold exactly ``want``: trim its cache to the longest common prefix
    with what it holds, then feed the rest (no logits asked for)."""
    have = runner.tokens
    lcp = common_prefix_len(have, want)
    if len(have) > lcp:
        runner.trim(len(have) - lcp)
    if len(want) > lcp:
        runner.forward(list(want[lcp:]), logits_for=0)
