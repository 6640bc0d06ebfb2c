"""The tuner (taps.tuner): each step's draft chosen by a measured cost model and running acceptance.

Whatever it chooses, the output is the target's own: greedy output equal to autoregressive decoding
under shapes forced to change every step (every strategy, ragged batches), and a chi-square of sampled
sequences against the target's exact distribution. It chooses no draft when the drafters are useless
or drafting is expensive, and drafts when acceptance is high and drafting cheap. The cost model's
calibration and online correction, the acceptance model and the catch-up of skipped drafter updates
are tested on injected numbers.
"""

import copy
import itertools
import math
import operator
import random

import pytest
import torch

from taps import ModelDrafter, PromptLookupDrafter, SpeculativeDecoder
from taps.decoder import _join
from taps.tuner import NONE, AcceptanceModel, CostModel, FixedCosts, Shape, Tuner, node_grid

import engine_models as em
from test_engine_sampling import PROMPT, STEPS, assert_samples_follow

pytestmark = pytest.mark.usefixtures("one_thread")


class Cycling(Tuner):
    """Runs candidate shapes (no draft included) drawn at random with a fixed seed, whatever they are worth."""

    def __init__(self, **kw):
        super().__init__(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-3), **kw)
        self.seen = []
        self.rng = random.Random(5)

    def choose(self, options):
        shape = options[0 if self.rng.random() < 0.25 else self.rng.randrange(len(options))][0]
        self.seen.append(shape)
        return shape


def _cheap(draft=1e-5, forward=1e-3, per_node=0.0):
    return FixedCosts(lambda n, b: forward + per_node * n, lambda g, d, b: draft * d, lambda g, t, b: draft)


def _measured(*sets):
    """A CostModel as calibration leaves it at batch 1 (a 1 ms plain step, 1.4 ms at 8 nodes), with each drafter
    set of `sets` (default: drafter 0) at 0.1 ms a level."""
    costs = CostModel()
    costs.set_forward(1, [(1, 1e-3), (4, 1.2e-3), (8, 1.4e-3)])
    for members in sets or ((0,),):
        costs.set_draft(members, 1, (1, 1e-4), (3, 3e-4))
    return costs


GREEDY_CASES = [
    ("single", ("eagle",)),
    ("merged", ("eagle", "lookup")),
    ("merged-budget", ("eagle", "early_exit")),
    ("route-confidence", ("eagle", "other")),
    ("route-entropy-prompt", ("eagle", "early_exit")),
    ("adaptive", ("eagle", "early_exit", "lookup")),
]


def _greedy_drafters(names):
    m = em.greedy_models()
    made = {"eagle": lambda: m["eagle"], "early_exit": lambda: ModelDrafter(m["early_exit"]),
            "other": lambda: ModelDrafter(m["other"]), "lookup": PromptLookupDrafter}
    return [made[n]() for n in names]


@pytest.mark.parametrize("strategy", ["merged-budget", "adaptive"])
def test_a_step_of_one_drafter_counts_its_accepted_tokens_as_the_path_does(strategy, monkeypatch):
    """A step whose every node one drafter proposed (a tuner's kind of one drafter in a merged decoder) reads
    that drafter's accepted tokens from the requests' accepted counts (SpeculativeDecoder._read_back): the
    per-request counts and the strategy's running per-drafter sums equal what the gather over the accepted
    path's sources gives, step by step (batch 3, forced shapes of every drafter set)."""
    m = em.greedy_models()
    prompts = [m["seqs"][0, :4].tolist(), m["seqs"][1, :9].tolist(), m["seqs"][2, :6].tolist()]
    dec = SpeculativeDecoder(m["target"], _greedy_drafters(("eagle", "early_exit", "lookup")), strategy=strategy,
                             depth=3, top_k=3, budget=8, route_steps=2, tuner=Cycling())
    read_back = SpeculativeDecoder._read_back
    alone = []

    def both(self, state, tree, ver, path, drafted, nodes=None, plan=None):
        before = self.strategy.accepted.clone()
        gathered = read_back(self, state, tree, ver, path, drafted, nodes)  # (no plan: the path's sources)
        after = self.strategy.accepted.clone()
        self.strategy.accepted.copy_(before)
        record = read_back(self, state, tree, ver, path, drafted, nodes, plan)
        one = drafted and len(plan.drafting) == 1 and len(plan.drafting[0].members) == 1
        alone.append(one)
        assert record == gathered
        assert torch.equal(self.strategy.accepted, after)
        return record

    monkeypatch.setattr(SpeculativeDecoder, "_read_back", both)
    out = dec.generate(prompts, max_new_tokens=24)
    assert sum(alone) >= 3 and not all(alone)
    assert sum(sum(s.drafter_accepted) for s in out.stats) > 0


@pytest.mark.parametrize("strategy,names", GREEDY_CASES, ids=[f"{s}-{'+'.join(n)}" for s, n in GREEDY_CASES])
def test_forced_shapes_keep_greedy_output(strategy, names):
    m = em.greedy_models()
    prompts = [m["seqs"][0, :4].tolist(), m["seqs"][1, :9].tolist(), m["seqs"][2, :6].tolist()]
    ref = SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate(prompts, max_new_tokens=24)
    tuner = Cycling()
    dec = SpeculativeDecoder(m["target"], _greedy_drafters(names), strategy=strategy, depth=3, top_k=3, budget=8,
                             route_steps=2, tuner=tuner)
    out = dec.generate(prompts, max_new_tokens=24)
    assert out.tokens == ref.tokens
    labels = {s.label for s in tuner.seen}
    assert "none" in labels and len({s.depth for s in tuner.seen if s.drafters}) >= 2, labels
    assert len({s.budget for s in tuner.seen}) >= 3, labels
    assert out.stats[0].draft_shapes and set(out.summary["shape_histogram"]) <= labels


def test_forced_shapes_sample_the_target():
    m = em.sampling_models()
    tuner = Cycling()
    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["target"]), m["eagle"]], strategy="merged", depth=3,
                             top_k=2, budget=6, tuner=tuner)
    out = dec.generate([PROMPT] * 2000, max_new_tokens=STEPS, temperature=1.0, seed=77)
    assert out.summary["tau"] > 1.3, "acceptance hardly exercised"
    assert len({s.label for s in tuner.seen}) >= 2
    assert_samples_follow(out.tokens, PROMPT, 1.0, 0, 1.0, what="tuned: ")


def test_forced_shapes_of_sampled_drafts_sample_the_target():
    """Drawn and top-k trees (one drafter, every request sampling) of the shapes a tuner picks at random (a
    drawn shape's width and depth from its budget): the target's distribution whatever they are."""
    m = em.sampling_models()
    tuner = Cycling()
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=3, budget=10, tuner=tuner)
    tokens, taus = [], []
    for seed in range(4):  # a batch takes about two steps (two shapes): four batches
        out = dec.generate([PROMPT] * 500, max_new_tokens=STEPS, temperature=1.0, seed=78 + seed)
        tokens += out.tokens
        taus.append(out.summary["tau"])
    assert min(taus) > 1.2, f"acceptance hardly exercised: {taus}"
    labels = {s.label for s in tuner.seen if s.drafters}
    assert len(labels) >= 4 and any(s.drawn for s in tuner.seen) and any(not s.drawn for s in tuner.seen), labels
    assert_samples_follow(tokens, PROMPT, 1.0, 0, 1.0, what="tuned, sampled: ")


class _WideRoot(Tuner):
    """Always the drawn depth-1 shape of the largest budget."""

    def __init__(self):
        super().__init__(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-3))

    def choose(self, options):
        return max((o[0] for o in options if o[0].drawn and o[0].depth == 1), key=lambda s: s.budget)


def test_a_depth_one_drawn_tree_spends_the_whole_budget():
    """A drawn depth-1 shape (no scratch columns) holds budget - 1 root draws, more than top_k, and the
    output follows the target."""
    m = em.sampling_models()
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=2, budget=7,
                             tuner=_WideRoot())
    out = dec.generate([PROMPT] * 2000, max_new_tokens=STEPS, temperature=1.0, seed=12)
    assert {n for s in out.stats for n in s.tree_nodes} == {7}
    assert out.summary["tau"] > 1.3
    assert_samples_follow(out.tokens, PROMPT, 1.0, 0, 1.0, what="wide root: ")


def test_drawn_trees_where_they_accept_more():
    """The target as its own drafter at T = 1, drafts cheap: its drawn chains are accepted whole, its top-k
    trees only as far as the children's mass carries, so the tuner drafts drawn trees on most steps."""
    m = em.sampling_models()
    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["target"])], strategy="single", depth=3, top_k=2, budget=7,
                             tuner=Tuner(_cheap(draft=1e-5, forward=1e-3)))
    for seed in range(3):
        out = dec.generate([PROMPT] * 4, max_new_tokens=40, temperature=1.0, seed=seed)
    hist = out.summary["shape_histogram"]
    drawn = sum(v for k, v in hist.items() if k.endswith(" drawn"))
    assert drawn >= 0.7 * sum(hist.values()), hist
    assert out.summary["tau"] > 3.0


def test_no_draft_when_the_drafter_is_useless():
    """A drafter that proposes only tokens the target never produces here, real costs measured on this
    machine: after a few probes, plain steps."""
    m = em.greedy_models()
    prompts = [m["seqs"][i, :6].tolist() for i in range(4)]
    ref = SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate(prompts, max_new_tokens=40)
    produced = {t for row in ref.tokens for t in row}
    useless = ModelDrafter(m["other"]).set_draft_vocab(torch.tensor([t for t in range(96) if t not in produced][:16]))
    dec = SpeculativeDecoder(m["target"], [useless], strategy="single", depth=3, top_k=3, budget="auto")
    for p in prompts:
        dec.generate([p], max_new_tokens=40)
    out = dec.generate([prompts[0]], max_new_tokens=40)
    assert out.tokens[0] == ref.tokens[0] and out.summary["tau"] == 1.0
    hist = out.summary["shape_histogram"]
    assert hist.get("none", 0) >= 0.75 * sum(hist.values()), hist


def _perfect_drafter_run(costs, top_k, budget):
    """60 tokens drafted by the target itself (every greedy draft of the first child accepted), with
    the tuner on injected costs."""
    m = em.greedy_models()
    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["target"])], strategy="single", depth=3, top_k=top_k,
                             budget=budget, tuner=Tuner(costs))
    out = dec.generate([m["seqs"][0, :6].tolist()], max_new_tokens=60)
    return out, out.summary["shape_histogram"]


def test_no_draft_when_drafting_is_expensive():
    """A perfect drafter whose draft costs ten target forwards a level."""
    out, hist = _perfect_drafter_run(_cheap(draft=1e-2, forward=1e-3), 2, 6)
    assert hist.get("none", 0) >= 0.8 * sum(hist.values()), hist


def test_drafts_deep_when_acceptance_is_high_and_drafting_cheap():
    """A perfect drafter, cheap: every step drafts two levels or more (a 6-node tree of top_k 2 seldom
    holds the third level's greedy node, so depth 2 and depth 3 yield about the same)."""
    out, hist = _perfect_drafter_run(_cheap(draft=1e-5, forward=1e-3), 2, 6)
    deep = sum(v for k, v in hist.items() if " d3 " in k or " d2 " in k)
    assert deep >= 0.8 * sum(hist.values()), hist
    assert out.summary["tau"] > 2.5


def test_node_cost_picks_a_narrow_tree():
    """When every node costs a fifth of the forward, the trees stay narrow (and are still drafted)."""
    out, hist = _perfect_drafter_run(_cheap(draft=1e-6, forward=1e-3, per_node=2e-4), 3, 10)
    nodes = out.stats[0].tree_nodes
    assert sum(nodes) / len(nodes) <= 5 and hist.get("none", 0) <= 0.2 * len(nodes), (hist, nodes)


def test_fixed_settings_unchanged():
    m = em.greedy_models()
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=3, budget=8)
    assert dec.tuner is None
    out = dec.generate([m["seqs"][0, :6].tolist()], max_new_tokens=20)
    assert out.stats[0].draft_shapes == [] and out.summary["shape_histogram"] == {}
    assert set(out.stats[0].tree_nodes) == {8}
    auto = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=3, budget="auto")
    fixed = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=3)
    assert isinstance(auto.tuner, Tuner) and auto.budget == fixed.budget  # the default budget: the largest shape
    assert SpeculativeDecoder(m["target"], [], strategy="autoregressive", budget="auto").tuner is None
    with pytest.raises(ValueError, match="auto"):
        SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", budget="fast")


# -- the models on injected numbers -------------------------------------------------------------------

def test_cost_model_interpolates_and_corrects_online():
    costs = CostModel(alpha=0.5)
    costs.set_forward(1, [(1, 1.0), (4, 2.0), (8, 4.0)])
    assert costs.forward(1, 1) == 1.0 and costs.forward(2, 1) == pytest.approx(4 / 3)
    assert costs.forward(16, 1) == pytest.approx(8.0)  # extended past the last point
    assert costs.forward(4, 2) == pytest.approx(4.0)   # another batch: scaled from the nearest
    costs.set_draft((0,), 1, (1, 0.5), (3, 1.5))
    assert costs.draft((0,), 2, 1) == pytest.approx(1.0)
    assert costs.update((0,), 0, 1) == 0.0 and costs.update((0,), 4, 1) > 0
    # measured forwards twice the prediction: the scale converges to 2
    for _ in range(20):
        costs.observe(((0,), 8), 1, 5.0, 2.0, {("forward", 1, 4): (4.0, costs.forward(4, 1))}, [])
    assert costs.forward(4, 1) == pytest.approx(4.0, rel=0.05)
    assert costs.forward(8, 1) == pytest.approx(4.0)  # scales are per node count
    for _ in range(100):  # the residual tracks the median of its samples: one outlier hardly moves it
        costs.observe(((0,), 8), 1, 5.0, 2.0, {}, [])
    assert costs.rest(((0,), 8)) == pytest.approx(3.0, abs=0.01)
    costs.observe(((0,), 8), 1, 50.0, 2.0, {}, [])
    assert costs.rest(((0,), 8)) == pytest.approx(3.0, abs=0.6)
    quiet = CostModel()
    for _ in range(100):
        quiet.observe(((0,), 8), 1, 5.0, 2.0, {}, [])
    quiet.observe(((0,), 8), 1, 50.0, 2.0, {}, [])
    assert quiet.rest(((0,), 8)) == pytest.approx(3.0, abs=0.11)
    # an unseen drafted kind starts from what drafted steps spent outside their timed parts (the first 20: 1.0
    # beyond their forward's 4.0; the steps without timed parts tell nothing of it); a plain step from its own
    assert costs.rest(((1,), 2)) == pytest.approx(1.0, rel=0.01) and costs.rest(NONE.key) == 0.0
    # updates of 1..8 tokens costing 0.2 + 0.1 * tokens: the fit predicts them
    for i in range(300):
        t = 1 + i % 8
        costs.observe(NONE.key, 1, 1.0, 1.0, {}, [((0,), t, 0.2 + 0.1 * t)])
    assert costs.update((0,), 3, 1) == pytest.approx(0.5, rel=0.1)
    assert costs.update((0,), 8, 1) == pytest.approx(1.0, rel=0.1)


def test_a_drafted_steps_time_outside_its_parts_is_priced_for_every_drafted_kind():
    """What drafted steps spend outside their timed parts (plan, tree, commit, read-back: the same work whatever
    the kind) is learned from every drafted step within some ten of them, and priced for drafted kinds never
    observed too (a per-kind residual moves a few percent of the step per step); plain steps are not charged
    it; a preempted step moves it by a tenth at most; a state round trip keeps it, an older state without it
    starts from 0."""
    costs = CostModel()
    costs.set_forward(1, [(1, 1e-3), (16, 2e-3)])
    for _ in range(15):  # a drafted kind's steps: 2 ms of timed parts (forward, draft, an append) and 0.5 ms more
        costs.observe(((0,), 16), 1, 2.5e-3, 1.7e-3,
                      {("forward", 1, 16): (1.5e-3, 1.5e-3), ("draft", (0,), 3, 1): (2e-4, 2e-4)}, [((0,), 2, 3e-4)])
    assert costs.drafted_rest == pytest.approx(5e-4, rel=0.25)
    assert costs.rest(((1,), 4)) == pytest.approx(costs.drafted_rest)  # never observed: the drafted steps' rest
    assert costs.rest(((0,), 16)) == pytest.approx(8e-4, rel=0.1)  # its own residual learns the rest of it
    assert costs.rest(NONE.key) == 0.0
    before = costs.drafted_rest
    costs.observe(((0,), 16), 1, 0.1, 1.7e-3, {("forward", 1, 16): (1.5e-3, 1.5e-3)}, [])  # preempted for 0.1 s
    assert before < costs.drafted_rest <= 1.1 * before
    restored = CostModel()
    restored.load_state_dict(costs.state_dict())
    assert restored.drafted_rest == costs.drafted_rest
    old = costs.state_dict()
    del old["drafted_rest"]
    restored.load_state_dict(old)
    assert restored.drafted_rest == 0.0


def test_update_fit_leaves_out_a_slow_first_append_of_a_token_count():
    """A token count's first append may pay one-off costs (a bf16 product's kernel built on the CPU): it
    counts only when it is not above the prediction, so it cannot price a drafter out for good; any other
    counts as at most twice the prediction."""
    costs = CostModel()
    costs.set_draft((0,), 1, (1, 0.5), (3, 1.5))  # the update first estimated as one level: 0.5 + 0.03 t
    before = costs.update((0,), 3, 1)
    costs.observe(NONE.key, 1, 1.0, 1.0, {}, [((0,), 1, 20.0), ((0,), 2, 25.0)])  # first sightings, slow
    assert costs.update((0,), 3, 1) == pytest.approx(before)
    costs.observe(NONE.key, 1, 1.0, 1.0, {}, [((0,), 1, 0.3)])                   # seen before: counts
    assert costs.update((0,), 1, 1) < 0.5
    costs.observe(NONE.key, 1, 1.0, 1.0, {}, [((0,), 5, 0.1)])                   # first, but faster: counts
    assert costs.update((0,), 5, 1) < costs.update((0,), 1, 1) + 0.2
    slow = costs.update((0,), 2, 1)
    costs.observe(NONE.key, 1, 1.0, 1.0, {}, [((0,), 2, 25.0)])                  # seen before: an outlier counts,
    assert slow < costs.update((0,), 2, 1) < 2 * slow                            # as twice the prediction at most


