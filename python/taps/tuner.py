"""Speculation as a decision: each step's draft chosen by measured costs and running acceptance.

A speculative step pays for the drafters' forwards, their cache updates and a target forward over the
whole tree; it wins only when the tokens it yields outweigh that against a plain one-token step. How
much each part costs depends on the machine (ISA, dtype, threads, batch, a GPU or not), so the
:class:`Tuner` measures it there and decides every step, down to no draft at all:

- **Cost model** (:class:`CostModel`): seconds of the target's tree forward with its verification as a
  function of the node count (per batch size), of each drafter group's expansion as a function of depth,
  of each group's cache update as a function of the tokens it appends, and a residual per draft kind
  (tree building, compaction, the loop). Calibrated in a few tens of milliseconds when a decoder first
  runs (a scratch tree forward per node count on the real cache, each group's expansion at two depths;
  neither commits anything), cached per (target, drafters, device, dtype, threads), and corrected online from the
  step's own timers (an exponential average of measured over predicted per part, the residual the
  difference). :class:`FixedCosts` injects fixed costs instead (tests, or a model measured elsewhere).
- **Acceptance model** (:class:`AcceptanceModel`): per draft kind (which drafters draft, and the node
  budget) and per depth d, the rate P(accepted >= d | accepted >= d - 1), counted per request (decayed:
  0.95 a step of the kind) and pooled over the decoder's past requests (decayed: 0.98), the pooled rate acting
  as the request's prior
  (itself drawn towards ``prior_rate``). Counting to the kind's nominal depth folds prompt lookup's match
  rate into its depth-1 rate (a step without a match is a miss at depth 1).
- **Objective**: for every candidate, E[accepted + 1] summed over the active requests (E[accepted] = sum
  over d of the product of the rates up to d, to the tree's depth) divided by its predicted step time; the
  largest wins. Where the batch ends with its last request (``plan(left=)``, ``finish_time``), by the time
  the batch would take to its end instead (:meth:`Tuner._finish`). Candidates: no draft (a plain one-token
  step), and for every allowed set of drafter groups, every depth 1 .. the decoder's and every node budget
  of ``budgets`` below the decoder's, and its own. Each kind not chosen is probed now and then at its full
  depth (every depth observed at once; once tried, at most two levels past the deepest its drafters were
  ever accepted at, so a drafter never accepted is probed at depth 1, its cheapest tree), with exponential
  back-off, only while it could win with its rates at an upper confidence bound (each raised by 1 / sqrt(1 +
  trials); a kind's chance to reach each depth at most that of a wider kind of the same drafters observed
  since, whose tree holds its best nodes, and its estimate at least that of a narrower one observed since)
  and its price before the running ratio its steps' seconds set (see :meth:`Tuner.observe`: only the kind's
  own steps correct that ratio),
  and only as far as an exploration credit covers its predicted loss (the credit grows by a share
  ``explore`` of each step's predicted time; an observed probe also spends what it lost beyond that), so
  probes lose about that share at most, however many kinds there are, whatever a tree costs at the batch
  size and however wrong the predictions, and useless drafters cost a vanishing share of the steps.

A group whose draft runs no model (prompt lookup) is asked before each plan whether it has anything to
propose, and left out of the step's kinds when it has not (``plan(idle=)``).

While no draft is best, a step costs what a plain autoregressive step does: the decoder repeats the
answer without planning (:meth:`Tuner.coast`) until its requests change, a draft is observed or a probe
could come due, and one such step in :attr:`Tuner.plain_sample` is timed for the cost model
(:meth:`Tuner.observes`).

Verification is unchanged whatever is chosen, so the output distribution is the target's own. Drafter
groups that do not draft in a step are not updated either: the tokens they missed are appended in one
call the next time they draft (that append is part of that step's predicted cost; a group not started yet
starts then, on every token before it, priced by the starts measured so far: :meth:`CostModel.start`).
"""

from __future__ import annotations

import bisect
import copy
import itertools
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np


__all__ = ["Shape", "CostModel", "FixedCosts", "AcceptanceModel", "Tuner", "NONE", "DRAWN"]


class CoastToken(NamedTuple):
    """What :meth:`Tuner.coast` takes to repeat a plan of no draft: the plan's memo and the tuner's
    version then, the positions of the groups idle at that plan (they must still be idle), and the
    (position, count) of the requests each other group that proposes for some requests only (prompt
    lookup) could draft for then (no more may now); whether every group was idle then."""

    memo: Optional[tuple]
    version: int
    idle: frozenset
    ready: Tuple[Tuple[int, int], ...] = ()
    #: every group was idle at that plan (nothing to price): the answer holds while they stay idle, whatever
    #: was learned since
    every: bool = False

    def limits(self, active: int) -> Tuple[Tuple[int, int], ...]:
        """The conditions on the groups that can fail with `active` requests, as (group position, the most
        requests it may have something to propose for): each group idle at the plan (0), and each free group
        that had fewer requests with a draft than `active` (that count; no more could otherwise)."""
        return tuple((i, 0) for i in self.idle) + tuple((i, count) for i, count in self.ready if count < active)


class Shape(NamedTuple):
    """One step's draft: which drafters draft (their indices in the decoder, () = no draft), the
    expansion depth and the node budget of the tree (root included); ``drawn``: the tree drawn from the
    drafters' (mean) distribution and verified by rejection sampling (``SpeculativeDecoder(sampled_drafts=)``)
    instead of their top-k tree."""

    drafters: Tuple[int, ...]
    depth: int
    budget: int
    drawn: bool = False

    @property
    def key(self) -> tuple:
        """The draft kind the acceptance model and the cost residuals are kept for: the drafters and
        the node budget (at one budget, a shallower expansion's tree is about the deeper one's cut at
        that depth: the best nodes by score are the same, so the per-depth rates carry over). A drawn
        kind's drafters end with :data:`DRAWN` (kept apart from the top-k kinds, beside its own wider
        budgets)."""
        return (self.drafters + (DRAWN,) if self.drawn else self.drafters, self.budget)

    @property
    def label(self) -> str:
        """Short name, e.g. ``none``, ``0+1 d3 n16`` (drafters 0 and 1, depth 3, 16 nodes) or ``0 d3 n13
        drawn``."""
        if not self.drafters:
            return "none"
        return "+".join(map(str, self.drafters)) + f" d{self.depth} n{self.budget}" + (" drawn" if self.drawn else "")


#: ends the drafters of a drawn kind's key (:attr:`Shape.key`)
DRAWN = -1


#: the plain one-token step
NONE = Shape((), 0, 1)


