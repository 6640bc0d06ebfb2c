"""The n-gram table of the target's own distributions and its drafter (taps.drafters.table; the ops
taps_ops.ngram_table_logits / ngram_table_draw): the table against a brute-force average on random corpora of odd
sizes (exact and hashed keys), the ops against the NumPy reference, draws chi-square against q, the ops' input
checks fuzzed, files, and decoding with the drafter (greedy equal to autoregressive decoding, samples chi-square
against the target)."""

import json
import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from sampling_checks import assert_distribution
from taps import NgramTable, NgramTableDrafter, SpeculativeDecoder
from taps.drafters.table import FLOOR_LOGIT

import engine_models as em
import taps_ops


def _random_corpus(rng, count, vocab, width):
    """(tokens, ids, probs, first) rows: random sequences over a few tokens (so contexts repeat), each position's
    distribution over `width` distinct random tokens."""
    rows = []
    for _ in range(count):
        n = int(rng.integers(2, 30))
        tokens = rng.integers(0, min(vocab, 6), n)
        ids = np.stack([rng.choice(min(vocab, 40), width, replace=False) for _ in range(n - 1)])
        probs = rng.dirichlet(np.ones(width), n - 1) * rng.uniform(0.5, 1.0, (n - 1, 1))
        rows.append((tokens, ids, probs, int(rng.integers(0, n - 1))))
    return rows


def _brute(rows, max_order, min_count, entries):
    """context tuple -> (count, [(id, mean prob)] most likely first, ties by id)."""
    sums = defaultdict(lambda: defaultdict(float))
    counts = defaultdict(int)
    for tokens, ids, probs, first in rows:
        for j in range(first, len(tokens) - 1):
            for n in range(max_order + 1):
                if j - n + 1 < 0:
                    continue
                key = tuple(int(t) for t in tokens[j - n + 1:j + 1])
                counts[key] += 1
                for a, b in zip(ids[j], probs[j]):
                    sums[key][int(a)] += float(b)
    out = {}
    for key, c in counts.items():
        if key and c < min_count:
            continue
        top = sorted(((a, s / c) for a, s in sums[key].items()), key=lambda x: (-x[1], x[0]))[:entries]
        out[key] = (c, top)
    return out


def _reference_choice(brute, context, max_order, min_count):
    best = ()
    for n in range(1, max_order + 1):
        key = tuple(int(t) for t in context[len(context) - n:]) if n <= len(context) else None
        if key is None or min(key) < 0:
            break
        if key in brute and brute[key][0] >= min_count:
            best = key
    return best


@pytest.mark.parametrize("seed,vocab,max_order,min_count,entries", [
    (0, 7, 2, 1, 3), (1, 41, 3, 2, 5), (2, 2 ** 21, 3, 1, 4), (3, 13, 0, 1, 2), (4, 9, 4, 3, 16)])
def test_table_against_brute_force(seed, vocab, max_order, min_count, entries):
    """Contexts kept, their counts and entries equal a dictionary's average; the op and the NumPy lookup pick
    the longest context held (2 ** 21 tokens: keys past 64 bits, hashed)."""
    rng = np.random.default_rng(seed)
    rows = _random_corpus(rng, 37, vocab, 5)
    table = NgramTable.from_distributions(rows, vocab, max_order=max_order, entries=entries, min_count=min_count)
    brute = _brute(rows, max_order, min_count, entries)
    assert table.num_contexts == len(brute)
    contexts = rng.integers(-1, min(vocab, 7), (61, max(max_order, 1) + 1))
    contexts[:5, :2] = -1
    for use in (1, 2, 5):
        got = table.logits(contexts, use)
        assert torch.equal(got, table.reference_logits(contexts, use))
        for r, ctx in enumerate(contexts):
            # a -1 cuts the context there (the tokens before it are not read)
            cut = ctx[np.flatnonzero(ctx < 0).max() + 1:] if (ctx < 0).any() else ctx
            key = _reference_choice(brute, cut, max_order, use)
            count, top = brute[key]
            row = got[r]
            held = torch.nonzero(row > FLOOR_LOGIT).flatten().tolist()
            assert sorted(held) == sorted(a for a, _ in top)
            for a, p in top:
                assert abs(float(row[a]) - math.log(p)) < 1e-5