def test_node_grid():
    assert node_grid(1) == [1]
    assert node_grid(16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert node_grid(31)[-1] == 31


def test_acceptance_model():
    acc = AcceptanceModel(prior_rate=0.5, prior_weight=2.0, pooled_weight=4.0, decay=1.0)
    acc.reset(2)
    key = ((0,), None)
    assert acc.expected(key, 0, 2) == pytest.approx(0.5 + 0.25)  # the prior
    for _ in range(200):
        acc.observe(key, [2, None], cap=3)   # request 0: two accepted of three every step
    assert acc.rate(key, 0, 1) > 0.97 and acc.rate(key, 0, 3) < 0.05
    assert acc.expected(key, 0, 3) == pytest.approx(2.0, abs=0.1)
    # request 1 never took part: the pooled rates are its prior
    assert acc.rate(key, 1, 1) > 0.9
    acc.reset(1)  # a new request starts from the pooled rates
    assert acc.expected(key, 0, 3) == pytest.approx(2.0, abs=0.1)
    # a kind that never gets a token accepted (e.g. prompt lookup without matches) tends to 0
    other = ((1,), None)
    for _ in range(100):
        acc.observe(other, [0], cap=8)
    assert acc.expected(other, 0, 8) < 0.05
    # its upper confidence bound shrinks with the trials (probes stop); an unseen kind's is every draft
    assert acc.expected(other, 0, 8, optimistic=True) < 0.1 * 8  # (depths past 1 never tried)
    assert acc.expected(((2,), 4), 0, 3, optimistic=True) == pytest.approx(3.0)


def test_pooled_values_kept_across_batches_equal_fresh_ones():
    """What a model computed from the pooled counts alone (a request without counts of its own) is kept across
    reset() and shared by such requests: every value equals that of a model that computes it afresh, before and
    after further observations, for requests with and without counts of their own."""
    rng = random.Random(1)
    keys = [((0,), 16), ((0,), 4), ((0,), 8), ((1,), 8), ((0, 1), 8)]
    kept = AcceptanceModel()
    kept.reset(3)
    for round_ in range(6):
        for _ in range(rng.randrange(0, 20)):
            kept.observe(rng.choice(keys), [rng.choice([None, 0, 1, 3, 6]) for _ in range(len(kept.requests))],
                         rng.randrange(1, 9))
        fresh = AcceptanceModel()
        fresh.load_state_dict(kept.state_dict())
        fresh.requests = [dict(r) for r in kept.requests]
        for key in keys:
            for b in range(len(kept.requests) + 1):
                for optimistic in (False, True):
                    cap = rng.randrange(1, 10)
                    assert kept.expected(key, b, cap, optimistic) == fresh.expected(key, b, cap, optimistic)
            rows = tuple(range(len(kept.requests)))
            assert kept.total(key, rows, 5) == fresh.total(key, rows, 5)
        kept.reset(rng.randrange(1, 4))   # a new batch: its requests have no counts yet


def test_reach_is_the_product_of_the_rates():
    """P(accepted >= d) (computed in one pass over the counts) is the product of rate() up to d, each
    raised by 1 / sqrt(1 + trials()) when optimistic, for requests with and without counts of their own."""
    rng = random.Random(0)
    keys = [((0,), 16), ((0,), 4), ((0, 1), 8)]
    for _ in range(50):
        m = AcceptanceModel()
        m.reset(3)
        for _ in range(rng.randrange(0, 30)):
            m.observe(rng.choice(keys), [rng.choice([None, 0, 1, 2, 3, 5, 7]) for _ in range(3)], rng.randrange(1, 9))
        for key in keys:
            for b in range(4):  # b = 3: a request the model has no row for
                for optimistic in (False, True):
                    cap = rng.randrange(1, 12)
                    want, p = [], 1.0
                    for d in range(1, cap + 1):
                        rate = m.rate(key, b, d)
                        if optimistic:
                            rate = min(1.0, rate + (1.0 + m.trials(key, b, d)) ** -0.5)
                        p *= rate
                        want.append(p)
                    m._forget()
                    assert m._reach(key, b, cap, optimistic)[:cap] == pytest.approx(want, rel=1e-12, abs=0)


def _reference_expected(m, key, b, cap, optimistic):
    """AcceptanceModel.expected as its docstring defines it, one request and kind at a time, from rate() and
    trials() (the model computes every kind, request and depth at once, in arrays)."""
    def rates(k, opt):
        out = []
        for d in range(1, cap + 1):
            rate = m.rate(k, b, d)
            out.append(min(1.0, rate + 1.0 / math.sqrt(1.0 + m.trials(k, b, d))) if opt else rate)
        return out

    def reach(k, opt):
        return list(itertools.accumulate(rates(k, opt), operator.mul))

    drafters, budget = key
    own = reach(key, optimistic)
    ceiling, floors = [1.0] * cap, []
    last = m._last.get(key, -1)
    for other in m.pooled if budget is not None else ():
        if other[0] != drafters or other[1] is None or m._last.get(other, -1) <= last:
            continue
        if other[1] > budget:
            ceiling = [min(p, q) for p, q in zip(ceiling, reach(other, optimistic))]
        elif other[1] < budget:  # at the depths its trees reached
            reached = len(m.pooled[other].trials)
            floors.append([p if d < reached else 0.0 for d, p in enumerate(reach(other, False))])
    values = [min(p, q) for p, q in zip(own, ceiling)]
    for floor in floors:
        values = [max(p, q) for p, q in zip(values, floor)]
    if floors:  # past a floor, each depth keeps this kind's own rate of going on from the depth above
        chained, above = [], 1.0
        for p, rate, c in zip(values, rates(key, optimistic), ceiling):
            above = max(p, min(above * rate, c))
            chained.append(above)
        values = chained
    return sum(values)


def test_expected_equals_its_definition_one_request_and_kind_at_a_time():
    """The arrays over kinds, requests and depths give what the definition gives for each alone (ceilings from
    wider kinds observed since, floors from narrower ones at the depths they reached and the chained rates past
    them; kinds without a budget unbounded; requests with and without counts, rows dropped and added, new
    batches), to the last bit."""
    rng = random.Random(11)
    kinds = [((0,), 2), ((0,), 3), ((0,), 4), ((0,), 8), ((0,), 16), ((0,), None), ((1,), 8), ((0, 1), 16)]
    for trial in range(30):
        m = AcceptanceModel(prior_rate=rng.choice([0.3, 0.5, 0.9]), pooled_weight=rng.choice([0.5, 2.0]))
        m.horizon = rng.randint(1, 4)
        m.reset(rng.randint(1, 5))
        for step in range(rng.randrange(0, 60)):
            batch = len(m.requests)
            m.observe(rng.choice(kinds), [rng.choice([None, 0, 0, 1, 2, 3, 5, 9]) for _ in range(batch)],
                      rng.randint(1, 8))
            if rng.random() < 0.1 and batch > 1:
                m.select_requests(sorted(rng.sample(range(batch), rng.randint(1, batch))))
            if rng.random() < 0.1:
                m.add_requests(rng.randint(1, 2))
            if rng.random() < 0.05:  # a new batch: the pooled values kept
                m.expected(rng.choice(kinds), 0, rng.randint(1, 9))
                m.reset(rng.randint(1, 5))
            if rng.random() < 0.3:  # values asked between observations (kept until the next one)
                m.expected(rng.choice(kinds), rng.randrange(len(m.requests) + 1), rng.randint(1, 9))
        if trial % 3 == 0:  # values of every kind and request kept, then a new batch
            for key in kinds:
                for b in range(len(m.requests)):
                    m.expected(key, b, 9)
            m.reset(rng.randint(1, 5))
        for key in kinds:
            for b in range(len(m.requests) + 1):  # the last: a request the model has no row for
                for optimistic in (False, True):
                    cap = rng.randint(1, 10)
                    assert m.expected(key, b, cap, optimistic) == _reference_expected(m, key, b, cap, optimistic), \
                        (trial, key, b, cap, optimistic)


def test_probes_back_off():
    """A kind that is never the best is tried again at doubling intervals (with credit for every probe)."""
    tuner = Tuner(_cheap(), explore=1.0)
    bad = Shape((0,), 3, 8)
    probes = [i for i in range(200) if tuner.choose([(NONE, 1.0, 1.0, 1.0), (bad, 0.1, 1.0, 4.0)]).drafters]
    # a kind that could not win even with every draft accepted is never tried
    hopeless = Tuner(_cheap())
    assert not any(hopeless.choose([(NONE, 1.0, 1.0, 1.0), (bad, 0.1, 5.0, 4.0)]).drafters for _ in range(50))
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == 0 and gaps == sorted(gaps) and gaps[-1] >= 64 and len(probes) <= 9


def test_a_kind_priced_out_by_its_running_ratio_is_still_probed():
    """A kind whose price its running ratio (_fix, set by its own steps' seconds) pushed above what plain steps give,
    where its price before that ratio could win, is probed when due, charged at that price (nothing here: it would
    win); one that could not win at that price either is not. Without probes such a kind kept a ratio that early or
    unlucky steps had set (1.4-1.7x, an n-gram table at a batch of 1) and decoded whole answers plain."""
    def tuner_with(ratio):
        tuner = Tuner(_measured(), explore=0.01, calibrate=False)
        tuner.begin(1, False)
        kind = Shape((0,), 3, 8)
        tuner._probe[kind.key] = (0, 1)  # (tried before: no free first try)
        tuner._fix_set[kind.key[0]] = ratio
        return tuner, kind

    tuner, kind = tuner_with(3.0)
    # plain: 1 token a ms; the kind: 2 tokens (2.5 at its upper bound) priced 3 x 1.2 ms
    shape = tuner.choose([(NONE, 1.0, 1e-3, 1.0), (kind, 2.0, 3.6e-3, 2.5)])
    assert shape == kind and tuner.probing
    # charged nothing at 1.2 ms: the credit as it starts, what max_probe_interval plain steps add
    assert tuner._credit == pytest.approx(0.01 * 1e-3 * tuner.max_probe_interval)
    # a kind that could not win even before its ratio: no probe
    tuner, kind = tuner_with(1.0)
    assert tuner.choose([(NONE, 1.0, 1e-3, 1.0), (kind, 2.0, 3.6e-3, 2.5)]) == NONE and not tuner.probing
    # a ratio below 1 probes no less: judged at its price (1.5 ms: 2.5 tokens at its upper bound beat 1.5)
    tuner, kind = tuner_with(0.5)
    assert tuner.choose([(NONE, 1.0, 1e-3, 1.0), (kind, 1.2, 1.5e-3, 2.5)]) == kind and tuner.probing


def test_probes_lose_at_most_their_share():
    """Probes spend an exploration credit (at first what max_probe_interval steps add) that grows by
    `explore` times the best shape's predicted seconds per step: a probe predicted to lose 0.9 s against
    1 s steps runs about every 0.9 / explore steps, however soon its back-off would allow it, and one
    predicted to lose nothing runs whenever due. A kind's first try is free."""
    bad = Shape((0,), 3, 8)
    for explore in (0.0, 0.05, 0.2):
        tuner = Tuner(_cheap(), explore=explore)
        probes = [i for i in range(400) if tuner.choose([(NONE, 1.0, 1.0, 1.0), (bad, 0.1, 1.0, 4.0)]).drafters]
        assert probes[0] == 0
        assert (len(probes) - 1) * 0.9 <= explore * (400 + tuner.max_probe_interval) + 1e-9, (explore, probes)
        assert explore == 0.0 or len(probes) > 1, explore
    free = Tuner(_cheap(), explore=0.0)
    even = Shape((0,), 3, 8)  # as many tokens per second as a plain step, within the margin
    assert free.choose([(NONE, 1.0, 1.0, 1.0), (even, 1.02, 1.0, 4.0)]) == even


def test_a_probe_that_loses_more_than_its_charge_spends_the_rest():
    """A probe is charged its predicted loss when chosen; observed, it also spends what it lost beyond that (its
    seconds beyond what the best shape would take for the tokens it gave), so predictions that flatter a kind
    cannot make probes lose more than the credit; one that lost less keeps its charge (no refund). Injected
    costs (FixedCosts, whose units need not be the timer's seconds) are charged their predictions only."""
    def probe_of(total, accepted, costs=None):
        tuner = Tuner(costs or _measured(), explore=0.05, calibrate=False)
        tuner.begin(1, False)
        bad = Shape((0,), 3, 8)
        # the first try (free: charged nothing), then steps until the kind is due and covered again
        shape = tuner.choose([(NONE, 1.0, 1e-3, 1.0), (bad, 1.2, 1.5e-3, 4.0)])
        assert shape == bad and tuner.probing
        before = tuner._credit
        tuner.observe(shape, [accepted], 3, 8.0, 1, total, {}, [])
        return before, tuner._credit

    # best rate: 1 token a millisecond; the probe gave 1 token in 5 ms: lost 4 ms beyond its charge of 0
    before, after = probe_of(5e-3, 0)
    assert after == pytest.approx(before - 4e-3)
    before, after = probe_of(1e-3, 3)  # gave 4 tokens in 1 ms: it won, the credit stays
    assert after == pytest.approx(before)
    before, after = probe_of(5e-3, 0, _cheap())
    assert after == before
    # no costs learned from the step (a kernel built for a new shape): nothing spent either
    tuner = Tuner(_measured(), explore=0.05, calibrate=False)
    tuner.begin(1, False)
    shape = tuner.choose([(NONE, 1.0, 1e-3, 1.0), (Shape((0,), 3, 8), 1.2, 1.5e-3, 4.0)])
    before = tuner._credit
    tuner.observe(shape, [0], 3, 8.0, 1, 5e-3, {}, [], costs=False)
    assert tuner._credit == before and tuner._charge is None


def test_no_plan_while_no_probe_is_affordable():
    """While no draft is best and no probe is both due and covered by the credit, plan() answers no
    draft without evaluating the candidates again (the steps' credit still adds up); drafters that
    never get a token accepted are probed a few times, the cheap shapes first."""
    class Counting(Tuner):
        def __init__(self, **kw):
            super().__init__(FixedCosts(lambda n, b: 1e-3 + 1e-4 * n, lambda g, d, b: 5e-4 * d), **kw)
            self.chosen = 0

        def choose(self, options):
            self.chosen += 1
            return super().choose(options)

    tuner = Counting(explore=0.02)
    tuner.begin(8, False)
    probes = []
    for i in range(300):
        shape = tuner.plan([(0,), (1,)], lambda g, d: d, [0, 0], list(range(8)), 8, 3, 16)
        if shape.drafters:
            probes.append(shape)
        tuner.observe(shape, [0] * 8, shape.depth, shape.budget, 8, 1e-3, {}, [])
    kinds = 3 * 4  # drafter sets and budgets, each tried once for free (those that could win)
    assert 2 <= len(probes) <= kinds + 12 and tuner.chosen <= 3 * len(probes) + 6, (probes, tuner.chosen)


def test_join_pending_steps():
    t1 = torch.tensor([[5, 6, -1], [7, -1, -1]])
    t2 = torch.tensor([[8], [9]])
    f1 = torch.arange(6.).view(2, 3, 1)
    f2 = torch.tensor([[[10.]], [[11.]]])
    e1 = (t1, torch.tensor([2, 0]), {"final": f1}, [2, 0], [[5, 6, -1], [7]])
    e2 = (t2, torch.tensor([1, 1]), {"final": f2}, [1, 1], [[8], [9]])
    tokens, num, feats, num_host, tokens_host = _join([e1, e2], "final")
    assert num.tolist() == [3, 1] and num_host == [3, 1]
    assert tokens[0, :3].tolist() == [5, 6, 8] and tokens[1, :1].tolist() == [9]
    assert feats[0, :3, 0].tolist() == [0., 1., 10.] and feats[1, 0, 0].item() == 11.
    assert tokens_host == [[5, 6, 8], [9]]


def _join_reference(entries, spec):
    """Queued steps joined with a tensor comparison per step (what _join computes from the host counts)."""
    tokens = torch.cat([e[0] for e in entries], 1)
    valid = torch.cat([torch.arange(e[0].shape[1]) < e[1].unsqueeze(1) for e in entries], 1)
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    feats = torch.cat([e[2][spec] for e in entries], 1)
    return tokens.gather(1, order), sum(e[1] for e in entries), \
        feats.gather(1, order.unsqueeze(-1).expand(-1, -1, feats.shape[-1]))


@pytest.mark.parametrize("seed", range(5))
def test_join_pending_steps_of_random_widths(seed):
    """Queued steps of random widths and counts (0 for a finished request), plain one-token steps among them:
    every row's real tokens and features first, in order, as the per-step tensor comparison gives them."""
    gen = random.Random(seed)
    batch, entries = gen.randint(1, 9), []
    for _ in range(gen.randint(2, 40)):
        width = 1 if gen.random() < 0.6 else gen.randint(1, 6)
        counts = [gen.randint(0, width) for _ in range(batch)]
        tokens = torch.randint(0, 1000, (batch, width))
        entries.append((tokens, torch.tensor(counts), {"final": torch.randn(batch, width, 3)}, counts,
                        [tokens[b, :counts[b]].tolist() for b in range(batch)]))
    tokens, num, feats, num_host, tokens_host = _join(entries, "final")
    want_tokens, want_num, want_feats = _join_reference(entries, "final")
    assert torch.equal(tokens, want_tokens) and torch.equal(num, want_num) and torch.equal(feats, want_feats)
    assert num_host == want_num.tolist()
    assert tokens_host == [tokens[b, :num_host[b]].tolist() for b in range(batch)]


def test_greedy_and_sampled_acceptance_kept_apart():
    tuner = Tuner(_cheap())
    tuner.begin(1, sampling=False)
    greedy = tuner.acceptance
    greedy.observe(((0,), 8), [3], cap=3)
    fresh = AcceptanceModel().expected(((0,), 8), 0, 3)  # the prior alone
    assert greedy.expected(((0,), 8), 0, 3) > fresh + 0.1  # (a table of greedy values built)
    tuner.begin(2, sampling=True)
    assert tuner.acceptance is not greedy and not tuner.acceptance.pooled
    # nothing computed from greedy verification's counts is kept for sampling's
    assert tuner.acceptance.expected(((0,), 8), 0, 3) == pytest.approx(fresh)
    tuner.begin(1, sampling=False)
    assert tuner.acceptance is greedy and ((0,), 8) in greedy.pooled


def test_cost_models_are_kept_per_drafter_set():
    """Decoders of one target with other drafters at the same positions do not share drafter costs: a
    prompt-lookup drafter at position 0 is not priced as the EAGLE head another decoder has there."""
    m = em.greedy_models()
    decoders = [SpeculativeDecoder(m["target"], [d], strategy="single", depth=3, top_k=3, budget="auto")
                for d in (m["eagle"], PromptLookupDrafter(), m["eagle"])]
    decoders[0].generate([[5, 17, 42, 8, 61, 3]], max_new_tokens=4)
    first = decoders[0].tuner.costs
    # The EAGLE head's expansion priced at a second a level: a decoder sharing this model would see it
    # (a comparison of the two measured costs would depend on the machine's load).
    for key in [k for k in first.draft_points if k[0] == (0,)]:
        first.draft_points[key] = (1, 1.0, 3, 3.0)
    assert first.draft((0,), 3, 1) >= 3.0
    for dec in decoders[1:]:
        dec.generate([[5, 17, 42, 8, 61, 3]], max_new_tokens=4)
    lookup, again = decoders[1].tuner.costs, decoders[2].tuner.costs
    assert first is again  # the same target and drafters: one cost model
    assert lookup is not first
    assert ((0,), 1) in lookup.draft_points  # the lookup drafter was calibrated on its own
    assert lookup.draft((0,), 3, 1) < 1.0  # not priced as the EAGLE head at position 0


class _FakeClock:
    """A timer advanced by the calls it times: each call of :meth:`call` takes `cost` seconds."""

    def __init__(self, cost):
        self.now, self.cost, self.calls = 0.0, cost, 0

    def __call__(self):
        return self.now

    def call(self):
        self.calls += 1
        self.now += self.cost


@pytest.mark.parametrize("cost,calls", [(1e-3, 5), (0.2, 2), (0.02, 3)])
def test_time_call_within_a_budget(cost, calls):
    """Calibration times a call `repeats` times after a warm-up, fewer when the calls would overrun the
    budget (at least one timed call): a large model's calibration costs a few forwards."""
    from taps.tuner import time_call

    clock = _FakeClock(cost)
    seconds = time_call(clock.call, repeats=4, timer=clock, budget=0.05)
    assert seconds == pytest.approx(cost)
    assert clock.calls == calls


def test_calibration_of_an_expensive_target_is_short():
    """With a forward dearer than the calibration budget, each point of the target's node grid is timed
    once after its warm-up call (not four times)."""
    m = em.greedy_models()
    calls = []
    tuner = Tuner(CostModel(), calibration_budget=1e-9)  # its own cost model: nothing calibrated yet
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=3, tuner=tuner)
    forward, prefill, prefilling = dec.forward.tree, dec.forward.prefill, []

    def counted(*args, **kwargs):
        if not prefilling:  # (a prompt's packed prefill is a tree forward too: not the calibration's)
            calls.append(1)
        return forward(*args, **kwargs)

    def flagged(*args, **kwargs):
        prefilling.append(1)
        try:
            return prefill(*args, **kwargs)
        finally:
            prefilling.pop()

    dec.forward.tree, dec.forward.prefill = counted, flagged
    dec.generate([[5, 17, 42, 8, 61, 3]], max_new_tokens=1)
    assert len(calls) == 2 * len(node_grid(dec.strategy.num_nodes))
    with pytest.raises(ValueError, match="calibration_budget"):
        Tuner(calibration_budget=0)


