"""A token store: prompt lookup's proposals from a corpus of earlier text, not only from the context.

A :class:`TokenStore` holds token sequences (typically the target's own outputs on many prompts: what the
target tends to say) and finds, after a context, the continuation that followed the longest suffix of that
context in the store (up to ``max_ngram`` tokens): the model-free drafting of retrieval- and suffix-based
speculative decoding. :class:`~taps.drafters.ngram.PromptLookupDrafter` takes one (``store=``) and proposes
its continuation beside the context's own matches; verification is unchanged, so decoding stays lossless
whatever the store holds.

The index is a suffix array over the *reversed* sequences (each position sorted by the token there, then
the one before, ...), so that a context's last token, then its last two, ... narrow one contiguous range of
positions: a longest match takes one binary search per matched token. The continuation is voted over up
to ``vote`` of the matching positions: at each level, the token most of the positions still agreeing with
the vote so far continue with (on the shipped models the first match's continuation alone gave 3.3
tokens a drafted step against 5.2 for the vote; bench/RESULTS.md). Both run in one C++ call,
:func:`taps_ops.token_store_continuation`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

import taps_ops  # noqa: F401  (loads the ops: _CONTINUATION_OP below)

__all__ = ["TokenStore"]

#: the most tokens a continuation holds (the sequences are padded with this many separators)
MAX_DEPTH = 64
#: the op itself, on the store's own arrays (made and checked here; the op checks its reads in C++): the wrapper's
#: Python checks of them cost 2.5 of a search's 4.7 us, paid by every request on every step with a store
_CONTINUATION_OP = torch.ops.taps_ops.token_store_continuation.default
_FORMAT = 1


class TokenStore:
    """Token sequences and an index that finds what followed a context's longest suffix.

    Args:
        sequences: the token sequences (lists or 1-D integer arrays of ids >= 0).
        vocab_size: the vocabulary the ids belong to (every id must be below it).
        max_ngram: the longest context suffix matched (>= 1).
        vote: the most matching positions whose continuations are voted (>= 1).
        meta: free-form facts kept with the store (how it was built), saved with it.
    """

    def __init__(self, sequences: Iterable[Sequence[int]], vocab_size: int, *, max_ngram: int = 8, vote: int = 32,
                 meta: Optional[dict] = None):
        if int(vocab_size) < 1:
            raise ValueError(f"TokenStore: vocab_size must be >= 1, got {vocab_size}")
        if int(max_ngram) < 1:
            raise ValueError(f"TokenStore: max_ngram must be >= 1, got {max_ngram}")
        if int(vote) < 1:
            raise ValueError(f"TokenStore: vote must be >= 1, got {vote}")
        self.vocab_size, self.max_ngram, self.vote = int(vocab_size), int(max_ngram), int(vote)
        self.meta = dict(meta or {})
        parts, count = [np.full(1, -1, dtype=np.int32)], 0
        for i, seq in enumerate(sequences):
            a = np.asarray(seq, dtype=np.int64).reshape(-1) if len(seq) else np.zeros(0, dtype=np.int64)
            if a.size and (a.min() < 0 or a.max() >= self.vocab_size):
                raise ValueError(f"TokenStore: sequence {i} holds ids outside [0, {self.vocab_size}) "
                                 f"(min {int(a.min())}, max {int(a.max())})")
            parts += [a.astype(np.int32), np.full(1, -1, dtype=np.int32)]
            count += 1
        parts.append(np.full(MAX_DEPTH, -1, dtype=np.int32))
        self.num_sequences = count
        self._build(np.concatenate(parts))

    @classmethod
    def _from_flat(cls, flat: np.ndarray, vocab_size: int, max_ngram: int, vote: int, meta: dict) -> "TokenStore":
        """From the separated form :meth:`save` writes (-1 between sequences; empty sequences dropped)."""
        flat = np.asarray(flat, dtype=np.int64).reshape(-1)
        pieces = (p[p >= 0] for p in np.split(flat, np.flatnonzero(flat < 0)))  # (each led by its separator)
        return cls([p for p in pieces if p.size], vocab_size, max_ngram=max_ngram, vote=vote, meta=meta)

    def _build(self, tokens: np.ndarray) -> None:
        self.tokens = tokens  # -1 before, between and after the sequences (then MAX_DEPTH more)
        real = np.flatnonzero(tokens >= 0)
        self.num_tokens = int(real.size)
        # columns: the token at each position, the one before, ... (-1 from the sequence's start on)
        cols = [tokens[real]]
        for j in range(1, self.max_ngram):
            prev = tokens[np.maximum(real - j, 0)] if real.size else real
            cols.append(np.where(cols[-1] < 0, -1, np.where(real - j >= 0, prev, -1)))
        order = np.lexsort(cols[::-1]) if real.size else np.zeros(0, dtype=np.int64)
        self.ends = real[order]  # the positions, sorted by the reversed text ending at them
        self.cols = np.stack([c[order] for c in cols]) if real.size else np.zeros((self.max_ngram, 0), np.int32)
        self._pairs: Optional[set] = None  # has_pair's, made when first asked (store_ngram 2 only)
        # the op's views of the arrays (sharing their memory)
        self._tokens_t = torch.from_numpy(self.tokens)
        self._ends_t = torch.from_numpy(np.ascontiguousarray(self.ends, dtype=np.int64))
        self._cols_t = torch.from_numpy(np.ascontiguousarray(self.cols, dtype=np.int32))

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"TokenStore({self.num_sequences} sequences, {self.num_tokens} tokens, vocab {self.vocab_size}, "
                f"max_ngram {self.max_ngram}, vote {self.vote})")

    def has_pair(self, before: int, last: int) -> bool:
        """Whether the two tokens `before`, `last` occur in this order in the store (a set lookup; the set of
        every pair, ~0.2 s and ~10 MB for the shipped store, is made at the first call)."""
        if self._pairs is None:
            if self.max_ngram >= 2 and self.cols.shape[1]:
                ok = self.cols[1] >= 0
                self._pairs = set((self.cols[0][ok].astype(np.int64) * self.vocab_size + self.cols[1][ok]).tolist())
            else:
                self._pairs = set()
        return last * self.vocab_size + before in self._pairs

    def match(self, context: Sequence[int]) -> Tuple[int, int, int]:
        """The longest suffix of `context` (up to ``max_ngram`` tokens) found in the store: (its length, the
        range lo, hi of the matching positions in the index); length 0 when the last token is absent."""
        got = _CONTINUATION_OP(self._tokens_t, self._ends_t, self._cols_t, [int(t) for t in context[-self.max_ngram:]],
                               0, 0, self.vote)
        return got[0], got[1], got[2]

    def continuation(self, context: Sequence[int], depth: int, min_ngram: int = 2) -> Tuple[List[int], int]:
        """The voted continuation (up to `depth` tokens, <= MAX_DEPTH) after the longest suffix of `context`
        found in the store, and that suffix's length; ([], n) when it is shorter than `min_ngram`.
        (One ``taps_ops.token_store_continuation`` call: the search and the vote in C++, 7-9 us; the same
        in Python cost 50-200 us a draft on the shipped models.)"""
        got = _CONTINUATION_OP(self._tokens_t, self._ends_t, self._cols_t, [int(t) for t in context[-self.max_ngram:]],
                               max(0, min(int(depth), MAX_DEPTH)), max(int(min_ngram), 1), self.vote)
        return got[3:], got[0]

    # -- files
    def save(self, path: Union[str, Path]) -> Path:
        """Write the store to `path` (.npz: the sequences, separated, and the settings and meta as JSON)."""
        path = Path(path)
        flat = self.tokens[:len(self.tokens) - MAX_DEPTH]
        dtype = np.int16 if self.vocab_size <= 1 << 15 else np.int32
        info = dict(format=_FORMAT, vocab_size=self.vocab_size, max_ngram=self.max_ngram, vote=self.vote,
                    meta=self.meta)
        with open(path, "wb") as f:
            np.savez_compressed(f, tokens=flat.astype(dtype), info=np.frombuffer(json.dumps(info).encode(), np.uint8))
        return path

    @classmethod
    def load(cls, path: Union[str, Path], *, max_ngram: Optional[int] = None, vote: Optional[int] = None
             ) -> "TokenStore":
        """Read a store :meth:`save` wrote (``max_ngram`` / ``vote`` override the saved settings)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"TokenStore: no store file at {path}")
        try:
            with np.load(path, allow_pickle=False) as z:
                flat = z["tokens"]
                info = json.loads(bytes(z["info"]).decode())
        except (KeyError, ValueError, OSError) as e:
            raise ValueError(f"TokenStore: {path} is not a token store ({e})") from None
        if info.get("format") != _FORMAT:
            raise ValueError(f"TokenStore: {path} has format {info.get('format')!r}; this version reads {_FORMAT}")
        return cls._from_flat(flat, info["vocab_size"], max_ngram or info["max_ngram"], vote or info["vote"],
                              info.get("meta", {}))
