"""Token stores (taps.drafters.store.TokenStore) and prompt lookup with a store: the index against brute force
on random stores of odd sizes, the vote, files and their errors, and decoding with a store stays lossless
(greedy equal to autoregressive decoding, samples chi-square against the target)."""

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from taps import PromptLookupDrafter, SpeculativeDecoder
from taps.drafters.store import MAX_DEPTH, TokenStore

import engine_models as em

pytestmark = pytest.mark.usefixtures("one_thread")


def _random_sequences(rng, count, vocab, lo=0, hi=40):
    return [[rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


def _occurrences(seqs, pattern):
    """(sequence, index of the token after the match) of every occurrence of `pattern` inside a sequence."""
    n = len(pattern)
    return [(s, i + n) for s, seq in enumerate(seqs) for i in range(len(seq) - n + 1) if seq[i:i + n] == pattern]


def _brute_match(seqs, context, max_ngram):
    best, occ = 0, []
    for n in range(1, min(max_ngram, len(context)) + 1):
        found = _occurrences(seqs, context[-n:])
        if not found:
            break
        best, occ = n, found
    return best, occ


def _check_vote(seqs, occ, got, depth):
    """`got` against the plurality walk over the continuations of the occurrences (the reference of
    TokenStore's vote: at each level the token most of the continuations still agreeing go on with; a tie
    may go either way, the walk follows the store's choice; -1 stands for a continuation's end)."""
    assert len(got) <= depth
    rows = [seqs[s][i:i + depth] for s, i in occ]
    for d in range(depth):
        votes = Counter(r[d] if d < len(r) else -1 for r in rows)
        top = max(votes.values())
        tied = {t for t, c in votes.items() if c == top}
        if d == len(got):
            assert -1 in tied, f"the continuation stopped at {d} with the plurality {tied} going on"
            return
        assert got[d] in tied, f"voted {got[d]} at {d}, the plurality is {tied}"
        rows = [r for r in rows if d < len(r) and r[d] == got[d]]


@pytest.mark.parametrize("seed,vocab,max_ngram", [(0, 3, 8), (1, 5, 4), (2, 17, 8), (3, 2, 1), (4, 7, 3)])
def test_match_and_vote_against_brute_force(seed, vocab, max_ngram):
    rng = random.Random(seed)
    seqs = _random_sequences(rng, rng.randrange(1, 23), vocab)
    store = TokenStore(seqs, vocab, max_ngram=max_ngram, vote=10 ** 6)
    assert len(store) == sum(map(len, seqs))
    for _ in range(150):
        if rng.random() < 0.5 and any(seqs):
            seq = rng.choice([s for s in seqs if s])
            i = rng.randrange(len(seq))
            context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 3))] + seq[max(0, i - 9):i + 1]
        else:
            context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        n, lo, hi = store.match(context)
        want_n, occ = _brute_match(seqs, context, max_ngram)
        assert n == want_n, context
        assert hi - lo == len(occ), context
        depth = rng.randrange(1, 12)
        got, got_n = store.continuation(context, depth, min_ngram=1)
        assert got_n == want_n
        if want_n:
            _check_vote(seqs, occ, got, depth)
        else:
            assert got == []
        # shorter than min_ngram: nothing
        assert store.continuation(context, depth, min_ngram=want_n + 1)[0] == []


def test_matches_stay_inside_their_sequence():
    store = TokenStore([[1, 2, 3], [4, 5]], 8)
    assert store.match([3, 4])[0] == 1  # 3 ends one sequence and 4 starts the next: no 2-gram across them
    assert store.continuation([1, 2, 3], 5, min_ngram=1) == ([], 3)  # nothing after the sequence's end
    assert store.continuation([4], 5, min_ngram=1) == ([5], 1)
    assert store.has_pair(4, 5) and not store.has_pair(3, 4) and not store.has_pair(5, 4)


def test_vote_follows_the_majority_and_its_cap():
    seqs = [[7, 1, 2, 3]] * 3 + [[7, 1, 5, 6]] * 2 + [[7, 4]]
    store = TokenStore(seqs, 8)
    assert store.continuation([7], 4, min_ngram=1) == ([1, 2, 3], 1)
    assert store.continuation([7, 1], 2, min_ngram=1) == ([2, 3], 2)
    one = TokenStore(seqs, 8, vote=1).continuation([7], 4, min_ngram=1)[0]
    assert one in ([1, 2, 3], [1, 5, 6], [4])  # one occurrence's own continuation
    # the depth is capped at MAX_DEPTH
    long = TokenStore([list(range(100))], 100)
    assert long.continuation([0], 1000, min_ngram=1)[0] == list(range(1, MAX_DEPTH + 1))


