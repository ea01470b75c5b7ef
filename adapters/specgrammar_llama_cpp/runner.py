"""llama.cpp as the core sees it: a ``ModelRunner`` over one ``Llama`` context (low-level API) and the
``TokenizerInfo`` of a GGUF vocabulary.

``LlamaRunner.forward`` is one ``llama_decode`` per ``n_batch`` chunk with the batch's logits flags set only on the
rows the caller wants (no ``logits_all=True`` needed), and ``trim`` is ``llama_memory_seq_rm`` with its return
value checked (llama-cpp-python 0.3.36 ignores it, llama.py:1010-1014).  The runner keeps the host's own
bookkeeping (``Llama.input_ids`` / ``n_tokens``, and ``scores`` when the model was made with ``logits_all=True``, for logprobs)
equal to what the KV cache holds, so the stock ``generate()``'s prefix reuse keeps working on the same object.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable, Sequence

import numpy as np

import llama_cpp

from specgrammar_plugins.api import TokenizerInfo

_NOT_TEXT = (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
             | llama_cpp.LLAMA_TOKEN_ATTR_UNUSED)


def eog_ids(llama) -> tuple[int, ...]:
    """Every end-of-generation id (``llama_vocab_is_eog``): what the host stops on and what llama.cpp's grammar
    sampler allows where a grammar may end."""
    vocab = llama._model.vocab
    return tuple(i for i in range(llama.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i))


def tokenizer_info(llama) -> TokenizerInfo:
    """The ``TokenizerInfo`` of a loaded GGUF model, read from llama.cpp's vocabulary (cached on the object).

    Token bytes come from ``llama_token_to_piece`` (no special rendering); control/unknown/unused tokens and
    end-of-generation tokens get ``b""``; the stop ids are all end-of-generation ids; ``encode`` is the model's
    own tokenizer (no BOS, no special tokens); the width is ``n_vocab`` (the logits row length).
    """
    cached = getattr(llama, "_specgrammar_tokinfo", None)
    if cached is not None:
        return cached
    vocab = llama._model.vocab
    n = llama.n_vocab()
    size = 256
    buf = ctypes.create_string_buffer(size)
    pieces: list[bytes] = []
    special: set[int] = set()
    stops = eog_ids(llama)
    stop_set = set(stops)
    for i in range(n):
        if i in stop_set or llama_cpp.llama_vocab_get_attr(vocab, i) & _NOT_TEXT:
            special.add(i)
            pieces.append(b"")
            continue
        k = llama_cpp.llama_token_to_piece(vocab, i, buf, size, 0, False)
        if k < 0:  # buffer too small: -k bytes needed
            size = -k + 1
            buf = ctypes.create_string_buffer(size)
            k = llama_cpp.llama_token_to_piece(vocab, i, buf, size, 0, False)
        pieces.append(buf.raw[:max(k, 0)])
    if not stops:
        raise ValueError("the model's vocabulary has no end-of-generation token")
    eos = llama.token_eos()
    if eos not in stop_set:
        eos = stops[0]

    def encode(text: str) -> list[int]:
        return llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    info = TokenizerInfo(tuple(pieces), eos, stops, n, frozenset(special), encode, None,
                         os.path.basename(getattr(llama, "model_path", "") or "gguf"))
    llama._specgrammar_tokinfo = info
    return info


Processor = Callable[[np.ndarray, np.ndarray], np.ndarray]


class LlamaRunner:
    """``ModelRunner`` over a ``llama_cpp.Llama`` (sequence 0 of its context).

    processors: llama-cpp-python logits processors ``f(input_ids, scores) -> scores``, applied to every returned
    row with that row's exact history (the host passes all evaluated ids instead, drafts included: llama.py:742).
    """

    def __init__(self, llama, processors: Sequence[Processor] | None = None):
        self.llama = llama
        self.vocab_size = llama.n_vocab()
        self.n_batch = int(llama.n_batch)
        self.processors = list(processors or ())
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.decodes = 0  # llama_decode calls
        self.rows = 0  # logits rows computed
        self.last: np.ndarray | None = None  # the rows the last forward returned

    def __del__(self):
        b = getattr(self, "_batch", None)
        self._batch = None
        if b is not None:
            try:
                llama_cpp.llama_batch_free(b)
            except Exception:  # interpreter shutdown: the bindings may already be gone
                pass

    @property
    def tokens(self) -> list[int]:
        return self.llama.input_ids[: self.llama.n_tokens].tolist()

    def forward(self, tokens: Sequence[int], logits_for: int | None = None) -> np.ndarray:
        llama = self.llama
        tokens = [int(t) for t in tokens]
        n = len(tokens)
        m = n if logits_for is None else int(logits_for)
        if not 0 <= m <= n:
            raise ValueError(f"logits_for={logits_for} with {n} tokens")
        n0 = llama.n_tokens
        if n0 + n > llama.n_ctx():
            raise ValueError(f"context window full: {n0} + {n} tokens > n_ctx={llama.n_ctx()}")
        out = np.empty((m, self.vocab_size), dtype=np.float32)
        start = n - m
        row = 0
        # with logits_all=True the host reads logprobs from its scores buffer: fill every row of it, as its eval does
        keep_all = bool(getattr(llama, "_logits_all", False))
        b = self._batch
        ctx = llama.ctx
        llama._requires_eval = True  # the host's "current logits" are no longer those of its last token
        for c0 in range(0, n, self.n_batch):
            chunk = tokens[c0:c0 + self.n_batch]
            past = llama.n_tokens
            b.n_tokens = len(chunk)
            for i, t in enumerate(chunk):
                b.token[i] = t
                b.pos[i] = past + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = keep_all or (c0 + i) >= start
            rc = llama_cpp.llama_decode(ctx, b)
            self.decodes += 1
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} (batch of {len(chunk)} at position {past})")
            llama.input_ids[past:past + len(chunk)] = chunk
            llama.n_tokens = past + len(chunk)
            for i in range(0 if keep_all else max(0, start - c0), len(chunk)):
                ptr = llama_cpp.llama_get_logits_ith(ctx, i)
                if not ptr:
                    raise RuntimeError(f"llama_get_logits_ith({i}) returned NULL")
                logits = np.ctypeslib.as_array(ptr, shape=(self.vocab_size,))
                if keep_all:
                    llama.scores[past + i, :] = logits
                if c0 + i >= start:
                    out[row] = logits
                    row += 1
        self.rows += m
        self.last = out
        if self.processors and m:
            ids = llama.input_ids
            for r in range(m):
                hist = ids[: n0 + start + r + 1]
                for p in self.processors:
                    out[r] = p(hist, out[r])
        return out

    def trim(self, n: int) -> None:
        llama = self.llama
        if n < 0 or n > llama.n_tokens:
            raise ValueError(f"cannot trim {n} of {llama.n_tokens} tokens")
        if n == 0:
            return
        p0 = llama.n_tokens - n
        # llama-cpp-python 0.3.36 ignores this return value (llama.py:1010-1014); a cache that refuses partial
        # removal (recurrent/hybrid models) would then keep the rejected drafts' keys and values
        if not llama_cpp.llama_memory_seq_rm(llama._ctx.memory, 0, p0, -1):
            raise RuntimeError(f"llama_memory_seq_rm refused to drop positions {p0}..{llama.n_tokens - 1}: this "
                               "model's cache cannot roll back (recurrent/hybrid), so it cannot verify drafts")
        llama.n_tokens = p0
        llama._requires_eval = True


__all__ = ["LlamaRunner", "eog_ids", "tokenizer_info"]
