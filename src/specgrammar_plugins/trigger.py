"""A deferred constraint: free text until a trigger string (e.g. ``</think>``) has been generated, then the grammar.

The trigger may complete in the middle of a token: the bytes after it are fed to the grammar, and a token whose
tail the grammar would reject is masked out before the trigger, so every output is "free text + trigger + a
string of the language".  The prompt is never searched (only generated text counts).
"""

from __future__ import annotations

import numpy as np

from .constraint import CompiledConstraint, Forced, Matcher
from .masks import clear_bit, full_mask


class TriggeredMatcher:
    def __init__(self, compiled: CompiledConstraint, inner: Matcher | None = None, *, _state=None):
        self.compiled = compiled
        self.tokenizer = compiled.tokenizer
        self.vocab_size = self.tokenizer.vocab_size
        self.trigger = compiled.spec.trigger.encode("utf-8")
        self._fresh = inner  # an unused inner matcher, handed over at trigger time
        if _state is not None:
            (self.history, self.text_lens, self.trigger_at, self.inner, self.terminated, self._shared) = _state
            return
        self.history: list[int] = []
        self.text_lens: list[int] = [0]  # bytes generated after each accepted token
        self.trigger_at: int | None = None  # number of tokens in history when the trigger completed
        self.inner: Matcher | None = None
        self.terminated = False
        n = len(self.tokenizer.token_bytes)
        last = self.trigger[-1:]
        self._shared = {
            "text": bytearray(),
            "free_mask": full_mask(n).copy() if n == self.vocab_size else _pad(full_mask(n), self.vocab_size),
            "candidates": [t for t, b in enumerate(self.tokenizer.token_bytes) if last in b],
            "tails": {},  # prefix bytes -> mask row for that prefix
        }

    # ------------------------------------------------------------------ helpers
    @property
    def _text(self) -> bytearray:
        return self._shared["text"]

    def _new_inner(self) -> Matcher:
        m, self._fresh = self._fresh, None
        return m if m is not None else self.compiled.make_matcher(self.compiled)

    def _completion(self, prefix: bytes, tok_bytes: bytes) -> bytes | None:
        """Tail after the trigger if ``prefix + tok_bytes`` completes it (else None)."""
        s = prefix + tok_bytes
        i = s.find(self.trigger)
        if i < 0 or i + len(self.trigger) <= len(prefix):
            return None
        return s[i + len(self.trigger):]

    def _prefix(self) -> bytes:
        keep = len(self.trigger) - 1
        end = self.text_lens[-1]
        return bytes(self._text[max(0, end - keep):end]) if keep else b""

    # ------------------------------------------------------------------ Matcher protocol
    def fill_mask(self, out: np.ndarray) -> None:
        if self.inner is not None:
            self.inner.fill_mask(out)
            return
        if self.terminated:
            out[:] = 0
            return
        prefix = self._prefix()
        row = self._shared["tails"].get(prefix)
        if row is None:
            row = self._shared["free_mask"].copy()
            probe = None
            for t in self._shared["candidates"]:
                tail = self._completion(prefix, self.tokenizer.token_bytes[t])
                if tail:  # completes the trigger with bytes left over: the grammar must take them
                    probe = probe or self.compiled.make_matcher(self.compiled)
                    if probe.accept_bytes(tail):
                        probe = None  # consumed state; make a fresh one next time
                    else:
                        clear_bit(row, t)
            if len(self._shared["tails"]) > 4096:
                self._shared["tails"].clear()
            self._shared["tails"][prefix] = row
        out[:] = row

    def accept(self, token: int) -> bool:
        if self.terminated:
            return False
        if self.inner is not None:
            ok = self.inner.accept(token)
            if ok:
                self.history.append(token)
                self.text_lens.append(self.text_lens[-1])
            return ok
        n = len(self.tokenizer.token_bytes)
        if not (0 <= token < n):
            return False
        if token in self.tokenizer.stop_token_ids:
            self.history.append(token)
            self.text_lens.append(self.text_lens[-1])
            self.terminated = True
            return True
        tb = self.tokenizer.token_bytes[token]
        tail = self._completion(self._prefix(), tb)
        if tail is not None:
            inner = self._new_inner()
            if tail and not inner.accept_bytes(tail):
                return False
            self.inner = inner
            self.trigger_at = len(self.history) + 1
        end = self.text_lens[-1]
        del self._text[end:]
        self._text.extend(tb)
        self.history.append(token)
        self.text_lens.append(end + len(tb))
        return True

    def accept_bytes(self, data: bytes) -> bool:
        if self.inner is not None:
            return self.inner.accept_bytes(data)
        raise NotImplementedError("accept_bytes before the trigger")

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if n > len(self.history):
            raise ValueError(f"cannot roll back {n} tokens: only {len(self.history)} accepted")
        keep = len(self.history) - n
        if self.inner is not None and self.trigger_at is not None:
            if keep >= self.trigger_at:
                self.inner.rollback(n)
            else:
                self.inner = None
                self.trigger_at = None
        del self.history[keep:]
        del self.text_lens[keep + 1:]
        self.terminated = False
        if self.inner is not None and self.inner.is_terminated():
            self.terminated = True

    def fork(self) -> "TriggeredMatcher":
        inner = self.inner.fork() if self.inner is not None else None
        shared = dict(self._shared)
        shared["text"] = bytearray(self._text[: self.text_lens[-1]])
        state = (list(self.history), list(self.text_lens), self.trigger_at, inner, self.terminated, shared)
        return TriggeredMatcher(self.compiled, None, _state=state)

    def is_terminated(self) -> bool:
        if self.inner is not None:
            return self.inner.is_terminated()
        return self.terminated

    def forced(self) -> Forced:
        return self.inner.forced() if self.inner is not None else Forced()

    def jump_forward(self, limit: int | None = None) -> bytes:
        return self.inner.jump_forward(limit) if self.inner is not None else b""

    @property
    def jump_forward_complete(self) -> bool:
        # before the trigger the text is free: nothing is forced, and b"" says so
        return self.inner is None or getattr(self.inner, "jump_forward_complete", False)

    @property
    def active(self) -> bool:
        """True once the trigger has been generated and the grammar constrains."""
        return self.inner is not None


def _pad(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    from .masks import mask_words

    out = np.zeros(mask_words(vocab_size), dtype=np.int32)
    out[: mask.shape[0]] = mask
    return out
