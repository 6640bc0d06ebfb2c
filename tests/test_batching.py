"""Continuous batching (taps.batching.ContinuousBatch) on tiny random Llama models, fp32 on CPU.

1. Requests that join a running batch at different steps, leave it when they finish, or are cancelled
   get, token for token, their greedy decoding alone (the target's own greedy output), for every kind of
   drafter group, the merging and routing strategies, with and without a tuner; nothing leaks (no row
   left, the state dropped when the batch empties).
2. Sampling: a request's tokens under a seed do not depend on its neighbours (fixed draft settings), and
   the first tokens of many seeded requests admitted at different steps, mixed with greedy ones, follow
   the target's exact distribution (chi-square).
3. The caller's errors: a known id, bad sampling values, a prompt too long for the model.
"""

import random
from collections import Counter

import pytest
import torch

from taps import ModelDrafter, PromptLookupDrafter, SpeculativeDecoder
from taps.batching import ContinuousBatch, SamplingParams
from taps.tuner import FixedCosts, Tuner

import engine_models as em
from sampling_checks import assert_counts, spec_probs

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 42, 8, 61, 3], [3, 3, 90, 12, 7, 64, 90, 2, 33, 41, 11], [70, 1], [9, 9, 9, 4, 9, 9, 9],
           [12, 40, 41, 42, 12, 40], [33, 2]]


SAMPLING_PROMPTS = [[3, 9, 1, 30], [5, 17, 2, 8, 11, 4], [7, 7], [30, 1, 4, 9, 22, 13, 8]]  # vocabulary 32


def _greedy(i, steps):
    return em.greedy_reference(em.greedy_models()["target"], PROMPTS[i], steps)


def _drafters(names):
    m = em.greedy_models()
    made = {"eagle": lambda: m["eagle"], "early": lambda: ModelDrafter(m["early_exit"]),
            "other": lambda: ModelDrafter(m["other"]), "lookup": lambda: PromptLookupDrafter()}
    return [made[n]() for n in names]


def _run(batch, arrivals, cancel_at=None):
    """Step `batch` until empty; `arrivals` {step: [(id, prompt, params)]} join at those steps, `cancel_at`
    {step: [ids]} are cancelled then. Returns ({id: tokens}, {id: finish reason}, {id: stats})."""
    tokens, reasons, stats, step = {}, {}, {}, 0
    cancel_at = cancel_at or {}
    while batch or any(s >= step for s in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            batch.add(rid, prompt, params)
        for rid in cancel_at.get(step, []):
            batch.cancel(rid)
        for ev in batch.step():
            assert ev.request_id not in reasons  # nothing after a request's last event
            tokens.setdefault(ev.request_id, []).extend(ev.tokens)
            if ev.finish_reason is not None:
                reasons[ev.request_id] = ev.finish_reason
                stats[ev.request_id] = ev.stats
                assert ev.stats.new_tokens == len(tokens[ev.request_id])
        assert batch.num_running <= batch.max_batch
        step += 1
        assert step < 500
    assert batch.num_running == 0 and batch.num_waiting == 0 and batch.state is None
    return tokens, reasons, stats


CASES = [
    # (strategy, drafters, budget)
    ("single", ("eagle",), None),
    ("merged", ("early", "eagle", "other"), None),
    ("merged-budget", ("eagle", "lookup"), None),
    ("route-confidence-prompt", ("eagle", "early"), None),
    ("adaptive", ("early", "eagle"), None),
    ("autoregressive", (), None),
    ("merged", ("early", "eagle", "lookup"), "auto"),
]


@pytest.mark.parametrize("strategy,drafters,budget", CASES, ids=[f"{c[0]}-{'+'.join(c[1])}-{c[2]}" for c in CASES])
def test_joining_and_leaving_keeps_greedy_output(strategy, drafters, budget):
    m = em.greedy_models()
    # the tuner on fixed costs where drafting pays (on the machine's own timings the shapes, and so tau,
    # would follow its load): its choices still change from step to step as requests join and leave
    tuner = Tuner(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-5 * d, lambda g, t, b: 1e-5)) if budget else None
    dec = SpeculativeDecoder(m["target"], _drafters(drafters), strategy=strategy, depth=3, top_k=3,
                             budget=8, route_steps=2, tuner=tuner)
    batch = ContinuousBatch(dec, max_batch=3)
    new = [14, 9, 20, 5, 11, 16]
    arrivals = {0: [(i, PROMPTS[i], SamplingParams(max_new_tokens=new[i])) for i in (0, 1)],
                2: [(2, PROMPTS[2], SamplingParams(max_new_tokens=new[2]))],
                3: [(i, PROMPTS[i], SamplingParams(max_new_tokens=new[i])) for i in (3, 4)],  # 4 waits
                9: [(5, PROMPTS[5], SamplingParams(max_new_tokens=new[5]))]}
    tokens, reasons, stats = _run(batch, arrivals)
    if drafters:
        assert sum(s.tau for s in stats.values()) / len(stats) > 1.3, strategy
    if tuner is not None:  # shapes chosen per step: several, across the joins and leaves
        assert len({x for s in stats.values() for x in s.draft_shapes}) > 1
    for i in range(6):
        assert tokens[i] == _greedy(i, new[i]), f"{strategy}: request {i}"
        assert reasons[i] == "length"