def test_a_wide_kind_bounds_the_narrower_ones():
    """Once a wide tree of some drafters has failed, a narrower budget of the same drafters cannot look
    more promising, in its mean or at its upper confidence bound (its tree holds the wide one's best
    nodes); kinds of other drafters and wider budgets are not bounded by it."""
    acc = AcceptanceModel()
    acc.reset(1)
    wide, narrow, other = ((0,), 16), ((0,), 4), ((1,), 4)
    before = acc.expected(narrow, 0, 3, optimistic=True)
    for _ in range(6):
        acc.observe(wide, [0], 3)
    bound = acc.expected(wide, 0, 3, optimistic=True)
    assert acc.expected(narrow, 0, 3, optimistic=True) <= bound + 1e-12 < before
    assert acc.expected(other, 0, 3, optimistic=True) == pytest.approx(before)
    assert acc.expected(((0,), 32), 0, 3, optimistic=True) == pytest.approx(before)
    assert acc.expected(narrow, 0, 3) <= acc.expected(wide, 0, 3) + 1e-12 < acc.expected(other, 0, 3)


def test_a_narrow_kind_bounds_the_wider_ones_from_below():
    """Once a narrow tree of some drafters is accepted, a wider budget of the same drafters (its tree holds
    the narrow one's nodes) is estimated at least as high, before it has run; its upper confidence bound
    stays its own; kinds of other drafters and narrower budgets are not raised by it."""
    acc = AcceptanceModel()
    acc.reset(1)
    narrow, wide, other, narrower = ((0,), 4), ((0,), 16), ((1,), 16), ((0,), 2)
    prior = acc.expected(wide, 0, 3)
    upper = acc.expected(wide, 0, 3, optimistic=True)
    for _ in range(6):
        acc.observe(narrow, [3], 3)
    assert acc.expected(wide, 0, 3) == pytest.approx(acc.expected(narrow, 0, 3))
    assert acc.expected(wide, 0, 3) > prior + 0.5
    assert acc.expected(wide, 0, 3, optimistic=True) == pytest.approx(max(upper, acc.expected(narrow, 0, 3)))
    assert acc.expected(other, 0, 3) == pytest.approx(prior)
    assert acc.expected(narrower, 0, 3) == pytest.approx(prior)


def test_past_a_floor_a_wider_kind_keeps_its_own_rate_of_going_on():
    """A narrower kind observed since lifts a wider kind's first levels (a floor); past them, each depth keeps
    the wider kind's own rate of going on from the depth above (P(>= d) = P(>= d - 1) P(>= d | >= d - 1)), so
    a prompt-lookup chain whose deep levels were accepted is not valued at its own old first levels once
    narrower trees are chosen; without a floor nothing changes."""
    acc = AcceptanceModel()
    acc.reset(1)
    narrow, wide = ((0,), 8), ((0,), 16)
    for a in (15, 0, 15, 1, 15, 0):  # deep chains: all or almost nothing
        acc.observe(wide, [a], 15)
    alone = acc.expected(wide, 0, 15)
    own = acc._reach(wide, 0, 15, False)
    for _ in range(6):
        acc.observe(narrow, [7], 7)  # its first seven levels accepted since
    floor = acc._reach(narrow, 0, 15, False)[:7]  # (a floor at the depths its trees reached)
    want, above, above_own = 0.0, 1.0, 1.0
    for d in range(15):
        p = max(own[d], floor[d] if d < 7 else 0.0, above * own[d] / above_own)
        want, above, above_own = want + p, p, own[d]
    assert acc.expected(wide, 0, 15) == pytest.approx(want)
    assert acc.expected(wide, 0, 15) > max(alone, acc.expected(narrow, 0, 7)) + 1.0
    fresh = AcceptanceModel()
    fresh.reset(1)
    for a in (15, 0, 15, 1, 15, 0):
        fresh.observe(wide, [a], 15)
    assert fresh.expected(wide, 0, 15) == pytest.approx(alone)  # no floor: its own values


def test_a_narrow_kind_is_a_floor_only_when_observed_after_the_wider_one():
    """A narrower kind's estimate floors a wider one's only when it was observed since the wider one was: a
    drafter that was good on the last topic (its narrow trees accepted) and fails now (its wide trees not)
    is not held up by the old narrow steps."""
    acc = AcceptanceModel()
    acc.reset(1)
    narrow, wide = ((0,), 4), ((0,), 16)
    for _ in range(6):
        acc.observe(narrow, [3], 3)
    floored = acc.expected(wide, 0, 3)
    for _ in range(6):
        acc.observe(wide, [0], 3)
    own = acc.expected(wide, 0, 3)
    assert own < 0.5 < floored, (own, floored)
    acc.observe(narrow, [3], 3)
    assert acc.expected(wide, 0, 3) == pytest.approx(acc.expected(narrow, 0, 3))


def test_a_requests_own_counts_follow_its_recent_steps():
    """A request's own counts decay (own_decay a step of the kind): after 40 accepted steps and then 40 rejected
    ones its rate is near the recent one, not the average of all 80."""
    for own_decay, low in ((0.95, True), (1.0, False)):
        acc = AcceptanceModel(own_decay=own_decay)
        acc.reset(1)
        key = ((0,), 4)
        for accepted in [1] * 40 + [0] * 40:
            acc.observe(key, [accepted], 1)
        assert (acc.rate(key, 0, 1) < 0.25) == low, (own_decay, acc.rate(key, 0, 1))


def _probes_of_a_useless_drafter(budgets, steps=300, chains=True):
    """Steps a tuner drafts, out of `steps`, with one drafter that is never accepted (fixed costs: a
    draft that is always accepted would win)."""
    tuner = Tuner(_cheap(draft=1e-5, forward=1e-3, per_node=1e-5), budgets=budgets, chains=chains)
    tuner.begin(1, False)
    drafted = 0
    for _ in range(steps):
        shape = tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 16)
        if shape.drafters:
            drafted += 1
            tuner.observe(shape, [0], min(shape.depth, shape.budget - 1), shape.budget, 1, 1e-3, {}, [])
    return drafted


def test_a_useless_drafter_is_probed_at_few_budgets():
    """Probes of a useless drafter do not multiply with the node budgets the tuner may choose from: the
    widest tree's failures bound the narrower ones."""
    alone = _probes_of_a_useless_drafter((), chains=False)
    several = [_probes_of_a_useless_drafter((2, 4, 8), chains=False), _probes_of_a_useless_drafter(()),
               _probes_of_a_useless_drafter((2, 4, 8))]   # (with chains: budgets 2, 3, 4 for depth 3 too)
    assert alone <= 12 and max(several) <= alone + 4, (alone, several)


def test_chain_budgets_are_candidates():
    """With chains (the default) each depth d below the decoder's budget is also tried at d + 1 nodes."""
    sets = [((0,),)]
    chains = {(s.depth, s.budget) for s in Tuner(budgets=(8,)).candidates(sets, 4, 16)}
    plain = {(s.depth, s.budget) for s in Tuner(budgets=(8,), chains=False).candidates(sets, 4, 16)}
    assert chains - plain == {(1, 2), (1, 3), (2, 3), (1, 4), (2, 4), (3, 4), (1, 5), (2, 5), (3, 5), (4, 5)}
    assert {s.budget for s in Tuner(budgets=()).candidates(sets, 4, 5)} == {2, 3, 4, 5}
    assert {s.budget for s in Tuner(budgets=(), chains=False).candidates(sets, 4, 5)} == {5}
    assert max(s.budget for s in Tuner(budgets=()).candidates(sets, 6, 4)) == 4   # none above the decoder's


def test_batch_sizes_near_a_calibrated_one_are_scaled_not_calibrated():
    """A batch size within a factor CostModel.reach of a calibrated one needs no calibration: it is
    predicted linearly in the batch size between calibrated ones, else in proportion from the nearest."""
    costs = CostModel()
    costs.set_forward(8, [(1, 8.0), (16, 32.0)])
    costs.set_draft((0,), 8, (1, 2.0), (3, 6.0))
    assert not costs.needs_forward(4) and not costs.needs_forward(16) and costs.needs_forward(3)
    assert not costs.needs_draft((0,), 5) and costs.needs_draft((0,), 2) and costs.needs_draft((1,), 8)
    assert costs.forward(16, 4) == pytest.approx(16.0) and costs.draft((0,), 3, 4) == pytest.approx(3.0)
    costs.set_forward(2, [(1, 4.0), (16, 10.0)])
    assert costs.forward(1, 5) == pytest.approx(6.0)  # halfway between batches 2 and 8
    assert costs.forward(16, 1) == pytest.approx(5.0)


def test_no_calibration_at_a_batch_size_near_a_calibrated_one():
    m = em.greedy_models()
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=3,
                             tuner=Tuner(CostModel()))
    prompts = [m["seqs"][i, :6].tolist() for i in range(4)]
    dec.generate(prompts, max_new_tokens=4)
    dec.generate(prompts[:3], max_new_tokens=4)
    assert set(dec.tuner.costs.forward_points) == {4}
    dec.generate(prompts[:1], max_new_tokens=4)
    assert set(dec.tuner.costs.forward_points) == {1, 4}


def test_dropping_requests_joins_the_queued_steps_once():
    """A drop re-indexes one joined entry per group, not every queued step, with the same tokens and
    features for the requests kept."""
    from types import SimpleNamespace

    from taps.decoder import _Pending

    groups = [SimpleNamespace(target_features="final"), SimpleNamespace(target_features=None)]
    pending = _Pending(groups, {}, lambda g: None)
    steps = [(torch.tensor([[5, 6], [7, -1], [8, 9]]), torch.tensor([2, 1, 2]), [2, 1, 2]),
             (torch.tensor([[1], [2], [3]]), torch.tensor([1, 1, 1]), [1, 1, 1])]
    for i, (tokens, num, host) in enumerate(steps):
        feats = torch.arange(tokens.numel(), dtype=torch.float32).view(*tokens.shape, 1) + 10 * i
        pending.add(tokens, num, {"final": feats}, host, [row[:n] for row, n in zip(tokens.tolist(), host)])
    want = _join(pending.queue[id(groups[0])], "final")
    keep = [2, 0]
    pending.select_requests(keep, torch.tensor(keep))
    for g in groups:
        assert len(pending.queue[id(g)]) == 1
    tokens, num, feats, host, tokens_host = _join(pending.queue[id(groups[0])], "final")
    assert tokens_host == [want[4][b] for b in keep] and host == [want[3][b] for b in keep]
    assert torch.equal(tokens, want[0][keep]) and torch.equal(feats, want[2][keep])
    assert _join(pending.queue[id(groups[1])], None)[4] == tokens_host
    assert pending.count(groups[0]) == max(host)


def test_idle_groups_are_left_out_of_the_plan():
    """A group with nothing to propose this step (a prompt lookup without a match) is in no candidate
    kind, probes included; the other groups still are."""
    tuner = Tuner(_cheap(draft=1e-5, forward=1e-3))
    tuner.begin(1, False)
    for _ in range(60):
        shape = tuner.plan([(0,), (1,)], lambda g, d: d, [0, 0], [0], 1, 3, 8, idle=(1,))
        assert 1 not in shape.drafters
    assert tuner.plan([(0,), (1,)], lambda g, d: d, [0, 0], [0], 1, 3, 8, idle=(0, 1)) == NONE


def test_a_group_with_a_match_again_is_planned_for():
    """Plain steps while the only group is idle (no draft could run: the tuner coasts), then the group has
    something to propose again: the next plan considers it at once (a drafter that pays drafts)."""
    tuner = Tuner(_cheap(draft=1e-5, forward=1e-3))
    tuner.begin(1, False)
    plan = lambda idle: tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 8, idle=idle)  # noqa: E731
    for _ in range(3):  # drafts are tried (the first tries are free) and observed to pay
        shape = plan(())
        tuner.observe(shape, [shape.depth], shape.depth, shape.budget, 1, 1e-3, {}, [])
    for _ in range(20):
        assert plan((0,)) == NONE
    assert plan(()).drafters == (0,)


def test_coasting_goes_on_while_fewer_groups_can_draft():
    """No draft was best with every group able to draft: steps where some group has nothing to propose
    repeat that answer without choosing again; a plan with a group idle gives a coast token that holds
    only while that group stays idle."""
    class Counting(Tuner):
        chosen = 0

        def choose(self, options):
            self.chosen += 1
            return super().choose(options)

    tuner = Counting(_cheap(draft=1e-2, forward=1e-3))  # a level costs ten forwards: no draft pays
    tuner.begin(1, False)
    plan = lambda idle: tuner.plan([(0,), (1,)], lambda g, d: d, [0, 0], [0], 1, 3, 8, idle=idle)  # noqa: E731
    for _ in range(40):  # past the free first tries
        shape = plan(())
        tuner.observe(shape, [0], shape.depth, shape.budget, 1, 1e-3, {}, [])
    assert plan(()) == NONE and tuner.coast_token() is not None
    before = tuner.chosen
    for idle in [(0,), (1,), (0, 1), ()] * 5:
        assert plan(idle) == NONE
    assert tuner.chosen == before
    plan((1,))
    token = tuner.coast_token()  # a coasting step keeps the token of the plan it repeats
    assert token is not None and token.idle == frozenset()
    tuner.begin(1, False)  # a new generation: its first plan with group 1 idle
    plan((1,))
    token = tuner.coast_token()
    assert token is not None and token.idle == frozenset({1})
    # the answer is repeated while group 1 stays idle (whatever else is), not once it has a match
    assert not tuner.coast(token, ()) and not tuner.coast(token, (0,))
    before = tuner.chosen
    assert tuner.coast(token, (1,)) and tuner.coast(token, (0, 1))
    assert tuner.chosen == before


