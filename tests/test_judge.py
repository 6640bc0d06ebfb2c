"""The generation judge (taps.judge): its counterfactual replays the decoder's own plain steps, its verdicts run
losing generations plain (1, 2, 4, ... in a row) and keep winning ones tuned, and a judged-plain generation is the
decoder's autoregressive decoding (greedy tokens equal, sampled tokens the target's distribution)."""

import itertools
import time

import pytest
import torch

from taps import SpeculativeDecoder, Tuner
from taps import judge as judge_module
from taps.judge import GenerationJudge, WindowJudge
from taps.tuner import NONE, CostModel

import engine_models as em
from test_engine_sampling import PROMPT, STEPS, assert_samples_follow

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = (False, 2)


def _reference(judge, key=KEY, rows_seconds=((2, 2.0), (1, 1.0))):
    judge.reference(key, [(r, s) for r, s in rows_seconds for _ in range(3)])


def test_the_replay_counts_steps_rows_and_drops_as_the_decoder():
    """Autoregressive steps for the emitted token counts: one a token after the prefill's, over the unfinished
    requests' rows, the finished dropped once they are a quarter of the rows; row counts between the measured
    ones interpolated, beyond them the nearest."""
    ref = {1: [1.0, 1], 2: [2.0, 1], 4: [4.0, 1]}
    # [3, 1]: two steps; request 1 done from the start, dropped after step 1 (1 of 2 rows)
    assert judge_module._replay(ref, [3, 1]) == pytest.approx(2.0 + 1.0)
    assert judge_module._replay(ref, [1, 1]) == 0.0
    # five rows of eight: 8 requests, one ends after 2 tokens (1 of 8: kept), two more after 3 (3 of 8: dropped)
    assert judge_module._replay({2: [2.0, 1], 8: [5.0, 1]}, [2, 3, 3, 5, 5, 5, 5, 5]) == \
        pytest.approx(5.0 + 5.0 + 3.5 + 3.5)
    assert judge_module._replay({3: [3.0, 1]}, [4] * 8) == pytest.approx(9.0)  # (beyond: the nearest)


def test_the_replay_matches_a_real_plain_generation(monkeypatch):
    """A judged-plain generation's steps (rows per step) are those the replay of its emitted counts walks: the
    same number of steps over the same rows (ragged prompts, requests ending at an EOS at different steps)."""
    m = em.greedy_models()
    prompts = [m["seqs"][i, : 4 + i].tolist() for i in range(6)]
    ref = SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate(prompts, max_new_tokens=30)
    # an EOS that ends three or more requests at different steps
    eos = next(t for t in range(96) if len({row.index(t) if t in row else 30 for row in ref.tokens}) >= 4)
    walked = []
    monkeypatch.setattr(GenerationJudge, "plain", lambda self, key: True)
    monkeypatch.setattr(GenerationJudge, "reference", lambda self, key, steps: walked.append([r for r, _ in steps]))
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=2, top_k=2, budget=5,
                             tuner=Tuner(CostModel()))
    out = dec.generate(prompts, max_new_tokens=30, eos_token_id=eos)
    lengths = [len(t) for t in out.tokens]
    assert len(set(lengths)) > 2, lengths
    assert walked == [judge_module._replay_rows(lengths)], (walked, lengths)


def test_losing_generations_run_plain_one_two_four_up_to_most():
    """Tuned generations at twice their counterfactual: each verdict runs 1, 2, 4, then `most` plain ones; the
    first tuned one is not judged (its one-off costs), and the first reference follows it; by default the first
    verdict waits for two judged generations."""
    judge = GenerationJudge(most=4, min_judged=1)
    assert not judge.plain(KEY)
    assert judge.tuned(KEY, 100.0, [5, 5]) is None  # (warm-up)
    assert judge.plain(KEY)  # the first reference
    _reference(judge)
    lengths = [5, 5]  # four steps over 2 rows: 8 seconds
    assert judge.counterfactual(KEY, lengths) == pytest.approx(8.0)
    runs = []
    for _ in range(5):
        assert not judge.plain(KEY)
        assert judge.tuned(KEY, 16.0, lengths) == pytest.approx(2.0)
        n = 0
        while judge.plain(KEY):
            n += 1
            _reference(judge)
        runs.append(n)
    assert runs == [1, 2, 4, 4, 4]
    judge = GenerationJudge()
    judge.tuned(KEY, 100.0, [5, 5])
    assert judge.plain(KEY)
    _reference(judge)
    assert judge.tuned(KEY, 16.0, [5, 5]) == pytest.approx(2.0) and not judge.plain(KEY)
    judge.tuned(KEY, 16.0, [5, 5])
    assert judge.plain(KEY) and not judge.plain(KEY)


