"""Tests of taps_ops.merge_trees against docs/SEMANTICS.md and taps_ops.reference.merge_trees_ref.

Reading of the spec used here: `source` of the root is the bitmask of all T trees (every tree contains
the root) and `source` of a padding node is 0 (no tree contains it).
"""

import pytest
import torch
from hypothesis import strategies as st

import taps_ops
from taps_ops.reference import build_tree_ref, merge_trees_ref

from conftest import (assert_compiles_like_eager, assert_literal_tree as _assert_tree, check_tree_invariants,
                      cuda_available, fuzz_against_reference, tree_lists as _lists)

BAD_INPUT = (RuntimeError, ValueError, TypeError, IndexError)
NEG_INF = float("-inf")


def _merge(device, tokens, parents, scores, num_nodes=None, weights=None):
    return taps_ops.merge_trees(tokens.to(device), parents.to(device), scores.to(device), num_nodes,
                                None if weights is None else weights.to(device))



# two trees over one root (token 0):
#   tree 0: 1 (-0.1) -> 2 (-0.5); 3 (-0.3)
#   tree 1: 1 (-0.2) -> 4 (-0.4)
_TWO_TOKENS = torch.tensor([[[0, 1, 2, 3], [0, 1, 4, -1]]])
_TWO_PARENTS = torch.tensor([[[-1, 0, 1, 0], [-1, 0, 1, -1]]])
_TWO_SCORES = torch.tensor([[[0.0, -0.1, -0.5, -0.3], [0.0, -0.2, -0.4, -9.0]]])


def test_literal_union(device):
    tree = _merge(device, _TWO_TOKENS, _TWO_PARENTS, _TWO_SCORES)
    # default num_nodes = 2 * 3 + 1 = 7: the union has 5 nodes, 2 padding rows.
    _assert_tree(tree, [0, 1, 3, 4, 2, -1, -1], [-1, 0, 0, 1, 1, -1, -1], [0, 1, 1, 2, 2, -1, -1],
                 [1, 3, 5, 11, 19, 0, 0], [0, -0.1, -0.3, -0.4, -0.5, NEG_INF, NEG_INF], [3, 3, 1, 2, 1, 0, 0])
    check_tree_invariants(tree, last_field_padding=0)


def test_literal_budget(device):
    tree = _merge(device, _TWO_TOKENS, _TWO_PARENTS, _TWO_SCORES, num_nodes=3)
    _assert_tree(tree, [0, 1, 3], [-1, 0, 0], [0, 1, 1], [1, 3, 5], [0, -0.1, -0.3], [3, 3, 1])


def test_literal_weights(device):
    # tree 1 weighted up by 1.0: node 1 scores max(-0.1, -0.2 + 1) = 0.8, node 4 0.6; budget 4.
    for weights in [torch.tensor([0.0, 1.0]), torch.tensor([[0.0, 1.0]])]:
        tree = _merge(device, _TWO_TOKENS, _TWO_PARENTS, _TWO_SCORES, num_nodes=4, weights=weights)
        _assert_tree(tree, [0, 1, 3, 4], [-1, 0, 0, 1], [0, 1, 1, 2], [1, 3, 5, 11], [0, 0.8, -0.3, 0.6], [3, 3, 1, 2])
    # weighted down: tree 1's node 4 (-0.4 - 1) drops out of a budget of 4.
    tree = _merge(device, _TWO_TOKENS, _TWO_PARENTS, _TWO_SCORES, num_nodes=4, weights=torch.tensor([0.0, -1.0]))
    _assert_tree(tree, [0, 1, 3, 2], [-1, 0, 0, 1], [0, 1, 1, 2], [1, 3, 5, 11], [0, -0.1, -0.3, -0.5], [3, 3, 1, 1])


