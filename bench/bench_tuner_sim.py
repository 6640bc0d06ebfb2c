"""The tuner against simulated drafts: how close ``taps.Tuner``'s choices come to the best fixed draft shape.

    PYTHONPATH=python python bench/bench_tuner_sim.py                      # costs of the 0.5B synthetic target
    PYTHONPATH=python python bench/bench_tuner_sim.py --forward 1:1,4:1.5,8:1.8,16:2.5 --rates 0 0.6

No model and no clock: the real :class:`taps.Tuner` (its acceptance model, candidates, probes and credit)
plans every step of a decoding of one request, and a simulation answers. Costs are fixed
(:class:`taps.tuner.FixedCosts`), in units of one plain autoregressive step: the target's forward over a
tree of n nodes (``--forward``, points interpolated linearly; the default is what the tuner calibrated for
``bench_e2e_synthetic.py --shape llama-0.5b`` on the development CPU, Intel Xeon with AVX-512, fp32, 1
thread, 2026-12-03), each drafter level (``--draft``) and each token the drafter appends (``--update``).
Drafts: a calibrated drafter whose top-1 candidate is the target's token with probability ``a``
(``--rates``) at every node and its rank-j candidate with a (1 - a)^(j - 1) (times ``--others``: 0 models
``bench_e2e_synthetic.py``'s oracle, whose other candidates are random); a draft of depth d and budget
n holds what an EAGLE-2 expansion keeps, min(n, 1 + top_k + (d - 1) top_k^2) nodes: the likeliest paths of
ranks (see ``Drafts``), and accepts the target's path as far as the tree holds it. The tuner is told the
expansion's candidate count, as the decoder tells it (``Tuner.plan(candidates=)``; ``--no-candidates``: it
is not, and predicts a shape it has not run at its budget's nodes). The tuner's rows run ``--seeds``
decodings of ``--tokens`` tokens each with a new tuner, so their first steps are its learning.

Columns: tokens per plain step's time (the ratio to taps autoregressive decoding), the mean and the worst
over seeds; the best fixed shape's expected ratio (what a user who knew ``a`` would set) and the tuner's
mean as a share of it; the share of plain steps and the shapes chosen most. Everything is deterministic
(seeded): a change to the tuner can be compared here without the noise of a shared machine, before it is
measured end to end. ``--switch N``: the drafter alternates between rate ``a`` and useless every N tokens (a
conversation that leaves the drafter's topic and comes back), how fast the tuner follows.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from collections import Counter
from typing import Dict, List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table  # noqa: E402

#: the tuner's calibration for bench_e2e_synthetic.py --shape llama-0.5b (Intel Xeon, AVX-512, fp32, 1 thread,
#: 2026-12-03): the target's forward over n nodes, in plain steps
DEFAULT_FORWARD = "1:1.03,2:1.11,3:1.15,4:1.15,6:1.26,8:1.29,12:1.63,16:1.89"


def parse_points(text: str) -> List[Tuple[float, float]]:
    try:
        points = sorted((float(n), float(c)) for n, c in (p.split(":") for p in text.split(",") if p))
    except ValueError:
        raise SystemExit(f"--forward: expected nodes:cost pairs separated by commas, got {text!r}")
    if not points or points[0][0] > 1 or any(c <= 0 for _, c in points):
        raise SystemExit(f"--forward: need a point at 1 node or below and positive costs, got {text!r}")
    return points


def interpolate(points: Sequence[Tuple[float, float]], x: float) -> float:
    if x <= points[0][0]:
        return points[0][1]
    for (a, ca), (b, cb) in zip(points, points[1:]):
        if x <= b:
            return ca + (cb - ca) * (x - a) / (b - a)
    if len(points) == 1:
        return points[0][1]
    (a, ca), (b, cb) = points[-2], points[-1]
    return cb + (cb - ca) / (b - a) * (x - b)


class Drafts:
    """The simulated drafts: tree, cost and acceptance of a (depth, budget) draft for a top-1 rate ``a``.

    The drafter is calibrated: the target's next token is the drafter's rank-j candidate with probability
    q_j = a (1 - a)^(j - 1) at every node, whatever came before. A draft of depth d and budget n is what an
    EAGLE-2 expansion keeps: the n - 1 paths of ranks (each rank <= top_k, at most d long) of the highest
    probability (the product of their q's; a path's prefixes are likelier, so the set is a tree). A draft
    accepts the target's path as far as the tree holds it."""

    def __init__(self, forward, draft: float, update: float, top_k: int, others: float = 1.0):
        self.forward, self.draft, self.update, self.top_k = forward, draft, update, top_k
        self.others = others  # the share of the calibrated q_j (j >= 2) the lower ranks hold
        self._trees: Dict[Tuple[float, int, int], Tuple[frozenset, float]] = {}

    def candidates(self, depth: int) -> int:
        return self.top_k + (depth - 1) * self.top_k ** 2

    def nodes(self, depth: int, budget: int) -> int:
        return min(budget, 1 + self.candidates(depth))

    def tree(self, a: float, depth: int, budget: int) -> Tuple[frozenset, float]:
        """The draft's nodes (rank paths) and its expected accepted tokens."""
        key = (a, depth, budget)
        if key not in self._trees:
            q = self.ranks(a)
            paths, frontier = [], [((), 1.0)]
            for _ in range(depth):  # every path of ranks <= top_k, at most `depth` long (ties: shallower, earlier)
                frontier = [(p + (j,), w * q[j]) for p, w in frontier for j in range(self.top_k)]
                paths += frontier
            order = sorted(range(len(paths)), key=lambda i: (-paths[i][1], len(paths[i][0]), i))
            kept = [paths[i] for i in order[:self.nodes(depth, budget) - 1]]
            self._trees[key] = (frozenset(p for p, _ in kept), sum(w for _, w in kept))
        return self._trees[key]

    def ranks(self, a: float) -> List[float]:
        """P(the target's token is the drafter's rank-j candidate), j = 1 .. top_k."""
        return [a] + [self.others * a * (1.0 - a) ** j for j in range(1, self.top_k)]

    def accept(self, a: float, depth: int, budget: int, rng: random.Random) -> int:
        """Draft tokens one step accepts."""
        nodes, _ = self.tree(a, depth, budget)
        q = self.ranks(a)
        path = ()
        while len(path) < depth:
            u, rank = rng.random(), 0  # the target token's rank under the drafter (top_k: none of them)
            while rank < self.top_k and u >= q[rank]:
                u -= q[rank]
                rank += 1
            if path + (rank,) not in nodes:
                break
            path += (rank,)
        return len(path)

    def cost(self, depth: int, budget: int, tokens: float) -> float:
        """Plain steps of a draft step that yields `tokens` tokens (its drafter appends them next step)."""
        return interpolate(self.forward, self.nodes(depth, budget)) + self.draft * depth + self.update * tokens

    def best_fixed(self, a: float, depth: int, budget: int, budgets: Sequence[int]) -> Tuple[float, str]:
        """The fixed shape with the most expected tokens per plain step's time, and that ratio (1.0 for
        plain steps)."""
        best = (1.0 / interpolate(self.forward, 1), "none")
        for n in sorted({b for b in budgets if b < budget} | {budget}):
            for d in range(1, min(depth, n - 1) + 1):
                tokens = 1.0 + self.tree(a, d, n)[1]
                best = max(best, (tokens / self.cost(d, n, tokens), f"d{d} n{n}"))
        return best


