"""Drafter groups, reduced draft vocabularies and the engine's two target paths (tiny random models, CPU).

1. Drafters of one shape run as one batched group; its candidates equal each drafter run on its own.
2. A routing decision that drops drafters from a batched group (route-*-prompt) keeps decoding exact.
3. A reduced draft vocabulary: every proposed token is in it, and greedy output is still the target's.
4. The lean target path and the Hugging Face path give the same greedy tokens for every strategy kind.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import taps_ops  # noqa: E402,F401
from taps import EagleDrafter, ModelDrafter, SpeculativeDecoder  # noqa: E402
from taps import hf  # noqa: E402
from taps.drafters import make_groups  # noqa: E402

import engine_models as em  # noqa: E402

VOCAB = 80


def _llama(hidden=32, layers=2, seed=0, head_scale=4.0):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def _eagle(target, seed):
    cfg = transformers.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
    torch.manual_seed(seed)
    return em.randomize_(EagleDrafter(cfg), 0.2)


PROMPTS = [[5, 17, 42, 8, 61, 3], [3, 3, 19, 12, 7, 64, 9, 2, 33, 41, 11]]
NEW = 12


def _prefilled(target):
    """PROMPTS as a padded batch, its lengths, the target's prefill (hidden states kept) and greedy roots."""
    batch, longest = len(PROMPTS), max(len(p) for p in PROMPTS)
    ids = torch.zeros((batch, longest), dtype=torch.int64)
    for i, p in enumerate(PROMPTS):
        ids[i, :len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in PROMPTS])
    cache = hf.TreeKVCache.for_model(target, batch, 64)
    pre = hf.prefill(target, cache, ids, lens, return_hidden=True)
    return ids, lens, pre, pre.logits.argmax(-1)


@torch.no_grad()
def test_group_candidates_equal_each_drafter_alone():
    target = hf.use_taps_attention(_llama(seed=1))
    a, b = _eagle(target, 3), _eagle(target, 4)
    for d in (a, b):
        d.bind(target)
    group, = make_groups([a, b])
    assert group.groups == 2 and group.members == [0, 1]
    batch = len(PROMPTS)
    ids, lens, pre, root = _prefilled(target)
    group.start(ids, lens, root, pre.hidden_states, 64)
    together = group.draft(3, 3)
    for g, d in enumerate((a, b)):
        d.start(ids, lens, root, pre.hidden_states, 64)
        alone = d.draft(3, 3)
        rows = slice(g * batch, (g + 1) * batch)
        torch.testing.assert_close(together.scores[rows], alone.scores, atol=1e-5, rtol=1e-5)
        assert torch.equal(together.tokens[rows], alone.tokens)
        assert torch.equal(together.parents[rows], alone.parents)
    # a step later (one accepted token + the bonus), still the same
    new = torch.stack([root, root.flip(0)], 1)
    hidden = pre.hidden_states[:, :2]
    group.advance(new, torch.tensor([2, 1]), hidden, [2, 1])
    together = group.draft(3, 3)
    for g, d in enumerate((a, b)):
        d.advance(new, torch.tensor([2, 1]), hidden)
        alone = d.draft(3, 3)
        rows = slice(g * batch, (g + 1) * batch)
        torch.testing.assert_close(together.scores[rows], alone.scores, atol=1e-5, rtol=1e-5)
        assert torch.equal(together.tokens[rows], alone.tokens)
    # routing that keeps drafter b only: the group of one carries b's caches and state over
    kept = group.subset([1])
    assert kept.groups == 1 and kept.members == [1]
    for group_now, step in ((kept, 0), (kept, 1)):
        if step:
            group_now.advance(new[:, :1], torch.tensor([1, 1]), hidden[:, :1], [1, 1])
            b.advance(new[:, :1], torch.tensor([1, 1]), hidden[:, :1])
        mine, ref = group_now.draft(3, 3), b.draft(3, 3)
        torch.testing.assert_close(mine.scores, ref.scores, atol=1e-5, rtol=1e-5)
        assert torch.equal(mine.tokens, ref.tokens)