def test_cancel_running_and_waiting_requests():
    m = em.greedy_models()
    dec = SpeculativeDecoder(m["target"], _drafters(("eagle", "early")), strategy="merged", depth=3, top_k=3,
                             budget=8)
    batch = ContinuousBatch(dec, max_batch=2)
    arrivals = {0: [(i, PROMPTS[i], SamplingParams(max_new_tokens=30)) for i in range(4)]}
    tokens, reasons, _ = _run(batch, arrivals, cancel_at={2: [1, 3, "unknown"]})
    assert reasons == {0: "length", 1: "cancelled", 2: "length", 3: "cancelled"}
    assert tokens[3] == []  # cancelled while waiting: never admitted
    assert 0 < len(tokens[1]) < 30 and tokens[1] == _greedy(1, 30)[:len(tokens[1])]
    for i in (0, 2):
        assert tokens[i] == _greedy(i, 30)


def test_eos_zero_tokens_and_cancel_after_finish():
    m = em.greedy_models()
    dec = SpeculativeDecoder(m["target"], _drafters(("eagle",)), strategy="single", depth=3, top_k=3, budget=8)
    ref = _greedy(0, 12)
    eos = ref[5]
    batch = ContinuousBatch(dec)
    arrivals = {0: [("eos", PROMPTS[0], SamplingParams(max_new_tokens=12, eos_token_id=[eos])),
                    ("none", PROMPTS[1], SamplingParams(max_new_tokens=0)),
                    ("one", PROMPTS[2], SamplingParams(max_new_tokens=1))]}
    tokens, reasons, _ = _run(batch, arrivals, cancel_at={3: ["one"]})
    assert tokens["eos"] == ref[:ref.index(eos) + 1] and reasons["eos"] == "eos"
    assert tokens.get("none", []) == [] and reasons["none"] == "length"
    assert tokens["one"] == _greedy(2, 1) and reasons["one"] == "length"


