"""taps_ops.expand_level: one level of an EAGLE-2 expansion, against the plain-torch reference
(taps_ops.reference.expand_level_ref) on random inputs in every logits dtype, its order on exact ties
(lowest token id, then lowest child index), its outputs checked directly against log_softmax / topk /
the entropy formula, special values (-inf, NaN, huge logits), strided layouts, empty shapes, its input
checks (one case per message, then a seeded fuzz of corrupted calls), torch.compile and opcheck, and
taps.expansion.expand on a fake drafting unit against a pure-torch EAGLE-2 expansion."""

import math

import pytest
import torch

import taps_ops
from taps.expansion import expand, num_candidates
from taps_ops.reference import expand_level_ref

from conftest import assert_compiles_like_eager, cuda_available

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FIELDS = taps_ops.ExpandLevel._fields
FLOAT_FIELDS = ("scores", "entropy", "next_scores")
INF = math.inf
# bf16 / f16 logits are upcast exactly, so every dtype's float outputs agree with the reference's float32
# log_softmax up to the summation order of the log-sum-exp
ATOL, RTOL = 2e-5, 1e-6


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------

def _run(device, logits, front_scores, front_cands, k, next_k=0, cand_offset=0, token_map=None,
         with_entropy=False):
    """taps_ops.expand_level with every tensor on `device`, the outputs back on the CPU."""
    to = (lambda t: None if t is None else t.to(device))
    out = taps_ops.expand_level(to(logits), to(front_scores), to(front_cands), k, next_k, cand_offset,
                                to(token_map), with_entropy=with_entropy)
    assert isinstance(out, taps_ops.ExpandLevel)
    return taps_ops.ExpandLevel(*(t.cpu() for t in out))


def _inputs(rows, front, vocab, dtype=torch.float32, gen=None, scale=3.0):
    """Random logits (scaled so that ties are rare), frontier scores <= 0 and candidate indices with
    some -1 (children of the root)."""
    logits = (torch.randn(rows, front, vocab, generator=gen) * scale).to(dtype)
    front_scores = -torch.rand(rows, front, generator=gen) * 6
    front_cands = torch.randint(-1, 40, (rows, front), generator=gen)
    front_cands[:, ::3] = -1
    return logits, front_scores, front_cands


def _token_map(vocab, gen=None):
    """A reduced draft vocabulary: V distinct target ids, neither sorted nor the identity."""
    return torch.randperm(3 * vocab + 5, generator=gen)[:vocab]


def _check_shapes(out, rows, children, next_k):
    shapes = dict(scores=(rows, children), tokens=(rows, children), parents=(rows, children), entropy=(rows,),
                  next_scores=(rows, next_k), next_tokens=(rows, next_k), next_slots=(rows, next_k),
                  next_cands=(rows, next_k))
    for name in FIELDS:
        t = getattr(out, name)
        assert tuple(t.shape) == shapes[name], name
        assert t.dtype == (torch.float32 if name in FLOAT_FIELDS else torch.int64), name
        assert t.is_contiguous(), name


def _assert_matches(got, want, atol=ATOL, rtol=RTOL):
    """Float fields close (NaN where the reference has NaN), integer fields exactly equal."""
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if name in FLOAT_FIELDS:
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol, equal_nan=True, msg=name)
        else:
            assert torch.equal(g, w), name


def _assert_identical(got, want):
    """Bit-for-bit equal outputs (NaN in the same places)."""
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if name in FLOAT_FIELDS:
            assert torch.equal(g.view(torch.int32), w.view(torch.int32)), name
        else:
            assert torch.equal(g, w), name


def _ordered(values, count):
    """The first `count` indices of `values` (a 1-D tensor) in the op's order: higher value first, equal
    values by the lower index, NaN as -inf (plain Python, independent of torch's sort)."""
    v = [(-INF if math.isnan(x) else x) for x in values.tolist()]
    return sorted(range(len(v)), key=lambda i: (-v[i], i))[:count]


def _entropy_rows(logits):
    """Entropy (nats) of softmax over the last dimension, float64, -inf logits contributing nothing."""
    logp = torch.log_softmax(logits.double(), -1)
    return -(logp.exp() * torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))).sum(-1)


# ---------------------------------------------------------------------------------------------------
# against the reference
# ---------------------------------------------------------------------------------------------------