def simulate(drafts: Drafts, a: float, tokens: int, seed: int, depth: int, budget: int, tuner_kw: dict,
             tell_candidates: bool = True, switch: int = 0):
    """One decoding of `tokens` tokens with a new tuner: (tokens per plain step's time, shape labels);
    ``switch`` > 0: the drafter's rate alternates between `a` and 0 every `switch` tokens."""
    from taps.tuner import FixedCosts, Tuner

    rng = random.Random(seed)
    costs = FixedCosts(lambda n, b: interpolate(drafts.forward, n), lambda g, d, b: drafts.draft * d,
                       lambda g, t, b: drafts.update * t)
    tuner = Tuner(costs, **tuner_kw)
    tuner.begin(1, False)
    made, seconds, labels = 0, 0.0, []
    while made < tokens:
        shape = tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, depth, budget,
                           candidates=(lambda g, d: drafts.candidates(d)) if tell_candidates else None)
        labels.append(shape.label)
        if not shape.drafters:
            made += 1
            seconds += interpolate(drafts.forward, 1)
            continue
        d, n = shape.depth, shape.budget
        passed = drafts.accept(a if not switch or (made // switch) % 2 == 0 else 0.0, d, n, rng)
        tuner.observe(shape, [passed], d, drafts.nodes(d, n), 1, 0.0, {}, [])
        made += passed + 1
        seconds += drafts.cost(d, n, passed + 1)
    return made / seconds, labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forward", default=DEFAULT_FORWARD, help="nodes:cost points of the target's forward, in "
                    "plain steps (interpolated; the default: the 0.5B synthetic target on the development CPU)")
    ap.add_argument("--draft", type=float, default=0.065, help="plain steps per drafter level")
    ap.add_argument("--update", type=float, default=0.02, help="plain steps per token the drafter appends")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 0.85],
                    help="top-1 acceptance a per level")
    ap.add_argument("--others", type=float, default=1.0,
                    help="the lower ranks' share of a calibrated drafter's probabilities (1: q_j = a (1 - a)^(j - 1); "
                         "0: only the top-1 candidate is ever the target's, as bench_e2e_synthetic.py's oracle)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[48, 400])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--budgets", type=int, nargs="*", default=[2, 4, 8], help="Tuner(budgets=)")
    ap.add_argument("--explore", type=float, default=None, help="Tuner(explore=) (default: the tuner's)")
    ap.add_argument("--max-probe-interval", type=int, default=None, help="Tuner(max_probe_interval=)")
    ap.add_argument("--margin", type=float, default=None, help="Tuner(margin=)")
    ap.add_argument("--switch", type=int, default=0,
                    help="N > 0: the drafter's rate alternates between a and 0 every N tokens (a drafter that knows one "
                         "topic of a conversation and not the next); the best fixed shape is then left out")
    ap.add_argument("--no-candidates", action="store_true",
                    help="do not tell the tuner the expansion's candidate count (Tuner.plan(candidates=None))")
    args = ap.parse_args()
    for name in ("draft", "update"):
        if getattr(args, name) < 0:
            ap.error(f"--{name} must be >= 0")
    if any(not 0.0 <= a <= 1.0 for a in args.rates):
        ap.error("--rates must lie in [0, 1]")
    if args.switch < 0:
        ap.error("--switch must be >= 0")
    if args.depth < 1 or args.top_k < 1 or args.budget < 2 or args.seeds < 1 or any(t < 1 for t in args.tokens):
        ap.error("need --depth, --top-k, --seeds, --tokens >= 1 and --budget >= 2")
    if not 0.0 <= args.others <= 1.0:
        ap.error("--others must lie in [0, 1]")
    drafts = Drafts(parse_points(args.forward), args.draft, args.update, args.top_k, args.others)
    tuner_kw: Dict[str, object] = {"budgets": tuple(args.budgets)}
    for name in ("explore", "max_probe_interval", "margin"):
        if getattr(args, name) is not None:
            tuner_kw[name] = getattr(args, name)
    print(f"forward (plain steps by nodes): {args.forward}; drafter {args.draft} a level, {args.update} a token "
          f"appended; lower ranks' share {args.others:g}; depth {args.depth}, top_k {args.top_k}, budget "
          f"{args.budget}, budgets {args.budgets}; {args.seeds} seeds, a new tuner each"
          + ("; the tuner is not told the candidate counts" if args.no_candidates else ""))
    rows = []
    for a in args.rates:
        oracle, oracle_shape = drafts.best_fixed(a, args.depth, args.budget, args.budgets)
        for tokens in args.tokens:
            ratios, labels = [], Counter()
            for seed in range(args.seeds):
                ratio, shapes = simulate(drafts, a, tokens, seed, args.depth, args.budget, tuner_kw,
                                         tell_candidates=not args.no_candidates, switch=args.switch)
                ratios.append(ratio)
                labels.update(shapes)
            steps = sum(labels.values())
            mean = statistics.mean(ratios)
            top = ", ".join(f"{k} {v / steps:.0%}" for k, v in labels.most_common(3))
            best = "-" if args.switch else f"{oracle:.3f}x ({oracle_shape})"
            rows.append([f"{a:g}" + (f" / 0 every {args.switch}" if args.switch else ""), tokens, f"{mean:.3f}x",
                         f"{min(ratios):.3f}x", best, "-" if args.switch else f"{mean / oracle:.0%}",
                         f"{labels['none'] / steps:.0%}", top])
    print_table(["a (top-1)", "tokens", "tuner vs AR (mean)", "worst seed", "best fixed shape", "tuner / best",
                 "plain steps", "shapes chosen most"], rows, title="Tuner against simulated drafts")


if __name__ == "__main__":
    main()