def test_seeded_request_does_not_depend_on_neighbours():
    m = em.sampling_models()
    dec = SpeculativeDecoder(m["target"], [m["eagle"], ModelDrafter(m["target"])], strategy="merged", depth=3,
                             top_k=2, budget=6)
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=77)
    alone, _, _ = _run(ContinuousBatch(dec), {0: [("me", SAMPLING_PROMPTS[1], params)]})
    others = {0: [("a", SAMPLING_PROMPTS[0], SamplingParams(max_new_tokens=20, temperature=1.0, seed=1))],
              2: [("me", SAMPLING_PROMPTS[1], params), ("b", SAMPLING_PROMPTS[3], SamplingParams(max_new_tokens=4))],
              4: [("c", SAMPLING_PROMPTS[2], SamplingParams(max_new_tokens=9, temperature=0.5, top_k=3, seed=5))]}
    crowded, _, _ = _run(ContinuousBatch(dec), others)
    assert crowded["me"] == alone["me"]
    again, _, _ = _run(ContinuousBatch(dec), {0: [("me", SAMPLING_PROMPTS[1], SamplingParams(**{**params.__dict__, "seed": 78}))]})
    assert again["me"] != alone["me"]  # another seed, other draws (12 tokens at T=0.9)


def test_greedy_requests_draw_no_coins():
    """A greedy request's coins are never read (verification takes the argmax): its generator is left where its
    seed put it, beside sampled neighbours, which draw theirs; the outputs are those of solo decoding."""
    m = em.sampling_models()
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=2, budget=6)
    greedy = SamplingParams(max_new_tokens=10, seed=5)
    sampled = SamplingParams(max_new_tokens=10, temperature=0.8, seed=6)
    batch = ContinuousBatch(dec)
    generators = {}
    real_add = batch.add

    def add(rid, prompt, params):
        real_add(rid, prompt, params)
        generators[rid] = batch._waiting[-1][0].coins
    batch.add = add
    together, _, _ = _run(batch, {0: [("g", SAMPLING_PROMPTS[0], greedy)], 1: [("s", SAMPLING_PROMPTS[1], sampled)]})
    assert torch.equal(generators["g"].get_state(), torch.Generator().manual_seed(5).get_state())
    assert not torch.equal(generators["s"].get_state(), torch.Generator().manual_seed(6).get_state())
    for rid, prompt, params in (("g", SAMPLING_PROMPTS[0], greedy), ("s", SAMPLING_PROMPTS[1], sampled)):
        alone, _, _ = _run(ContinuousBatch(dec), {0: [(rid, prompt, params)]})
        assert alone[rid] == together[rid]