def test_steps_where_every_group_is_idle_coast_whatever_was_learned():
    """Every group idle (prompt lookup without a match): the plan prices nothing and chooses no draft, and
    its coast token holds while the groups stay idle, even after drafts were observed since (a drafted
    step's values need not stand: nothing could draft); a group with a match ends it."""
    tuner = Tuner(_cheap(draft=1e-6, forward=1e-3))
    tuner.begin(1, False)
    plan = lambda ready: tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 8, ready=ready)  # noqa: E731
    for _ in range(6):  # drafts with a match, observed
        shape = plan([(0,)])
        tuner.observe(shape, [shape.depth], shape.depth, shape.budget, 1, 1e-3, {}, [])
    priced = []
    total = tuner.acceptance.total
    tuner.acceptance.total = lambda *a, **k: (priced.append(1), total(*a, **k))[1]
    assert plan([()]) == NONE and not priced
    token = tuner.coast_token()
    assert token is not None and token.every
    shape = Shape((0,), 3, 8)
    tuner.observe(shape, [0], 3, 8, 1, 1e-3, {}, [])  # learned something since
    clock = tuner.clock
    assert all(tuner.coast(token, ready=[()]) for _ in range(10)) and tuner.clock == clock + 10
    assert not tuner.coast(token, ready=[(0,)])  # a match: plan again
    assert plan([(0,)]).drafters == (0,)


def _lookup_costs():
    """A batch of 8: a plain step 1 ms; a drafted step 1.5 ms and 0.4 ms per node a request beyond its root
    (0.05 ms a row: a node pays for itself when accepted with p > 0.4, after the draft's fixed cost)."""
    return FixedCosts(lambda n, b: 1e-3 if n <= 1 else 1.5e-3 + 0.4e-3 * (n - 1), lambda g, d, b: 1e-6)


def test_prompt_lookup_is_valued_over_the_requests_with_a_match():
    """A group that proposes for some requests only (``ready``: prompt lookup's requests with a match) is
    valued over those requests and priced at their nodes: with its chains of 3 all accepted, a step where
    every request of 8 has a match drafts, and one where a single request has one does not (its 3 tokens do
    not pay the draft's fixed cost); without ``ready`` both steps would be valued over the whole batch."""
    tuner = Tuner(_lookup_costs(), budgets=(), explore=0.0, refresh=1)
    tuner.begin(8, False)
    every, one = tuple(range(8)), (5,)
    plan = lambda ready: tuner.plan([(0,)], lambda g, d: 3, [0], list(range(8)), 8, 1, 4,  # noqa: E731
                                    ready=[ready])
    assert plan(every).drafters == (0,)  # the kind's first try
    for _ in range(6):
        tuner.observe(Shape((0,), 1, 4), [3] * 8, 3, 4.0, 8, 3e-3, {}, [], drafting=(8, 24))
    assert tuner._extra[((0,), 4), 1, 4] == pytest.approx(3.0)
    assert plan(every).drafters == (0,)
    assert plan(one) == NONE
    assert plan(()) == NONE  # no match: idle
    # one request with a match, observed alone: its nodes per drafting request stay 3, and its acceptance
    # is not diluted by the 7 requests that drafted nothing (root alone: None)
    for _ in range(6):
        tuner.observe(Shape((0,), 1, 4), [None] * 5 + [3] + [None] * 2, 3, 1.375, 8, 2e-3, {}, [], drafting=(1, 3))
    assert tuner._extra[((0,), 4), 1, 4] == pytest.approx(3.0)
    assert tuner.acceptance.expected(((0,), 4), 0, 3) > 2.5
    assert plan(every).drafters == (0,)


def test_prompt_lookup_kinds_keep_their_own_forward_scale():
    """A free kind's forward is reported as the kind's own part (its trees' width, not only their nodes, sets
    a packed forward's cost): measured at twice its node count's prediction, that kind is priced higher while
    another budget's kind and the node count's own prediction are not."""
    costs = CostModel()
    costs.set_forward(8, [(1, 1e-3), (2, 1.4e-3), (4, 2.2e-3), (8, 3.8e-3)])
    costs.set_draft((0,), 8, (1, 1e-5), (3, 3e-5))
    tuner = Tuner(costs, budgets=(4,), explore=0.0, refresh=1, calibrate=False)
    tuner.begin(8, False)
    tuner.plan([(0,)], lambda g, d: 3, [0], list(range(8)), 8, 1, 16, ready=[tuple(range(8))])
    wide, narrow = Shape((0,), 1, 16), Shape((0,), 1, 4)
    part, predicted = tuner.forward_part(wide, 2.0, 8)
    assert part == ("forward", 8, wide.key) and predicted == pytest.approx(1.4e-3)
    assert tuner.forward_part(NONE, 2.0, 8) == (("forward", 8, 2), pytest.approx(1.4e-3))
    for _ in range(40):
        part, predicted = tuner.forward_part(wide, 2.0, 8)
        costs.observe(wide.key, 8, 2.9e-3, predicted, {part: (2.8e-3, predicted)}, [])
    assert tuner.forward_part(wide, 2.0, 8)[1] == pytest.approx(2.8e-3, rel=0.05)
    assert tuner.forward_part(narrow, 2.0, 8)[1] == pytest.approx(1.4e-3)
    assert costs.forward_part(2.0, 8) == pytest.approx(1.4e-3)
    # and a plan prices the wide kind at its scale: with both kinds at one node below the root a request,
    # the wide one costs the measured forward, the narrow one its node count's
    for shape in (wide, narrow):
        tuner.observe(shape, [1] * 8, 1, 2.0, 8, 3e-3, {}, [], costs=False, drafting=(8, 8))
    seen = {}
    choose = tuner.choose
    tuner.choose = lambda options: seen.update({o[0]: o[2] for o in options}) or choose(options)
    tuner.plan([(0,)], lambda g, d: 3, [0], list(range(8)), 8, 1, 16, ready=[tuple(range(8))])
    assert seen[wide] - seen[narrow] == pytest.approx(1.4e-3, rel=0.1)


def test_coasting_stops_when_prompt_lookup_has_more_matches():
    """A plan of no draft with one request matched gives a coast token that holds while no more requests
    have a match (fewer is fine) and not once more have one."""
    tuner = Tuner(_lookup_costs(), budgets=(), explore=0.0, refresh=1)
    tuner.begin(8, False)
    plan = lambda ready: tuner.plan([(0,)], lambda g, d: 3, [0], list(range(8)), 8, 1, 4,  # noqa: E731
                                    ready=[ready])
    plan(tuple(range(8)))
    for _ in range(6):
        tuner.observe(Shape((0,), 1, 4), [3] * 8, 3, 4.0, 8, 3e-3, {}, [], drafting=(8, 24))
    assert plan((2, 6)) == NONE
    token = tuner.coast_token()
    assert token is not None and token.ready == ((0, 2),)
    assert tuner.coast(token, (), [(2,)]) and tuner.coast(token, (), [(1, 6)])
    assert not tuner.coast(token, (), [(1, 2, 6)]) and not tuner.coast(token, (), None)


def test_requests_without_a_match_are_no_trials(monkeypatch):
    """In a batch decoded with prompt lookup and a tuner, a drafted step reports exactly the requests whose
    tree held only its root (no match, or finished) as no trial of the kind (None), and counts the others
    as drafting; the output is the target's greedy output."""
    m = em.greedy_models()
    prompts = [[5, 17, 42, 8, 61, 3, 5, 17, 42, 8, 61, 3, 5, 17], [9, 31, 4, 77, 20, 13]]
    ref = SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate(prompts, max_new_tokens=24)
    seen, trees = [], []
    observe, verify = Tuner.observe, SpeculativeDecoder._verify

    def spy(self, shape, accepted, *args, drafting=None, **kwargs):
        if shape.drafters:
            seen.append((list(accepted), drafting))
        return observe(self, shape, accepted, *args, drafting=drafting, **kwargs)

    def nodes_of(self, state, tree, nodes=None):
        if tree.tokens.shape[1] > 1:
            trees.append(list(nodes))
        return verify(self, state, tree, nodes)
    monkeypatch.setattr(Tuner, "observe", spy)
    monkeypatch.setattr(SpeculativeDecoder, "_verify", nodes_of)
    tuner = Tuner(_cheap(draft=1e-6, forward=1e-3, per_node=1e-6))
    dec = SpeculativeDecoder(m["target"], [PromptLookupDrafter()], strategy="single", depth=3, top_k=1, budget=4,
                             tuner=tuner)
    out = dec.generate(prompts, max_new_tokens=24)
    assert out.tokens == ref.tokens
    assert seen and len(seen) == len(trees)
    for (accepted, drafting), nodes in zip(seen, trees):
        assert [a is None for a in accepted] == [n == 1 for n in nodes]
        assert drafting == (sum(n > 1 for n in nodes), sum(n - 1 for n in nodes))
    assert any(nodes.count(1) == 1 for nodes in trees)  # a step drafted for one of the two requests only


def test_prompt_lookup_that_does_not_pay_coasts():
    """Where prompt lookup has matches but its trees never pay (each node costs ten forwards), the decoder
    repeats the plain step without planning or searching for matches (the lookup is appended to every
    step and keeps a flag per request of whether it has a match), and the output is the target's greedy
    output."""
    m = em.greedy_models()
    prompt = [5, 17, 42, 8, 61, 3, 5, 17, 42, 8, 61, 3, 5, 17]
    ref = SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate([prompt], max_new_tokens=60)

    class Counting(Tuner):
        calls = 0

        def plan(self, *args, **kw):
            self.calls += 1
            return super().plan(*args, **kw)

    tuner = Counting(FixedCosts(lambda n, b: 1e-3 + 1e-2 * (n - 1), lambda g, d, b: 1e-6))
    dec = SpeculativeDecoder(m["target"], [PromptLookupDrafter()], strategy="single", depth=3, top_k=1, budget=4,
                             tuner=tuner)
    out = dec.generate([prompt], max_new_tokens=60)
    assert out.tokens[0] == ref.tokens[0]
    shapes = out.stats[0].draft_shapes
    assert shapes.count("none") >= len(shapes) - 4, shapes  # the first tries, then plain steps
    assert tuner.calls <= len(shapes) // 2, (tuner.calls, len(shapes))


def test_unobserved_plain_steps_read_no_clock():
    """A plain step the tuner does not observe (coasting, fifteen in sixteen) reads none of the tuner's
    clock (a CPU-time clock can cost 100 us a read in a VM); the steps it observes are timed as before,
    and the output is the target's greedy output."""
    m = em.greedy_models()
    prompt = [5, 17, 42, 8, 61, 3, 9]
    ref = SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate([prompt], max_new_tokens=80)
    reads = []
    tuner = Tuner(FixedCosts(lambda n, b: 1e-3 + 1e-2 * (n - 1), lambda g, d, b: 1e-2),
                  timer=lambda: reads.append(1) or float(len(reads)))
    observed, coasted = [], []
    observe, coast = tuner.observe, tuner.coast
    tuner.observe = lambda shape, *a, **k: (observed.append(shape), observe(shape, *a, **k))[1]
    tuner.coast = lambda *a, **k: (lambda ok: (coasted.append(ok), ok)[1])(coast(*a, **k))
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=2, budget=8, tuner=tuner)
    out = dec.generate([prompt], max_new_tokens=80)
    assert out.tokens[0] == ref.tokens[0]
    steps = len(out.stats[0].draft_shapes)
    assert out.stats[0].draft_shapes.count("none") >= steps - 4
    # a step that plans reads the clock once, a timed step three more (the forward's two, the step's end), a
    # draft its own timings; a coasting step that is not observed reads none
    drafts = sum(1 for s in observed if s.drafters)
    planned = steps - sum(coasted)
    assert sum(coasted) >= steps - 12, (sum(coasted), steps)
    assert len(observed) <= steps // 8 + drafts + 2, (len(observed), steps)
    assert len(reads) <= planned + 4 * len(observed) + 8 * drafts, (len(reads), steps, planned, len(observed))
    assert len(reads) < steps // 2, (len(reads), steps)


def test_a_host_group_not_started_is_priced_as_its_start():
    """A group kept current once started (an n-gram table) and not started yet is priced as a start on every token
    it has yet to take (its measured seconds a token), not as a start and then appends at the append price of a
    drafter that runs a model (that price, never measured for such a group, grew the first draft's price with
    every plain step); a group that runs a model starts on its prompts and appends the steps queued since."""
    import numpy as np

    from taps import NgramTable, NgramTableDrafter
    from taps.drafters import target_vocab_size

    m = em.greedy_models()
    table = NgramTable(np.array([0], np.uint64), [1], [0, 1], [5], [0.0], target_vocab_size(m["target"]), 0)
    seen = []
    plan = Tuner.plan

    def spy(self, groups, caps, pending, *a, starting=None, **k):
        seen.append((list(pending), list(starting)))
        return plan(self, groups, caps, pending, *a, starting=starting, **k)

    # drafting never pays (a draft level costs 10 ms): the groups never start
    dec = SpeculativeDecoder(m["target"], [NgramTableDrafter(table), m["eagle"]], strategy="merged", depth=2, top_k=2,
                             budget=4, tuner=Tuner(_cheap(draft=1e-2, forward=1e-3), explore=0.0))
    dec.tuner.plan = spy.__get__(dec.tuner)
    dec.tuner.coast = lambda *a, **k: False  # (every step plans: no coasting)
    out = dec.generate([[5, 17, 42, 8, 61, 3]], max_new_tokens=12)
    assert out.summary["shape_histogram"] == {"none": out.steps}
    assert len(seen) >= 3 and seen[-1][0][0] > seen[0][0][0]  # tokens queued as the plain steps went
    for pending, starting in seen:
        assert starting[0] == pending[0]  # the table: all of them priced as its start
        assert starting[1] == 6  # the model drafter: its prompt, then appends of the steps queued since
    assert seen[-1][0][1] > seen[-1][1][1]


def test_a_step_is_timed_from_after_its_plan():
    """A step's time, which the tuner prices its kind by, leaves its plan's own work out, plain or drafted (a
    recomputation after a request joined or finished, the plan that repeats the last draft unpriced: the steps
    that coast plan nothing, and a plan costs the same whichever shape it chooses). A clock that jumps by 1000
    inside every plan and by 10**6 inside every recomputation: no step is observed at 1000 or more."""
    m = em.greedy_models()
    prompt = [5, 17, 42, 8, 61, 3, 9]
    now = [0.0]

    def timer():
        now[0] += 1.0
        return now[0]

    # drafting priced near a tie: first tries, probes and plain steps that plan
    tuner = Tuner(FixedCosts(lambda n, b: 1e-3 + 5e-4 * (n - 1), lambda g, d, b: 2e-4), timer=timer)
    plan, observe = tuner.plan, tuner.observe
    tuner.plan = lambda *a, **k: (now.__setitem__(0, now[0] + 1000.0), plan(*a, **k))[1]
    tuner._learns_fix = lambda: True  # (as a tuner on measured costs: it times its recomputations)
    shapes, recomputed = tuner._shapes, []
    tuner._shapes = lambda *a, **k: (now.__setitem__(0, now[0] + 1e6), recomputed.append(1), shapes(*a, **k))[2]
    seen = []
    tuner.observe = lambda shape, *a, **k: (seen.append((shape, a[4])), observe(shape, *a, **k))[1]
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=2, budget=8, tuner=tuner)
    dec.generate([prompt], max_new_tokens=60)
    plain = [t for s, t in seen if not s.drafters]
    drafted = [t for s, t in seen if s.drafters]
    assert plain and drafted and len(recomputed) >= 2, (seen, recomputed)
    assert max(plain) < 1000 and max(drafted) < 1000, (plain, drafted)


def test_values_are_refreshed_within_refresh_steps():
    """While drafts are observed every step, a plan prices the candidates again once in ``refresh``
    steps (their values then hold every observation so far), not every step; a plain step is repeated
    without planning from values that miss an observation only until they are due."""
    with pytest.raises(ValueError, match="refresh"):
        Tuner(_cheap(), refresh=0)
    for refresh in (1, 3):
        tuner = Tuner(_cheap(draft=1e-5, forward=1e-3), refresh=refresh)
        tuner.begin(1, False)
        priced, plans = [], []
        total = tuner.acceptance.total
        tuner.acceptance.total = lambda *a, **k: (priced.append(len(plans)), total(*a, **k))[1]
        for _ in range(30):
            shape = tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 8)
            plans.append(shape)
            tuner.observe(shape, [shape.depth], shape.depth, shape.budget, 1, 1e-3, {}, [])  # all accepted
        assert all(s.drafters for s in plans[-20:])
        steps = sorted(set(priced))
        assert [b - a for a, b in zip(steps, steps[1:])] == [refresh] * (len(steps) - 1), (refresh, steps)
        assert steps[-1] >= len(plans) - refresh
    # no draft is best; a draft observed since the values were priced: that plain step is not repeated
    tuner = Tuner(_cheap(draft=1e-2, forward=1e-3), refresh=4)  # a level costs ten forwards
    tuner.begin(1, False)
    for _ in range(40):
        shape = tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 8)
        tuner.observe(shape, [0], shape.depth, shape.budget, 1, 1e-3, {}, [])
    assert tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 8) == NONE and tuner.coast_token() is not None
    probe = Shape((0,), 3, 8)
    tuner.observe(probe, [0], 3, 8, 1, 1e-3, {}, [])
    assert tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 8) == NONE  # priced again (long ago)
    tuner.observe(probe, [0], 3, 8, 1, 1e-3, {}, [])
    assert tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 8) == NONE  # from values a step old
    # that plain step is repeated from them without planning until they are due (refresh steps after they
    # were computed), then priced again from values that hold both observations
    memo, token = tuner._plan_memo, tuner.coast_token()
    assert token is not None and memo[2] < tuner._version
    coasted = 0
    while tuner.coast(token):
        coasted += 1
    assert 1 <= coasted < 4 and tuner._plan_memo is memo
    assert tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 8) == NONE
    assert tuner._plan_memo is not memo and tuner._plan_memo[2] == tuner._version


