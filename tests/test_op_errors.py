"""One exception type for bad op input: every taps_ops op raises ValueError (a message starting
``taps_ops:``) on a bad shape, dtype, value or tree, and ``taps_ops.reference`` is an attribute of the
package without a separate import."""

import subprocess
import sys

import pytest
import torch

import taps_ops


def _verify(logits=None, parents=None, **kw):
    logits = torch.randn(1, 3, 7) if logits is None else logits
    parents = torch.tensor([[-1, 0, 0]]) if parents is None else parents
    return lambda: taps_ops.verify_tree(logits, torch.tensor([[1, 2, 3]]), parents, **kw)


def _candidates(parents=(-1, -1, 0, 1), scores=None):
    scores = torch.tensor([[-0.1, -0.2, -0.3, -0.4]]) if scores is None else scores
    return scores, torch.tensor([[4, 5, 6, 7]]), torch.tensor([list(parents)])


def _attention(kv_lens=(6,), q_dtype=torch.float32, num_queries=None):
    q = torch.randn(1, 2, 3, 8, dtype=q_dtype)
    k = v = torch.randn(1, 1, 8, 8)
    mask = torch.tensor([[[1], [3], [5]]])
    return lambda: taps_ops.tree_attention(q, k, v, mask, torch.tensor(list(kv_lens)), num_queries=num_queries)


def _compact(path=((0, 1, -1),), dtype=torch.int64):
    caches = [torch.randn(1, 1, 8, 4)]
    return lambda: taps_ops.compact_kv(caches, torch.tensor(path, dtype=dtype), torch.tensor([2]))


def _stacked_trees(n_scores=3):
    tokens = torch.tensor([[[1, 2, 3], [1, 2, 4]]])
    parents = torch.tensor([[[-1, 0, 0], [-1, 0, 1]]])
    return lambda: taps_ops.merge_trees(tokens, parents, torch.zeros(1, 2, n_scores))


def _decoder_layer_without_weights():
    x = torch.randn(1, 2, 8)
    cache = torch.zeros(1, 1, 4, 4)
    rope = torch.ones(1, 2, 1, 4)
    return lambda: taps_ops.decoder_layer(x, [None] * 3, [1e-6] * 3, [2, 1, 4, 1], rope, rope, cache, cache, 0,
                                          torch.ones(1, 2, 1, dtype=torch.int64), torch.tensor([2]), 0.5)


def _store(tokens=(-1, 3, 4, -1), ends=(1, 2), cols=((3, 4), (-1, 3)), depth=2, vote=4):
    return lambda: taps_ops.token_store_continuation(
        torch.tensor(tokens, dtype=torch.int32), torch.tensor(ends), torch.tensor(cols, dtype=torch.int32), [3],
        depth, 1, vote)


def _table(op, keys=(0, 9), starts=(0, 1, 2), contexts=((1, 2),), temperature=1.0):
    # (vocab 4: the 1-token context (3,) has key 1 * 5 + 4 = 9)
    arrays = (torch.tensor(keys), torch.tensor([3, 1]), torch.tensor(starts), torch.tensor([1, 2]),
              torch.tensor([-1.0, -2.0]))
    if op == "logits":
        return lambda: taps_ops.ngram_table_logits(*arrays, torch.tensor(contexts), 4, 1)
    return lambda: taps_ops.ngram_table_draw(*arrays, torch.tensor(contexts), torch.rand(1, 2),
                                             torch.tensor([temperature]), 1, 2, 4, 1)


