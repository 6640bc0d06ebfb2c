"""Tests of taps_ops.verify_tree against docs/SEMANTICS.md and taps_ops.reference.

- literal trees with literal expected outputs;
- random trees of odd sizes in every mode, compared with the reference under identical uniforms;
- output distributions (chi-square): the first emitted token ~ p(root) and, given the acceptance of a
  child, the next token ~ p(child);
- bad inputs raise clear errors, fuzzing never crashes, opcheck and torch.compile.
"""

import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import taps_ops
from taps_ops.reference import target_probs_ref, verify_tree_ref

from conftest import assert_compiles_like_eager, cuda_available, verify_on as _verify
from sampling_checks import MARGIN, assert_distribution, assert_matches_reference, spec_probs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BAD_INPUT = (RuntimeError, ValueError, TypeError, IndexError)


def _as_lists(out):
    return [t.cpu().tolist() for t in out]


# ---------------------------------------------------------------------------------------------------
# literal trees
# ---------------------------------------------------------------------------------------------------

def _one_hot_logits(rows, v):
    """[1, len(rows), v] logits whose argmax at node i is rows[i] (others 0, the argmax 5)."""
    logits = torch.zeros(1, len(rows), v)
    for i, t in enumerate(rows):
        logits[0, i, t] = 5.0
    return logits


def test_greedy_chain_partial(device):
    # root -> 5 -> 6 -> 3; the target wants 5, 6, 7: two accepted, correction 7.
    logits = _one_hot_logits([5, 6, 7, 1], 10)
    tokens = torch.tensor([[9, 5, 6, 3]])
    parents = torch.tensor([[-1, 0, 1, 2]])
    out = _verify(device, logits, tokens, parents)
    assert _as_lists(out) == [[[5, 6, 7, -1]], [2], [[0, 1, 2, -1]]]


def test_greedy_chain_leaf_bonus(device):
    # the whole chain is accepted, the leaf's row gives the bonus token 1.
    logits = _one_hot_logits([5, 6, 3, 1], 10)
    tokens = torch.tensor([[9, 5, 6, 3]])
    parents = torch.tensor([[-1, 0, 1, 2]])
    out = _verify(device, logits, tokens, parents)
    assert _as_lists(out) == [[[5, 6, 3, 1]], [3], [[0, 1, 2, 3]]]


def test_greedy_branching_tree(device):
    #            0
    #      1(4)  2(7)  3(2)
    #   4(1) 5(8)      6(8)
    #        7(3)
    logits = _one_hot_logits([7, 0, 8, 0, 0, 3, 0, 9], 10)
    tokens = torch.tensor([[0, 4, 7, 2, 1, 8, 8, 3]])
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 3, 5]])
    out = _verify(device, logits, tokens, parents)
    # 7 -> node 2, whose row wants 8 but node 2 has no children: correction 8.
    assert _as_lists(out) == [[[7, 8, -1, -1, -1, -1, -1, -1]], [1], [[0, 2, -1, -1, -1, -1, -1, -1]]]
    logits = _one_hot_logits([4, 8, 0, 0, 0, 3, 0, 9], 10)
    out = _verify(device, logits, tokens, parents)
    assert _as_lists(out) == [[[4, 8, 3, 9, -1, -1, -1, -1]], [3], [[0, 1, 5, 7, -1, -1, -1, -1]]]


def test_greedy_argmax_ties_to_lowest_id(device):
    logits = torch.zeros(1, 2, 6)
    logits[0, 0, [2, 4]] = 3.0  # tie between 2 and 4 -> 2... which is not a child: emitted.
    tokens = torch.tensor([[0, 4]])
    parents = torch.tensor([[-1, 0]])
    out = _verify(device, logits, tokens, parents)
    assert _as_lists(out) == [[[2, -1]], [0], [[0, -1]]]


def test_greedy_duplicate_sibling_tokens(device):
    # nodes 1 and 2 both carry token 5: the first one (node 1) is taken.
    logits = _one_hot_logits([5, 2, 6, 0], 8)
    tokens = torch.tensor([[0, 5, 5, 6]])
    parents = torch.tensor([[-1, 0, 0, 2]])
    out = _verify(device, logits, tokens, parents)
    assert _as_lists(out) == [[[5, 2, -1, -1]], [1], [[0, 1, -1, -1]]]


def test_greedy_padding_ragged_batch(device):
    logits = torch.cat([_one_hot_logits([3, 4, 0, 0, 0], 6), _one_hot_logits([3, 1, 2, 0, 0], 6)])
    tokens = torch.tensor([[0, 3, -1, -1, -1], [0, 3, 1, 2, -1]])
    parents = torch.tensor([[-1, 0, -1, -1, -1], [-1, 0, 1, 0, -1]])
    out = _verify(device, logits, tokens, parents)
    assert _as_lists(out) == [[[3, 4, -1, -1, -1], [3, 1, 2, -1, -1]], [1, 2], [[0, 1, -1, -1, -1], [0, 1, 2, -1, -1]]]


def test_root_only_tree(device):
    logits = _one_hot_logits([4], 6)
    out = _verify(device, logits, torch.tensor([[1]]), torch.tensor([[-1]]))
    assert _as_lists(out) == [[[4]], [0], [[0]]]


def test_empty_batch(device):
    out = _verify(device, torch.zeros(0, 4, 10), torch.zeros(0, 4, dtype=torch.int64),
                  torch.zeros(0, 4, dtype=torch.int64), temperature=0.5)
    assert [tuple(t.shape) for t in out] == [(0, 4), (0,), (0, 4)]
    assert all(t.dtype == torch.int64 for t in out)


# p = [0.5, 0.25, 0.125, 0.125] at every node (logits = log p, temperature 1).
_LOG_P = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()