def test_a_new_batchs_first_plan_prices_the_values_computed_for_new_requests_before():
    """A batch's first plan prices the candidates from the values a first plan computed for requests without
    counts of their own (the pooled ones: what new requests start from) while those stand, computing none
    again: the same values and choice as a recomputation when nothing was observed since; values computed
    with a request's own counts are not kept for new requests; stale ones (a draft observed, `refresh` steps
    passed) are computed again; each verification mode keeps its own; a loaded state drops them."""
    tuner = Tuner(_cheap(draft=1e-5, forward=1e-3), refresh=40)
    counted = []
    total = tuner.acceptance.total
    tuner.acceptance.total = lambda *a, **k: (counted.append(a), total(*a, **k))[1]

    def plan(t=tuner):
        return t.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 8)

    tuner.begin(1, False)
    first = plan()
    assert first.drafters and counted
    fresh = tuner._plan_memo
    recomputing = copy.deepcopy(tuner)
    recomputing._fresh = {}
    tuner.begin(1, False)
    counted.clear()
    again = plan()
    assert again.drafters and not counted and tuner._plan_memo is fresh
    recomputing.begin(1, False)
    assert plan(recomputing) == again and recomputing._plan_memo is not fresh
    assert [e[:4] for e in recomputing._plan_memo[1]] == [e[:4] for e in fresh[1]]
    # a request's own counts: values computed from them are not what new requests start from
    tuner.observe(first, [0], first.depth, first.budget, 1, 1e-3, {}, [])
    tuner._plan_memo = None
    counted.clear()
    plan()
    assert counted and tuner._fresh[False] is fresh
    # stale (a draft observed since they were computed, and their refresh passed): computed again
    tuner.clock += 40
    tuner.begin(1, False)
    counted.clear()
    plan()
    assert counted and tuner._fresh[False] is tuner._plan_memo and tuner._plan_memo is not fresh
    # each verification mode its own (a sampled batch's first plan computes its values)
    tuner.begin(1, True)
    tuner.acceptance.total = lambda *a, **k: (counted.append(a), total(*a, **k))[1]
    counted.clear()
    plan()
    assert counted and tuner._fresh[True] is tuner._plan_memo and tuner._fresh[False] is not tuner._plan_memo
    tuner.load_state_dict(tuner.state_dict())
    assert tuner._fresh == {}


def test_recomputing_the_values_takes_at_most_its_share_of_the_time():
    """With measured costs the values are recomputed after observed drafts once in as many steps as make a
    recomputation's own time (the tuner's timer) ``recompute_share`` of the plain steps' predicted time, and
    at least once in ``refresh``; a probe's outcome is priced ``refresh`` steps after the last recomputation."""
    with pytest.raises(ValueError, match="recompute_share"):
        Tuner(_cheap(), recompute_share=0)

    def recomputed(tick, share, refresh=1, steps=120, probe_at=None):
        """The steps whose plan recomputed the values, after the first tries of the kinds (steps 0-5)."""
        clock = [0.0]

        def timer():  # every read moves the clock by `tick` (a recomputation reads it twice)
            clock[0] += tick
            return clock[0]

        costs = CostModel()
        costs.set_forward(1, [(1, 1e-3), (16, 4e-3)])  # a plain step: ~1 ms
        costs.set_draft((0,), 1, (1, 1e-6), (3, 3e-6))
        tuner = Tuner(costs, calibrate=False, timer=timer, refresh=refresh, recompute_share=share)
        tuner.begin(1, False)
        out = []
        for step in range(steps):
            memo = tuner._plan_memo
            shape = tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 8)
            assert shape.drafters
            if tuner._plan_memo is not memo:
                out.append(step)
            if step == probe_at:
                tuner.probing = True  # (as choose() marks a probe)
            tuner.observe(shape, [shape.depth], shape.depth, shape.budget, 1, 1e-3, {}, [])  # all accepted
        return [s for s in out if s > 5]

    def gaps(steps):
        return {b - a for a, b in zip(steps, steps[1:])}

    # 0.2 ms a recomputation, 5% of ~1 ms steps (the plain step's prediction moves with the observations): every
    # 4-5 steps; 1 ms: every 20-21; 10 us: every `refresh`; the whole time: every `refresh`
    assert gaps(recomputed(2e-4, 0.05)) <= {4, 5}
    long = recomputed(1e-3, 0.05)
    assert len(long) >= 5 and gaps(long) <= {20, 21}
    assert gaps(recomputed(1e-5, 0.05, refresh=3)) == {3}
    assert gaps(recomputed(1e-3, 1.0, refresh=2)) == {2}
    # a probe observed 3 steps after a recomputation: the next comes `refresh` steps after that one
    base = recomputed(1e-3, 0.05, refresh=4)
    probed = recomputed(1e-3, 0.05, refresh=4, probe_at=base[1] + 3)
    assert base[2] - base[1] >= 20 and probed[:3] == [base[0], base[1], base[1] + 4], (base, probed)


def test_a_best_draft_is_chosen_again_without_pricing_while_its_values_stand():
    """A draft chosen as the best (not a probe) is chosen again without pricing the candidates while their
    values stand (until recomputed, see refresh) and the requests, groups and appends (their prices, within 1% of
    a plain step) stay the same; a change of any of those chooses afresh; a subclass's own choose() is asked every
    step."""
    tuner = Tuner(_cheap(draft=1e-5, forward=1e-3), refresh=4)
    tuner.begin(2, False)
    chosen = []
    choose = tuner.choose
    tuner.choose = lambda options: (chosen.append(1), choose(options))[1]
    plan = lambda pending=0, active=(0, 1): tuner.plan([(0,)], lambda g, d: d, [pending], list(active), 2, 3, 8)  # noqa: E731
    shapes = []
    for _ in range(40):
        shapes.append(plan())
        tuner.observe(shapes[-1], [shapes[-1].depth] * 2, shapes[-1].depth, shapes[-1].budget, 2, 1e-3, {}, [])
    assert all(s.drafters for s in shapes[-30:])
    assert 40 // 4 <= len(chosen) <= 40 // 4 + 6, len(chosen)  # once a refresh, and the first tries
    first = plan()
    before = len(chosen)
    assert plan() == plan() == first and len(chosen) == before  # the same inputs, values standing: again
    plan(active=(0,))  # a request finished: chosen afresh
    assert len(chosen) == before + 1
    # the chosen group's appends of another length, priced the same (_cheap: one price whatever the tokens) or
    # within 1% of a plain step (0 -> 1 token: 1e-5 of 1e-3): again; priced otherwise (10% a token): afresh
    first = plan(pending=1)
    before = len(chosen)
    assert plan(pending=3) == plan(pending=2) == plan(pending=0) == first and len(chosen) == before
    per_token = Tuner(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-5 * d, lambda g, t, b: 1e-4 * t), refresh=4)
    per_token.begin(2, False)
    asked = []
    choose_pt = per_token.choose
    per_token.choose = lambda options: (asked.append(1), choose_pt(options))[1]
    plan_pt = lambda pending: per_token.plan([(0,)], lambda g, d: d, [pending], [0, 1], 2, 3, 8)  # noqa: E731
    for _ in range(30):
        shape = plan_pt(1)
        per_token.observe(shape, [shape.depth] * 2, shape.depth, shape.budget, 2, 1e-3, {}, [])
    assert shape.drafters
    first = plan_pt(1)
    before = len(asked)
    assert plan_pt(1) == first and len(asked) == before  # (values standing: again)
    plan_pt(2)
    assert len(asked) == before + 1

    class Own(Tuner):
        def choose(self, options):
            self.asked = getattr(self, "asked", 0) + 1
            return super().choose(options)

    own = Own(_cheap(draft=1e-5, forward=1e-3), refresh=4)
    own.begin(1, False)
    for _ in range(12):
        shape = own.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 8)
        own.observe(shape, [shape.depth], shape.depth, shape.budget, 1, 1e-3, {}, [])
    assert own.asked == 12


def test_requests_finishing_sum_the_values_over_the_others_without_recomputing():
    """When requests of a batch finish (its rows stay), a plan sums each kind's values over the requests left
    instead of computing every candidate's value and price again: the same values as a full recomputation
    from the same counts, for trained drafters' kinds and prompt lookup's (valued per request with a match);
    the values' age (their version and due step) is kept; more requests, or a new batch size, recompute."""
    ready = [None, (0, 1, 2, 3)]

    def plan(t, active, batch=4, groups=((0,), (1,))):
        r = [None if x is None else tuple(b for b in x if b in active) for x in ready]
        return t.plan(list(groups), lambda g, d: d if g == 0 else 2 * d, [0, 0], list(active), batch, 3, 8,
                      ready=r)

    tuner = Tuner(_cheap(draft=1e-4, forward=1e-3, per_node=1e-5), refresh=40)
    tuner.begin(4, False)
    gen = random.Random(0)
    for step in range(30):
        shape = plan(tuner, (0, 1, 2, 3))
        cap = max(shape.depth, 1)
        tuner.observe(shape, [gen.randint(0, cap) for _ in range(4)], cap, shape.budget, 4, 1e-3, {}, [])
    tuner._plan_memo = None  # (computed afresh from the counts so far, as a full recomputation below is)
    plan(tuner, (0, 1, 2, 3))
    assert tuner._plan_memo[2] == tuner._version
    memo, drafts = tuner._plan_memo, []
    draft = tuner.costs.draft
    tuner.costs.draft = lambda *a: (drafts.append(a), draft(*a))[1]
    plan(tuner, (0, 2, 3))
    assert not drafts and tuner._plan_memo[0] != memo[0] and tuner._plan_memo[2:] == memo[2:]
    fresh = copy.deepcopy(tuner)
    fresh._plan_memo = None
    plan(fresh, (0, 2, 3))
    drafts.clear()  # (the copy's prices go through the same counting function)
    summed = {e[0]: e for e in tuner._plan_memo[1]}
    for shape, value, seconds, upper, index in fresh._plan_memo[1]:
        got = summed[shape]
        assert got[2] == pytest.approx(seconds) and got[4] == index
        if value is None:  # prompt lookup's kind: per-request values, summed when priced
            assert got[1] is None
            assert [[got[3][i][b] for b in (0, 2, 3)] for i in (0, 1)] == \
                [pytest.approx([u[b] for b in (0, 2, 3)]) for u in upper]
        else:
            assert got[1] == pytest.approx(value) and got[3] == pytest.approx(upper)
    plan(tuner, (0, 2))
    assert not drafts
    plan(tuner, (0, 1, 2))  # a request back (a join at the same size): everything again
    assert drafts
    drafts.clear()
    plan(tuner, (0, 1), batch=3)  # a smaller batch: its forwards' prices change
    assert drafts


def test_a_best_draft_is_chosen_again_while_other_groups_queue_or_it_has_no_match():
    """The last best draft is chosen again without pricing while a group it does not draft with queues more
    appends (drafting with that group only grew dearer), and after steps where its own groups had nothing to
    propose (a prompt lookup's match comes and goes); its own group's appends changing, or another group's
    shrinking, chooses afresh."""
    costs = FixedCosts(lambda n, b: 1e-3 + 1e-5 * n, lambda g, d, b: 1e-2 * d if g == (0,) else 1e-6 * d,
                       lambda g, t, b: 1e-3 * t)
    tuner = Tuner(costs, refresh=4)
    tuner.begin(1, False)
    chosen = []
    choose = tuner.choose
    tuner.choose = lambda options: (chosen.append(1), choose(options))[1]
    queued = [0]

    def step(match=True, own=0, observe=True):
        shape = tuner.plan([(0,), (1,)], lambda g, d: d, [queued[0], own], [0], 1, 3, 8,
                           ready=[None, (0,) if match else ()])
        if observe and shape.drafters:
            tuner.observe(shape, [shape.depth if shape.drafters == (1,) else 0], shape.depth, shape.budget, 1,
                          1e-3, {}, [])
        if 0 not in shape.drafters:
            queued[0] += 1  # group 0 queues the step's tokens
        return shape

    shapes = [step() for _ in range(60)]
    assert all(s.drafters == (1,) for s in shapes[-20:]), shapes[-20:]
    step(observe=False)  # (values recomputed if due)
    before = len(chosen)
    shapes = [step(observe=False) for _ in range(5)]  # values standing, group 0's queue growing: again
    assert len(set(shapes)) == 1 and shapes[0].drafters == (1,) and len(chosen) == before
    assert step(match=False, observe=False) == NONE  # group 1 idle: priced (group 0 alone does not pay)
    assert len(chosen) == before + 1
    assert step(observe=False) == shapes[0] and len(chosen) == before + 1  # its match back: again
    step(own=1, observe=False)  # its own group's appends changed: chosen afresh
    assert len(chosen) == before + 2
    queued[0] = 0  # group 0's queue shrank (it drafted or caught up): chosen afresh
    step(observe=False)
    assert len(chosen) == before + 3
    # a prompt lookup alone: a step without a match has nothing to price, and the draft after it is again
    alone = Tuner(costs, refresh=4)
    alone.begin(1, False)
    for _ in range(40):
        shape = alone.plan([(1,)], lambda g, d: d, [0], [0], 1, 3, 8, ready=[(0,)])
        alone.observe(shape, [shape.depth], shape.depth, shape.budget, 1, 1e-3, {}, [])
    best = alone.plan([(1,)], lambda g, d: d, [0], [0], 1, 3, 8, ready=[(0,)])
    asked = []
    choose = alone.choose
    alone.choose = lambda options: (asked.append(len(options)), choose(options))[1]
    assert alone.plan([(1,)], lambda g, d: d, [0], [0], 1, 3, 8, ready=[()]) == NONE and asked == [1]
    assert alone.plan([(1,)], lambda g, d: d, [0], [0], 1, 3, 8, ready=[(0,)]) == best and best.drafters
    assert asked == [1]  # (the step without a match chose among no draft alone; the one after, not at all)


def test_prompt_lookup_drafts_only_with_a_match():
    """With drafting priced as free, a prompt-lookup decoder still runs a plain step whenever the context
    has no earlier occurrence of its last n-gram (no tree of the root alone), and drafts when it has one;
    its output is the target's greedy output."""
    m = em.greedy_models()
    prompt = [5, 17, 42, 8, 61, 3, 5, 17, 42, 8, 61, 3, 5, 17]
    ref = SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate([prompt], max_new_tokens=40)
    dec = SpeculativeDecoder(m["target"], [PromptLookupDrafter()], strategy="single", depth=3, top_k=1,
                             budget=4, tuner=Tuner(_cheap(draft=1e-6, forward=1e-3)))
    out = dec.generate([prompt], max_new_tokens=40)
    assert out.tokens[0] == ref.tokens[0]
    stats = out.stats[0]
    drafted = [n for s, n in zip(stats.draft_shapes, stats.tree_nodes) if s != "none"]
    assert drafted and min(drafted) > 1, (stats.draft_shapes, stats.tree_nodes)


def test_a_shape_not_run_yet_is_priced_at_the_nodes_its_expansion_can_fill():
    """plan(candidates=): a top-k shape not run yet is predicted at min(budget, 1 + its groups' candidates)
    nodes (a depth-1 draft of top_k 4 under a budget of 16 is a 5-node tree, not a 16-node one), a drawn one
    and every shape without `candidates` at its budget; once run, at the nodes it ran."""
    def seconds(tuner, shape):
        return next(s for sh, _, s, _, _ in tuner._plan_memo[1] if sh == shape)

    forward = lambda n, b: 1e-3 * n  # noqa: E731
    top4 = lambda g, d: 4 + (d - 1) * 16  # noqa: E731  (an EAGLE expansion with top_k 4)
    d1, d2 = Shape((0, 1), 1, 16), Shape((0, 1), 2, 16)
    for candidates, want_d1 in ((None, 16), (top4, 9)):  # two groups: 1 + 4 + 4 nodes at depth 1
        tuner = Tuner(FixedCosts(forward, lambda g, d, b: 0.0))
        tuner.begin(1, True)
        tuner.plan([(0,), (1,)], lambda g, d: d, [0, 0], [0], 1, 3, 16, drawn=(0,), candidates=candidates)
        assert seconds(tuner, d1) == pytest.approx(want_d1 * 1e-3)
        assert seconds(tuner, d2) == pytest.approx(16e-3)  # 1 + 2 x 20 candidates: the budget
        drawn = Shape((0,), 1, 16, drawn=True)  # a drawn depth-1 shape spends its whole budget
        assert seconds(tuner, drawn) == pytest.approx(16e-3)
        alone = Shape((0,), 1, 4)
        assert seconds(tuner, alone) == pytest.approx(4e-3)  # the budget is below 1 + 4
    tuner.observe(d1, [0], 1, 7, 1, 0.0, {}, [])  # it ran 7 nodes (e.g. a merged tree's duplicates)
    tuner._plan_memo = None
    tuner.plan([(0,), (1,)], lambda g, d: d, [0, 0], [0], 1, 3, 16, drawn=(0,), candidates=top4)
    assert seconds(tuner, d1) == pytest.approx(7e-3)


