"""Prompt-lookup drafting: proposals copied from earlier in the context, no model.

:class:`PromptLookupDrafter` proposes, after each root, what followed the most recent earlier
occurrences of the context's last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``): the
drafter-free speculative decoding known as prompt lookup, which pays off wherever answers repeat their
prompt or themselves (quoting, code edits, extraction, arithmetic chains). It costs no forward pass, so it
combines cheaply with trained drafters: in ``merged`` / ``merged-budget`` / ``adaptive`` its tree joins
theirs, and a request takes whichever proposals the target accepts.

The proposals of one request form a small trie: the continuations of up to ``top_k`` most recent
matches (longest n-gram first), each up to ``depth`` tokens (the drafter's own, 16 by default, under
greedy verification; the decoder's when it samples; a continuation that runs into the context's end, a
loop, repeated up to that length), merged on common prefixes. Scores are
pseudo log-probs: ``log(match_confidence)`` per token, minus a penalty for later (older) matches, so that
``build_tree`` and ``merge_trees`` keep the most recent match's tokens first. Verification is unchanged,
so decoding stays lossless whatever is proposed.
"""

from __future__ import annotations

import math
from array import array
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..expansion import DraftCandidates, num_candidates
from .base import DraftGroup, Drafter, HostLengths, target_vocab_size
from .store import TokenStore

__all__ = ["PromptLookupDrafter", "LookupGroup"]


