"""Synthetic EAGLE-2 style draft candidates and trees for the build/merge benchmarks."""

from __future__ import annotations

import torch


def eagle_candidates(batch: int, depth: int, top_k: int, vocab: int, seed: int = 0):
    """Candidates of an EAGLE-2 expansion: each of `depth` levels expands the top_k best frontier nodes
    by top_k children; scores are cumulative log-probs (non-increasing along a path).

    Returns scores [B, M] float32, tokens [B, M] int64, parents [B, M] int64 with M = top_k + (depth-1)*top_k^2.
    """
    g = torch.Generator().manual_seed(seed)
    scores, tokens, parents = [], [], []
    # level 1: top_k children of the root
    logp = torch.log_softmax(torch.randn(batch, top_k, generator=g) * 2, -1)
    scores.append(logp)
    tokens.append(torch.randint(0, vocab, (batch, top_k), generator=g))
    parents.append(torch.full((batch, top_k), -1, dtype=torch.int64))
    frontier_score, frontier_idx, offset = logp, torch.arange(top_k).expand(batch, -1), top_k
    for _ in range(depth - 1):
        child_logp = torch.log_softmax(torch.randn(batch, top_k, top_k, generator=g) * 2, -1)
        cum = frontier_score.unsqueeze(-1) + child_logp  # [B, top_k, top_k]
        scores.append(cum.reshape(batch, -1))
        tokens.append(torch.randint(0, vocab, (batch, top_k * top_k), generator=g))
        parents.append(frontier_idx.unsqueeze(-1).expand(-1, -1, top_k).reshape(batch, -1))
        best = torch.topk(cum.reshape(batch, -1), top_k, dim=-1)
        frontier_score, frontier_idx = best.values, best.indices + offset
        offset += top_k * top_k
    return torch.cat(scores, 1).float(), torch.cat(tokens, 1), torch.cat(parents, 1).long()
