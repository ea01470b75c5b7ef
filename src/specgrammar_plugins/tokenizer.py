"""What every grammar engine needs to know about a tokenizer, in plain Python: the bytes of each token.

``TokenizerInfo`` is built once per model (``from_hf``/``from_file``) and carried by every compiled constraint.
Its ``vocab_size`` is the *model's output width* (masks are padded to it), which may exceed the number of tokens
the tokenizer defines (Qwen2.5: 151,936 vs 151,665).  Special tokens get ``b""`` as their bytes so no engine
ever lets a grammar produce them; stop tokens (EOS) are allowed by an engine only where the grammar may end.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

from .errors import TokenizerMismatchError


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _decode_byte_level(piece: str) -> bytes:
    table = _byte_decoder()
    try:
        return bytes(table[ch] for ch in piece)
    except KeyError:  # not a byte-level piece (added token spelled in plain text)
        return piece.encode("utf-8")


def _decode_metaspace(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


@dataclass(frozen=True, eq=False)
class TokenizerInfo:
    """Token bytes plus the ids that end a sequence.

    token_bytes: bytes of each token id below ``len(token_bytes)``; ``b""`` for special tokens.
    vocab_size: mask width = model output width (>= len(token_bytes)); ids past the tokenizer are never allowed.
    eos_token_id / stop_token_ids: ids that end generation; engines allow them only where the grammar may end.
    encode: optional text -> ids function (used for jump-forward strings and by engines that tokenize).
    """

    token_bytes: tuple[bytes, ...]
    eos_token_id: int
    stop_token_ids: tuple[int, ...]
    vocab_size: int
    special_ids: frozenset[int] = frozenset()
    encode: Callable[[str], list[int]] | None = field(default=None, repr=False)
    tokenizer_json: str | None = field(default=None, repr=False)
    name: str = "tokenizer"

    def __post_init__(self):
        if self.vocab_size < len(self.token_bytes):
            raise ValueError(f"vocab_size {self.vocab_size} < number of tokens {len(self.token_bytes)}")
        if self.eos_token_id not in self.stop_token_ids:
            object.__setattr__(self, "stop_token_ids", (self.eos_token_id, *self.stop_token_ids))

    @property
    def fingerprint(self) -> str:
        """Content hash of the vocabulary (not of the width): the token bytes, the stop and special ids."""
        return self._hash("_fp", lambda: json.dumps([self.eos_token_id, sorted(self.stop_token_ids),
                                                     sorted(self.special_ids)]).encode())

    @property
    def vocab_fingerprint(self) -> str:
        """Content hash of the token bytes alone.  Recipe packs are bound to it: they hold token ids, whose meaning
        is their bytes; hosts may disagree on which ids end generation (llama.cpp marks <|endoftext|> as EOG in a
        GGUF whose HF tokenizer stops on <|im_end|> only), which ``fingerprint`` includes."""
        return self._hash("_vfp", lambda: b"")

    def _hash(self, slot: str, extra) -> str:
        """Hash of the token bytes and ``extra()`` (called only when not cached yet), cached in ``slot``."""
        fp = self.__dict__.get(slot)
        if fp is None:
            h = hashlib.sha256()
            for b in self.token_bytes:
                h.update(len(b).to_bytes(4, "little"))
                h.update(b)
            h.update(extra())
            fp = h.hexdigest()[:16]
            object.__setattr__(self, slot, fp)
        return fp

    @property
    def byte_complete(self) -> bool:
        """Whether every single byte is a token of its own (neither special nor a stop token): then any byte a
        grammar allows next is an allowed token, so a position that allows one token only is one whose next byte
        is forced (``DraftBlock.forced_hint``).  Byte-level BPE vocabularies are; cached."""
        v = self.__dict__.get("_byte_complete")
        if v is None:
            skip = self.special_ids | frozenset(self.stop_token_ids)
            v = len({b for i, b in enumerate(self.token_bytes) if len(b) == 1 and i not in skip}) == 256
            object.__setattr__(self, "_byte_complete", v)
        return v

    def with_vocab_size(self, vocab_size: int) -> "TokenizerInfo":
        """The same tokenizer with masks padded to another model's output width."""
        if vocab_size == self.vocab_size:
            return self
        return replace(self, vocab_size=vocab_size)

    def decode(self, ids: Sequence[int]) -> bytes:
        n = len(self.token_bytes)
        return b"".join(self.token_bytes[i] for i in ids if 0 <= i < n)

    def check_same_vocab(self, other: "TokenizerInfo", what: str = "draft and target") -> None:
        if self.fingerprint != other.fingerprint:
            raise TokenizerMismatchError(
                f"{what} tokenizers differ ({self.name}: {len(self.token_bytes)} tokens, fingerprint {self.fingerprint}; "
                f"{other.name}: {len(other.token_bytes)} tokens, fingerprint {other.fingerprint}); "
                "grammar-aware speculation needs one tokenizer"
            )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_tokenizers(cls, tok, *, vocab_size: int | None = None, eos_token: str | int | None = None,
                        stop_tokens: Sequence[str | int] = (), name: str = "tokenizer") -> "TokenizerInfo":
        """From a ``tokenizers.Tokenizer`` (the Rust library HF tokenizers use)."""
        raw = json.loads(tok.to_str())
        decoder = raw.get("decoder") or {}
        dec_types = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", []) or []}
        byte_level = "ByteLevel" in dec_types
        vocab = tok.get_vocab(with_added_tokens=True)
        n = max(vocab.values()) + 1 if vocab else 0
        pieces: list[str | None] = [None] * n
        for piece, i in vocab.items():
            pieces[i] = piece
        special: set[int] = set()
        for added in raw.get("added_tokens", []):
            if added.get("special"):
                special.add(int(added["id"]))
        token_bytes: list[bytes] = []
        for i, piece in enumerate(pieces):
            if piece is None or i in special:
                token_bytes.append(b"")
            elif byte_level:
                token_bytes.append(_decode_byte_level(piece))
            else:
                token_bytes.append(_decode_metaspace(piece))

        def _id(t: str | int) -> int:
            if isinstance(t, int):
                return t
            i = tok.token_to_id(t)
            if i is None:
                raise ValueError(f"token {t!r} is not in the vocabulary")
            return i

        if eos_token is None:
            for cand in ("<|im_end|>", "<|eot_id|>", "</s>", "<|endoftext|>", "<eos>"):
                if tok.token_to_id(cand) is not None:
                    eos_token = cand
                    break
        if eos_token is None:
            raise ValueError("cannot tell the EOS token: pass eos_token=")
        eos = _id(eos_token)
        stops = tuple(dict.fromkeys([eos, *(_id(s) for s in stop_tokens)]))

        def encode(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False).ids

        return cls(tuple(token_bytes), eos, stops, vocab_size or n, frozenset(special), encode, tok.to_str(), name)

    @classmethod
    def from_file(cls, path: str | Path, **kw) -> "TokenizerInfo":
        """From a ``tokenizer.json`` file or a folder holding one (reads ``tokenizer_config.json`` for EOS)."""
        from tokenizers import Tokenizer

        p = Path(path)
        folder = p if p.is_dir() else p.parent
        tj = p / "tokenizer.json" if p.is_dir() else p
        tok = Tokenizer.from_file(str(tj))
        if "eos_token" not in kw:
            cfg = folder / "tokenizer_config.json"
            if cfg.exists():
                eos = json.loads(cfg.read_text()).get("eos_token")
                if isinstance(eos, dict):
                    eos = eos.get("content")
                if eos and tok.token_to_id(eos) is not None:
                    kw["eos_token"] = eos
        kw.setdefault("name", folder.name)
        return cls.from_tokenizers(tok, **kw)

    @classmethod
    def from_hf(cls, hf_tokenizer, *, vocab_size: int | None = None, **kw) -> "TokenizerInfo":
        """From a ``transformers`` fast tokenizer (or anything with ``backend_tokenizer``/``_tokenizer``)."""
        backend = getattr(hf_tokenizer, "backend_tokenizer", None) or getattr(hf_tokenizer, "_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(hf_tokenizer).__name__} has no fast (Rust) tokenizer behind it")
        if "eos_token" not in kw and getattr(hf_tokenizer, "eos_token_id", None) is not None:
            kw["eos_token"] = int(hf_tokenizer.eos_token_id)
        kw.setdefault("name", getattr(hf_tokenizer, "name_or_path", "") or "hf")
        return cls.from_tokenizers(backend, vocab_size=vocab_size, **kw)