@pytest.mark.parametrize("strategy", ["route-confidence-prompt", "route-entropy-prompt"])
def test_routing_that_drops_drafters_from_a_group(strategy):
    target = _llama(seed=1)
    drafters = [_eagle(target, 5), ModelDrafter(target), _eagle(target, 6)]  # eagles 0 and 2 share a group
    dec = SpeculativeDecoder(target, drafters, strategy=strategy, depth=3, top_k=3, budget=8, route_steps=2)
    out = dec.generate(PROMPTS * 2, max_new_tokens=NEW)
    for b, p in enumerate(PROMPTS * 2):
        assert out.tokens[b] == em.greedy_reference(target, p, NEW)
    alive = dec.strategy.alive()
    assert len(alive) < 3  # some drafter was dropped for the rest of the generation
    fixed = dec.strategy.fixed.tolist()
    assert sorted(set(fixed)) == alive
    for s, choice in zip(out.stats, fixed):
        assert s.route_decisions[2:] == [choice] * (len(s.route_decisions) - 2)


def test_reduced_draft_vocabulary():
    target = _llama(seed=1)
    vocab = torch.tensor(sorted(set(range(0, VOCAB, 2)) | {3, 17, 61}))
    d = ModelDrafter(target).set_draft_vocab(vocab)
    e = _eagle(target, 7).set_draft_vocab(vocab)
    allowed = set(vocab.tolist())
    for drafters, strategy in (([d], "single"), ([d, e], "merged")):
        dec = SpeculativeDecoder(target, drafters, strategy=strategy, depth=3, top_k=3, budget=8)
        seen = []
        real = dec.strategy.combine

        def combine(cands, root, real=real):
            seen.append(cands.tokens.flatten().tolist())
            return real(cands, root)
        dec.strategy.combine = combine
        out = dec.generate(PROMPTS, max_new_tokens=NEW)
        for b, p in enumerate(PROMPTS):
            assert out.tokens[b] == em.greedy_reference(target, p, NEW)
        proposed = {t for step in seen for t in step}
        assert proposed <= allowed, proposed - allowed
        assert out.summary["tau"] > 1.2  # the copy of the target still proposes its tokens where allowed
    with pytest.raises(ValueError, match="distinct"):
        ModelDrafter(target).set_draft_vocab(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="in \\[0, 80\\)"):
        ModelDrafter(target).set_draft_vocab(torch.tensor([1, VOCAB]))


@pytest.mark.parametrize("strategy", ["single", "merged-budget", "adaptive"])
def test_lean_and_hugging_face_paths_agree(strategy):
    target = _llama(seed=1)
    drafters = [_eagle(target, 8)] if strategy == "single" else [_eagle(target, 8), ModelDrafter(target)]
    outs = []
    for lean in (True, False):
        dec = SpeculativeDecoder(target, drafters, strategy=strategy, depth=3, top_k=3, budget=8, lean=lean)
        assert (dec.forward.use_lean is True) == lean
        outs.append(dec.generate(PROMPTS, max_new_tokens=NEW))
    assert outs[0].tokens == outs[1].tokens == [em.greedy_reference(target, p, NEW) for p in PROMPTS]
    assert [s.accepted for s in outs[0].stats] == [s.accepted for s in outs[1].stats]


# ---------------------------------------------------------------------------------------------------
# Prompt lookup
# ---------------------------------------------------------------------------------------------------