def test_ties_and_small_losses_run_one_plain_generation_each():
    """Tuned generations at 1.03x their counterfactual (a loss under clear_loss): one plain generation after each
    verdict, never a doubling run; at 1.10x the runs double."""
    for seconds, want in ((8.24, [1, 1, 1, 1]), (8.8, [1, 2, 4, 8])):
        judge = GenerationJudge(min_judged=1)
        judge.tuned(KEY, 1.0, [5, 5])
        assert judge.plain(KEY)
        _reference(judge)
        runs = []
        for _ in range(4):
            assert not judge.plain(KEY)
            judge.tuned(KEY, seconds, [5, 5])
            n = 0
            while judge.plain(KEY):
                n += 1
                _reference(judge)
            runs.append(n)
        assert runs == want, (seconds, runs)


def test_winning_generations_stay_tuned_with_rarer_references():
    """Tuned generations at half their counterfactual stay tuned; a reference comes after `refresh` of them,
    the interval doubling (up to `most_refresh`) while they win by more than `clear_win`; one at the
    counterfactual's time (no clear win) brings the interval back to `refresh`."""
    judge = GenerationJudge(refresh=2, most_refresh=8, min_judged=1)
    judge.tuned(KEY, 1.0, [5, 5])
    assert judge.plain(KEY)
    _reference(judge)
    gaps, n = [], 0
    for _ in range(30):
        if judge.plain(KEY):
            gaps.append(n)
            n = 0
            _reference(judge)
        judge.tuned(KEY, 4.0, [5, 5])
        n += 1
    assert gaps[:3] == [4, 8, 8], gaps
    for _ in range(3):
        judge.tuned(KEY, 8.0, [5, 5])  # (the running ratio back above 1 - clear_win)
    assert judge.tracks[KEY].refresh == 2 and judge.tracks[KEY].plain_left == 0


def test_tuned_generations_before_the_first_reference_are_judged_with_it():
    judge = GenerationJudge(min_judged=1)
    judge.tuned(KEY, 1.0, [5, 5])
    judge.tuned(KEY, 30.0, [5, 5])  # (no reference yet: waits)
    assert judge.tracks[KEY].plain_left == 0
    _reference(judge)
    assert judge.tracks[KEY].plain_left == 1 and judge.tracks[KEY].ratio == pytest.approx(30.0 / 8.0)
    assert judge.state(KEY)["reference"] == {1: 1.0, 2: 2.0}
    assert judge.state((True, 2)) == {} and judge.counterfactual((True, 2), [3]) is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(most=0), "most must be an integer >= 1"), (dict(refresh=1.5), "refresh must be an integer"),
    (dict(most_refresh=True), "most_refresh must be an integer"), (dict(alpha=0), "alpha must be in"),
    (dict(alpha=float("nan")), "alpha must be in"), (dict(alpha_reference=1.5), "alpha_reference must be in"),
    (dict(margin=-0.1), "margin, clear_win and clear_loss must be in"),
    (dict(clear_win=1.0), "margin, clear_win and clear_loss must be in"),
    (dict(clear_loss=-0.5), "margin, clear_win and clear_loss must be in"),
    (dict(min_batch=0), "min_batch must be an integer >= 1"), (dict(min_judged=0), "min_judged must be an integer")])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenerationJudge(**kwargs)


