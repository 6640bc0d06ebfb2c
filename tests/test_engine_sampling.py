"""Speculative sampling is lossless end to end (taps.SpeculativeDecoder, tiny random Llama, fp32 CPU).

The first three tokens of many copies of one prompt are compared (chi-square) with their exact joint
distribution under the target, computed with plain Hugging Face forwards and the sampling rules
written from the spec (sampling_checks.spec_probs): for every strategy, with EAGLE heads and small-LM
drafters that agree with the target (so that accepted drafts, not only bonus tokens, are tested), at
several temperatures with top-k and top-p, on the lean and the Hugging Face target paths; per-request
temperature / top-k / top-p tensors in a ragged batch; a reduced draft vocabulary; EOS given as a
collection, with streaming; reproducibility under a seed and a generator.
"""

from collections import Counter

import pytest
import torch

from taps import ModelDrafter, SpeculativeDecoder

import engine_models as em

pytestmark = pytest.mark.usefixtures("one_thread")
from sampling_checks import assert_counts, spec_probs

SAMPLES = 2000
PROMPT = [3, 9, 1, 30]
STEPS = 3


def _drafters(names):
    m = em.sampling_models()
    made = {"copy": lambda: ModelDrafter(m["target"]), "other": lambda: ModelDrafter(m["other"]),
            "eagle": lambda: m["eagle"], "eagle2": lambda: m["eagle2"]}
    return [made[n]() for n in names]


def assert_samples_follow(sequences, prompt, temperature, top_k, top_p, eos=(), what=""):
    """Chi-square of sampled token sequences against the target's exact joint distribution."""
    target = em.sampling_models()["target"]
    joint = em.exact_joint(target, prompt, STEPS, lambda row: spec_probs(row, temperature, top_k, top_p), eos)
    counts = Counter(tuple(s) for s in sequences)
    impossible = [s for s in counts if s not in joint]
    assert not impossible, f"{what}sequences the target cannot produce: {impossible[:5]}"
    cells = list(joint)
    expected = [joint[c] * len(sequences) for c in cells]
    assert sum(e >= 5 for e in expected) >= 6, f"{what}too few cells for a meaningful test"
    assert_counts([counts.get(c, 0) for c in cells], [joint[c] for c in cells], what=what)


CASES = [
    # (strategy, drafters, temperature, top_k, top_p, lean)
    ("merged", ("copy", "eagle"), 1.0, 0, 0.9, None),
    ("merged", ("copy", "eagle"), 1.0, 0, 1.0, False),
    ("single", ("eagle",), 0.7, 0, 1.0, None),
    ("average", ("eagle", "eagle2"), 1.0, 8, 1.0, None),
    ("route-confidence", ("copy", "other"), 1.3, 0, 0.9, None),
    ("route-entropy-prompt", ("eagle", "other"), 0.8, 5, 0.95, False),
    ("merged-budget", ("eagle", "copy"), 0.6, 0, 1.0, None),
    ("adaptive", ("eagle", "copy", "other"), 1.0, 4, 0.8, None),
]


@pytest.mark.parametrize("strategy,drafters,temperature,top_k,top_p,lean", CASES,
                         ids=[f"{c[0]}-{'+'.join(c[1])}-T{c[2]}-k{c[3]}-p{c[4]}-lean{c[5]}" for c in CASES])
def test_strategies_sample_the_target(strategy, drafters, temperature, top_k, top_p, lean):
    m = em.sampling_models()
    dec = SpeculativeDecoder(m["target"], _drafters(drafters), strategy=strategy, depth=3, top_k=2, budget=6,
                             route_steps=1, lean=lean)
    out = dec.generate([PROMPT] * SAMPLES, max_new_tokens=STEPS, temperature=temperature, top_k=top_k, top_p=top_p,
                       seed=1234)
    assert out.summary["tau"] > 1.3, f"tau {out.summary['tau']:.2f}: acceptance is hardly exercised"
    assert_samples_follow(out.tokens, PROMPT, temperature, top_k, top_p)