@pytest.mark.parametrize("coin,expected", [
    # order: child tokens [2, 0] then 1, 3; cumulative 0.125, 0.625, 0.875, 1.0
    (0.05, ([2, 1], 1, [0, 1])),   # token 2 -> node 1 (leaf), whose coin 0.55 draws token 1
    (0.3, ([0, 0], 1, [0, 2])),    # token 0 -> node 2 (leaf)
    (0.7, ([1], 0, [0])),          # token 1: not a child
    (0.95, ([3], 0, [0])),         # token 3: not a child
])
def test_sampling_literal(device, coin, expected):
    logits = _LOG_P.expand(1, 3, 4).clone()
    tokens = torch.tensor([[0, 2, 0]])
    parents = torch.tensor([[-1, 0, 0]])
    # leaf coins: node 1 (no children, order 0, 1, 2, 3): 0.55 -> cumulative 0.5, 0.75 -> token 1;
    # node 2: 0.3 -> token 0.
    uniforms = torch.tensor([[coin, 0.55, 0.3]])
    out = _verify(device, logits, tokens, parents, temperature=1.0, uniforms=uniforms)
    toks, acc, path = expected
    assert _as_lists(out) == [[toks + [-1] * (3 - len(toks))], [acc], [path + [-1] * (3 - len(path))]]


def test_sampling_literal_duplicate_siblings(device):
    # children tokens [2, 2, 0]: the order is 2, 0, 1, 3 and token 2 moves to node 1, never node 2.
    logits = _LOG_P.expand(1, 4, 4).clone()
    tokens = torch.tensor([[0, 2, 2, 0]])
    parents = torch.tensor([[-1, 0, 0, 0]])
    for coin, node, tok in [(0.05, 1, 2), (0.3, 3, 0)]:
        out = _verify(device, logits, tokens, parents, temperature=1.0, uniforms=torch.tensor([[coin, 0.1, 0.1, 0.1]]))
        assert _as_lists(out) == [[[tok, 0, -1, -1]], [1], [[0, node, -1, -1]]]