def test_literal_dedup_inside_one_tree(device):
    # one tree whose root has two children with token 5 (scores -1 and -0.5), each with a child:
    # they merge into one node 5 (score -0.5, position key node 1) with children 7 and 8.
    tokens = torch.tensor([[[2, 5, 5, 7, 8, 7]]])
    parents = torch.tensor([[[-1, 0, 0, 1, 2, 2]]])
    scores = torch.tensor([[[0.0, -1.0, -0.5, -2.0, -1.5, -3.0]]])
    tree = _merge(device, tokens, parents, scores)
    _assert_tree(tree, [2, 5, 8, 7, -1, -1], [-1, 0, 1, 1, -1, -1], [0, 1, 2, 2, -1, -1], [1, 3, 7, 11, 0, 0],
                 [0, -0.5, -1.5, -2.0, NEG_INF, NEG_INF], [1, 1, 1, 1, 0, 0])


def test_literal_ties_position_key(device):
    # equal scores everywhere: ranking by depth then (tree, node index); tree 1's token 6 (node 1)
    # comes after tree 0's nodes in sibling order.
    tokens = torch.tensor([[[0, 3, 4], [0, 6, 3]]])
    parents = torch.tensor([[[-1, 0, 0], [-1, 0, 0]]])
    scores = torch.full((1, 2, 3), -1.0)
    tree = _merge(device, tokens, parents, scores)
    _assert_tree(tree, [0, 3, 4, 6, -1], [-1, 0, 0, 0, -1], [0, 1, 1, 1, -1], [1, 3, 5, 9, 0],
                 [0, -1, -1, -1, NEG_INF], [3, 3, 1, 2, 0])
    tree = _merge(device, tokens, parents, scores, num_nodes=3)
    _assert_tree(tree, [0, 3, 4], [-1, 0, 0], [0, 1, 1], [1, 3, 5], [0, -1, -1], [3, 3, 1])


def test_literal_same_token_different_paths(device):
    # token 4 under 1 and token 4 under the root are different trie nodes.
    tokens = torch.tensor([[[0, 1, 4], [0, 4, 1]]])
    parents = torch.tensor([[[-1, 0, 1], [-1, 0, 1]]])
    scores = torch.tensor([[[0.0, -1.0, -2.0], [0.0, -1.5, -2.5]]])
    tree = _merge(device, tokens, parents, scores)
    _assert_tree(tree, [0, 1, 4, 4, 1], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2], [1, 3, 5, 11, 21],
                 [0, -1, -1.5, -2, -2.5], [3, 1, 2, 1, 2])


def test_empty_batch(device):
    e = dict(dtype=torch.int64)
    tree = _merge(device, torch.zeros(0, 2, 5, **e), torch.zeros(0, 2, 5, **e), torch.zeros(0, 2, 5))
    assert [tuple(t.shape) for t in tree] == [(0, 9), (0, 9), (0, 9), (0, 9, 1), (0, 9), (0, 9)]


def test_multi_word_masks(device):
    # two chains of 69 nodes sharing their first 10 tokens: 10 + 2 * 59 = 128 nodes + root = 129.
    n = 70
    tokens = torch.zeros(1, 2, n, dtype=torch.int64)
    tokens[0, 0, 1:] = torch.arange(1, n)
    tokens[0, 1, 1:] = torch.arange(1, n)
    tokens[0, 1, 11:] += 1000
    parents = (torch.arange(n) - 1).expand(1, 2, n).contiguous()
    scores = (-torch.arange(n, dtype=torch.float32) * 0.1).expand(1, 2, n).contiguous()
    tree = _merge(device, tokens, parents, scores, num_nodes=130)
    check_tree_invariants(tree, last_field_padding=0)
    expected = merge_trees_ref(tokens, parents, scores, 130)
    for name, got, want in zip(taps_ops.MergedTree._fields, tree, expected):
        assert torch.equal(got.cpu(), want), name
    assert tree.tree_mask.shape[-1] == 3
    assert int((tree.tokens[0] >= 0).sum()) == 129
    assert int((tree.source[0] == 3).sum()) == 11  # root + the shared prefix


def test_single_tree_is_identity(device):
    # merging one build_tree output (distinct sibling tokens) gives the same tree back.
    gen = torch.Generator().manual_seed(4)
    m = 60
    scores = -torch.rand(2, m, generator=gen).cumsum(1)
    tokens = torch.randperm(1000, generator=gen)[:m].expand(2, m).contiguous()  # all distinct
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(-1, c, (1,), generator=gen)) for c in range(1, m)])
                           for _ in range(2)])
    built = build_tree_ref(scores, tokens, parents, 40, torch.tensor([5, 6]))
    tree = _merge(device, built[0][:, None], built[1][:, None], built[4][:, None])
    for name, got, want in zip(taps_ops.MergedTree._fields[:5], tree[:5], built[:5]):
        assert torch.equal(got.cpu(), want), name
    assert tree.source.cpu().tolist() == [[1] * 40] * 2


