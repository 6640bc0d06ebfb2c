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
tokens a drafted step against 5.2 for the vote; bench/RESULTS.md).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["TokenStore"]

#: the most tokens a continuation holds (the sequences are padded with this many separators)
MAX_DEPTH = 64
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
        """From the separated form :meth:`save` writes (-1 between sequences)."""
        flat = np.asarray(flat, dtype=np.int64).reshape(-1)
        bounds = np.flatnonzero(flat < 0)
        seqs = [flat[a + 1:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a + 1]
        if len(bounds) == 0:
            seqs = [flat] if flat.size else []
        else:
            if bounds[0] > 0:
                seqs.insert(0, flat[:bounds[0]])
            if bounds[-1] + 1 < flat.size:
                seqs.append(flat[bounds[-1] + 1:])
        return cls(seqs, vocab_size, max_ngram=max_ngram, vote=vote, meta=meta)

    def _build(self, tokens: np.ndarray) -> None:
        self.tokens = tokens  # -1 before, between and after the sequences (then MAX_DEPTH more)
        self._tokens_list: Optional[List[int]] = None
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
        # the range of each last token (the first narrowing, a dict lookup instead of two binary searches)
        first: Dict[int, Tuple[int, int]] = {}
        if real.size:
            vals, starts, counts = np.unique(self.cols[0], return_index=True, return_counts=True)
            first = {int(v): (int(s), int(s + c)) for v, s, c in zip(vals, starts, counts)}
        self._first = first
        if self.max_ngram >= 2 and real.size:
            ok = self.cols[1] >= 0
            self._pairs = set((self.cols[0][ok].astype(np.int64) * self.vocab_size + self.cols[1][ok]).tolist())
        else:
            self._pairs = set()
        self._memo: Dict[Tuple[int, int, int], List[int]] = {}

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"TokenStore({self.num_sequences} sequences, {self.num_tokens} tokens, vocab {self.vocab_size}, "
                f"max_ngram {self.max_ngram}, vote {self.vote})")

    def has_pair(self, before: int, last: int) -> bool:
        """Whether the two tokens `before`, `last` occur in this order in the store (a set lookup)."""
        return last * self.vocab_size + before in self._pairs

    def match(self, context: Sequence[int]) -> Tuple[int, int, int]:
        """The longest suffix of `context` (up to ``max_ngram`` tokens) found in the store: (its length, the
        range lo, hi of the matching positions in the index); length 0 when the last token is absent."""
        n = len(context)
        if n == 0:
            return 0, 0, 0
        rng = self._first.get(int(context[-1]))
        if rng is None:
            return 0, 0, 0
        lo, hi = rng
        got = 1
        cols = self.cols
        top = min(self.max_ngram, n)
        for j in range(1, top):
            t = int(context[-1 - j])
            if hi - lo <= 16:
                # a few positions left: the rest compared on the host (two binary searches a token cost more)
                rest = cols[j:top, lo:hi].T.tolist()
                want = [int(context[-1 - i]) for i in range(j, top)]
                for i, w in enumerate(want):
                    keep = [r for r in range(hi - lo) if rest[r][i] == w]
                    if not keep:
                        return got, lo, hi
                    # rows are sorted, so the rows that agree so far are contiguous
                    lo, hi = lo + keep[0], lo + keep[-1] + 1
                    rest = rest[keep[0]:keep[-1] + 1]
                    got = j + i + 1
                return got, lo, hi
            col, key = cols[j, lo:hi], np.int32(t)
            # (a scalar of the column's dtype: with a Python int numpy converts the whole column, 20x slower)
            a = int(col.searchsorted(key, "left"))
            b = int(col.searchsorted(key, "right"))
            if a == b:
                break
            lo, hi = lo + a, lo + b
            got = j + 1
        return got, lo, hi

    def continuation(self, context: Sequence[int], depth: int, min_ngram: int = 2) -> Tuple[List[int], int]:
        """The voted continuation (up to `depth` tokens, <= MAX_DEPTH) after the longest suffix of `context`
        found in the store, and that suffix's length; ([], n) when it is shorter than `min_ngram`."""
        depth = min(int(depth), MAX_DEPTH)
        n, lo, hi = self.match(context)
        if n < min_ngram or depth < 1:
            return [], n
        key = (lo, hi, depth)
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) >= 1 << 16:
                self._memo.clear()
            got = self._memo[key] = self._vote(self.ends[lo:min(hi, lo + self.vote)] + 1, depth)
        return got, n

    def _vote(self, starts: np.ndarray, depth: int) -> List[int]:
        rows = self.tokens[starts[:, None] + np.arange(depth)]
        distinct = Counter(map(tuple, rows.tolist()))
        out: List[int] = []
        cands = list(distinct.items())  # (row, how many positions continue with it)
        for d in range(depth):
            if len(cands) == 1:
                row = cands[0][0]
                for t in row[d:]:
                    if t < 0:
                        break
                    out.append(t)
                break
            votes: Dict[int, int] = {}
            for row, c in cands:
                votes[row[d]] = votes.get(row[d], 0) + c
            t = max(votes, key=votes.get)
            if t < 0:
                break
            out.append(t)
            cands = [(row, c) for row, c in cands if row[d] == t]
        return out

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