@torch.no_grad()
def test_a_group_reads_each_rows_last_appended_entry_by_host_counts_as_by_index():
    """DraftGroup._last: each row's entry num_new - 1 (rows group-major), the same values whether the host
    counts are given (one column when every row appended as many: a view) or not (per-row indexing), for
    uniform and ragged counts and several drafters; and an EAGLE group's root features after an append of
    several tokens are those of a group told no host counts."""
    target = hf.use_taps_attention(_llama(seed=1))
    heads = [_eagle(target, 3), _eagle(target, 4)]
    for d in heads:
        d.bind(target)
    group = make_groups(heads)[0]
    gen = torch.Generator().manual_seed(0)
    for counts in ([3, 3, 3], [1, 1, 1], [2, 4, 1], [4]):
        batch = len(counts)
        group.host_lengths = [0] * batch
        out = torch.randn(group.groups * batch, 5, 7, generator=gen)
        num_new = torch.tensor(counts)
        want = torch.stack([out[r, counts[r % batch] - 1] for r in range(out.shape[0])])
        assert torch.equal(group._last(out, num_new), want)
        assert torch.equal(group._last(out, num_new, counts), want)
    prompt = torch.randint(3, 60, (2, 9), generator=gen)
    hidden = torch.randn(2, 9, target.config.hidden_size, generator=gen)
    roots = []
    for host in (True, False):
        g = make_groups(heads[:1])[0]
        g.start(prompt, torch.tensor([9, 9]), torch.tensor([5, 6]), hidden, 64, [9, 9])
        g.advance(torch.randint(3, 60, (2, 3), generator=torch.Generator().manual_seed(1)), torch.tensor([3, 3]),
                  torch.randn(2, 3, target.config.hidden_size, generator=torch.Generator().manual_seed(2)),
                  [3, 3] if host else None)
        roots.append((g.root_feature.clone(), g.root_logits.clone()))
    assert torch.equal(roots[0][0], roots[1][0]) and torch.equal(roots[0][1], roots[1][1])


def test_prompt_lookup_candidates_literal():
    from taps import PromptLookupDrafter
    target = _llama(seed=1)
    d = PromptLookupDrafter(max_ngram=2, min_ngram=1, confidence=0.5, depth=None)  # the decoder's depth
    d.bind(target)
    #        0  1  2  3  4  5  6  7   root 9
    prompt = [7, 8, 9, 4, 7, 8, 5, 6, 7]
    d.start(torch.tensor([prompt]), torch.tensor([len(prompt)]), torch.tensor([8]), None, 64)
    cand = d.draft(3, 2)
    assert cand.scores.shape == (1, 2 + 2 * 4)
    # context ends with (7, 8): most recent earlier match at positions 4-5 -> 5 6 7; then at 0-1 -> 9 4 7
    tokens, parents, scores = cand.tokens[0].tolist(), cand.parents[0].tolist(), cand.scores[0].tolist()
    assert tokens[:6] == [5, 6, 7, 9, 4, 7] and parents[:6] == [-1, 0, 1, -1, 3, 4]
    assert all(t == -1 for t in tokens[6:]) and all(s == float("-inf") for s in scores[6:])
    assert scores[0] > scores[3] and scores[1] == pytest.approx(2 * torch.tensor(0.5).log().item(), abs=1e-6)
    d.advance(torch.tensor([[5, 6]]), torch.tensor([2]), None)  # context now ... 7 8 5 6: (5, 6) seen at 6-7
    cand = d.draft(3, 1)
    assert cand.tokens[0, :3].tolist() == [7, 8, 5]
    # its own depth: continuations of up to 5 tokens in the decoder's 2 + 2 * 4 candidate slots
    long = PromptLookupDrafter(max_ngram=2, min_ngram=1, confidence=0.5, depth=5, repeat=False)
    long.bind(target)
    long.start(torch.tensor([prompt]), torch.tensor([len(prompt)]), torch.tensor([8]), None, 64)
    cand = long.draft(3, 2)
    assert cand.tokens[0].tolist() == [5, 6, 7, 8, 9, 4, 7, 8, 5, -1]  # to the context's end; then 5 tokens
    assert cand.parents[0].tolist() == [-1, 0, 1, 2, -1, 4, 5, 6, 7, -1]
    long._group.sampling = True  # sampled verification: the decoder's depth again
    assert long.draft(3, 2).tokens[0].tolist() == [5, 6, 7, 9, 4, 7] + [-1] * 4
    with pytest.raises(ValueError, match="depth"):
        PromptLookupDrafter(depth=0)