def test_save_and_load(tmp_path):
    rng = np.random.default_rng(5)
    rows = _random_corpus(rng, 20, 300, 4)
    for vocab in (300, 65536, 70000):
        table = NgramTable.from_distributions(rows, vocab, max_order=3, entries=4, min_count=1, meta={"a": 1})
        table.save(tmp_path / "t.npz")
        back = NgramTable.load(tmp_path / "t.npz")
        assert np.array_equal(back.keys, table.keys) and np.array_equal(back.ids, table.ids)
        assert np.array_equal(back.counts, table.counts) and np.array_equal(back.starts, table.starts)
        assert np.abs(back.logp - table.logp).max() < 2e-2 and back.meta["a"] == 1  # (float16 on disk)
        assert back.vocab_size == vocab and back.max_order == 3
    with pytest.raises(FileNotFoundError, match="taps train table"):
        NgramTable.load(tmp_path / "none.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a table")
    with pytest.raises(ValueError, match="not an n-gram table"):
        NgramTable.load(tmp_path / "bad.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not an n-gram table"):
        NgramTable.load(tmp_path / "other.npz")


def test_constructor_and_builder_errors():
    good = dict(keys=np.array([0, 9], np.uint64), counts=[3, 1], starts=[0, 1, 2], ids=[1, 2], logp=[-1.0, -2.0],
                vocab_size=4, max_order=1)
    NgramTable(**good)
    for change, match in ((dict(keys=np.array([9, 0], np.uint64)), "sorted"),
                          (dict(keys=np.array([1, 9], np.uint64)), "order-0"),
                          (dict(starts=[0, 0, 2]), "at least one entry"), (dict(counts=[3]), "agree"),
                          (dict(ids=[1, 4]), r"\[0, 4\)"), (dict(logp=[-1.0, float("nan")]), "finite"),
                          (dict(max_order=-1), "max_order"), (dict(vocab_size=0), "vocab_size")):
        with pytest.raises(ValueError, match=match):
            NgramTable(**{**good, **change})
    with pytest.raises(ValueError, match="no positions"):
        NgramTable.from_distributions([], 5)
    with pytest.raises(ValueError, match="len\\(tokens\\) - 1"):
        NgramTable.from_distributions([([1, 2, 3], np.zeros((3, 2), int), np.zeros((3, 2)), 0)], 5)
    with pytest.raises(ValueError, match="entries >= 1"):
        NgramTable.from_distributions([([1, 2], np.zeros((1, 2), int), np.ones((1, 2)), 0)], 5, entries=0)
    with pytest.raises(TypeError, match="NgramTable"):
        NgramTableDrafter("table")
    with pytest.raises(ValueError, match="min_count"):
        NgramTableDrafter(NgramTable(**good), min_count=0)


def _small_table(seed=6, vocab=23):
    rng = np.random.default_rng(seed)
    return NgramTable.from_distributions(_random_corpus(rng, 40, vocab, 6), vocab, max_order=3, entries=5,
                                         min_count=1)