class _AlwaysDraft(Tuner):
    """Measured costs (the judge needs them; its own cost model, not the one shared by the decoders of these
    models: the slow drafts below must not price theirs), but a draft chosen at every step whatever it costs."""

    def __init__(self):
        super().__init__(CostModel())

    def choose(self, options):
        super().choose(options)
        self.probing = False
        return max((o for o in options if o[0].drafters), key=lambda o: o[0].budget)[0]


def _slow(dec, monkeypatch, delay=0.004):
    """`dec` with every draft of its drafter groups' class spinning `delay` seconds more (patched on the class: a
    continuous batch drafts with groups spawned from the decoder's)."""
    cls = type(dec._draft_groups()[0])
    draft = cls.draft

    def slow(self, *args, **kwargs):
        end = time.perf_counter() + delay
        while time.perf_counter() < end:
            pass
        return draft(self, *args, **kwargs)
    monkeypatch.setattr(cls, "draft", slow)
    return dec


def test_a_decoder_whose_drafts_lose_runs_its_next_generations_plain(monkeypatch):
    """A tuner that drafts every step with a drafter several plain steps slow: after the warm-up generation and
    the first reference, two tuned generations are judged a loss, then each one, and the next 1, 2, 4 ones run
    plain: no group
    started, every step a plain one, the greedy output the target's; a decoder with ``judge=None`` drafts on."""
    m = em.greedy_models()
    prompts = [m["seqs"][i, :6].tolist() for i in range(2)]
    ref = SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate(prompts, max_new_tokens=20)
    dec = _slow(SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=2, top_k=2, budget=4,
                                   tuner=_AlwaysDraft()), monkeypatch)
    plain = []
    for i in range(11):
        out = dec.generate(prompts, max_new_tokens=20)
        assert out.tokens == ref.tokens, i
        plain.append(out.summary["judged_plain"])
        if plain[-1]:
            assert out.summary["shape_histogram"] == {"none": out.steps * 2} and out.summary["left_out"] == []
            assert out.summary["tau"] == 1.0
        else:
            assert "none" not in out.summary["shape_histogram"]
    assert plain == [False, True, False, False, True, False, True, True, False, True, True], plain
    assert dec.judge.state(KEY)["ratio"] > 1.5
    dec.judge = None
    assert not any(dec.generate(prompts, max_new_tokens=20).summary["judged_plain"] for _ in range(3))


def test_a_single_request_is_not_judged(monkeypatch):
    """At a batch of 1 (below min_batch) drafts that lose are not judged: every generation tuned."""
    m = em.greedy_models()
    dec = _slow(SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=2, top_k=2, budget=4,
                                   tuner=_AlwaysDraft()), monkeypatch)
    outs = [dec.generate([m["seqs"][0, :6].tolist()], max_new_tokens=12) for _ in range(5)]
    assert not any(o.summary["judged_plain"] for o in outs) and dec.judge.tracks == {}
    assert not dec.judge.judges(1) and dec.judge.judges(2)


def test_injected_costs_are_not_judged(monkeypatch):
    """A tuner of injected costs (FixedCosts) chooses by them: its generations are never judged plain."""
    from taps.tuner import FixedCosts

    m = em.greedy_models()
    prompts = [m["seqs"][i, :6].tolist() for i in range(2)]
    dec = _slow(SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=2, top_k=2, budget=4,
                                   tuner=Tuner(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-6))), monkeypatch)
    outs = [dec.generate(prompts, max_new_tokens=12) for _ in range(6)]
    assert not any(o.summary["judged_plain"] for o in outs) and dec.judge.tracks == {}


def test_a_judged_plain_generation_samples_the_target(monkeypatch):
    """A sampled generation the judge runs plain follows the target's distribution (chi-square)."""
    monkeypatch.setattr(GenerationJudge, "plain", lambda self, key: True)
    m = em.sampling_models()
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=2, budget=6,
                             tuner=Tuner(CostModel()))
    out = dec.generate([PROMPT] * 2000, max_new_tokens=STEPS, temperature=1.0, seed=79)
    assert out.summary["judged_plain"] and out.summary["shape_histogram"] == {"none": 2000 * (STEPS - 1)}
    assert_samples_follow(out.tokens, PROMPT, 1.0, 0, 1.0, what="judged plain: ")
    assert NONE.label == "none"