def test_has_pair_against_brute_force():
    rng = random.Random(5)
    seqs = _random_sequences(rng, 9, 6)
    store = TokenStore(seqs, 6)
    pairs = {(a, b) for s in seqs for a, b in zip(s, s[1:])}
    for a in range(6):
        for b in range(6):
            assert store.has_pair(a, b) == ((a, b) in pairs)


def test_save_and_load(tmp_path):
    rng = random.Random(7)
    seqs = [s for s in _random_sequences(rng, 12, 300, 1, 30)]
    store = TokenStore(seqs, 300, max_ngram=5, vote=7, meta={"how": "test"})
    path = store.save(tmp_path / "s.npz")
    back = TokenStore.load(path)
    assert (back.tokens == store.tokens).all() and back.num_sequences == len(seqs)
    assert (back.max_ngram, back.vote, back.vocab_size, back.meta) == (5, 7, 300, {"how": "test"})
    assert TokenStore.load(path, max_ngram=2, vote=3).max_ngram == 2
    big = TokenStore([[70000, 1]], 70001)  # ids past int16 are kept
    assert TokenStore.load(big.save(tmp_path / "b.npz")).continuation([70000], 3, 1)[0] == [1]


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        TokenStore([[1, 2], [3, 9]], 8)
    with pytest.raises(ValueError, match="outside"):
        TokenStore([[-1]], 8)
    for kw in (dict(max_ngram=0), dict(vote=0)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            TokenStore([[1]], 8, **kw)
    with pytest.raises(ValueError, match="vocab_size"):
        TokenStore([[0]], 0)
    with pytest.raises(FileNotFoundError, match="no store file"):
        TokenStore.load(tmp_path / "none.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a token store"):
        TokenStore.load(tmp_path / "bad.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not a token store"):
        TokenStore.load(tmp_path / "other.npz")
    info = np.frombuffer(json.dumps({"format": 99}).encode(), np.uint8)
    np.savez(tmp_path / "new.npz", tokens=np.zeros(3, np.int16), info=info)
    with pytest.raises(ValueError, match="format 99"):
        TokenStore.load(tmp_path / "new.npz")
    empty = TokenStore([], 4)
    assert len(empty) == 0 and empty.match([1, 2]) == (0, 0, 0) and empty.continuation([1], 3) == ([], 0)
    with pytest.raises(TypeError, match="TokenStore"):
        PromptLookupDrafter(store=[[1, 2]])
    target = em.sampling_models()["target"]
    with pytest.raises(ValueError, match="larger than the target"):
        SpeculativeDecoder(target, [PromptLookupDrafter(store=TokenStore([[1]], 1000))], strategy="single")


def _target_store(target, count=60, new=12, seed=3, temperature=0.0, also=()):
    """A store of the target's own answers to random prompts (and to the prompts `also`)."""
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (count, 4), generator=gen).tolist() + [list(p) for p in also]
    ar = SpeculativeDecoder(target, [], strategy="autoregressive")
    out = ar.generate(prompts, max_new_tokens=new, temperature=temperature, seed=seed)
    return TokenStore([p + list(t) for p, t in zip(prompts, out.tokens)], vocab)


def test_greedy_with_a_store_equals_autoregressive():
    target = em.sampling_models()["target"]
    store = _target_store(target, count=200)
    rng = random.Random(11)
    prompts = [[rng.randrange(32) for _ in range(rng.randrange(2, 9))] for _ in range(6)]
    ar = SpeculativeDecoder(target, [], strategy="autoregressive").generate(prompts, max_new_tokens=20)
    # a store alone (no match of the context's own: min_ngram 3 is rare in 20 tokens) and beside the context
    for kw in (dict(max_ngram=3, min_ngram=3, store_ngram=3), dict(store_ngram=2), dict()):
        dec = SpeculativeDecoder(target, [PromptLookupDrafter(store=store, **kw)], strategy="single")
        out = dec.generate(prompts, max_new_tokens=20)
        assert [list(t) for t in out.tokens] == [list(t) for t in ar.tokens]
        if kw:
            assert out.summary["tau"] > 1.7, "the store's drafts are hardly accepted: nothing is tested"
            plain = SpeculativeDecoder(target, [PromptLookupDrafter(**kw)], strategy="single")
            assert plain.generate(prompts, max_new_tokens=20).summary["tau"] < out.summary["tau"] - 0.2