def _ema(old: Optional[float], new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


def _interpolate(points: Sequence[Tuple[int, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points, extended linearly past the last two."""
    if len(points) == 1:
        return points[0][1] * max(x, 1) / max(points[0][0], 1)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def _within(batches, batch: int, reach: float) -> bool:
    """Whether some batch size of `batches` is within a factor `reach` of `batch`."""
    return any(b <= batch * reach and batch <= b * reach for b in batches)


def _across(batches, batch: int, at: Callable[[int], float]) -> float:
    """``at(batch)`` when `batch` is among the calibrated `batches`; else linear in the batch size between
    the calibrated ones around it, or in proportion to it from the nearest (0 without any)."""
    if batch in batches:
        return at(batch)
    below = max((b for b in batches if b < batch), default=None)
    above = min((b for b in batches if b > batch), default=None)
    if below is not None and above is not None:
        low, high = at(below), at(above)
        return low + (high - low) * (batch - below) / (above - below)
    near = below if below is not None else above
    return 0.0 if near is None else at(near) * batch / near


def _batches_of(table: dict, group: tuple) -> List[int]:
    """The batch sizes `group` has entries for in a table keyed by (group, batch)."""
    return [b for g, b in table if g == group]


def _group_across(table: dict, group: tuple, batch: int, at: Callable[[int], float]) -> float:
    """:func:`_across` over the batch sizes a (group, batch)-keyed table holds for `group` (``at(batch)``
    directly when it holds this one)."""
    return at(batch) if (group, batch) in table else _across(_batches_of(table, group), batch, at)


def _same_appends(last: tuple, appends: tuple, same_cost: Callable[[int, int, int], bool]) -> bool:
    """Whether the groups' appends (pending, starting) leave the last plan's draft (``Tuner._last_draft``) the
    best: its own groups' as they were (or priced the same: ``same_cost(position, tokens now, tokens then)``), the
    others' as they were or more (what drafting with those others would cost only grew: a drafter group not chosen
    queues the steps it has yet to append)."""
    (pending, starting), index = last[1], last[3]
    now, now_starting = appends
    if starting != now_starting:
        return False
    return all(same_cost(i, n, p) if i in index else n >= p for i, (n, p) in enumerate(zip(now, pending)))


def _idle(ready: Sequence[Optional[Sequence[int]]]) -> Tuple[int, ...]:
    """Positions of the groups of :meth:`Tuner.plan`'s ``ready`` with nothing to propose for any request."""
    return tuple(i for i, r in enumerate(ready) if r is not None and not r)


def _fewer_requests(old: tuple, new: tuple) -> bool:
    """Whether plan memo `new` is `old` with some of its active requests finished (every other input the
    same: the groups, depth, budget, batch rows, ...)."""
    return old[:4] == new[:4] and old[5:] == new[5:] and set(new[4]) < set(old[4])


def node_grid(max_nodes: int) -> List[int]:
    """Node counts the target forward is timed at: 1, 2, 3, 4, 6, 8, 12, 16, ... up to max_nodes."""
    grid, n = [1, 2, 3], 4
    while n < max_nodes:
        grid += [n, n * 3 // 2]
        n *= 2
    return sorted({g for g in grid if g < max_nodes} | {max_nodes})


class CostModel:
    """Predicted seconds of a step's parts on this machine (see the module docstring).

    Parts are keyed by batch size and, for drafter groups, by the drafter indices of the group. The
    decoder calibrates what is missing when a generation starts (:meth:`needs`, :meth:`set_forward`,
    :meth:`set_draft`) and reports every step's measured parts (:meth:`observe`).

    A batch size that was not calibrated is predicted from the calibrated ones (linear in the batch
    size between the two around it, else in proportion to the batch size from the nearest) and corrected
    online like any other; the decoder calibrates a new batch size only when no calibrated one is within
    a factor ``reach`` of it (requests joining and leaving a running batch meet every size).

    Args:
        alpha: weight of the newest measurement in the online averages.
        reach: how far (a factor) a calibrated batch size stands for others.
    """

    def __init__(self, alpha: float = 0.1, reach: float = 2.0):
        self.alpha = alpha
        self.reach = reach
        self.forward_points: Dict[int, List[Tuple[int, float]]] = {}
        self.draft_points: Dict[Tuple[tuple, int], Tuple[int, float, int, float]] = {}
        self.update_fit: Dict[Tuple[tuple, int], List[float]] = {}
        self._update_sums: Dict[Tuple[tuple, int], List[float]] = {}
        self._update_seen: Dict[Tuple[tuple, int], set] = {}  # token counts appended so far
        #: per (group, batch): seconds per token (per request) of the group's start, measured (a tuner's group
        #: starts when it first drafts, on every token before it: its prompts and the steps it missed)
        self.start_rate: Dict[Tuple[tuple, int], float] = {}
        self.scale: Dict[tuple, float] = {}
        self.residual: Dict[tuple, float] = {}
        #: a drafted step's seconds outside its timed parts (its plan, tree, commit, read-back and record: the
        #: same work whatever the kind), running mean over every drafted step; a drafted kind's rest is this
        #: plus its own residual
        self.drafted_rest = 0.0
        #: forward()'s answers per (nodes, batch), and per ("floors", batch) the calibrated node counts with the most
        #: any of them up to each is predicted at; until a point or scale moves
        self._forward_memo: Dict[tuple, object] = {}

    #: what :meth:`state_dict` holds (the memo is rebuilt)
    _STATE = ("alpha", "reach", "forward_points", "draft_points", "update_fit", "_update_sums", "_update_seen", "scale",
              "residual", "start_rate", "drafted_rest")
    #: what a state saved before a name was kept has for it (starts measured anew, no drafted steps' rest yet)
    _STATE_DEFAULTS = {"start_rate": {}, "drafted_rest": 0.0}

    def state_dict(self) -> dict:
        """What the model measured and learned, as plain values (:func:`Tuner.save` writes it as JSON)."""
        return {name: copy.deepcopy(getattr(self, name)) for name in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        default = self._STATE_DEFAULTS
        for name in self._STATE:
            setattr(self, name, copy.deepcopy(state.get(name, default[name]) if name in default else state[name]))
        self._forward_memo = {}

    # -- calibration -------------------------------------------------------------------------------
    def needs_forward(self, batch: int) -> bool:
        """Whether the target's forward lacks a calibrated batch size within a factor ``reach`` of
        `batch` (one that is near enough stands for it, scaled: :meth:`forward`)."""
        return not _within(self.forward_points, batch, self.reach)

    def needs_draft(self, group: tuple, batch: int) -> bool:
        """The same for a drafter group's expansion."""
        return not _within(_batches_of(self.draft_points, group), batch, self.reach)

    def set_forward(self, batch: int, points: Sequence[Tuple[int, float]]) -> None:
        """Measured (nodes, seconds) of the target's tree forward with verification at this batch (made
        non-decreasing in the node count: a burst of load during one measurement costs that point)."""
        points = sorted(points)
        for i in range(len(points) - 2, -1, -1):
            points[i] = (points[i][0], min(points[i][1], points[i + 1][1]))
        self.forward_points[batch] = points
        self._forward_memo.clear()

    def set_draft(self, group: tuple, batch: int, shallow: Tuple[int, float], deep: Tuple[int, float]) -> None:
        """Measured (depth, seconds) of group's expansion at two depths; the update is first estimated
        as one expansion level (an append runs the same layers over a few tokens)."""
        (d0, t0), (d1, t1) = shallow, deep
        self.draft_points[(group, batch)] = (d0, t0, d1, t1)
        level = (t1 - t0) / (d1 - d0) if d1 > d0 else t0
        self.update_fit.setdefault((group, batch), [max(level, 0.0), max(level, 0.0) / 16])

    # -- predictions --------------------------------------------------------------------------------
    def forward(self, nodes: float, batch: int) -> float:
        """The target's tree forward and verification over `nodes` real nodes per request, as plans price
        it: at least what fewer nodes are predicted to cost (each node count's online scale moves on its own,
        and a count seldom run keeps a scale from another moment of the machine; a tree never costs less
        than a smaller one, nor a draft's forward less than a plain step's). Kept until a measurement moves a
        scale (a plan asks for the same node counts many times)."""
        memo = self._forward_memo
        seconds = memo.get((nodes, batch))
        if seconds is not None:
            return seconds
        floors = memo.get(("floors", batch))
        if floors is None:  # the calibrated node counts, and the most any of them up to each is predicted at
            grid = [n for n, _ in self.forward_points.get(batch) or next(iter(self.forward_points.values()), ())]
            floors = memo[("floors", batch)] = (grid, [])
        grid, most = floors
        seconds = self.forward_part(nodes, batch)
        below = bisect.bisect_left(grid, nodes)  # the calibrated counts below `nodes`
        if below:
            # (the running most extended as far as asked: after a plain step's measurement a plan asks for one
            # node alone, no floor)
            for n in grid[len(most):below]:
                part = self.forward_part(n, batch)
                most.append(max(most[-1], part) if most else part)
            seconds = max(seconds, most[below - 1])
        if len(memo) > 4096:
            memo.clear()
        memo[(nodes, batch)] = seconds
        return seconds

    def forward_part(self, nodes: float, batch: int) -> float:
        """That node count's own prediction (its calibration times its online scale): what a measured
        forward of `nodes` nodes is compared with to correct that scale (:meth:`observe`), not what plans
        price (:meth:`forward`)."""
        points = self.forward_points.get(batch)
        if points is not None:
            seconds = _interpolate(points, nodes)
        else:
            seconds = _across(self.forward_points, batch, lambda b: _interpolate(self.forward_points[b], nodes))
        return seconds * self.scale.get(("forward", batch, round(nodes)), 1.0)

    def draft(self, group: tuple, depth: int, batch: int, drawn: bool = False) -> float:
        """Group's expansion of `depth` levels; ``drawn``: its drawn draft (:meth:`draft_key`: measured apart
        where calibrated, the top-k expansion's cost until then)."""
        key = self.draft_key(group, batch, drawn)
        def at(b):
            d0, t0, d1, t1 = self.draft_points[(key, b)]
            slope = (t1 - t0) / (d1 - d0) if d1 > d0 else 0.0
            return max(t0 + slope * (depth - d0), 0.0)
        return _group_across(self.draft_points, key, batch, at) * self.scale.get(("draft", key, depth, batch), 1.0)

    def draft_key(self, group: tuple, batch: int, drawn: bool) -> tuple:
        """What a group's draft is priced and corrected under: the group; for a drawn draft the group followed by
        :data:`DRAWN` once calibrated (an n-gram table's drawn chains are one host call, its top-k tree an
        expansion over its logits: 0.16 against 0.58 ms on the shipped target)."""
        if drawn and _batches_of(self.draft_points, group + (DRAWN,)):
            return group + (DRAWN,)
        return group

    def _fit_update(self, key: tuple, tokens: int, seconds: float) -> None:
        """Least squares of seconds = a + b * tokens over the measured appends, older ones forgotten
        (weight 0.97 per append); the calibrated estimate counts as one append of one token.

        The first append of a token count may pay one-off costs: on the CPU oneDNN builds a kernel for each
        new shape of a bf16 product (0.4-1.6 ms against 35-60 us for the calls after). It counts only when
        it is not above the current prediction: two such appends (1 and 2 tokens at 2.2 and 2.7 ms against
        0.2 ms after) once made the fit 0.1 + 1.3 ms a token, and the drafter, then priced out, never
        drafted again to correct it. Any other append counts as at most twice the prediction (as a part's scale
        moves by at most a factor 2 per measurement): a least-squares line over a handful of appends is
        otherwise set by one outlier."""
        seen = self._update_seen.setdefault(key, set())
        fit = self.update_fit.get(key)
        predicted = None if fit is None else fit[0] + fit[1] * tokens
        if tokens not in seen:
            seen.add(tokens)
            if predicted is None or seconds > predicted:
                return
        if predicted is not None and predicted > 0:
            seconds = min(seconds, 2 * predicted)
        sums = self._update_sums.get(key)
        if sums is None:
            a, b = self.update_fit.get(key, (seconds, 0.0))
            sums = self._update_sums[key] = [1.0, 1.0, 1.0, a + b, a + b]  # n, sx, sxx, sy, sxy
        forget = 1 - self.alpha * 0.3
        x, y = float(tokens), seconds
        for i, v in enumerate((1.0, x, x * x, y, x * y)):
            sums[i] = sums[i] * forget + v
        n, sx, sxx, sy, sxy = sums
        det = n * sxx - sx * sx
        b = (n * sxy - sx * sy) / det if det > 1e-9 * n * n else 0.0
        b = max(b, 0.0)
        self.update_fit[key] = [max((sy - b * sx) / n, 0.0), b]

    def update(self, group: tuple, tokens: int, batch: int) -> float:
        """Group's append of `tokens` tokens per request (0: nothing to append)."""
        if tokens <= 0:
            return 0.0
        def at(b):
            a, slope = self.update_fit[(group, b)]
            return a + slope * tokens
        return max(_group_across(self.update_fit, group, batch, at), 0.0)

    def observe_start(self, group: tuple, batch: int, tokens: int, seconds: float) -> None:
        """A measured start of `group` over `tokens` tokens per request: its seconds per token, each
        measurement moving the kept rate by at most a factor 2."""
        if tokens <= 0:
            return
        rate, old = seconds / tokens, self.start_rate.get((group, batch))
        self.start_rate[(group, batch)] = rate if old is None else _ema(old, min(max(rate, old / 2), old * 2), 0.3)

    def start(self, group: tuple, tokens: int, batch: int) -> float:
        """Group's start over `tokens` tokens per request (0: started already): the measured starts' seconds
        per token; before any was measured, what an append of as many tokens is predicted to cost."""
        if tokens <= 0:
            return 0.0
        if not _batches_of(self.start_rate, group):
            return self.update(group, tokens, batch)
        return max(_group_across(self.start_rate, group, batch, lambda b: self.start_rate[(group, b)] * tokens), 0.0)

    def rest(self, key: tuple) -> float:
        """The residual of a draft kind (tree building, compaction, the loop's own work): for a drafted kind
        what every drafted step spends outside its timed parts (:attr:`drafted_rest`) and its own residual."""
        if not key[0]:
            return self.residual.get(key, 0.0)
        return self.drafted_rest + self.residual.get(key, 0.0)

    # -- online correction -----------------------------------------------------------------------------
    def observe(self, key: tuple, batch: int, total: float, predicted_parts: float, parts: Dict[tuple, Tuple[float, float]],
                updates: Sequence[Tuple[tuple, int, float]], timed_elsewhere: float = 0.0) -> None:
        """One step's measurements: total seconds, the parts' predictions summed, each timed part as
        {part key: (measured, predicted)}, and each group update as (group, tokens, seconds) (a group's
        start: :meth:`observe_start`, its seconds in ``timed_elsewhere``)."""
        # Each measurement moves a part's scale by at most a factor 2 (a burst of load on a shared
        # machine, or a collection, must not undo the calibration); the residual moves by at most a
        # fifth of a tenth of the step per step (it tracks a median, robust to outliers).
        self._forward_memo.clear()
        for part, (measured, predicted) in parts.items():
            if predicted > 0:
                ratio = min(max(measured / predicted, 0.5), 2.0)
                self.scale[part] = _ema(1.0, self.scale.get(part, 1.0) * ratio, self.alpha) if part not in self.scale \
                    else _ema(self.scale[part], self.scale[part] * ratio, self.alpha)
        for group, tokens, seconds in updates:
            self._fit_update((group, batch), tokens, seconds)
        timed = (sum(m for m, _ in parts.values()) + sum(u[2] for u in updates) + timed_elsewhere) if key[0] else 0.0
        if timed > 0:
            # what this drafted step spent outside its timed parts moves the drafted steps' common rest at once
            # (a sample counts as at most twice the rest, or half the timed parts while the rest is small: a
            # preempted step moves it by a tenth at most); the kind's own residual then tracks what is left
            # (drafted kinds seldom chosen, probes and T = 1's few drafts, had been priced 1.3-2x below what their
            # steps took: a residual per kind that moves a few microseconds a step had not learned the ~0.35-0.5 ms
            # every drafted step spends outside its parts)
            outside = min(max(total - timed, 0.0), 2.0 * max(self.drafted_rest, 0.25 * timed))
            self.drafted_rest = _ema(self.drafted_rest, outside, self.alpha)
        old = self.rest(key)  # (a drafted kind's: the common rest and its own residual)
        step = 0.1 * (predicted_parts + max(old, 0.0))
        moved = min(max(total - predicted_parts - old, -step), step) * 2 * self.alpha
        self.residual[key] = self.residual.get(key, 0.0) + moved


class FixedCosts(CostModel):
    """A cost model with given part costs and no calibration or online correction.

    Args:
        forward: ``forward(nodes, batch) -> seconds``.
        draft: ``draft(drafters, depth, batch) -> seconds`` (drafters: the group's drafter indices; a drawn draft
            costs what its top-k expansion does).
        update: ``update(drafters, tokens, batch) -> seconds``.
        rest: seconds of everything else in a step.
    """

    def __init__(self, forward: Callable[[float, int], float], draft: Callable[[tuple, int, int], float],
                 update: Callable[[tuple, int, int], float] = lambda g, t, b: 0.0, rest: float = 0.0):
        super().__init__()
        self._forward, self._draft, self._update, self._rest = forward, draft, update, rest

    def needs_forward(self, batch):
        return False

    def needs_draft(self, group, batch):
        return False

    def forward(self, nodes, batch):
        return self._forward(nodes, batch)

    def forward_part(self, nodes, batch):
        return self._forward(nodes, batch)

    def draft(self, group, depth, batch, drawn=False):
        return self._draft(group, depth, batch)

    def update(self, group, tokens, batch):
        return self._update(group, tokens, batch) if tokens > 0 else 0.0

    def rest(self, key):
        return self._rest

    def observe_start(self, *args, **kwargs):
        pass

    def observe(self, *args, **kwargs):
        pass


@dataclass
class _Counts:
    """Trials and hits per depth (index d - 1)."""

    trials: List[float] = field(default_factory=list)
    hits: List[float] = field(default_factory=list)

    def add(self, accepted: int, cap: int, weight: float = 1.0) -> None:
        while len(self.trials) < cap:
            self.trials.append(0.0)
            self.hits.append(0.0)
        for d in range(1, min(accepted + 1, cap) + 1):
            self.trials[d - 1] += weight
            if accepted >= d:
                self.hits[d - 1] += weight

    def scale(self, factor: float) -> None:
        self.trials = [t * factor for t in self.trials]
        self.hits = [h * factor for h in self.hits]


class _Table:
    """:meth:`AcceptanceModel._table`: per kind (its index in ``kinds``), request row and depth, the bounded
    E[accepted] running sums (nested lists) and the own reach (an array), for the estimate (``[0]``) and the
    optimistic one (``[1]``); ``rows``: each request position's row (a request past them has the pooled values: the
    last row)."""

    __slots__ = ("kinds", "depth", "pooled_row", "rows", "sums", "reach")

    def __init__(self, kinds: Dict[tuple, int], depth: int, batch: int, sums: list, reach: np.ndarray):
        self.kinds, self.depth, self.pooled_row = kinds, depth, batch
        self.rows = list(range(batch))
        self.sums, self.reach = sums, reach

    def row(self, b: int) -> int:
        rows = self.rows
        return rows[b] if 0 <= b < len(rows) else self.pooled_row


class AcceptanceModel:
    """Running acceptance rates per draft kind and depth, per request, with a prior (see the module
    docstring).

    Args:
        prior_rate, prior_weight: the rate the first depth starts from, and its weight in trials; with
            ``chain_prior`` each deeper depth's pooled rate is drawn towards the pooled rate of the depth above
            instead (a drafter that went on at one depth goes on at the next at about that rate: drawn
            towards 0.5 each, the deep levels of a prompt-lookup chain, a few trials each, were valued at
            (10.5 / 11) ** 10 = 0.63 of what ten levels accepted every time give, and its chains lost to
            shallow ones), else towards ``prior_rate`` too.
        pooled_weight: weight (in trials) of the pooled rate in a request's own.
        decay: factor applied to the pooled counts of a kind at each of its observations.
        own_decay: the same for a request's own counts (a drafter's acceptance moves with the text: one that
            knew the last topic may not know the next).
    """

    def __init__(self, prior_rate: float = 0.5, prior_weight: float = 1.0, pooled_weight: float = 2.0,
                 decay: float = 0.98, own_decay: float = 0.95, chain_prior: bool = True):
        self.prior_rate, self.prior_weight, self.chain_prior = prior_rate, prior_weight, bool(chain_prior)
        self.pooled_weight, self.decay, self.own_decay = pooled_weight, decay, own_decay
        self.pooled: Dict[tuple, _Counts] = {}
        self.requests: List[Dict[tuple, _Counts]] = []
        self._memo: Dict[tuple, dict] = {}  # per kind: its totals and each request's value, until observed
        self._tables: Dict[tuple, _Table] = {}  # per set of drafters: every value of its kinds (_table)
        self._asked: Dict[tuple, set] = {}  # per set of drafters: the kinds values were asked for
        self._priors: Dict[tuple, List[float]] = {}  # per kind: its pooled rates (_pooled_rates), until observed
        self._last: Dict[tuple, int] = {}  # per kind: when it was last observed (counts observations)
        self._observations = 0
        #: the depth the values are computed to at least (the tuner sets the deepest a plan asks for: they are
        #: then computed once, not once per depth)
        self.horizon = 1

    def state_dict(self) -> dict:
        """The pooled counts (what the decoder's past requests taught; a batch's own requests are not kept)."""
        return {"pooled": {k: (list(c.trials), list(c.hits)) for k, c in self.pooled.items()},
                "last": dict(self._last), "observations": self._observations}

    def load_state_dict(self, state: dict) -> None:
        self.pooled = {k: _Counts(list(t), list(h)) for k, (t, h) in state["pooled"].items()}
        self._last, self._observations = dict(state["last"]), int(state["observations"])
        self._forget()

    def reset(self, batch: int) -> None:
        """Start a batch of requests (the pooled counts stay, and the values computed from them alone: a new
        request's values are the pooled ones until it has counts of its own)."""
        self.requests = [{} for _ in range(batch)]
        self._memo.clear()
        for table in self._tables.values():
            table.rows = []  # (every request: the pooled row)

    def _forget(self) -> None:
        """Drop every value computed from the counts."""
        self._memo.clear()
        self._tables.clear()
        self._priors = {}

    def add_requests(self, count: int) -> None:
        """`count` requests join the batch after the running ones (from the pooled rates: they have no counts
        yet, and the kept tables give a request past their rows the pooled values)."""
        self.requests += [{} for _ in range(count)]

    def select_requests(self, keep: Sequence[int]) -> None:
        """Keep only the requests at positions `keep` (in that order), and what is kept of their values under
        their new positions (a server's batch changes every few steps; its requests' counts do not)."""
        self.requests = [self.requests[b] for b in keep]
        where = {old: new for new, old in enumerate(keep)}
        for table in self._tables.values():
            table.rows = [table.row(b) for b in keep]
        for key, kind in self._memo.items():
            # each request's value under its new position (a sum over rows, keyed by the rows: dropped)
            self._memo[key] = {memo: {where[b]: v for b, v in value.items() if b in where}
                               for memo, value in kind.items() if memo[0] == "per request"}

    def rate(self, key: tuple, b: int, d: int) -> float:
        """P(accepted >= d | accepted >= d - 1) for request b."""
        return self._depths(key, b, d)[d - 1][0]

    def trials(self, key: tuple, b: int, d: int) -> float:
        """Trials at depth d counted for request b (its own and the pooled ones)."""
        return self._depths(key, b, d)[d - 1][1]

    def _depths(self, key: tuple, b: int, cap: int) -> List[Tuple[float, float]]:
        """(rate, trials) of request b at depths 1 .. cap: the request's own counts with the pooled rate as a
        prior of ``pooled_weight`` trials, the pooled rate drawn towards ``prior_rate`` with ``prior_weight``
        (:meth:`_table` computes the same for every request and kind at once)."""
        pooled = self.pooled.get(key)
        own = self.requests[b].get(key) if b < len(self.requests) else None
        pt = pooled.trials if pooled is not None else ()
        ot, oh = (own.trials, own.hits) if own is not None else ((), ())
        out = []
        priors = self._pooled_rates(pooled, cap)
        for i in range(cap):
            t0 = pt[i] if i < len(pt) else 0.0
            t1, h1 = (ot[i], oh[i]) if i < len(ot) else (0.0, 0.0)
            out.append(((h1 + self.pooled_weight * priors[i]) / (t1 + self.pooled_weight), t0 + t1))
        return out

    def _prior(self, key: tuple, depth: int) -> List[float]:
        """Kind `key`'s pooled rates at depths 1 .. depth (:meth:`_pooled_rates`), kept until it is observed (a
        table is rebuilt after an observation of any kind of its drafters; the others' pooled counts have not
        changed)."""
        kept = self._priors.get(key)
        if kept is None or len(kept) < depth:
            kept = self._priors[key] = self._pooled_rates(self.pooled.get(key), depth)
        return kept if len(kept) == depth else kept[:depth]

    def _pooled_rates(self, pooled: Optional[_Counts], cap: int) -> List[float]:
        """The pooled rates at depths 1 .. cap: each depth's pooled counts with a prior of ``prior_weight``
        trials at ``prior_rate`` for the first depth and, with ``chain_prior``, at the pooled rate of the
        depth above for the deeper ones."""
        pt, ph = (pooled.trials, pooled.hits) if pooled is not None else ((), ())
        weight, above, out = self.prior_weight, self.prior_rate, []
        for i in range(cap):
            t0, h0 = (pt[i], ph[i]) if i < len(pt) else (0.0, 0.0)
            rate = (h0 + weight * above) / (t0 + weight)
            out.append(rate)
            if self.chain_prior:
                above = rate
        return out

    def expected(self, key: tuple, b: int, cap: int, optimistic: bool = False) -> float:
        """E[accepted] of request b for a tree of depth `cap`; ``optimistic``: with every rate raised by
        1 / sqrt(1 + its trials) (an upper confidence bound: what a kind could still turn out to give).
        Each P(accepted >= d) is at most that of any kind of the same drafters with a larger node budget
        observed since this one was (whose tree holds this one's best nodes: what it did not accept, this one
        would not have either), and at least the estimate (not the optimistic one) of any narrower kind
        observed since this one was, at the depths its trees reached (what it accepted, this tree would have
        too), so that the widest tree's steps speak for the narrower kinds and a narrow tree's for the wider
        ones; past such a floor each depth keeps this kind's own rate of going on from the depth above
        (P(>= d) = P(>= d - 1) P(>= d | >= d - 1): a narrower tree's steps that lift its first levels lift the
        deeper ones in proportion; a deep prompt-lookup chain is otherwise valued at its own old steps once
        narrower ones are chosen, and never chosen again). Steps older than this kind's own speak only for it
        (acceptance moves with the text: a drafter good on the last topic may fail on this one)."""
        if cap <= 0:
            return 0.0
        table = self._table(key, cap)
        return table.sums[optimistic][table.kinds[key]][table.row(b)][cap - 1]

    def _reach(self, key: tuple, b: int, cap: int, optimistic: bool) -> List[float]:
        """P(accepted >= d) of request b for d = 1 .. cap (or more) from kind `key`'s own rates (at their
        upper confidence bound when ``optimistic``), before any other kind bounds them."""
        table = self._table(key, cap)
        return table.reach[int(optimistic), table.kinds[key], table.row(b)].tolist()

    def _table(self, key: tuple, cap: int) -> "_Table":
        """The values of every kind of `key`'s drafters, every request and both estimates, to depth `cap`
        at least (the tuner's depth: a plan asks for every depth of every kind); computed at once, in arrays
        over (kind, request, depth), kept until an observation of these drafters (a new batch's requests read
        its pooled row)."""
        drafters = key[0]
        table = self._tables.get(drafters)
        if table is None or key not in table.kinds or table.depth < cap:
            # every kind of these drafters asked for so far (a plan asks for all of them, most before they
            # are observed), to the deepest depth asked for so far
            asked = self._asked.setdefault(drafters, set())
            asked.add(key)
            depth = max(cap, self.horizon, table.depth if table is not None else 0)
            table = self._tables[drafters] = self._build(drafters, asked, depth)
        return table

    def _build(self, drafters: tuple, asked, depth: int) -> "_Table":
        """:meth:`_table`'s arrays: (rate, trials) as :meth:`_depths`, the rates' running products (own
        reach), each kind bounded by the others of these drafters observed since it was (ceilings from the
        wider ones, floors from the narrower ones, see :meth:`expected`), their running sums."""
        kinds = list(dict.fromkeys([k for k in self.pooled if k[0] == drafters] + sorted(asked, key=repr)))
        requests = self.requests
        batch = len(requests)
        zeros = [0.0] * depth
        none = (zeros, zeros)

        def padded(counts):
            if counts is None:
                return none
            n = len(counts.trials)
            if n >= depth:
                return counts.trials[:depth], counts.hits[:depth]
            return counts.trials + zeros[n:], counts.hits + zeros[n:]

        # [kind, row, trials / hits, depth]: rows 0 .. B - 1 the requests' own counts, B none (a request without
        # counts of its own), B + 1 the pooled counts
        counts = np.array([[padded(own.get(k)) for own in requests] + [none, padded(self.pooled.get(k))]
                           for k in kinds], dtype=np.float64)
        ot, oh = counts[:, :batch + 1, 0], counts[:, :batch + 1, 1]
        pt = counts[:, batch + 1:, 0]  # [K, 1, D]
        prior = np.array([self._prior(k, depth) for k in kinds])[:, None, :]
        rate = (oh + self.pooled_weight * prior) / (ot + self.pooled_weight)  # [K, B + 1, D]
        trials = pt + ot
        rates = np.stack([rate, np.minimum(1.0, rate + 1.0 / np.sqrt(1.0 + trials))])  # [estimate, optimistic]
        own = np.cumprod(rates, axis=-1)  # [2, K, B + 1, D]
        # which kinds bound which (only those observed since, and only kinds with a budget)
        budget = np.array([np.nan if k[1] is None else float(k[1]) for k in kinds])
        last = np.array([self._last.get(k, -1) for k in kinds], dtype=np.float64)
        pooled = np.array([k in self.pooled for k in kinds])
        since = pooled[None, :] & (last[None, :] > last[:, None])  # [i, j]: j observed since i was
        wider = since & (budget[None, :] > budget[:, None])  # (nan compares false: no budget, no bound)
        narrower = since & (budget[None, :] < budget[:, None])
        ceiling = np.where(wider[None, :, :, None, None], own[:, None], 1.0).min(axis=2)
        reach = np.minimum(own, ceiling)
        floored = np.flatnonzero(narrower.any(axis=1))
        if len(floored):
            # (a narrower kind is a floor at the depths its trees reached only: past them its values are the
            # prior's extrapolation, and it accepted nothing there)
            reached = np.array([len(self.pooled[k].trials) if k in self.pooled else 0 for k in kinds])
            within = np.arange(depth)[None, :] < reached[:, None]  # [K, D]
            floor = np.where(narrower[floored][:, :, None, None] & within[None, :, None, :], own[0][None],
                             0.0).max(axis=1)
            # past a floor, each depth keeps the kind's own rate of going on from the depth above:
            # P(>= d) = max(its bounds' value, min(P(>= d - 1) * rate(d), ceiling(d)))
            # (depth first: each step of the recurrence reads and writes contiguous rows)
            # ([2, F, B + 1, D] -> [D, 2, F, B + 1]; transpose, not moveaxis: a fifth of this build's time was
            # moveaxis's own argument handling)
            bounded = np.ascontiguousarray(np.maximum(reach[:, floored], floor[None]).transpose(3, 0, 1, 2))
            going = np.ascontiguousarray(rates[:, floored].transpose(3, 0, 1, 2))
            top = np.ascontiguousarray(ceiling[:, floored].transpose(3, 0, 1, 2))
            chained = np.empty_like(bounded)
            above = np.ones(bounded.shape[1:])
            for d in range(depth):
                p = chained[d]
                np.multiply(above, going[d], out=p)
                np.minimum(p, top[d], out=p)
                np.maximum(p, bounded[d], out=p)
                above = p
            reach[:, floored] = chained.transpose(1, 2, 3, 0)
        sums = np.cumsum(reach, axis=-1)
        return _Table({k: i for i, k in enumerate(kinds)}, depth, batch, sums.tolist(), own)

    def probe_depth(self, key: tuple) -> int:
        """How deep a probe of kind `key` goes, at most, once it was tried: two levels past the deepest level
        at which any kind of its drafters had a draft accepted, or 1 if none ever was (to reach a level a
        draft must pass the ones above it: a drafter never accepted is probed with its cheapest tree, not
        its deepest); unlimited before any draft of its drafters was observed."""
        deepest, seen = 0, False
        for other, counts in self.pooled.items():
            if other[0] == key[0]:
                seen = True
                for d in range(len(counts.hits), deepest, -1):
                    if counts.hits[d - 1] > 0.05:
                        deepest = d
                        break
        if not seen:  # no draft of these drafters observed: nothing to limit by
            return 1 << 30
        return deepest + 2 if deepest else 1

    def total(self, key: tuple, rows: Tuple[int, ...], cap: int, optimistic: bool = False) -> float:
        """E[accepted + 1] summed over the requests `rows` (kept until an observation of a kind of the same
        drafters)."""
        memo = (rows, cap, optimistic)
        kind = self._memo.setdefault(key, {})
        value = kind.get(memo)
        if value is None:
            # each request's E[accepted + 1] kept too: a plan after a request finished or joined sums the
            # same requests' values over new rows (one dict read each, not the bounded lists' calls)
            per = self.per_request(key, rows, cap, optimistic)
            value = kind[memo] = sum(per[b] for b in rows)
        return value

    def per_request(self, key: tuple, rows: Sequence[int], cap: int, optimistic: bool = False) -> Dict[int, float]:
        """Each request's E[accepted + 1] for kind `key` ({request: value}, holding at least `rows`; kept until
        an observation of a kind of the same drafters: read it, never write it)."""
        kind = self._memo.setdefault(key, {})
        per = kind.get(("per request", cap, optimistic))
        if per is None:
            per = kind[("per request", cap, optimistic)] = {}
        missing = [b for b in rows if b not in per]
        if missing:
            if cap <= 0:
                per.update((b, 1.0) for b in missing)
            else:  # (expected's values, read from the table once)
                table = self._table(key, cap)
                sums, row = table.sums[optimistic][table.kinds[key]], table.row
                per.update((b, 1.0 + sums[row(b)][cap - 1]) for b in missing)
        return per

    def observe(self, key: tuple, accepted: Sequence[Optional[int]], cap: int) -> None:
        """One step of kind `key` with nominal depth `cap`: accepted[b] draft tokens (None: request b
        did not take part)."""
        pooled = self.pooled.setdefault(key, _Counts())
        pooled.scale(self.decay)
        self._observations += 1
        self._last[key] = self._observations
        for b, a in enumerate(accepted):
            if a is None:
                continue
            pooled.add(a, cap)
            own = self.requests[b].setdefault(key, _Counts())
            own.scale(self.own_decay)
            own.add(a, cap)
        # the values of the other kinds of these drafters are bounded by this kind's
        for other in [k for k in self._memo if k[0] == key[0]]:
            del self._memo[other]
        self._tables.pop(key[0], None)
        self._priors.pop(key, None)


class Tuner:
    """Chooses each step's draft (:class:`Shape`) by expected tokens per second; see the module docstring.

    Pass one to ``SpeculativeDecoder(tuner=...)`` (``budget="auto"`` makes a default one). It keeps what
    it learned (costs, pooled acceptance, probe schedule) across the decoder's generations.

    Args:
        costs: a :class:`CostModel` (default: the one cached for the target, the drafters, device, dtype and threads).
        acceptance: an :class:`AcceptanceModel` (default: a new one).
        budgets: node budgets (root included) tried besides the decoder's own (those below it).
        chains: also try each depth d at a budget of d + 1 nodes (the drafters' best path alone; below the
            decoder's budget): on a 0.5B target bound by reading its weights (bf16, Zen 4 CPU) an EAGLE head at
            tau ~3 ran at 1.76x taps autoregressive without them and 1.89x with (bench/RESULTS.md).
        max_probe_interval: steps between probes of a kind that is not chosen, at most.
        margin: how much more tokens per second (a fraction) a draft must promise than a plain step (the
            predictions' own error; drafting on a tie would lose by it).
        explore: the share of the predicted time probes of kinds not chosen may lose (see :meth:`choose`).
        calibrate: measure the missing costs when a generation starts (False: only online).
        calibration_budget: seconds of timed calls per measured point of the calibration (at least one
            call): a target whose forward takes longer is timed fewer times (see :func:`time_call`).
        timer: the clock of every measurement (default ``time.perf_counter``, wall time; on a CPU shared
            with other jobs and one thread, ``time.process_time`` leaves their load out).
        refresh: steps between recomputations of the candidates' values after observed drafts, at least
            (1: every step that follows one; a plan of no draft is repeated without planning only from
            values that hold every observation); a draft chosen as the best is chosen again without pricing
            the candidates until their values are recomputed, while the requests, groups, matches and
            appends stay the same (pricing costs ~0.2 ms a plan on the CPU, ~20% of a prompt-lookup step).
        recompute_share: the share of the decoding time recomputing the candidates' values may take: after a
            recomputation that took ``t`` seconds the next waits at least ``t / (recompute_share * plain)``
            steps (``plain``: a plain step's predicted seconds), and at least `refresh` (a recomputation is
            0.6-0.9 ms within decoding on the CPU: ~100% of a plain step of the shipped models at batch 1, where
            recomputing every 4 steps cost ~10% of prompt lookup's time, and 1-2% of one of a 0.5B target's).
            Recomputations that wait on the share take about that share of the time wherever drafts are
            observed often: 0.02 measured 2.6% (prompt lookup) and 4% (merged-budget + lookup) faster than 0.05
            on the shipped models (bf16, T = 0), the same at T = 1 and for an EAGLE head.
        finish_time: where a batch ends with its last request (``plan(left=)``: a ``generate`` call of several
            prompts), value each candidate by how much it shortens that end rather than by its tokens
            (:meth:`_finish`); False: by tokens everywhere.
    """

    def __init__(self, costs: Optional[CostModel] = None, acceptance: Optional[AcceptanceModel] = None, *,
                 budgets: Sequence[int] = (2, 4, 8), max_probe_interval: int = 256, margin: float = 0.05,
                 explore: float = 0.01, calibrate: bool = True, calibration_budget: float = 0.05,
                 timer: Callable[[], float] = time.perf_counter, refresh: int = 4, chains: bool = True,
                 recompute_share: float = 0.02, finish_time: bool = True):
        self.costs = costs
        self.acceptance = acceptance or AcceptanceModel()
        #: an acceptance model per verification mode (greedy, sampled): their rates differ
        self._modes: Dict[bool, AcceptanceModel] = {False: self.acceptance}
        self.budgets = tuple(sorted({int(n) for n in budgets if int(n) >= 2}))
        self.chains = bool(chains)
        self.max_probe_interval = int(max_probe_interval)
        self.margin = float(margin)
        self.calibrate = calibrate
        if not calibration_budget > 0:
            raise ValueError(f"Tuner: calibration_budget must be > 0 seconds, got {calibration_budget!r}")
        self.calibration_budget = float(calibration_budget)
        if int(refresh) < 1:
            raise ValueError(f"Tuner: refresh must be >= 1 step, got {refresh!r}")
        if not 0 < float(recompute_share) <= 1:
            raise ValueError(f"Tuner: recompute_share must be in (0, 1], got {recompute_share!r}")
        self.recompute_share = float(recompute_share)
        #: value a batch's steps by how much they shorten its end where no request joins (see _finish)
        self.finish_time = bool(finish_time)
        self.timer = timer
        self.clock = 0
        self._probe: Dict[tuple, Tuple[int, int]] = {}  # kind -> (next step, interval)
        #: running mean of the nodes per request the forward ran for each (kind, depth, budget): trees of
        #: prompt lookup, merged trees and shallow candidates hold fewer than their budget
        self._nodes: Dict[tuple, float] = {}
        #: for the kinds of drafters that propose for some requests only (prompt lookup: those with a
        #: match, :meth:`plan`'s ``ready``): running mean of the nodes below the root per request that drafted
        self._extra: Dict[tuple, float] = {}
        self._free: set = set()  # the keys of those kinds
        self._plan_ready: Dict[int, int] = {}  # per such group: the requests it could draft for at the last plan
        self._shape_memo = None
        self._plan_memo = None
        #: per kind key: the running ratio of its steps' measured seconds to its price when chosen (at whatever
        #: batch: a server's changes every few steps), which scales its price (see observe); _fix_set: per set of
        #: drafters (a kind key's first part), the same ratio over every kind of that set, which scales the
        #: prices of all of them (a drafted kind's _fix is then its own ratio to that: see _price_fix); _priced:
        #: the last choice's (shape, batch, price before the ratios, the set's ratio then)
        self._fix: Dict[tuple, float] = {}
        self._fix_set: Dict[tuple, float] = {}
        self._priced: Optional[tuple] = None
        #: seconds the last plan spent recomputing the candidates' values (0 when it did not): the decoder leaves
        #: them out of the step it times (a drafted step's time includes its plan, which after a run of plain
        #: steps recomputes: at T = 1 the first drawn chain after plain steps read 1.2x a chain's time with it,
        #: and those steps' prices kept the table's auto row at plain steps in some runs); the recomputations
        #: are held to recompute_share of the time instead
        self.recomputed = 0.0
        #: the last plan's draft (not a probe): (what it was chosen over, the groups' appends then, the shape,
        #: its groups' positions); see plan
        self._last_draft = None
        self._every_idle = False  # whether every group was idle at the last plan
        self._plan_idle: frozenset = frozenset()  # the idle groups of the last plan that chose
        self._plan_version = 0  # the version (below) at the last plan that priced the candidates
        #: per sampling mode (see begin): the last plan memo computed for requests with no counts of their own,
        #: what a new batch's first plan starts from; _sampling: the mode of the current batch
        self._fresh: Dict[bool, tuple] = {}
        self._sampling = False
        self._version = 0  # counts observations of drafts (the plan's cached part depends on them)
        self._plain_until = 0  # while no draft is best: the clock of the next probe that could win
        self._requests: Optional[int] = None  # the active requests of the plan being made (see choose)
        self.explore = float(explore)
        self._credit: Optional[float] = None  # seconds the probes may still lose (see choose)
        self._charge: Optional[tuple] = None  # the last probe's charge, until it is observed (see observe)
        #: per kind key: the running mean of the seconds a step of it took beyond its price where the step before
        #: was of another kind (see observe); plan adds it to such a step's price
        self._switch: Dict[tuple, float] = {}
        self._accrual = 0.0  # the credit one step adds
        #: while plain steps run with no probe near, one in this many is observed (see observes)
        self.plain_sample = 16
        #: a plan recomputes the candidates' values after observed drafts at most once in this many steps,
        #: and in as many more as recompute_share asks (each recomputation prices every candidate again: most
        #: of a plan's cost, paid on most steps where a drafter is chosen; a value a few steps old moves by a
        #: few observations' worth)
        self.refresh = int(refresh)
        #: whether the last plan's shape is a probe (a kind tried for what it could give, not the best one)
        self.probing = False

    # -- the candidate set ---------------------------------------------------------------------------
    def kinds(self, groups: Sequence[Tuple[int, ...]], single: bool) -> List[Tuple[Tuple[int, ...], ...]]:
        """Allowed sets of drafter groups: every non-empty subset (all groups together when ``single``)."""
        if single or len(groups) > 4:
            return [tuple(groups)]
        out = []
        for mask in range(1, 1 << len(groups)):
            out.append(tuple(g for i, g in enumerate(groups) if mask >> i & 1))
        return out

    def candidates(self, sets, depth: int, budget: int) -> List[Shape]:
        """Every (drafter set, depth, node budget) shape: the budgets below the decoder's, and its own; with
        :attr:`chains`, also each depth's chain budget (depth + 1 nodes: the best path alone, what pays where a
        tree forward costs about a plain one and a drafter is confident, e.g. a target bound by reading its
        weights)."""
        out = []
        below = set(n for n in self.budgets if n < budget)
        if self.chains:
            below |= {d + 1 for d in range(1, depth + 1) if d + 1 < budget}
        for groups in sets:
            drafters = tuple(sorted(t for g in groups for t in g))
            for n in sorted(below) + [budget]:
                for d in range(1, min(depth, n - 1) + 1):
                    out.append(Shape(drafters, d, n))
        return out

    # -- choosing ---------------------------------------------------------------------------------------
    def value(self, shape: Shape, active: Sequence[int], cap: int) -> float:
        """E[accepted + 1] summed over the active requests."""
        if not shape.drafters:
            return float(len(active))
        return self.acceptance.total(shape.key, tuple(active), cap)

    def choose(self, options: Sequence[Tuple[Shape, float, float, float]]) -> Shape:
        """The shape to run from (shape, value, predicted seconds, an optimistic value: its acceptance
        rates at an upper confidence bound) options (the first is no draft): the best value per second,
        unless a kind not chosen (no draft included) is due for a probe, could beat it with its optimistic
        value (and its price before its running ratio, :meth:`_price_fix`), and its predicted loss is covered by
        the exploration credit (then its deepest such shape:
        every depth observed at once, once tried no deeper than :meth:`AcceptanceModel.probe_depth`; of
        the widest such kind); a probed kind's interval doubles, and the narrower kinds of its drafters
        wait as long (its outcome bounds theirs).

        A kind's first try is free; the credit starts at what ``max_probe_interval`` steps add and holds
        at most that; it grows by ``explore`` times the best shape's predicted seconds every step, and a
        later probe spends its predicted loss: the seconds it takes beyond what the best shape would take for the
        tokens it is expected to give; once observed, any probe (a first try too) also spends what it lost
        beyond its charge (:meth:`observe`). So probes cost about that share of the time whatever they cost
        each (a tree over a batch of 8 costs several plain steps, one over a single request little more
        than one) and however their predictions err."""
        margin = 1.0 + self.margin
        best_shape, best_value, best_seconds, _ = max(
            options, key=lambda o: o[1] / max(o[2], 1e-9) * (1.0 if o[0].drafters else margin))
        rate = best_value / max(best_seconds, 1e-9)
        self.clock += 1
        clock, probe = self.clock, self._probe
        best_key = best_shape.key
        probe[best_key] = (clock + 1, 1)
        self._accrual = self.explore * best_seconds
        # the credit starts full (a new tuner may try the kinds at once), and holds at most what
        # max_probe_interval steps add
        top = self._accrual * self.max_probe_interval
        self._credit = top if self._credit is None else min(self._credit + self._accrual, top)
        credit, accrual = self._credit, self._accrual
        due: Dict[tuple, Tuple[Shape, float]] = {}
        ready = clock + self.max_probe_interval  # the first step some kind could be probed at
        fix = self._price_fix if self._learns_fix() else None
        for shape, value, seconds, upper in options:
            # could it win: its acceptance at the upper bound, its price before its kind's running ratio (the
            # steps' correction of the price as a whole, _fix): a ratio that early or unlucky steps pushed up is
            # corrected only by the kind's own steps, and a kind it priced out was never chosen to correct it (the
            # n-gram table at a batch of 1, fp32: prices 1.4-1.7x what its steps took, whole answers decoded plain
            # where its chains give 1.5x)
            # (never above its price: a ratio below 1 is no reason to probe less)
            optimistic = seconds / max(fix(shape.key), 1.0) if fix is not None and shape.drafters else seconds
            if upper <= rate * optimistic:
                continue
            key = shape.key
            if key == best_key:
                continue
            # a kind's first try is free (a new tuner tries every kind that could win once)
            tried = key in probe
            # (its charge too: at the optimistic price; once observed, a probe spends what it lost beyond its charge,
            # so probes still lose about `explore` of the time whatever the prices say)
            loss = 0.0 if not tried else max(optimistic - value / rate, 0.0) if rate > 0 else optimistic
            at = probe.get(key, (0, 1))[0]
            if loss > credit:
                at = max(at, clock + (int((loss - credit) / accrual) + 1 if accrual > 0 else self.max_probe_interval))
            elif at <= clock:
                if tried and shape.depth > self.acceptance.probe_depth(key):
                    continue
                old = due.get(key)
                if old is None or (shape.depth, shape.budget) > (old[0].depth, old[0].budget):
                    due[key] = (shape, loss)
            ready = min(ready, at)
        self._plain_until = ready if not best_shape.drafters else 0
        if not due:
            return best_shape
        # the widest due kind first (of the drafters due longest): its tree holds the narrower kinds' best
        # nodes, so its outcome bounds theirs (AcceptanceModel.expected), and it counts as their probe too
        key = max(due, key=lambda k: (k[1], -probe.get(k, (0, 1))[0]))
        shape, loss = due[key]
        self._credit -= loss
        self.probing = True
        # what the probe was charged, the best shape's tokens per second, the active requests (those plan() was
        # given; else no draft's value, its tokens, one a request): its observation
        # charges what it lost instead (see observe)
        self._charge = (shape, loss, rate, self._requests if self._requests is not None else options[0][1])
        interval = min(probe.get(key, (0, 1))[1] * 2, self.max_probe_interval)
        probe[key] = (clock + interval, interval)
        for other in {o[0].key for o in options}:
            if other[0] == key[0] and other[1] < key[1] and other != best_key:  # (drawn kinds apart: key[0])
                at, old = probe.get(other, (0, 1))
                if at < clock + interval:
                    probe[other] = (clock + interval, max(old, interval))
        self._plain_until = 0
        return shape

    # -- the decoder's calls ------------------------------------------------------------------------------
    # -- what it learned, across processes -------------------------------------------------------------
    #: the attributes :meth:`state_dict` holds besides the cost model and the acceptance models
    _STATE = ("clock", "_probe", "_nodes", "_extra", "_free", "_plain_until", "_credit", "_accrual", "_fix",
              "_fix_set", "_switch")

    def state_dict(self) -> dict:
        """What the tuner measured and learned (its cost model, the pooled acceptance of each verification mode,
        the probe schedule, the trees' node counts), as plain values; a batch's own requests are not kept."""
        costs = self.costs.state_dict() if type(self.costs) is CostModel else None
        return {"costs": costs, "modes": {mode: model.state_dict() for mode, model in self._modes.items()},
                **{name: copy.deepcopy(getattr(self, name)) for name in self._STATE}}

    def load_state_dict(self, state: dict) -> None:
        """Take what :meth:`state_dict` gave (another tuner's, or this one's earlier); the settings given to the
        constructor stay. A cost model in `state` replaces this tuner's (a decoder then calibrates only the
        batch sizes it lacks)."""
        if state["costs"] is not None:
            if self.costs is None or type(self.costs) is not CostModel:
                self.costs = CostModel()
            self.costs.load_state_dict(state["costs"])
        template = self._modes[False]
        self._modes = {}
        for mode, values in state["modes"].items():
            model = copy.copy(template)  # (its settings; its own requests and memo, load_state_dict the rest)
            model.requests, model._memo, model._tables, model._asked, model._priors = [], {}, {}, {}, {}
            model.load_state_dict(values)
            self._modes[bool(mode)] = model
        if False not in self._modes:
            self._modes[False] = template
        self.acceptance = self._modes[False]
        for name in self._STATE:
            if name in state:  # (a state saved before the name was kept: this tuner's own stays)
                setattr(self, name, copy.deepcopy(state[name]))
        self._plan_memo = self._shape_memo = self._last_draft = self._priced = None
        self._fresh = {}
        self._version += 1

    def save(self, path, fingerprint: Optional[dict] = None, judges: Optional[dict] = None) -> None:
        """Write :meth:`state_dict` to `path` (JSON), with `fingerprint` (what it was measured on:
        :meth:`SpeculativeDecoder.tuner_fingerprint`), which :meth:`load` checks, and `judges` (plain values: the
        states of the judges of the same decoder's runs, :mod:`taps.judge`), which :meth:`load` returns."""
        import json
        import os

        data = {"format": "taps.Tuner", "version": _STATE_VERSION, "fingerprint": fingerprint,
                "state": _to_json(self.state_dict())}
        if judges is not None:
            data["judges"] = _to_json(judges)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)  # a reader never sees half a file

    def load(self, path, fingerprint: Optional[dict] = None) -> Optional[dict]:
        """Take the state :meth:`save` wrote to `path`; returns the judges' states saved with it (None: none).
        ValueError when it is not such a file, or was saved with another fingerprint than `fingerprint` (another
        model, drafters, device, dtype, thread count or CPU: its costs and acceptance would mislead), naming what
        differs."""
        import json

        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"Tuner.load: {path} is not a tuner state written by Tuner.save ({e})") from None
        if not isinstance(data, dict) or data.get("format") != "taps.Tuner":
            raise ValueError(f"Tuner.load: {path} is not a tuner state written by Tuner.save")
        if data.get("version") != _STATE_VERSION:
            raise ValueError(f"Tuner.load: {path} holds state version {data.get('version')}, this taps reads "
                             f"{_STATE_VERSION}")
        saved = data.get("fingerprint")
        if fingerprint is not None and saved != fingerprint:
            keys = sorted(set(saved or {}) | set(fingerprint))
            diff = [f"{k}: {(saved or {}).get(k)!r} there, {fingerprint.get(k)!r} here" for k in keys
                    if (saved or {}).get(k) != fingerprint.get(k)]
            raise ValueError(f"Tuner.load: {path} was measured on another setup ({'; '.join(diff)})")
        judges = _from_json(data.get("judges"))
        if judges is not None and not isinstance(judges, dict):
            raise ValueError(f"Tuner.load: {path} holds judge states that are not a dict")
        self.load_state_dict(_from_json(data["state"]))
        return judges

    def begin(self, batch: int, sampling: bool) -> None:
        """A generation of `batch` requests starts; ``sampling``: verification samples (temperature > 0),
        whose acceptance is kept apart from greedy verification's."""
        if sampling not in self._modes:
            self._modes[sampling] = copy.deepcopy(self._modes[False])
            self._modes[sampling].pooled.clear()
            self._modes[sampling]._forget()  # (nothing computed from greedy verification's counts either)
        self.acceptance = self._modes[sampling]
        self.acceptance.reset(batch)
        # the candidates' values a first plan computed for requests without counts of their own (the pooled
        # ones, what this batch's requests start from): the first plan prices the candidates from them while
        # they stand (no draft observed since, or within their refresh), instead of computing every value
        # again (250-450 us a generation on the shipped models); it plans as after any recomputation (the
        # last plan's answer is not repeated unpriced: it was made for the last batch's requests)
        self._sampling = sampling
        self._plan_memo = self._fresh.get(sampling)
        self._plan_version = -1
        self._last_draft = None

    def plan(self, groups: Sequence[Tuple[int, ...]], caps: Callable[[int, int], int], pending: Sequence[int],
             active: Sequence[int], batch: int, depth: int, budget: int, single: bool = False,
             idle: Sequence[int] = (), drawn: Sequence[int] = (), drawn_only: Union[bool, Sequence[int]] = False,
             candidates: Optional[Callable[[int, int], int]] = None,
             ready: Optional[Sequence[Optional[Sequence[int]]]] = None,
             starting: Optional[Sequence[int]] = None,
             drawn_nodes: Optional[Callable[[int, int], int]] = None,
             left: Optional[Sequence[int]] = None, previous: Optional[tuple] = None) -> Shape:
        """This step's draft.

        Args:
            groups: each drafter group's drafter indices.
            caps: ``caps(group position, depth)``: the deepest node that group's draft of `depth` levels
                can propose.
            pending: tokens per request each group has yet to append (it appends them before drafting).
            active: requests still generating.
            batch: rows of the step (finished requests included).
            depth, budget: the decoder's depth and node budget (the largest shape).
            single: whether the strategy needs every group at once.
            idle: positions of groups that have nothing to propose this step (a prompt lookup without a
                match): no kind with one of them is a candidate (unless ``single``).
            drawn: positions of groups whose kinds of that group alone may be drawn too (:attr:`Shape.drawn`:
                some request samples); ``drawn_only``: those kinds are drawn only (True), or those of the groups at
                these positions (an n-gram table's: its drawn chain is also its cheap greedy draft, its top-k tree
                the generic expansion over its logits).
            candidates: ``candidates(group position, depth)``: the most nodes below the root that group's
                top-k draft of `depth` levels proposes (an EAGLE expansion: top_k + (depth - 1) top_k^2). A
                top-k shape not yet run is predicted at its budget's nodes or, when fewer, at its groups'
                candidates plus the root (a depth-1 draft of top_k 4 under a budget of 16 is a 5-node tree);
                once run, at the nodes it ran. Without it, at its budget's nodes.
            ready: per group position, the active requests it has something to propose for this step, for
                the groups that know before drafting (prompt lookup: the requests with a match; None for a
                group that always proposes; an empty one is idle). A kind of such groups only is valued over
                those requests (E[accepted + 1] of each, as observed on its steps' requests that drafted,
                and one token for each other request) and priced at the nodes its drafting requests ran
                below their roots, times their share of the batch: a step where many requests have a match
                may pay where one with a single match does not.
            starting: per group, the tokens of `pending` that it would start on (a group not started yet:
                its prompts and the steps folded into them), priced as a start (:meth:`CostModel.start`), the
                rest as an append; None: every group started.
            drawn_nodes: ``drawn_nodes(budget, depth)``: the nodes (root included) a drawn draft of that budget
                and depth runs; a drawn shape that runs fewer nodes than its budget, where the drawn shape of
                that many nodes at its depth is a candidate too, is left out (the same tree under two kinds:
                at depth 2 and top_k 1 a budget of 4 draws the 3-node chain a budget of 3 does, and the two
                kinds had split its observations, first tries and probes).
            left: per active request (as `active`), the tokens it may still emit, where the batch ends with its
                last request (no request joins it: :meth:`SpeculativeDecoder.generate`); with
                :attr:`finish_time`, each candidate is then valued by how much it shortens the batch's end
                (:meth:`_finish`). None: by its tokens (a server's rows are refilled as requests finish).
            previous: the kind (:attr:`Shape.key`) of the step before this one (None: none known): a kind other
                than it is priced with its switch cost (:meth:`observe`).
        """
        costs = self.costs
        self.probing = self._every_idle = False
        self._charge = None
        self.recomputed = 0.0
        groups = tuple(groups)
        finish = self.finish_time and left is not None and len(active) > 1
        self._requests = len(active)
        idle = frozenset(idle) if not single else frozenset()
        counts: Dict[int, int] = {}  # per group that proposes for some requests only: how many now
        if ready is not None:
            ready = [None if r is None else tuple(r) for r in ready]
            counts = {i: len(r) for i, r in enumerate(ready) if r}
            if not single:
                idle = idle | set(_idle(ready))
        free = None if ready is None else tuple(r is not None for r in ready)
        drawn = frozenset(drawn)
        drawn_only = drawn_only if isinstance(drawn_only, bool) else frozenset(drawn_only)
        memo = (groups, depth, budget, single, tuple(active), batch, drawn, drawn_only, free)
        last, cached = self._last_draft, self._plan_memo
        inputs = (memo, ready, idle)
        queued = (tuple(pending), None if starting is None else tuple(starting))
        if (last is not None and last[0] == inputs and cached is not None and self._values_stand(cached)
                and _same_appends(last, queued, lambda i, n, p: n == p or abs(
                    costs.update(groups[i], n, batch) - costs.update(groups[i], p, batch))
                    <= 0.01 * costs.forward(1, batch))):
            # the draft the last plan chose (not a probe) over the same requests, groups, matches and appends (its
            # own groups' priced within 1% of a plain step of what they were: a host drafter's append costs ~nothing
            # whatever its tokens, where drawn chains' varying accepted counts had sent ~70% of a table's drafted
            # steps through the whole plan, 45-60 us against 16 for this),
            # while the candidates' values it was chosen on stand (see refresh): again, without pricing every
            # candidate (a probe that comes due waits until they are recomputed)
            return self._again(last[2])
        self._last_draft = None
        if cached is not None and cached[0] == memo and self._plan_version == self._version \
                and self._values_stand(cached) and idle >= self._plan_idle \
                and all(c <= self._plan_ready.get(i, 0) for i, c in counts.items()) and self.coast():
            # no draft was best and nothing a draft's value depends on changed since (no draft observed, the
            # values it was priced on standing: current, or stale within the refresh), while what drafting
            # would cost only grew (its pending appends) and no group idle then has something now, nor has a
            # prompt lookup more requests to propose for: no draft again, until a probe is due
            return NONE
        self._plan_idle = idle
        self._plan_ready = counts
        self._plan_version = self._version
        plain, learns = costs.forward(1, batch) + costs.rest(NONE.key), self._learns_fix()
        if groups and len(idle) == len(groups):
            # no group has anything to propose (prompt lookup without a match): nothing to price, the choice
            # a plan whose every kind is left out would make (repeated while they stay idle, coast_token)
            self._every_idle = True
            if learns:
                self._priced = (NONE, batch, plain, 1.0)
            shape = self.choose([(NONE, self.value(NONE, active, 0), plain, len(active))])
            # the last draft stays the one to repeat when the groups have something again (at batch 1 prompt
            # lookup's match comes and goes: a step with one after a step without is priced as before)
            self._last_draft = last
            return shape
        if cached is not None and cached[0] != memo and self._values_stand(cached) and _fewer_requests(cached[0], memo):
            # only requests finished since (a batch's rows stay): the values summed over the requests left, the
            # rest as they were (a batch of 8 had recomputed everything at each request's end: ~8 recomputations
            # a generation, 3% of its time with prompt lookup)
            self._plan_memo = (memo, self._fewer_rows(cached, tuple(active))) + cached[2:]
        elif cached is None or cached[0] != memo or not self._values_stand(cached):
            started = self.timer() if learns else 0.0
            # what only an observation of a draft changes (plain steps leave it as it is), for every shape
            # (those of idle groups are left out below: a prompt lookup's match comes and goes)
            base, caps_of = [], {}  # (caps_of: each shape's depth cap, for the values over fewer requests)
            per_request: Dict[Shape, Dict[int, float]] = {}
            position = {g: i for i, g in enumerate(groups)}
            rows, acceptance = tuple(active), self.acceptance
            # the parts shapes share, each computed once: a group's depth cap and expansion per depth
            cap_of = {(g, d): caps(position[g], d) for g in groups for d in range(1, depth + 1)}
            acceptance.horizon = max([depth] + [min(budget - 1, c) for c in cap_of.values()])
            draft_of = {(g, d, False): costs.draft(g, d, batch) for g in groups for d in range(1, depth + 1)}
            draft_of.update({(groups[i], d, True): costs.draft(groups[i], d, batch, drawn=True) for i in drawn
                             for d in range(1, depth + 1)})
            most = None if candidates is None else {(g, d): candidates(position[g], d) for g in groups
                                                    for d in range(1, depth + 1)}
            for shape, members, key, index in self._shapes(groups, depth, budget, single, drawn, drawn_only,
                                                           drawn_nodes):
                d = shape.depth
                cap = min(shape.budget - 1, max(cap_of[g, d] for g in members))
                if free is not None and all(free[i] for i in index):
                    # a kind of groups that propose for some requests only: valued and priced each step over
                    # the requests it has a draft for (below); here what it costs besides the forward, and
                    # its nodes below the root per drafting request (not run yet: its budget's, or what a
                    # run kind of the same drafters, as deep or deeper and as wide or wider, ran, scaled by
                    # the budgets' ratio)
                    below = self._extra.get((key, d, shape.budget))
                    if below is None:
                        below = float(shape.budget - 1)
                        wider = [v * (shape.budget - 1) / max(n - 1, 1) for (k, dd, n), v in self._extra.items()
                                 if k[0] == key[0] and dd >= d and n >= shape.budget]
                        if wider:
                            below = min(below, min(wider))
                    self._free.add(key)
                    # each active request's E[accepted + 1] and its optimistic one (copies: the acceptance
                    # model's memo is dropped at the kind's next observation, these are kept to the refresh)
                    base.append((shape, None, (below, costs.rest(key) + sum(draft_of[g, d, False] for g in members)),
                                 (dict(acceptance.per_request(key, rows, cap)),
                                  dict(acceptance.per_request(key, rows, cap, optimistic=True))), index))
                    continue
                nodes = self._nodes.get((key, d, shape.budget))
                if nodes is None:  # not run yet: its budget, or the most its groups' top-k drafts propose
                    nodes = shape.budget
                    if most is not None and not shape.drawn:
                        nodes = min(nodes, 1 + sum(most[g, d] for g in members))
                    # and what a run kind of the same drafters, as deep or deeper and as wide or wider, ran
                    # below its root, scaled by the budgets' ratio: its tree holds this one's (a prompt lookup
                    # proposes fewer nodes than its budget, and none for a request without a match: a packed
                    # batch's forward runs that mean); a tree that fills its budget scales to this budget
                    wider = [1.0 + (v - 1.0) * (shape.budget - 1) / max(n - 1, 1)
                             for (k, dd, n), v in self._nodes.items()
                             if k[0] == key[0] and dd >= d and n >= shape.budget]
                    if wider:
                        nodes = min(nodes, min(wider))
                seconds = costs.forward(nodes, batch) + costs.rest(key) + sum(draft_of[g, d, shape.drawn] for g in members)
                base.append((shape, acceptance.total(key, rows, cap), seconds,
                             acceptance.total(key, rows, cap, optimistic=True), index))
                caps_of[shape] = cap
                if finish:  # each request's E[accepted + 1], for the values by the batch's end (_finish)
                    per_request[shape] = dict(acceptance.per_request(key, rows, cap))
            # the next recomputation waits until the steps between make this one's time their recompute_share
            # (injected costs are not in the timer's seconds: with them the values are recomputed every `refresh`)
            self.recomputed = self.timer() - started if learns else 0.0
            wait = self.recomputed / (self.recompute_share * plain) if plain > 0 and learns else 0.0
            self._plan_memo = (memo, base, self._version, self.clock + max(self.refresh, math.ceil(wait)),
                               self.clock, caps_of, per_request)
            if all(not acceptance.requests[b] for b in rows):  # every value the pooled one (see begin)
                self._fresh[self._sampling] = self._plan_memo
        fix = self._price_fix if learns else (lambda key: 1.0)
        options = [(NONE, self.value(NONE, active, 0), plain * fix(NONE.key), len(active))]
        update = [costs.update(g, pending[i], batch) if not starting or not starting[i] else
                  costs.start(g, starting[i], batch) + costs.update(g, pending[i] - starting[i], batch)
                  for i, g in enumerate(groups)]
        appends: Dict[tuple, float] = {}  # per set of drafting groups (their positions)
        gains: list = []  # with finish: per drafted option, its requests' E[accepted + 1] (see _finish)
        for shape, value, seconds, upper, members in self._plan_memo[1]:
            if idle and not idle.isdisjoint(members):
                continue
            if value is None:  # a kind of groups that propose for some requests only: over those requests
                (below, fixed), (values, uppers) = seconds, upper
                rows = ready[members[0]] if len(members) == 1 else set().union(*(ready[i] for i in members))
                if not rows:
                    continue
                if finish:
                    gains.append([values[b] if b in rows else 1.0 for b in active])
                others = len(active) - len(rows)
                value = sum(values[b] for b in rows) + others
                upper = sum(uppers[b] for b in rows) + others
                # (times the kind's own scale: its trees' width, not only their nodes, sets a packed
                # forward's cost, see forward_part)
                seconds = costs.forward(1.0 + below * len(rows) / batch, batch) * self._kind_scale(shape, batch)[1] \
                    + fixed
            elif finish:
                per = self._plan_memo[6]
                values = per.get(shape)
                if values is None:  # (a memo made by a plan that did not value by the end: no left, or one request)
                    values = per[shape] = dict(self.acceptance.per_request(shape.key, tuple(active),
                                                                           self._plan_memo[5][shape]))
                gains.append([values[b] for b in active])
            extra = appends.get(members)
            if extra is None:
                extra = appends[members] = sum(update[i] for i in members)
            # a draft step does all a plain step does and more: never predicted to cost less (each part's
            # online correction moves on its own, and a burst of load on a plain step can lift it past them)
            options.append((shape, value, (max(seconds, plain) + extra) * fix(shape.key), upper))
        if finish and len(options) > 1:
            options = self._finish(options, gains, active, left)
        switch = self._switch
        if switch and previous is not None:
            # a step of another kind than the one before costs its switch too (see observe); the steady prices
            # stay what observe compares a step with
            ranked = [o if o[0].key == previous else (o[0], o[1], o[2] + switch.get(o[0].key, 0.0)) + o[3:]
                      for o in options]
        else:
            ranked = options
        shape = self.choose(ranked)
        if learns:  # what the choice was priced at, before its correction (observe compares the step with it)
            chosen = next(o for o in options if o[0] is shape)
            self._priced = (shape, batch, chosen[2] / fix(shape.key), self._set_fix(shape.key))
        if shape.drafters and not self.probing and type(self).choose is Tuner.choose:
            # (a subclass's own choice is asked every step)
            index = next(o[4] for o in self._plan_memo[1] if o[0] is shape)
            self._last_draft = (inputs, queued, shape, index)
        elif not shape.drafters and last is not None and not idle.isdisjoint(last[3]):
            # no draft while the last draft's groups have nothing to propose: that draft stays the one to
            # repeat when they have something again (as at the plan where every group is idle)
            self._last_draft = last
        return shape

    def _finish(self, options: list, gains: list, active: Sequence[int], left: Sequence[int]) -> list:
        """`options` (no draft first) valued by the batch's end, for a batch no request joins (``plan(left=)``):
        each option as if the batch ran it to its end, every request b at its expected tokens a step ``mu_b``
        (at most its tokens left ``l_b``; one for the no-draft option) and so ending after ``f_b = l_b / mu_b``
        steps, and each step at a batch of ``i`` requests costing ``c(i) / c(n)`` of its own (``c``: a plain
        step's predicted seconds at a batch of i): its time ``seconds * R(f) / c(n)`` with ``R(f) = sum_i f_(i)
        (c(i) - c(i - 1))`` over the end steps from the last one down (``c(0) = 0``). An option's value becomes
        the tokens a step gives at the rate of that run, ``sum(l) * c(n) / R(f)``: n tokens for a plain step
        where the requests end together, and for a draft that gives every request as much; less where requests
        would end apart and the last steps run a few requests at about a whole step's cost (at a batch of 1
        most of a step is the weights' pass and the host's work). `gains`: per drafted option, each active
        request's E[accepted + 1] (one where a kind of prompt lookup has no draft for it). By tokens alone
        (fp32, a batch of 8, prompt lookup with the shipped store) the tuner chose 16-node trees that gave ~40%
        more tokens a step to the requests that matched, which then ended far ahead of the others; the last
        third of the generation ran at batches of 1-3, and the whole at 0.97x autoregressive decoding against
        1.11x for budgets of 4 or 8. The optimistic values are scaled as their estimates are."""
        n = len(active)
        costs, rest = self.costs, self.costs.rest(NONE.key)
        # (~24 us at a batch of 8 and 30 options; the ends sorted up, the marginal costs reversed)
        steps = [0.0] + [costs.forward(1, k) + rest for k in range(1, n + 1)]
        marginal = [max(b - a, 0.0) for a, b in zip(steps, steps[1:])]
        whole = sum(marginal)
        if whole <= 0:
            return options
        lv = [max(float(x), 1.0) for x in left]
        rate = np.array([[1.0] * n] + gains)  # (row 0: no draft)
        ends = np.sort(np.array(lv) / np.minimum(rate, lv), axis=1)
        values = (sum(lv) * whole / (ends @ np.array(marginal[::-1]))).tolist()
        out = [(options[0][0], values[0], options[0][2], values[0])]
        for (shape, value, seconds, upper), v in zip(options[1:], values[1:]):
            out.append((shape, v, seconds, upper * v / value if value > 0 else upper))
        return out

    def _fewer_rows(self, cached: tuple, rows: Tuple[int, ...]) -> list:
        """A plan memo's values over requests `rows` (a subset of those it was computed over): each kind's
        E[accepted + 1] and optimistic one summed over them (each request's value read from the acceptance
        model, as kept), the predicted seconds and the per-request values of prompt lookup's kinds as they
        were."""
        acceptance, caps_of = self.acceptance, cached[5]
        return [entry if entry[1] is None else
                (entry[0], acceptance.total(entry[0].key, rows, caps_of[entry[0]]), entry[2],
                 acceptance.total(entry[0].key, rows, caps_of[entry[0]], optimistic=True), entry[4])
                for entry in cached[1]]

    def _price_fix(self, key: tuple) -> float:
        """What a kind's predicted seconds are scaled by (see observe): the no-draft step's own running ratio;
        a drafted kind's, the ratio of its set of drafters (every kind of them observed: the rarely chosen kinds,
        probes, learn from them all) times its own to that."""
        return self._fix.get(key, 1.0) * self._set_fix(key)

    def _set_fix(self, key: tuple) -> float:
        """The running ratio of a drafted kind's set of drafters (:attr:`_fix_set`); 1 for the no-draft step."""
        return self._fix_set.get(key[0], 1.0) if key[0] else 1.0

    def _learns_fix(self) -> bool:
        """Whether steps correct the prices of the kinds as a whole (:attr:`_fix`): not with injected costs."""
        return not isinstance(self.costs, FixedCosts)

    def repeats(self, shape: Shape, step: bool = False) -> bool:
        """Whether a plan now would repeat `shape`, the draft the last plan chose (not a probe), without pricing,
        as far as the tuner knows (the caller vouches that the requests, groups and appends are the same): the
        candidates' values it was chosen on stand. ``step``: the caller runs that step now without planning, and
        it is counted as a repeat (:meth:`_again`)."""
        last, cached = self._last_draft, self._plan_memo
        if last is None or last[2] != shape or cached is None or not self._values_stand(cached):
            return False
        if step:
            self._again(shape)
            self.probing = False
        return True

    def observe_accepted(self, shape: Shape, accepted: Sequence[Optional[int]], cap: int, nodes: float) -> None:
        """What a drafted step gave besides its time: the accepted draft tokens per request (the kind's acceptance)
        and its nodes per request; all a drafted step the decoder repeated without planning or timing reports
        (:meth:`repeats`), and the first part of :meth:`observe`."""
        self._version += 1
        self.acceptance.observe(shape.key, accepted, cap)
        memo = (shape.key, shape.depth, shape.budget)
        self._nodes[memo] = _ema(self._nodes.get(memo), nodes, 0.2)

    def _again(self, shape: Shape) -> Shape:
        """:meth:`choose`'s bookkeeping of a step where `shape`, the best, is chosen again without pricing."""
        self.clock += 1
        self._probe[shape.key] = (self.clock + 1, 1)
        self._accrue()
        self._plain_until = 0
        return shape

    def _accrue(self) -> None:
        """A step's exploration credit (see :meth:`choose`), on a step that :meth:`choose` did not see."""
        self._credit = min(self._credit + self._accrual, self._accrual * self.max_probe_interval)

    def coast_token(self) -> Optional["CoastToken"]:
        """Right after :meth:`plan` returned no draft: what :meth:`coast` takes to repeat that answer
        (None otherwise), with the positions of the groups that were idle then (``idle``): the answer holds
        while each of them still has nothing to propose (a group that has a match now could change it); when
        every group was idle, whatever the tuner learned since (nothing could draft)."""
        if self._every_idle:
            return CoastToken(None, self._version, self._plan_idle, every=True)
        if self._plan_memo is None or not self._values_stand(self._plan_memo):
            return None
        return CoastToken(self._plan_memo, self._version, self._plan_idle, tuple(sorted(self._plan_ready.items())))

    def coast(self, token: Optional["CoastToken"] = None, idle: Sequence[int] = (),
              ready: Optional[Sequence[Optional[Sequence[int]]]] = None, checked: bool = False) -> bool:
        """Another step of no draft without planning, where the caller knows that nothing :meth:`plan`'s
        arguments said changed since it returned no draft (the requests, the groups) and holds its
        :meth:`coast_token`: True (and the step counted) unless the tuner learned something since (a
        draft observed; not asked when every group was idle then), the candidates' values that plan stood on
        are due for their recomputation (stale ones, :meth:`_values_stand`), a group idle at that plan is not
        idle now (``idle``: the groups idle now, asked only when ``token.idle`` is not empty; derived from
        ``ready`` when not given), a group that proposes
        for some requests only has more of them now than then (``ready``, as :meth:`plan` takes it, asked
        only when ``token.idle`` or ``token.ready`` is not empty), or a probe could come due at the next step
        (then the caller plans). ``checked``: the caller checked the groups' conditions itself (`idle` and
        `ready` are not read)."""
        if not checked and ready is not None and not idle:
            idle = _idle(ready)
        if token is not None and ((not token.every and (token.memo is not self._plan_memo
                                                         or token.version != self._version
                                                         or not self._values_stand(token.memo)))
                                  or (not checked and token.idle and not token.idle.issubset(idle))
                                  or (not checked and token.ready
                                      and (ready is None or any(len(ready[i] or ()) > c for i, c in token.ready)))):
            return False
        if not self._probe_near() and (self._plan_memo is not None or (token is not None and token.every)):
            self.clock += 1
            self._accrue()
            return True
        return False

    def _shapes(self, groups, depth, budget, single, drawn=frozenset(), drawn_only=False, drawn_nodes=None):
        # (the drawn nodes by the cells they differ in: a decoder's rule is the same every step of a mode)
        sizes = None if drawn_nodes is None else tuple(drawn_nodes(n, d) for n in range(2, budget + 1)
                                                       for d in range(1, depth + 1))
        memo = (groups, depth, budget, single, drawn, drawn_only, sizes)
        if self._shape_memo is None or self._shape_memo[0] != memo:
            out = []
            position = {g: i for i, g in enumerate(groups)}
            for members in self.kinds(groups, single):
                index = tuple(position[g] for g in members)
                may_draw = len(index) == 1 and index[0] in drawn  # one group alone: its shapes drawn too
                only = may_draw and (drawn_only if isinstance(drawn_only, bool) else index[0] in drawn_only)
                shapes = self.candidates([members], depth, budget)
                held = {(s.depth, s.budget) for s in shapes}
                for shape in shapes:
                    if not only:
                        out.append((shape, members, shape.key, index))
                    if may_draw:
                        if drawn_nodes is not None:
                            nodes = drawn_nodes(shape.budget, shape.depth)
                            if nodes < shape.budget and (shape.depth, nodes) in held:
                                continue  # (the drawn shape of `nodes` nodes at this depth draws the same tree)
                        shape = shape._replace(drawn=True)
                        out.append((shape, members, shape.key, index))
            self._shape_memo = (memo, out)
        return self._shape_memo[1]

    def forward_part(self, shape: Shape, nodes: float, batch: int) -> Tuple[tuple, float]:
        """The timed part a step of `shape` reports its target forward as (its key in the cost model's
        scales, and the prediction the measurement corrects) at `nodes` per request: that node count's own
        (:meth:`CostModel.forward_part`); for a kind of groups that propose for some requests only, the
        kind's own, a scale on top of the node count's: a batch where one request has many matches and the
        others none packs few nodes into a wide grid, whose padding the attention still reads (at batch 8,
        23 nodes in a grid 16 wide cost 16% more than in one 4 wide)."""
        predicted = self.costs.forward_part(nodes, batch)
        if shape.key not in self._free:
            return ("forward", batch, round(nodes)), predicted
        part, scale = self._kind_scale(shape, batch)
        return part, predicted * scale

    def _kind_scale(self, shape: Shape, batch: int) -> Tuple[tuple, float]:
        """A free kind's own forward part (its key among the cost model's scales) and scale."""
        part = ("forward", batch, shape.key)
        return part, self.costs.scale.get(part, 1.0)

    def observes(self, shape: Shape) -> bool:
        """Whether the decoder should time and report (:meth:`observe`) a step of `shape`: every draft; a
        plain step while no draft is close to being tried one in :attr:`plain_sample` (those steps only
        keep the plain step's cost current, and a long run of them would pay the bookkeeping each step),
        else every one."""
        if shape.drafters or self._probe_near():
            return True
        return self.clock % self.plain_sample == 0

    def _values_stand(self, memo: tuple) -> bool:
        """Whether the candidates' values of a plan memo stand: computed since the last observation of a
        draft, or stale within the wait it set for its recomputation (see refresh and recompute_share)."""
        return memo[2] == self._version or self.clock < memo[3]

    def _probe_near(self) -> bool:
        """Whether a draft was chosen last, or a probe could come due at the next step."""
        return self._plain_until <= self.clock + 1

    def observe(self, shape: Shape, accepted: Sequence[Optional[int]], cap: int, nodes: float, batch: int,
                total: float, parts: Dict[tuple, Tuple[float, float]], updates, costs: bool = True,
                drafting: Optional[Tuple[int, int]] = None, switched: bool = False) -> None:
        """What a step of `shape` gave: accepted draft tokens per request (None: finished before it, or
        nothing drafted for it), the nominal tree depth, the nodes per request the forward ran, the step's
        seconds, its timed parts ({part: (measured, predicted)}) and group updates ((drafters, tokens,
        seconds)); ``costs=False``: the times correct no cost (a step that paid one-off costs, e.g. a kernel
        built for a new shape); ``drafting``: (the requests whose tree held more than its root, their nodes
        below the roots); ``switched``: the step followed a step of another kind. A drafted step (or a probe) that
        did corrects no cost (it ran code and data the steps before it evicted: on the CPU a drawn table chain
        after plain steps took ~1.4x what it takes in a run of them), while what a probe lost still counts against
        the exploration credit; what it took beyond its price is its kind's switch cost, which :meth:`plan` adds
        where the step before was of another kind (``previous``). A plain step after a draft corrects as before."""
        if shape.drafters:
            self.observe_accepted(shape, accepted, cap, nodes)
            cached = self._plan_memo
            if self.probing and cached is not None:
                # a probe's outcome is news (what a kind not chosen gives bounds its narrower and wider kinds):
                # the values are recomputed `refresh` steps after the last time, not as late as the share asks
                self._plan_memo = cached[:3] + (min(cached[3], cached[4] + self.refresh),) + cached[4:]
            if drafting and drafting[0] and shape.key in self._free:
                # (the real nodes: a half-precision packed forward's filler rows are not the tree's)
                memo = (shape.key, shape.depth, shape.budget)
                self._extra[memo] = _ema(self._extra.get(memo), drafting[1] / drafting[0], 0.2)
        starts = [u[:3] for u in updates if len(u) > 3 and u[3]]  # (drafters, tokens, seconds, True)
        appends = [u for u in updates if not (len(u) > 3 and u[3])]
        for group, tokens, seconds in starts:  # measured even on a step whose forward paid one-off costs
            self.costs.observe_start(group, batch, tokens, seconds)
        charge, self._charge = self._charge, None
        if not costs:
            return
        if charge is not None and charge[0] == shape and charge[2] > 0 and self._learns_fix():
            # (injected costs need not be in the timer's seconds)
            # a probe that lost more than it was charged spends the rest too: its seconds beyond what the best
            # shape would have taken for the tokens it gave (each request that took part, its accepted drafts and
            # one more; the others one each), so probes lose about `explore` of the time at most whatever the
            # predictions' errors (at a batch of 8 prompt lookup's probes were valued 12% above what they gave
            # and priced 12% below what they took, and lost several times their charge). One that lost less gets
            # nothing back (a refund let the probes that won at T = 0 make room for more of prompt lookup's
            # narrow kinds: 17% more drafted steps for the same tokens)
            _, charged, rate, active = charge
            took = [a for a in accepted if a is not None]
            gave = sum(a + 1 for a in took) + max(active - len(took), 0)
            self._credit -= max(total - gave / rate - charged, 0.0)
        priced = self._priced
        if switched and (shape.drafters or self.probing) and (
                priced is None or priced[0] != shape or priced[1] != batch or
                total >= priced[2] * priced[3] * self._fix.get(shape.key, 1.0)):
            # a drafted step (or a probe) after one of another kind corrects no price: its code and data were cold
            # (the steps before it evicted them). What it took beyond its kind's price is the kind's switch cost,
            # which plan adds to the kind where the step before was of another kind. (bf16, a batch of 8, the
            # table's drawn chains: 2.81 ms a step after a plain step against 1.92 in a run of them; their prices
            # corrected by such steps had the tuner choose plain steps, 0.90x taps AR, where a run of chains gives
            # 1.19x.) Not a plain step after a draft: a switch cost priced into plain steps kept prompt lookup
            # drafting at T = 1 (its store's row at batch 1 0.97 -> 0.88x). One that took less than its price,
            # cold as it ran, corrects it: a kind priced out by a few slow steps, then only probed among plain
            # steps, kept its price; at a batch of 8 the table's drawn chains, 12% above a plain step's tokens
            # per second, stayed priced out for whole loads
            if priced is not None and priced[0] == shape and priced[1] == batch and priced[2] > 0:
                key = shape.key
                steady = priced[2] * priced[3] * self._fix.get(key, 1.0)
                self._switch[key] = _ema(self._switch.get(key, 0.0), max(total - steady, 0.0), self.costs.alpha)
            return
        predicted = sum(p for _, p in parts.values()) + sum(self.costs.update(g, t, batch) for g, t, _ in appends) \
            + sum(self.costs.start(g, t, batch) for g, t, _ in starts)
        self.costs.observe(shape.key, batch, total, predicted, parts, appends, sum(s for _, _, s in starts))
        if priced is not None and priced[0] == shape and priced[1] == batch and priced[2] > 0:  # (set where it learns)
            # the step against what its kind was priced at when chosen: the parts' corrections leave some of a
            # step out of every part (at batch 8 a prompt-lookup tree's forward priced at its mean nodes, a
            # residual that tracks the median of a skewed distribution: its kinds were priced 20-50% below
            # what their steps took, and chosen where they lost); each kind's price is scaled by its running
            # ratio (each step moves it by at most a factor 2 times the averaging weight, as the parts'). A drafted
            # kind's ratio is also its set of drafters' (every kind of them moves it), and its own is kept against
            # that: a kind chosen seldom, as a probe or after a run of plain steps, is priced from the set's steps
            # too (an EAGLE head's seldom kinds at T = 1 took 2-2.5x their prices, their own ratios a few steps old)
            key, alpha = shape.key, self.costs.alpha
            if shape.drafters:
                self._fix_set[key[0]] = _ema(self._fix_set.get(key[0], 1.0),
                                             min(max(total / priced[2], 0.5), 2.0), alpha)
            ratio = min(max(total / (priced[2] * priced[3]), 0.5), 2.0)
            self._fix[key] = _ema(self._fix.get(key, 1.0), ratio, alpha)


_STATE_VERSION = 1


def _to_json(x):
    """Plain values with tuple, set and non-string keys spelt out for JSON (:func:`_from_json` reverses it)."""
    if isinstance(x, dict):
        return {"__dict__": [[_to_json(k), _to_json(v)] for k, v in x.items()]}
    if isinstance(x, tuple):
        return {"__tuple__": [_to_json(v) for v in x]}
    if isinstance(x, (set, frozenset)):
        return {"__set__": [_to_json(v) for v in sorted(x, key=repr)]}
    if isinstance(x, list):
        return [_to_json(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"tuner state: cannot write {type(x).__name__}")


def _from_json(x):
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    if isinstance(x, dict):
        if "__dict__" in x:
            return {_from_json(k): _from_json(v) for k, v in x["__dict__"]}
        if "__tuple__" in x:
            return tuple(_from_json(v) for v in x["__tuple__"])
        if "__set__" in x:
            return {_from_json(v) for v in x["__set__"]}
    return x


_SHARED_COSTS: Dict[tuple, CostModel] = {}
_IDENTITIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_NEXT_IDENTITY = itertools.count()


def identity(obj) -> int:
    """A number that names `obj` (a model or drafter) for as long as it lives, never reused after it is
    gone (unlike ``id``): part of the key of a shared cost model."""
    number = _IDENTITIES.get(obj)
    if number is None:
        number = _IDENTITIES[obj] = next(_NEXT_IDENTITY)
    return number


def shared_costs(key: tuple) -> CostModel:
    """The cost model kept for `key`, created empty when new. The decoder's key names the target, the
    drafters in their order (the model keys its drafter parts by drafter positions), the device, dtype
    and threads."""
    model = _SHARED_COSTS.get(key)
    if model is None:
        model = _SHARED_COSTS[key] = CostModel()
    return model


def time_call(fn: Callable[[], object], repeats: int = 2, sync: Optional[Callable[[], None]] = None,
              timer: Callable[[], float] = time.perf_counter, budget: Optional[float] = None) -> float:
    """Fewest seconds of `repeats` calls of fn, after one untimed call.

    budget: seconds the timed calls may take together, at least one call: with a model whose forward takes
    longer than budget / repeats, fewer calls (a calibration of a large model then costs a few forwards, not
    tens; the step timers correct the costs afterwards). The untimed call sets the pace.
    """
    def once() -> float:
        if sync is not None:
            sync()
        t0 = timer()
        fn()
        if sync is not None:
            sync()
        return timer() - t0

    first = once()
    best = float("inf")
    for i in range(max(int(repeats), 1)):
        if budget is not None and i > 0 and (i + 1) * min(best, first) > budget:
            break
        best = min(best, once())
    return best