# ---------------------------------------------------------------------------------------------------
# random trees vs the reference
# ---------------------------------------------------------------------------------------------------

def random_tree_sets(batch, num_trees, n, vocab, gen, ties=False):
    """T random trees per request in the tree format (shared root token), with overlapping tokens."""
    tokens = torch.full((batch, num_trees, n), -1, dtype=torch.int64)
    parents = torch.full((batch, num_trees, n), -1, dtype=torch.int64)
    scores = torch.full((batch, num_trees, n), NEG_INF)
    for b in range(batch):
        root = int(torch.randint(0, vocab, (1,), generator=gen))
        for t in range(num_trees):
            real = int(torch.randint(1, n + 1, (1,), generator=gen))
            tokens[b, t, 0], scores[b, t, 0] = root, 0.0
            for i in range(1, real):
                p = int(torch.randint(max(0, i - 5), i, (1,), generator=gen))
                parents[b, t, i] = p
                tokens[b, t, i] = int(torch.randint(0, vocab, (1,), generator=gen))
                s = float(scores[b, t, p]) - float(torch.rand(1, generator=gen)) * 2
                scores[b, t, i] = round(s * 2) / 2 if ties else s
    return tokens, parents, scores


@pytest.mark.parametrize("weights_kind", ["none", "per_tree", "per_request"])
@pytest.mark.parametrize("batch,num_trees,n,vocab,num_nodes", [
    (1, 1, 1, 3, None), (3, 2, 6, 3, None), (4, 3, 12, 4, 9), (2, 5, 40, 5, None), (5, 4, 40, 50, 60),
    (2, 2, 70, 3, 100), (3, 3, 9, 2, 1), (6, 2, 5, 2, 30),
])
def test_random_vs_reference(device, weights_kind, batch, num_trees, n, vocab, num_nodes):
    gen = torch.Generator().manual_seed(batch * 997 + num_trees * 31 + n * 7 + vocab + len(weights_kind))
    tokens, parents, scores = random_tree_sets(batch, num_trees, n, vocab, gen, ties=(n % 2 == 0))
    weights = None
    if weights_kind == "per_tree":
        weights = torch.randn(num_trees, generator=gen)
    elif weights_kind == "per_request":
        weights = torch.randn(batch, num_trees, generator=gen).round()  # round: ties across trees
    tree = _merge(device, tokens, parents, scores, num_nodes, weights)
    check_tree_invariants(tree, last_field_padding=0)
    expected = merge_trees_ref(tokens, parents, scores, num_nodes, weights)
    for name, got, want in zip(taps_ops.MergedTree._fields, tree, expected):
        assert torch.equal(got.cpu(), want), f"{name} differs from the reference"
    # every merged node's token path exists in every tree of its source bitmask
    toks, pars, src = (t.cpu() for t in (tree.tokens, tree.parents, tree.source))
    for b in range(batch):
        path_sets = []
        for t in range(num_trees):
            paths = {0: ()}
            for i in range(1, n):
                if tokens[b, t, i] >= 0:
                    paths[i] = paths[int(parents[b, t, i])] + (int(tokens[b, t, i]),)
            path_sets.append(set(paths.values()))
        out_paths = {0: ()}
        for i in range(1, toks.shape[1]):
            if pars[b, i] < 0:
                break
            out_paths[i] = out_paths[int(pars[b, i])] + (int(toks[b, i]),)
            assert int(src[b, i]) == sum(1 << t for t in range(num_trees) if out_paths[i] in path_sets[t])
        assert len(set(out_paths.values())) == len(out_paths), "duplicate node after merging"


