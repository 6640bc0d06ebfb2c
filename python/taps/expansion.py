"""EAGLE-2 tree expansion shared by every drafter.

From the current root (whose next-token logits the drafter already holds), a tree is grown level by
level: the root's top_k children are the first frontier; at every further level the drafter runs once
on the K frontier nodes (one batched forward over scratch cache entries, each node attending to the
committed prefix and its own ancestors), every frontier node proposes its top_k children, and the best
top_k of those K * K children by cumulative log-prob become the next frontier. All children ever
proposed are candidates; ``taps_ops.build_tree`` then keeps the best ``budget - 1`` of them. Each level's
bookkeeping (top-k by log-softmax, cumulative scores, draft-to-target tokens, parents, the entropy and
the next frontier) is one ``taps_ops.expand_level`` call.

The expansion runs on a *drafting unit*: one drafter, or G drafters of one shape batched together (a
drafter group, :mod:`taps.drafters`), whose rows are then group-major (row g * B + b is request b of
drafter g). A unit provides ``root_logits [R, V']``, ``lengths [R]`` (committed entries per row, the root
last), ``scratch_start`` (a host int >= every length: where the expansion writes its scratch entries, the
same column for every row), ``token_map`` (None, or [V'] target ids of a reduced draft vocabulary) and
``forward_nodes(tokens, parent_slot, write_start, rope_pos, mask, level) -> logits [R, K, V']``, whose
mask is a bool tensor [R, 1, K, start + level * K] (True = visible) or, for units whose ``node_masks`` is
true (every row's prefix ends at ``scratch_start``), a :class:`taps.kv.NodeMask` (the frontier's
ancestor bits over the level * K scratch entries; taps_ops.tree_attention's form).

Shapes: R rows, K = top_k, M = K + (depth - 1) * K * K candidates.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

import taps_ops
from .kv import NodeMask, pack_bits

__all__ = ["DraftCandidates", "DraftSampler", "SampledDraft", "expand", "expand_sampled", "num_candidates",
           "scratch_positions", "target_probs"]


class DraftCandidates(NamedTuple):
    """EAGLE-2 candidates of one drafter ([B, M] unless noted), the input of ``taps_ops.build_tree``.

    scores: float32 cumulative draft log-prob; tokens: int64 target token ids; parents: int64 (-1 = child
    of the root, else an earlier candidate); entropy: [B] mean entropy (nats) of the distributions the
    expansion read (zeros when not asked for).
    """

    scores: Tensor
    tokens: Tensor
    parents: Tensor
    entropy: Tensor


def num_candidates(depth: int, top_k: int) -> int:
    """M, the candidates an expansion of `depth` levels with `top_k` children per node proposes."""
    return top_k + (depth - 1) * top_k * top_k


def scratch_positions(depth: int, top_k: int) -> int:
    """Cache entries past the committed ones that an expansion writes: (depth - 1) * top_k."""
    return max(depth - 1, 0) * top_k


_OWN_BITS: Dict[Tuple[int, int, torch.device], Tensor] = {}


def _own_bits(depth: int, k: int, device: torch.device) -> Tensor:
    """[depth - 1, K, W] int64: row i of level l (0-based) holds bit l * K + i, node i of expansion level
    l + 1 among the scratch entries (W = ceil((depth - 1) * K / 64) words); cached."""
    key = (depth, k, torch.device(device))
    own = _OWN_BITS.get(key)
    if own is None:
        nodes = (depth - 1) * k
        own = pack_bits(torch.eye(nodes, dtype=torch.bool)).view(depth - 1, k, -1).to(device)
        _OWN_BITS[key] = own
    return own


def _section(profiler, name):
    return profiler.section(name) if profiler is not None else contextlib.nullcontext()


@torch.no_grad()
def expand(unit, depth: int, top_k: int, profiler=None, with_entropy: bool = True) -> DraftCandidates:
    """Grow EAGLE-2 candidates after each row's root.

    Args:
        unit: a drafting unit (see the module docstring): a :class:`taps.drafters.Drafter` after
            ``start`` / ``advance``, or a drafter group.
        depth: levels of the tree below the root (>= 1).
        top_k: children per expanded node and frontier width (clamped to the draft vocabulary).
        profiler: optional :class:`taps.stats.Profiler`; the drafter forwards go to "draft_forward".
        with_entropy: compute the mean entropy (entropy routing); zeros otherwise.

    Returns:
        DraftCandidates(scores [R, M] float32 cumulative log-probs, tokens [R, M] target ids, parents
        [R, M] (-1 = child of the root, else the index of an earlier candidate), entropy [R]).
    """
    k = min(int(top_k), unit.root_logits.shape[1])
    token_map = unit.token_map
    entropy = []

    # Every level (the root's first) is one taps_ops.expand_level call: top-k by log-softmax, cumulative
    # scores, tokens through the draft vocabulary, parents, the next frontier (the best k children).
    def level(logits, front_scores, front_cands, offset, last):
        lv = taps_ops.expand_level(logits, front_scores, front_cands, k, 0 if last else k, offset, token_map,
                                   with_entropy=with_entropy)
        entropy.append((lv.entropy, logits.shape[1]))
        return lv

    scores, tokens, parents = _grow(unit, depth, k, level, profiler)
    if with_entropy:
        mean = sum(e for e, _ in entropy) / sum(n for _, n in entropy)
    else:
        mean = entropy[0][0]  # (zeros)
    return DraftCandidates(scores, tokens, parents, mean)


def _grow(unit, depth: int, k: int, level, profiler=None) -> Tuple[Tensor, Tensor, Tensor]:
    """The expansion's frontier loop, whatever picks the children: ``level(logits [R, F, V'], front_scores
    [R, F], front_cands [R, F], offset, last) -> ExpandLevel`` (F = 1 at the root, then k; C children in all,
    candidates offset .. offset + C - 1; the next frontier of k nodes unless `last`). Between levels the
    drafter runs once on the frontier (scratch entries, each node attending to the committed prefix and its
    own ancestors). Returns the candidates' scores, tokens and parents [R, M]."""
    root_logits = unit.root_logits
    rows = root_logits.shape[0]
    device = root_logits.device
    lv = level(root_logits.unsqueeze(1), torch.zeros(rows, 1, device=device),
               torch.full((rows, 1), -1, dtype=torch.int64, device=device), 0, depth == 1)
    scores, tokens, parents = [lv.scores], [lv.tokens], [lv.parents]
    parent_slot = torch.full((rows, k), -1, dtype=torch.int64, device=device)
    offset = lv.scores.shape[1]
    node_masks = depth > 1 and bool(getattr(unit, "node_masks", False))
    if depth > 1:
        lengths = unit.lengths
        start = int(unit.scratch_start)
        row = torch.arange(rows, device=device).unsqueeze(1)
        rope_root = lengths.unsqueeze(1).expand(rows, k)                # level l nodes: lengths + l - 1
    if node_masks:
        # Every row's prefix ends at `start` (no gap): each level's mask is the frontier's ancestor bits
        # over the scratch entries drafted so far (taps.kv.NodeMask, for taps_ops.tree_attention), the
        # parent's bits plus the node's own.
        own = _own_bits(depth, k, device)                              # [depth - 1, K, W]
        bits = own[0].expand(rows, k, own.shape[-1])
    elif depth > 1:
        # Keys: the committed prefix (columns < lengths[r]; columns lengths[r] .. start-1 hide other rows'
        # longer prefixes), then the scratch entries of levels 1 .. level (K columns each, from `start`).
        # A level's mask [R, K, start + level * K]: the prefix, then each node's ancestors among the scratch
        # entries (its parent's row of the previous level's mask) and itself.
        prefix = (torch.arange(start, device=device) < lengths.unsqueeze(1)).unsqueeze(1).expand(rows, k, start)
        eye = torch.eye(k, dtype=torch.bool, device=device).expand(rows, k, k)
        mask = torch.cat([prefix, eye], dim=-1)
    for depth_level in range(1, depth):
        if depth_level > 1:
            parent_slot = lv.next_slots
            if node_masks:
                bits = bits[row, parent_slot] | own[depth_level - 1]
            else:
                mask = torch.cat([prefix, mask[row, parent_slot, start:], eye], dim=-1)
        if node_masks:
            level_mask = NodeMask(bits, torch.full((rows,), start + depth_level * k, dtype=torch.int64, device=device),
                                  depth_level * k)
        else:
            level_mask = mask.unsqueeze(1)
        with _section(profiler, "draft_forward"):
            logits = unit.forward_nodes(lv.next_tokens, parent_slot, start + (depth_level - 1) * k,
                                        rope_root + (depth_level - 1), level_mask, depth_level)
        lv = level(logits, lv.next_scores, lv.next_cands, offset, depth_level + 1 == depth)
        scores.append(lv.scores)
        tokens.append(lv.tokens)
        parents.append(lv.parents)
        offset += lv.scores.shape[1]
    return torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1)