def test_sampling_with_a_store_follows_the_target():
    from test_engine_sampling import PROMPT, SAMPLES, STEPS, assert_samples_follow

    target = em.sampling_models()["target"]
    # what the target said before after this prompt and after others (sampled: a store of its greedy answers
    # would propose one path only)
    store = _target_store(target, count=100, new=6, temperature=1.0, also=[PROMPT] * 100)
    dec = SpeculativeDecoder(target, [PromptLookupDrafter(store=store, store_ngram=2)], strategy="single", depth=3,
                             top_k=2, budget=6)
    out = dec.generate([PROMPT] * SAMPLES, max_new_tokens=STEPS, temperature=1.0, seed=99)
    assert out.summary["tau"] > 1.3, f"tau {out.summary['tau']:.2f}: the store's drafts are hardly accepted"
    assert_samples_follow(out.tokens, PROMPT, 1.0, 0, 1.0)


def test_store_continuation_ranked_by_match_length():
    """The store's continuation goes before the context's matches of a shorter n-gram, after those of one as
    long or longer; a context with no match of its own has a draft from the store (has_draft)."""
    target = em.sampling_models()["target"]

    def conts(context, store, top_k=4, **kw):
        d = PromptLookupDrafter(store=store, **{"store_ngram": kw.get("min_ngram", 2), **kw})
        d.bind(target)
        g = PromptLookupDrafter.make_group([d])
        ids = torch.tensor([context[:-1]])
        g.start(ids, torch.tensor([len(context) - 1]), torch.tensor([context[-1]]), None, 64)
        return g.continuations(0, 4, top_k), g.has_draft(0)

    context = [1, 6, 7, 9, 5, 6, 7]  # the context's own match: [6, 7] -> 9 5 6 7 (a 2-gram)
    long = TokenStore([[4, 5, 6, 7, 20, 21]], 32)  # a 3-gram match -> 20 21 ...
    short = TokenStore([[8, 7, 30, 31]], 32)  # a 1-gram match only (under min_ngram 2: none)
    two = TokenStore([[1, 6, 7, 25]], 32)  # a 2-gram match, as long as the context's
    assert conts(context, long)[0] == [[20, 21], [9, 5, 6, 7]]
    assert conts(context, two)[0] == [[9, 5, 6, 7], [25]]
    assert conts(context, short)[0] == [[9, 5, 6, 7]]
    assert conts(context, long, top_k=1)[0] == [[20, 21]]
    fresh = [1, 2, 3, 6, 7]  # no match of its own
    assert conts(fresh, None) == ([], False)
    assert conts(fresh, two) == ([[25]], True)
    assert conts(fresh, short) == ([], False)
    assert conts(fresh, short, min_ngram=1)[0] == [[30, 31]]
    # store_ngram: the shortest store match that proposes (and makes a draft), found by a search past 2
    fresh3 = [9, 5, 6, 7]
    assert conts(fresh3, long, store_ngram=3) == ([[20, 21]], True)
    assert conts(fresh3, long, store_ngram=4) == ([], False)
    assert conts(fresh3, two, store_ngram=3) == ([], False)
    with pytest.raises(ValueError, match="store_ngram"):
        PromptLookupDrafter(store=long, store_ngram=0)


