"""Packed token masks: bit ``j`` of int32 word ``i`` set <=> token ``32*i + j`` allowed (the layout xgrammar and
llguidance use), ``mask_words(vocab_size)`` words per row.  Every engine fills rows of this shape and every law
backend reads them."""

from __future__ import annotations

from typing import Iterable

import numpy as np


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_mask(vocab_size: int, rows: int | None = None, fill: int = 0) -> np.ndarray:
    shape = (mask_words(vocab_size),) if rows is None else (rows, mask_words(vocab_size))
    return np.full(shape, fill, dtype=np.int32)


def unpack_mask(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Packed int32 rows [..., W] -> bool [..., vocab_size]."""
    m = np.ascontiguousarray(mask, dtype=np.int32)
    bits = np.unpackbits(m.view(np.uint8).reshape(*m.shape[:-1], -1), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """bool [..., V] -> packed int32 [..., ceil(V/32)]."""
    a = np.asarray(allowed, dtype=bool)
    v = a.shape[-1]
    pad = mask_words(v) * 32 - v
    if pad:
        a = np.concatenate([a, np.zeros((*a.shape[:-1], pad), dtype=bool)], axis=-1)
    return np.packbits(a, axis=-1, bitorder="little").view(np.int32)


def mask_allows(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def allowed_among(mask: np.ndarray, ids: np.ndarray) -> list[int]:
    """The ids of ``ids`` (int64 array, each below the row's width) that the packed row allows, in their order:
    one vectorized test instead of ``mask_allows`` per id."""
    words = mask.view(np.uint32)[ids >> 5]
    return ids[((words >> (ids & 31).astype(np.uint32)) & 1).astype(bool)].tolist()


def clear_bit(mask: np.ndarray, token: int) -> None:
    """Disallow ``token`` in a packed row, in place."""
    mask.view(np.uint32)[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)


def set_bit(mask: np.ndarray, token: int) -> None:
    mask.view(np.uint32)[token >> 5] |= np.uint32(1 << (token & 31))


ALLOWED_IDS_CACHE = 128  # sparse rows an ``allowed_ids`` cache keeps (the oldest dropped first)


def allowed_ids(mask: np.ndarray, vocab_size: int | None = None, cache: dict | None = None) -> np.ndarray:
    """The ids a packed row allows, ascending (below ``vocab_size``).  A sparse row (at most 1/8 of its words
    nonzero: a structural position) has only its nonzero words unpacked: ~4x cheaper at 151,936 tokens.

    ``cache``: a dict the caller keeps, for rows filled again and again at the same grammar states (vLLM's refused
    draft rows: the same ~425-id row after an opening brace, 390 nonzero words of 4,748, costs 15-55 us to unpack
    right after a draft pass has swept the caches, a lookup less): a sparse row's ids by its content (its bytes),
    read-only, at most ``ALLOWED_IDS_CACHE`` rows."""
    vocab_size = vocab_size or mask.shape[-1] * 32
    if mask.ndim == 1:
        if cache is not None:  # (the row's bytes are the key: two calls on a hit, each more costs ~3 us cold)
            key = (vocab_size, mask.tobytes())
            hit = cache.get(key)
            if hit is not None:
                return hit
        if np.count_nonzero(mask) * 8 <= mask.shape[0]:
            words = np.flatnonzero(mask != 0)  # (numpy's nonzero is much faster on bools than on int32 words)
            bits = np.flatnonzero(np.unpackbits(np.ascontiguousarray(mask[words]).view(np.uint8),
                                                bitorder="little").view(bool))
            ids = words[bits >> 5] * 32 + (bits & 31)
            if len(ids) and ids[-1] >= vocab_size:
                ids = ids[ids < vocab_size]
            if cache is not None:
                while len(cache) >= ALLOWED_IDS_CACHE:
                    del cache[next(iter(cache))]
                ids.flags.writeable = False
                cache[key] = ids
            return ids
    return np.flatnonzero(unpack_mask(mask, vocab_size))


def full_mask(vocab_size: int, exclude: Iterable[int] = ()) -> np.ndarray:
    """Every token id below vocab_size allowed (minus ``exclude``)."""
    allowed = np.ones(vocab_size, dtype=bool)
    for t in exclude:
        if 0 <= t < vocab_size:
            allowed[t] = False
    return pack_mask(allowed)


def single_allowed(row: np.ndarray) -> int | None:
    """The only allowed token of a packed row, or None if zero or several are allowed."""
    if np.count_nonzero(row) != 1:  # (counting first: ~12x cheaper than the index array at 4,748 words)
        return None
    nz = np.flatnonzero(row)
    word = int(row.view(np.uint32)[nz[0]])
    if word & (word - 1):
        return None
    return int(nz[0]) * 32 + word.bit_length() - 1