CASES = [
    ("verify_tree: parent not topological", _verify(parents=torch.tensor([[-1, 2, 0]]))),
    ("verify_tree: integer logits", _verify(logits=torch.zeros(1, 3, 7, dtype=torch.int64))),
    ("verify_tree: negative temperature", _verify(temperature=-1.0)),
    ("verify_tree: fractional top_k", _verify(top_k=2.5)),
    ("verify_tree: uniforms of the wrong shape", _verify(uniforms=torch.rand(1, 2))),
    ("build_tree: parent after its child", lambda: taps_ops.build_tree(*_candidates((-1, 3, 0, 1)), 3)),
    ("build_tree: float64 scores", lambda: taps_ops.build_tree(*_candidates(scores=torch.zeros(1, 4).double()), 3)),
    ("build_tree: num_nodes 0", lambda: taps_ops.build_tree(*_candidates(), 0)),
    ("merge_trees: scores of another shape", _stacked_trees(n_scores=2)),
    ("tree_attention: float64 q", _attention(q_dtype=torch.float64)),
    ("tree_attention: kv_lens of the wrong shape", _attention(kv_lens=(6, 6))),
    ("tree_attention: kv_lens below the tree", _attention(kv_lens=(2,))),
    ("tree_attention: num_queries past N", _attention(num_queries=torch.tensor([4]))),
    ("compact_kv: int32 path", _compact(dtype=torch.int32)),
    ("compact_kv: path not increasing", _compact(path=((0, 2, 1),))),
    ("rms_norm: weight of another width", lambda: taps_ops.rms_norm(torch.randn(2, 6), torch.ones(5), 1e-6)),
    ("rope_: cos of another shape", lambda: taps_ops.rope_(torch.randn(1, 2, 1, 4), torch.ones(1, 3, 4),
                                                           torch.ones(1, 3, 4))),
    ("expand_level: k of 0", lambda: taps_ops.expand_level(torch.randn(1, 2, 7), torch.zeros(1, 2),
                                                            torch.tensor([[-1, -1]]), 0)),
    ("decoder_layer: too few weights", _decoder_layer_without_weights()),
    ("token_store_continuation: ends past the tokens", _store(ends=(9, 2))),
    ("token_store_continuation: ends of another length", _store(ends=(1,))),
    ("token_store_continuation: int64 cols", lambda: taps_ops.token_store_continuation(
        torch.tensor([-1, 3], dtype=torch.int32), torch.tensor([1]), torch.tensor([[3]]), [3], 1)),
    ("token_store_continuation: negative depth", _store(depth=-1)),
    ("token_store_continuation: vote 0", _store(vote=0)),
    ("ngram_table_logits: context past the vocabulary", _table("logits", contexts=((3, 9),))),
    ("ngram_table_logits: no order-0 context", _table("logits", keys=(5, 9))),
    ("ngram_table_draw: temperature below 0", _table("draw", temperature=-0.5)),
    ("ngram_table_draw: start past the entries", _table("draw", starts=(0, 1, 7), contexts=((1, 3),))),
]


@pytest.mark.parametrize("name, call", CASES, ids=lambda c: c if isinstance(c, str) else "")
def test_bad_input_raises_value_error(name, call):
    with pytest.raises(ValueError, match="^taps_ops"):
        call()


def test_reference_is_an_attribute_of_the_package():
    code = "import taps_ops; print(taps_ops.reference.verify_tree_ref.__name__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "verify_tree_ref", run.stderr


def test_a_library_built_from_older_sources_is_named_at_import(monkeypatch):
    """A compiled library that lacks an op this package calls (an in-place build not redone after an
    update) fails at import with its path, the missing ops and how to rebuild, not later with the
    dispatcher's "operator does not exist"; the library loaded here has every op."""
    taps_ops._check_library("loaded", "fix")
    monkeypatch.setattr(taps_ops, "_OPS", taps_ops._OPS + ("no_such_op",))
    with pytest.raises(ImportError, match=r"/x/_C\.so was built from older sources: it lacks the op\(s\) no_such_op; "
                                          r"rebuild"):
        taps_ops._check_library("/x/_C.so", "rebuild it")
    # an op whose schema lacks an argument the package passes (built before the op grew it)
    monkeypatch.setattr(taps_ops, "_OPS", taps_ops._OPS[:-1])
    monkeypatch.setattr(taps_ops, "_NEWEST_ARGUMENTS", {"tree_attention": ("num_queries", "no_such_argument")})
    with pytest.raises(ImportError, match=r"lacks the op\(s\) tree_attention\(no_such_argument=\); rebuild"):
        taps_ops._check_library("/x/_C.so", "rebuild it")