# -- a continuous batch's windows (WindowJudge) ---------------------------------------------------------------------

def _window_steps(judge, steps, tuned_seconds, plain_seconds=1.0, rows=2, tokens=4):
    """Run `steps` steps through `judge`: a plain step over `rows` rows emits one token each in `plain_seconds`, a
    tuned one `tokens` in `tuned_seconds`; the kinds of the steps."""
    kinds = []
    for _ in range(steps):
        plain = judge.plain()
        kinds.append("p" if plain else "t")
        judge.record(rows, rows, rows if plain else tokens, plain_seconds if plain else tuned_seconds)
    return "".join(kinds)


def test_windows_that_lose_run_plain_windows_one_two_four():
    """Windows of 2 steps: the first tuned window is not judged, the next is a reference; tuned windows at twice
    the seconds of plain steps for their tokens (4 tokens in 4 s against 2 in 1 s) are judged losses from the
    second, then 1, 2, 4 plain windows follow each."""
    judge = WindowJudge(window=2)
    kinds = _window_steps(judge, 40, tuned_seconds=4.0)
    assert kinds == "tt" "pp" "tt" "tt" "pp" "tt" "pppp" "tt" "pppppppp" "tt" + "p" * 12, kinds
    assert judge.state()["ratio"] == pytest.approx(2.0) and judge.state()["reference"] == {2: 1.0}
    assert judge.windows == {"plain": 14, "tuned": 6}


def test_windows_that_win_stay_tuned():
    """Tuned windows at half the seconds of plain steps for their tokens: references after 8, then 16 tuned
    windows (the interval, 4, doubling at the first verdict after each reference while they win clearly)."""
    judge = WindowJudge(window=1)
    kinds = _window_steps(judge, 40, tuned_seconds=1.0)
    assert kinds == "tp" + "t" * 8 + "p" + "t" * 16 + "p" + "t" * 12, kinds


def test_window_judge_settings_are_checked():
    for kwargs in (dict(window=0), dict(window=2.5), dict(most=0), dict(alpha=2)):
        with pytest.raises(ValueError, match="WindowJudge"):
            WindowJudge(**kwargs)


def test_a_continuous_batch_whose_drafts_lose_runs_plain_windows(monkeypatch):
    """A continuous batch over a decoder that drafts every step with a drafter several plain steps slow: its
    window judge runs plain windows (their steps plain: no draft, tau 1 on them), and every request's tokens are
    its greedy decoding; ``judge=None`` drafts every step; the default judge exists only for a tuner that measures
    its costs."""
    from taps.batching import ContinuousBatch, SamplingParams
    from taps.tuner import FixedCosts

    m = em.greedy_models()
    prompts = [m["seqs"][i, :6].tolist() for i in range(6)]
    ref = SpeculativeDecoder(m["target"], [], strategy="autoregressive").generate(prompts, max_new_tokens=24)
    for judge in (WindowJudge(window=4), None):
        dec = _slow(SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=2, top_k=2, budget=4,
                                       tuner=_AlwaysDraft()), monkeypatch)
        batch = ContinuousBatch(dec, max_batch=2, judge=judge)
        tokens, shapes = {}, {}
        for i in range(24):
            batch.add(i, prompts[i % 6], SamplingParams(max_new_tokens=24))
        while batch:
            for ev in batch.step():
                tokens.setdefault(ev.request_id, []).extend(ev.tokens)
                if ev.finish_reason is not None:
                    shapes[ev.request_id] = ev.stats.draft_shapes
        assert all(tokens[i] == ref.tokens[i % 6] for i in range(24))
        plain = sum(s.count("none") for s in shapes.values())
        if judge is None:
            assert plain == 0
        else:
            assert judge.windows["plain"] >= 4 and judge.windows["plain"] > judge.windows["tuned"] - 3, judge.windows
            assert plain >= 4 * 4, plain
            assert judge.state()["ratio"] > 1.5
    assert isinstance(ContinuousBatch(dec).judge, WindowJudge)
    fixed = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=2, top_k=2, budget=4,
                               tuner=Tuner(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-6)))
    assert ContinuousBatch(fixed).judge is None
    assert ContinuousBatch(SpeculativeDecoder(m["target"], [], strategy="autoregressive")).judge is None
    for bad in ("on", 3, GenerationJudge()):
        with pytest.raises(ValueError, match="judge must be 'auto', None or a taps.judge.WindowJudge"):
            ContinuousBatch(dec, judge=bad)