def test_per_request_parameters_in_a_ragged_batch():
    """One batch of interleaved requests of three prompts of different lengths, each prompt with its
    own temperature / top-k / top-p ([B] tensors), plus greedy requests."""
    m = em.sampling_models()
    groups = [([3, 9, 1, 30], 0.7, 5, 1.0), ([7, 2, 2, 19, 4, 11, 8], 1.3, 0, 0.8), ([25, 6], 1.0, 3, 0.9),
              ([12, 5, 5], 0.0, 0, 1.0)]
    copies = 1500
    order = [g for _ in range(copies) for g in range(3)] + [3] * 4
    column = lambda i, dtype: torch.tensor([groups[g][i] for g in order], dtype=dtype)  # noqa: E731
    dec = SpeculativeDecoder(m["target"], _drafters(("copy", "eagle")), strategy="merged", depth=3, top_k=2, budget=6)
    out = dec.generate([groups[g][0] for g in order], max_new_tokens=STEPS, temperature=column(1, torch.float32),
                       top_k=column(2, torch.int64), top_p=column(3, torch.float32), seed=99)
    assert out.summary["tau"] > 1.3
    for g, (prompt, temperature, top_k, top_p) in enumerate(groups[:3]):
        rows = [out.tokens[i] for i, h in enumerate(order) if h == g]
        assert_samples_follow(rows, prompt, temperature, top_k, top_p, what=f"prompt {g}: ")
    greedy = em.greedy_reference(m["target"], groups[3][0], STEPS)
    assert all(out.tokens[i] == greedy for i, h in enumerate(order) if h == 3)


def test_reduced_draft_vocab_samples_the_target():
    m = em.sampling_models()
    vocab = em.frequent_tokens(m["seqs"], 12)
    eagle, copy = m["eagle"].clone(), ModelDrafter(m["target"])
    eagle.set_draft_vocab(vocab)
    copy.set_draft_vocab(vocab.flip(0))
    dec = SpeculativeDecoder(m["target"], [eagle, copy], strategy="merged", depth=3, top_k=2, budget=6)
    out = dec.generate([PROMPT] * SAMPLES, max_new_tokens=STEPS, temperature=0.9, seed=5)
    assert out.summary["tau"] > 1.3
    assert_samples_follow(out.tokens, PROMPT, 0.9, 0, 1.0)


@pytest.mark.parametrize("lean", [None, False])
def test_eos_collection_and_stream(lean):
    """EOS given as a collection of the two most frequent tokens of the first three: sequences stop at
    the first of them (kept), with finish_reason "eos"; the streamed tokens are the outputs."""
    m = em.sampling_models()
    joint = em.exact_joint(m["target"], PROMPT, STEPS, lambda row: spec_probs(row, 1.0))
    mass = Counter()
    for seq, p in joint.items():
        for t in seq:
            mass[t] += p
    eos = tuple(t for t, _ in mass.most_common(2))
    streamed = {}
    dec = SpeculativeDecoder(m["target"], _drafters(("eagle", "copy")), strategy="merged-budget", depth=3, top_k=2,
                             budget=6, lean=lean)
    out = dec.generate([PROMPT] * SAMPLES, max_new_tokens=STEPS, temperature=1.0, eos_token_id=list(eos), seed=7,
                       stream=lambda b, toks: streamed.setdefault(b, []).extend(toks))
    assert streamed == dict(enumerate(out.tokens))
    for toks, s in zip(out.tokens, out.stats):
        assert all(t not in eos for t in toks[:-1])
        assert s.finish_reason == ("eos" if toks[-1] in eos else "length")
        assert len(toks) == STEPS or toks[-1] in eos
    assert sum(s.finish_reason == "eos" for s in out.stats) > SAMPLES // 4
    assert_samples_follow(out.tokens, PROMPT, 1.0, 0, 1.0, eos=set(eos))


def test_seed_and_generator_reproducible():
    m = em.sampling_models()
    prompts = [PROMPT, [7, 2, 2, 19]] * 100

    def run(lean=None, **kw):
        dec = SpeculativeDecoder(m["target"], _drafters(("copy", "eagle")), strategy="merged", depth=3, top_k=2,
                                 budget=6, lean=lean)
        return dec.generate(prompts, max_new_tokens=5, temperature=1.0, top_p=0.95, **kw).tokens

    first = run(seed=5)
    assert run(seed=5) == first
    assert run(seed=6) != first
    gen = torch.Generator().manual_seed(5)
    assert run(generator=gen) == first  # seed=5 is a generator seeded with 5
    assert run(generator=gen) != first  # the generator moved on
    # the Hugging Face target path draws the same tokens from the same coins
    assert run(lean=False, seed=5) == first