class PromptLookupDrafter(Drafter):
    """Drafts by matching the context's last n tokens earlier in the context (prompt lookup).

    Args:
        max_ngram, min_ngram: the n-gram lengths tried, longest first (1 <= min_ngram <= max_ngram; default
            min_ngram: 2, or max_ngram when that is 1). A context whose last two tokens occurred nowhere
            before has no draft (a plain step): a single repeated token predicts little (the continuation
            of a 1-gram match was accepted 1.5 tokens on average against 5.8 for a 3-gram one at T=0), and
            on the shipped models leaving those matches out took prompt lookup from 1.52x to 1.72x its
            autoregressive decoding under emulated AVX2 and from 1.72x to 1.96x at AVX-512 (T=0;
            bench/RESULTS.md).
        confidence: the pseudo probability of each proposed token (sets the scores other drafters'
            proposals are ranked against in merged trees and confidence routing).
        depth: tokens per proposed continuation under greedy verification (None: the decoder's depth).
            A lookup runs no forward, so a longer chain costs only the target's extra tree nodes (the node
            budget still caps them, and the decoder's candidate slots, ``num_candidates(depth, top_k)``);
            16 measured best on the shipped models (bench/RESULTS.md). When the decoder samples, chains
            keep the decoder's depth: a long deterministic chain rarely survives sampling, and in merged
            trees its nodes take budget from the other drafters.
        runner_up: when the lookup's tree is verified on its own (it is the step's only drafter): each
            continuation's pseudo probability relative to the one ranked above it, in (0, 1]; its nodes
            score ``log(runner_up)`` lower per rank, and the node budget keeps the best-scored nodes, so
            a small value keeps the first continuation deep before the next ones are added (0.05 against
            ``confidence`` 0.6: six levels of the first weigh as much as one rank). Merged with or ranked
            against other drafters' candidates, the continuations are always taken level by level (as
            with 1): on the shipped models the first-deep order took 8% more steps in merged-budget trees
            and 6% fewer alone (bench/RESULTS.md).
        repeat: a match whose continuation runs into the context's end (the text since the match repeats a
            span of it: a loop) is continued as that span repeated, up to the chain's length, instead of
            stopping at the end: the next tokens of a loop of period p are its last p tokens again.
            Without it a loop shorter than the chain drafts one period a step.
        store: a :class:`~taps.drafters.store.TokenStore` (e.g. the target's own outputs on many prompts,
            :func:`taps.models.load_store`): after each root, the continuation voted from the store's
            occurrences of the context's longest suffix (up to the store's ``max_ngram`` tokens, at least
            ``store_ngram``) is proposed beside the context's matches, ranked before those of a shorter
            n-gram. A context with no match of its own then often still has a draft: on the shipped models
            a store of the target's outputs on 2,000 training prompts took the drafted tokens a step from 2.3
            to 5.2 (bench/RESULTS.md).
        store_ngram: the shortest suffix matched in the store that proposes (default: the store's ``max_ngram``,
            8: only a match as long as the store indexes; a shorter one is weak evidence in millions of tokens:
            on the shipped models full-length matches accepted 7.6 tokens a draft, shorter ones 3.5; 8 against
            4, in three in-process runs: fixed 1.85 / 1.94 / 1.93x against 1.81 / 1.90 / 1.93x taps
            autoregressive, merged-budget with a tuner 1.57 / 1.61 / 1.72x against 1.41 / 1.62 / 1.15x;
            4 had measured 4.6% faster than 2; bench/RESULTS.md).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: Optional[int] = None, confidence: float = 0.6,
                 depth: Optional[int] = 16, runner_up: float = 0.05, repeat: bool = True,
                 store: Optional[TokenStore] = None, store_ngram: Optional[int] = None):
        super().__init__()
        if min_ngram is None:
            min_ngram = min(2, int(max_ngram))
        if not 1 <= int(min_ngram) <= int(max_ngram):
            raise ValueError(f"PromptLookupDrafter: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not 0.0 < confidence < 1.0:
            raise ValueError(f"PromptLookupDrafter: confidence must be in (0, 1), got {confidence}")
        if depth is not None and int(depth) < 1:
            raise ValueError(f"PromptLookupDrafter: depth must be >= 1 (or None), got {depth}")
        if not 0.0 < runner_up <= 1.0:
            raise ValueError(f"PromptLookupDrafter: runner_up must be in (0, 1], got {runner_up}")
        self.max_ngram, self.min_ngram, self.confidence = int(max_ngram), int(min_ngram), float(confidence)
        self.depth = None if depth is None else int(depth)
        self.runner_up = float(runner_up)
        self.repeat = bool(repeat)
        if store is not None and not isinstance(store, TokenStore):
            raise TypeError(f"PromptLookupDrafter: store must be a TokenStore, got {type(store).__name__}")
        self.store = store
        self.store_ngram = (store.max_ngram if store is not None else 8) if store_ngram is None else int(store_ngram)
        if self.store_ngram < 1:
            raise ValueError(f"PromptLookupDrafter: store_ngram must be >= 1, got {store_ngram}")
        self._vocab = 0
        self._device = torch.device("cpu")
        self._group: Optional[LookupGroup] = None

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def bind(self, target: nn.Module) -> None:
        vocab = target_vocab_size(target)
        if self.store is not None and self.store.vocab_size > vocab:
            raise ValueError(f"PromptLookupDrafter: the store's vocabulary ({self.store.vocab_size}) is larger than "
                             f"the target's ({vocab}): it was built for another model")
        self._vocab = vocab
        self._device = next(target.parameters()).device

    def clone(self) -> "PromptLookupDrafter":
        twin = PromptLookupDrafter(self.max_ngram, self.min_ngram, self.confidence, self.depth, self.runner_up,
                                   self.repeat, self.store, self.store_ngram)
        twin._vocab, twin._device = self._vocab, self._device
        return twin

    @classmethod
    def make_group(cls, drafters: Sequence["PromptLookupDrafter"]) -> DraftGroup:
        if len(drafters) != 1:
            raise ValueError("PromptLookupDrafter: drafters run one at a time")
        return LookupGroup(drafters[0])

    # the single-drafter interface, through a group of one
    def start(self, input_ids, prompt_lens, root, hidden, max_len):
        self._group = LookupGroup(self)
        self._group.start(input_ids, prompt_lens, root, hidden, max_len)

    def advance(self, tokens, num_new, hidden):
        self._group.advance(tokens, num_new, hidden)

    def draft(self, depth: int, top_k: int, profiler=None, with_entropy: bool = True) -> DraftCandidates:
        if self._group is None:
            raise RuntimeError("PromptLookupDrafter: call start() first")
        return self._group.draft(depth, top_k, profiler, with_entropy)

    @property
    def lengths(self) -> Tensor:
        if self._group is None:
            raise RuntimeError("PromptLookupDrafter: call start() first")
        return self._group.lengths_b

    def release(self) -> None:
        super().release()
        self._group = None


class LookupGroup(HostLengths, DraftGroup):
    """The prompt-lookup drafter's state: each request's tokens and an index of their n-grams (host)."""

    free_draft = True
    kept_current = True

    def __init__(self, drafter: PromptLookupDrafter):
        super().__init__([drafter])
        self.d = drafter
        self.history: List[List[int]] = []
        #: per request: n-gram -> end positions, oldest first, for the ends up to ``indexed[b]`` (brought up to
        #: date when a draft searches it, :meth:`continuations`: a step that drafts nothing indexes nothing)
        self.index: List[Dict[Tuple[int, ...], List[int]]] = []
        self.indexed: List[int] = []
        #: per request: the shortest n-grams tried (``min_ngram`` tokens) that end anywhere in its context
        self.seen: List[set] = []
        #: per request: whether its context's last n-gram (of a length tried) occurred before (has_draft)
        self.matched: List[bool] = []

    # Every step, plain ones included, appends each request's new tokens and says whether its last n-gram
    # occurred before (the decoder asks whether the group has a draft on every plain step of a tuner's):
    # that is whether its last `min_ngram` tokens did (a longer n-gram's occurrence ends with them), one set
    # lookup a token. The index that finds the occurrences is brought up to date only when a draft reads it.
    # (On the shipped models the full index kept at every append cost 6 us a step, and the Python work
    # between two target forwards slowed the forward by about as much again.)
    def _add(self, b: int, new: Sequence[int]) -> None:
        """Append host ints `new` to request b's context (see above: a set operation a token)."""
        hist, seen, n = self.history[b], self.seen[b], self.d.min_ngram
        matched = False
        for t in new:
            hist.append(t)
            if len(hist) >= n:
                key = tuple(hist[-n:]) if n != 2 else (hist[-2], t)
                matched = key in seen
                if not matched:
                    seen.add(key)
        if new:
            self.matched[b] = matched or self._in_store(hist)

    def _in_store(self, hist: List[int]) -> bool:
        """Whether the store (if any) holds the context's last ``store_ngram`` tokens: its continuation is then a
        draft (for 2, one set lookup; else one search)."""
        store, n = self.d.store, self.d.store_ngram
        if store is None or len(hist) < n:
            return False
        if n == 2:
            return store.has_pair(hist[-2], hist[-1])
        return store.match(hist[-n:])[0] >= n

    def _index(self, b: int, tokens: List[int]) -> None:
        """Request b's whole context at once (its history empty): what :meth:`_add` of `tokens` makes (the
        shortest n-grams of a joining prompt made by ``zip``, a server's every joining prompt)."""
        hist, seen, n = self.history[b], self.seen[b], self.d.min_ngram
        hist.extend(tokens)
        if len(hist) < n:
            return
        keys = list(zip(*(hist[i:] for i in range(n))))
        seen.update(keys[:-1])
        self.matched[b] = keys[-1] in seen or self._in_store(hist)
        seen.add(keys[-1])

    def _catch_up(self, b: int) -> Dict[Tuple[int, ...], List[int]]:
        """Request b's index with every n-gram that ends in its context (those since the last search added,
        each length's keys made by ``zip``)."""
        hist, index, done = self.history[b], self.index[b], self.indexed[b]
        end = len(hist)
        if done == end:
            return index
        for n in range(self.d.min_ngram, self.d.max_ngram + 1):
            first = max(done + 1, n)  # the first end position not indexed yet for this length
            # (keys of one length in end order: each key's ends stay oldest first)
            for pos, key in enumerate(zip(*(hist[first - n + i:] for i in range(n))), first):
                ends = index.get(key)
                if ends is None:
                    index[key] = [pos]
                else:
                    ends.append(pos)
        self.indexed[b] = end
        return index

    def start(self, input_ids, prompt_lens, root, hidden, max_len, prompt_lens_host=None):
        ids, lens, roots = input_ids.tolist(), prompt_lens.tolist(), root.tolist()
        self.history = [[] for _ in ids]
        self.index = [{} for _ in ids]
        self.indexed = [0] * len(ids)
        self.seen = [set() for _ in ids]
        self.matched = [False] * len(ids)
        for b, (row, n, r) in enumerate(zip(ids, lens, roots)):
            self._index(b, row[:n] + [r])
        self.host_lengths = [len(h) for h in self.history]
        self.lengths_b = torch.tensor(self.host_lengths, dtype=torch.int64, device=input_ids.device)

    def advance(self, tokens, num_new, hidden, num_new_host=None, tokens_host=None):
        rows = tokens_host if tokens_host is not None else tokens.tolist()
        counts = num_new_host if num_new_host is not None else num_new.tolist()
        lengths = self.host_lengths
        for b, (row, n) in enumerate(zip(rows, counts)):
            if n:
                self._add(b, row if len(row) == n else row[:int(n)])
                lengths[b] = len(self.history[b])
        self._lengths_changed()

    def continuations(self, b: int, depth: int, top_k: int) -> List[List[int]]:
        """Up to top_k continuations of up to `depth` tokens after request b's context, most recent
        match of the longest n-gram first."""
        hist, index = self.history[b], self._catch_up(b)
        repeat = self.d.repeat
        out: List[List[int]] = []
        store = self.d.store
        # the store's continuation goes before the context's matches of a shorter n-gram
        stored, stored_n = store.continuation(hist, depth, self.d.store_ngram) if store is not None else ([], 0)
        end = len(hist)
        for n in range(self.d.max_ngram, self.d.min_ngram - 1, -1):
            if end < n:
                continue
            if stored and n < stored_n and stored not in out:
                out.append(stored)
                if len(out) >= top_k:
                    return out
            for pos in reversed(index.get(tuple(hist[end - n:]), ())):
                if pos >= end:  # the context's own last n-gram
                    continue
                cont = hist[pos:pos + depth]
                if repeat and pos + depth > end:  # (pos < end here)
                    # the span since the match runs to the end: a loop of period end - pos, continued as the
                    # span again (what the match predicts once the span has been emitted)
                    cont = (cont * (depth // len(cont) + 1))[:depth]
                if cont and cont not in out:
                    out.append(cont)
                if len(out) >= top_k:
                    return out
        if stored and stored not in out:
            out.append(stored)
        return out

    def has_draft(self, b: int) -> bool:
        """Whether request b's last n-gram (of any length tried) occurred before in its context, or its last
        ``store_ngram`` tokens occur in the store: whether :meth:`continuations` finds anything (kept by each
        append, so asking costs nothing; with a store an append costs one search, 5-10 us)."""
        return self.matched[b]

    def draft(self, depth: int, top_k: int, profiler=None, with_entropy: bool = True) -> DraftCandidates:
        batch = len(self.history)
        k = min(int(top_k), max(self.d.vocab_size, 1))
        m = num_candidates(depth, k)
        step = math.log(self.d.confidence)
        # alone: the runner-up's weight per rank; merged: level by level, the better rank first at a level
        rank_step = math.log(self.d.runner_up) if self.alone else -0.01
        chain = depth if self.sampling or self.d.depth is None else self.d.depth
        # rows built on the host as flat arrays, one tensor each at the end over their buffers (a tensor
        # write per node costs microseconds each, more than the search; torch.tensor of a list about 9 us,
        # a tensor over an array's buffer under 3)
        no_score, no_node = array("f", [float("-inf")]) * m, array("q", [-1]) * m  # a row's padding
        scores, nodes = array("f"), array("q")  # nodes: every row's tokens, then every row's parents
        parents = array("q")
        for b in range(batch):
            trie: Dict[Tuple[int, int], int] = {}  # (parent candidate, token) -> candidate
            s_row, t_row, p_row = [], [], []
            for rank, cont in enumerate(self.continuations(b, chain, k)):
                parent = -1
                for i, t in enumerate(cont):
                    node = trie.get((parent, t))
                    if node is None:
                        if len(t_row) >= m:
                            break
                        node = trie[(parent, t)] = len(t_row)
                        t_row.append(t)
                        p_row.append(parent)
                        s_row.append(step * (i + 1) + rank_step * rank)
                    parent = node
            used = len(t_row)
            scores.fromlist(s_row)
            scores.extend(no_score[used:])
            nodes.fromlist(t_row)
            nodes.extend(no_node[used:])
            parents.fromlist(p_row)
            parents.extend(no_node[used:])
        nodes.extend(parents)
        device = self._lengths_device
        both = torch.frombuffer(nodes, dtype=torch.int64).view(2, batch, m).to(device)
        return DraftCandidates(torch.frombuffer(scores, dtype=torch.float32).view(batch, m).to(device),
                               both[0], both[1], torch.zeros(batch, device=device))

    def tree_depth(self, depth: int, top_k: int) -> int:
        chain = depth if self.sampling or self.d.depth is None else self.d.depth
        return min(chain, num_candidates(depth, min(int(top_k), max(self.d.vocab_size, 1))))

    def forward_nodes(self, *args, **kwargs):
        raise NotImplementedError("PromptLookupDrafter runs no model")

    def release(self) -> None:
        super().release()
        self.history, self.index, self.indexed, self.seen, self.matched = [], [], [], [], []

    def _select_state(self, keep, index, rows):
        super()._select_state(keep, index, rows)
        self.history = [self.history[b] for b in keep]
        self.index = [self.index[b] for b in keep]
        self.indexed = [self.indexed[b] for b in keep]
        self.seen = [self.seen[b] for b in keep]
        self.matched = [self.matched[b] for b in keep]

    def _join_state(self, other):
        super()._join_state(other)
        self.history = self.history + other.history
        self.index = self.index + other.index
        self.indexed = self.indexed + other.indexed
        self.seen = self.seen + other.seen
        self.matched = self.matched + other.matched