def test_samples_follow_the_target_when_requests_join_at_different_steps():
    m = em.sampling_models()
    steps, temperature, top_p = 3, 1.0, 0.9
    dec = SpeculativeDecoder(m["target"], [m["eagle"], ModelDrafter(m["target"])], strategy="merged", depth=3,
                             top_k=2, budget=6)
    batch = ContinuousBatch(dec, max_batch=24)
    prompt = [3, 9, 1, 30]
    samples = 1500
    arrivals = {}
    for i in range(samples):  # a stream of seeded sampled requests, with greedy neighbours of other prompts
        arrivals.setdefault(i // 20, []).append((i, prompt, SamplingParams(steps, temperature, top_p=top_p, seed=i, eos_token_id=[])))
        if i % 97 == 0:
            arrivals[i // 20].append((f"g{i}", SAMPLING_PROMPTS[i % 4], SamplingParams(max_new_tokens=7)))
    tokens, reasons, stats = _run(batch, arrivals)
    tau = sum(stats[i].tau for i in range(samples)) / samples
    assert tau > 1.3, f"tau {tau:.2f}: acceptance is hardly exercised"
    sequences = [tuple(tokens[i]) for i in range(samples)]
    joint = em.exact_joint(m["target"], prompt, steps, lambda row: spec_probs(row, temperature, 0, top_p))
    counts = Counter(sequences)
    assert not [s for s in counts if s not in joint]
    cells = list(joint)
    assert sum(joint[c] * samples >= 5 for c in cells) >= 6
    assert_counts([counts.get(c, 0) for c in cells], [joint[c] for c in cells], what="continuous batch: ")


def test_caller_errors():
    m = em.greedy_models()
    dec = SpeculativeDecoder(m["target"], _drafters(("eagle",)), strategy="single", depth=2, top_k=2)
    batch = ContinuousBatch(dec)
    batch.add("x", [1, 2, 3])
    with pytest.raises(ValueError, match="already"):
        batch.add("x", [4, 5])
    bad = [dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5),
           dict(top_k=-2), dict(top_k=1.5), dict(max_new_tokens=-1), dict(max_new_tokens=2.5), dict(seed="7")]
    for kw in bad:
        with pytest.raises(ValueError):
            batch.add(f"bad {kw}", [1, 2], SamplingParams(**kw))
    with pytest.raises(ValueError):
        batch.add("empty", [])
    with pytest.raises(ValueError):
        batch.add("vocab", [1, 10 ** 6])
    limit = m["target"].config.max_position_embeddings
    with pytest.raises(ValueError, match="context"):
        batch.add("long", [1] * (limit - 3), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError):
        ContinuousBatch(dec, max_batch=0)
    assert batch.num_waiting == 1
    tokens, reasons, _ = _run(batch, {})
    assert list(reasons) == ["x"]


def _assert_same_drafts(first, second):
    for a, b in zip(first, second):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        torch.testing.assert_close(a.scores, b.scores, rtol=1e-4, atol=1e-4)


class _Scheduled(Tuner):
    """No draft for the first `idle` steps (the groups stay unstarted while requests join and leave), then
    shapes drawn at random with a fixed seed, no draft included, whatever they are worth."""

    def __init__(self, idle: int, seed: int):
        super().__init__(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-3))
        self.idle, self.rng = idle, random.Random(seed)

    def choose(self, options):
        if self.clock < self.idle:
            self.clock += 1
            return options[0][0]
        self.clock += 1
        return options[0 if self.rng.random() < 0.3 else self.rng.randrange(len(options))][0]


@pytest.mark.parametrize("idle,seed", [(0, 1), (4, 2), (12, 3)])
def test_groups_that_wait_keep_greedy_output_as_requests_join_and_leave(idle, seed):
    """Groups that have not started (their requests' prompts and missed steps folded into their start), and
    started groups behind on appends, through joins and drops: every request still gets its greedy output."""
    m = em.greedy_models()
    dec = SpeculativeDecoder(m["target"], _drafters(("early", "eagle", "lookup")), strategy="merged", depth=3,
                             top_k=3, budget=8, tuner=_Scheduled(idle, seed))
    batch = ContinuousBatch(dec, max_batch=3)
    new = [14, 9, 20, 5, 11, 16]
    arrivals = {0: [(i, PROMPTS[i], SamplingParams(max_new_tokens=new[i])) for i in (0, 1)],
                2: [(2, PROMPTS[2], SamplingParams(max_new_tokens=new[2]))],
                5: [(i, PROMPTS[i], SamplingParams(max_new_tokens=new[i])) for i in (3, 4)],
                13: [(5, PROMPTS[5], SamplingParams(max_new_tokens=new[5]))]}
    tokens, reasons, stats = _run(batch, arrivals, cancel_at={7: [3]})
    shapes = Counter(label for s in stats.values() for label in s.draft_shapes)
    assert shapes["none"] and len(shapes) > 2, shapes  # plain steps and drafts both ran
    for i in range(6):
        ref = _greedy(i, new[i])
        assert tokens[i] == (ref if reasons[i] == "length" else ref[:len(tokens[i])]), f"request {i}"


