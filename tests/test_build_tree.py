"""Tests of taps_ops.build_tree against docs/SEMANTICS.md and taps_ops.reference.build_tree_ref."""

import math

import pytest
import torch
from hypothesis import strategies as st

import taps_ops
from taps_ops.reference import build_tree_ref

from conftest import (assert_compiles_like_eager, assert_literal_tree as _assert_tree, check_tree_invariants,
                      cuda_available, fuzz_against_reference, tree_lists as _lists)

BAD_INPUT = (RuntimeError, ValueError, TypeError, IndexError)
NEG_INF = float("-inf")


def _build(device, scores, tokens, parents, num_nodes, root_tokens=None):
    to = (lambda t: None if t is None else t.to(device))
    return taps_ops.build_tree(to(scores), to(tokens), to(parents), num_nodes, to(root_tokens))


def _t(values, dtype=torch.int64):
    return torch.tensor([values], dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# literal cases
# ---------------------------------------------------------------------------------------------------

def test_literal_top_by_score(device):
    # c0 (tok 1) and c1 (tok 2) are children of the root; c2 (3) and c3 (4) of c0; c4 (5) of c2;
    # c5 is a padding candidate. The best 4: c0, c2, then c3 and c4 tied at -0.3 (c3 is shallower).
    scores = _t([-0.1, -0.5, -0.2, -0.3, -0.3, -5.0], torch.float32)
    tokens, parents = _t([1, 2, 3, 4, 5, -1]), _t([-1, -1, 0, 0, 2, -1])
    tree = _build(device, scores, tokens, parents, 5, torch.tensor([7]))
    _assert_tree(tree, [7, 1, 3, 4, 5], [-1, 0, 1, 1, 2], [0, 1, 2, 2, 3], [1, 3, 7, 11, 23],
                 [0, -0.1, -0.2, -0.3, -0.3], [-1, 0, 2, 3, 4])
    check_tree_invariants(tree)


def test_literal_ties_shallower_then_earlier(device):
    # all scores equal: the ranking is by depth, then candidate index; c1 (depth 2) loses.
    scores = _t([-1.0, -1.0, -1.0, -1.0], torch.float32)
    tokens, parents = _t([10, 11, 12, 13]), _t([-1, 0, -1, -1])
    tree = _build(device, scores, tokens, parents, 3)
    _assert_tree(tree, [-1, 10, 12], [-1, 0, 0], [0, 1, 1], [1, 3, 5], [0, -1, -1], [-1, 0, 2])
    tree = _build(device, scores, tokens, parents, 5)
    # siblings with equal scores by candidate index; c1 (child of c0) comes after depth 1.
    _assert_tree(tree, [-1, 10, 12, 13, 11], [-1, 0, 0, 0, 1], [0, 1, 1, 1, 2], [1, 3, 5, 9, 19],
                 [0, -1, -1, -1, -1], [-1, 0, 2, 3, 1])


def test_literal_siblings_sorted_by_score(device):
    # root children in candidate order with scores -3, -1, -2: output order by score.
    scores = _t([-3.0, -1.0, -2.0, -1.5], torch.float32)
    tokens, parents = _t([4, 5, 6, 7]), _t([-1, -1, -1, 1])
    tree = _build(device, scores, tokens, parents, 5, torch.tensor([0]))
    _assert_tree(tree, [0, 5, 6, 4, 7], [-1, 0, 0, 0, 1], [0, 1, 1, 1, 2], [1, 3, 5, 9, 19],
                 [0, -1, -2, -3, -1.5], [-1, 1, 2, 0, 3])


def test_literal_non_monotone_scores(device):
    # c1 (child of c0) scores better than its parent: its effective score is its parent's (-2), so
    # c2 (-1) ranks first; the stored score stays its own.
    scores = _t([-2.0, -0.1, -1.0], torch.float32)
    tokens, parents = _t([1, 2, 3]), _t([-1, 0, -1])
    tree = _build(device, scores, tokens, parents, 3, torch.tensor([9]))
    _assert_tree(tree, [9, 3, 1], [-1, 0, 0], [0, 1, 1], [1, 3, 5], [0, -1, -2], [-1, 2, 0])
    tree = _build(device, scores, tokens, parents, 4, torch.tensor([9]))
    _assert_tree(tree, [9, 3, 1, 2], [-1, 0, 0, 2], [0, 1, 1, 2], [1, 3, 5, 13], [0, -1, -2, -0.1], [-1, 2, 0, 1])
    check_tree_invariants(tree)


def test_literal_padding_and_num_nodes_larger(device):
    # padding candidates interleaved; 3 real candidates, 6 nodes requested: 2 padding rows.
    scores = _t([-0.5, 0.0, -0.7, 3.0, -0.2], torch.float32)
    tokens, parents = _t([8, -1, 9, -1, 4]), _t([-1, -1, 0, -1, 0])
    tree = _build(device, scores, tokens, parents, 6, torch.tensor([1]))
    _assert_tree(tree, [1, 8, 4, 9, -1, -1], [-1, 0, 1, 1, -1, -1], [0, 1, 2, 2, -1, -1], [1, 3, 7, 11, 0, 0],
                 [0, -0.5, -0.2, -0.7, NEG_INF, NEG_INF], [-1, 0, 4, 2, -1, -1])
    check_tree_invariants(tree)


def test_literal_num_nodes_one_and_no_candidates(device):
    scores = _t([-0.5, -0.1], torch.float32)
    tree = _build(device, scores, _t([3, 4]), _t([-1, 0]), 1, torch.tensor([5]))
    _assert_tree(tree, [5], [-1], [0], [1], [0], [-1])
    tree = _build(device, torch.zeros(1, 0), torch.zeros(1, 0, dtype=torch.int64),
                  torch.zeros(1, 0, dtype=torch.int64), 3)
    _assert_tree(tree, [-1, -1, -1], [-1, -1, -1], [0, -1, -1], [1, 0, 0], [0, NEG_INF, NEG_INF], [-1, -1, -1])


def test_literal_batch(device):
    scores = torch.tensor([[-0.1, -0.2, -0.3], [-0.3, -0.2, -0.1]])
    tokens = torch.tensor([[1, 2, 3], [4, 5, -1]])
    parents = torch.tensor([[-1, 0, 1], [-1, -1, -1]])
    tree = _build(device, scores, tokens, parents, 3, torch.tensor([7, 8]))
    got = _lists(tree)
    assert got[0] == [[7, 1, 2], [8, 5, 4]]
    assert got[1] == [[-1, 0, 1], [-1, 0, 0]]
    assert got[2] == [[0, 1, 2], [0, 1, 1]]
    assert got[3] == [[[1], [3], [7]], [[1], [3], [5]]]
    assert got[5] == [[-1, 0, 1], [-1, 1, 0]]


def test_empty_batch(device):
    tree = _build(device, torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.int64),
                  torch.zeros(0, 4, dtype=torch.int64), 70)
    assert [tuple(t.shape) for t in tree] == [(0, 70), (0, 70), (0, 70), (0, 70, 2), (0, 70), (0, 70)]


