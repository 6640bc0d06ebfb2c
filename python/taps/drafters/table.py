"""An n-gram table of the target's own next-token distributions, and the drafter that drafts from it.

:class:`NgramTable` holds, for every context of up to ``max_order`` tokens seen in a corpus, the target's
next-token distribution averaged over the corpus positions that end in that context (its ``entries`` most
likely tokens). The corpus is the target's own answers to many prompts, and the distributions are the
target's probabilities at each of their positions (``taps train table``): so the table is a model of the
target's *distribution*, not of a text.

:class:`NgramTableDrafter` proposes from it: after each node of a draft, the distribution of the longest
context the table holds (at least ``min_count`` corpus positions; the order-0 average when none). It runs
no model: a draft is a few binary searches a level. Under greedy verification its trees are the top-k
trees of every drafter; where some request samples, the decoder may *draw* its trees
(``SpeculativeDecoder(sampled_drafts=)``) and verify them by recursive rejection sampling, where a draw is
accepted with probability 1 - TV(target, table) at its node: at temperature 1 the target's distributions
are wide (its most likely token holds ~0.3 of the mass on the shipped models), so a deterministic guess is
accepted with about that, a draw from a close distribution with more. Verification is unchanged, so
decoding stays lossless whatever the table holds (a wrong or even another model's table costs acceptance,
never correctness).

Contexts are keyed by one 64-bit number: the order, then the tokens, as digits in base V + 1 (exact when
(V + 1) ** (max_order + 1) < 2 ** 64: V <= 65534 at order 3, V <= 7130 at order 4; past that the same arithmetic wraps, a hash
whose rare collisions only cost acceptance).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn

import taps_ops

from ..expansion import DraftCandidates, DraftSampler, SampledDraft
from .base import DraftGroup, Drafter, HostLengths, SoloMixin, target_vocab_size

#: taps_ops.ngram_table_draw's op, called by the table group without the wrapper's Python checks
_DRAW_OP = torch.ops.taps_ops.ngram_table_draw.default

__all__ = ["NgramTable", "NgramTableDrafter"]

#: the logit of a token a context's entries do not hold: q gives it ~1e-12 of the entries' mass (a draw from
#: it stays possible, and lossless, but rare)
FLOOR_LOGIT = taps_ops.NGRAM_FLOOR_LOGIT
#: the key of no context (a position with fewer tokens before it than the order)
_NO_KEY = np.uint64(np.iinfo(np.uint64).max)


def _ranges(lo: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """lo[0] .. lo[0] + sizes[0] - 1, then lo[1] .. : the flat indices of ranges (int64)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    before = np.cumsum(sizes) - sizes
    return np.repeat(np.asarray(lo, dtype=np.int64) - before, sizes) + np.arange(total, dtype=np.int64)


