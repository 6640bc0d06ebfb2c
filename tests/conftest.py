"""Shared pytest fixtures of the taps_ops suites.

`device` runs a test on "cpu" and on "cuda"; the CUDA case is skipped when there is no GPU, and fails
when there is one but the extension was built without its CUDA kernels (a silent skip there would hide
every CUDA kernel from the suite). Every test starts from a fixed torch seed.
"""

import contextlib

import pytest
import torch

import taps_ops


def cuda_available() -> bool:
    """True when a GPU is present (CUDA tests then need the extension's CUDA kernels)."""
    return torch.cuda.is_available()


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not cuda_available(), reason="no GPU")),
]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """The device a test runs on: "cpu", then "cuda" when a GPU is present."""
    if request.param == "cuda":
        assert taps_ops.has_cuda_kernels(), "a GPU is present but taps_ops was built without its CUDA kernels"
    return request.param


@contextlib.contextmanager
def one_torch_thread():
    """Run with one torch thread: for tiny models a second thread only adds waiting (on 2 shared cores
    the engine suites take several times the CPU time with two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """The test runs with one torch thread (modules of tiny models: ``pytestmark =
    pytest.mark.usefixtures("one_thread")``)."""
    with one_torch_thread():
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def verify_on(device, logits, tokens, parents, **kw):
    """taps_ops.verify_tree with every tensor argument moved to `device`."""
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return taps_ops.verify_tree(logits.to(device), tokens.to(device), parents.to(device), **kw)


def tree_lists(tree):
    """The fields of a build_tree / merge_trees output as nested Python lists."""
    return [t.cpu().tolist() for t in tree]


def assert_literal_tree(tree, tokens, parents, depth, mask, scores, last):
    """Compare a one-request tree with literal lists (mask: one int per row, < 2**63; `last` is
    candidate_index for build_tree, source for merge_trees)."""
    got = tree_lists(tree)
    assert got[0] == [tokens]
    assert got[1] == [parents]
    assert got[2] == [depth]
    assert got[3] == [[[m] for m in mask]]
    assert got[4] == [pytest.approx(scores)]
    assert got[5] == [last]


def check_tree_invariants(tree, last_field_padding: int = -1) -> None:
    """Assert the tree format of DESIGN.md on a build_tree / merge_trees output: real nodes first with
    topological parents, depth = parent's depth + 1, the ancestor bitmask consistent with the parents,
    siblings best first, breadth-first order, and well-formed padding."""
    tokens, parents, depth, mask, scores, last = (t.cpu() for t in tree)
    batch, n = tokens.shape
    words = (n + 63) // 64
    assert tuple(mask.shape) == (batch, n, words)
    assert tokens.dtype == parents.dtype == depth.dtype == mask.dtype == last.dtype == torch.int64
    assert scores.dtype == torch.float32
    for b in range(batch):
        assert parents[b, 0] == -1 and depth[b, 0] == 0 and scores[b, 0] == 0
        bits = [1]
        real = 1
        while real < n and parents[b, real] >= 0:
            real += 1
        for i in range(1, n):
            if i < real:
                p = int(parents[b, i])
                assert 0 <= p < i, f"node {i} of request {b}: parent {p} not topological"
                assert tokens[b, i] >= 0
                assert depth[b, i] == depth[b, p] + 1
                assert depth[b, i] >= depth[b, i - 1], "not breadth first"
                if depth[b, i] == depth[b, i - 1]:
                    assert p >= parents[b, i - 1], "one depth not ordered by parent"
                bits.append(bits[p] | (1 << i))
                if i > 1 and parents[b, i - 1] == p:
                    assert scores[b, i - 1] >= scores[b, i], "siblings not ordered by score"
            else:
                assert tokens[b, i] == -1 and parents[b, i] == -1 and depth[b, i] == -1
                assert scores[b, i] == float("-inf") and last[b, i] == last_field_padding
                bits.append(0)
        for i in range(n):
            for w in range(words):
                word = (bits[i] >> (64 * w)) & ((1 << 64) - 1)
                word = word - (1 << 64) if word >= (1 << 63) else word
                assert mask[b, i, w] == word, f"tree_mask row {i} word {w} of request {b}"


def assert_compiles_like_eager(fn, *args):
    """``torch.compile(fn, fullgraph=True)`` gives what eager ``fn`` gives (tensors or lists of tensors
    in, a tuple of tensors out). The aot_eager backend traces the ops through their fake (shape)
    implementations and functionalisation, as every compiler backend does. Each run gets fresh clones
    of the inputs, so in-place ops are compared through the tensors fn returns."""
    def fresh():
        return [[t.clone() for t in a] if isinstance(a, list) else a.clone() if isinstance(a, torch.Tensor) else a
                for a in args]

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(*fresh()), fn(*fresh())
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype and g.device == w.device, f"output {i}"
        assert torch.equal(g, w), f"output {i} differs from eager"


def assert_modes_see_op(call, op, want):
    """``call()`` gives `want` under a torch-function mode and a dispatch mode, and each mode sees `op` (an
    OpOverload): what a wrapper's fast entry must keep of torch.ops' dispatch."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class FunctionMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(("function", func))
            return func(*args, **(kwargs or {}))

    class DispatchMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(("dispatch", func))
            return func(*args, **(kwargs or {}))

    for mode in (FunctionMode, DispatchMode):
        seen.clear()
        with mode():
            assert torch.equal(call(), want)
        assert (mode is FunctionMode and ("function", op) in seen) or ("dispatch", op) in seen, mode.__name__


def fuzz_against_reference(device, cases, reference, op, fields, max_examples=150):
    """Hypothesis fuzzing of a tree op: for every drawn case (a tuple of op arguments), the op raises on
    `device` exactly when `reference` raises ValueError, and otherwise returns the reference's outputs
    (compared field by field). Both outcomes must occur at least 20 times."""
    from hypothesis import HealthCheck, given, settings

    outcomes = {"raised": 0, "returned": 0}

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)
    @given(case=cases)
    def run(case):
        try:
            want = reference(*case)
        except ValueError:
            want = None
        try:
            got = op(device, *case)
            if device == "cuda":
                torch.cuda.synchronize()
        except (RuntimeError, ValueError, TypeError, IndexError):
            assert want is None, "the op refused an input the reference accepts"
            outcomes["raised"] += 1
            return
        assert want is not None, "the op accepted an input the reference refuses"
        outcomes["returned"] += 1
        for name, g, w in zip(fields, got, want):
            assert torch.equal(g.cpu(), w), name

    run()
    assert outcomes["raised"] >= 20 and outcomes["returned"] >= 20, outcomes