def test_prompt_lookup_continues_a_loop():
    """A match whose continuation runs into the context's end is a loop: with repeat (the default) it is
    continued as the span since the match again, up to the drafter's depth; a match whose continuation
    stops before the end is left as it is; repeat=False stops at the end."""
    from taps import PromptLookupDrafter
    target = _llama(seed=1)
    #        0  1  2  3  4  5  6  7   root 8: the context ends with (7, 8), last seen at 4-5
    prompt = [7, 8, 9, 4, 7, 8, 5, 6, 7]
    for repeat, first in ((True, [5, 6, 7, 8, 5, 6, 7]), (False, [5, 6, 7, 8])):
        d = PromptLookupDrafter(max_ngram=2, min_ngram=1, confidence=0.5, depth=7, repeat=repeat)
        d.bind(target)
        d.start(torch.tensor([prompt]), torch.tensor([len(prompt)]), torch.tensor([8]), None, 64)
        assert d.clone().repeat == repeat
        conts = d._group.continuations(0, 7, 2)
        # the older match (ends at 2) runs 7 tokens without reaching the end: as it is either way
        assert conts == [first, [9, 4, 7, 8, 5, 6, 7]]
        cand = d.draft(3, 2)  # 2 + 2 * 4 candidate slots: the first continuation whole, then the second's
        assert cand.tokens[0].tolist()[:len(first)] == first
    # a loop of period 1 (one token repeated) and of period 3, at depth 8
    d = PromptLookupDrafter(max_ngram=3, min_ngram=2, depth=8)
    d.bind(target)
    rows = [[1, 2, 4, 4, 4], [1, 5, 6, 7, 5, 6]]
    d.start(torch.tensor([r + [0] * (6 - len(r)) for r in rows]), torch.tensor([5, 6]), torch.tensor([4, 7]), None, 64)
    assert d._group.continuations(0, 8, 1) == [[4] * 8]
    assert d._group.continuations(1, 8, 1) == [[5, 6, 7, 5, 6, 7, 5, 6]]


def test_prompt_lookup_leaves_single_token_matches_out_by_default():
    """min_ngram defaults to 2 (max_ngram when that is 1): a context whose last token occurred before but not
    its last two has no draft; with min_ngram=1 it drafts what followed the token."""
    from taps import PromptLookupDrafter
    target = _llama(seed=1)
    assert PromptLookupDrafter().min_ngram == 2 and PromptLookupDrafter(max_ngram=1).min_ngram == 1
    prompt = [3, 9, 4, 5, 2]                                   # root 9: (2, 9) never seen, 9 seen at 1
    for min_ngram, drafts in ((None, False), (1, True)):
        d = PromptLookupDrafter(min_ngram=min_ngram, depth=3)
        d.bind(target)
        d.start(torch.tensor([prompt]), torch.tensor([len(prompt)]), torch.tensor([9]), None, 64)
        assert d._group.has_draft(0) == drafts
        tokens = d.draft(3, 1).tokens[0].tolist()
        assert tokens[:3] == ([4, 5, 2] if drafts else [-1, -1, -1])