def context_keys(tokens: np.ndarray, order: int, vocab: int) -> np.ndarray:
    """uint64 keys of the `order`-token contexts ending at each position of the 1-D int array `tokens`
    (position j: tokens j - order + 1 .. j; the first order - 1 positions, which have no such context, get
    keys too, which callers drop)."""
    base = np.uint64(vocab + 1)
    t = tokens.astype(np.uint64) + np.uint64(1)
    key = np.full(len(tokens), order, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(order - 1, -1, -1):  # the oldest token first
            shifted = np.zeros_like(t)
            shifted[i:] = t[:len(t) - i]
            key = key * base + shifted
    return key


class NgramTable:
    """Next-token distributions per context of 0 .. ``max_order`` tokens (see the module docstring).

    Build one with :meth:`from_distributions` (or ``taps train table``), or :meth:`load` a saved one.

    Args (of the constructor; the arrays as :meth:`save` writes them):
        keys: [K] uint64 sorted context keys; counts: [K] int64 corpus positions each context averaged;
        starts: [K + 1] int64 each context's first entry; ids: [E] int64 token ids; logp: [E] float32 log of
            the averaged probabilities (a context's entries most likely first); vocab_size; max_order.
    """

    def __init__(self, keys, counts, starts, ids, logp, vocab_size: int, max_order: int,
                 meta: Optional[dict] = None):
        self.keys = np.ascontiguousarray(keys, dtype=np.uint64)
        self.counts = np.ascontiguousarray(counts, dtype=np.int64)
        self.starts = np.ascontiguousarray(starts, dtype=np.int64)
        self.ids = np.ascontiguousarray(ids, dtype=np.int64)
        self.logp = np.ascontiguousarray(logp, dtype=np.float32)
        self.vocab_size, self.max_order = int(vocab_size), int(max_order)
        self.meta = dict(meta or {})
        k = len(self.keys)
        if self.max_order < 0:
            raise ValueError(f"NgramTable: max_order must be >= 0, got {max_order}")
        if self.vocab_size < 1:
            raise ValueError(f"NgramTable: vocab_size must be >= 1, got {vocab_size}")
        if len(self.counts) != k or len(self.starts) != k + 1 or len(self.ids) != len(self.logp):
            raise ValueError("NgramTable: keys, counts, starts (one more) and ids / logp must agree in length")
        if k == 0 or self.starts[0] != 0 or self.starts[-1] != len(self.ids) or np.any(np.diff(self.starts) < 1):
            raise ValueError("NgramTable: every context needs at least one entry, starts from 0 to len(ids)")
        if np.any(self.keys[1:] <= self.keys[:-1]):
            raise ValueError("NgramTable: keys must be sorted and distinct")
        if len(self.ids) and (self.ids.min() < 0 or self.ids.max() >= self.vocab_size):
            raise ValueError(f"NgramTable: token ids must be in [0, {self.vocab_size})")
        if not np.all(np.isfinite(self.logp)):
            raise ValueError("NgramTable: log-probabilities must be finite")
        # the op's view of the arrays (keys as int64 bits)
        self._t = (torch.from_numpy(self.keys.view(np.int64)), torch.from_numpy(self.counts),
                   torch.from_numpy(self.starts), torch.from_numpy(self.ids), torch.from_numpy(self.logp))
        zero = np.searchsorted(self.keys, np.uint64(0))
        if zero >= k or self.keys[zero] != 0:
            raise ValueError("NgramTable: the order-0 context (key 0, the corpus average) is missing")
        self._zero = int(zero)

    @property
    def num_contexts(self) -> int:
        return len(self.keys)

    # -- building ----------------------------------------------------------------------------------
    @classmethod
    def from_distributions(cls, sequences: Iterable[Tuple[Sequence[int], np.ndarray, np.ndarray, int]],
                           vocab_size: int, max_order: int = 4, entries: int = 8, min_count: int = 2,
                           meta: Optional[dict] = None) -> "NgramTable":
        """The table of `sequences`: each (tokens [T], ids [T - 1, E'] int, probs [T - 1, E'] float, first)
        where row j of ids / probs is the target's distribution of token j + 1 after tokens 0 .. j (its E'
        most likely tokens: a truncation the average keeps), and rows j >= first count (e.g. the answer's
        positions after a prompt: first = prompt length - 1). Contexts of order >= 1 averaged over fewer than
        `min_count` positions are left out (order 0 always stays); each keeps its `entries` most likely
        tokens."""
        if max_order < 0 or entries < 1 or min_count < 1:
            raise ValueError("NgramTable.from_distributions: need max_order >= 0, entries >= 1, min_count >= 1")
        per_order: List[List[np.ndarray]] = [[] for _ in range(max_order + 1)]
        all_ids, all_probs = [], []
        for tokens, ids, probs, first in sequences:
            tokens = np.asarray(tokens, dtype=np.int64)
            ids, probs = np.asarray(ids), np.asarray(probs, dtype=np.float64)
            if ids.shape != probs.shape or ids.ndim != 2 or ids.shape[0] != len(tokens) - 1:
                raise ValueError("NgramTable.from_distributions: ids and probs must be [len(tokens) - 1, E']")
            rows = np.arange(max(int(first), 0), len(tokens) - 1)
            if not len(rows):
                continue
            for order in range(max_order + 1):
                keys = context_keys(tokens[:-1], order, vocab_size)[rows]
                per_order[order].append(np.where(rows >= order - 1, keys, _NO_KEY))
            all_ids.append(ids[rows])
            all_probs.append(probs[rows])
        if not all_ids:
            raise ValueError("NgramTable.from_distributions: no positions")
        ids = np.concatenate(all_ids)
        probs = np.concatenate(all_probs)
        width = ids.shape[1]
        out_keys, out_counts, out_ids, out_logp, out_sizes = [], [], [], [], []
        for order in range(max_order + 1):
            keys = np.concatenate(per_order[order])
            valid = keys != _NO_KEY
            uniq, inverse, counts = np.unique(keys[valid], return_inverse=True, return_counts=True)
            keep = counts >= (1 if order == 0 else min_count)
            # sum each context's probabilities per token: (context, token) pairs, sorted
            ctx = np.repeat(inverse, width)
            tok = ids[valid].reshape(-1)
            pr = probs[valid].reshape(-1)
            sel = keep[ctx]
            ctx, tok, pr = ctx[sel], tok[sel], pr[sel]
            pair = ctx.astype(np.int64) * vocab_size + tok
            upair, pinv = np.unique(pair, return_inverse=True)
            sums = np.bincount(pinv, weights=pr)
            pctx, ptok = upair // vocab_size, upair % vocab_size
            avg = sums / counts[pctx]
            order_idx = np.lexsort((-avg, pctx))            # by context, most likely first
            pctx, ptok, avg = pctx[order_idx], ptok[order_idx], avg[order_idx]
            first = np.r_[0, np.flatnonzero(np.diff(pctx)) + 1]
            rank = np.arange(len(pctx)) - np.repeat(first, np.diff(np.r_[first, len(pctx)]))
            top = rank < entries
            pctx, ptok, avg = pctx[top], ptok[top], avg[top]
            kept_ctx = np.flatnonzero(keep)
            out_keys.append(uniq[kept_ctx])
            out_counts.append(counts[kept_ctx])
            out_sizes.append(np.bincount(np.searchsorted(kept_ctx, pctx), minlength=len(kept_ctx)))
            out_ids.append(ptok)
            out_logp.append(np.log(avg))
        keys = np.concatenate(out_keys)
        order_idx = np.argsort(keys, kind="stable")
        # past the exact range a key is a hash: of two contexts of different orders with one key, the lower
        # order's stays
        order_idx = order_idx[np.r_[True, keys[order_idx][1:] != keys[order_idx][:-1]]]
        sizes = np.concatenate(out_sizes)
        starts_in = np.cumsum(sizes) - sizes
        flat_ids, flat_logp = np.concatenate(out_ids), np.concatenate(out_logp)
        pick = _ranges(starts_in[order_idx], sizes[order_idx])
        sizes = sizes[order_idx]
        meta = dict(meta or {})
        meta.setdefault("entries", int(entries))
        meta.setdefault("min_count", int(min_count))
        return cls(keys[order_idx], np.concatenate(out_counts)[order_idx], np.r_[0, np.cumsum(sizes)],
                   flat_ids[pick], flat_logp[pick].astype(np.float32), vocab_size, max_order, meta)

    # -- files --------------------------------------------------------------------------------------
    def save(self, path: Union[str, Path]) -> None:
        """Write the table as one compressed .npz (ids as uint16 where the vocabulary fits, else int32;
        log-probabilities as float16)."""
        small = self.vocab_size <= np.iinfo(np.uint16).max + 1
        np.savez_compressed(path, keys=self.keys, counts=self.counts, sizes=np.diff(self.starts).astype(np.int32),
                            ids=self.ids.astype(np.uint16 if small else np.int32),
                            logp=self.logp.astype(np.float16),
                            header=np.frombuffer(json.dumps({"format": "taps-ngram-table", "version": 1,
                                                             "vocab_size": self.vocab_size,
                                                             "max_order": self.max_order,
                                                             "meta": self.meta}).encode(), dtype=np.uint8))

    @classmethod
    def load(cls, path: Union[str, Path]) -> "NgramTable":
        """A table :meth:`save` wrote (ValueError for any other file, FileNotFoundError when there is none)."""
        if not Path(path).is_file():
            raise FileNotFoundError(f"NgramTable.load: no table file {path} (build one with `taps train table`)")
        try:
            with np.load(path, allow_pickle=False) as f:
                header = json.loads(bytes(f["header"]).decode())
                if header.get("format") != "taps-ngram-table":
                    raise ValueError("not an n-gram table")
                ids = f["ids"].astype(np.int64)
                sizes = f["sizes"].astype(np.int64)
                return cls(f["keys"], f["counts"], np.r_[0, np.cumsum(sizes)], ids,
                           f["logp"].astype(np.float32), header["vocab_size"], header["max_order"], header.get("meta"))
        except (KeyError, ValueError, json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError) as e:
            raise ValueError(f"NgramTable.load: {path} is not an n-gram table ({e})") from None

    # -- lookup ---------------------------------------------------------------------------------------
    def context_rows(self, contexts: np.ndarray, min_count: int = 1) -> np.ndarray:
        """For each row of `contexts` [R, max_order] (the last tokens before the predicted one, oldest first;
        -1 where the context is shorter), the index of the longest context the table holds with at least
        `min_count` positions (order 0 when none)."""
        contexts = np.asarray(contexts, dtype=np.int64)
        rows, width = contexts.shape
        best = np.full(rows, self._zero, dtype=np.int64)
        base = np.uint64(self.vocab_size + 1)
        key = np.zeros(rows, dtype=np.uint64)
        valid = np.ones(rows, dtype=bool)
        # order n: the last n tokens; its key is n * base^n + sum(...): built from the newest token back
        power = np.uint64(1)
        with np.errstate(over="ignore"):
            for n in range(1, min(self.max_order, width) + 1):
                t = contexts[:, width - n]
                valid &= t >= 0
                key = key + (t.astype(np.uint64) + np.uint64(1)) * power
                power = power * base
                full = key + np.uint64(n) * power
                pos = np.searchsorted(self.keys, full)
                hit = valid & (pos < len(self.keys))
                hit[hit] &= self.keys[pos[hit]] == full[hit]
                hit[hit] &= self.counts[pos[hit]] >= min_count
                best = np.where(hit, pos, best)
        return best

    def logits(self, contexts: Union[np.ndarray, Tensor], min_count: int = 1) -> Tensor:
        """[R, V] float32 logits of q for each context row (see :meth:`context_rows`): log of the averaged
        probabilities at the context's entries, ``FLOOR_LOGIT`` elsewhere (``taps_ops.ngram_table_logits``)."""
        ctx = torch.as_tensor(contexts, dtype=torch.int64)
        return taps_ops.ngram_table_logits(*self._t, ctx, self.vocab_size, self.max_order, min_count, FLOOR_LOGIT)

    def reference_logits(self, contexts: np.ndarray, min_count: int = 1) -> Tensor:
        """:meth:`logits` in NumPy (the reference the op is tested against)."""
        idx = self.context_rows(contexts, min_count)
        rows = len(idx)
        out = torch.full((rows, self.vocab_size), FLOOR_LOGIT, dtype=torch.float32)
        lo = self.starts[idx]
        sizes = self.starts[idx + 1] - lo
        flat = _ranges(lo, sizes)
        row = np.repeat(np.arange(rows), sizes)
        out[torch.from_numpy(row), torch.from_numpy(self.ids[flat])] = torch.from_numpy(self.logp[flat])
        return out


class NgramTableDrafter(SoloMixin, Drafter):
    """Drafts from an :class:`NgramTable` of the target's own distributions (see the module docstring).

    Args:
        table: the table (:meth:`NgramTable.load` of a file `taps train table` wrote, or
            :meth:`NgramTable.from_distributions`).
        min_count: the fewest corpus positions a context needs to be used (a shorter context otherwise).
    """

    def __init__(self, table: NgramTable, min_count: int = 1):
        super().__init__()
        if not isinstance(table, NgramTable):
            raise TypeError(f"NgramTableDrafter: table must be an NgramTable, got {type(table).__name__}")
        if int(min_count) < 1:
            raise ValueError(f"NgramTableDrafter: min_count must be >= 1, got {min_count}")
        self.table, self.min_count = table, int(min_count)
        self._vocab = 0
        self._device = torch.device("cpu")

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def bind(self, target: nn.Module) -> None:
        vocab = target_vocab_size(target)
        if self.table.vocab_size != vocab:
            raise ValueError(f"NgramTableDrafter: the table's vocabulary ({self.table.vocab_size}) is not the "
                             f"target's ({vocab}): it was built for another model")
        self._vocab = vocab
        self._device = next(target.parameters()).device

    def clone(self) -> "NgramTableDrafter":
        twin = NgramTableDrafter(self.table, self.min_count)
        twin._vocab, twin._device = self._vocab, self._device
        return twin

    @classmethod
    def make_group(cls, drafters: Sequence["NgramTableDrafter"]) -> DraftGroup:
        if len(drafters) != 1:
            raise ValueError("NgramTableDrafter: drafters run one at a time")
        return TableGroup(drafters[0])


class TableGroup(HostLengths, DraftGroup):
    """An :class:`NgramTableDrafter`'s state: each request's last ``max_order`` tokens (host). Its "forward"
    over a frontier is the table's lookup of each node's context (the parent's, shifted, with the node)."""

    _row_state = ()
    #: (an append sets each request's tail: a few list operations)
    kept_current = True
    #: (ngram_table_draw at temperature 0: the modes' chain, ~15 us against ~0.5 ms for the top-k expansion)
    draws_greedy = True

    def __init__(self, drafter: NgramTableDrafter):
        super().__init__([drafter])
        self.d = drafter
        self.order = max(drafter.table.max_order, 1)
        self.tail: List[List[int]] = []       # per request: its last `order` tokens, oldest first
        self._root: Optional[Tensor] = None   # root_logits, made when first read after an append
        self._front: Optional[np.ndarray] = None  # [R, F, order] the last frontier's contexts
        #: the drawn drafts' probs, one buffer rewritten each draft (a draft's probs are read before the next)
        self._probs: Optional[Tensor] = None
        #: the tails as an int64 array [B, order] (a tensor shares it), kept with each append; None: made at the next
        #: read (after a start, join or drop)
        self._ctx: Optional[np.ndarray] = None
        self._ctx_t: Optional[Tensor] = None

    @property
    def root_logits(self) -> Optional[Tensor]:
        if self._root is None and self.tail:
            self._root = self.d.table.logits(self._contexts(), self.d.min_count).to(self.d._device)
        return self._root

    @root_logits.setter
    def root_logits(self, value) -> None:
        self._root = value

    def _set(self, b: int, new: Sequence[int]) -> None:
        tail = (self.tail[b] + [int(t) for t in new])[-self.order:]
        self.tail[b] = [-1] * (self.order - len(tail)) + tail
        if self._ctx is not None:
            self._ctx[b] = self.tail[b]

    def _contexts(self) -> Tensor:
        """The tails as an int64 CPU tensor [B, order] (what ngram_table_draw, the root's logits and the first level
        of the expansion read)."""
        if self._ctx is None or len(self._ctx) != len(self.tail):
            self._ctx = np.asarray(self.tail, dtype=np.int64).reshape(len(self.tail), self.order)
            self._ctx_t = torch.from_numpy(self._ctx)
        return self._ctx_t

    def start(self, input_ids, prompt_lens, root, hidden, max_len, prompt_lens_host=None):
        ids, roots = input_ids.tolist(), root.tolist()
        lens = prompt_lens_host if prompt_lens_host is not None else prompt_lens.tolist()
        self.tail, self._ctx = [[] for _ in ids], None
        for b, (row, n, r) in enumerate(zip(ids, lens, roots)):
            self._set(b, row[max(0, int(n) - self.order):int(n)] + [r])
        self.host_lengths = [int(n) + 1 for n in lens]
        self.lengths_b = torch.tensor(self.host_lengths, dtype=torch.int64, device=self.d._device)
        self._root = None

    def advance(self, tokens, num_new, hidden, num_new_host=None, tokens_host=None):
        rows = tokens_host if tokens_host is not None else tokens.tolist()
        counts = num_new_host if num_new_host is not None else num_new.tolist()
        for b, (row, n) in enumerate(zip(rows, counts)):
            n = int(n)
            if n:
                self._set(b, row[:n])
                self.host_lengths[b] += n
        self._lengths_changed()
        self._root = None

    def forward_nodes(self, tokens, parent_slot, write_start, rope_pos, mask, level):
        rows, k = tokens.shape
        toks = tokens.cpu().numpy()
        if level == 1 or self._front is None:
            parent = np.broadcast_to(self._contexts().numpy()[:, None, :], (rows, k, self.order))
        else:
            slots = parent_slot.cpu().numpy()
            parent = np.take_along_axis(self._front, slots[:, :, None], axis=1)
        ctx = np.concatenate([parent[:, :, 1:], toks[:, :, None]], axis=2)
        self._front = ctx
        logits = self.d.table.logits(ctx.reshape(rows * k, self.order), self.d.min_count)
        return logits.view(rows, k, -1).to(tokens.device)

    def draft_sampled(self, depth: int, width: int, sampler: DraftSampler, profiler=None) -> SampledDraft:
        """Sampled chains drawn straight from the table (``taps_ops.ngram_table_draw``: every level of every
        chain in one host call): `width` draws at each request's root, each continued by one draw a level, q at
        a node = softmax(log q_table / T) over its context's entries. The sampler's temperature applies; its
        top-k / top-p do not (q may be any distribution its draws come from: verification stays lossless). On the
        CPU the probs are a buffer the group rewrites at its next draft."""
        batch = len(self.tail)
        k = max(1, int(width))
        count = k * int(depth)
        gens = sampler.generators
        if gens is None or len(gens) == 1:  # (one request's own generator: the same draws as its row of the stack)
            gen = sampler.generator if gens is None else gens[0]
            uniforms = torch.rand((batch, count), generator=gen, device=None if gen is None else gen.device).cpu()
        else:
            uniforms = torch.stack([torch.rand(count, generator=g, device=g.device).cpu() for g in gens])
        # (a number's tensor made once per value and batch)
        temp = taps_ops._per_request(sampler.temperature, batch, torch.float32, torch.device("cpu"), "temperature")
        table = self.d.table
        shape = (batch, 1 + count, table.vocab_size)
        if self._probs is None or self._probs.shape != shape:
            self._probs = torch.empty(shape)
        # the op itself (its checks in C++: the wrapper's Python ones cost ~15 us a draft on arrays made here)
        tokens, parents, scores, probs = _DRAW_OP(
            *table._t, self._contexts(), uniforms, temp, k, int(depth), table.vocab_size, table.max_order,
            self.d.min_count, self._probs)
        device = self.d._device
        if device.type == "cpu":
            return SampledDraft(DraftCandidates(scores, tokens, parents, scores.new_zeros(batch)), probs)
        return SampledDraft(DraftCandidates(scores.to(device), tokens.to(device), parents.to(device),
                                            torch.zeros(batch, device=device)), probs.to(device))

    def release(self) -> None:
        super().release()
        self.tail, self._front, self._root, self._probs, self._ctx = [], None, None, None, None

    def _select_state(self, keep, index, rows):
        super()._select_state(keep, index, rows)
        self.tail = [self.tail[b] for b in keep]
        self._root = self._ctx = None

    def _join_state(self, other):
        super()._join_state(other)
        self.tail = self.tail + other.tail
        self._root = self._ctx = None
