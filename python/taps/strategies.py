"""How several drafters' proposals become the one tree the target verifies.

Every strategy turns the EAGLE-2 candidates of the drafters that draft this step into a batch of trees
(``taps_ops`` tree format, [B, N]) plus a per-node ``source`` bitmask (bit t: drafter t proposed it).
Routing and budgeting use only the drafts and past acceptance, never the current target logits.

Names (:data:`STRATEGIES`):

- ``single``: one drafter's tree of ``budget`` nodes.
- ``average``: the weight-space mean of drafters of one shape (built by the decoder with
  :func:`taps.drafters.average_drafters`), then ``single``.
- ``route-confidence`` / ``route-entropy``: every drafter builds its tree; per request the tree with the
  highest mean node confidence (mean exp(cumulative log-prob) over its draft nodes), or the lowest mean
  entropy of the drafter distributions read while expanding it, is verified.
- ``route-confidence-prompt`` / ``route-entropy-prompt``: the same signal routes per step for the first
  ``route_steps`` steps of a request and is summed; then the request keeps the best drafter for good,
  and drafters no request uses stop drafting.
- ``merged``: the trie union of the full trees (``taps_ops.merge_trees``, up to T * (budget - 1) + 1 nodes).
- ``merged-budget``: that union cut to ``budget`` nodes by score.
- ``adaptive``: the ``budget - 1`` draft nodes split between drafters in proportion to their running
  accepted tokens on this request (plus a prior; at least one node each): each drafter's best nodes of
  its share are reserved (:func:`reserve_nodes`), the union is cut to ``budget`` nodes keeping the
  reserved ones first, and the room their overlap leaves is filled with the best other nodes by score.
- ``autoregressive``: no drafter; the tree is the root alone (the baseline through the same loop).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

import torch
from torch import Tensor

import taps_ops

from .drafters import DraftCandidates

__all__ = ["STRATEGIES", "Combined", "Strategy", "make_strategy", "tree_confidence", "allocate_budget",
           "reserve_nodes"]

STRATEGIES = ("single", "average", "route-confidence", "route-entropy", "route-confidence-prompt",
              "route-entropy-prompt", "merged", "merged-budget", "adaptive", "autoregressive")


class Combined(NamedTuple):
    """The tree to verify ([B, N]): tokens, parents, depth, tree_mask [B, N, W], source (bitmask of
    drafters per node, 0 for the root and padding), choice ([B] routed drafter, or None)."""

    tokens: Tensor
    parents: Tensor
    depth: Tensor
    tree_mask: Tensor
    source: Tensor
    choice: Optional[Tensor]


def tree_confidence(tree) -> Tensor:
    """[B] mean exp(cumulative log-prob) over each tree's draft nodes (root and padding excluded)."""
    real = tree.tokens >= 0
    real[:, 0] = False
    conf = torch.where(real, tree.scores.exp(), torch.zeros_like(tree.scores)).sum(1)
    return conf / real.sum(1).clamp_min(1)


def _build(cand: DraftCandidates, num_nodes: int, root: Tensor):
    return taps_ops.build_tree(cand.scores, cand.tokens, cand.parents, num_nodes, root_tokens=root)


def _single_source(tree, t: int) -> Tensor:
    real = tree.tokens >= 0
    real[:, 0] = False
    return real.long() << t


def allocate_budget(weights: Tensor, nodes: int) -> Tensor:
    """Split `nodes` draft nodes per request in proportion to weights [B, T] (>= 0), at least one node
    per drafter when nodes >= T; largest remainders get the leftovers. Returns [B, T] int64 summing to
    `nodes`."""
    batch, num = weights.shape
    base = 1 if nodes >= num else 0
    free = nodes - base * num
    share = weights.double() / weights.double().sum(1, keepdim=True).clamp_min(1e-30)
    exact = share * free
    alloc = exact.floor().long()
    left = free - alloc.sum(1, keepdim=True)                            # [B, 1] in [0, T)
    order = (exact - alloc).argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(num, device=weights.device).expand(batch, num))
    return alloc + (rank < left).long() + base


#: added to the scores of reserved nodes; cumulative log-probs of real drafts stay far above -RESERVE
RESERVE = 1000.0


def reserve_nodes(scores: Tensor, tokens: Tensor, alloc: Tensor) -> Tensor:
    """Scores [B, T, N] of T trees with each tree's root and best ``alloc[b, t]`` draft nodes (by score,
    ties: lower index first) raised by :data:`RESERVE`, so that ``merge_trees`` cut to a budget keeps
    every reserved node first and fills what the overlap of the reserved sets leaves free with the best
    of the rest. Scores never increase along a path, so a reserved set is closed under ancestors."""
    real = tokens >= 0
    key = torch.where(real, scores, torch.full_like(scores, float("-inf")))
    key[..., 0] = float("inf")  # the root first
    order = key.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    n = order.shape[-1]
    rank.scatter_(-1, order, torch.arange(n, device=order.device).expand_as(order))
    keep = (rank <= alloc.unsqueeze(-1)) & real
    return scores + keep.to(scores.dtype) * RESERVE