def _mask_row(bits, words=3):
    row = []
    for w in range(words):
        word = sum(1 << (j - 64 * w) for j in bits if 64 * w <= j < 64 * (w + 1))
        row.append(word - (1 << 64) if word >= (1 << 63) else word)
    return row


@pytest.mark.parametrize("shape", ["chain", "star"])
def test_multi_word_masks(device, shape):
    m = 129  # 130 nodes: 3 mask words, the last with two bits
    scores = -torch.arange(m, dtype=torch.float32)[None] * 0.01
    tokens = torch.arange(m)[None] + 100
    parents = (torch.arange(m) - 1)[None] if shape == "chain" else torch.full((1, m), -1)
    tree = _build(device, scores, tokens, parents, 130)
    check_tree_invariants(tree)
    mask = tree.tree_mask.cpu()[0]
    assert tuple(mask.shape) == (130, 3)
    for i in [0, 1, 63, 64, 65, 127, 128, 129]:
        bits = list(range(i + 1)) if shape == "chain" else sorted({0, i})
        assert mask[i].tolist() == _mask_row(bits), f"row {i}"
    assert tree.candidate_index.cpu()[0].tolist() == [-1] + list(range(m))


# ---------------------------------------------------------------------------------------------------
# random candidates vs the reference
# ---------------------------------------------------------------------------------------------------