def test_prompt_lookup_knows_whether_it_has_a_match_without_searching():
    """has_draft is kept by each append (a flag per request, read every plain step of a tuned decoder):
    it equals whether the search of continuations() finds anything, for every n-gram range, through
    appends of several tokens, requests dropped and requests joined; the lengths tensor, built when read,
    follows the host lengths."""
    from taps import PromptLookupDrafter
    target = _llama(seed=1)
    gen = torch.Generator().manual_seed(0)
    answers = set()
    for max_ngram, min_ngram in ((1, 1), (3, None), (3, 1), (4, 3)):
        d = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram, depth=3)
        d.bind(target)
        group = PromptLookupDrafter.make_group([d])

        calls = [0]

        def check(g):
            # has_draft against a brute-force index of the history; the lazily kept index (brought up to date
            # by a search) equals that index when searched, every third check (and every search finds
            # something exactly where has_draft said so)
            lo, hi = d.min_ngram, d.max_ngram + 1
            refs = [_ngram_index(h, lo, hi) for h in g.history]
            want = [any(len(ref.get(tuple(h[len(h) - n:]), ())) > 1 for n in range(lo, min(hi, len(h) + 1)))
                    for h, ref in zip(g.history, refs)]
            assert [g.has_draft(b) for b in range(g.batch)] == want
            calls[0] += 1
            if calls[0] % 3 == 0:
                assert [bool(g.continuations(b, 1, 1)) for b in range(g.batch)] == want
                assert g.index == refs
            assert g.lengths_b.tolist() == g.host_lengths == [len(h) for h in g.history]
            answers.update(g.matched)

        ids = torch.randint(0, 6, (3, 9), generator=gen)
        group.start(ids, torch.tensor([9, 4, 1]), torch.randint(0, 6, (3,), generator=gen), None, 64)
        check(group)
        for step in range(40):
            num_new = torch.randint(0, 4, (3,), generator=gen)
            group.advance(torch.randint(0, 6, (3, 3), generator=gen), num_new, None, num_new.tolist())
            check(group)
            if step == 20:
                group.select_requests([2, 0])
                check(group)
                extra = group.spawn()
                extra.start(torch.randint(0, 6, (1, 5), generator=gen), torch.tensor([5]), torch.tensor([1]), None, 64)
                group.append_requests(extra)
                check(group)
    assert answers == {False, True}


def _ngram_index(hist, lo, hi):
    """Every n-gram (lo <= n < hi) of `hist` -> the positions it ends at (exclusive ends), oldest first."""
    index = {}
    for end in range(1, len(hist) + 1):
        for n in range(lo, min(hi, end + 1)):
            index.setdefault(tuple(hist[end - n:end]), []).append(end)
    return index


def test_prompt_lookup_in_every_combining_strategy():
    from taps import PromptLookupDrafter
    target = _llama(seed=1)
    prompts = [p * 3 for p in PROMPTS]  # repetitive prompts, so lookup has something to match
    for strategy, drafters in (("single", [PromptLookupDrafter()]),
                               ("merged", [_eagle(target, 9), PromptLookupDrafter()]),
                               ("merged-budget", [_eagle(target, 9), ModelDrafter(target), PromptLookupDrafter()]),
                               ("adaptive", [_eagle(target, 9), PromptLookupDrafter()]),
                               ("route-confidence", [_eagle(target, 9), PromptLookupDrafter()])):
        dec = SpeculativeDecoder(target, drafters, strategy=strategy, depth=3, top_k=3, budget=8)
        out = dec.generate(prompts, max_new_tokens=NEW)
        for b, p in enumerate(prompts):
            assert out.tokens[b] == em.greedy_reference(target, p, NEW), strategy
    # the target's own greedy output repeats itself here, so prompt lookup alone gets accepted
    out = SpeculativeDecoder(target, [PromptLookupDrafter()], strategy="single", depth=3, top_k=3,
                             budget=8).generate(prompts, max_new_tokens=40)
    assert out.summary["tau"] > 1.3
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)