class _Script(WindowJudge):
    """A window judge whose steps follow `kinds` ("t" tuned, "p" plain; any iterable), then tuned, whatever their
    times; `steps` counts them."""

    def __init__(self, kinds):
        super().__init__(window=1)
        self.kinds, self.steps = iter(kinds), 0

    def plain(self):
        self.steps += 1
        self._plain = next(self.kinds, "t") == "p"
        return self._plain

    def record(self, rows, active, tokens, seconds):
        pass


def test_plain_steps_between_drawn_drafts_sample_the_target():
    """A continuous batch of seeded sampled requests joining at different steps, whose steps alternate between a
    tuner's random shapes (drawn trees among them: their distributions must not reach the plain step after) and
    plain ones: every request's tokens follow the target's distribution (chi-square)."""
    from collections import Counter

    from sampling_checks import assert_counts, spec_probs
    from taps.batching import ContinuousBatch, SamplingParams
    from test_tuner import Cycling

    m = em.sampling_models()
    steps, temperature = 3, 1.0
    tuner = Cycling()
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=3, budget=10, tuner=tuner)
    batch = ContinuousBatch(dec, max_batch=24, judge=_Script(itertools.cycle("tp")))
    prompt, samples = [3, 9, 1, 30], 1500
    tokens, added, step = {}, 0, 0
    while added < samples or batch:
        for _ in range(20 if added < samples else 0):
            batch.add(added, prompt, SamplingParams(steps, temperature, seed=added, eos_token_id=[]))
            added += 1
        for ev in batch.step():
            tokens.setdefault(ev.request_id, []).extend(ev.tokens)
        step += 1
    assert any(s.drawn for s in tuner.seen) and batch.judge.steps > 100
    joint = em.exact_joint(m["target"], prompt, steps, lambda row: spec_probs(row, temperature, 0, 1.0))
    counts = Counter(tuple(tokens[i]) for i in range(samples))
    assert not [s for s in counts if s not in joint]
    cells = list(joint)
    assert_counts([counts.get(c, 0) for c in cells], [joint[c] for c in cells], what="plain steps between drafts: ")


def test_a_plain_step_after_a_drawn_draft_and_a_drop():
    """A drawn tree's distributions stay with its step: a request that ends in it leaves the batch, and the plain
    step after (one row fewer) verifies without them (a load test's server had failed there: draft_probs of 8 rows
    against logits of 7)."""
    from taps.batching import ContinuousBatch, SamplingParams
    from test_tuner import _WideRoot

    m = em.sampling_models()
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=3, budget=10,
                             tuner=_WideRoot())
    batch = ContinuousBatch(dec, max_batch=4, judge=_Script("tpp"))
    batch.add("short", PROMPT, SamplingParams(2, 1.0, seed=1, eos_token_id=[]))
    batch.add("long", PROMPT, SamplingParams(6, 1.0, seed=2, eos_token_id=[]))
    tokens, rows = {}, []
    while batch:
        rows.append(batch.num_running)
        for ev in batch.step():
            tokens.setdefault(ev.request_id, []).extend(ev.tokens)
    assert len(tokens["short"]) == 2 and len(tokens["long"]) == 6
    assert rows[:2] == [0, 1], rows  # (both admitted at the first step, the short one gone after it)