@pytest.mark.skipif(not cuda_available(), reason="no GPU")
def test_cpu_cuda_agree():
    gen = torch.Generator().manual_seed(5)
    tokens, parents, scores = random_tree_sets(8, 4, 60, 4, gen, ties=True)
    weights = torch.randn(8, 4, generator=gen)
    for num_nodes in [None, 1, 64, 100]:
        cpu = _merge("cpu", tokens, parents, scores, num_nodes, weights)
        cuda = _merge("cuda", tokens, parents, scores, num_nodes, weights)
        for name, a, b in zip(taps_ops.MergedTree._fields, cpu, cuda):
            assert torch.equal(a, b.cpu()), name


# ---------------------------------------------------------------------------------------------------
# bad inputs, opcheck
# ---------------------------------------------------------------------------------------------------

def _bad_cases():
    tokens, parents, scores = _TWO_TOKENS, _TWO_PARENTS, _TWO_SCORES

    def w(t, index, v):
        t = t.clone()
        t[index] = v
        return t

    big = torch.zeros(1, 64, 2, dtype=torch.int64)
    return [
        ("tokens_2d", (tokens[0], parents[0], scores[0]), {}, "tokens"),
        ("tokens_int32", (tokens.int(), parents, scores), {}, "tokens"),
        ("parents_shape", (tokens, parents[:, :, :3], scores), {}, "parents"),
        ("parents_float", (tokens, parents.float(), scores), {}, "parents"),
        ("scores_shape", (tokens, parents, scores[:, :1]), {}, "scores"),
        ("scores_f64", (tokens, parents, scores.double()), {}, "scores"),
        ("parent_forward", (tokens, w(parents, (0, 0, 1), 2), scores), {}, "parent"),
        ("parent_self", (tokens, w(parents, (0, 1, 2), 2), scores), {}, "parent"),
        ("parent_out_of_range", (tokens, w(parents, (0, 0, 3), 11), scores), {}, "parent"),
        ("real_node_without_parent", (tokens, w(parents, (0, 0, 3), -1), scores), {}, "parent|padding"),
        ("parent_is_padding", (w(tokens, (0, 0, 2), -1), w(w(parents, (0, 0, 2), -1), (0, 0, 3), 2), scores),
         {}, "parent|padding"),
        ("nan_score", (tokens, parents, w(scores, (0, 1, 1), float("nan"))), {}, "nan"),
        ("num_nodes_zero", (tokens, parents, scores), dict(num_nodes=0), "num_nodes"),
        ("weights_shape", (tokens, parents, scores), dict(weights=torch.zeros(3)), "weights"),
        ("too_many_trees", (big, torch.full((1, 64, 2), -1).index_fill(2, torch.tensor([1]), 0), torch.zeros(1, 64, 2)), {},
         "63|trees"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises(device, case):
    _, args, kwargs, message = case
    with pytest.raises(BAD_INPUT, match=f"(?i){message}"):
        _merge(device, *args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()


@st.composite
def _fuzz_case(draw):
    """T trees per request with malformed roots, parents and padding, NaN / inf scores, num_nodes < 1,
    weights; half of the time well-formed random trees."""
    batch = draw(st.integers(0, 3))
    num_trees = draw(st.integers(1, 3))
    n = draw(st.integers(1, 6))
    size = batch * num_trees * n

    def values(strategy):
        return draw(st.lists(strategy, min_size=size, max_size=size))

    shape = (batch, num_trees, n)
    tokens = torch.tensor(values(st.integers(-2, 3)), dtype=torch.int64).reshape(shape)
    parents = torch.tensor(values(st.integers(-2, n)), dtype=torch.int64).reshape(shape)
    special = st.sampled_from([0.0, -0.5, -1.0, -1.0, -2.5, 0.7, NEG_INF, float("inf"), float("nan")])
    scores = torch.tensor(values(special), dtype=torch.float32).reshape(shape)
    if batch and draw(st.booleans()):
        gen = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
        tokens, parents, scores = random_tree_sets(batch, num_trees, n, 3, gen, ties=True)
    weights = None
    if draw(st.booleans()):
        weights = torch.tensor(draw(st.lists(st.sampled_from([0.0, -1.0, 0.5]), min_size=num_trees,
                                             max_size=num_trees)), dtype=torch.float32)
    num_nodes = draw(st.sampled_from([None, -1, 0, 1, 3, 8]))
    return tokens, parents, scores, num_nodes, weights


def test_fuzz_agrees_with_reference(device):
    """Malformed input raises on both backends exactly when the reference refuses it; accepted input
    gives the reference's tree."""
    fuzz_against_reference(device, _fuzz_case(), merge_trees_ref, _merge, taps_ops.MergedTree._fields)


def test_reference_rejects_bad_trees():
    for case in _bad_cases():
        _, (tokens, parents, scores), kwargs, _ = case
        if case[0] in ("parent_forward", "parent_self", "parent_out_of_range", "real_node_without_parent",
                       "parent_is_padding", "nan_score", "too_many_trees"):
            with pytest.raises(ValueError):
                merge_trees_ref(tokens, parents, scores, **kwargs)


@pytest.mark.skipif(not cuda_available(), reason="no GPU")
def test_device_mismatch_raises():
    with pytest.raises(BAD_INPUT, match="(?i)device|cuda|cpu"):
        taps_ops.merge_trees(_TWO_TOKENS.cuda(), _TWO_PARENTS, _TWO_SCORES.cuda())
    with pytest.raises(BAD_INPUT, match="(?i)device|cuda|cpu"):
        taps_ops.merge_trees(_TWO_TOKENS.cuda(), _TWO_PARENTS.cuda(), _TWO_SCORES)


def test_opcheck(device):
    gen = torch.Generator().manual_seed(2)
    tokens, parents, scores = random_tree_sets(3, 3, 12, 4, gen)
    to = (lambda t: t.to(device))
    for num_nodes, weights in [(34, None), (5, torch.randn(3, 3, generator=gen)), (70, None)]:
        args = (to(tokens), to(parents), to(scores), num_nodes, None if weights is None else to(weights))
        torch.library.opcheck(torch.ops.taps_ops.merge_trees.default, args)


# ---------------------------------------------------------------------------------------------------
# validate=False
# ---------------------------------------------------------------------------------------------------

def test_validate_false_same_result_and_opcheck(device):
    gen = torch.Generator().manual_seed(12)
    tokens, parents, scores = random_tree_sets(3, 3, 12, 4, gen)
    args = (tokens.to(device), parents.to(device), scores.to(device), 20, torch.randn(3, 3, generator=gen).to(device))
    assert _lists(taps_ops.merge_trees(*args, validate=False)) == _lists(taps_ops.merge_trees(*args))
    torch.library.opcheck(torch.ops.taps_ops.merge_trees.default, (*args, False))


@pytest.mark.parametrize("case", [c for c in _bad_cases() if c[0] in ("parent_forward", "parent_is_padding",
                                                                      "nan_score")], ids=lambda c: c[0])
def test_validate_false_still_checks_on_cpu(case):
    # The CPU checks cost no device sync and the core's loop relies on them: they run with validate=False too.
    _, args, kwargs, message = case
    with pytest.raises(BAD_INPUT, match=f"(?i){message}"):
        taps_ops.merge_trees(*args, **kwargs, validate=False)


@pytest.mark.skipif(not cuda_available(), reason="no GPU or no CUDA kernels")
def test_validate_false_cuda_bad_input_no_raise():
    # CUDA without validate: no error readback; bad trees give in-bounds, unspecified trees.
    case = {c[0]: c for c in _bad_cases()}["parent_forward"]
    tokens, parents, scores = (a.cuda() for a in case[1])
    tree = taps_ops.merge_trees(tokens, parents, scores, validate=False)
    assert tuple(tree.tokens.shape) == (1, 2 * 3 + 1)


def test_torch_compile_fullgraph(device):
    gen = torch.Generator().manual_seed(6)
    tokens, parents, scores = random_tree_sets(3, 3, 12, 4, gen)
    weights = torch.randn(3, 3, generator=gen)
    args = [t.to(device) for t in (tokens, parents, scores, weights)]

    def step(tokens, parents, scores, weights):
        return tuple(taps_ops.merge_trees(tokens, parents, scores)) + \
            tuple(taps_ops.merge_trees(tokens, parents, scores, num_nodes=9, weights=weights))

    assert_compiles_like_eager(step, *args)