@pytest.mark.parametrize("width,depth,temperature", [(1, 1, 1.0), (3, 2, 0.7), (2, 4, 1.6)])
def test_draw_structure_and_rows(width, depth, temperature):
    """Chains: level-by-level candidates, each node's parent its chain's previous node, every token an entry of
    its parent's context; probs rows are softmax(logp / T) over each node's context's entries; scores are the
    cumulative log q."""
    table = _small_table()
    rng = np.random.default_rng(1)
    batch = 5
    contexts = torch.from_numpy(rng.integers(-1, 6, (batch, 3)))
    uniforms = torch.from_numpy(rng.random((batch, width * depth)).astype(np.float32))
    temp = torch.full((batch,), temperature)
    tokens, parents, scores, probs = taps_ops.ngram_table_draw(*table._t, contexts, uniforms, temp, width, depth,
                                                               table.vocab_size, table.max_order, 1)
    m = width * depth
    assert tokens.shape == parents.shape == scores.shape == (batch, m) and probs.shape == (batch, 1 + m, 23)
    # into a kept buffer (stale values in it, as a decoder's last draft leaves them): the same draft, in the buffer
    out = torch.full((batch, 1 + m, 23), float("nan"))
    again = taps_ops.ngram_table_draw(*table._t, contexts, uniforms, temp, width, depth, table.vocab_size,
                                      table.max_order, 1, out=out)
    assert again[3] is out and torch.equal(out, probs)
    assert all(torch.equal(a, b) for a, b in zip(again[:3], (tokens, parents, scores)))
    # one temperature as a Python number: the same draft
    number = taps_ops.ngram_table_draw(*table._t, contexts, uniforms, temperature, width, depth, table.vocab_size,
                                       table.max_order, 1)
    assert all(torch.equal(a, b) for a, b in zip(number, (tokens, parents, scores, probs)))

    def q_of(ctx):
        z = table.reference_logits(np.asarray([ctx[-3:]]), 1)[0].double() / temperature
        held = z > FLOOR_LOGIT / temperature
        q = torch.zeros_like(z)
        q[held] = torch.softmax(z[held], 0)
        return q

    for b in range(batch):
        ctx = contexts[b].tolist()
        assert torch.allclose(probs[b, 0].double(), q_of(ctx), atol=1e-6)
        for c in range(width):
            chain = list(ctx)
            score = 0.0
            for lv in range(depth):
                cand = lv * width + c
                assert parents[b, cand] == (-1 if lv == 0 else cand - width)
                row = probs[b, 0 if lv == 0 else 1 + cand - width].double()
                tok = int(tokens[b, cand])
                assert row[tok] > 0, "a token of zero mass was drawn"
                score += math.log(row[tok])
                assert abs(float(scores[b, cand]) - score) < 1e-4
                chain.append(tok)
                if lv + 1 < depth:
                    assert torch.allclose(probs[b, 1 + cand].double(), q_of(chain), atol=1e-6)
            for lv in range(depth):
                if lv + 1 == depth:
                    assert probs[b, 1 + lv * width + c].abs().sum() == 0, "the leaves draw nothing"


def test_draw_at_temperature_zero_takes_the_modes():
    """A request at temperature 0 (beside sampling ones) draws the chain of its contexts' most likely entries (ties
    to the lowest id) whatever its uniforms, q all on that entry, scores 0; the sampling requests draw as they do
    alone."""
    table = _small_table(seed=9)
    rng = np.random.default_rng(4)
    batch, width, depth = 6, 2, 3
    contexts = torch.from_numpy(rng.integers(-1, 6, (batch, 3)))
    uniforms = torch.from_numpy(rng.random((batch, width * depth)).astype(np.float32))
    temps = torch.tensor([0.0, 1.0, 0.0, 0.7, 0.0, 1.3])
    args = (table.vocab_size, table.max_order, 1)
    tokens, parents, scores, probs = taps_ops.ngram_table_draw(*table._t, contexts, uniforms, temps, width, depth, *args)
    sampled = [1, 3, 5]
    alone = taps_ops.ngram_table_draw(*table._t, contexts[sampled], uniforms[sampled], temps[sampled], width, depth,
                                      *args)
    for got, want in zip((tokens, parents, scores, probs), alone):
        assert torch.equal(got[sampled], want)
    other = taps_ops.ngram_table_draw(*table._t, contexts, torch.rand(batch, width * depth), temps, width, depth, *args)
    for b in (0, 2, 4):
        assert torch.equal(other[0][b], tokens[b]), "a greedy request's draft depends on its uniforms"
        chain = contexts[b].tolist()
        for lv in range(depth):
            z = table.reference_logits(np.asarray([chain[-3:]]), 1)[0]
            mode = int(z.argmax())  # (the first of equal largest: the lowest id)
            row = probs[b, 0 if lv == 0 else 1 + (lv - 1) * width]
            assert row[mode] == 1 and row.sum() == 1, f"request {b} level {lv}: q is not all on the mode"
            for c in range(width):
                assert tokens[b, lv * width + c] == mode and scores[b, lv * width + c] == 0
            chain.append(mode)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_follow_q(temperature):
    table = _small_table(seed=8)
    n = 20000
    ctx = torch.tensor([[-1, 2, 3]]).expand(n, 3).contiguous()
    uniforms = torch.rand((n, 1), generator=torch.Generator().manual_seed(3))
    tokens, _, _, probs = taps_ops.ngram_table_draw(*table._t, ctx, uniforms, torch.full((n,), temperature), 1, 1,
                                                    table.vocab_size, table.max_order, 1)
    assert_distribution(tokens.flatten().numpy(), probs[0, 0].double().numpy())