# (R, F, V, k, next_k): odd sizes; V below, at and across the kernel's 32-wide blocks; k = V; k = 64;
# next_k = 0, < k, = F * k
SHAPES = [
    (1, 1, 1, 1, 1),
    (1, 1, 7, 3, 0),
    (2, 3, 33, 5, 7),
    (3, 5, 100, 7, 11),
    (2, 7, 31, 31, 217),
    (2, 4, 257, 64, 64),
    (1, 2, 64, 64, 128),
    (5, 2, 1000, 10, 20),
    (2, 3, 4099, 9, 27),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(device, dtype, shape):
    rows, front, vocab, k, next_k = shape
    gen = torch.Generator().manual_seed(sum(shape) * 13 + DTYPES.index(dtype))
    logits, front_scores, front_cands = _inputs(rows, front, vocab, dtype, gen)
    tmap = _token_map(vocab, gen)
    for token_map, with_entropy, cand_offset in [(None, False, 0), (tmap, True, 17), (None, True, 3),
                                                 (tmap, False, 0)]:
        args = (logits, front_scores, front_cands, k, next_k, cand_offset, token_map, with_entropy)
        got = _run(device, *args)
        _check_shapes(got, rows, front * k, next_k)
        _assert_matches(got, expand_level_ref(*args))


def test_large_batch_parallel_rows():
    """Enough rows for at::parallel_for to split them over threads: the same as row by row."""
    gen = torch.Generator().manual_seed(1)
    logits, front_scores, front_cands = _inputs(64, 8, 3000, torch.bfloat16, gen)
    args = (logits, front_scores, front_cands, 8, 8, 5, _token_map(3000, gen), True)
    got = _run("cpu", *args)
    _assert_matches(got, expand_level_ref(*args))
    for r in (0, 17, 63):
        one = _run("cpu", logits[r:r + 1], front_scores[r:r + 1], front_cands[r:r + 1], *args[3:])
        _assert_identical(one, taps_ops.ExpandLevel(*(t[r:r + 1] for t in got)))


# ---------------------------------------------------------------------------------------------------
# exact ties: the order's index tie-break
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_exact_ties_match_stable_sort(device, dtype):
    """Logits from three integer values: within a row, equal logits go to the lowest token id; rows are
    drawn from a pool of two, and frontier scores from two values, so equal children of different
    frontier nodes tie exactly and the next frontier takes the lower child index first."""
    gen = torch.Generator().manual_seed(2 + DTYPES.index(dtype))
    rows, front, vocab, k = 4, 6, 45, 6
    pool = torch.randint(0, 3, (2, vocab), generator=gen).float()
    logits = pool[torch.randint(0, 2, (rows, front), generator=gen)].to(dtype)
    front_scores = torch.tensor([0.0, -1.0])[torch.randint(0, 2, (rows, front), generator=gen)]
    front_cands = torch.arange(rows * front).reshape(rows, front)
    for next_k in (0, 5, 13, front * k):
        args = (logits, front_scores, front_cands, k, next_k, 100, _token_map(vocab, gen), True)
        got = _run(device, *args)
        _assert_matches(got, expand_level_ref(*args))
        # the same order, checked without torch's sort
        for r in range(rows):
            order = _ordered(got.scores[r], next_k)
            assert got.next_cands[r].tolist() == [100 + c for c in order]
        ids = _run(device, logits, front_scores, front_cands, k).tokens.view(rows, front, k)
        for r in range(rows):
            for f in range(front):
                assert ids[r, f].tolist() == _ordered(logits[r, f].float(), k)


def test_all_equal_logits(device):
    """A flat row: tokens 0..k-1, each scored front_score - log(V); equal frontier scores give the next
    frontier in child order."""
    rows, front, vocab, k = 2, 3, 50, 4
    logits = torch.full((rows, front, vocab), 1.5)
    front_scores = torch.full((rows, front), -0.25)
    front_cands = torch.arange(rows * front).reshape(rows, front)
    got = _run(device, logits, front_scores, front_cands, k, front * k, 9, with_entropy=True)
    assert torch.equal(got.tokens, torch.arange(k).repeat(rows, front))
    torch.testing.assert_close(got.scores, torch.full((rows, front * k), -0.25 - math.log(vocab)),
                               atol=ATOL, rtol=RTOL)
    assert torch.equal(got.next_cands, 9 + torch.arange(front * k).expand(rows, -1))
    torch.testing.assert_close(got.entropy, torch.full((rows,), front * math.log(vocab)), atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------------------------------
# semantics, checked directly (not through the reference)
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_root_level_is_log_softmax_topk(device, dtype):
    """The root level (F = 1, front_scores 0, front_cands -1): scores are log_softmax at torch.topk's
    ids, best first; parents -1; the next frontier is the children themselves in order."""
    gen = torch.Generator().manual_seed(3)
    rows, vocab, k = 5, 201, 8
    # distinct values, exact in every dtype (integers below 256 over 8): no ties
    perm = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)])
    logits = ((perm - 100) / 8).unsqueeze(1).to(dtype)
    got = _run(device, logits, torch.zeros(rows, 1), torch.full((rows, 1), -1), k, k)
    top = torch.topk(logits.float().squeeze(1), k, dim=-1)
    assert torch.equal(got.tokens, top.indices)
    logp = torch.log_softmax(logits.float().squeeze(1), -1)
    torch.testing.assert_close(got.scores, logp.gather(1, top.indices), atol=ATOL, rtol=RTOL)
    assert torch.equal(got.parents, torch.full((rows, k), -1))
    assert torch.equal(got.next_cands, torch.arange(k).expand(rows, k))
    assert torch.equal(got.next_slots, torch.zeros(rows, k, dtype=torch.int64))
    assert torch.equal(got.next_scores, got.scores) and torch.equal(got.next_tokens, got.tokens)
    assert torch.equal(got.entropy, torch.zeros(rows))  # not asked