SAMPLED_CASES = [
    # (drafter, temperature, top_k, top_p, lean)
    ("copy", 1.0, 0, 1.0, None),
    ("eagle", 1.0, 0, 0.9, None),
    ("eagle", 0.7, 5, 1.0, False),
    ("other", 1.3, 0, 1.0, None),
    ("eagle2", 1.0, 4, 0.8, None),
]


@pytest.mark.parametrize("name,temperature,top_k,top_p,lean", SAMPLED_CASES,
                         ids=[f"{c[0]}-T{c[1]}-k{c[2]}-p{c[3]}-lean{c[4]}" for c in SAMPLED_CASES])
def test_sampled_drafts_sample_the_target(name, temperature, top_k, top_p, lean):
    """Sampled chains (every request samples, one drafter drafts: ``sampled_drafts``) verified by recursive
    rejection sampling follow the target's distribution."""
    m = em.sampling_models()
    dec = SpeculativeDecoder(m["target"], _drafters((name,)), strategy="single", depth=3, top_k=2, budget=7,
                             lean=lean, sampled_drafts=True)
    out = dec.generate([PROMPT] * SAMPLES, max_new_tokens=STEPS, temperature=temperature, top_k=top_k, top_p=top_p,
                       seed=4321)
    assert out.summary["tau"] > 1.3, f"tau {out.summary['tau']:.2f}: acceptance is hardly exercised"
    assert_samples_follow(out.tokens, PROMPT, temperature, top_k, top_p)


@pytest.mark.parametrize("name,temperature,lean", [("eagle", 1.0, None), ("eagle2", 0.8, False), ("copy", 1.0, None)])
def test_sampled_chains_sample_the_target(name, temperature, lean):
    """One drawn chain a request (top_k 1: the tree is the drawn layout as it is, and an accepted path, a prefix
    of its chain, is committed where its K/V were written, with no compaction) follows the target's
    distribution; its first step runs every request on that path, the next ones with finished requests beside."""
    m = em.sampling_models()
    dec = SpeculativeDecoder(m["target"], _drafters((name,)), strategy="single", depth=3, top_k=1, budget=4,
                             lean=lean, sampled_drafts=True)
    out = dec.generate([PROMPT] * SAMPLES, max_new_tokens=STEPS, temperature=temperature, seed=77)
    assert out.summary["tau"] > 1.3, f"tau {out.summary['tau']:.2f}: acceptance is hardly exercised"
    assert_samples_follow(out.tokens, PROMPT, temperature, 0, 1.0)


@pytest.mark.parametrize("name", ["eagle", "copy"])
def test_the_drawn_layout_and_its_commit_change_no_token(monkeypatch, name):
    """Drawn trees of one or two chains a request, 40 tokens of a ragged batch at T = 1 under a seed: the same
    tokens with the drawn layout's tree and a chain's commit without compaction as with ``build_tree``'s tree and
    ``compact_kv`` (the same coins: any K/V left where it does not belong changes later draws)."""
    from taps import decoder as decoder_module
    from taps.strategies import sampled_tree as laid_out

    m = em.sampling_models()
    prompts = [PROMPT, [7, 2, 2, 19, 4, 11, 8], [25, 6], [3, 9, 1, 30, 2]]

    def run(width):
        dec = SpeculativeDecoder(m["target"], _drafters((name,)), strategy="single", depth=3, top_k=width,
                                 budget=1 + 3 * width, sampled_drafts=True)
        out = dec.generate(prompts, max_new_tokens=40, temperature=1.0, seed=12)
        return out.tokens, out.summary["tau"]

    fast = {w: run(w) for w in (1, 2)}
    original = SpeculativeDecoder._commit

    def commit(self, state, ver):
        state.chain = False
        return original(self, state, ver)
    monkeypatch.setattr(decoder_module, "sampled_tree", lambda cands, root, depth=None: laid_out(cands, root))
    monkeypatch.setattr(SpeculativeDecoder, "_commit", commit)
    for width, (tokens, tau) in fast.items():
        assert tau > 1.3, f"width {width}: tau {tau:.2f}, hardly accepted"
        assert run(width)[0] == tokens, f"width {width}"