def test_op_inputs_are_checked():
    """Both ops: every malformed input raises ValueError naming the op (fuzzed), never reads out of bounds."""
    table = _small_table()
    k, c, s, i, lp = table._t
    ctx = torch.tensor([[1, 2, 3]])
    u, t = torch.rand(1, 2), torch.ones(1)

    def logits(*a, ctxs=ctx, vocab=23, order=3, mc=1):
        return taps_ops.ngram_table_logits(*a, ctxs, vocab, order, mc)

    def draw(*a, ctxs=ctx, un=u, temp=t, width=1, depth=2, vocab=23, out=None):
        return taps_ops.ngram_table_draw(*a, ctxs, un, temp, width, depth, vocab, 3, 1, out=out)

    assert logits(k, c, s, i, lp).shape == (1, 23) and draw(k, c, s, i, lp)[3].shape == (1, 3, 23)
    bad_arrays = [
        (k.int(), c, s, i, lp), (k, c.float(), s, i, lp), (k, c, s[:-1], i, lp), (k, c, s, i, lp.double()),
        (k, c, s, i[:-1], lp), (k[None], c, s, i, lp), (k[::2], c[::2], s, i, lp), (k, c, s + 10 ** 6, i, lp),
        (k, c, s - 10 ** 6, i, lp), (k, c, s, i + 1000, lp), (k, c, s, i - 1000, lp),
        (k + 1, c, s, i, lp),  # no key 0
    ]
    for arrays in bad_arrays:
        with pytest.raises(ValueError, match="^taps_ops: ngram_table_logits"):
            logits(*arrays, ctxs=torch.tensor([[-1, -1, -1], [1, 2, 3]]))
        with pytest.raises(ValueError, match="^taps_ops: ngram_table_draw"):
            draw(*arrays, ctxs=torch.tensor([[1, 2, 3]]))
    for kw in (dict(ctxs=torch.tensor([1, 2])), dict(ctxs=torch.tensor([[1, 2, 23]])), dict(ctxs=torch.tensor([[-2, 1]])),
               dict(ctxs=ctx.int()), dict(vocab=0), dict(order=-1), dict(mc=-1)):
        with pytest.raises(ValueError, match="^taps_ops: ngram_table_logits"):
            logits(k, c, s, i, lp, **kw)
    for kw in (dict(un=torch.rand(1, 3)), dict(un=torch.rand(2, 2)), dict(un=u.double()), dict(temp=torch.full((1,), -0.5)),
               dict(temp=torch.full((1,), float("inf"))), dict(temp=torch.ones(2)), dict(width=0), dict(depth=0),
               dict(ctxs=torch.tensor([[99, 1, 2]])), dict(out=torch.zeros(1, 2, 23)), dict(out=torch.zeros(2, 3, 23)),
               dict(out=torch.zeros(1, 3, 22)), dict(out=torch.zeros(1, 3, 23, dtype=torch.float64)),
               dict(out=torch.zeros(3, 23)), dict(out=torch.zeros(1, 23, 3).transpose(1, 2)), dict(temp=-1e-6),
               dict(temp=-1.0), dict(temp=float("nan"))):
        with pytest.raises(ValueError, match="^taps_ops: ngram_table_draw"):
            draw(k, c, s, i, lp, **kw)
    with pytest.raises(ValueError, match="out must be a tensor, a CPU tensor"):
        draw(k, c, s, i, lp, out=torch.zeros(1, 3, 23).numpy())
    with pytest.raises(ValueError, match="must be a tensor"):
        taps_ops.ngram_table_logits(k.numpy(), c, s, i, lp, ctx, 23, 3)
    # shuffled (unsorted) keys, key 0 first (else the op says it lacks one): some answer, in bounds
    rng = torch.Generator().manual_seed(0)
    for _ in range(20):
        perm = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(k.numel() - 1, generator=rng)])
        out = logits(k[perm].contiguous(), c[perm].contiguous(), s, i, lp, ctxs=torch.randint(-1, 23, (4, 3)))
        assert out.shape == (4, 23) and torch.isfinite(out).all()