# Tie rules of top-k and top-p (SEMANTICS.md: every token tied with the k-th largest value, or with the
# last token of the top-p set, is kept; -0.0 and +0.0 tie). A root-only tree draws by inverse CDF in id
# order; the token of each coin is worked out by hand from the kept weights (T = 1):
#   logits 4, 3, 3, 1, 0: w = 54.598, 20.086, 20.086, 2.718, 1 (p = 0.554, 0.204, 0.204, 0.028, 0.010)
#     kept {0, 1, 2}: cumulative 0.5761, 0.7881, 1;  kept {0, 1, 2, 3}: 0.5601, 0.7661, 0.9721, 1
#   logits 1, -0.0, +0.0, -1: w = 2.718, 1, 1, 0.135 (p = 0.560, 0.206, 0.206, 0.028)
#     kept {0, 1, 2}: cumulative 0.5761, 0.7881, 1
# A top-k or top-p that dropped the tied token 2 would draw token 1 (or 0) for coin 0.9.
_TIES = [4.0, 3.0, 3.0, 1.0, 0.0]
_SIGNED_ZEROS = [1.0, -0.0, 0.0, -1.0]
TIE_CASES = [
    # (id, logits, top_k, top_p, [(coin, emitted token)])
    ("top_k_tie_with_kth", _TIES, 2, 1.0, [(0.5, 0), (0.7, 1), (0.9, 2), (0.999, 2)]),
    ("top_k_one", _TIES, 1, 1.0, [(0.5, 0), (0.999, 0)]),
    ("top_k_tie_signed_zeros", _SIGNED_ZEROS, 2, 1.0, [(0.5, 0), (0.7, 1), (0.9, 2), (0.999, 2)]),
    ("top_p_tie_with_last", _TIES, 0, 0.6, [(0.5, 0), (0.7, 1), (0.9, 2), (0.999, 2)]),
    ("top_p_one_past_tie", _TIES, 0, 0.97, [(0.5, 0), (0.9, 2), (0.98, 3), (0.999, 3)]),
    ("top_p_first_alone", _TIES, 0, 0.5, [(0.0, 0), (0.999, 0)]),
    ("top_p_tie_signed_zeros", _SIGNED_ZEROS, 0, 0.7, [(0.5, 0), (0.7, 1), (0.9, 2), (0.999, 2)]),
    ("top_k_top_p_tie", _TIES, 2, 0.6, [(0.7, 1), (0.9, 2)]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", TIE_CASES, ids=lambda c: c[0])
def test_sampling_literal_ties(device, case, dtype):
    _, row, top_k, top_p, draws = case
    logits = torch.tensor([[row]]).to(dtype)
    tokens, parents = torch.tensor([[0]]), torch.tensor([[-1]])
    coins = torch.tensor([[c] for c, _ in draws])
    batch = len(draws)
    args = (logits.expand(batch, 1, -1), tokens.expand(batch, 1), parents.expand(batch, 1))
    kw = dict(temperature=1.0, top_k=top_k, top_p=top_p, uniforms=coins)
    expected = [t for _, t in draws]
    assert _verify(device, *args, **kw).tokens[:, 0].tolist() == expected
    assert verify_tree_ref(*args, **kw)[0][:, 0].tolist() == expected
    cumulative = np.cumsum(spec_probs(logits[0, 0], 1.0, top_k, top_p))
    assert [int(np.argmax(cumulative > c)) for c, _ in draws] == expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_spec_probs_match_reference(dtype):
    """The tests' distributions (sampling_checks.spec_probs, written from SEMANTICS.md) and the
    reference's (target_probs_ref) agree on random rows with ties (rounded logits, signed zeros),
    -inf entries and every kind of parameter."""
    gen = torch.Generator().manual_seed(31)
    checked = 0
    for v in (1, 2, 7, 50, 301):
        for r in range(4):
            row = torch.randn(v, generator=gen) * 3
            if r % 2:
                row = row.round()  # many exact ties
            if v > 2:
                row[torch.randint(0, v, (2,), generator=gen)] = torch.tensor([-0.0, 0.0])
                if r == 3:
                    row[0] = float("-inf")
            row = row.to(dtype)
            for temperature in (0.0, 0.3, 1.0, 2.5):
                for top_k in (0, 1, 3, v - 1, v, v + 5):
                    for top_p in (0.05, 0.5, 0.9, 1.0):
                        want = target_probs_ref(row, temperature, top_k, top_p).numpy()
                        got = spec_probs(row, temperature, top_k, top_p)
                        assert np.allclose(got, want, rtol=1e-9, atol=1e-12), (v, r, temperature, top_k, top_p)
                        checked += 1
    assert checked > 1000


@pytest.mark.parametrize("top_k,top_p", [(2, 1.0), (0, 0.6)])
def test_sampling_literal_tied_child(device, top_k, top_p):
    # logits 4, 3, 3, 1, 0 at both nodes; the root's child carries token 2 (tied with token 1), so the
    # order is 2, 0, 1 over the kept tokens: cumulative 0.2119, 0.7881, 1. Coin 0.1 accepts the child
    # (whose own coin 0.0 draws token 0), 0.5 emits 0, 0.9 emits 1.
    logits = torch.tensor(_TIES).expand(3, 2, 5)
    tokens, parents = torch.tensor([[0, 2]]).expand(3, 2), torch.tensor([[-1, 0]]).expand(3, 2)
    kw = dict(temperature=1.0, top_k=top_k, top_p=top_p, uniforms=torch.tensor([[0.1, 0.0], [0.5, 0.0], [0.9, 0.0]]))
    expected = [[[2, 0], [0, -1], [1, -1]], [1, 0, 0], [[0, 1], [0, -1], [0, -1]]]
    assert _as_lists(_verify(device, logits, tokens, parents, **kw)) == expected
    assert [t.tolist() for t in verify_tree_ref(logits, tokens, parents, **kw)] == expected


@pytest.mark.parametrize("u1,expected", [
    # root p = [0.5, 0.25, 0.125, 0.125], q = [0.25, 0.5, 0.125, 0.125]; child token 1: accept iff
    # u1 * 0.5 < 0.25. Accepted with u1 = 0.2: coin = 0.2 * 0.5 / 0.25 = 0.4 at node 1 (leaf),
    # drawn in id order from p: token 0.
    (0.2, ([1, 0], 1, [0, 1])),
    # rejected: r = norm(max(p - q, 0)) = [1, 0, 0, 0]: token 0 whatever the root coin.
    (0.75, ([0, -1], 0, [0, -1])),
])
def test_draft_probs_literal(device, u1, expected):
    logits = _LOG_P.expand(1, 2, 4).clone()
    draft_probs = torch.tensor([0.25, 0.5, 0.125, 0.125]).expand(1, 2, 4).clone()
    tokens = torch.tensor([[3, 1]])
    parents = torch.tensor([[-1, 0]])
    out = _verify(device, logits, tokens, parents, temperature=1.0, draft_probs=draft_probs,
                  uniforms=torch.tensor([[0.9, u1]]))
    assert _as_lists(out) == [[expected[0]], [expected[1]], [expected[2]]]


def test_draft_probs_literal_second_sibling(device):
    # two children, tokens 1 then 0. Child 1 (token 1) rejected (u = 0.9): r = [1, 0, 0, 0]; child 2
    # (token 0, q_0 = 0.25 <= r_0 = 1) accepted with coin 0.6 -> node 2's row (p, id order): token 1.
    logits = _LOG_P.expand(1, 3, 4).clone()
    draft_probs = torch.tensor([0.25, 0.5, 0.125, 0.125]).expand(1, 3, 4).clone()
    out = _verify(device, logits, torch.tensor([[3, 1, 0]]), torch.tensor([[-1, 0, 0]]), temperature=1.0,
                  draft_probs=draft_probs, uniforms=torch.tensor([[0.1, 0.9, 0.6]]))
    assert _as_lists(out) == [[[0, 1, -1]], [1], [[0, 2, -1]]]


def test_draft_probs_greedy_request_ignores_draft_probs(device):
    logits = _one_hot_logits([5, 6, 7], 10)
    draft_probs = torch.full((1, 3, 10), float("nan"))  # never read when temperature is 0
    out = _verify(device, logits, torch.tensor([[0, 5, 6]]), torch.tensor([[-1, 0, 1]]), temperature=0.0,
                  draft_probs=draft_probs, uniforms=torch.zeros(1, 3))
    assert _as_lists(out) == [[[5, 6, 7]], [2], [[0, 1, 2]]]


# ---------------------------------------------------------------------------------------------------
# random trees vs the reference
# ---------------------------------------------------------------------------------------------------

def random_trees(batch, n, v, gen, dup=True):
    """Random valid trees: per request a random number of real nodes (>= 1), random topological
    parents, tokens in [0, v) (duplicates among siblings happen for small v), -1 padding."""
    tokens = torch.full((batch, n), -1, dtype=torch.int64)
    parents = torch.full((batch, n), -1, dtype=torch.int64)
    for b in range(batch):
        real = int(torch.randint(1, n + 1, (1,), generator=gen))
        if b == 0:
            real = n  # at least one full tree
        tokens[b, 0] = int(torch.randint(0, v, (1,), generator=gen))
        for i in range(1, real):
            # bias towards recent parents so that trees get deep
            lo = max(0, i - 4) if float(torch.rand(1, generator=gen)) < 0.7 else 0
            parents[b, i] = int(torch.randint(lo, i, (1,), generator=gen))
            tokens[b, i] = int(torch.randint(0, v, (1,), generator=gen))
    return tokens, parents


def random_logits(tokens, parents, v, dtype, gen, boost=4.0):
    """Random logits that favour each node's child tokens, so that paths get long."""
    batch, n = tokens.shape
    logits = torch.randn(batch, n, v, generator=gen) * 2.0
    for b in range(batch):
        for i in range(1, n):
            if parents[b, i] >= 0:
                logits[b, parents[b, i], tokens[b, i]] += boost * float(torch.rand(1, generator=gen)) + 1.0
                if float(torch.rand(1, generator=gen)) < 0.4:  # a clear favourite: greedy accepts it
                    logits[b, parents[b, i], tokens[b, i]] += 8.0
    return logits.to(dtype)


SIZES = [(1, 1, 1), (1, 5, 3), (7, 5, 3), (111, 37, 17), (1000, 37, 3), (1000, 5, 17), (7, 37, 17), (111, 1, 3), (1000, 1, 17)]
MODES = ["greedy", "temperature", "top_k_top_p", "per_request", "draft_probs"]


def _mode_params(mode, batch, v, dtype, gen, n):
    if mode == "greedy":
        return dict(temperature=0.0)
    if mode == "temperature":
        return dict(temperature=0.7)
    if mode == "top_k_top_p":
        return dict(temperature=1.3, top_k=5, top_p=0.8)
    temperature = torch.tensor([0.0, 0.4, 1.0, 2.5])[torch.randint(0, 4, (batch,), generator=gen)]
    top_k = torch.tensor([0, 1, 3, 50])[torch.randint(0, 4, (batch,), generator=gen)]
    top_p = torch.tensor([0.3, 0.9, 1.0])[torch.randint(0, 3, (batch,), generator=gen)]
    params = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    if mode == "draft_probs":
        params["draft_probs"] = torch.softmax(torch.randn(batch, n, v, generator=gen) * 2, -1).to(dtype)
    return params


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("v,n,batch", SIZES)
def test_random_vs_reference(device, mode, dtype, v, n, batch):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{mode} {dtype} {v} {n} {batch}".encode()))
    tokens, parents = random_trees(batch, n, v, gen)
    logits = random_logits(tokens, parents, v, dtype, gen)
    params = _mode_params(mode, batch, v, dtype, gen, n)
    uniforms = torch.rand(batch, n, generator=gen)
    out = _verify(device, logits, tokens, parents, uniforms=uniforms, **params)
    ref_acc = assert_matches_reference(out, (logits, tokens, parents), dict(uniforms=uniforms, **params))
    if n >= 5 and mode in ("greedy", "temperature"):
        assert ref_acc.max() >= 1  # the boosted logits make the test exercise acceptance


@pytest.mark.parametrize("mode", MODES)
def test_validate_false_same_result(device, mode):
    gen = torch.Generator().manual_seed(12)
    tokens, parents = random_trees(9, 21, 40, gen)
    logits = random_logits(tokens, parents, 40, torch.float32, gen)
    params = _mode_params(mode, 9, 40, torch.float32, gen, 21)
    uniforms = torch.rand(9, 21, generator=gen)
    checked = _verify(device, logits, tokens, parents, uniforms=uniforms, **params)
    unchecked = _verify(device, logits, tokens, parents, uniforms=uniforms, validate=False, **params)
    assert _as_lists(checked) == _as_lists(unchecked)


@pytest.mark.skipif(not cuda_available(), reason="no GPU")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_cuda_agree(mode, dtype):
    gen = torch.Generator().manual_seed(7)
    v, n, batch = 1000, 37, 33
    tokens, parents = random_trees(batch, n, v, gen)
    logits = random_logits(tokens, parents, v, dtype, gen)
    params = _mode_params(mode, batch, v, dtype, gen, n)
    uniforms = torch.rand(batch, n, generator=gen)
    cpu = _verify("cpu", logits, tokens, parents, uniforms=uniforms, **params)
    cuda = _verify("cuda", logits, tokens, parents, uniforms=uniforms, **params)
    _, _, _, margin = verify_tree_ref(logits, tokens, parents, uniforms=uniforms, **params, return_margin=True)
    same = (cpu.tokens == cuda.tokens.cpu()).all(1) & (cpu.num_accepted == cuda.num_accepted.cpu()) \
        & (cpu.path == cuda.path.cpu()).all(1)
    assert bool((same | (margin < MARGIN)).all()), f"CPU and CUDA differ for requests {(~same).nonzero().flatten().tolist()}"


def test_generator_reproducible(device):
    gen = torch.Generator().manual_seed(3)
    tokens, parents = random_trees(5, 9, 50, gen)
    logits = random_logits(tokens, parents, 50, torch.float32, gen)
    outs = []
    for _ in range(2):
        g = torch.Generator(device=device).manual_seed(11)
        outs.append(_as_lists(_verify(device, logits, tokens, parents, temperature=1.0, generator=g)))
    assert outs[0] == outs[1]


def argmax_walk(logits, tokens, parents):
    """Greedy verification written independently of the reference: numpy argmax walk."""
    x = logits.float().cpu().numpy()
    tok, par = tokens.cpu().numpy(), parents.cpu().numpy()
    batch, n, _ = x.shape
    out_tokens = np.full((batch, n), -1)
    out_path = np.full((batch, n), -1)
    acc = np.zeros(batch, dtype=np.int64)
    for b in range(batch):
        cur, k = 0, 0
        out_path[b, 0] = 0
        while True:
            y = int(np.argmax(x[b, cur]))  # first maximal index
            kids = [j for j in range(1, n) if par[b, j] == cur and tok[b, j] == y]
            out_tokens[b, k] = y
            if not kids:
                break
            cur = kids[0]
            k += 1
            out_path[b, k] = cur
        acc[b] = k
    return out_tokens, acc, out_path


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_greedy_is_argmax_walk(dtype):
    gen = torch.Generator().manual_seed(5)
    for v, n, batch in [(7, 37, 17), (111, 9, 5), (3, 12, 8)]:
        tokens, parents = random_trees(batch, n, v, gen)
        logits = random_logits(tokens, parents, v, dtype, gen)
        expected = argmax_walk(logits, tokens, parents)
        got = verify_tree_ref(logits, tokens, parents, temperature=0.0)
        for g, e in zip(got, expected):
            assert g.tolist() == e.tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_is_argmax_walk(device, dtype):
    gen = torch.Generator().manual_seed(6)
    # small V with bf16/fp16 rounding gives many exact ties: ties must go to the lowest id.
    for v, n, batch in [(7, 37, 17), (1000, 37, 9), (3, 12, 64)]:
        tokens, parents = random_trees(batch, n, v, gen)
        logits = (random_logits(tokens, parents, v, torch.float32, gen) * 2).round().to(dtype)
        expected = argmax_walk(logits, tokens, parents)
        got = _verify(device, logits, tokens, parents, temperature=0.0,
                      top_k=3, top_p=0.5)  # ignored when greedy
        for g, e in zip(got, expected):
            assert g.cpu().tolist() == e.tolist()


# ---------------------------------------------------------------------------------------------------
# output distribution (chi-square)
# ---------------------------------------------------------------------------------------------------

def test_chi_square_helper_can_fail():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    samples = torch.multinomial(p, 20000, replacement=True, generator=gen)
    assert_distribution(samples, p)  # the right distribution passes
    wrong = torch.tensor([0.37, 0.33, 0.2, 0.1], dtype=torch.float64)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_distribution(samples, wrong)
    with pytest.raises(AssertionError, match="probability-0"):
        assert_distribution(samples, torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64))


COPIES = 20000

# one tree: root with children tokens 3, 1, 3 (duplicate), 5; node 1 has children 2, 0; node 4 (token 5)
# has child 6; V = 12.
_TREE_TOKENS = [0, 3, 1, 3, 5, 2, 0, 6]
_TREE_PARENTS = [-1, 0, 0, 0, 0, 1, 1, 4]


def _chi_square_tree(dtype, gen, v=12):
    n = len(_TREE_TOKENS)
    tokens = torch.tensor(_TREE_TOKENS).expand(COPIES, n).contiguous()
    parents = torch.tensor(_TREE_PARENTS).expand(COPIES, n).contiguous()
    row = torch.randn(n, v, generator=gen)
    for i in range(1, n):
        row[_TREE_PARENTS[i], _TREE_TOKENS[i]] += 1.5  # children are likely, so conditionals have samples
    logits = row.to(dtype).expand(COPIES, n, v).contiguous()
    return logits, tokens, parents


def _check_tree_distribution(out, logits, temperature, top_k, top_p, min_conditional=300):
    row = logits[0].cpu()
    first = out.tokens[:, 0].cpu()
    assert_distribution(first, spec_probs(row[0], temperature, top_k, top_p))
    path1 = out.path[:, 1].cpu()
    tested = 0
    for child in range(1, len(_TREE_TOKENS)):
        accepted = path1 == child
        if _TREE_PARENTS[child] != 0 or accepted.sum() < min_conditional:
            continue
        assert (first[accepted] == _TREE_TOKENS[child]).all()
        assert_distribution(out.tokens[:, 1].cpu()[accepted], spec_probs(row[child], temperature, top_k, top_p))
        tested += 1
    # the duplicate (node 3, token 3) is never entered: node 1 is the first child with token 3.
    assert not (path1 == 3).any()
    assert tested >= 2


@pytest.mark.parametrize("temperature,top_k,top_p,dtype", [
    (1.0, 0, 1.0, torch.float32),
    (0.5, 0, 1.0, torch.float32),
    (2.0, 0, 1.0, torch.float32),
    (1.0, 4, 1.0, torch.float32),
    (0.8, 0, 0.7, torch.float32),
    (1.0, 6, 0.9, torch.bfloat16),
    (1.0, 0, 1.0, torch.float16),
])
def test_chi_square_deterministic_candidates(device, temperature, top_k, top_p, dtype):
    gen = torch.Generator().manual_seed(1234)
    logits, tokens, parents = _chi_square_tree(dtype, gen)
    uniforms = torch.rand(COPIES, tokens.shape[1], generator=gen)
    out = _verify(device, logits, tokens, parents, temperature=temperature, top_k=top_k, top_p=top_p,
                  uniforms=uniforms)
    _check_tree_distribution(out, logits, temperature, top_k, top_p)


def test_chi_square_detects_a_biased_kernel(device):
    # the same check must reject outputs drawn with reused coins (uniforms of the root reused at the
    # child): the conditional distribution after acceptance is then wrong.
    gen = torch.Generator().manual_seed(99)
    logits, tokens, parents = _chi_square_tree(torch.float32, gen)
    uniforms = torch.rand(COPIES, 1, generator=gen).expand(COPIES, tokens.shape[1]).contiguous()
    out = _verify(device, logits, tokens, parents, temperature=1.0, uniforms=uniforms)
    with pytest.raises(AssertionError, match="chi-square|probability-0"):
        _check_tree_distribution(out, logits, 1.0, 0, 1.0)


def _sampled_children_case(gen, v, copies, dtype, temperature, top_k, top_p):
    """Per copy: root with 3 children drawn i.i.d. from q_root (a per-copy distribution), each child c
    with 2 children drawn i.i.d. from q(c). The target row of a child depends on its token only."""
    n = 1 + 3 + 6
    root_logits = torch.randn(v, generator=gen) * 1.5
    child_logits = torch.randn(v, v, generator=gen) * 1.5  # row s: the target after token s
    leaf_logits = torch.randn(v, generator=gen)
    base_q = torch.randn(v, generator=gen)
    q_root = torch.softmax(base_q + 0.7 * torch.randn(copies, v, generator=gen), -1)
    q_child = torch.softmax(torch.randn(copies, 3, v, generator=gen) * 1.5, -1)
    tokens = torch.zeros(copies, n, dtype=torch.int64)
    parents = torch.full((copies, n), -1, dtype=torch.int64)
    tokens[:, 1:4] = torch.multinomial(q_root, 3, replacement=True, generator=gen)
    parents[:, 1:4] = 0
    for j in range(3):
        tokens[:, 4 + 2 * j: 6 + 2 * j] = torch.multinomial(q_child[:, j], 2, replacement=True, generator=gen)
        parents[:, 4 + 2 * j: 6 + 2 * j] = 1 + j
    logits = torch.empty(copies, n, v)
    logits[:, 0] = root_logits
    logits[:, 1:4] = child_logits[tokens[:, 1:4]]
    logits[:, 4:] = leaf_logits
    draft_probs = torch.zeros(copies, n, v)
    draft_probs[:, 0] = q_root
    draft_probs[:, 1:4] = q_child
    draft_probs[:, 4:] = 1.0 / v  # rows of leaves are never read
    return logits.to(dtype), tokens, parents, draft_probs, root_logits.to(dtype), child_logits.to(dtype)


@pytest.mark.parametrize("temperature,top_k,top_p,dtype", [
    (1.0, 0, 1.0, torch.float32),
    (0.6, 0, 1.0, torch.float32),
    (1.0, 5, 1.0, torch.float32),
    (1.2, 0, 0.8, torch.bfloat16),
])
def test_chi_square_sampled_children(device, temperature, top_k, top_p, dtype):
    gen = torch.Generator().manual_seed(4321)
    v = 8  # small: duplicates among the i.i.d. siblings are frequent
    logits, tokens, parents, draft_probs, root_logits, child_logits = _sampled_children_case(
        gen, v, COPIES, dtype, temperature, top_k, top_p)
    uniforms = torch.rand(COPIES, tokens.shape[1], generator=gen)
    out = _verify(device, logits, tokens, parents, temperature=temperature, top_k=top_k, top_p=top_p,
                  draft_probs=draft_probs, uniforms=uniforms)
    first = out.tokens[:, 0].cpu()
    assert_distribution(first, spec_probs(root_logits, temperature, top_k, top_p))
    accepted = out.num_accepted.cpu() >= 1
    path1 = out.path[:, 1].cpu()
    assert ((path1 >= 1) & (path1 <= 3))[accepted].all() and (path1[~accepted] == -1).all()
    assert (tokens.gather(1, path1.clamp(min=0)[:, None])[:, 0] == first)[accepted].all()
    tested = 0
    for s in range(v):
        given = accepted & (first == s)
        if given.sum() < 300:
            continue
        assert_distribution(out.tokens[:, 1].cpu()[given], spec_probs(child_logits[s], temperature, top_k, top_p))
        tested += 1
    assert tested >= 2


def test_reference_chi_square():
    """The reference's own sampling is distributed as p (both modes), on fewer samples (it is slow)."""
    gen = torch.Generator().manual_seed(77)
    copies = 1500
    logits, tokens, parents = _chi_square_tree(torch.float32, gen, v=8)
    logits, tokens, parents = logits[:copies], tokens[:copies], parents[:copies]
    uniforms = torch.rand(copies, tokens.shape[1], generator=gen)
    out = taps_ops.VerifyOutput(*verify_tree_ref(logits, tokens, parents, temperature=0.9, top_k=4, uniforms=uniforms))
    _check_tree_distribution(out, logits, 0.9, 4, 1.0, min_conditional=200)
    logits, tokens, parents, draft_probs, root_logits, _ = _sampled_children_case(gen, 6, copies, torch.float32, 1.0, 0, 1.0)
    uniforms = torch.rand(copies, tokens.shape[1], generator=gen)
    out = verify_tree_ref(logits, tokens, parents, temperature=1.0, draft_probs=draft_probs, uniforms=uniforms)
    assert_distribution(out[0][:, 0], spec_probs(root_logits, 1.0))


# ---------------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------------

def _valid_case(v=10):
    logits = torch.randn(2, 4, v)
    tokens = torch.tensor([[0, 1, 2, -1], [0, 3, 4, 5]])
    parents = torch.tensor([[-1, 0, 1, -1], [-1, 0, 0, 2]])
    return logits, tokens, parents


def _with(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def _bad_cases():
    logits, tokens, parents = _valid_case()
    u = torch.rand(2, 4)
    # (id, args, kwargs, message regex)
    return [
        ("logits_2d", (logits[0], tokens, parents), {}, "logits"),
        ("logits_f64", (logits.double(), tokens, parents), {}, "logits"),
        ("logits_int", (logits.long(), tokens, parents), {}, "logits"),
        ("tokens_shape", (logits, tokens[:, :3], parents), {}, "tokens"),
        ("tokens_batch", (logits, tokens[:1], parents), {}, "tokens"),
        ("tokens_int32", (logits, tokens.int(), parents), {}, "tokens"),
        ("parents_shape", (logits, tokens, parents[:, :3]), {}, "parents"),
        ("parents_float", (logits, tokens, parents.float()), {}, "parents"),
        ("uniforms_shape", (logits, tokens, parents), dict(uniforms=u[:, :3]), "uniforms"),
        ("uniforms_f64", (logits, tokens, parents), dict(uniforms=u.double()), "uniforms"),
        ("draft_probs_shape", (logits, tokens, parents), dict(temperature=1.0, draft_probs=torch.rand(2, 4, 9)), "draft_probs"),
        ("draft_probs_int", (logits, tokens, parents), dict(temperature=1.0, draft_probs=torch.ones(2, 4, 10, dtype=torch.long)), "draft_probs"),
        ("temperature_shape", (logits, tokens, parents), dict(temperature=torch.ones(3)), "temperature"),
        ("top_k_float_tensor", (logits, tokens, parents), dict(top_k=torch.ones(2)), "top_k"),
        ("root_parent", (logits, tokens, _with(parents, (0, 0), 0)), {}, "parent"),
        ("parent_self", (logits, tokens, _with(parents, (1, 2), 2)), {}, "parent"),
        ("parent_forward", (logits, tokens, _with(parents, (1, 1), 3)), {}, "parent"),
        ("parent_out_of_range", (logits, tokens, _with(parents, (1, 3), 17)), {}, "parent"),
        ("parent_negative", (logits, tokens, _with(parents, (1, 3), -5)), {}, "parent"),
        ("real_after_padding", (logits, _with(_with(tokens, (0, 2), -1), (0, 3), 4), _with(_with(parents, (0, 2), -1), (0, 3), 1)),
         {}, "padding|parent|token"),
        ("padding_with_token", (logits, _with(tokens, (0, 3), 4), parents), {}, "padding|parent|token"),
        ("token_ge_v", (logits, _with(tokens, (1, 2), 10), parents), {}, "token"),
        ("token_negative", (logits, _with(tokens, (1, 2), -1), parents), {}, "token|padding"),
        ("temperature_negative", (logits, tokens, parents), dict(temperature=-0.5), "temperature"),
        ("temperature_negative_tensor", (logits, tokens, parents), dict(temperature=torch.tensor([1.0, -0.5])), "temperature"),
        ("temperature_nan_tensor", (logits, tokens, parents), dict(temperature=torch.tensor([float("nan"), 1.0])), "temperature"),
        ("temperature_inf_tensor", (logits, tokens, parents), dict(temperature=torch.tensor([float("inf"), 1.0])), "temperature"),
        ("top_p_zero", (logits, tokens, parents), dict(temperature=1.0, top_p=0.0), "top_p"),
        ("top_p_above_one", (logits, tokens, parents), dict(temperature=1.0, top_p=1.5), "top_p"),
        ("top_p_tensor", (logits, tokens, parents), dict(temperature=1.0, top_p=torch.tensor([0.5, 1.01])), "top_p"),
        ("top_p_nan_tensor", (logits, tokens, parents), dict(temperature=1.0, top_p=torch.tensor([0.5, float("nan")])), "top_p"),
        ("top_k_negative", (logits, tokens, parents), dict(temperature=1.0, top_k=-1), "top_k"),
        ("top_k_negative_tensor", (logits, tokens, parents), dict(temperature=1.0, top_k=torch.tensor([0, -2])), "top_k"),
        ("uniforms_one", (logits, tokens, parents), dict(temperature=1.0, uniforms=_with(u, (1, 2), 1.0)), "uniforms"),
        ("uniforms_negative", (logits, tokens, parents), dict(temperature=1.0, uniforms=_with(u, (0, 0), -0.1)), "uniforms"),
        ("uniforms_nan", (logits, tokens, parents), dict(temperature=1.0, uniforms=_with(u, (0, 1), float("nan"))), "uniforms"),
        ("nan_logits_root", (_with(logits, (1, 0, 3), float("nan")), tokens, parents), {}, "nan|finite"),
        ("nan_logits_root_sampling", (_with(logits, (0, 0, 9), float("nan")), tokens, parents), dict(temperature=1.0), "nan|finite"),
        ("posinf_logits_root", (_with(logits, (0, 0, 2), float("inf")), tokens, parents), dict(temperature=1.0), "nan|finite|inf"),
        ("all_neginf_root", (_with(logits, (0, 0), float("-inf")), tokens, parents), dict(temperature=1.0), "nan|finite|inf"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises(device, case):
    _, args, kwargs, message = case
    with pytest.raises(BAD_INPUT, match=f"(?i){message}"):
        _verify(device, *args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()


def test_nan_logits_visited_after_acceptance(device):
    # greedy chain: root accepts node 1 whose row has NaN -> raises.
    logits = _one_hot_logits([5, 6, 7], 10)
    logits[0, 1, 0] = float("nan")
    with pytest.raises(BAD_INPUT, match="(?i)nan|finite"):
        _verify(device, logits, torch.tensor([[0, 5, 6]]), torch.tensor([[-1, 0, 1]]))


@pytest.mark.parametrize("mode", ["greedy", "sampling", "draft_probs"])
def test_nan_logits_unvisited_is_fine(device, mode):
    # root -> 5 -> 6, the root wants 7: node 1 and node 2 are never visited; their rows may hold NaN.
    logits = _one_hot_logits([7, 6, 1], 10) * 10
    logits[0, 1:, :] = float("nan")
    kw = dict(greedy=dict(), sampling=dict(temperature=1.0, uniforms=torch.tensor([[0.5, 0.5, 0.5]])),
              draft_probs=dict(temperature=1.0, uniforms=torch.tensor([[0.5, 0.99, 0.5]]),
                               draft_probs=torch.full((1, 3, 10), 0.1)))[mode]
    out = _verify(device, logits, torch.tensor([[0, 5, 6]]), torch.tensor([[-1, 0, 1]]), **kw)
    assert _as_lists(out) == [[[7, -1, -1]], [0], [[0, -1, -1]]]


@pytest.mark.skipif(not cuda_available(), reason="no GPU")
def test_device_mismatch_raises():
    logits, tokens, parents = _valid_case()
    for args in [(logits.cuda(), tokens, parents.cuda()), (logits.cuda(), tokens.cuda(), parents),
                 (logits, tokens.cuda(), parents.cuda())]:
        with pytest.raises(BAD_INPUT, match="(?i)device|cuda|cpu"):
            taps_ops.verify_tree(*args)
    with pytest.raises(BAD_INPUT, match="(?i)device|cuda|cpu"):
        taps_ops.verify_tree(logits.cuda(), tokens.cuda(), parents.cuda(), uniforms=torch.rand(2, 4))
    with pytest.raises(BAD_INPUT, match="(?i)device|cuda|cpu"):
        taps_ops.verify_tree(logits.cuda(), tokens.cuda(), parents.cuda(), temperature=1.0,
                             draft_probs=torch.rand(2, 4, 10))


# ---------------------------------------------------------------------------------------------------
# fuzzing: malformed trees and parameters never crash
# ---------------------------------------------------------------------------------------------------

def _check_valid_output(out, batch, n, v, tokens, parents):
    assert [tuple(t.shape) for t in out] == [(batch, n), (batch,), (batch, n)]
    toks, acc, path = (t.cpu() for t in out)
    for b in range(batch):
        a = int(acc[b])
        assert 0 <= a <= n - 1
        assert path[b, 0] == 0 and (path[b, a + 1:] == -1).all() and (toks[b, a + 1:] == -1).all()
        assert 0 <= toks[b, a] < v
        for k in range(1, a + 1):
            node = int(path[b, k])
            assert parents[b, node] == path[b, k - 1] and tokens[b, node] == toks[b, k - 1]


@st.composite
def _fuzz_case(draw):
    batch = draw(st.integers(0, 3))
    n = draw(st.integers(1, 6))
    v = draw(st.integers(1, 6))
    tokens = torch.tensor(draw(st.lists(st.lists(st.integers(-2, v + 1), min_size=n, max_size=n),
                                        min_size=batch, max_size=batch)), dtype=torch.int64).reshape(batch, n)
    parents = torch.tensor(draw(st.lists(st.lists(st.integers(-2, n), min_size=n, max_size=n),
                                         min_size=batch, max_size=batch)), dtype=torch.int64).reshape(batch, n)
    if draw(st.booleans()):  # often a well-formed tree, so that the valid path is exercised too
        gen = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
        if batch > 0:
            tokens, parents = random_trees(batch, n, v, gen)
    special = st.sampled_from([0.0, 1.0, -1.0, 3.0, float("nan"), float("inf"), float("-inf")])
    logits = torch.randn(batch, n, v)
    for _ in range(draw(st.integers(0, 2))):
        if batch:
            logits[draw(st.integers(0, batch - 1)), draw(st.integers(0, n - 1)), draw(st.integers(0, v - 1))] = draw(special)
    # mostly valid values, so that a good share of the cases pass validation
    coins = [0.0, 0.3, 0.999, 0.7] + ([1.0, -0.5, float("nan")] if draw(st.booleans()) else [])
    kw = dict(
        temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 0.0, 2.0, -1.0, float("nan")])),
        top_k=draw(st.sampled_from([0, 1, 2, 0, -1])),
        top_p=draw(st.sampled_from([1.0, 0.5, 0.9, 0.0, 1.5])),
        uniforms=torch.tensor(draw(st.lists(st.sampled_from(coins), min_size=batch * n, max_size=batch * n)),
                              dtype=torch.float32).reshape(batch, n),
        validate=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
    )
    if draw(st.booleans()):
        kw["draft_probs"] = torch.rand(batch, n, v)
    return logits, tokens, parents, kw


def test_fuzz_never_crashes(device):
    outcomes = {"raised": 0, "returned": 0}

    @settings(max_examples=150, deadline=2000, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(case=_fuzz_case())
    def run(case):
        logits, tokens, parents, kw = case
        kw = dict(kw)
        dtype = kw.pop("dtype")
        batch, n, v = logits.shape
        try:
            out = _verify(device, logits.to(dtype), tokens, parents, **kw)
            if device == "cuda":
                torch.cuda.synchronize()
        except BAD_INPUT:
            outcomes["raised"] += 1
            return
        outcomes["returned"] += 1
        if kw.pop("validate"):
            # accepted input must be valid: the outputs are a real accepted path, the reference's.
            _check_valid_output(out, batch, n, v, tokens, parents)
            assert_matches_reference(out, (logits.to(dtype), tokens, parents), kw)
        else:
            assert [tuple(t.shape) for t in out] == [(batch, n), (batch,), (batch, n)]

    run()
    # both branches must have been exercised for the fuzzing to mean anything
    assert outcomes["raised"] >= 20 and outcomes["returned"] >= 20, outcomes


# ---------------------------------------------------------------------------------------------------
# opcheck and torch.compile
# ---------------------------------------------------------------------------------------------------

def _op_samples(device):
    gen = torch.Generator().manual_seed(8)
    tokens, parents = random_trees(3, 7, 20, gen)
    logits = random_logits(tokens, parents, 20, torch.float32, gen)
    u = torch.rand(3, 7, generator=gen)
    f32 = dict(dtype=torch.float32)
    temp, top_k, top_p = torch.tensor([0.0, 0.7, 1.0], **f32), torch.tensor([0, 3, 0]), torch.tensor([1.0, 0.9, 0.5], **f32)
    dp = torch.softmax(torch.randn(3, 7, 20, generator=gen), -1)
    samples = [
        (logits, tokens, parents, temp, top_k, top_p, None, u, True),
        (logits.bfloat16(), tokens, parents, temp, top_k, top_p, dp, u, True),
        (logits.half(), tokens, parents, temp, top_k, top_p, None, u, False),
    ]
    return [tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in s) for s in samples]


def test_opcheck(device):
    for args in _op_samples(device):
        torch.library.opcheck(torch.ops.taps_ops.verify_tree.default, args)


def test_torch_compile_fullgraph(device):
    gen = torch.Generator().manual_seed(9)
    tokens, parents = random_trees(4, 9, 30, gen)
    logits = random_logits(tokens, parents, 30, torch.float32, gen).to(device)
    tokens, parents = tokens.to(device), parents.to(device)
    u = torch.rand(4, 9, generator=gen).to(device)
    temperature = torch.tensor([0.0, 0.8, 1.0, 1.5], device=device)
    dp = torch.softmax(torch.randn(4, 9, 30, generator=gen), -1).to(device)

    def step(logits, tokens, parents, u, temperature, dp):
        a = taps_ops.verify_tree(logits, tokens, parents, temperature=0.8, top_k=10, uniforms=u)
        b = taps_ops.verify_tree(logits, tokens, parents, temperature=temperature, top_p=0.9, draft_probs=dp,
                                 uniforms=u, validate=False)
        return a.tokens, a.num_accepted, a.path, b.tokens, b.num_accepted, b.path

    assert_compiles_like_eager(step, logits, tokens, parents, u, temperature, dp)
