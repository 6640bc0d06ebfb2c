"""EAGLE-2 tree expansion shared by every drafter.

From the current root (whose next-token logits the drafter already holds), a tree is grown level by
level: the root's top_k children are the first frontier; at every further level the drafter runs once
on the K frontier nodes (one batched forward over scratch cache entries, each node attending to the
committed prefix and its own ancestors), every frontier node proposes its top_k children, and the best
top_k of those K * K children by cumulative log-prob become the next frontier. All children ever
proposed are candidates; ``taps_ops.build_tree`` then keeps the best ``budget - 1`` of them.

Shapes: B requests, K = top_k, M = K + (depth - 1) * K * K candidates.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .drafters import DraftCandidates

__all__ = ["expand", "num_candidates", "scratch_positions"]


def num_candidates(depth: int, top_k: int) -> int:
    """M, the candidates an expansion of `depth` levels with `top_k` children per node proposes."""
    return top_k + (depth - 1) * top_k * top_k


def scratch_positions(depth: int, top_k: int) -> int:
    """Cache entries past the committed ones that an expansion writes: (depth - 1) * top_k."""
    return max(depth - 1, 0) * top_k


def _top_logp(logits: Tensor, k: int, with_entropy: bool):
    """Top-k log-probs and ids over the last dim of `logits` (float32), and the entropy (nats) of the
    softmax when asked (else None), without materialising the full log_softmax."""
    logits = logits.float()
    lse = logits.logsumexp(-1, keepdim=True)
    values, ids = logits.topk(k, dim=-1)
    entropy = None
    if with_entropy:
        p = torch.softmax(logits, -1)
        finite = torch.where(torch.isfinite(logits), logits, torch.zeros_like(logits))
        entropy = lse.squeeze(-1) - (p * finite).sum(-1)
    return values - lse, ids, entropy


def _section(profiler, name):
    return profiler.section(name) if profiler is not None else contextlib.nullcontext()


@torch.no_grad()
def expand(drafter, depth: int, top_k: int, profiler=None, with_entropy: bool = True) -> DraftCandidates:
    """Grow EAGLE-2 candidates after each request's root.

    Args:
        drafter: a :class:`taps.drafters.Drafter` after ``start`` / ``advance`` (it holds
            ``root_logits [B, V]`` and ``lengths [B]``).
        depth: levels of the tree below the root (>= 1).
        top_k: children per expanded node and frontier width (clamped to V).
        profiler: optional :class:`taps.stats.Profiler`; the drafter forwards go to "draft_forward".
        with_entropy: compute the mean entropy (entropy routing); zeros otherwise.

    Returns:
        DraftCandidates(scores [B, M] float32 cumulative log-probs, tokens [B, M], parents [B, M]
        (-1 = child of the root, else the index of an earlier candidate), entropy [B]).
    """
    root_logits = drafter.root_logits
    batch, vocab = root_logits.shape
    device = root_logits.device
    k = min(int(top_k), vocab)
    front_score, front_tok, entropy_sum = _top_logp(root_logits, k, with_entropy)  # [B, K]
    entropy_count = 1
    scores, tokens = [front_score], [front_tok]
    parents = [torch.full((batch, k), -1, dtype=torch.int64, device=device)]
    front_cand = torch.arange(k, device=device).expand(batch, k)      # candidate index of each frontier node
    parent_slot = torch.full((batch, k), -1, dtype=torch.int64, device=device)
    offset = k
    if depth > 1:
        lengths = drafter.lengths
        committed_max = int(lengths.max())
        eye = torch.eye(k, dtype=torch.bool, device=device).expand(batch, k, k)
        ancestors = eye                                                # [B, K, level * K] over scratch slots
        slot_range = torch.arange(k, device=device)
    for level in range(1, depth):
        if level > 1:
            ancestors = torch.cat([ancestors.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, ancestors.shape[-1])),
                                   eye], dim=-1)
        used = level * k
        span = committed_max + used
        write_pos = lengths.unsqueeze(1) + (level - 1) * k + slot_range           # [B, K]
        rope_pos = (lengths + (level - 1)).unsqueeze(1).expand(batch, k)           # root at lengths - 1
        mask = (torch.arange(span, device=device) < lengths.unsqueeze(1)).unsqueeze(1).repeat(1, k, 1)
        scratch_idx = (lengths.unsqueeze(1) + torch.arange(used, device=device)).unsqueeze(1).expand(batch, k, used)
        mask.scatter_(2, scratch_idx, ancestors)
        with _section(profiler, "draft_forward"):
            logits = drafter.forward_nodes(front_tok, parent_slot, write_pos, rope_pos, mask.unsqueeze(1), level)
        child_logp, child_tok, entropy = _top_logp(logits, k, with_entropy)       # [B, K, K]
        if with_entropy:
            entropy_sum = entropy_sum + entropy.sum(1)
        entropy_count += k
        cum = (front_score.unsqueeze(-1) + child_logp).reshape(batch, k * k)
        child_tok = child_tok.reshape(batch, k * k)
        scores.append(cum)
        tokens.append(child_tok)
        parents.append(front_cand.unsqueeze(-1).expand(batch, k, k).reshape(batch, k * k))
        if level + 1 < depth:  # the next frontier (the last level's children are leaves)
            front_score, idx = cum.topk(k, dim=-1)
            parent_slot = idx // k
            front_tok = child_tok.gather(1, idx)
            front_cand = offset + idx
        offset += k * k
    return DraftCandidates(torch.cat(scores, 1).contiguous(), torch.cat(tokens, 1).contiguous(),
                           torch.cat(parents, 1).contiguous(),
                           entropy_sum / entropy_count if with_entropy else torch.zeros(batch, device=device))