def _target_table(target, count=300, new=8, seed=4, temperature=1.0, also=()):
    """A table of the target's own distributions over its answers to random prompts (and the prompts `also`)."""
    from taps.train.table import build_table

    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (count, 4), generator=gen).tolist() + [list(p) for p in also]
    return build_table(target, prompts, new_tokens=new, temperature=temperature, seed=seed, max_order=3, entries=8,
                       min_count=1, quiet=True)


def test_greedy_with_a_table_equals_autoregressive():
    target = em.sampling_models()["target"]
    table = _target_table(target, temperature=0.0)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 32, (int(n),), generator=gen).tolist() for n in (3, 5, 8, 2)]
    ar = SpeculativeDecoder(target, [], strategy="autoregressive").generate(prompts, max_new_tokens=16)
    dec = SpeculativeDecoder(target, [NgramTableDrafter(table)], strategy="single", depth=3, top_k=2, budget=6)
    out = dec.generate(prompts, max_new_tokens=16)
    assert [list(t) for t in out.tokens] == [list(t) for t in ar.tokens]
    assert out.summary["tau"] > 1.5, "the table's drafts are hardly accepted: nothing is tested"


def test_greedy_table_chains_are_drawn_as_its_modes(monkeypatch):
    """Where no request samples, a table group still draws (``sampled_drafts=True``; its draw is its cheap draft):
    one chain of its modes a request, every step, accepted step by step as the top-1 chains of the expansion over
    the table's logits (``sampled_drafts=False``), and the tokens are the target's greedy ones."""
    from taps.drafters.table import TableGroup

    target = em.sampling_models()["target"]
    table = _target_table(target, temperature=0.0)
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 32, (int(n),), generator=gen).tolist() for n in (4, 7, 2)]
    runs, calls = {}, []
    original = TableGroup.draft_sampled
    monkeypatch.setattr(TableGroup, "draft_sampled",
                        lambda self, depth, width, *a, **k: calls.append(width) or original(self, depth, width, *a, **k))
    for sampled in (True, False):
        calls.clear()
        dec = SpeculativeDecoder(target, [NgramTableDrafter(table)], strategy="single", depth=3, top_k=2, budget=7,
                                 sampled_drafts=sampled)
        out = dec.generate(prompts, max_new_tokens=20)
        runs[sampled] = out
        assert (calls == [1] * out.steps) if sampled else not calls, calls
    ar = SpeculativeDecoder(target, [], strategy="autoregressive").generate(prompts, max_new_tokens=20)
    assert runs[True].tokens == ar.tokens
    # sampled_drafts="auto" (the default) draws a table's drafts too, with fixed settings and with a tuner (whose
    # candidates hold no top-k tree of the table), greedy and at mixed temperatures
    calls.clear()
    dec = SpeculativeDecoder(target, [NgramTableDrafter(table)], strategy="single", depth=3, top_k=2, budget=7)
    assert dec.generate(prompts, max_new_tokens=20).tokens == ar.tokens and len(calls) > 5
    tuned = SpeculativeDecoder(target, [NgramTableDrafter(table)], strategy="single", depth=3, top_k=2, budget="auto")
    for temps in (0.0, torch.tensor([0.0, 1.0, 0.5])):
        out = tuned.generate(prompts, max_new_tokens=20, temperature=temps, seed=1)
        shapes = {x for st in out.stats for x in st.draft_shapes}
        assert shapes and all(x == "none" or x.endswith("drawn") for x in shapes), shapes
    top1 = SpeculativeDecoder(target, [NgramTableDrafter(table)], strategy="single", depth=3, top_k=1, budget=4,
                              sampled_drafts=False).generate(prompts, max_new_tokens=20)
    assert [s.accepted for s in runs[True].stats] == [s.accepted for s in top1.stats]
    assert runs[True].summary["tau"] > 1.5