@pytest.mark.parametrize("with_map", [False, True])
def test_level_semantics(device, with_map):
    """A deeper level: every child's score is its parent's score plus the log-prob of its token (the
    top k by torch.topk), parents are front_cands repeated k times, the next frontier is the best next_k
    children (by the op's own scores) with slot = child // k and cand = cand_offset + child, gathered
    scores and tokens; the entropy is the rows' -(p log p) summed over the frontier."""
    gen = torch.Generator().manual_seed(4)
    rows, front, vocab, k, next_k, offset = 3, 5, 123, 6, 9, 41
    logits, front_scores, front_cands = _inputs(rows, front, vocab, torch.float32, gen)
    token_map = _token_map(vocab, gen) if with_map else None
    got = _run(device, logits, front_scores, front_cands, k, next_k, offset, token_map, with_entropy=True)

    top = torch.topk(logits, k, dim=-1)                                 # [R, F, k]
    ids = top.indices.reshape(rows, front * k)
    assert torch.equal(got.tokens, token_map[ids] if with_map else ids)
    logp = torch.log_softmax(logits, -1).gather(-1, top.indices)
    torch.testing.assert_close(got.scores, (front_scores.unsqueeze(-1) + logp).reshape(rows, -1),
                               atol=ATOL, rtol=RTOL)
    assert torch.equal(got.parents, front_cands.repeat_interleave(k, dim=1))

    child = got.next_cands - offset
    for r in range(rows):
        assert child[r].tolist() == _ordered(got.scores[r], next_k)
    assert torch.equal(got.next_slots, child // k)
    assert torch.equal(got.next_scores, got.scores.gather(1, child))
    assert torch.equal(got.next_tokens, got.tokens.gather(1, child))
    torch.testing.assert_close(got.entropy, _entropy_rows(logits).sum(-1).float(), atol=ATOL, rtol=RTOL)

    # without with_entropy: the same children, entropy exactly zero
    plain = _run(device, logits, front_scores, front_cands, k, next_k, offset, token_map)
    assert torch.equal(plain.entropy, torch.zeros(rows))
    for name in FIELDS:
        if name != "entropy":
            assert torch.equal(getattr(plain, name), getattr(got, name)), name


# ---------------------------------------------------------------------------------------------------
# special values
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_minus_inf_logits(device, dtype):
    """-inf logits are never chosen while finite ones remain, add nothing to the softmax, and leave
    the entropy finite; past the finite ones, the lowest -inf ids follow with score -inf."""
    gen = torch.Generator().manual_seed(5)
    rows, front, vocab, k = 2, 3, 70, 5
    logits = (torch.randn(rows, front, vocab, generator=gen) * 2).to(dtype)
    logits[0, :, ::2] = -INF                  # half the vocabulary masked
    logits[1, 1, 3:] = -INF                   # only 3 finite logits, k = 5
    front_scores, front_cands = torch.zeros(rows, front), torch.full((rows, front), -1)
    got = _run(device, logits, front_scores, front_cands, k, front * k, 0, with_entropy=True)
    x = logits.float()
    chosen = x.gather(-1, got.tokens.view(rows, front, k))
    assert torch.isfinite(chosen[0]).all() and torch.isfinite(got.scores[0]).all()
    assert (got.tokens[0] % 2 == 1).all()
    assert torch.isfinite(chosen[1, 1, :3]).all()
    assert got.tokens[1, k:k + 5].tolist()[3:] == [3, 4]   # then the lowest ids among the -inf
    assert torch.isinf(got.scores[1, k + 3:k + 5]).all() and (got.scores[1, k + 3:k + 5] < 0).all()
    assert torch.isfinite(got.entropy).all()
    torch.testing.assert_close(got.entropy, _entropy_rows(x).sum(-1).float(), atol=ATOL, rtol=RTOL)
    # the masked logits change nothing: log-probs equal those of the finite logits alone
    finite = x[1, 1, :3]
    torch.testing.assert_close(got.scores[1, k:k + 3], torch.log_softmax(finite, -1).sort(descending=True).values,
                               atol=ATOL, rtol=RTOL)
    # the two -inf children of row (1, 1) rank last in request 1's next frontier
    assert set(got.next_cands[1, -2:].tolist()) == {k + 3, k + 4}
    args = (logits, front_scores, front_cands, k, front * k, 0, None, True)
    _assert_matches(got, expand_level_ref(*args))


def test_row_of_only_minus_inf(device):
    """A row of only -inf: scores -inf, tokens the lowest ids, entropy 0; its request's other rows and
    the other requests as without it."""
    gen = torch.Generator().manual_seed(6)
    rows, front, vocab, k = 2, 3, 40, 4
    logits, front_scores, front_cands = _inputs(rows, front, vocab, torch.float32, gen)
    logits[0, 1] = -INF
    logits[1] = -INF                          # a whole request
    got = _run(device, logits, front_scores, front_cands, k, front * k, 0, with_entropy=True)
    assert torch.equal(got.scores[0, k:2 * k], torch.full((k,), -INF))
    assert torch.equal(got.scores[1], torch.full((front * k,), -INF))
    assert torch.equal(got.tokens[0, k:2 * k], torch.arange(k))
    assert torch.equal(got.tokens[1], torch.arange(k).repeat(front))
    assert got.entropy[1].item() == 0.0
    rows_entropy = _entropy_rows(logits[0, [0, 2]]).sum().item()
    assert got.entropy[0].item() == pytest.approx(rows_entropy, abs=ATOL)
    # the -inf children come last in the next frontier, in child order
    assert got.next_cands[0, -k:].tolist() == list(range(k, 2 * k))
    assert got.next_cands[1].tolist() == list(range(front * k))
    clean = _run(device, logits[0:1, [0, 2]], front_scores[0:1, [0, 2]], front_cands[0:1, [0, 2]], k)
    assert torch.equal(got.scores[0, [*range(k), *range(2 * k, 3 * k)]], clean.scores[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_logit(device, dtype):
    """A NaN logit makes its row's scores and its request's entropy NaN; the row's tokens stay in
    range (NaN ranked as -inf), its children rank last; every other row is bit for bit unaffected."""
    gen = torch.Generator().manual_seed(7)
    rows, front, vocab, k = 3, 3, 65, 5
    clean_logits, front_scores, front_cands = _inputs(rows, front, vocab, dtype, gen)
    logits = clean_logits.clone()
    top = int(logits[1, 2].float().argmax())
    logits[1, 2, top] = math.nan              # the row's maximum becomes NaN
    logits[2, 0, :] = math.nan                # a row of only NaN
    args = (front_scores, front_cands, k, front * k, 0, None, True)
    got, clean = _run(device, logits, *args), _run(device, clean_logits, *args)
    assert torch.isnan(got.scores[1, 2 * k:]).all() and torch.isnan(got.scores[2, :k]).all()
    assert torch.isnan(got.entropy[1:]).all()
    for r, f in [(1, 2), (2, 0)]:
        tok = got.tokens[r, f * k:(f + 1) * k]
        assert ((tok >= 0) & (tok < vocab)).all() and len(set(tok.tolist())) == k
    assert top not in got.tokens[1, 2 * k:].tolist()
    assert torch.equal(got.tokens[1, 2 * k:], torch.tensor(_ordered(logits[1, 2].float(), k)))
    assert torch.equal(got.tokens[2, :k], torch.arange(k))
    # NaN children last in the next frontier
    assert got.next_cands[1, -k:].tolist() == list(range(2 * k, 3 * k))
    assert got.next_cands[2, -k:].tolist() == list(range(k))
    # the rest unaffected
    _assert_identical(taps_ops.ExpandLevel(*(t[0:1] for t in got)), taps_ops.ExpandLevel(*(t[0:1] for t in clean)))
    for name in ("scores", "tokens", "parents"):
        assert torch.equal(getattr(got, name)[1, :2 * k], getattr(clean, name)[1, :2 * k]), name
        assert torch.equal(getattr(got, name)[2, k:], getattr(clean, name)[2, k:]), name
    _assert_matches(got, expand_level_ref(logits, *args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_huge_logits_stay_finite(device, dtype):
    """+-1e30 logits (representable in float32 and bfloat16): no overflow to NaN where log_softmax is
    finite, the same values as torch's log_softmax."""
    gen = torch.Generator().manual_seed(8)
    rows, front, vocab, k = 3, 2, 90, 6
    logits = torch.randn(rows, front, vocab, generator=gen)
    logits[0, 0, 10], logits[0, 0, 20] = 1e30, -1e30      # one dominant token, one hopeless one
    logits[0, 1] = torch.randn(vocab, generator=gen) * 1e30  # every logit huge, differences huge
    logits[1, :, :45] = -1e30                             # a -1e30 half
    logits[2, 1] = 1e30 + torch.zeros(vocab)              # all equal and huge
    logits = logits.to(dtype)
    front_scores, front_cands = torch.zeros(rows, front), torch.full((rows, front), -1)
    got = _run(device, logits, front_scores, front_cands, k, k, 0, with_entropy=True)
    for name in FLOAT_FIELDS:
        assert not torch.isnan(getattr(got, name)).any(), name
    assert torch.isfinite(got.entropy).all()
    assert got.tokens[0, 0].item() == 10 and got.scores[0, 0].item() == 0.0
    want = torch.log_softmax(logits.float(), -1).gather(-1, got.tokens.view(rows, front, k)).reshape(rows, -1)
    torch.testing.assert_close(got.scores, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got.entropy, _entropy_rows(logits.float()).sum(-1).float(), atol=ATOL, rtol=RTOL)
    _assert_matches(got, expand_level_ref(logits, front_scores, front_cands, k, k, 0, None, True))


def test_special_front_scores(device):
    """A frontier node scored -inf or NaN passes it to all its children; the next frontier ranks them
    last (NaN as -inf, then by child index), the other nodes' children unaffected."""
    gen = torch.Generator().manual_seed(15)
    rows, front, vocab, k = 2, 4, 30, 3
    logits, front_scores, front_cands = _inputs(rows, front, vocab, torch.float32, gen)
    front_scores[0, 1] = -INF
    front_scores[0, 2] = math.nan
    front_scores[1, 0] = math.nan
    got = _run(device, logits, front_scores, front_cands, k, front * k, 0)
    assert torch.equal(got.scores[0, k:2 * k], torch.full((k,), -INF))
    assert torch.isnan(got.scores[0, 2 * k:3 * k]).all() and torch.isnan(got.scores[1, :k]).all()
    assert got.next_cands[0, -2 * k:].tolist() == list(range(k, 3 * k))
    assert got.next_cands[1, -k:].tolist() == list(range(k))
    for r in range(rows):
        assert got.next_cands[r].tolist() == _ordered(got.scores[r], front * k)
    _assert_matches(got, expand_level_ref(logits, front_scores, front_cands, k, front * k))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plus_inf_logit(device, dtype):
    """A +inf logit (e.g. a float16 drafter's overflow): torch's formula (x - max) - log(sum(exp(x - max)))
    is NaN for the whole row, so the row's scores and its request's entropy are NaN (as torch.log_softmax
    and the reference give); +inf ranks first among the row's tokens, which stay in range; its children
    rank last in the next frontier; the other rows are bit for bit unaffected."""
    gen = torch.Generator().manual_seed(16)
    rows, front, vocab, k = 2, 3, 40, 4
    clean_logits, front_scores, front_cands = _inputs(rows, front, vocab, dtype, gen)
    logits = clean_logits.clone()
    logits[0, 1, 7] = INF
    logits[0, 1, 30] = INF                    # two of them: the lower id first
    logits[0, 1, 2] = -INF
    if dtype == torch.float16:
        logits[1, 2, 5] = 70000.0             # overflows float16 to +inf
    else:
        logits[1, 2, 5] = INF
    args = (front_scores, front_cands, k, front * k, 0, None, True)
    got, clean = _run(device, logits, *args), _run(device, clean_logits, *args)
    assert torch.isnan(torch.log_softmax(logits.float(), -1)[0, 1]).all()
    assert torch.isnan(got.scores[0, k:2 * k]).all() and torch.isnan(got.scores[1, 2 * k:]).all()
    assert torch.isnan(got.entropy).all()
    assert got.tokens[0, k:k + 2].tolist() == [7, 30] and got.tokens[1, 2 * k].item() == 5
    assert torch.equal(got.tokens[0, k:2 * k], torch.tensor(_ordered(logits[0, 1].float(), k)))
    assert got.next_cands[0, -k:].tolist() == list(range(k, 2 * k))
    assert got.next_cands[1, -k:].tolist() == list(range(2 * k, 3 * k))
    for name in ("scores", "tokens", "parents"):
        for r, keep in [(0, [*range(k), *range(2 * k, 3 * k)]), (1, list(range(2 * k)))]:
            assert torch.equal(getattr(got, name)[r, keep], getattr(clean, name)[r, keep]), name
    _assert_matches(got, expand_level_ref(logits, *args))


# ---------------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_layouts(device, dtype):
    """Transposed, sliced, strided and expanded logits give the contiguous copy's outputs, bit for bit."""
    gen = torch.Generator().manual_seed(9)
    rows, front, vocab = 3, 4, 77
    big = torch.randn(front + 2, rows + 1, vocab + 9, generator=gen).to(dtype)
    one_row = torch.randn(1, 1, vocab, generator=gen).to(dtype)
    views = [
        big[:front, :rows, :vocab].transpose(0, 1),           # [R, F, V] from an [F, R, V] buffer
        big[1:1 + rows, :front, 4:4 + vocab],                 # rows further apart than V (a sliced vocab)
        torch.randn(vocab, front, rows, generator=gen).to(dtype).permute(2, 1, 0),  # vocabulary not contiguous
        torch.randn(rows, front, 2 * vocab, generator=gen).to(dtype)[..., ::2],  # strided vocabulary
        one_row.expand(rows, 1, vocab),                       # stride 0 over the requests
        one_row.expand(rows, front, vocab),                   # stride 0 over requests and frontier
        big[:rows, :front, :1].expand(rows, front, vocab),    # stride 0 over the vocabulary (all ties)
    ]
    for i, logits in enumerate(views):
        r, f, _ = logits.shape
        assert not logits.is_contiguous(), i
        front_scores = -torch.rand(r, f, generator=gen)
        front_cands = torch.randint(-1, 9, (r, f), generator=gen)
        token_map = _token_map(vocab, gen)
        next_k = min(7, f * 5)
        args = (front_scores, front_cands, 5, next_k, 2, token_map, True)
        _assert_identical(_run(device, logits, *args), _run(device, logits.contiguous(), *args))
        # non-contiguous front_scores / front_cands too
        fs = torch.randn(f, r, generator=gen).t()
        fc = torch.randint(-1, 9, (f, r), generator=gen).t()
        args = (fs, fc, 5, next_k, 2, token_map, True)
        _assert_identical(_run(device, logits, *args), _run(device, logits.contiguous(), fs.contiguous(),
                                                            fc.contiguous(), *args[2:]))


# ---------------------------------------------------------------------------------------------------
# empty shapes
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(0, 3, 10, 2, 4), (0, 0, 10, 2, 0), (3, 0, 10, 2, 0), (0, 1, 1, 1, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_empty(device, shape):
    rows, front, vocab, k, next_k = shape
    logits, front_scores, front_cands = _inputs(rows, front, vocab)
    for with_entropy in (False, True):
        got = _run(device, logits, front_scores, front_cands, k, next_k, 5, _token_map(vocab), with_entropy)
        _check_shapes(got, rows, front * k, next_k)
        assert torch.equal(got.entropy, torch.zeros(rows))  # no rows: an empty sum


# ---------------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------------

def _valid_args():
    gen = torch.Generator().manual_seed(10)
    logits, front_scores, front_cands = _inputs(2, 3, 20, torch.float32, gen)
    return [logits, front_scores, front_cands, 4, 6, 0, _token_map(20, gen), False]


def _with(i, value):
    args = _valid_args()
    args[i] = value
    return args


def _bad_cases():
    logits, front_scores, front_cands, *_ = _valid_args()
    return [
        ("logits_2d", _with(0, logits[0]), r"logits must be \[R, F, V\]"),
        ("logits_4d", _with(0, logits.unsqueeze(0)), r"logits must be \[R, F, V\]"),
        ("logits_int", _with(0, logits.long()), "float32, bfloat16 or float16"),
        ("logits_f64", _with(0, logits.double()), "float32, bfloat16 or float16"),
        ("logits_empty_vocab", _with(0, logits[..., :0]), r"at least one token \(V >= 1\)"),
        ("front_scores_f64", _with(1, front_scores.double()), "front_scores must have dtype Float"),
        ("front_scores_bf16", _with(1, front_scores.bfloat16()), "front_scores must have dtype Float"),
        ("front_scores_1d", _with(1, front_scores[0]), "front_scores must have 2 dimensions"),
        ("front_scores_rows", _with(1, front_scores[:1]), r"front_scores must be \[R, F\] = \[2, 3\]"),
        ("front_scores_front", _with(1, torch.zeros(2, 4)), r"front_scores must be \[R, F\] = \[2, 3\]"),
        ("front_cands_int32", _with(2, front_cands.int()), "front_cands must have dtype Long"),
        ("front_cands_float", _with(2, front_cands.float()), "front_cands must have dtype Long"),
        ("front_cands_3d", _with(2, front_cands.unsqueeze(-1)), "front_cands must have 2 dimensions"),
        ("front_cands_shape", _with(2, front_cands[:, :2]), r"front_cands must be \[R, F\] = \[2, 3\]"),
        ("k_zero", _with(3, 0), r"k must be in \[1, min\(V, 64\)\] \(V = 20\), got 0"),
        ("k_negative", _with(3, -2), r"k must be in \[1, min\(V, 64\)\]"),
        ("k_above_vocab", _with(3, 21), r"k must be in \[1, min\(V, 64\)\] \(V = 20\), got 21"),
        ("k_above_64", _with(0, torch.randn(2, 3, 100))[:3] + [65, 6, 0, None, False],
         r"k must be in \[1, min\(V, 64\)\] \(V = 100\), got 65"),
        ("next_k_negative", _with(4, -1), r"next_k must be in \[0, F \* k\] = \[0, 12\], got -1"),
        ("next_k_above", _with(4, 13), r"next_k must be in \[0, F \* k\] = \[0, 12\], got 13"),
        ("cand_offset_negative", _with(5, -1), "cand_offset must be >= 0, got -1"),
        ("token_map_int32", _with(6, torch.arange(20, dtype=torch.int32)), "token_map must have dtype Long"),
        ("token_map_float", _with(6, torch.arange(20.0)), "token_map must have dtype Long"),
        ("token_map_short", _with(6, torch.arange(19)), "token_map must have V = 20 entries"),
        ("token_map_long", _with(6, torch.arange(21)), "token_map must have V = 20 entries"),
        ("token_map_2d", _with(6, torch.arange(20).view(1, 20)), "token_map must have 1 dimensions"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs_raise(device, case):
    _, args, message = case
    with pytest.raises(ValueError, match=message):
        _run(device, *args)


@pytest.mark.skipif(not cuda_available(), reason="no GPU")
def test_device_mismatch_raises():
    logits, front_scores, front_cands, k, next_k, offset, token_map, _ = _valid_args()
    cases = [
        (logits.cuda(), front_scores, front_cands.cuda(), token_map.cuda(), "front_scores is on cpu"),
        (logits.cuda(), front_scores.cuda(), front_cands, token_map.cuda(), "front_cands is on cpu"),
        (logits.cuda(), front_scores.cuda(), front_cands.cuda(), token_map, "token_map is on cpu"),
        (logits, front_scores.cuda(), front_cands.cuda(), token_map.cuda(), "on one device"),
    ]
    for lg, fs, fc, tm, message in cases:
        with pytest.raises(ValueError, match=message):
            taps_ops.expand_level(lg, fs, fc, k, next_k, offset, tm)
            torch.cuda.synchronize()


def test_fuzz_validation():
    """Seeded fuzz: a random valid call (random sizes, empty ones included) matches the reference; the
    same call with one argument corrupted (dtype, rank, size, k, next_k, cand_offset, token_map) raises
    a ValueError naming the op: never a crash, never a silent result."""
    gen = torch.Generator().manual_seed(11)

    def pick(n):
        return int(torch.randint(0, n, (), generator=gen))

    kinds = ["logits_dtype", "logits_rank", "logits_vocab", "scores_dtype", "scores_shape", "cands_dtype",
             "cands_shape", "k_low", "k_high", "next_k_low", "next_k_high", "offset", "map_dtype", "map_shape"]
    seen = set()
    for case in range(200):
        rows, front, vocab = pick(4), pick(4), 1 + pick(70)
        k = 1 + pick(min(vocab, 64))
        next_k = pick(front * k + 1)
        dtype = DTYPES[pick(3)]
        logits, front_scores, front_cands = _inputs(rows, front, vocab, dtype, gen)
        token_map = _token_map(vocab, gen) if pick(2) else None
        args = [logits, front_scores, front_cands, k, next_k, pick(50), token_map, bool(pick(2))]
        _assert_matches(_run("cpu", *args), expand_level_ref(*args))

        kind = kinds[case % len(kinds)]
        seen.add(kind)
        if kind == "logits_dtype":
            args[0] = logits.to([torch.float64, torch.int64, torch.int32, torch.bool][pick(4)])
        elif kind == "logits_rank":
            args[0] = [logits.reshape(rows * front, vocab), logits.unsqueeze(pick(4)), logits.reshape(-1)][pick(3)]
        elif kind == "logits_vocab":
            args[0] = logits[..., :0]
        elif kind == "scores_dtype":
            args[1] = front_scores.to([torch.float64, torch.bfloat16, torch.float16, torch.int64][pick(4)])
        elif kind == "scores_shape":
            args[1] = [torch.zeros(rows + 1 + pick(2), front), torch.zeros(rows, front + 1 + pick(2)),
                       front_scores.reshape(-1), front_scores.unsqueeze(0)][pick(4)]
        elif kind == "cands_dtype":
            args[2] = front_cands.to([torch.int32, torch.float32, torch.float64, torch.bool, torch.uint8][pick(5)])
        elif kind == "cands_shape":
            args[2] = [torch.zeros(rows, front + 1, dtype=torch.int64), front_cands.reshape(-1),
                       torch.zeros(rows + 2, front, dtype=torch.int64), front_cands.unsqueeze(-1)][pick(4)]
        elif kind == "k_low":
            args[3] = -pick(3)
        elif kind == "k_high":
            args[3] = max(vocab, 64) + 1 + pick(5) if pick(2) else vocab + 1
        elif kind == "next_k_low":
            args[4] = -1 - pick(5)
        elif kind == "next_k_high":
            args[4] = front * k + 1 + pick(5)
        elif kind == "offset":
            args[5] = -1 - pick(100)
        elif kind == "map_dtype":
            args[6] = torch.arange(vocab).to([torch.int32, torch.float32, torch.int16, torch.uint8][pick(4)])
        elif kind == "map_shape":
            args[6] = [torch.arange(vocab + 1), torch.arange(vocab - 1), torch.arange(vocab).view(1, -1),
                       torch.zeros((), dtype=torch.int64)][pick(4)]
        with pytest.raises(ValueError) as err:
            taps_ops.expand_level(*args[:7], with_entropy=args[7])
        assert str(err.value).startswith("taps_ops: expand_level:"), (kind, str(err.value))
    assert seen == set(kinds)


# ---------------------------------------------------------------------------------------------------
# torch.compile, opcheck, CUDA against the CPU
# ---------------------------------------------------------------------------------------------------

def test_compiles():
    """Two levels of an expansion (the root, then its frontier) in one fullgraph-compiled function."""
    gen = torch.Generator().manual_seed(12)
    rows, vocab, k = 3, 50, 4
    root = torch.randn(rows, vocab, generator=gen).bfloat16()
    level = torch.randn(rows, k, vocab, generator=gen)
    token_map = _token_map(vocab, gen)

    def two_levels(root, level, token_map):
        a = taps_ops.expand_level(root.unsqueeze(1), torch.zeros(rows, 1), torch.full((rows, 1), -1), k, k, 0,
                                  token_map, with_entropy=True)
        b = taps_ops.expand_level(level, a.next_scores, a.next_cands, k, k, k, None)
        return tuple(a) + tuple(b)

    assert_compiles_like_eager(two_levels, root, level, token_map)


def test_opcheck(device):
    gen = torch.Generator().manual_seed(13)
    logits, front_scores, front_cands = _inputs(2, 3, 40, torch.float32, gen)
    to = (lambda t: None if t is None else t.to(device))
    for lg, k, next_k, offset, token_map, with_entropy in [
            (logits, 4, 6, 0, None, False),
            (logits.bfloat16(), 5, 15, 7, _token_map(40, gen), True),
            (logits[:, :, ::2].half(), 1, 0, 3, None, True)]:
        args = (to(lg), to(front_scores), to(front_cands), k, next_k, offset, to(token_map), with_entropy)
        torch.library.opcheck(torch.ops.taps_ops.expand_level.default, args)


@pytest.mark.skipif(not (cuda_available() and taps_ops.has_cuda_kernels()), reason="no GPU or no CUDA kernels")
def test_cuda_matches_cpu():
    """The same selection on both backends (integer outputs equal); floats within the last bits of the
    device's log."""
    gen = torch.Generator().manual_seed(14)
    for dtype in DTYPES:
        for rows, front, vocab, k, next_k in [(4, 1, 32000, 10, 10), (7, 8, 1000, 8, 8), (2, 3, 65, 64, 100)]:
            logits, front_scores, front_cands = _inputs(rows, front, vocab, dtype, gen)
            logits[0, 0, 3] = math.nan
            logits[-1, -1] = -INF
            args = (front_scores, front_cands, k, next_k, 11, _token_map(vocab, gen), True)
            _assert_matches(_run("cuda", logits, *args), _run("cpu", logits, *args), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------
# taps.expansion.expand on a fake drafting unit
# ---------------------------------------------------------------------------------------------------

class FakeUnit:
    """A drafting unit (taps.expansion's interface) whose logits are a seeded function of what the
    expansion feeds it: each frontier node's token, its parent's frontier slot, the level and its
    position in the frontier. It records every forward_nodes call."""

    def __init__(self, rows, vocab, depth, top_k, token_map=None, seed=0, dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        k = min(top_k, vocab)
        target_vocab = int(token_map.max()) + 1 if token_map is not None else vocab
        self.root_logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
        self.lengths = torch.randint(3, 9, (rows,), generator=gen)
        self.scratch_start = int(self.lengths.max()) + 2
        self.token_map = token_map
        self.dtype = dtype
        self.token_logits = torch.randn(target_vocab, vocab, generator=gen) * 2
        self.slot_logits = torch.randn(depth, k + 1, vocab, generator=gen)
        self.node_logits = torch.randn(depth, rows, k, vocab, generator=gen)
        self.calls = []

    def logits_for(self, tokens, parent_slot, level):
        """[R, K, V'] logits of frontier nodes with these (target) tokens and parent slots."""
        x = self.token_logits[tokens] + self.slot_logits[level][parent_slot + 1] + self.node_logits[level]
        return x.to(self.dtype)

    def forward_nodes(self, tokens, parent_slot, write_start, rope_pos, mask, level):
        self.calls.append(dict(tokens=tokens.clone(), parent_slot=parent_slot.clone(), write_start=write_start,
                               rope_pos=rope_pos.clone(), mask=mask.clone(), level=level))
        return self.logits_for(tokens, parent_slot, level)


def _topk_without_ties(x, k):
    """torch.topk over the last dimension, asserting that no tie decides the selection or its order
    (the test's inputs are meant to have none; torch.topk leaves the order of ties open)."""
    top = torch.topk(x, min(k + 1, x.shape[-1]), dim=-1)
    assert (top.values[..., :-1] > top.values[..., 1:]).all(), "a tie among the top values: change the seed"
    return torch.return_types.topk((top.values[..., :k], top.indices[..., :k]))


def _entropy_sum(logits):
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


def eagle2_reference(unit, depth, top_k, with_entropy):
    """EAGLE-2 expansion in plain torch (no taps_ops): the root's top-k children by log-softmax, then per
    level every frontier node's top-k children with cumulative scores, the best k of the K * K as the
    next frontier. Returns the candidates and the forward_nodes calls it expects (tokens, parent slots,
    scratch column, rotary positions and the attention mask built from the frontier's ancestry)."""
    rows, vocab = unit.root_logits.shape
    k = min(top_k, vocab)
    tmap = (lambda ids: unit.token_map[ids] if unit.token_map is not None else ids)
    logp = torch.log_softmax(unit.root_logits.float(), -1)
    top = _topk_without_ties(logp, k)
    scores, tokens, parents = [top.values], [tmap(top.indices)], [torch.full((rows, k), -1)]
    entropy = _entropy_sum(unit.root_logits)
    # the frontier: k nodes per row (its scores, target tokens, candidate indices, parents' slots)
    f_scores, f_tokens, f_cands = top.values, tmap(top.indices), torch.arange(k).expand(rows, k)
    f_parent_slot = torch.full((rows, k), -1)
    ancestry = []                     # per level, each frontier node's ancestor slot at that level
    offset, calls = k, []
    start = unit.scratch_start
    for level in range(1, depth):
        ancestry = [a.gather(1, f_parent_slot) for a in ancestry] + [torch.arange(k).expand(rows, k)]
        mask = torch.zeros(rows, 1, k, start + level * k, dtype=torch.bool)
        mask[:, 0, :, :start] = (torch.arange(start) < unit.lengths.unsqueeze(1)).unsqueeze(1)
        for lv, slots in enumerate(ancestry):
            cols = start + lv * k + slots                                 # [R, K]
            mask[:, 0].scatter_(-1, cols.unsqueeze(-1), True)
        calls.append(dict(tokens=f_tokens, parent_slot=f_parent_slot, write_start=start + (level - 1) * k,
                          rope_pos=unit.lengths.unsqueeze(1).expand(rows, k) + (level - 1), mask=mask, level=level))
        logits = unit.logits_for(f_tokens, f_parent_slot, level)          # [R, K, V']
        entropy = entropy + _entropy_sum(logits).sum(-1)
        lp = torch.log_softmax(logits.float(), -1)
        top = _topk_without_ties(lp, k)                                   # [R, K, k]
        cum = (f_scores.unsqueeze(-1) + top.values).reshape(rows, k * k)
        tok = tmap(top.indices).reshape(rows, k * k)
        scores.append(cum)
        tokens.append(tok)
        parents.append(f_cands.unsqueeze(-1).expand(rows, k, k).reshape(rows, k * k))
        best = _topk_without_ties(cum, k).indices                         # the next frontier
        f_scores, f_tokens, f_cands = cum.gather(1, best), tok.gather(1, best), offset + best
        f_parent_slot = best // k
        offset += k * k
    count = 1 + (depth - 1) * k
    entropy = entropy / count if with_entropy else torch.zeros(rows)
    return torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1), entropy, calls


@pytest.mark.parametrize("depth,top_k,vocab,with_map,with_entropy,dtype", [
    (1, 4, 30, False, True, torch.float32),
    (2, 3, 40, True, True, torch.float32),
    (4, 5, 67, False, True, torch.float32),
    (5, 4, 50, True, False, torch.float32),
    (3, 8, 6, True, True, torch.float32),       # top_k clamped to the draft vocabulary
    (4, 3, 80, True, True, torch.bfloat16),
])
def test_expansion_matches_torch_eagle2(depth, top_k, vocab, with_map, with_entropy, dtype):
    rows = 3
    gen = torch.Generator().manual_seed(depth * 100 + top_k)
    token_map = _token_map(vocab, gen) if with_map else None
    unit = FakeUnit(rows, vocab, depth, top_k, token_map, seed=depth + vocab, dtype=dtype)
    got = expand(unit, depth, top_k, with_entropy=with_entropy)
    scores, tokens, parents, entropy, calls = eagle2_reference(unit, depth, top_k, with_entropy)
    k = min(top_k, vocab)
    assert got.scores.shape == (rows, num_candidates(depth, k))
    torch.testing.assert_close(got.scores, scores, atol=ATOL, rtol=RTOL)
    assert torch.equal(got.tokens, tokens)
    assert torch.equal(got.parents, parents)
    torch.testing.assert_close(got.entropy, entropy, atol=ATOL, rtol=RTOL)
    assert len(unit.calls) == len(calls) == depth - 1
    for have, want in zip(unit.calls, calls):
        for key in want:
            if isinstance(want[key], torch.Tensor):
                assert torch.equal(have[key], want[key]), (want["level"], key)
            else:
                assert have[key] == want[key], (want["level"], key)
