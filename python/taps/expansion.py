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
from typing import Dict, NamedTuple, Tuple

import torch
from torch import Tensor

import taps_ops
from taps.kv import NodeMask, pack_bits

__all__ = ["DraftCandidates", "expand", "num_candidates", "scratch_positions"]


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
    root_logits = unit.root_logits
    rows, vocab = root_logits.shape
    device = root_logits.device
    token_map = unit.token_map
    k = min(int(top_k), vocab)
    # The root level: its top k children are the first frontier (taps_ops.expand_level: top-k by
    # log-softmax, cumulative scores, tokens through the draft vocabulary, parents, next frontier).
    lv = taps_ops.expand_level(root_logits.unsqueeze(1), torch.zeros(rows, 1, device=device),
                               torch.full((rows, 1), -1, dtype=torch.int64, device=device), k,
                               k if depth > 1 else 0, 0, token_map, with_entropy=with_entropy)
    entropy_sum, entropy_count = lv.entropy, 1
    scores, tokens, parents = [lv.scores], [lv.tokens], [lv.parents]
    parent_slot = torch.full((rows, k), -1, dtype=torch.int64, device=device)
    offset = k
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
    for level in range(1, depth):
        if level > 1:
            parent_slot = lv.next_slots
            if node_masks:
                bits = bits[row, parent_slot] | own[level - 1]
            else:
                mask = torch.cat([prefix, mask[row, parent_slot, start:], eye], dim=-1)
        if node_masks:
            level_mask = NodeMask(bits, torch.full((rows,), start + level * k, dtype=torch.int64, device=device),
                                  level * k)
        else:
            level_mask = mask.unsqueeze(1)
        with _section(profiler, "draft_forward"):
            logits = unit.forward_nodes(lv.next_tokens, parent_slot, start + (level - 1) * k,
                                        rope_root + (level - 1), level_mask, level)
        lv = taps_ops.expand_level(logits, lv.next_scores, lv.next_cands, k, k if level + 1 < depth else 0,
                                   offset, token_map, with_entropy=with_entropy)
        if with_entropy:
            entropy_sum = entropy_sum + lv.entropy
        entropy_count += k
        scores.append(lv.scores)
        tokens.append(lv.tokens)
        parents.append(lv.parents)
        offset += k * k
    return DraftCandidates(torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1),
                           entropy_sum / entropy_count if with_entropy else entropy_sum)  # (zeros without)