def test_a_tuned_table_is_kept_current_through_plain_steps():
    """Under a tuner, a started table group is appended to at every step, plain ones included (its append sets
    each request's last tokens: nothing is queued until it next drafts), through requests joining and leaving;
    every request's greedy tokens are the target's."""
    import random

    from taps.batching import ContinuousBatch, SamplingParams
    from taps.tuner import FixedCosts, Tuner

    class Blocks(Tuner):  # drafts (any shape) for 2 steps, then none for 5, in turn
        def __init__(self):
            super().__init__(FixedCosts(lambda n, b: 1e-3, lambda g, d, b: 1e-3))
            self.rng = random.Random(3)

        def choose(self, options):
            self.clock += 1
            if (self.clock - 1) % 7 >= 2 or len(options) == 1:
                return options[0][0]
            return options[1 + self.rng.randrange(len(options) - 1)][0]

    target = em.sampling_models()["target"]
    table = _target_table(target, count=100, new=8, temperature=0.0)
    dec = SpeculativeDecoder(target, [NgramTableDrafter(table)], strategy="single", depth=3, top_k=2, budget=6,
                             tuner=Blocks())
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 32, (int(n),), generator=gen).tolist() for n in (3, 6, 2, 5)]
    batch = ContinuousBatch(dec, max_batch=3)
    for i in range(3):
        batch.add(i, prompts[i], SamplingParams(max_new_tokens=40 + 8 * i, eos_token_id=[]))
    out, checked = {i: [] for i in range(4)}, 0
    for step in range(80):
        if step == 6:
            batch.add(3, prompts[3], SamplingParams(max_new_tokens=40, eos_token_id=[]))
        for event in batch.step():
            out[event.request_id] += event.tokens
        state = batch.state
        if state is None:
            break
        for g in state.groups:
            if state.pending.started(g):
                assert not state.pending.queue[id(g)], f"step {step}: the table's appends were queued"
                for b, request in enumerate(state.requests):
                    seq = prompts[request.key] + request.tokens
                    assert g.tail[b][-len(seq):] == seq[-table.max_order:], f"step {step} request {b}"
                checked += 1
    assert checked > 10, (checked, step)
    for i, p in enumerate(prompts):
        assert out[i] == em.greedy_reference(target, p, len(out[i])) and len(out[i]) == (40 if i == 3 else 40 + 8 * i)


@pytest.mark.parametrize("sampled,width", [(True, 2), (True, 1), (False, 2)])
def test_sampling_with_a_table_follows_the_target(sampled, width):
    """Drawn chains (the op; two a request, or one: committed with no compaction) and top-k trees (the generic
    expansion over the table's logits), chi-square against the target's exact distribution; drawn chains accept
    more at T = 1."""
    from test_engine_sampling import PROMPT, SAMPLES, STEPS, assert_samples_follow

    target = em.sampling_models()["target"]
    table = _target_table(target, count=100, new=6, also=[PROMPT] * 100)
    dec = SpeculativeDecoder(target, [NgramTableDrafter(table)], strategy="single", depth=3, top_k=width,
                             budget=1 + 3 * width, sampled_drafts=sampled)
    out = dec.generate([PROMPT] * SAMPLES, max_new_tokens=STEPS, temperature=1.0, seed=99)
    assert out.summary["tau"] > (1.6 if sampled else 1.2), f"tau {out.summary['tau']:.2f}: hardly accepted"
    assert_samples_follow(out.tokens, PROMPT, 1.0, 0, 1.0)


def test_vocabulary_mismatch_is_refused():
    target = em.sampling_models()["target"]
    table = NgramTable(np.array([0], np.uint64), [1], [0, 1], [0], [0.0], 1000, 0)
    with pytest.raises(ValueError, match="another model"):
        SpeculativeDecoder(target, [NgramTableDrafter(table)], strategy="single")