@pytest.mark.parametrize("names", [("early",), ("eagle",), ("lookup",), ("eagle", "early")])
def test_folded_start_drafts_as_start_and_appends(names):
    """A group that waited: starting it on its prompts with the missed steps folded in drafts what starting
    it on the prompts and appending the steps drafts (prompt lookup never waits: it is caught up at every
    plan)."""
    m = em.greedy_models()
    drafts = []
    for fold in (False, True):
        dec = SpeculativeDecoder(m["target"], _drafters(names), strategy="merged" if len(names) > 1 else "single",
                                 depth=3, top_k=3, budget=8, tuner=_Scheduled(idle=10 ** 6, seed=0))
        batch = ContinuousBatch(dec, max_batch=4)
        for i in (0, 1, 2):
            batch.add(i, PROMPTS[i], SamplingParams(max_new_tokens=30))
        for _ in range(5):
            batch.step()
        state = batch.state
        out = []
        for g in state.groups:
            if g.free_draft:  # prompt lookup catches up at every plan, to say whether it has a match: at
                # most the last step's tokens wait
                assert state.pending.started(g) and len(state.pending.queue[id(g)]) <= 1
                continue
            assert not state.pending.started(g) and state.pending.count(g) > 0
            if fold:
                state.pending.fold(g)
                assert not state.pending.queue[id(g)]
            state.pending.catch_up([g])
            out.append(g.draft(3, 3))
        drafts.append(out)
    _assert_same_drafts(*drafts)


class _Blocks(Tuner):
    """Drafts (any shape but no draft, at random with a fixed seed) for `on` steps, then none for `off`, in turn."""

    def __init__(self, on: int, off: int, seed: int):
        super().__init__(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-3))
        self.on, self.off, self.rng = on, off, random.Random(seed)

    def choose(self, options):
        self.clock += 1
        if (self.clock - 1) % (self.on + self.off) >= self.on or len(options) == 1:
            return options[0][0]
        return options[1 + self.rng.randrange(len(options) - 1)][0]


@pytest.mark.parametrize("names,seed", [(("eagle", "early", "lookup"), 1), (("eagle",), 2), (("early", "lookup"), 3)])
def test_parked_groups_keep_greedy_output_as_requests_join_and_leave(names, seed, monkeypatch):
    """Started groups that idle for PARK_AFTER_TOKENS tokens or more are parked when requests join (returned to
    not started: their history becomes their start arguments) and restart on it when they next draft, through
    further joins and drops: every request still gets its greedy output, and parking happened."""
    from taps import decoder as D

    parked = []
    park = D._Pending.park
    monkeypatch.setattr(D._Pending, "park", lambda self, g: parked.append(park(self, g)) or parked[-1])
    m = em.greedy_models()
    dec = SpeculativeDecoder(m["target"], _drafters(names), strategy="merged" if len(names) > 1 else "single",
                             depth=3, top_k=3, budget=8, tuner=_Blocks(4, 2 * D.PARK_AFTER_TOKENS, seed))
    new = [40, 9, 30, 12, 35, 16, 20, 25, 14, 30]
    arrivals = {}  # two at the start, then one every 9 steps
    for i in range(10):
        arrivals.setdefault(0 if i < 2 else 9 * (i - 1), []).append((i, PROMPTS[i % 6],
                                                                   SamplingParams(max_new_tokens=new[i])))
    for parking in (True, False):  # park_groups=False: no history kept, nothing parked, greedy output all the same
        dec.park_groups, parked[:] = parking, []
        tokens, reasons, stats = _run(ContinuousBatch(dec, max_batch=4), arrivals, cancel_at={30: [4]})
        assert any(parked) == parking, parked
        for i in range(10):
            ref = _greedy(i % 6, new[i])
            assert tokens[i] == (ref if reasons[i] == "length" else ref[:len(tokens[i])]), f"request {i}"