def test_a_shape_not_run_yet_is_priced_at_the_nodes_a_wider_deeper_run_kind_ran_scaled():
    """An unobserved shape's nodes: what a run shape of the same drafters, as deep or deeper and with as large
    a budget or larger, ran below its root, scaled by the budgets' ratio (its tree holds this one's: a prompt
    lookup's tree, or a packed batch's mean, holds fewer nodes than its budget; a tree that filled its budget
    scales to this one's), at most this one's budget; a shallower or narrower run kind says nothing, and
    another drafter's kind nothing."""
    def seconds(tuner, shape):
        return next(s for sh, _, s, _, _ in tuner._plan_memo[1] if sh == shape)

    def replan(tuner):
        tuner._plan_memo = None
        tuner.plan([(0,), (1,)], lambda g, d: d, [0, 0], [0], 1, 3, 16)

    tuner = Tuner(FixedCosts(lambda n, b: 1e-3 * n, lambda g, d, b: 0.0))
    tuner.begin(1, False)
    replan(tuner)
    assert seconds(tuner, Shape((0,), 2, 8)) == pytest.approx(8e-3)     # nothing run: its budget
    tuner.observe(Shape((0,), 3, 16), [0], 3, 3.5, 1, 0.0, {}, [])       # ran 3.5 nodes on average
    tuner.observe(Shape((1,), 3, 16), [0], 3, 2.0, 1, 0.0, {}, [])       # another drafter's kind
    tuner.observe(Shape((0,), 1, 4), [0], 1, 1.5, 1, 0.0, {}, [])        # shallower and narrower
    replan(tuner)
    scaled = lambda v, n, wide: 1e-3 * (1 + (v - 1) * (n - 1) / (wide - 1))  # noqa: E731
    assert seconds(tuner, Shape((0,), 2, 8)) == pytest.approx(scaled(3.5, 8, 16))   # from (0,) d3 n16
    assert seconds(tuner, Shape((0,), 2, 4)) == pytest.approx(scaled(3.5, 4, 16))   # (0,) d1 n4 is shallower
    assert seconds(tuner, Shape((0,), 1, 2)) == pytest.approx(scaled(1.5, 2, 4))    # (0,) d1 n4 gives less
    assert seconds(tuner, Shape((0,), 1, 8)) == pytest.approx(scaled(3.5, 8, 16))
    tuner.observe(Shape((0,), 1, 16), [0], 1, 1.2, 1, 0.0, {}, [])
    tuner.observe(Shape((0,), 3, 8), [0], 1, 8.0, 1, 0.0, {}, [])       # a tree that filled its budget
    replan(tuner)
    assert seconds(tuner, Shape((0,), 1, 8)) == pytest.approx(scaled(1.2, 8, 16))
    assert seconds(tuner, Shape((0,), 2, 8)) == pytest.approx(scaled(3.5, 8, 16))   # d1 n16 is shallower than d2
    assert seconds(tuner, Shape((0,), 2, 4)) == pytest.approx(scaled(3.5, 4, 16))   # the least of d3 n16, d3 n8
    assert seconds(tuner, Shape((0,), 3, 4)) == pytest.approx(scaled(3.5, 4, 16))
    assert seconds(tuner, Shape((0, 1), 2, 8)) == pytest.approx(8e-3)    # no run kind of these drafters


def test_the_decoder_tells_the_tuner_its_expansions_candidates():
    """A decoder prices its drafters' depth-1 shapes at 1 + top_k nodes before running them."""
    m = em.greedy_models()
    seen = []

    class Spy(Tuner):
        def plan(self, *args, **kwargs):
            seen.append(kwargs.get("candidates"))
            return super().plan(*args, **kwargs)

    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["other"])], strategy="single", depth=3, top_k=3,
                             tuner=Spy(_cheap()))
    dec.generate(torch.tensor([PROMPT]), max_new_tokens=4)
    assert seen and all(c is not None and c(0, 1) == 3 and c(0, 2) == 3 + 9 for c in seen)


def test_probes_go_no_deeper_than_the_drafters_were_ever_accepted_plus_two():
    """Once tried, a kind's probes go at most two levels past the deepest level any kind of its drafters was
    accepted at, and to depth 1 while none ever was: a useless drafter is probed with its cheapest tree (the
    first drafts, chosen on the prior's rates before plain steps win, are not probes: at full depth)."""
    acc = AcceptanceModel()
    acc.reset(1)
    key, wide = ((0,), 8), ((0,), 16)
    assert acc.probe_depth(key) > 100  # nothing observed: no limit
    acc.observe(wide, [0], 4)
    assert acc.probe_depth(key) == 1 and acc.probe_depth(((1,), 8)) > 100
    acc.observe(key, [1], 4)
    assert acc.probe_depth(wide) == 3

    # trees of 1 + 4 d nodes; cheap ones for the drafter never accepted, and ones of 2.4x a plain step for
    # the drafter accepted once a step: every draft of it loses, while a deep one that is all accepted would win
    cheap = _cheap(draft=1e-5, forward=1e-3, per_node=1e-5)
    dear = FixedCosts(lambda n, b: 1e-3 if n <= 1 else 2.4e-3 + 1e-5 * n, lambda g, d, b: 1e-5 * d)
    for accepted, want, costs in ((0, {1}, cheap), (1, {1, 2, 3}, dear)):
        tuner = Tuner(costs, budgets=())
        tuner.begin(1, False)
        depths = []  # 0: a plain step
        for _ in range(300):
            shape = tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 4, 16, candidates=lambda g, d: 4 * d)
            depths.append(shape.depth)
            if shape.drafters:
                tuner.observe(shape, [min(accepted, shape.depth)], shape.depth, 1 + 4 * shape.depth, 1, 1e-3, {}, [])
        probes = depths[depths.index(0):]
        assert depths[0] >= 3 and sum(d > 0 for d in probes) > 2 and set(probes) <= want | {0}, (accepted, depths)


def test_a_draft_is_never_predicted_cheaper_than_a_plain_step():
    """Each node count's online scale moves on its own (a burst of load on plain steps lifts the 1-node one):
    the predicted forward never decreases with the node count, and the tuner never prices a draft below a
    plain step, so a drafter that is never accepted is not run on every step for looking cheap."""
    costs = CostModel()
    costs.set_forward(1, [(1, 1.0), (2, 1.2), (4, 1.5), (8, 2.0)])
    costs.scale[("forward", 1, 1)] = 1.6  # plain steps measured during a burst of load
    assert costs.forward(1, 1) == pytest.approx(1.6) and costs.forward(2, 1) == pytest.approx(1.6)
    assert costs.forward(4, 1) == pytest.approx(1.6) and costs.forward(8, 1) == pytest.approx(2.0)
    assert costs.forward(3, 2) >= costs.forward(1, 2)  # a batch size not calibrated: the same rule

    class Seen(Tuner):
        def choose(self, options):
            self.options = options
            return super().choose(options)

    # a tree's forward predicted at half a plain one's (stale scales), drafting free
    tuner = Seen(FixedCosts(lambda n, b: 1e-3 if n <= 1 else 0.5e-3, lambda g, d, b: 0.0))
    tuner.begin(1, False)
    drafted = 0
    for _ in range(200):
        shape = tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 16)
        plain = tuner.options[0][2]
        assert all(seconds >= plain for _, _, seconds, _ in tuner.options)
        if shape.drafters:
            drafted += 1
            tuner.observe(shape, [0], shape.depth, shape.budget, 1, 1e-3, {}, [])
    assert drafted < 40, drafted  # (priced below a plain step, it ran on all 200)


def test_a_measured_forward_corrects_its_own_node_counts_scale():
    """The decoder compares a measured tree forward with that node count's own prediction
    (CostModel.forward_part), not with the plans' non-decreasing price (CostModel.forward): with the 1-node
    scale lifted by a burst of load, a forward of more nodes measured at its own prediction leaves its scale
    where it is."""
    m = em.greedy_models()
    seen = []

    class Spy(CostModel):
        def observe(self, key, batch, total, predicted_parts, parts, updates, timed_elsewhere=0.0):
            for part, (_, predicted) in parts.items():
                if part[0] == "forward":
                    seen.append((part, predicted, self.forward_part(part[2], part[1]), self.forward(part[2], part[1])))
            super().observe(key, batch, total, predicted_parts, parts, updates, timed_elsewhere)

    costs = Spy()
    costs.set_forward(1, [(n, 1e-3 * (1 + n / 8)) for n in (1, 2, 4, 8, 16)])
    costs.set_draft((0,), 1, (1, 1e-5), (3, 3e-5))
    costs.scale[("forward", 1, 1)] = 5.0  # every tree now priced at a plain step's lifted forward
    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["other"])], strategy="single", depth=3, top_k=3,
                             tuner=Tuner(costs, calibrate=False))
    dec.generate(torch.tensor([PROMPT]), max_new_tokens=12)
    trees = [s for s in seen if s[0][2] > 1]
    assert trees and all(predicted == pytest.approx(own) for _, predicted, own, _ in seen), seen
    assert all(price > own for _, _, own, price in trees), trees


def test_a_forward_shape_run_for_the_first_time_corrects_no_cost(monkeypatch):
    """A step whose target forward ran a shape (rows computed, requests, tree width) the decoder had not run
    before may hold one-off costs (oneDNN builds a bf16 product's kernel at each new row count): the tuner
    learns its acceptance but not its times; the same shapes run again correct the costs."""
    m = em.greedy_models()
    prompts = [m["seqs"][0, :4].tolist(), m["seqs"][1, :9].tolist(), m["seqs"][2, :6].tolist()]
    calls = []
    observe = Tuner.observe

    def spy(self, shape, accepted, cap, nodes, batch, total, parts, updates, costs=True, **kwargs):
        calls.append((shape, costs))
        return observe(self, shape, accepted, cap, nodes, batch, total, parts, updates, costs=costs, **kwargs)
    monkeypatch.setattr(Tuner, "observe", spy)
    shapes = []
    first_shape = SpeculativeDecoder._first_shape

    def record(self, rows, batch, width):
        first = first_shape(self, rows, batch, width)
        shapes.append(first)
        return first
    monkeypatch.setattr(SpeculativeDecoder, "_first_shape", record)
    dec = SpeculativeDecoder(m["target"], _greedy_drafters(["eagle", "lookup"]), strategy="merged", depth=3, top_k=3,
                             budget=8, tuner=Cycling())
    dec.generate(prompts, max_new_tokens=24)
    assert calls and len(calls) == len(shapes)  # Cycling observes every step
    assert [c for _, c in calls] == [not f for f in shapes]
    assert 0 < sum(shapes) < len(shapes)
    assert all(acc.pooled for acc in [dec.tuner.acceptance])  # learned from every drafted step, first ones too
    seen = set(dec._shapes_run)
    calls.clear(), shapes.clear()
    dec.generate(prompts, max_new_tokens=24)
    assert sum(shapes) == len(set(dec._shapes_run) - seen)  # only shapes new in this run are left out


def test_totals_equal_the_sum_of_each_requests_expectation_through_observations_and_row_changes():
    """AcceptanceModel.total keeps each request's E[accepted + 1] beside the sums: through observations of several
    kinds (which bound each other), finished rows and requests joining and leaving, every total equals the sum of
    the requests' expectations computed afresh."""
    import copy
    import random

    from taps.tuner import AcceptanceModel

    rng = random.Random(3)
    model = AcceptanceModel()
    model.horizon = 3
    model.reset(5)
    kinds = [((0,), 4), ((0,), 8), ((0,), 16), ((1,), 8), ((0, 1), 16)]
    for step in range(120):
        key = rng.choice(kinds)
        batch = len(model.requests)
        model.observe(key, [None if rng.random() < 0.2 else rng.randint(0, 3) for _ in range(batch)], 3)
        if step % 17 == 5 and batch > 2:
            model.select_requests([b for b in range(batch) if b != rng.randrange(batch)])
        if step % 23 == 7:
            model.add_requests(2)
        batch = len(model.requests)
        for _ in range(4):
            rows = tuple(sorted(rng.sample(range(batch), rng.randint(1, batch))))
            kind, cap, optimistic = rng.choice(kinds), rng.randint(1, 3), rng.random() < 0.5
            got = model.total(kind, rows, cap, optimistic)
            fresh = copy.deepcopy(model)
            fresh._forget()
            want = sum(1.0 + fresh.expected(kind, b, cap, optimistic) for b in rows)
            assert got == want, (step, kind, rows, cap, optimistic)


# ---- what a tuner learned, across processes -----------------------------------------------------------------------

def _tuned(names=("eagle", "lookup"), **kw):
    m = em.greedy_models()
    made = {"eagle": lambda: m["eagle"], "early": lambda: ModelDrafter(m["early_exit"]), "lookup": PromptLookupDrafter}
    return SpeculativeDecoder(m["target"], [made[n]() for n in names], strategy="merged", depth=3, top_k=3, budget="auto",
                              **kw)


def test_a_group_not_started_is_priced_by_its_measured_starts():
    """A group starts when it first drafts, on every token before it: the decoder times that start and
    reports it (drafters, tokens, seconds, True), the tuner tells the cost model even on a step whose forward
    paid one-off costs; the cost model keeps its seconds per token (each
    measurement moving it by at most 2x) and prices a group not started by it (before any start was
    measured, as an append of as many tokens), and the plan adds it to a draft's predicted seconds; a
    state saved before starts were measured loads with none."""
    costs = CostModel()
    costs.set_draft((0,), 1, (1, 1e-4), (3, 3e-4))
    assert costs.start((0,), 100, 1) == pytest.approx(costs.update((0,), 100, 1)) and costs.start((0,), 0, 1) == 0
    costs.observe_start((0,), 1, 50, 5e-3)
    assert costs.start((0,), 100, 1) == pytest.approx(1e-2)  # 0.1 ms a token
    costs.observe_start((0,), 1, 10, 1e-2)  # 1 ms a token: moved 2x at most
    assert 1e-4 < costs.start_rate[((0,), 1)] <= 2e-4
    state = costs.state_dict()
    del state["start_rate"]
    other = CostModel()
    other.load_state_dict(state)
    assert other.start_rate == {}
    # the plan prices a group not started by its starts (a shape of it predicted dearer by that much)
    forward = lambda n, b: 1e-3  # noqa: E731
    tuner = Tuner(FixedCosts(forward, lambda g, d, b: 1e-4, lambda g, t, b: 1e-5 * t))
    tuner.begin(1, False)
    seconds = {}
    tuner.choose = lambda options: (seconds.update({o[0]: o[2] for o in options}), NONE)[1]
    tuner.plan([(0,)], lambda g, d: d, [100], [0], 1, 3, 8, starting=[100])
    started, seconds = dict(seconds), {}
    tuner._plan_memo = None
    tuner.plan([(0,)], lambda g, d: d, [100], [0], 1, 3, 8, starting=[0])
    shape = Shape((0,), 2, 8)
    assert started[shape] == pytest.approx(seconds[shape])  # FixedCosts: a start costs what an append does
    # the decoder reports a group's start when a draft starts it
    m = em.greedy_models()
    tuner = Tuner(_cheap(draft=1e-6, forward=1e-3))  # drafting pays: the group starts at the first step
    reported = []
    observe = tuner.observe

    def spy(shape, accepted, cap, nodes, batch, total, parts, updates, **kw):
        reported.extend(u for u in updates if u[3:] and u[3])
        return observe(shape, accepted, cap, nodes, batch, total, parts, updates, **kw)

    tuner.observe = spy
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=2, top_k=2, budget=4, tuner=tuner)
    dec.generate([[5, 17, 42, 8, 61, 3, 9]], max_new_tokens=16)
    assert len(reported) == 1 and reported[0][:2] == ((0,), 7) and reported[0][2] > 0, reported


def test_a_saved_tuner_is_loaded_by_a_new_decoder(tmp_path):
    """save_tuner / load_tuner: the new decoder's tuner holds the same costs, pooled acceptance and probe schedule
    (it calibrates nothing at the batch sizes measured), and decodes losslessly from there."""
    from taps.tuner import _to_json

    first = _tuned()
    prompts = [[5, 17, 42, 8, 61, 3], [3, 3, 90, 12, 7, 64, 90, 2, 33, 41, 11]]
    first.generate(prompts, max_new_tokens=24)
    assert first.tuner.acceptance.pooled and first.tuner.costs.forward_points  # something learned
    key = (False, 2)
    first.generate(prompts, max_new_tokens=24)  # (the judge's first reference, a plain generation)
    assert first.judge.tracks[key].reference
    first.save_tuner(tmp_path / "tuner.json")
    second = _tuned()
    assert second.tuner.costs is None
    second.load_tuner(tmp_path / "tuner.json")
    assert _to_json(second.tuner.state_dict()) == _to_json(first.tuner.state_dict())
    # the generation judge's tracks too, each one's next tuned generation not judged (a new process's warm-up)
    assert second.judge.state(key) == first.judge.state(key) and second.judge.tracks[key].reference
    assert first.judge.tracks[key].warm and not second.judge.tracks[key].warm
    assert not second.tuner.costs.needs_forward(2)
    measured = []
    second.tuner.costs.set_forward = lambda batch, points: measured.append(batch)
    out = second.generate(prompts, max_new_tokens=24)
    assert not measured  # no calibration of the target's forward: the loaded one holds batch 2
    target = em.greedy_models()["target"]
    for p, tokens in zip(prompts, out.tokens):
        assert tokens == em.greedy_reference(target, p, 24)
    # the cost model it loaded, not one shared in this process (a later decoder of the same models would)
    assert second.tuner.costs is not first.tuner.costs


@pytest.mark.parametrize("change,field", [
    (lambda: _tuned(("early", "lookup")), "drafters"),
    (lambda: _tuned(tuner=Tuner(budgets=(2,))), None),  # the tuner's own settings are not the fingerprint's
    (lambda: SpeculativeDecoder(em.greedy_models()["target"], [em.greedy_models()["eagle"], PromptLookupDrafter()],
                                strategy="merged", depth=2, top_k=3, budget="auto"), "depth"),
])
def test_tuner_state_of_another_setup_is_refused(tmp_path, change, field):
    _tuned().save_tuner(tmp_path / "tuner.json")  # (nothing learned yet: a state all the same)
    other = change()
    if field is None:
        other.load_tuner(tmp_path / "tuner.json")
        return
    with pytest.raises(ValueError, match=f"another setup.*{field}: "):
        other.load_tuner(tmp_path / "tuner.json")


def test_tuner_state_threads_and_bad_files(tmp_path):
    dec = _tuned()
    dec.save_tuner(tmp_path / "tuner.json")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        with pytest.raises(ValueError, match=f"threads: {threads} there, {threads + 1} here"):
            dec.load_tuner(tmp_path / "tuner.json")
    finally:
        torch.set_num_threads(threads)
    (tmp_path / "other.json").write_text('{"weights": [1, 2]}')
    with pytest.raises(ValueError, match="not a tuner state"):
        dec.load_tuner(tmp_path / "other.json")
    (tmp_path / "cut.json").write_text((tmp_path / "tuner.json").read_text()[:100])  # (a file cut short)
    with pytest.raises(ValueError, match="cut.json is not a tuner state"):
        dec.load_tuner(tmp_path / "cut.json")
    text = (tmp_path / "tuner.json").read_text().replace('"version": 1', '"version": 99')
    (tmp_path / "future.json").write_text(text)
    with pytest.raises(ValueError, match="version 99"):
        dec.load_tuner(tmp_path / "future.json")
    m = em.greedy_models()
    fixed = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=2, top_k=2)
    with pytest.raises(ValueError, match="no tuner"):
        fixed.save_tuner(tmp_path / "x.json")
    with pytest.raises(ValueError, match="no tuner"):
        fixed.load_tuner(tmp_path / "tuner.json")