def _through_json(state):
    """`state` as Tuner.save writes it and Tuner.load reads it back."""
    import json

    from taps.tuner import _from_json, _to_json

    return _from_json(json.loads(json.dumps(_to_json(state))))


def test_a_generation_judge_state_goes_on_in_a_new_judge():
    """state_dict / load_state_dict (through JSON, as save_tuner writes it): the new judge holds the same reference,
    ratio and schedule for each track and runs the same plain generations after; its next tuned generation is not
    judged (a new process's one-off costs), the one after is, against the loaded reference."""
    judge = GenerationJudge(most=4, min_judged=1)
    other = (True, 3)
    judge.tuned(KEY, 100.0, [5, 5])
    assert judge.plain(KEY)
    _reference(judge)
    judge.tuned(KEY, 16.0, [5, 5])  # lost: 1 plain run
    assert judge.plain(KEY)
    _reference(judge)
    judge.tuned(KEY, 16.0, [5, 5])  # lost again: 2 plain runs
    for _ in range(2):  # (a track with a waiting run and no reference; the first is its warm-up)
        judge.tuned(other, 1.0, [3, 3, 3])
    new = GenerationJudge(most=4, min_judged=1)
    new.load_state_dict(_through_json(judge.state_dict()))
    assert set(new.tracks) == {KEY, other}
    for key in (KEY, other):
        assert new.state(key) == judge.state(key)
    assert new.tracks[other].waiting == [(1.0, {3: 2.0})]
    assert new.counterfactual(KEY, [5, 5]) == judge.counterfactual(KEY, [5, 5]) == pytest.approx(8.0)
    for j in (judge, new):
        assert j.plain(KEY) and j.plain(KEY) and not j.plain(KEY)  # the two plain runs it had left
        for _ in range(2):
            _reference(j)
    assert judge.tuned(KEY, 16.0, [5, 5]) == pytest.approx(2.0)
    assert new.tuned(KEY, 16.0, [5, 5]) is None  # (not judged: warm-up of the new process)
    assert new.tuned(KEY, 16.0, [5, 5]) == pytest.approx(2.0)
    # the settings are the new judge's own
    assert GenerationJudge(most=2).state_dict() == {"tracks": {}}


def test_a_window_judge_state_goes_on_in_a_new_judge():
    """A WindowJudge's track (not the window under way) goes on in a new judge: the same plain windows after."""
    judge = WindowJudge(window=2)
    kinds = _window_steps(judge, 13, tuned_seconds=4.0)  # a verdict of 2 plain windows, one step into them
    assert kinds.endswith("ttp"), kinds
    new = WindowJudge(window=2)
    new.load_state_dict(_through_json(judge.state_dict()))
    assert {k: v for k, v in new.state().items() if k != "windows"} == \
        {k: v for k, v in judge.state().items() if k != "windows"}
    # the old judge finishes its window, then one more plain window; the new one starts its last plain window
    assert _window_steps(judge, 3, tuned_seconds=4.0) == "ppp"
    assert _window_steps(new, 2, tuned_seconds=4.0) == "pp"
    assert _window_steps(new, 2, tuned_seconds=4.0) == "tt" and new.track.judged == judge.track.judged  # not judged


@pytest.mark.parametrize("state,match", [
    (None, "not a judge state"), ({}, "not a judge state"), ({"tracks": [1]}, "not a judge state"),
    ({"tracks": {KEY: 3}}, "must be a dict"), ({"tracks": {KEY: {"reference": {2: "x"}}}}, "wrong kind"),
    ({"tracks": {KEY: {"plain_left": "many"}}}, "wrong kind"), ({"tracks": {KEY: {"waiting": [1]}}}, "wrong kind"),
])
def test_bad_judge_states_are_refused(state, match):
    judge = GenerationJudge()
    judge.tuned(KEY, 1.0, [2, 2])
    with pytest.raises(ValueError, match=match):
        judge.load_state_dict(state)
    assert set(judge.tracks) == {KEY}  # (this judge's own, untouched)
    with pytest.raises(ValueError, match="not a window judge state"):
        WindowJudge().load_state_dict({"tracks": {}})