@pytest.mark.parametrize("names", [("early",), ("eagle",), ("eagle", "early")])
def test_a_parked_group_drafts_as_one_kept_current(names, monkeypatch):
    """A started group parked after idling, restarted on its history (its start arguments with every step
    since, the joined requests' after), drafts what the same group kept current drafts."""
    from taps import decoder as D

    m = em.greedy_models()
    drafts = []
    for parking in (False, True):
        monkeypatch.setattr(D, "PARK_AFTER_TOKENS", 3 if parking else 10 ** 6)
        dec = SpeculativeDecoder(m["target"], _drafters(names), strategy="merged" if len(names) > 1 else "single",
                                 depth=3, top_k=3, budget=8, tuner=_Blocks(3, 10 ** 6, seed=0))
        batch = ContinuousBatch(dec, max_batch=4)
        for i in (0, 1):
            batch.add(i, PROMPTS[i], SamplingParams(max_new_tokens=30))
        for _ in range(4):  # three drafted steps start the groups, then plain steps
            batch.step()
        batch.add(2, PROMPTS[2], SamplingParams(max_new_tokens=30))  # joins after one plain step: kept current
        for _ in range(4):
            batch.step()
        batch.add(3, PROMPTS[3], SamplingParams(max_new_tokens=30))  # joins after 5 plain steps: parked (3)
        for _ in range(2):
            batch.step()
        state = batch.state
        assert state.batch == 4
        out = []
        for g in state.groups:
            assert state.pending.started(g) != parking
            with torch.no_grad():
                state.pending.catch_up([g])
                out.append(g.draft(3, 3))
        drafts.append(out)
    _assert_same_drafts(*drafts)


def test_the_tuner_starts_a_sampling_mode_once():
    """Sampled requests joining a greedy batch switch the tuner to its sampling mode once (the next one to
    join is added to that mode's requests: a second switch would reset their acceptance), and back to
    greedy once when they have left."""
    m = em.greedy_models()

    class Counting(Tuner):
        def __init__(self):
            super().__init__(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-2 * d, lambda g, t, b: 1e-5))
            self.modes = []

        def begin(self, batch, sampling):
            self.modes.append(sampling)
            super().begin(batch, sampling)

    tuner = Counting()
    dec = SpeculativeDecoder(m["target"], _drafters(("eagle",)), strategy="single", depth=3, top_k=3, budget=8,
                             tuner=tuner)
    arrivals = {0: [(0, PROMPTS[0], SamplingParams(max_new_tokens=30))],
                3: [(1, PROMPTS[1], SamplingParams(max_new_tokens=10, temperature=1.0, seed=1))],
                6: [(2, PROMPTS[2], SamplingParams(max_new_tokens=10, temperature=0.8, seed=2))]}
    _run(ContinuousBatch(dec, max_batch=4), arrivals)
    assert tuner.modes == [False, True, False], tuner.modes


def test_plain_steps_coast_until_the_batch_changes():
    """Where no draft pays, the decoder repeats the tuner's plain step without planning (a run of plain
    steps costs what autoregressive steps do), and plans again at the first step after requests join,
    finish or leave; every request still gets its greedy output."""
    m = em.greedy_models()

    class Counting(Tuner):
        calls = 0

        def plan(self, *args, **kw):
            self.calls += 1
            return super().plan(*args, **kw)

    # drafting costs ten target forwards a level: no draft is ever best (the first tries are free)
    tuner = Counting(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-2 * d, lambda g, t, b: 1e-5))
    dec = SpeculativeDecoder(m["target"], _drafters(("eagle",)), strategy="single", depth=3, top_k=3, budget=8,
                             tuner=tuner)
    steps = []  # per decoder step: the unfinished requests, whether the tuner planned
    decoder_step = dec.step

    def step(state):
        before = tuner.calls
        running = tuple(r.key for r in state.requests if not r.done)
        decoder_step(state)
        steps.append((running, tuner.calls > before))
    dec.step = step
    new = [40, 12, 30, 25]
    arrivals = {0: [(i, PROMPTS[i], SamplingParams(max_new_tokens=new[i])) for i in (0, 1)],
                9: [(2, PROMPTS[2], SamplingParams(max_new_tokens=new[2]))],
                20: [(3, PROMPTS[3], SamplingParams(max_new_tokens=new[3]))]}
    tokens, reasons, _ = _run(ContinuousBatch(dec, max_batch=4), arrivals)
    for i in range(4):
        assert tokens[i] == _greedy(i, new[i]) and reasons[i] == "length", f"request {i}"
    # a step that runs other requests than the step before (some joined, finished or left) plans
    changed = [i for i in range(1, len(steps)) if steps[i][0] != steps[i - 1][0]]
    assert len(changed) >= 5, steps
    for i in changed:
        assert steps[i][1], (i, steps[i - 1:i + 1])
    planned = sum(p for _, p in steps)
    assert planned <= len(steps) // 2, (planned, len(steps))
    # generate(): a request that finishes stays in the batch as a finished row; the next step plans
    ref0, ref1 = _greedy(0, 30), _greedy(1, 30)
    eos = next(t for t in ref1[3:] if t not in ref0)
    steps.clear()
    out = dec.generate([PROMPTS[0], PROMPTS[1]], max_new_tokens=30, eos_token_id=eos)
    assert out.tokens == [ref0, ref1[:ref1.index(eos) + 1]]
    changed = [i for i in range(1, len(steps)) if steps[i][0] != steps[i - 1][0]]
    assert len(changed) == 1 and steps[changed[0]][1], steps