def test_train_store_command_and_load_store(tmp_path):
    """`taps train store` on the shipped target (three math prompts) writes a store that models.load_store
    reads back, checked against its manifest and the target's weights digest."""
    from taps import models
    from taps.train import cli as train_cli
    from taps.train.data import shared_data_dir

    if not (shared_data_dir() / "gsm8k" / "train.jsonl").is_file():
        pytest.skip("no shared training data")
    out = tmp_path / "stores" / "mine"
    assert train_cli.main(["store", "--math", "3", "--chat", "0", "--new-tokens", "5", "--batch", "2",
                           "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sequences"] == 3 and manifest["prompts"]["math"]["used"] == 3
    store = models.load_store("mine", path=tmp_path / "stores")
    assert store.num_sequences == 3 and len(store) == manifest["tokens"]
    # each sequence is a prompt and the target's greedy answer to it
    target, tok = models.load_target()
    seqs = np.split(store.tokens[1:-MAX_DEPTH - 1], np.flatnonzero(store.tokens[1:-MAX_DEPTH - 1] < 0))
    first = [int(t) for t in seqs[0] if t >= 0]
    ar = SpeculativeDecoder(target, [], strategy="autoregressive")
    answer = first[-5:]
    assert list(ar.generate([first[:-5]], max_new_tokens=5).tokens[0]) == answer
    # built for another target: refused
    manifest["target_weights_sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="another target"):
        models.load_store("mine", path=tmp_path / "stores")
    with pytest.raises(FileNotFoundError, match="taps train store"):
        models.load_store("none", path=tmp_path / "stores")
    (out / "store.npz").write_bytes(b"changed")
    with pytest.raises(ValueError, match="does not match"):
        models.load_store("mine", path=tmp_path / "stores")


def test_shipped_store():
    """The shipped store loads, was built from the shipped target, and proposes for a shipped-model context."""
    from taps import models

    store = models.load_store()
    assert store.vocab_size == 8192 and store.num_sequences == 7000
    target, tok = models.load_target()
    context = tok.encode_chat([{"role": "user", "content": "What is 12 plus 30?"}], add_generation_prompt=True)
    assert store.continuation(context, 8)[0], "the chat template's end is in every stored prompt"


def test_op_inputs_are_checked():
    """token_store_continuation: every malformed input raises ValueError (fuzzed), never reads out of bounds;
    unsorted columns give some answer; device tensors elsewhere are refused."""
    import taps_ops

    store = TokenStore([[1, 2, 3, 1, 2, 4], [2, 3]], 8)
    good = (store._tokens_t, store._ends_t, store._cols_t)
    assert taps_ops.token_store_continuation(*good, [1, 2], 3, 1, 32)[0] == 2
    rng = random.Random(0)
    bad = [
        lambda t, e, c: (t.long(), e, c), lambda t, e, c: (t, e.int(), c), lambda t, e, c: (t, e, c.long()),
        lambda t, e, c: (t[None], e, c), lambda t, e, c: (t, e[:-1], c), lambda t, e, c: (t, e, c[:, :-1]),
        lambda t, e, c: (t[::2], e, c), lambda t, e, c: (t, e, c.t().contiguous().t()),
        lambda t, e, c: (t, e + 10 ** 6, c), lambda t, e, c: (t, e - 10 ** 6, c), lambda t, e, c: (t, e, c[0]),
    ]
    for make in bad:
        t, e, c = make(*good)
        with pytest.raises(ValueError, match="^taps_ops: token_store_continuation"):
            taps_ops.token_store_continuation(t, e, c, [1, 2], 3, 1, 32)
    for depth, min_n, vote in ((-1, 1, 1), (1, -1, 1), (1, 1, 0)):
        with pytest.raises(ValueError, match="^taps_ops"):
            taps_ops.token_store_continuation(*good, [1, 2], depth, min_n, vote)
    with pytest.raises(ValueError, match="CPU tensor"):
        taps_ops.token_store_continuation(good[0].to("meta"), good[1], good[2], [1], 1)
    # ids no store holds, an empty context, and shuffled (unsorted) columns: answers, in bounds
    assert taps_ops.token_store_continuation(*good, [-5, 2 ** 40], 3) == (0, 0, 0, [])
    assert taps_ops.token_store_continuation(*good, [], 3) == (0, 0, 0, [])
    for _ in range(50):
        perm = torch.randperm(good[1].numel())
        n, lo, hi, cont = taps_ops.token_store_continuation(good[0], good[1][perm].contiguous(),
                                                            good[2][:, perm].contiguous(),
                                                            [rng.randrange(8) for _ in range(3)], 4)
        assert 0 <= lo <= hi <= good[1].numel() and len(cont) <= 4


def test_vote_ties_go_to_the_first_occurrence():
    """A tie at a level goes to the token of the first of the tied occurrences in the index's order (the
    ends' order), whichever it is, and the continuation then follows it."""
    store = TokenStore([[5, 1, 2], [5, 3, 4]], 8)
    first = int(store.tokens[store.ends[store.match([5])[1]] + 1])
    cont, n = store.continuation([5], 3, min_ngram=1)
    assert n == 1 and cont == ([1, 2] if first == 1 else [3, 4])