class Strategy:
    """Base class: `combine` the drafters' candidates each step, `observe` what was accepted.

    Args:
        name: one of :data:`STRATEGIES`.
        num_drafters: T.
        budget: N, the node budget of one drafter's tree (root included).
    """

    def __init__(self, name: str, num_drafters: int, budget: int, route_steps: int = 3,
                 prior: float = 1.0):
        self.name = name
        self.num_drafters = num_drafters
        self.budget = budget
        self.route_steps = route_steps
        self.prior = prior
        self._alive: List[int] = list(range(num_drafters))

    def reset(self, batch: int, device: torch.device) -> None:
        """Start a new batch of requests."""
        self._alive = list(range(self.num_drafters))
        self.accepted = torch.zeros((batch, self.num_drafters), dtype=torch.float64, device=device)
        self.signal_sum = torch.zeros((batch, self.num_drafters), dtype=torch.float64, device=device)
        self.steps = 0
        self.fixed: Optional[Tensor] = None

    def alive(self) -> List[int]:
        """Drafters that draft (and must be kept up to date) from now on; the list only shrinks."""
        return list(self._alive)

    @property
    def num_nodes(self) -> int:
        """N of the verified tree."""
        if self.name == "autoregressive":
            return 1
        if self.name == "merged":
            return self.num_drafters * (self.budget - 1) + 1
        return self.budget

    # ---------------------------------------------------------------------------------------------
    def combine(self, cands: Dict[int, DraftCandidates], root: Tensor) -> Combined:
        """Candidates of the alive drafters ({t: DraftCandidates [B, M]}) and root [B] -> Combined."""
        name, n = self.name, self.budget
        if name == "autoregressive":
            batch = root.shape[0]
            ones = torch.ones((batch, 1), dtype=torch.int64, device=root.device)
            return Combined(root.view(batch, 1), -ones, ones * 0, ones.view(batch, 1, 1), ones * 0, None)
        if name in ("single", "average"):
            (t, cand), = cands.items()
            tree = _build(cand, n, root)
            return Combined(tree.tokens, tree.parents, tree.depth, tree.tree_mask, _single_source(tree, t), None)
        if name.startswith("route"):
            return self._route(cands, root)
        trees = [_build(cands[t], n, root) for t in sorted(cands)]
        stack = lambda f: torch.stack([getattr(tr, f) for tr in trees], 1)  # noqa: E731
        tokens, scores = stack("tokens"), stack("scores")
        if name == "adaptive":
            alloc = allocate_budget(self.accepted[:, sorted(cands)] + self.prior, n - 1)  # [B, T]
            scores = reserve_nodes(scores, tokens, alloc)
        merged = taps_ops.merge_trees(tokens, stack("parents"), scores,
                                      num_nodes=None if name == "merged" else n)
        # merge_trees numbers its trees 0..len-1; map bits back to drafter indices
        source = merged.source
        order = sorted(cands)
        if order != list(range(len(order))):
            remapped = torch.zeros_like(source)
            for i, t in enumerate(order):
                remapped |= ((source >> i) & 1) << t
            source = remapped
        source = torch.where(merged.tokens >= 0, source, torch.zeros_like(source))
        source[:, 0] = 0
        return Combined(merged.tokens, merged.parents, merged.depth, merged.tree_mask, source, None)

    def _route(self, cands: Dict[int, DraftCandidates], root: Tensor) -> Combined:
        order = sorted(cands)
        trees = {t: _build(cands[t], self.budget, root) for t in order}
        batch = root.shape[0]
        if self.fixed is not None:
            choice = self.fixed
        else:
            if "confidence" in self.name:
                sig = torch.stack([tree_confidence(trees[t]) for t in order], 1)
            else:
                sig = -torch.stack([cands[t].entropy for t in order], 1)
            local = sig.argmax(1)  # ties: the lower drafter index
            choice = torch.tensor(order, device=root.device)[local]
            if self.name.endswith("-prompt"):
                self.signal_sum[:, order] += sig.double()  # every drafter is alive until the decision
                self.steps += 1
                if self.steps >= self.route_steps:
                    self.fixed = self.signal_sum.argmax(1)
                    self._alive = sorted(set(self.fixed.tolist()))
        stack = lambda f: torch.stack([getattr(trees[t], f) for t in order], 1)  # noqa: E731
        lookup = torch.zeros(self.num_drafters, dtype=torch.int64, device=root.device)
        lookup[torch.tensor(order, device=root.device)] = torch.arange(len(order), device=root.device)
        idx = lookup[choice]  # position of the chosen drafter among those that drafted
        rows = torch.arange(batch, device=root.device)
        tokens, parents, depth = stack("tokens")[rows, idx], stack("parents")[rows, idx], stack("depth")[rows, idx]
        tree_mask = stack("tree_mask")[rows, idx]
        real = tokens >= 0
        real[:, 0] = False
        return Combined(tokens, parents, depth, tree_mask, real.long() << choice.unsqueeze(1), choice)

    def observe(self, accepted_by_drafter: Tensor) -> None:
        """Accepted draft tokens each drafter had proposed in the last step, [B, T]."""
        self.accepted += accepted_by_drafter.to(self.accepted.dtype)


def make_strategy(name: str, num_drafters: int, budget: int, **options) -> Strategy:
    """The strategy called `name` (see :data:`STRATEGIES`); raises ValueError for unknown names or a
    drafter count the strategy cannot use."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    if name == "autoregressive":
        if num_drafters:
            raise ValueError("strategy 'autoregressive' uses no drafter; pass drafters=[]")
    elif num_drafters == 0:
        raise ValueError(f"strategy {name!r} needs at least one drafter (got an empty list); use "
                         "strategy='autoregressive' for plain decoding")
    if name == "single" and num_drafters != 1:
        raise ValueError(f"strategy 'single' takes exactly one drafter, got {num_drafters}")
    if num_drafters > 63:
        raise ValueError("at most 63 drafters (the source bitmask is int64)")
    if budget < 1:
        raise ValueError(f"budget must be >= 1 node, got {budget}")
    return Strategy(name, num_drafters, budget, **options)