class _Picks(Tuner):
    """The first option whose drafters include `wanted` (no draft when `wanted` is None) every `every` steps,
    marked a probe when `probe`; no draft on the other steps."""

    def __init__(self, wanted=None, probe=False, every=1):
        super().__init__(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-3))
        self.wanted, self.probe, self.every = wanted, probe, every

    def choose(self, options):
        self.clock += 1
        for shape, *_ in options:
            if self.wanted is not None and self.wanted in shape.drafters and self.clock % self.every == 0:
                self.probing = self.probe
                return shape
        return options[0][0]


@pytest.mark.parametrize("names,wanted,probe,retired", [
    (("eagle", "early", "lookup"), None, False, [0, 1]),   # never chosen: both model groups leave, lookup stays
    (("eagle", "early", "lookup"), 0, False, [1]),         # the chosen one stays
    (("eagle", "early", "lookup"), 0, True, [0, 1]),       # probes (every third step) are no choice
    (("eagle", "early"), None, False, [1]),                # one group stays (the first)
])
def test_groups_the_tuner_never_chooses_retire(names, wanted, probe, retired):
    """A drafter group that runs a model and that the tuner has not chosen for retire_after steps leaves the
    batch (its arguments, queue and history released), through joins and drops, and every request still gets
    its greedy output; retire_after=None keeps every group."""
    m = em.greedy_models()
    new = [30, 9, 25, 12, 28, 16, 20]
    arrivals = {}
    for i in range(7):
        arrivals.setdefault(0 if i < 2 else 5 * (i - 1), []).append((i, PROMPTS[i % 6],
                                                                   SamplingParams(max_new_tokens=new[i])))
    for retire_after in (6, None):
        dec = SpeculativeDecoder(m["target"], _drafters(names), strategy="merged", depth=3, top_k=3, budget=8,
                                 tuner=_Picks(wanted, probe, every=3 if probe else 1))
        dec.retire_after = retire_after
        batch = ContinuousBatch(dec, max_batch=4)
        seen = []
        step = batch.step

        def watched():
            out = step()
            if batch.state is not None:
                state = batch.state
                seen.append(list(state.retired))
                ids = {id(g) for g in state.groups}
                assert set(state.pending.queue) == ids and set(state.pending.starts) <= ids
                assert len(state.groups) >= 1
            return out
        batch.step = watched
        tokens, reasons, _ = _run(batch, arrivals, cancel_at={12: [3]})
        assert sorted(max(seen, key=len)) == (retired if retire_after else []), seen
        for i in range(7):
            ref = _greedy(i % 6, new[i])
            assert tokens[i] == (ref if reasons[i] == "length" else ref[:len(tokens[i])]), f"request {i}"