class DraftSampler:
    """How a sampled expansion (:func:`expand_sampled`) draws children: from q = softmax(logits / T) of the
    drafter, truncated as the target's sampling truncates (top-k, then top-p), each child an independent
    draw.

    Args:
        temperature: a Python float or a [R] tensor (>= 0), one per row; a row at 0 (a greedy request of a
            batch whose others sample) has q all on its argmax (ties to the lowest id), the greedy limit.
        top_k, top_p: as ``taps_ops.verify_tree`` takes them (scalars or [R] tensors; 0 / 1 = off).
        generator: the random source of every row (None: torch's default one).
        generators: one generator per row instead (a request's own: its draws do not depend on its
            neighbours').
    """

    def __init__(self, temperature, top_k=0, top_p=1.0, generator: Optional[torch.Generator] = None,
                 generators: Optional[Sequence[torch.Generator]] = None):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator, self.generators = generator, generators

    @staticmethod
    def _per_row(value, rows: int, device, dtype) -> Tensor:
        t = torch.as_tensor(value, device=device, dtype=dtype)
        return t.reshape(1).expand(rows) if t.dim() == 0 else t

    def dist(self, logits: Tensor) -> Tensor:
        """q [R, F, V'] float32 from the drafter's logits [R, F, V']."""
        rows, device = logits.shape[0], logits.device
        temp = self._per_row(self.temperature, rows, device, torch.float32).view(rows, 1, 1)
        greedy = None
        if (bool((temp == 0).any()) if isinstance(self.temperature, Tensor) else self.temperature == 0):
            greedy = temp == 0
            temp = torch.where(greedy, torch.ones_like(temp), temp)
        scaled = logits.float() / temp
        top_k = self._per_row(self.top_k, rows, device, torch.int64)
        top_p = self._per_row(self.top_p, rows, device, torch.float32)
        vocab = scaled.shape[-1]
        if bool(((top_k > 0) & (top_k < vocab)).any()):
            kth = scaled.topk(int(top_k.clamp(0, vocab).max()), dim=-1).values             # [R, F, kmax]
            idx = (top_k.clamp(1, vocab) - 1).view(rows, 1, 1).expand(rows, scaled.shape[1], 1)
            cut = kth.gather(-1, idx.clamp_max(kth.shape[-1] - 1))
            cut = torch.where((top_k > 0).view(rows, 1, 1), cut, torch.full_like(cut, float("-inf")))
            scaled = scaled.masked_fill(scaled < cut, float("-inf"))
        q = torch.softmax(scaled, dim=-1)
        if bool((top_p < 1).any()):
            sorted_q, order = q.sort(dim=-1, descending=True)
            before = sorted_q.cumsum(-1) - sorted_q                     # the mass of the more likely tokens
            drop = before >= top_p.view(rows, 1, 1)
            q = q.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
            q = q / q.sum(-1, keepdim=True)
        if greedy is not None:
            mode = torch.zeros_like(q).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
            q = torch.where(greedy, mode, q)
        return q

    def draw(self, q: Tensor, count: int) -> Tensor:
        """[R, F, count] independent draws (with replacement) from each row of q [R, F, V'], by inverse CDF:
        the first token whose cumulative mass exceeds a uniform times the row's total (a positive increment: a
        token of zero mass is never drawn). One cumulative sum a row; ``torch.multinomial`` draws a single sample
        by the exponential trick, a random number and a logarithm per token: 192 against 27 us at V' = 8192
        (bench/RESULTS.md)."""
        rows, front, vocab = q.shape
        cdf = q.reshape(rows * front, vocab).float().cumsum(-1)
        if self.generators is None:
            u = torch.rand((rows, front * count), generator=self.generator, device=q.device)
        else:
            u = torch.stack([torch.rand(front * count, generator=g, device=q.device) for g in self.generators])
        # u < 1, so u * total < total (a product of floats rounds to the total only from a half ulp below it,
        # which (1 - 2^-24) * total never is): the first cumulative mass above it is a token of positive mass
        u = u.view(rows * front, count) * cdf[:, -1:]
        return torch.searchsorted(cdf, u, right=True).view(rows, front, count)


