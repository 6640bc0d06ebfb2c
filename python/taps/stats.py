"""Per-request decoding statistics and a light step profiler.

Acceptance length ``tau`` = tokens emitted by verification steps / target verification forwards (the
prefill and the token it yields are not counted), per request; summaries average it over requests.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import ContextManager, Dict, Iterator, List, Optional

import torch

__all__ = ["RequestStats", "Profiler", "summarize"]


@dataclass
class RequestStats:
    """What happened to one request.

    accepted: accepted draft tokens of every verification step (emitted = accepted + 1).
    depth_reached[d]: steps whose accepted length was >= d (d = 0 .. max depth).
    drafter_accepted[t]: accepted draft tokens that drafter t had proposed (a token proposed by several
        drafters counts for each: the merge_trees ``source`` bitmask).
    route_decisions: the drafter whose tree was verified at each step (routing strategies), else empty.
    tree_nodes: real nodes (root included) of the tree verified at each step.
    draft_shapes: the draft a tuner chose at each step (:attr:`taps.tuner.Shape.label`: ``none`` for a
        plain one-token step, else the drafters, depth and node budget), empty without a tuner.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    accepted: List[int] = field(default_factory=list)
    depth_reached: List[int] = field(default_factory=list)
    drafter_accepted: List[int] = field(default_factory=list)
    route_decisions: List[int] = field(default_factory=list)
    tree_nodes: List[int] = field(default_factory=list)
    draft_shapes: List[str] = field(default_factory=list)
    finish_reason: str = ""

    @property
    def target_forwards(self) -> int:
        """Verification forwards this request took part in (prefill excluded)."""
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target verification forward."""
        n = len(self.accepted)
        return (sum(self.accepted) + n) / n if n else 0.0

    @property
    def acceptance_rate_per_depth(self) -> List[float]:
        """rate[d - 1] = P(accepted >= d | accepted >= d - 1), for d = 1 .. max depth."""
        r = self.depth_reached
        return [r[d] / r[d - 1] if r[d - 1] else 0.0 for d in range(1, len(r))]

    @property
    def drafter_share(self) -> List[float]:
        """Share of this request's accepted draft tokens that each drafter proposed."""
        total = sum(self.accepted)
        return [a / total if total else 0.0 for a in self.drafter_accepted]

    @property
    def shape_histogram(self) -> Dict[str, int]:
        """Steps per draft shape a tuner chose (:attr:`draft_shapes`), most frequent first."""
        return _histogram(self.draft_shapes)

    def record(self, accepted: int, max_depth: int, nodes: Optional[int] = None) -> None:
        """One verification step: `accepted` draft tokens, of a tree of `nodes` real nodes."""
        if not self.depth_reached:
            self.depth_reached = [0] * (max_depth + 1)
        self.accepted.append(accepted)
        if nodes is not None:
            self.tree_nodes.append(nodes)
        for d in range(min(accepted, max_depth) + 1):
            self.depth_reached[d] += 1

    def as_dict(self) -> dict:
        return dict(prompt_tokens=self.prompt_tokens, new_tokens=self.new_tokens, tau=self.tau,
                    target_forwards=self.target_forwards,
                    acceptance_rate_per_depth=self.acceptance_rate_per_depth,
                    drafter_share=self.drafter_share, route_decisions=list(self.route_decisions),
                    tree_nodes=list(self.tree_nodes), shape_histogram=self.shape_histogram,
                    finish_reason=self.finish_reason)


def _histogram(labels: List[str]) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for s in labels:
        counts[s] = counts.get(s, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def summarize(stats: List[RequestStats]) -> dict:
    """Over requests: tau (per request, then the mean), acceptance rate per depth and the share of
    accepted tokens per drafter (pooled), the share of routed steps per drafter (routing strategies),
    the steps per draft shape a tuner chose (pooled; empty without a tuner)."""
    if not stats:
        return {}
    depth = max(len(s.depth_reached) for s in stats)
    reached = [sum(s.depth_reached[d] if d < len(s.depth_reached) else 0 for s in stats) for d in range(depth)]
    ndrafters = max(len(s.drafter_accepted) for s in stats)
    acc_total = sum(sum(s.accepted) for s in stats)
    decisions = [c for s in stats for c in s.route_decisions]
    return dict(
        tau=sum(s.tau for s in stats) / len(stats),
        new_tokens=sum(s.new_tokens for s in stats),
        target_forwards=sum(s.target_forwards for s in stats),
        acceptance_rate_per_depth=[reached[d] / reached[d - 1] if reached[d - 1] else 0.0
                                   for d in range(1, depth)],
        drafter_share=[sum(s.drafter_accepted[t] for s in stats if t < len(s.drafter_accepted)) / acc_total
                       if acc_total else 0.0 for t in range(ndrafters)],
        route_share=[decisions.count(t) / len(decisions) for t in range(ndrafters)] if decisions else [],
        shape_histogram=_histogram([x for s in stats for x in s.draft_shapes]),
    )


#: what a disabled profiler's sections are
_OFF = contextlib.nullcontext()


class Profiler:
    """Exclusive wall time per named section (nested sections pause their parent).

    On CUDA each section boundary synchronises the device when ``sync`` is set, so that times are
    attributed to the section that launched the work.
    """

    def __init__(self, enabled: bool = True, sync: bool = False):
        self.enabled = enabled
        self.sync = sync
        self.totals: Dict[str, float] = {}
        self.steps = 0
        self._stack: List[list] = []

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def section(self, name: str) -> ContextManager[None]:
        """A context timing section `name`; disabled, one shared context that does nothing (a generator's
        context costs ~1 us a section, and a decoding step opens about ten of them)."""
        return self._section(name) if self.enabled else _OFF

    @contextlib.contextmanager
    def _section(self, name: str) -> Iterator[None]:
        now = self._now()
        if self._stack:  # pause the parent
            parent = self._stack[-1]
            self.totals[parent[0]] = self.totals.get(parent[0], 0.0) + now - parent[1]
        self._stack.append([name, now])
        try:
            yield
        finally:
            end = self._now()
            entry = self._stack.pop()
            self.totals[name] = self.totals.get(name, 0.0) + end - entry[1]
            if self._stack:
                self._stack[-1][1] = end

    def per_step(self) -> Dict[str, float]:
        """Mean seconds per decoding step of each section."""
        n = max(self.steps, 1)
        return {k: v / n for k, v in self.totals.items()}

    def reset(self) -> None:
        self.totals.clear()
        self.steps = 0