def test_tuner_state_json_round_trip():
    from taps.tuner import _from_json, _to_json

    value = {(("a", 1), 3): [(1, 2.5), (2, 3.0)], "s": {3, 1, 2}, 7: {"x": None, True: (1,)}, "e": ()}
    import json

    assert _from_json(json.loads(json.dumps(_to_json(value)))) == value
    with pytest.raises(TypeError, match="cannot write object"):
        _to_json({"x": object()})


def test_a_kind_is_priced_at_what_its_steps_take():
    """Whatever the parts' corrections leave out of a step (at batch 8 prompt lookup's kinds were priced 20-50%
    below what their steps took, and chosen where they lost), each kind's price is scaled by the running ratio of
    its steps' measured seconds to its price when chosen: a draft whose steps take 2.5x its price stops being
    chosen once its price says so, and plain steps keep their own ratio. Injected costs (FixedCosts) learn none."""
    def tuned():
        tuner = Tuner(_measured(), budgets=(4,), explore=0.0, refresh=1, calibrate=False, chains=False)
        tuner.begin(1, False)
        return tuner

    def run(tuner, slow):
        plans = []
        for _ in range(60):
            shape = tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 1, 4)
            plans.append(shape)
            price = tuner._priced[2] if tuner._priced is not None else 1e-3
            if shape.drafters:  # one token accepted a draft: priced to pay, it takes `slow` times its price
                tuner.observe(shape, [1], shape.depth, 2.0, 1, slow * price, {}, [])
            else:
                tuner.observe(shape, [None], 0, 1.0, 1, price, {}, [])
        return plans

    honest, slow = tuned(), tuned()
    assert all(s.drafters for s in run(honest, 1.0)[-20:])  # steps take their price: drafting pays
    assert honest._price_fix(Shape((0,), 1, 4).key) == pytest.approx(1.0)
    plans = run(slow, 2.5)
    assert plans[0].drafters and not any(s.drafters for s in plans[-20:])
    assert slow._price_fix(Shape((0,), 1, 4).key) > 1.5 and slow._price_fix(NONE.key) == pytest.approx(1.0)
    state = slow.state_dict()  # kept with what the tuner learned, and an older state without it loads
    other = tuned()
    other.load_state_dict(state)
    assert other._fix == slow._fix and other._fix_set == slow._fix_set
    del state["_fix"], state["_fix_set"]
    tuned().load_state_dict(state)
    fixed = Tuner(_cheap(draft=1e-5, forward=1e-3))
    fixed.begin(1, False)
    shape = fixed.plan([(0,)], lambda g, d: d, [0], [0], 1, 1, 4)
    fixed.observe(shape, [1], 1, 2.0, 1, 1.0, {}, [])
    assert fixed._fix == {} and fixed._fix_set == {} and fixed._priced is None


def test_a_kind_seldom_chosen_is_priced_from_its_drafters_other_kinds():
    """The running ratio of a set of drafters' steps to their prices scales every kind of that set: a kind never
    run since (a probe, a kind chosen after a run of plain steps) is priced at it too, its own ratio kept against
    it; another set's kinds and the no-draft step are not."""
    tuner = Tuner(_measured((0,), (1,)), budgets=(4,), explore=0.0, refresh=1, calibrate=False, chains=False)
    tuner.begin(1, False)
    often, seldom, other = Shape((0,), 1, 4), Shape((0,), 1, 8), Shape((1,), 1, 4)
    for _ in range(40):  # the often-run kind's steps take twice their price
        tuner._priced = (often, 1, 1e-3, tuner._fix_set.get(often.key[0], 1.0))
        tuner.observe(often, [1], 1, 4.0, 1, 2e-3, {}, [])
    assert tuner._fix_set[(0,)] == pytest.approx(2.0, rel=0.05)
    assert tuner._price_fix(seldom.key) == pytest.approx(2.0, rel=0.05)  # never run: its set's ratio
    assert tuner._price_fix(often.key) == pytest.approx(2.0, rel=0.05)   # its own against the set's: ~1
    assert tuner._price_fix(other.key) == 1.0 and tuner._price_fix(NONE.key) == 1.0
    for _ in range(40):  # the seldom kind, once run, takes its price as the set's ratio predicts: it stays there
        tuner._priced = (seldom, 1, 1e-3, tuner._fix_set[(0,)])
        tuner.observe(seldom, [1], 1, 8.0, 1, 2e-3, {}, [])
    assert tuner._price_fix(seldom.key) == pytest.approx(2.0, rel=0.05)


def test_a_forward_is_priced_at_least_at_what_fewer_nodes_are():
    """CostModel.forward: a node count's own prediction, or the most any calibrated smaller count is predicted at
    (each count's online scale moves on its own), whatever the scales and however often it is asked; over the
    calibrated counts, never less for more nodes."""
    rng = random.Random(5)
    for _ in range(20):
        costs = CostModel()
        grid = sorted(rng.sample(range(1, 40), rng.randint(1, 8)))
        for batch in (1, 4):
            costs.set_forward(batch, [(n, batch * (1e-4 + 2e-5 * n) * rng.uniform(0.8, 1.2)) for n in grid])
        for _ in range(3):
            for n in grid:
                costs.scale[("forward", 1, n)] = rng.uniform(0.5, 2.0)
            costs._forward_memo.clear()  # (as an observation that moves a scale does)
            asked = [rng.choice([rng.uniform(1, 45), float(rng.randint(1, 45))]) for _ in range(30)]
            for nodes in asked + asked:
                want = max([costs.forward_part(nodes, 1)] + [costs.forward_part(n, 1) for n in grid if n < nodes])
                assert costs.forward(nodes, 1) == want
            assert all(costs.forward(a, 1) <= costs.forward(b, 1) for a, b in zip(grid, grid[1:]))


@pytest.mark.parametrize("batch", [1, 2])
def test_a_coasting_step_ends_when_prompt_lookup_has_a_match(batch, monkeypatch):
    """Where prompt lookup's drafts pay (a node costs a thousandth of a forward), a plain step that repeats
    a plan of no draft (coasting, with the checks listed when that plan chose) ends at the first step where
    the lookup has a match for more requests than at that plan: every step with a match drafts, every step
    without coasts or plans no draft; a drafted step that repeats the last draft without planning
    (SpeculativeDecoder._coasts_draft) does so only while the lookup has a match for the same requests as at
    that draft's plan; the output is the target's greedy output."""
    m = em.greedy_models()
    prompts = [[5, 17, 42, 8, 61, 3, 5, 17, 42, 8, 61, 3, 5, 17], [9, 31, 4, 77, 20, 13, 2, 58]][:batch]
    ref = SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate(prompts, max_new_tokens=40)
    steps, planned, drafts_again = [], [], []
    plan_of, step_of = SpeculativeDecoder._plan, SpeculativeDecoder.step

    def spy_plan(self, state):
        plan = plan_of(self, state)
        planned.append((bool(plan.drafting), self.tuner.probing))
        return plan

    def spy_step(self, state):
        lookup = state.groups[0]
        started = state.pending.started(lookup)
        matched = sum(lookup.has_draft(b) for b in state.active()) if started else None
        token, repeat = state.coast, state.coast_draft
        planned.clear()
        step_of(self, state)
        coasted = token is not None and state.coast is token  # (repeated without planning)
        # (the last draft repeated without planning)
        again = repeat is not None and state.coast_draft is not None and state.coast_draft[0] is repeat[0] \
            and state.coast_draft[2] == repeat[2] + 1
        assert coasted + again + bool(planned) == 1
        drafts_again.append(again)
        steps.append((matched, coasted) + (planned[0] if planned else (again, False)))
    monkeypatch.setattr(SpeculativeDecoder, "_plan", spy_plan)
    monkeypatch.setattr(SpeculativeDecoder, "step", spy_step)
    # (a step's cost in proportion to its requests: a request's tokens are then worth as much wherever it stands
    # in the batch, also by the batch's end, Tuner.finish_time)
    tuner = Tuner(FixedCosts(lambda n, b: b * (1e-3 + 1e-6 * n), lambda g, d, b: 1e-6), explore=0.0)
    dec = SpeculativeDecoder(m["target"], [PromptLookupDrafter()], strategy="single", depth=3, top_k=1, budget=4,
                             tuner=tuner)
    out = dec.generate(prompts, max_new_tokens=40)
    assert out.tokens == ref.tokens
    known = [s for s in steps if s[0] is not None]
    assert any(s[1] for s in known) and any(s[2] for s in known), steps  # both coasting and drafting happened
    assert any(drafts_again), steps  # and drafts repeated without planning
    for matched, coasted, drafted, probing in known:
        assert drafted == (matched > 0) or probing, steps
        assert not (coasted and matched)


def _useless_and_reference(new=40):
    """The greedy target, prompts, their autoregressive outputs and a drafter whose proposals the target never
    produces here."""
    m = em.greedy_models()
    prompts = [m["seqs"][i, :6].tolist() for i in range(3)]
    ref = SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate(prompts, max_new_tokens=new)
    produced = {t for row in ref.tokens for t in row}
    useless = ModelDrafter(m["other"]).set_draft_vocab(torch.tensor([t for t in range(96) if t not in produced][:16]))
    return m, prompts, ref, useless


def test_a_drafter_the_tuner_never_chooses_is_left_out_of_the_next_generations(monkeypatch):
    """Greedy generations of 40 steps where drafting never pays (a useless drafter, a draft priced at ten
    forwards): after two in which the tuner chose it on no step (probes apart) the drafter is left out of the
    next generation, tried again in the one after, then left out of 2, 4, 8, 16, 16 ... in a row; left out, it
    is not started and every step is an autoregressive one (no tuner plan); the output is the target's greedy
    one throughout. A sampled generation is judged apart (its first two start the drafter)."""
    import taps.decoder as decoder_module

    m, prompts, ref, useless = _useless_and_reference()
    dec = SpeculativeDecoder(m["target"], [useless], strategy="single", depth=3, top_k=3, budget=6,
                             tuner=Tuner(_cheap(draft=1e-2, forward=1e-3)))
    starts, plans = [], []
    start_of, plan_of = decoder_module._Pending.__init__, SpeculativeDecoder._plan
    monkeypatch.setattr(decoder_module._Pending, "__init__",
                        lambda self, groups, *a, **k: (starts.append(len(groups)), start_of(self, groups, *a, **k))[1])
    monkeypatch.setattr(SpeculativeDecoder, "_plan",
                        lambda self, state: (plans.append(self.tuner), plan_of(self, state))[1])
    left = []
    for i in range(40):
        starts.clear(), plans.clear()
        out = dec.generate([prompts[i % 3]], max_new_tokens=40)
        assert out.tokens[0] == ref.tokens[i % 3], i
        left.append(bool(out.summary["left_out"]))
        if left[-1]:
            assert out.summary["left_out"] == [0] and not starts and all(t is None for t in plans) and out.steps == 39
        else:
            assert starts == [1] and all(t is dec.tuner for t in plans)
    kept = [i for i, x in enumerate(left) if not x]
    assert kept == [0, 1, 3, 6, 11, 20, 37], kept
    assert dec.tuner is not None
    sampled = [dec.generate([prompts[0]], max_new_tokens=40, temperature=1.0, seed=s).summary["left_out"]
               for s in range(3)]
    assert sampled == [[], [], [0]], sampled


def test_a_drafter_the_tuner_chooses_is_never_left_out():
    """A perfect cheap drafter (the target itself) is chosen on most steps: never left out; nor is prompt
    lookup in greedy generations (nor in a batch where some request is greedy), even where the tuner never drafts
    with it (its drafts priced at ten forwards), while generations where every request samples leave it out
    like any idle drafter; nor is an n-gram table, greedy or sampled; with
    ``leave_out_after=None`` no drafter is, however idle; a generation under 8 steps judges nothing."""
    m, prompts, ref, useless = _useless_and_reference()
    good = SpeculativeDecoder(m["target"], [ModelDrafter(m["target"])], strategy="single", depth=3, top_k=2,
                              budget=6, tuner=Tuner(_cheap(draft=1e-5, forward=1e-3)))
    for i in range(5):
        out = good.generate([prompts[i % 3]], max_new_tokens=40)
        assert out.summary["left_out"] == [] and out.tokens[0] == ref.tokens[i % 3]
    lookup = SpeculativeDecoder(m["target"], [PromptLookupDrafter()], strategy="single", depth=3, top_k=2, budget=6,
                                tuner=Tuner(_cheap(draft=1e-2, forward=1e-3)))
    outs = [lookup.generate([prompts[i % 3]], max_new_tokens=40) for i in range(5)]
    assert all(o.summary["left_out"] == [] and o.tokens[0] == ref.tokens[i % 3] for i, o in enumerate(outs))
    assert sum(o.summary["shape_histogram"].get("none", 0) for o in outs) >= 0.9 * sum(o.steps for o in outs)
    mixed = torch.tensor([0.0, 1.0])
    left = [lookup.generate([prompts[0], prompts[1]], max_new_tokens=20, temperature=mixed, seed=i).summary["left_out"]
            for i in range(4)]
    assert left == [[]] * 4, left
    left = [lookup.generate([prompts[i % 3]], max_new_tokens=20, temperature=1.0, seed=i).summary["left_out"]
            for i in range(4)]
    assert left == [[], [], [0], []], left
    # nor an n-gram table (kept current at little cost: a table left out while the tuner learned missed up to 16
    # generations where its chains paid), greedy or sampled, even where the tuner never drafts with it
    import numpy as np

    from taps import NgramTable, NgramTableDrafter
    from taps.drafters import target_vocab_size

    produced = {t for row in ref.tokens for t in row}
    never = next(t for t in range(96) if t not in produced)
    table = NgramTable(np.array([0], np.uint64), [1], [0, 1], [never], [0.0], target_vocab_size(m["target"]), 0)
    tabled = SpeculativeDecoder(m["target"], [NgramTableDrafter(table)], strategy="single", depth=3, top_k=1, budget=4,
                                tuner=Tuner(_cheap(draft=1e-2, forward=1e-3)))
    for temperature in (0.0, 1.0):
        outs = [tabled.generate([prompts[i % 3]], max_new_tokens=40, temperature=temperature, seed=i) for i in range(5)]
        assert all(o.summary["left_out"] == [] for o in outs), temperature
        assert sum(o.summary["shape_histogram"].get("none", 0) for o in outs) >= 0.9 * sum(o.steps for o in outs)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="leave_out_after must be None or an integer >= 1"):
            good.leave_out_after = bad
    for after, new, expect in ((None, 40, []), (2, 8, [])):
        dec = SpeculativeDecoder(m["target"], [useless], strategy="single", depth=3, top_k=3, budget=6,
                                 tuner=Tuner(_cheap(draft=1e-2, forward=1e-3)))
        dec.leave_out_after = after
        left = [dec.generate([prompts[i % 3]], max_new_tokens=new).summary["left_out"] for i in range(6)]
        assert left == [expect] * 6, (after, new, left)


def test_only_the_idle_group_of_several_is_left_out():
    """Merged-budget over a perfect cheap drafter and a useless dear one (two groups): the useless group is left
    out from the third generation (of 12-15 steps each); the other drafts on; greedy output unchanged."""
    m, prompts, ref, useless = _useless_and_reference()
    costs = FixedCosts(lambda n, b: 1e-3, lambda g, d, b: (1e-2 if 1 in g else 1e-5) * d,
                       lambda g, t, b: 1e-2 if 1 in g else 1e-5)
    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["target"]), useless], strategy="merged-budget", depth=3,
                             top_k=2, budget=6, tuner=Tuner(costs))
    assert [tuple(g.members) for g in dec._draft_groups()] == [(0,), (1,)]
    outs = [dec.generate([prompts[i % 3]], max_new_tokens=40) for i in range(3)]
    assert [o.summary["left_out"] for o in outs] == [[], [], [1]]
    assert all(o.tokens[0] == ref.tokens[i % 3] for i, o in enumerate(outs))
    assert outs[2].summary["tau"] > 2 and outs[2].summary["drafter_share"][1] == 0.0


def test_a_generation_with_its_drafter_left_out_samples_the_target():
    """Two sampled generations in which drafting never pays (a draft priced at ten forwards) leave the drafter out
    of the third; that generation's sampled sequences follow the target's distribution (chi-square)."""
    m = em.sampling_models()
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=2, budget=6,
                             tuner=Tuner(_cheap(draft=1e-2, forward=1e-3)))
    for s in range(2):
        assert dec.generate([PROMPT], max_new_tokens=12, temperature=1.0, seed=s).summary["left_out"] == []
    out = dec.generate([PROMPT] * 2000, max_new_tokens=STEPS, temperature=1.0, seed=78)
    assert out.summary["left_out"] == [0] and out.summary["shape_histogram"] == {"none": 2000 * (STEPS - 1)}
    assert_samples_follow(out.tokens, PROMPT, 1.0, 0, 1.0, what="left out: ")


def test_a_drawn_draft_is_priced_by_its_own_calibration():
    """CostModel.draft(drawn=True): the group's top-k expansion's cost until its drawn draft is calibrated, then
    its own points and its own online scale (an n-gram table's drawn chain is one host call, its top-k tree an
    expansion over its logits)."""
    from taps.tuner import DRAWN

    costs = _measured()
    assert costs.draft((0,), 3, 1, drawn=True) == costs.draft((0,), 3, 1) == pytest.approx(3e-4)
    assert costs.draft_key((0,), 1, True) == (0,)
    assert costs.needs_draft((0, DRAWN), 1)
    costs.set_draft((0, DRAWN), 1, (1, 2e-5), (3, 4e-5))
    assert not costs.needs_draft((0, DRAWN), 1) and costs.draft_key((0,), 1, True) == (0, DRAWN)
    assert costs.draft((0,), 3, 1, drawn=True) == pytest.approx(4e-5)
    assert costs.draft((0,), 2, 2, drawn=True) == pytest.approx(2 * 3e-5)  # (a batch of 2: scaled from batch 1)
    assert costs.draft((0,), 3, 1) == pytest.approx(3e-4)
    costs.observe(((0, DRAWN), 4), 1, 1.5e-3, 1.3e-3, {("draft", (0, DRAWN), 3, 1): (8e-5, 4e-5)}, [])
    assert costs.draft((0,), 3, 1, drawn=True) > 4e-5 and costs.draft((0,), 3, 1) == pytest.approx(3e-4)