def random_candidates(batch, m, gen, monotone=True, ties=False, padding=0.1):
    """EAGLE-2 like candidates: parents -1 or earlier real candidates; cumulative log-prob scores
    (monotone) or arbitrary scores; optional quantised scores (many ties) and padding candidates."""
    tokens = torch.randint(0, 50, (batch, m), generator=gen)
    parents = torch.full((batch, m), -1, dtype=torch.int64)
    scores = torch.zeros(batch, m)
    for b in range(batch):
        real = []
        for c in range(m):
            if float(torch.rand(1, generator=gen)) < padding:
                tokens[b, c] = -1
                parents[b, c] = int(torch.randint(-1, m, (1,), generator=gen))  # ignored for padding
                scores[b, c] = float(torch.randn(1, generator=gen))
                continue
            if real and float(torch.rand(1, generator=gen)) < 0.75:
                parents[b, c] = real[int(torch.randint(max(0, len(real) - 8), len(real), (1,), generator=gen))]
            step = float(torch.rand(1, generator=gen)) * 2
            if monotone:
                base = 0.0 if parents[b, c] < 0 else float(scores[b, parents[b, c]])
                scores[b, c] = base - step
            else:
                scores[b, c] = -step * 3
            if ties:
                scores[b, c] = round(float(scores[b, c]) * 2) / 2
            real.append(c)
    return scores, tokens, parents


@pytest.mark.parametrize("monotone,ties", [(True, False), (True, True), (False, False), (False, True)])
@pytest.mark.parametrize("batch,m,num_nodes", [(1, 1, 1), (3, 10, 4), (5, 60, 26), (2, 200, 130), (7, 37, 64), (4, 8, 20)])
def test_random_vs_reference(device, monotone, ties, batch, m, num_nodes):
    gen = torch.Generator().manual_seed(batch * 1000 + m * 7 + num_nodes + 2 * monotone + ties)
    scores, tokens, parents = random_candidates(batch, m, gen, monotone, ties)
    root_tokens = torch.randint(0, 50, (batch,), generator=gen)
    tree = _build(device, scores, tokens, parents, num_nodes, root_tokens)
    check_tree_invariants(tree)
    expected = build_tree_ref(scores, tokens, parents, num_nodes, root_tokens)
    for name, got, want in zip(taps_ops.Tree._fields, tree, expected):
        assert torch.equal(got.cpu(), want), f"{name} differs from the reference"
    # the kept candidates are exactly the nodes' candidate indices, each at most once
    kept = tree.candidate_index.cpu()
    for b in range(batch):
        idx = kept[b][kept[b] >= 0]
        assert idx.unique().numel() == idx.numel()
        assert (tokens[b, idx] == tree.tokens.cpu()[b, 1:1 + idx.numel()]).all()


@pytest.mark.skipif(not cuda_available(), reason="no GPU")
def test_cpu_cuda_agree():
    gen = torch.Generator().manual_seed(5)
    scores, tokens, parents = random_candidates(16, 300, gen, monotone=False, ties=True)
    for num_nodes in [1, 60, 200, 400]:
        cpu = _build("cpu", scores, tokens, parents, num_nodes)
        cuda = _build("cuda", scores, tokens, parents, num_nodes)
        for name, a, b in zip(taps_ops.Tree._fields, cpu, cuda):
            assert torch.equal(a, b.cpu()), name