def test_prompt_lookup_without_a_match_sits_the_step_out():
    """Without a tuner too, a step where prompt lookup has no match for any request runs no draft (its
    group is not asked: a plain step of the root alone), alone or beside a drafter that runs a model (which
    then drafts by itself); a step where some request has one drafts; the output is the target's greedy
    output, alone, merged and in a ragged batch."""
    from taps import PromptLookupDrafter
    target = _llama(seed=1)
    rep = PROMPTS[0] * 3  # repeats itself: matches come and go
    for strategy, extra in (("single", []), ("merged", [_eagle(target, 9)])):
        lookup = PromptLookupDrafter()
        dec = SpeculativeDecoder(target, extra + [lookup], strategy=strategy, depth=3, top_k=3, budget=8)
        group = dec._draft_groups()[-1]
        asked = []
        draft = type(group).draft

        def counting(self, *a, **k):
            asked.append([self.has_draft(b) for b in range(self.batch)])
            return draft(self, *a, **k)

        type(group).draft = counting
        try:
            for prompts in ([PROMPTS[1]], [rep], [PROMPTS[1], rep]):
                asked.clear()
                out = dec.generate(prompts, max_new_tokens=NEW)
                for b, p in enumerate(prompts):
                    assert out.tokens[b] == em.greedy_reference(target, p, NEW), (strategy, b)
                assert all(any(row) for row in asked), asked  # asked only when some request has a match
                if strategy == "single" and len(prompts) == 1:  # the steps it was not asked are plain ones
                    nodes = out.stats[0].tree_nodes
                    assert nodes.count(1) >= len(nodes) - len(asked), (nodes, len(asked))
                if prompts == [rep]:
                    assert asked, "a repetitive prompt has matches"
        finally:
            type(group).draft = draft


def test_prompt_lookup_alone_keeps_its_first_continuation_deep():
    """Verified on its own (the decoder sets DraftGroup.alone), prompt lookup scores each lower-ranked
    continuation log(runner_up) lower, so a node budget keeps the first continuation deep; merged with
    other drafters' candidates it keeps the continuations level by level."""
    import math

    import taps_ops
    from taps import PromptLookupDrafter
    target = _llama(seed=1)
    d = PromptLookupDrafter(max_ngram=2, min_ngram=1, confidence=0.5, depth=5, runner_up=0.05, repeat=False)
    d.bind(target)
    #        0  1  2  3  4  5  6  7   root 9
    prompt = [7, 8, 9, 4, 7, 8, 5, 6, 7]
    d.start(torch.tensor([prompt]), torch.tensor([len(prompt)]), torch.tensor([8]), None, 64)
    # continuations: 5 6 7 8 (rank 0, to the context's end), then 9 4 7 8 5 (rank 1)
    level = d.draft(3, 2)
    d._group.alone = True
    deep = d.draft(3, 2)
    assert deep.tokens.tolist() == level.tokens.tolist() and deep.parents.tolist() == level.parents.tolist()
    assert level.tokens[0, :9].tolist() == [5, 6, 7, 8, 9, 4, 7, 8, 5]
    assert deep.scores[0, 1].item() == pytest.approx(2 * math.log(0.5))                 # rank 0, depth 2
    assert deep.scores[0, 4].item() == pytest.approx(math.log(0.5) + math.log(0.05))    # rank 1, depth 1
    kept = []
    for cand in (level, deep):  # a budget of 6 nodes: the root and 5 candidates
        tree = taps_ops.build_tree(cand.scores, cand.tokens, cand.parents, 6, root_tokens=torch.tensor([7]))
        kept.append((sorted(tree.tokens[0, 1:].tolist()), int(tree.depth.max())))
    assert kept[0] == (sorted([5, 6, 7, 9, 4]), 3)   # two levels of both, and a third of the first
    assert kept[1] == (sorted([5, 6, 7, 8, 9]), 4)   # the first continuation whole, then the next's first
    with pytest.raises(ValueError, match="runner_up"):
        PromptLookupDrafter(runner_up=0.0)