class SampledDraft(NamedTuple):
    """A sampled expansion's candidates and the distributions their children were drawn from.

    candidates: :class:`DraftCandidates` [R, M] (M = width * depth), level by level, each level's in the
    order drawn; probs: [R, 1 + M, V'] float32, row 0 the root's q, row 1 + m the q candidate m's children were
    drawn from (zeros for the last level's candidates, which have none); V' is the draft vocabulary."""

    candidates: DraftCandidates
    probs: Tensor


@torch.no_grad()
def expand_sampled(unit, depth: int, width: int, sampler: DraftSampler, profiler=None,
                   groups: int = 1) -> SampledDraft:
    """Sampled chains after each request's root: `width` independent draws from the root's q, then under each
    of them one draw per level from q at that node, to `depth` levels (M = width * depth candidates). Every
    draw is kept, in the order drawn (duplicates included), and how many children a node gets never depends
    on what they are: so each node's children are independent draws from its row of ``probs``, which is what
    ``taps_ops.verify_tree``'s recursive rejection sampling (``draft_probs``) needs to be lossless. Scores are
    the cumulative draft log-probs (for statistics; a tree of these candidates keeps them all, in this
    order: :func:`taps.strategies.sampled_tree`).

    ``groups`` = G > 1: the unit is G drafters over B requests (rows group-major, one draft vocabulary) and q
    is the mean of their distributions at the node: each level's draws are fed to all G (every drafter
    runs on the same chains), and the result is per request ([B, M], probs [B, 1 + M, V'])."""
    rows, vocab = unit.root_logits.shape
    batch = rows // groups
    k = max(1, min(int(width), vocab))
    token_map = unit.token_map
    probs: List[Tensor] = []

    def level(logits, front_scores, front_cands, offset, last):
        front = logits.shape[1]
        # the mixture of the G drafters' distributions (the sampler's per-request settings on each)
        q = sum(sampler.dist(logits[g * batch:(g + 1) * batch]) for g in range(groups)) / groups
        probs.append(q)
        count = k if front == 1 else 1                                  # the root: k draws; then chains
        draws = sampler.draw(q, count)                                  # [B, F, c] draft ids
        front_scores, front_cands = front_scores[:batch], front_cands[:batch]
        n = front * count
        scores = (front_scores.unsqueeze(2) + q.gather(2, draws).log()).reshape(batch, n)
        ids = draws.reshape(batch, n)
        tokens = ids if token_map is None else token_map[ids]
        parents = front_cands.unsqueeze(2).expand(batch, front, count).reshape(batch, n)
        slots = torch.arange(n, device=logits.device).expand(batch, n) // count
        cands = offset + torch.arange(n, device=logits.device).expand(batch, n)
        every = (lambda t: t) if groups == 1 else (lambda t: torch.cat([t] * groups))  # noqa: E731
        zeros = scores.new_zeros(rows)
        scores, tokens, parents = every(scores), every(tokens), every(parents)
        if last:
            empty = tokens[:, :0]
            return taps_ops.ExpandLevel(scores, tokens, parents, zeros, scores[:, :0], empty, empty, empty)
        return taps_ops.ExpandLevel(scores, tokens, parents, zeros, scores, tokens, every(slots), every(cands))

    scores, tokens, parents = _grow(unit, depth, k, level, profiler)
    probs.append(probs[-1].new_zeros((batch, k, vocab)))                # the leaves draw nothing
    first = slice(0, batch)
    return SampledDraft(DraftCandidates(scores[first], tokens[first], parents[first], scores.new_zeros(batch)),
                        torch.cat(probs, 1))


def target_probs(probs: Tensor, token_map: Optional[Tensor], vocab: int) -> Tensor:
    """Draft-vocabulary rows [..., V'] as target-vocabulary rows [..., vocab] (zeros off the draft
    vocabulary); as they are without a token_map."""
    if token_map is None:
        return probs
    out = probs.new_zeros((*probs.shape[:-1], vocab))
    out[..., token_map] = probs
    return out