@pytest.mark.parametrize("strategy", ["merged", "merged-budget", "adaptive"])
def test_drawn_from_the_mean_of_two_heads_samples_the_target(strategy):
    """Two EAGLE heads of one shape (one batched group): the merging strategies' tree at T > 0 drawn from the
    mean of the two heads' distributions, both heads running on the same chains; every node is both heads'
    (source bits), and the output follows the target."""
    m = em.sampling_models()
    dec = SpeculativeDecoder(m["target"], _drafters(("eagle", "eagle2")), strategy=strategy, depth=3, top_k=2,
                             budget=7, sampled_drafts=True)
    assert len(dec.new_groups()) == 1
    out = dec.generate([PROMPT] * SAMPLES, max_new_tokens=STEPS, temperature=1.0, top_p=0.95, seed=31)
    assert out.summary["tau"] > 1.3
    a, b = zip(*(s.drafter_accepted for s in out.stats))
    assert a == b and sum(a) > 0  # every accepted node was drawn from both
    assert_samples_follow(out.tokens, PROMPT, 1.0, 0, 0.95)


def test_sampled_drafts_of_the_target_itself_are_all_accepted():
    """A drafter with the target's own distribution: each of its draws is accepted (with probability
    min(1, p / q) = 1), so a step of two 3-deep chains emits 4 tokens; its top-k tree is accepted only as far
    as the target's mass on the children carries it."""
    m = em.sampling_models()
    steps = {}
    for sampled in (True, False):
        dec = SpeculativeDecoder(m["target"], _drafters(("copy",)), strategy="single", depth=3, top_k=2, budget=7,
                                 sampled_drafts=sampled)
        out = dec.generate([PROMPT] * 32, max_new_tokens=33, temperature=1.0, seed=3)
        steps[sampled] = [len(s.accepted) for s in out.stats]
    assert max(steps[True]) <= 9 and sum(steps[True]) / len(steps[True]) < 8.2, steps[True]  # 1 + 8 steps of 4
    assert sum(steps[False]) > 1.3 * sum(steps[True])


def test_sampled_drafts_in_a_ragged_batch():
    """Drawn trees over a batch of three prompts of different lengths (the expansion's dense masks, each
    row's scratch entries after its own prefix), each prompt with its own temperature / top-k / top-p."""
    m = em.sampling_models()
    groups = [([3, 9, 1, 30], 0.7, 5, 1.0), ([7, 2, 2, 19, 4, 11, 8], 1.3, 0, 0.8), ([25, 6], 1.0, 3, 0.9)]
    order = [g for _ in range(1500) for g in range(3)]
    column = lambda i, dtype: torch.tensor([groups[g][i] for g in order], dtype=dtype)  # noqa: E731
    dec = SpeculativeDecoder(m["target"], _drafters(("eagle",)), strategy="single", depth=3, top_k=2, budget=7,
                             sampled_drafts=True)
    out = dec.generate([groups[g][0] for g in order], max_new_tokens=STEPS, temperature=column(1, torch.float32),
                       top_k=column(2, torch.int64), top_p=column(3, torch.float32), seed=98)
    assert out.summary["tau"] > 1.3
    for g, (prompt, temperature, top_k, top_p) in enumerate(groups):
        rows = [out.tokens[i] for i, h in enumerate(order) if h == g]
        assert_samples_follow(rows, prompt, temperature, top_k, top_p, what=f"prompt {g}: ")


def _count_drawn(monkeypatch):
    """Counts of the drafter groups' drawn drafts (``draft_sampled``) from here on."""
    from taps.drafters.base import DraftGroup
    from taps.drafters.table import TableGroup

    calls = []
    for cls in (DraftGroup, TableGroup):
        original = cls.draft_sampled

        def counted(self, *a, _original=original, **k):
            calls.append(1)
            return _original(self, *a, **k)
        monkeypatch.setattr(cls, "draft_sampled", counted)
    return calls


