"""Helpers for tests: a pure-numpy "model" with a cache, exact law enumeration, and stopping a server process.

``MarkovRunner`` is a fixed random table: the logits at a position depend only on the last two tokens (hashed
into a seeded generator), so batched and one-at-a-time forwards give bit-identical logits.  It is a test double
for pure math (the loop's bookkeeping and the verifier's law), never a stand-in for a host.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class MarkovRunner:
    def __init__(self, vocab_size: int, seed: int = 0, scale: float = 3.0, *, noise_of: "MarkovRunner | None" = None,
                 noise: float = 0.0, valid: int | None = None):
        self.vocab_size = vocab_size
        self.seed = seed
        self.scale = scale
        self.noise_of = noise_of
        self.noise = noise
        self.valid = valid if valid is not None else vocab_size  # ids >= valid get -inf (padding rows of a head)
        self._tokens: list[int] = []
        self.forward_calls = 0
        self.tokens_fed = 0

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def logits_after(self, a: int, b: int) -> np.ndarray:
        if self.noise_of is not None:
            base = self.noise_of.logits_after(a, b)
            g = np.random.default_rng((self.seed, 7919, a + 1, b + 1))
            return base + self.noise * g.standard_normal(self.vocab_size)
        g = np.random.default_rng((self.seed, a + 1, b + 1))
        z = self.scale * g.standard_normal(self.vocab_size)
        z[self.valid:] = -np.inf
        return z

    def forward(self, tokens: Sequence[int], logits_for: int | None = None) -> np.ndarray:
        self.forward_calls += 1
        self.tokens_fed += len(tokens)
        rows = []
        m = len(tokens) if logits_for is None else logits_for
        start = len(tokens) - m
        for i, t in enumerate(tokens):
            self._tokens.append(int(t))
            if i >= start:
                prev = self._tokens[-2] if len(self._tokens) >= 2 else -1
                rows.append(self.logits_after(prev, int(t)))
        if not rows:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        return np.stack(rows).astype(np.float32)

    def trim(self, n: int) -> None:
        if n < 0 or n > len(self._tokens):
            raise ValueError(f"cannot trim {n} of {len(self._tokens)} tokens")
        if n:
            del self._tokens[-n:]


def plain_decode(runner: MarkovRunner, prompt: Sequence[int], matcher, params, max_tokens: int, rng,
                 stop_token_ids: Sequence[int] = (), tilt_fn=None, budget=None) -> list[int]:
    """Reference: non-speculative constrained decoding, one fresh forward per token, no cache reuse.  ``budget``
    (``budget.Budget``): its cut of each row, and for a budget checked at commit, ``Budget.draw``."""
    from .masks import new_mask
    from .distributions import log_law, sample

    out: list[int] = []
    seq = list(prompt)
    stops = set(stop_token_ids)
    row = new_mask(runner.vocab_size)
    while len(out) < max_tokens:
        runner.trim(len(runner.tokens))
        logits = runner.forward(seq, logits_for=1)[-1]
        mask = None
        if matcher is not None:
            matcher.fill_mask(row)
            mask = row
        if budget is not None and mask is not None:
            budget.restrict(mask, out)
        tilt = tilt_fn(out, matcher) if tilt_fn is not None else None
        t = sample(log_law(logits, mask, params, tilt), rng)
        if budget is not None and budget.settles:
            t = budget.draw(out, mask, lambda row: sample(log_law(logits, row, params, tilt), rng), first=t)
        out.append(t)
        seq.append(t)
        if matcher is not None:
            assert matcher.accept(t)
        if t in stops or (matcher is not None and matcher.is_terminated()):
            break
    return out


def exact_law(runner, prompt: Sequence[int], compiled, params, max_tokens: int, tilt_fn=None,
              budget=None) -> dict:
    """Every output of plain constrained sampling (one fresh forward per token, no speculation) with its exact
    probability: {output token tuple (stop token included when generated): probability}.  ``tilt_fn(generated,
    matcher)`` gives the cost tilt, as in the loop.  ``budget`` (``budget.Budget``): the law under the grammar row
    cut to the tokens that still fit (for a budget checked at commit: every token with mass checked with
    ``Budget.feasible``).  Only for small vocabularies and short outputs."""
    from .masks import new_mask
    from .distributions import log_law

    row = new_mask(runner.vocab_size)
    out: dict = {}

    def rec(gen, m, prob):
        if len(gen) >= max_tokens or m.is_terminated():
            out[tuple(gen)] = out.get(tuple(gen), 0.0) + prob
            return
        runner.trim(len(runner.tokens))
        logits = runner.forward(list(prompt) + gen, logits_for=1)[-1]
        m.fill_mask(row)
        tilt = None if tilt_fn is None else tilt_fn(gen, m)
        if budget is not None:
            budget.restrict(row, gen)
        p = np.exp(log_law(logits, row, params, tilt))
        if budget is not None and budget.settles:
            from .masks import clear_bit

            for t in np.flatnonzero(p > 0):
                if not budget.feasible(gen, int(t)):
                    clear_bit(row, int(t))
            p = np.exp(log_law(logits, row, params, tilt))
        for t in np.flatnonzero(p > 0):
            m2 = m.fork()
            assert m2.accept(int(t))
            rec(gen + [int(t)], m2, prob * p[t])

    rec([], compiled.matcher(), 1.0)
    return out


def toy_tokenizer(vocab_size: int = 128):
    """A small byte-level vocabulary with multi-byte tokens (for core tests that need no tokenizer files).

    Id 0 is EOS (special); ids past the defined tokens are padding (never allowed)."""
    from .tokenizer import TokenizerInfo

    pieces = [b""]  # 0: EOS
    pieces += [bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyz"]
    pieces += [bytes([c]) for c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    pieces += [bytes([c]) for c in b"0123456789"]
    pieces += [b"-", b"@", b".", b" ", b"<", b">", b"/", b"{", b"}", b":", b",", b'"', b"\n"]
    pieces += [b"ab", b"ba", b"aa", b"bb", b"12", b"20", b"19", b".com", b"com", b"ex", b"ample", b"</", b"think",
               b"</think>", b"k>", b'{"', b'":', b'",', b"\xc3", b"\xa9", b"\xc3\xa9"]
    assert len(pieces) <= vocab_size
    table = {p: i for i, p in enumerate(pieces) if p}

    def encode(text: str) -> list[int]:  # greedy longest match
        data, out, i = text.encode("utf-8"), [], 0
        while i < len(data):
            for j in range(min(len(data), i + 8), i, -1):
                if data[i:j] in table:
                    out.append(table[data[i:j]])
                    i = j
                    break
            else:
                raise ValueError(f"cannot tokenize {data[i:]!r}")
        return out

    return TokenizerInfo(tuple(pieces), 0, (0,), vocab_size, frozenset({0}), encode, None, "toy")


class TableMatcher:
    """A matcher whose allowed tokens at depth i are the packed row ``masks[i]`` (pure data: for laws and
    verification on small vocabularies, where the grammar is not the point).  Implements ``constraint.Matcher``."""

    def __init__(self, masks: Sequence[np.ndarray], vocab_size: int, depth: int = 0):
        self.masks, self.vocab_size, self.depth = masks, vocab_size, depth

    def fill_mask(self, out: np.ndarray) -> None:
        out[:] = self.masks[self.depth]

    def accept(self, token: int) -> bool:
        from .masks import mask_allows

        if self.depth >= len(self.masks) or not mask_allows(self.masks[self.depth], int(token)):
            return False
        self.depth += 1
        return True

    def rollback(self, n: int) -> None:
        self.depth -= n

    def fork(self) -> "TableMatcher":
        return TableMatcher(self.masks, self.vocab_size, self.depth)

    def is_terminated(self) -> bool:
        return False

    def forced(self):
        from .constraint import Forced

        return Forced()

    def jump_forward(self) -> bytes:
        return b""

    def accept_bytes(self, data: bytes) -> bool:
        return False


class CountingMatcher:
    """Wraps a real engine's matcher and counts every ``fill_mask`` call made on it or on its forks (``counter``:
    a one-element list shared by the forks)."""

    def __init__(self, inner, counter: list | None = None):
        self.inner = inner
        self.counter = counter if counter is not None else [0]
        self.vocab_size = inner.vocab_size

    def fill_mask(self, out):
        self.counter[0] += 1
        self.inner.fill_mask(out)

    def fork(self):
        return CountingMatcher(self.inner.fork(), self.counter)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def stop_server(proc) -> None:
    """Stop a server started in its own session (``start_new_session=True``): SIGINT, so it shuts down as on
    Ctrl-C, then SIGKILL to its whole process group after 8 s (the tests' and the benchmarks' servers).  An idle
    server exits on SIGINT within ~2.5 s here; one whose client still holds a keep-alive connection can wait for
    that handler thread, which cost 30 s per such teardown in the suite with a 30 s grace."""
    import os
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(8)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