def test_a_step_after_another_kind_corrects_no_cost_and_prices_the_switch():
    """Tuner.observe(switched=True) of a step that took longer than its price, a probe or a chosen kind's: the
    kind's acceptance is learned, its costs are not (it ran code and data the steps before evicted), what it took
    beyond its price becomes the kind's switch cost, and what a probe lost beyond its charge is still spent from
    the credit; one that took less than its price corrects them (cold as it ran, the kind costs at most that), as
    does a step after a step of its own kind."""
    shape = Shape((0,), 3, 4)
    parts = {("forward", 1, 4): (3e-3, 1.2e-3), ("draft", (0,), 3, 1): (9e-4, 3e-4)}

    def observed(probing, switched, price=2e-3):
        tuner = Tuner(_measured())
        tuner.begin(1, False)
        tuner.probing = probing
        tuner._charge = (shape, 0.0, 1000.0, 1)
        tuner._priced = (shape, 1, price, 1.0)
        tuner._credit = 1.0
        before = copy.deepcopy((tuner.costs.state_dict(), tuner._fix))
        tuner.observe(shape, [1], 3, 4.0, 1, 4e-3, dict(parts), [], switched=switched)
        assert tuner.acceptance.trials(shape.key, 0, 1) > 0
        assert tuner._credit < 1.0  # (4 ms for 2 tokens at 1,000 tokens/s: 2 ms lost)
        switch = tuner._switch.get(shape.key, 0.0)
        # (the switch: 4 ms against a price of 2: 2 ms, a running mean from 0)
        assert switch == (pytest.approx(tuner.costs.alpha * (4e-3 - price)) if switched and price < 4e-3 else 0.0)
        return (tuner.costs.state_dict(), tuner._fix) != before

    assert not observed(probing=True, switched=True)
    assert not observed(probing=False, switched=True)
    assert observed(probing=True, switched=True, price=5e-3)
    assert observed(probing=True, switched=False) and observed(probing=False, switched=False)
    # a plain step after a draft corrects the plain price and learns no switch cost
    tuner = Tuner(_measured())
    tuner.begin(1, False)
    tuner._priced = (NONE, 1, 1e-3, 1.0)
    before = copy.deepcopy((tuner.costs.state_dict(), tuner._fix))
    tuner.observe(NONE, [None], 0, 1.0, 1, 2e-3, {("forward", 1, 1): (1.8e-3, 1e-3)}, [], switched=True)
    assert (tuner.costs.state_dict(), tuner._fix) != before and not tuner._switch


def test_a_switch_costs_its_kind_where_the_step_before_was_another():
    """plan(previous=): a kind other than the step before's is priced with its switch cost (Tuner._switch): a
    draft that pays in a run of drafts is not switched to from plain steps when switching costs more than it
    gains, and is kept where the step before was one of its own."""
    def tuner_and_plan(previous, switch):
        tuner = Tuner(FixedCosts(lambda n, b: 1e-3 + 1e-4 * b * n, lambda g, d, b: 1e-5 * d), budgets=(),
                      chains=False, explore=0.0, refresh=1)
        tuner.begin(1, False)
        shape = Shape((0,), 3, 4)
        for _ in range(20):  # every draft of 3 accepted: 4 tokens a step for ~1.4 ms against 1 for 1.1
            tuner.observe(shape, [3], 3, 4.0, 1, 1.4e-3, {}, [])
        tuner._switch = {shape.key: switch}
        return shape, tuner.plan([(0,)], lambda g, d: d, [0], [0], 1, 3, 4, previous=previous)

    shape, chosen = tuner_and_plan(NONE.key, 0.0)
    assert chosen == shape
    assert tuner_and_plan(NONE.key, 10e-3)[1] == NONE  # 4 tokens in 11.4 ms against 1 in 1.1
    assert tuner_and_plan(shape.key, 10e-3)[1] == shape
    assert tuner_and_plan(None, 10e-3)[1] == shape  # (no step before known: no switch)


def test_the_decoder_calibrates_drawn_drafts_and_reports_switches(monkeypatch):
    """At T = 1 with drawn drafts allowed, the tuner's cost model gets the group's drawn draft calibrated apart
    (from a private generator: the same tokens as a decoder whose drawn draft was calibrated before); every step's
    observation says whether the step before it ran another kind."""
    from taps.tuner import DRAWN

    m = em.sampling_models()
    calls = []
    observe = Tuner.observe

    def spy(self, shape, *args, switched=False, **kwargs):
        calls.append((shape.key, switched))
        return observe(self, shape, *args, switched=switched, **kwargs)
    monkeypatch.setattr(Tuner, "observe", spy)

    def run(tuner):
        dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["target"])], strategy="single", depth=3, top_k=1,
                                 budget=4, tuner=tuner, sampled_drafts=True)
        return dec.generate([PROMPT, [7, 2, 2, 19]], max_new_tokens=30, temperature=1.0, seed=4).tokens

    tuner = Cycling()
    tuner.costs = CostModel()
    tuner.costs.set_forward(2, [(1, 1e-3), (4, 1.2e-3)])
    first = run(tuner)
    assert ((0, DRAWN), 2) in tuner.costs.draft_points and ((0,), 2) in tuner.costs.draft_points
    kinds = [k for k, _ in calls]
    # (before the first step: as after a plain one)
    assert [w for _, w in calls] == [kinds[0] != NONE.key] + [a != b for a, b in zip(kinds, kinds[1:])]
    assert True in [w for _, w in calls[1:]] and False in [w for _, w in calls]
    calibrated = Cycling()
    calibrated.costs = copy.deepcopy(tuner.costs)
    assert run(calibrated) == first  # (no calibration this time: the requests' draws are the same)


def test_drawn_shapes_that_draw_the_same_tree_are_one_kind():
    """With the decoder's drawn node counts (``plan(drawn_nodes=)``), a drawn shape that runs fewer nodes than its
    budget is left out where the drawn shape of that many nodes at its depth is a candidate (at top_k 1 a budget of
    4 at depth 2 draws the 3-node chain a budget of 3 does); the top-k shapes stay; without drawn_nodes every
    budget is a kind."""
    tuner = Tuner(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-3))
    chains = lambda budget, depth: 1 + depth  # noqa: E731  (one chain: top_k 1)
    both = tuner._shapes(((0,),), 3, 4, False, frozenset({0}), False, chains)
    drawn = {(s.depth, s.budget) for s, *_ in both if s.drawn}
    topk = {(s.depth, s.budget) for s, *_ in both if not s.drawn}
    assert drawn == {(1, 2), (2, 3), (3, 4)}, drawn
    assert {(2, 4), (1, 3), (1, 4)} <= topk
    every = tuner._shapes(((0,),), 3, 4, False, frozenset({0}), False, None)
    assert {(s.depth, s.budget) for s, *_ in every if s.drawn} == {(s.depth, s.budget) for s, *_ in every if not s.drawn}
    # two chains a level where the budget allows (1 + 2 * depth nodes): budget 4 at depth 1 is its own tree (3 nodes
    # there: left out for (1, 3)), budget 8 at depth 3 draws 7
    wide = lambda budget, depth: 1 + min(2, (budget - 1) // depth) * depth  # noqa: E731
    drawn = {(s.depth, s.budget) for s, *_ in tuner._shapes(((0,),), 3, 8, False, frozenset({0}), False, wide) if s.drawn}
    assert (1, 4) not in drawn and (1, 3) in drawn and (3, 8) in drawn and (2, 4) not in drawn, drawn


def test_drafted_steps_of_a_kept_current_group_repeat_without_planning(monkeypatch):
    """A drafted kind the tuner keeps choosing, of groups kept current (an n-gram table) and no group asked for
    matches: of each DRAFT_COAST + 1 steps in a row, one plans and is timed and the rest repeat its plan (no plan, no
    clock, no cost observation), every step's acceptance observed; a join or drop ends the repeats. The output is
    the target's greedy one."""
    import numpy as np

    import taps.decoder as decoder_module
    from taps import NgramTable, NgramTableDrafter
    from taps.drafters import target_vocab_size

    m = em.greedy_models()
    prompts = [m["seqs"][i, :6].tolist() for i in range(3)]
    ref = SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate(prompts, max_new_tokens=40)
    # a table of the target's own continuations (orders 0-2 over its greedy outputs): its chains are accepted
    seqs = [p + r for p, r in zip(prompts, ref.tokens)]
    vocab = target_vocab_size(m["target"])
    rows = []
    for seq in seqs:
        ids = np.array([[t] for t in seq[1:]])
        rows.append((np.array(seq), ids, np.ones((len(seq) - 1, 1)), 0))
    table = NgramTable.from_distributions(rows, vocab, max_order=2, entries=4, min_count=1)
    calls = {"plan": 0, "observe": 0, "accepted": 0}
    for name, key in (("plan", "plan"), ("observe", "observe")):
        original = getattr(Tuner, name)
        monkeypatch.setattr(Tuner, name, lambda self, *a, _o=original, _k=key, **k: (
            calls.__setitem__(_k, calls[_k] + 1), _o(self, *a, **k))[1])
    # the steps repeated without planning (each reports its acceptance alone: Tuner.observe_accepted)
    accepted_of = decoder_module.SpeculativeDecoder._record

    def record(self, state, plan, *a, **k):
        if plan.coasted:
            calls["accepted"] += 1
        return accepted_of(self, state, plan, *a, **k)
    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "_record", record)
    dec = SpeculativeDecoder(m["target"], [NgramTableDrafter(table)], strategy="single", depth=3, top_k=1, budget=4,
                             tuner=Tuner(_cheap(draft=1e-6, forward=1e-3)))
    out = dec.generate(prompts[:1], max_new_tokens=40)
    assert out.tokens[0] == ref.tokens[0]
    drafted = sum(1 for x in out.stats[0].draft_shapes if x != "none")
    assert drafted >= 6 and out.summary["tau"] > 2, (drafted, out.summary)
    assert calls["accepted"] >= drafted // 2, calls
    assert calls["plan"] + calls["accepted"] <= out.steps + 1 and calls["observe"] + calls["accepted"] >= drafted, calls
    assert decoder_module.DRAFT_COAST >= 1
    # a batch whose requests finish apart: repeats end at each finish, and every request's output is its greedy one
    out = dec.generate(prompts, max_new_tokens=40)
    assert out.tokens == ref.tokens


def _finish_tuner(finish=True):
    """A tuner over one drafter and a batch of 2, where request 0's drafts of 3 are all accepted and request 1's
    never (observed 20 steps); a step costs 1 ms plus 0.1 ms a row and node, so a request's row is a tenth of
    a plain step's cost at a batch of 1."""
    tuner = Tuner(FixedCosts(lambda n, b: 1e-3 + 1e-4 * b * n, lambda g, d, b: 1e-5 * d), budgets=(), chains=False,
                  explore=0.0, refresh=1, finish_time=finish)
    tuner.begin(2, False)
    for _ in range(20):
        _plan_left(tuner, None)
        tuner.observe(Shape((0,), 3, 4), [3, 0], 3, 4.0, 2, 1.8e-3, {}, [])
    return tuner


def _plan_left(tuner, left):
    return tuner.plan([(0,)], lambda g, d: d, [0], [0, 1], 2, 3, 4, left=left)


@pytest.mark.parametrize("left,drafts", [([40, 40], False), ([2, 40], False), ([40, 2], True), ([3, 3], False)])
def test_a_static_batch_is_valued_by_its_end(left, drafts):
    """Where the batch ends with its last request (``plan(left=)``), a draft is valued by how much it shortens
    that end: by tokens a draft that gives request 0 ~3.8 tokens a step pays (4.99 tokens for 1.8 ms against 2
    for 1.2), but where request 1, whose drafts are never accepted, has as many tokens left or more, the batch
    ends when it does and drafting only adds to every step's cost (no draft); where request 0 has the most
    left, it does (draft); near the end, a request's tokens count up to those it has left (no draft)."""
    tuner = _finish_tuner()
    assert tuner.acceptance.expected(((0,), 4), 0, 3) > 2.5 and tuner.acceptance.expected(((0,), 4), 1, 3) < 0.3
    assert bool(_plan_left(tuner, left).drafters) == drafts
    # by tokens (no left, or finish_time off): a draft
    assert _plan_left(_finish_tuner(), None).drafters == (0,)
    assert _plan_left(_finish_tuner(finish=False), left).drafters == (0,)


def test_generate_passes_the_tokens_left_and_a_continuous_batch_does_not():
    """``generate`` (a batch no request joins) gives the tuner each active request's tokens left; a
    :class:`ContinuousBatch` (rows refilled as requests finish) gives none."""
    from taps.batching import ContinuousBatch, SamplingParams

    m = em.greedy_models()
    seen = []
    plan = Tuner.plan

    def spy(self, *args, left=None, **kw):
        seen.append((tuple(args[3]), None if left is None else tuple(left)))
        return plan(self, *args, left=left, **kw)

    prompts = [m["seqs"][0, :5].tolist(), m["seqs"][1, :8].tolist()]
    tuner = Tuner(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-5 * d), refresh=1)
    dec = SpeculativeDecoder(m["target"], [PromptLookupDrafter()], strategy="single", depth=3, top_k=1, budget=4,
                             tuner=tuner)
    import unittest.mock

    with unittest.mock.patch.object(Tuner, "plan", spy):
        out = dec.generate(prompts, max_new_tokens=12)
        assert seen and all(left is not None and len(left) == len(active) for active, left in seen)
        assert seen[0][1] == (11, 11) and all(0 < x <= 11 for _, left in seen for x in left)
        assert out.tokens == SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate(
            prompts, max_new_tokens=12).tokens
        seen.clear()
        batch = ContinuousBatch(dec, max_batch=2)
        for i, p in enumerate(prompts):
            batch.add(i, p, SamplingParams(max_new_tokens=9))
        for _ in range(100):
            if not batch:
                break
            batch.step()
        assert not batch
        assert seen and all(left is None for _, left in seen)


def test_finish_time_switched_on_after_plans_without_it():
    """A tuner whose plans kept no per-request values (``finish_time`` off) and is then switched on values the
    batch by its end from its current plan memo (no error, the same answer as one on from the start)."""
    tuner = _finish_tuner(finish=False)
    assert _plan_left(tuner, None).drafters == (0,)  # (values computed now, kept while no draft is observed)
    memo = tuner._plan_memo
    assert not memo[6]
    tuner.finish_time = True
    tuner._last_draft = None  # (not the last draft repeated unpriced: the candidates priced from the memo)
    assert _plan_left(tuner, [2, 40]) == NONE
    assert tuner._plan_memo[1] is memo[1] and memo[6]  # the same memo, its per-request values added
    assert _plan_left(_finish_tuner(), [2, 40]) == NONE


def test_the_decoder_passes_the_kind_of_the_step_before():
    """The decoder's plans get ``previous``: the kind of the step before (a plain step's at the first plan and
    after coasting plain steps), the drafted kind after a drafted step."""
    m = em.greedy_models()
    seen = []
    plan = Tuner.plan

    def spy(self, *args, previous=None, **kw):
        shape = plan(self, *args, previous=previous, **kw)
        seen.append((previous, shape.key))
        return shape

    tuner = Tuner(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-5 * d), refresh=1)
    dec = SpeculativeDecoder(m["target"], [PromptLookupDrafter()], strategy="single", depth=3, top_k=1, budget=4,
                             tuner=tuner)
    import unittest.mock

    with unittest.mock.patch.object(Tuner, "plan", spy):
        dec.generate([m["seqs"][0, :6].tolist()], max_new_tokens=16)
    assert seen and seen[0][0] == NONE.key
    assert all(prev is not None for prev, _ in seen)
    drafted = [i for i, (_, kind) in enumerate(seen[:-1]) if kind != NONE.key]
    assert drafted, seen
    # a plan right after a drafted step's plan (no step between them) is told that step's kind
    assert any(seen[i + 1][0] == seen[i][1] for i in drafted), seen


def test_coasting_plain_steps_are_reported_as_runs():
    """Coasting plain steps are timed as runs (SpeculativeDecoder.coast_block): the tuner is told of them as
    plain steps of the run's mean time (a clock read at a run's start and end, none between), at most one
    report per coast_block steps; coast_block None times one coasting step on its own as before. The output is
    the target's greedy output either way."""
    m = em.greedy_models()
    prompt = [5, 17, 42, 8, 61, 3, 9]
    ref = SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate([prompt], max_new_tokens=120)
    for block in (4, None):
        reads = []
        tuner = Tuner(FixedCosts(lambda n, b: 1e-3 + 1e-2 * (n - 1), lambda g, d, b: 1e-2),
                      timer=lambda: reads.append(1) or float(len(reads)))
        runs, plain, inside = [], [], [False]
        observe = tuner.observe
        tuner.observe = lambda shape, *a, **k: ((plain if not shape.drafters else []).append((a[4], inside[0])),
                                                observe(shape, *a, **k))[1]
        dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=2, budget=8,
                                 tuner=tuner)
        dec.coast_block = block
        report = dec._observe_coast

        def spy(state):
            runs.append(state.coast_block[1])
            inside[0] = True
            report(state)
            inside[0] = False
        dec._observe_coast = spy
        out = dec.generate([prompt], max_new_tokens=120)
        assert out.tokens[0] == ref.tokens[0]
        if block is None:
            assert not runs and plain and not any(i for _, i in plain)
            continue
        assert runs and min(runs) >= block, runs
        # each run's mean: this clock counts reads, and a run reads it at its start and its end only (the end the
        # next run's start)
        means = [t for t, i in plain if i]
        assert means == [pytest.approx(1.0 / n) for n in runs], (means, runs)