def test_train_table_command(tmp_path):
    """`taps train table` on the shipped target (three math prompts) writes a table whose contexts come from the
    target's answers, with a manifest."""
    from taps.train import cli as train_cli
    from taps.train.data import shared_data_dir

    if not (shared_data_dir() / "gsm8k" / "train.jsonl").is_file():
        pytest.skip("no shared training data")
    out = tmp_path / "t"
    assert train_cli.main(["table", "--math", "3", "--chat", "0", "--new-tokens", "6", "--batch", "2",
                           "--min-count", "1", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    table = NgramTable.load(out / "table.npz")
    assert manifest["contexts"] == table.num_contexts > 3 and table.vocab_size == 8192
    assert manifest["target_weights_sha256"] and manifest["prompts"]["math"]["used"] == 3
    assert table.counts[table._zero] == 3 * 6, "order 0 averages every answer position"
    # models.load_table: by folder name under a tables folder, checked against its manifest and its target
    from taps import models

    loaded = models.load_table("t", path=tmp_path)
    assert loaded.num_contexts == table.num_contexts and np.array_equal(loaded.keys, table.keys)
    with pytest.raises(FileNotFoundError, match="taps train table"):
        models.load_table("none", path=tmp_path)
    manifest["target_weights_sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="n-gram table was built from another target"):
        models.load_table("t", path=tmp_path)


def test_frontier_contexts():
    """A frontier node's logits are the table's for the request's last tokens, its ancestors and itself."""
    table = _small_table(seed=12)
    drafter = NgramTableDrafter(table)
    group = NgramTableDrafter.make_group([drafter])
    drafter._vocab = table.vocab_size
    group.start(torch.tensor([[1, 2, 3, 4], [5, 0, 0, 0]]), torch.tensor([4, 1]), torch.tensor([2, 3]), None, 64)
    tails = [[3, 4, 2], [-1, 5, 3]]
    assert group.tail == tails
    assert torch.equal(group.root_logits, table.reference_logits(np.asarray(tails)))
    lv1 = torch.tensor([[1, 5], [0, 2]])
    got = group.forward_nodes(lv1, None, 0, None, None, 1)
    for b in range(2):
        for k in range(2):
            ctx = np.asarray([tails[b][1:] + [int(lv1[b, k])]])
            assert torch.equal(got[b, k], table.reference_logits(ctx)[0])
    lv2, slots = torch.tensor([[4, 3], [1, 1]]), torch.tensor([[1, 0], [1, 1]])
    got = group.forward_nodes(lv2, slots, 0, None, None, 2)
    for b in range(2):
        for k in range(2):
            parent = int(lv1[b, slots[b, k]])
            ctx = np.asarray([tails[b][2:] + [parent, int(lv2[b, k])]])
            assert torch.equal(got[b, k], table.reference_logits(ctx)[0])
    group.advance(torch.tensor([[7, 8, -1], [9, -1, -1]]), torch.tensor([2, 1]), None)
    assert group.tail == [[2, 7, 8], [5, 3, 9]] and group.host_lengths == [7, 3]
    assert group.lengths_b.tolist() == [7, 3]


def test_the_drafter_interface_on_its_own():
    """bind / start / draft / advance / release without a decoder: the candidates are the expansion's over the
    table's logits (children of the root: the root context's most likely entries)."""
    target = em.sampling_models()["target"]
    table = _target_table(target, count=40, new=6)
    drafter = NgramTableDrafter(table)
    with pytest.raises(RuntimeError, match="start"):
        drafter.draft(2, 2)
    drafter.bind(target)
    drafter.start(torch.tensor([[3, 9, 1, 30]]), torch.tensor([4]), torch.tensor([5]), None, 64)
    cand = drafter.draft(2, 2)
    assert cand.tokens.shape == (1, 2 + 2 * 2) and cand.parents[0, :2].tolist() == [-1, -1]
    logits = table.reference_logits(np.asarray([[1, 30, 5]]))[0]
    # (values, not ids: entries of equal logits may come in either order)
    assert logits[cand.tokens[0, :2]].tolist() == logits.topk(2).values.tolist()
    assert drafter.lengths.tolist() == [5]
    drafter.advance(torch.tensor([[7, 2]]), torch.tensor([2]), None)
    assert drafter.lengths.tolist() == [7]
    drafter.release()
    with pytest.raises(RuntimeError, match="start"):
        drafter.lengths