def test_reference_invariants():
    gen = torch.Generator().manual_seed(3)
    for monotone in (True, False):
        scores, tokens, parents = random_candidates(6, 90, gen, monotone, ties=True)
        tree = taps_ops.Tree(*build_tree_ref(scores, tokens, parents, 70))
        check_tree_invariants(tree)
        # selection: every kept real candidate ranks above every dropped one by (eff, depth, index)
        for b in range(6):
            eff, depth = {}, {}
            for c in range(90):
                if tokens[b, c] < 0:
                    continue
                p = int(parents[b, c])
                eff[c] = min(float(scores[b, c]), eff[p] if p >= 0 else math.inf)
                depth[c] = 1 + (depth[p] if p >= 0 else 0)
            kept = set(tree.candidate_index[b][1:].tolist()) - {-1}
            rank = {c: (-eff[c], depth[c], c) for c in eff}
            if kept and len(kept) < len(eff):
                assert max(rank[c] for c in kept) < min(rank[c] for c in eff if c not in kept)


# ---------------------------------------------------------------------------------------------------
# bad inputs, opcheck
# ---------------------------------------------------------------------------------------------------

def _bad_cases():
    scores = torch.tensor([[-0.1, -0.2, -0.3, -0.4]])
    tokens = torch.tensor([[1, 2, -1, 3]])
    parents = torch.tensor([[-1, 0, -1, 1]])

    def w(t, i, v):
        t = t.clone()
        t[0, i] = v
        return t

    return [
        ("scores_f64", (scores.double(), tokens, parents, 3), "scores"),
        ("scores_1d", (scores[0], tokens, parents, 3), "scores"),
        ("tokens_int32", (scores, tokens.int(), parents, 3), "tokens"),
        ("tokens_shape", (scores, tokens[:, :3], parents, 3), "tokens"),
        ("parents_shape", (scores, tokens, parents[:, :3], 3), "parents"),
        ("parents_float", (scores, tokens, parents.float(), 3), "parents"),
        ("parent_forward", (scores, tokens, w(parents, 1, 3), 3), "parent"),
        ("parent_self", (scores, tokens, w(parents, 1, 1), 3), "parent"),
        ("parent_out_of_range", (scores, tokens, w(parents, 3, 9), 3), "parent"),
        ("parent_below_minus_one", (scores, tokens, w(parents, 1, -2), 3), "parent"),
        ("parent_is_padding", (scores, tokens, w(parents, 3, 2), 3), "parent"),
        ("nan_score", (w(scores, 1, float("nan")), tokens, parents, 3), "nan"),
        ("num_nodes_zero", (scores, tokens, parents, 0), "num_nodes"),
        ("root_tokens_shape", (scores, tokens, parents, 3, torch.tensor([1, 2])), "root_tokens"),
        ("root_tokens_float", (scores, tokens, parents, 3, torch.tensor([1.0])), "root_tokens"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises(device, case):
    _, args, message = case
    with pytest.raises(BAD_INPUT, match=f"(?i){message}"):
        _build(device, *args)
        if device == "cuda":
            torch.cuda.synchronize()


@st.composite
def _fuzz_case(draw):
    """Candidates with malformed parents, NaN / inf scores, padding anywhere, num_nodes < 1; half of
    the time well-formed random candidates."""
    batch = draw(st.integers(0, 3))
    m = draw(st.integers(0, 7))

    def rows(values):
        return draw(st.lists(st.lists(values, min_size=m, max_size=m), min_size=batch, max_size=batch))

    tokens = torch.tensor(rows(st.integers(-2, 4)), dtype=torch.int64).reshape(batch, m)
    parents = torch.tensor(rows(st.integers(-3, m + 1)), dtype=torch.int64).reshape(batch, m)
    special = st.sampled_from([0.0, -0.5, -1.0, -1.0, -2.5, 0.7, NEG_INF, float("inf"), float("nan")])
    scores = torch.tensor(rows(special), dtype=torch.float32).reshape(batch, m)
    if batch and m and draw(st.booleans()):
        gen = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
        scores, tokens, parents = random_candidates(batch, m, gen, monotone=draw(st.booleans()), ties=True)
    root = None
    if draw(st.booleans()):
        root = torch.tensor(draw(st.lists(st.integers(-1, 4), min_size=batch, max_size=batch)), dtype=torch.int64)
    return scores, tokens, parents, draw(st.integers(-1, 9)), root


def test_fuzz_agrees_with_reference(device):
    """Malformed input raises on both backends exactly when the reference refuses it; accepted input
    gives the reference's tree."""
    fuzz_against_reference(device, _fuzz_case(), build_tree_ref, _build, taps_ops.Tree._fields)


@pytest.mark.skipif(not cuda_available(), reason="no GPU")
def test_device_mismatch_raises():
    scores, tokens, parents = torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.int64), torch.full((1, 3), -1)
    for args in [(scores.cuda(), tokens, parents), (scores, tokens.cuda(), parents.cuda())]:
        with pytest.raises(BAD_INPUT, match="(?i)device|cuda|cpu"):
            taps_ops.build_tree(*args, 3)
    with pytest.raises(BAD_INPUT, match="(?i)device|cuda|cpu"):
        taps_ops.build_tree(scores.cuda(), tokens.cuda(), parents.cuda(), 3, torch.tensor([1]))


def test_opcheck(device):
    gen = torch.Generator().manual_seed(2)
    scores, tokens, parents = random_candidates(3, 40, gen, monotone=False, ties=True)
    to = (lambda t: t.to(device))
    for num_nodes, root in [(10, None), (70, torch.tensor([1, 2, 3])), (1, None)]:
        args = (to(scores), to(tokens), to(parents), num_nodes, None if root is None else to(root))
        torch.library.opcheck(torch.ops.taps_ops.build_tree.default, args)


# ---------------------------------------------------------------------------------------------------
# validate=False
# ---------------------------------------------------------------------------------------------------

def test_validate_false_same_result_and_opcheck(device):
    gen = torch.Generator().manual_seed(11)
    scores, tokens, parents = random_candidates(4, 50, gen, monotone=False, ties=True)
    args = (scores.to(device), tokens.to(device), parents.to(device), 20, torch.tensor([1, 2, 3, 4], device=device))
    assert _lists(taps_ops.build_tree(*args, validate=False)) == _lists(taps_ops.build_tree(*args))
    torch.library.opcheck(torch.ops.taps_ops.build_tree.default, (*args, False))


@pytest.mark.parametrize("case", [c for c in _bad_cases() if c[0] in ("parent_forward", "parent_is_padding",
                                                                      "nan_score")], ids=lambda c: c[0])
def test_validate_false_still_checks_on_cpu(case):
    # The CPU checks cost no device sync and the core's loop relies on them: they run with validate=False too.
    _, args, message = case
    with pytest.raises(BAD_INPUT, match=f"(?i){message}"):
        taps_ops.build_tree(*args, validate=False)


@pytest.mark.skipif(not cuda_available(), reason="no GPU or no CUDA kernels")
def test_validate_false_cuda_bad_input_no_raise():
    # CUDA without validate: no error readback; bad candidates give in-bounds, unspecified trees.
    case = {c[0]: c for c in _bad_cases()}["parent_forward"]
    scores, tokens, parents, num_nodes = (a.cuda() if isinstance(a, torch.Tensor) else a for a in case[1])
    tree = taps_ops.build_tree(scores, tokens, parents, num_nodes, validate=False)
    assert tuple(tree.tokens.shape) == (1, num_nodes)


def test_torch_compile_fullgraph(device):
    gen = torch.Generator().manual_seed(4)
    scores, tokens, parents = random_candidates(3, 40, gen, monotone=False, ties=True)
    root = torch.tensor([1, 2, 3])
    args = [t.to(device) for t in (scores, tokens, parents, root)]

    def step(scores, tokens, parents, root):
        return tuple(taps_ops.build_tree(scores, tokens, parents, 20, root_tokens=root)) + \
            tuple(taps_ops.build_tree(scores, tokens, parents, 70))

    assert_compiles_like_eager(step, *args)