@pytest.mark.parametrize("max_ngram, min_ngram", [(3, None), (1, 1), (4, 2), (3, 3)])
def test_prompt_lookup_indexes_a_prompt_as_token_by_token(max_ngram, min_ngram):
    """start() indexes each prompt at once (LookupGroup._index); the index, the history and whether the last
    n-gram occurred before equal what appending the same tokens one at a time (_add) makes, on random
    prompts of a small vocabulary (many repeats) and of every short length."""
    from taps import PromptLookupDrafter
    from taps.drafters.ngram import LookupGroup

    g = torch.Generator().manual_seed(max_ngram)
    d = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    lengths = list(range(0, 6)) + [17, 64, 250]
    for vocab in (3, 50):
        rows = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
        width = max(lengths)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        root = torch.randint(0, vocab, (len(rows),), generator=g)
        bulk = LookupGroup(d)
        bulk.start(ids, torch.tensor(lengths), root, None, 512)
        step = LookupGroup(d)
        step.history, step.index, step.indexed = [[] for _ in rows], [{} for _ in rows], [0] * len(rows)
        step.seen, step.matched = [set() for _ in rows], [False] * len(rows)
        for b, r in enumerate(rows):
            step._add(b, r + [int(root[b])])
        assert bulk.history == step.history and bulk.seen == step.seen and bulk.matched == step.matched
        # the index, made when a draft first searches it, is the brute-force one either way
        refs = [_ngram_index(h, d.min_ngram, d.max_ngram + 1) for h in bulk.history]
        assert [bulk._catch_up(b) for b in range(len(rows))] == refs == [step._catch_up(b) for b in range(len(rows))]
        if vocab == 3:  # both answers occur (the short prompts cannot repeat, the long ones do)
            assert any(bulk.matched) and not all(bulk.matched)


def test_decoder_tells_groups_how_they_draft(monkeypatch):
    """The decoder sets DraftGroup.sampling for a generation (prompt lookup keeps the decoder's depth under
    sampling): False when greedy, True when any request samples; and DraftGroup.alone before each draft:
    True for a step whose only drafter is the group's, False when other drafters draft beside it (the
    lossless output is the same either way: test_prompt_lookup_in_every_combining_strategy)."""
    from taps import PromptLookupDrafter
    from taps.drafters.ngram import LookupGroup
    seen = []
    draft = LookupGroup.draft

    def spy(self, *args, **kwargs):
        seen.append((self.sampling, self.alone))
        return draft(self, *args, **kwargs)

    monkeypatch.setattr(LookupGroup, "draft", spy)
    target = _llama(seed=1)
    dec = SpeculativeDecoder(target, [PromptLookupDrafter()], strategy="single", depth=3, top_k=3, budget=8)
    prompts = [p * 2 for p in PROMPTS]
    dec.generate(prompts, max_new_tokens=4)
    assert seen and set(seen) == {(False, True)}
    seen.clear()
    dec.generate(prompts, max_new_tokens=4, temperature=torch.tensor([0.0, 1.0]), seed=0)
    assert seen and set(seen) == {(True, True)}
    seen.clear()
    SpeculativeDecoder(target, [_eagle(target, 9), PromptLookupDrafter()], strategy="merged", depth=3, top_k=3,
                       budget=8).generate(prompts, max_new_tokens=4)
    assert seen and set(seen) == {(False, False)}


# ---------------------------------------------------------------------------------------------------
# Node masks: a drafter level's attention as one tree_attention call instead of a dense mask and SDPA
# ---------------------------------------------------------------------------------------------------

def _drafting_runs(group, ids, lens, root, hidden, steps):
    """Root logits after start, then candidates of `steps` draft / advance rounds."""
    group.start(ids, lens, root, hidden, 96)
    out = [group.root_logits.clone()]
    for step in range(steps):
        cand = group.draft(4, 3)
        out += [cand.scores, cand.tokens, cand.parents]
        num = 1 + step % 3
        tokens = cand.tokens[:len(PROMPTS), :num].clamp_min(0)
        group.advance(tokens, torch.full((len(PROMPTS),), num), hidden[:, :num] if hidden is not None else None,
                      [num] * len(PROMPTS))
        out.append(group.root_logits.clone())
    return out