def test_sampled_drafts_beside_a_greedy_request(monkeypatch):
    """A batch with a greedy request still draws its trees (the greedy request's q all on the drafter's argmax):
    the greedy request's output is the target's greedy output, the sampled ones still follow the target."""
    m = em.sampling_models()
    dec = SpeculativeDecoder(m["target"], _drafters(("eagle",)), strategy="single", depth=3, top_k=2, budget=7,
                             sampled_drafts=True)
    drawn = _count_drawn(monkeypatch)
    temps = torch.tensor([1.0] * SAMPLES + [0.0])
    out = dec.generate([PROMPT] * (SAMPLES + 1), max_new_tokens=STEPS, temperature=temps, seed=8)
    assert drawn, "no drawn draft"
    assert out.tokens[-1] == em.greedy_reference(m["target"], PROMPT, STEPS)
    assert_samples_follow(out.tokens[:-1], PROMPT, 1.0, 0, 1.0)


@pytest.mark.parametrize("name", ["eagle", "table"])
def test_greedy_requests_of_a_sampled_batch_keep_their_greedy_tokens(monkeypatch, name):
    """Greedy requests of a ragged batch whose other requests sample, 24 tokens each, every step drawn (the
    greedy ones draft their drafter's modes: the EAGLE head's argmax, the n-gram table's most likely entry): each
    greedy request's tokens are its greedy continuation, and they are accepted (the modes' chains are a top-1
    tree)."""
    m = em.sampling_models()
    if name == "table":
        from taps import NgramTableDrafter
        from test_ngram_table import _target_table

        drafters = [NgramTableDrafter(_target_table(m["target"], count=100, new=8, temperature=0.0))]
    else:
        drafters = _drafters((name,))
    dec = SpeculativeDecoder(m["target"], drafters, strategy="single", depth=3, top_k=1, budget=4,
                             sampled_drafts=True)
    drawn = _count_drawn(monkeypatch)
    prompts = [PROMPT, [7, 2, 2, 19, 4, 11, 8], [25, 6], [3, 9, 1, 30, 2], [11, 4]]
    temps = torch.tensor([0.0, 1.0, 0.0, 0.7, 0.0])
    out = dec.generate(prompts, max_new_tokens=24, temperature=temps, seed=5)
    assert len(drawn) == out.steps, "a step drafted other than drawn"
    # the same greedy requests alone, drafting top-1 chains (the drafter's argmax at each level, by the top-k
    # expansion): the same tokens, and the same drafts accepted step by step
    del drawn[:]
    top1 = SpeculativeDecoder(m["target"], drafters, strategy="single", depth=3, top_k=1, budget=4,
                              sampled_drafts=False)
    alone = top1.generate([prompts[b] for b in (0, 2, 4)], max_new_tokens=24, temperature=0.0)
    assert not drawn
    for i, b in enumerate((0, 2, 4)):
        assert out.tokens[b] == em.greedy_reference(m["target"], prompts[b], 24), f"request {b}"
        assert out.stats[b].accepted == alone.stats[i].accepted, f"request {b}: other drafts than top-1 chains"
    assert alone.summary["tau"] > 1.5, f"tau {alone.summary['tau']:.2f}: hardly accepted, nothing is tested"


def test_sampled_drafts_reproducible_under_a_seed():
    m = em.sampling_models()
    dec = SpeculativeDecoder(m["target"], _drafters(("eagle",)), strategy="single", depth=3, top_k=2, budget=7,
                             sampled_drafts=True)
    run = lambda seed: dec.generate([PROMPT, [7, 2, 2, 19]] * 50, max_new_tokens=6, temperature=1.0,  # noqa: E731
                                    seed=seed).tokens
    first = run(5)
    assert run(5) == first and run(6) != first


def test_sampled_drafts_setting_is_checked():
    m = em.sampling_models()
    with pytest.raises(ValueError, match="sampled_drafts must be True, False or 'auto'"):
        SpeculativeDecoder(m["target"], _drafters(("eagle",)), strategy="single", sampled_drafts="yes")