@pytest.mark.parametrize("kind", ["eagle", "eagle-pair", "lm", "eagle3"])
@torch.no_grad()
def test_node_masks_draft_what_dense_masks_draft(kind):
    """Requests of equal length: the lean groups attend through taps.kv.NodeMask (expansion levels and
    appends, one taps_ops.tree_attention call per layer); with that switched off they take the dense
    bool mask and SDPA. Both must draft the same candidates and root logits; ragged requests never take
    node masks."""
    from taps.eagle3 import Eagle3Drafter
    target = hf.use_taps_attention(_llama(seed=1, layers=3))
    if kind == "eagle3":
        cfg = transformers.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
        torch.manual_seed(2)
        head = em.randomize_(Eagle3Drafter(cfg), 0.2)
        head.bind(target)
        drafters = [head]
    else:
        drafters = {"eagle": lambda: [_eagle(target, 3)], "eagle-pair": lambda: [_eagle(target, 3), _eagle(target, 4)],
                    "lm": lambda: [ModelDrafter(_llama(seed=5))]}[kind]()
    for d in drafters:
        d.bind(target)
    prompts = [p[:6] for p in PROMPTS]  # equal lengths
    ids = torch.tensor(prompts)
    lens = torch.tensor([6, 6])
    cache = hf.TreeKVCache.for_model(target, len(prompts), 96)
    layers = getattr(drafters[0], "feature_layers", None)
    pre = hf.prefill(target, cache, ids, lens, return_hidden=True,
                     **({"capture_layers": layers} if layers else {}))
    hidden = torch.cat([pre.layers[i] for i in layers], -1) if layers else pre.hidden_states
    root = pre.logits.argmax(-1)
    runs = []
    for node_masks in (True, False):
        group, = make_groups(drafters)
        group.lean_attention = node_masks
        seen = []
        forward = group.forward_nodes
        group.forward_nodes = lambda *a, forward=forward: seen.append(type(a[4]).__name__) or forward(*a)
        runs.append(_drafting_runs(group, ids, lens, root, hidden, 4))
        assert set(seen) == ({"NodeMask"} if node_masks else {"Tensor"}), seen
    for a, b in zip(*runs):
        if a.dtype.is_floating_point:  # fp32 rounding of two attention kernels, compounded over the levels
            # (2.1e-5 of the largest logit measured at AVX2 on an AMD EPYC Zen 3; a wrong mask moves them by O(1))
            torch.testing.assert_close(a, b, atol=1e-4 * a.abs().max().item(), rtol=0)
        else:
            assert torch.equal(a, b)
    # ragged requests: the dense mask (a gap between a short row's prefix and the scratch entries)
    group, = make_groups(drafters)
    ragged = torch.tensor([4, 6])
    group.start(ids, ragged, root, hidden, 96)
    assert group.lean_attention and not group.node_masks


@pytest.mark.parametrize("kind", ["eagle", "lm"])
@torch.no_grad()
def test_wide_append_grows_a_full_cache(kind):
    """An append pads every row to the widest row's tokens and writes them all at each row's own positions:
    after a lazy catch-up (a tuner's group, rows of a continuous batch that missed different numbers of
    steps) a short row near the end of its cache wrote past it (IndexError in the server's decoding loop).
    The caches now grow; the result equals a group started with room to spare."""
    target = hf.use_taps_attention(_llama(seed=1))
    batch = len(PROMPTS)
    ids, lens, pre, root = _prefilled(target)
    wide = 12  # request 0 catches up 12 tokens, request 1 (11 + 1 entries) one: 12 + 12 > 20
    new = torch.randint(0, VOCAB, (batch, wide), generator=torch.Generator().manual_seed(7))
    hidden = torch.randn(batch, wide, pre.hidden_states.shape[-1], generator=torch.Generator().manual_seed(8))
    num_new = torch.tensor([wide, 1])
    runs = []
    for room in (20, 64):
        drafter = _eagle(target, 3) if kind == "eagle" else ModelDrafter(_llama(seed=5))
        drafter.bind(target)
        group, = make_groups([drafter])
        group.start(ids, lens, root, pre.hidden_states, room)
        group.advance(new, num_new, hidden if group.needs_hidden else None, [wide, 1])
        cand = group.draft(3, 3)
        runs.append([group.root_logits, cand.scores, cand.tokens, cand.parents])
        assert group.kv[0][0].shape[2] >= (24 if room == 20 else 64)
    for a, b in zip(*runs):
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a, b, atol=1e-5 * a.abs().max().item(), rtol=0)
        else:
            assert torch.equal(a, b)
