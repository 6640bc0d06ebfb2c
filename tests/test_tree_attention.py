"""taps_ops.tree_attention against the float64 dense-mask reference (taps_ops.reference).

Accuracy rule: in fp32 (flash-attention's) the kernel's max error against the float64 reference is at
most twice the error of plain PyTorch attention in fp32, plus a small floor; in bf16 / fp16 every
element's error is at most 4x the error a correct kernel can make there (see check_accuracy).
"""

import math

import pytest
import torch

import taps_ops
from taps_ops.reference import tree_attention_dense_mask, tree_attention_ref

from conftest import assert_compiles_like_eager, assert_modes_see_op

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_tree_mask(batch: int, num_nodes: int, words: int = None) -> torch.Tensor:
    """Ancestor bitmasks of random trees (parent of node i uniform in [0, i)), [B, N, W] int64."""
    words = words or (num_nodes + 63) // 64
    parents = [[int(torch.randint(0, i, ())) if i else -1 for i in range(num_nodes)] for _ in range(batch)]
    bits = torch.zeros(batch, num_nodes, num_nodes, dtype=torch.bool)
    for b in range(batch):
        for i in range(num_nodes):
            bits[b, i, i] = True
            if i:
                bits[b, i] |= bits[b, parents[b][i]]
    mask = torch.zeros(batch, num_nodes, words, dtype=torch.int64)
    for j in range(num_nodes):
        mask[:, :, j // 64] |= bits[:, :, j].long() << (j % 64)
    return mask


def make_inputs(batch, heads_q, heads_kv, num_nodes, head_dim, cache_len, dtype, device, ragged=True):
    q = torch.randn(batch, heads_q, num_nodes, head_dim, dtype=dtype)
    k = torch.randn(batch, heads_kv, cache_len, head_dim, dtype=dtype)
    v = torch.randn(batch, heads_kv, cache_len, head_dim, dtype=dtype)
    if ragged:
        kv_lens = torch.randint(num_nodes, cache_len + 1, (batch,))
        kv_lens[0] = cache_len
        kv_lens[-1] = num_nodes if batch > 1 else kv_lens[-1]
    else:
        kv_lens = torch.full((batch,), cache_len)
    mask = random_tree_mask(batch, num_nodes)
    return [t.to(device) for t in (q, k, v, mask, kv_lens)]


def _half_error_scale(q, k, v, mask, kv_lens, scale, ref, tree_nodes=None):
    """Per-element error a correct bf16 / fp16 kernel may make, [B, Hq, N, D] float64: rounding the
    output (half an ulp of the exact value) plus rounding the probabilities P to the dtype before P.V
    (as the tensor-core kernel and flash attention do): sum_j delta_j p_j v_j with |delta_j| <= u (the
    dtype's unit roundoff) and random signs, whose size is u * sqrt(sum_j p_j^2 v_j^2), plus the same
    for the normaliser, u * |out| * sqrt(sum_j p_j^2)."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[q.dtype]
    unit = 2.0 ** -(mantissa + 1)
    dense = tree_attention_dense_mask(mask.cpu(), kv_lens.cpu(), k.shape[2], tree_nodes)[:, None]
    group = q.shape[1] // k.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    kf, vf = (t.cpu().double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.cpu().double() @ kf.transpose(-1, -2)) * scale
    p2 = torch.softmax(scores.masked_fill(~dense, float("-inf")), -1).nan_to_num(0.0) ** 2
    magnitude = ref.abs().clamp_min(torch.finfo(q.dtype).tiny)
    ulp = 2.0 ** (torch.floor(torch.log2(magnitude)) - mantissa)
    return 0.5 * ulp + unit * ((p2 @ vf ** 2).sqrt() + ref.abs() * p2.sum(-1, keepdim=True).sqrt())


def check_accuracy(q, k, v, mask, kv_lens, scale=None, tree_nodes=None):
    """fp32: the kernel's max error against the float64 reference is at most twice plain PyTorch's in
    fp32 (flash-attention's rule). bf16 / fp16, where plain PyTorch's error is much larger than a good
    kernel's: every element's error is at most 4x the error scale of a correct kernel
    (_half_error_scale; the CPU kernel makes about 0.3 of it, the output rounding alone)."""
    out = taps_ops.tree_attention(q, k, v, mask, kv_lens, scale, tree_nodes=tree_nodes)
    assert out.dtype == q.dtype and out.shape == q.shape and out.device == q.device
    ref = tree_attention_ref(q.cpu(), k.cpu(), v.cpu(), mask.cpu(), kv_lens.cpu(), scale, tree_nodes=tree_nodes)
    err = (out.cpu().double() - ref).abs()
    if q.dtype == torch.float32:
        plain = tree_attention_ref(q.cpu(), k.cpu(), v.cpu(), mask.cpu(), kv_lens.cpu(), scale, dtype=q.dtype,
                                   tree_nodes=tree_nodes)
        plain_err = (plain.double() - ref).abs().max().item()
        assert err.max().item() <= 2 * plain_err + 1e-5, (err.max().item(), plain_err)
        return
    ratio = err / _half_error_scale(q, k, v, mask, kv_lens, scale, ref, tree_nodes)
    worst = int(ratio.argmax())
    assert ratio.max().item() <= 4.0, (f"error {err.flatten()[worst].item():.3g} at element {worst} is "
                                       f"{ratio.max().item():.2f}x the error scale of a correct kernel "
                                       f"(value {ref.flatten()[worst].item():.4g})")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_nodes,cache_len", [(1, 50), (7, 257), (65, 257), (130, 1000), (7, 1000)])
def test_matches_reference(device, dtype, num_nodes, cache_len):
    check_accuracy(*make_inputs(3, 8, 2, num_nodes, 64, cache_len, dtype, device))


def make_level_inputs(batch, heads_q, heads_kv, num_queries, tree_nodes, head_dim, cache_len, dtype, device):
    """Inputs of a drafter's expansion level: a random tree of T = tree_nodes nodes after each request's
    prefix, queries for its newest N = num_queries nodes (mask rows: their ancestors and themselves)."""
    q, k, v, _, _ = make_inputs(batch, heads_q, heads_kv, num_queries, head_dim, cache_len, dtype, "cpu")
    mask = random_tree_mask(batch, tree_nodes)[:, tree_nodes - num_queries:].contiguous()
    kv_lens = torch.randint(tree_nodes, cache_len + 1, (batch,))
    kv_lens[0] = cache_len
    kv_lens[-1] = tree_nodes if batch > 1 else kv_lens[-1]
    return [t.to(device) for t in (q, k, v, mask, kv_lens)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_queries,tree_nodes,cache_len", [(8, 8, 50), (8, 32, 157), (5, 67, 200), (1, 40, 41),
                                                              (13, 130, 300)])
def test_tree_nodes_matches_reference(device, dtype, num_queries, tree_nodes, cache_len):
    # queries for only the newest N of T tree nodes (a drafter's expansion level), 1-3 mask words, a request
    # without a prefix (kv_lens = T)
    args = make_level_inputs(3, 4, 2, num_queries, tree_nodes, 64, cache_len, dtype, device)
    check_accuracy(*args, tree_nodes=tree_nodes)


def test_tree_nodes_semantics():
    # Independent of the reference's mask builder: keys before L - T are visible, key L - T + j iff bit j.
    torch.manual_seed(3)
    q, k, v, mask, kv_lens = make_level_inputs(2, 4, 4, 6, 45, 16, 90, torch.float32, "cpu")
    out = taps_ops.tree_attention(q, k, v, mask, kv_lens, tree_nodes=45)
    for b in range(2):
        length = int(kv_lens[b])
        dense = torch.zeros(6, 90, dtype=torch.bool)
        dense[:, :length - 45] = True
        for i in range(6):
            for j in range(45):
                dense[i, length - 45 + j] = bool((int(mask[b, i, j // 64]) >> (j % 64)) & 1)
        want = torch.nn.functional.scaled_dot_product_attention(q[b:b + 1].double(), k[b:b + 1].double(),
                                                                v[b:b + 1].double(), attn_mask=dense)
        torch.testing.assert_close(out[b:b + 1].double(), want, atol=2e-5, rtol=1e-5)
    # T = N is the default
    q, k, v, mask, kv_lens = make_inputs(2, 4, 2, 7, 64, 40, torch.float32, "cpu")
    assert torch.equal(taps_ops.tree_attention(q, k, v, mask, kv_lens, tree_nodes=7),
                       taps_ops.tree_attention(q, k, v, mask, kv_lens))


@pytest.mark.parametrize(
    "tree_nodes,words,lens,message",
    [(6, 1, 40, "tree_nodes = 6 must be at least N = 7"),
     (65, 1, 70, "ceil\\(T / 64\\) = 2"),
     (30, 1, 20, "kv_lens"),
     (41, 1, 40, "kv_lens")],
)
def test_tree_nodes_bad_inputs(tree_nodes, words, lens, message):
    q = torch.randn(1, 4, 7, 64)
    k = torch.randn(1, 2, 40, 64)
    v = torch.randn_like(k)
    mask = torch.full((1, 7, words), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match=message):
        taps_ops.tree_attention(q, k, v, mask, torch.tensor([lens]), tree_nodes=tree_nodes)


def test_tree_nodes_opcheck(device):
    args = make_level_inputs(2, 4, 2, 5, 37, 64, 60, torch.float32, device)
    torch.library.opcheck(torch.ops.taps_ops.tree_attention.default, (*args, 0.125, True, 37))


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256, 40, 4])
def test_head_dims(device, head_dim):
    # CUDA: 40 and 4 are zero-padded to the compiled 64 and 32
    check_accuracy(*make_inputs(2, 4, 4, 7, head_dim, 100, torch.float32, device))


# CPU fast path (cpu/tree_attention_fast.h): G * N query rows per KV head in micro-kernel row blocks of 6
# (a remainder of 1-3 rows split 7 = 4 + 3, 8 = 4 + 4, 9 = 5 + 4), 64-key tiles whose score columns stop at
# the first whole vector past the last key, masks only on tiles that reach the tree or the keys' end,
# the next tile's K / V prefetched (contiguous rows or rows further apart than D); a last tile of 24 keys
# (AVX2: score columns in a block of 16 and one of 8).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads_q,heads_kv,num_nodes", [(1, 1, 1), (2, 2, 7), (1, 1, 8), (3, 1, 3), (1, 1, 13),
                                                        (4, 2, 16), (1, 1, 33)])
@pytest.mark.parametrize("head_dim,cache_len", [(8, 65), (24, 200), (40, 64), (64, 130), (40, 88)])
def test_fast_path_row_blocks_and_ragged_tiles(dtype, heads_q, heads_kv, num_nodes, head_dim, cache_len):
    batch = 3
    cache_len = max(cache_len, num_nodes)
    q, k, v, mask, kv_lens = make_inputs(batch, heads_q, heads_kv, num_nodes, head_dim, cache_len, dtype, "cpu")
    kv_lens[1] = min(cache_len, num_nodes + 64)  # a tree that starts exactly one tile in
    check_accuracy(q, k, v, mask, kv_lens)
    # K / V rows further apart than D (the prefetch walks row by row)
    wide = [torch.zeros(*t.shape[:3], head_dim + 5, dtype=dtype) for t in (k, v)]
    wide[0][..., :head_dim], wide[1][..., :head_dim] = k, v
    check_accuracy(q, wide[0][..., :head_dim], wide[1][..., :head_dim], mask, kv_lens)


def test_scores_far_below_the_max():
    # scores 130+ below a row's max in base 2 (2^-130 is past float32's normal range): those keys weigh 0,
    # the rest must still be right (the fast path's exp2 clamps at -127)
    q, k, v, mask, kv_lens = make_inputs(2, 4, 2, 5, 32, 150, torch.float32, "cpu", ragged=False)
    k = k * torch.linspace(0.0, 30.0, 150).view(1, 1, 150, 1)
    check_accuracy(q, k, v, mask, kv_lens, scale=4.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256, 40])
def test_head_dims_half(device, dtype, head_dim):
    # G * N = 4 * 9 = 36 query rows per KV head: on CUDA the tensor-core kernel (3 m-tiles, the last
    # partial), with one K/V tile partly past the cache end.
    check_accuracy(*make_inputs(2, 8, 2, 9, head_dim, 300, dtype, device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_large_group_half(device, dtype):
    # G * N = 4 * 70 = 280 rows at D = 128: on CUDA two row blocks of the tensor-core kernel (256 + 24
    # rows), two mask words, and key splits merged by log-sum-exp.
    check_accuracy(*make_inputs(1, 4, 1, 70, 128, 2000, dtype, device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_unaligned_half_rows(device, dtype):
    # Rows that are not 16-byte aligned (q starts 4 elements into its storage, k / v rows 68 elements
    # apart): on CUDA the tensor-core kernel cannot load them 16 bytes at a time, so the SIMT kernel
    # runs. The answer must be the same either way.
    q, k, v, mask, kv_lens = make_inputs(2, 8, 2, 9, 64, 120, dtype, device)
    q_big = torch.zeros(*q.shape[:3], 72, dtype=dtype, device=device)
    q_big[..., 4:68] = q
    k_big = torch.zeros(*k.shape[:3], 68, dtype=dtype, device=device)
    v_big = torch.zeros_like(k_big)
    k_big[..., :64], v_big[..., :64] = k, v
    out = taps_ops.tree_attention(q_big[..., 4:68], k_big[..., :64], v_big[..., :64], mask, kv_lens)
    torch.testing.assert_close(out, taps_ops.tree_attention(q, k, v, mask, kv_lens), atol=2e-2, rtol=2e-2)
    check_accuracy(q_big[..., 4:68], k_big[..., :64], v_big[..., :64], mask, kv_lens)


@pytest.mark.parametrize("heads", [(1, 1), (4, 1), (6, 3), (8, 8)])
def test_gqa_and_long_split(device, heads):
    # B * Hkv small and a long cache: the CPU kernel splits the keys and merges by log-sum-exp.
    check_accuracy(*make_inputs(1, heads[0], heads[1], 9, 64, 1500, torch.float32, device))


def test_scale_and_strided_inputs(device):
    q, k, v, mask, kv_lens = make_inputs(2, 4, 2, 5, 64, 60, torch.float32, device)
    # q as a transposed view ([B, N, Hq, D] storage), k/v as slices of a longer cache.
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    big_k = torch.randn(2, 2, 80, 64, device=device)
    big_k[:, :, :60] = k
    big_v = torch.randn(2, 2, 80, 64, device=device)
    big_v[:, :, :60] = v
    out = taps_ops.tree_attention(q_t, big_k[:, :, :60], big_v[:, :, :60], mask, kv_lens, 0.3)
    ref = tree_attention_ref(q.cpu(), k.cpu(), v.cpu(), mask.cpu(), kv_lens.cpu(), 0.3)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)
    # Non-contiguous feature dim is accepted too (copied).
    out2 = taps_ops.tree_attention(q, k, v.transpose(2, 3).contiguous().transpose(2, 3), mask, kv_lens, 0.3)
    torch.testing.assert_close(out2.cpu().double(), ref, atol=1e-5, rtol=1e-5)


def test_literal_tree(device):
    # Prefix of 2 keys, a chain 0 -> 1 and a sibling 2 of 1: query 2 must not see node 1.
    q = torch.zeros(1, 1, 3, 4, device=device)
    k = torch.zeros(1, 1, 5, 4, device=device)  # all scores 0: uniform over the visible keys
    v = torch.arange(5, dtype=torch.float32, device=device).view(1, 1, 5, 1).expand(1, 1, 5, 4).contiguous()
    mask = torch.tensor([[[0b001], [0b011], [0b101]]], device=device)
    out = taps_ops.tree_attention(q, k, v, mask, torch.tensor([5], device=device))
    expected = torch.tensor([(0 + 1 + 2) / 3, (0 + 1 + 2 + 3) / 4, (0 + 1 + 2 + 4) / 4], device=device)
    torch.testing.assert_close(out[0, 0, :, 0], expected)


def test_head_dim_over_256(device):
    if device == "cpu":
        pytest.skip("the CPU kernels take any head dim")
    q, k, v, mask, kv_lens = make_inputs(1, 1, 1, 2, 264, 8, torch.float32, device, ragged=False)
    with pytest.raises(ValueError, match="head dims up to 256"):
        taps_ops.tree_attention(q, k, v, mask, kv_lens)


def test_wider_mask_and_padding_rows(device):
    # W larger than needed is accepted; a row that sees nothing at all (malformed) gives zeros.
    q, k, v, mask, kv_lens = make_inputs(2, 2, 1, 3, 64, 3, torch.float32, device, ragged=False)
    wide = torch.cat([mask, torch.zeros_like(mask)], dim=2)
    wide[:, 2] = 0
    out = taps_ops.tree_attention(q, k, v, wide, kv_lens)
    assert torch.all(out[:, :, 2] == 0)
    ref = tree_attention_ref(q.cpu(), k.cpu(), v.cpu(), wide.cpu(), kv_lens.cpu())
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck(device, dtype):
    # every dtype: the shape function must give the kernel's output dtype too (compiled graphs are
    # traced with it)
    args = make_inputs(2, 4, 2, 7, 64, 40, dtype, device)
    torch.library.opcheck(torch.ops.taps_ops.tree_attention.default, (*args, 0.125))
    # q as a model computes it: [B, N, Hq, D] memory seen as [B, Hq, N, D]; the output is contiguous and
    # the shape function must say so (an empty_like(q) fake broke torch.compile on exactly this input)
    q = args[0].transpose(1, 2).contiguous().transpose(1, 2)
    torch.library.opcheck(torch.ops.taps_ops.tree_attention.default, (q, *args[1:], 0.125))
    assert torch.ops.taps_ops.tree_attention.default(q, *args[1:], 0.125, True).is_contiguous()


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(kv_lens=a["kv_lens"] * 0 + 2), "kv_lens"),
        (lambda a: a.update(kv_lens=a["kv_lens"] * 0 + 41), "kv_lens"),
        (lambda a: a.update(q=a["q"][:, :3]), "multiple of Hkv"),
        (lambda a: a.update(tree_mask=a["tree_mask"][:, :, :0]), "ceil\\(T / 64\\)"),
        (lambda a: a.update(k=a["k"].half()), "one dtype"),
        (lambda a: a.update(q=a["q"][0]), "4 dimensions"),
        (lambda a: a.update(tree_mask=a["tree_mask"].int()), "tree_mask"),
        (lambda a: a.update(kv_lens=a["kv_lens"][:1]), "kv_lens"),
        (lambda a: a.update(v=a["v"][:, :, :30]), "v must have k's shape"),
        (lambda a: a.update(q=a["q"].double()), "dtype"),
    ],
)
def test_bad_inputs(device, change, message):
    q, k, v, tree_mask, kv_lens = make_inputs(2, 4, 2, 7, 64, 40, torch.float32, device)
    args = dict(q=q, k=k, v=v, tree_mask=tree_mask, kv_lens=kv_lens)
    change(args)
    with pytest.raises(ValueError, match=message):
        torch.ops.taps_ops.tree_attention.default(args["q"], args["k"], args["v"], args["tree_mask"],
                                                  args["kv_lens"], 0.125)
    for scale in (0.125, None):  # the wrapper's fast entry raises the same errors
        with pytest.raises(ValueError, match="taps_ops: tree_attention: .*" + message):
            taps_ops.tree_attention(args["q"], args["k"], args["v"], args["tree_mask"], args["kv_lens"], scale)


@pytest.mark.parametrize("scale,kwargs", [(None, {}), (0.3, {}), (1, {}), (torch.tensor(0.3), {}),
                                          (0.3, dict(validate=False)), (None, dict(tree_nodes=9)),
                                          (None, dict(tree_nodes=torch.tensor(9)))])
def test_wrapper_same_as_torch_ops(scale, kwargs):
    """taps_ops.tree_attention takes a fast entry for plain tensors and a float / default scale, torch.ops
    for anything else: the same results either way."""
    q, k, v, mask, kv_lens = make_inputs(2, 4, 2, 7, 32, 40, torch.float32, "cpu", ragged=False)
    out = taps_ops.tree_attention(q, k, v, mask, kv_lens, scale, **kwargs)
    nodes = kwargs.get("tree_nodes")
    want = torch.ops.taps_ops.tree_attention.default(
        q, k, v, mask, kv_lens, float(scale) if scale is not None else 1 / math.sqrt(32),
        kwargs.get("validate", True), None if nodes is None else int(nodes))
    assert torch.equal(out, want)


def test_wrapper_keeps_modes_autograd_and_profiler():
    """The fast entry still dispatches: torch-function and dispatch modes, subclasses, the autograd
    fallback (inputs that need gradients) and the profiler see the op as through torch.ops."""
    q, k, v, mask, kv_lens = make_inputs(1, 2, 1, 3, 16, 10, torch.float32, "cpu")
    want = taps_ops.tree_attention(q, k, v, mask, kv_lens)
    assert_modes_see_op(lambda: taps_ops.tree_attention(q, k, v, mask, kv_lens),
                        torch.ops.taps_ops.tree_attention.default, want)

    class Sub(torch.Tensor):
        pass

    assert torch.equal(taps_ops.tree_attention(q.as_subclass(Sub), k, v, mask, kv_lens), want)

    qg = q.clone().requires_grad_()
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        out = taps_ops.tree_attention(qg, k, v, mask, kv_lens)
        assert out.requires_grad and out.grad_fn is not None  # the autograd fallback's node, as with torch.ops
        out.sum().backward()
    with torch.no_grad():
        assert taps_ops.tree_attention(qg, k, v, mask, kv_lens).grad_fn is None

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        taps_ops.tree_attention(q, k, v, mask, kv_lens)
    assert any(e.name == "taps_ops::tree_attention" for e in prof.events())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_mismatch():
    q, k, v, tree_mask, kv_lens = make_inputs(1, 2, 1, 3, 64, 10, torch.float32, "cpu")
    with pytest.raises(ValueError, match="device"):
        torch.ops.taps_ops.tree_attention.default(q.cuda(), k.cuda(), v.cuda(), tree_mask, kv_lens.cuda(), 1.0)


def test_default_scale():
    q, k, v, mask, kv_lens = make_inputs(1, 2, 1, 3, 64, 10, torch.float32, "cpu")
    a = taps_ops.tree_attention(q, k, v, mask, kv_lens)
    b = taps_ops.tree_attention(q, k, v, mask, kv_lens, 1 / math.sqrt(64))
    assert torch.equal(a, b)


def test_validate_false_same_result_and_opcheck(device):
    q, k, v, mask, kv_lens = make_inputs(2, 4, 2, 7, 64, 40, torch.float32, device)
    a = taps_ops.tree_attention(q, k, v, mask, kv_lens)
    b = taps_ops.tree_attention(q, k, v, mask, kv_lens, validate=False)
    assert torch.equal(a, b)
    torch.library.opcheck(torch.ops.taps_ops.tree_attention.default, (q, k, v, mask, kv_lens, 0.125, False))


def test_validate_false_still_checks_on_cpu():
    # The CPU check costs no device sync, so the CPU kernel keeps it even with validate=False.
    q, k, v, mask, kv_lens = make_inputs(2, 4, 2, 7, 64, 40, torch.float32, "cpu")
    with pytest.raises(ValueError, match="kv_lens"):
        taps_ops.tree_attention(q, k, v, mask, kv_lens * 0 + 2, validate=False)


def test_torch_compile_fullgraph(device):
    args = make_inputs(2, 4, 2, 7, 64, 40, torch.float32, device)

    def step(q, k, v, mask, kv_lens):
        return (taps_ops.tree_attention(q, k, v, mask, kv_lens),
                taps_ops.tree_attention(q.half(), k.half(), v.half(), mask, kv_lens, 0.2, validate=False))

    assert_compiles_like_eager(step, *args)


def test_bf16_amx_path_forced_matches_reference():
    """The bf16 AMX brgemm path (P rounded to bf16) for every bf16 call (TAPS_ATTN_BF16_AMX=1, read once
    per process): run the bf16 reference comparisons in a child process with it on. Skipped on hosts
    without AMX, where the flag changes nothing."""
    import os
    import subprocess
    import sys
    if taps_ops.cpu_info()["isa"] != "amx":
        pytest.skip("the kernels do not run at the amx level here (no AMX, or TAPS_CPU_ISA below it)")
    env = dict(os.environ, TAPS_ATTN_BF16_AMX="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "bfloat16 and (matches_reference or head_dims_half or large_group_half)"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout


_AMX_CHILD = """
import sys, torch, taps_ops
torch.set_num_threads(1)
cases = torch.load(sys.argv[1])
torch.save([taps_ops.tree_attention(*args) for args in cases], sys.argv[2])
"""


def test_bf16_amx_path_taken_by_shape(tmp_path):
    """Unset, TAPS_ATTN_BF16_AMX takes the AMX path (P in bf16) for head dims >= 64 with >= 16 query rows
    per KV head and the fp32-P micro-GEMMs below; 1 forces it everywhere, 0 nowhere. Told apart by the
    bits (P rounded to bf16 or not) of the same inputs in child processes (the flag is read once per
    process). Skipped on hosts without AMX."""
    import os
    import subprocess
    import sys
    if taps_ops.cpu_info()["isa"] != "amx":
        pytest.skip("the kernels do not run at the amx level here (no AMX, or TAPS_CPU_ISA below it)")
    torch.manual_seed(5)
    cases = {"small head dim": make_inputs(1, 8, 4, 16, 32, 216, torch.bfloat16, "cpu"),       # G * N = 32
             "few rows": make_inputs(1, 32, 8, 2, 128, 300, torch.bfloat16, "cpu"),             # G * N = 8
             "tree": make_inputs(2, 32, 8, 16, 128, 300, torch.bfloat16, "cpu"),                 # G * N = 64
             "tree, D 64": make_inputs(1, 20, 4, 16, 64, 200, torch.bfloat16, "cpu")}            # G * N = 80
    inputs = tmp_path / "cases.pt"
    torch.save(list(cases.values()), inputs)
    outs = {}
    for mode in ("unset", "0", "1"):
        env = {k: v for k, v in os.environ.items() if k != "TAPS_ATTN_BF16_AMX"}
        if mode != "unset":
            env["TAPS_ATTN_BF16_AMX"] = mode
        result = tmp_path / f"out_{mode}.pt"
        done = subprocess.run([sys.executable, "-c", _AMX_CHILD, str(inputs), str(result)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        outs[mode] = dict(zip(cases, torch.load(result)))
    for name in cases:
        fp32_p, bf16_p = outs["0"][name], outs["1"][name]
        assert not torch.equal(fp32_p, bf16_p), f"{name}: P in bf16 should move some outputs"
        expected = bf16_p if name.startswith("tree") else fp32_p
        assert torch.equal(outs["unset"][name], expected), name


# ---- num_queries: a ragged batch of trees in one [B, N] grid ------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,heads_q,heads_kv,num_nodes,head_dim,cache_len", [
    (5, 4, 2, 9, 32, 61),     # fast path (attend_keys at avx2: G N <= 64)
    (4, 8, 1, 13, 64, 130),   # fast path, 104 rows per KV head (bf16: the AMX brgemm path on AMX hosts)
    (3, 6, 3, 7, 20, 45),     # head dim 20: the Vec kernel at avx2 / avx512
    (1, 4, 1, 11, 64, 1000),  # one work item: key splits (partial results and the combine)
    (2, 2, 2, 70, 16, 300),   # 70 nodes: two mask words
])
def test_num_queries_skips_rows(device, dtype, batch, heads_q, heads_kv, num_nodes, head_dim, cache_len):
    """Rows past num_queries[b] are zeros and never read: their queries NaN and their mask rows garbage leave
    the live rows as they are, bit for bit the rows of the call without num_queries (the kernels compute a row
    alone), which test_matches_reference checks against the reference."""
    torch.manual_seed(batch * 1000 + num_nodes)
    q, k, v, mask, kv_lens = make_inputs(batch, heads_q, heads_kv, num_nodes, head_dim, cache_len, dtype, device)
    full = taps_ops.tree_attention(q, k, v, mask, kv_lens)
    live = torch.randint(0, num_nodes + 1, (batch,))
    live[0] = num_nodes
    live[-1] = 0 if batch > 1 else num_nodes - 3
    if batch > 2:
        live[1] = 1
    dead = torch.arange(num_nodes) >= live.view(-1, 1)  # [B, N]
    q_dead, mask_dead = q.clone(), mask.clone()
    q_dead.masked_fill_(dead.to(device)[:, None, :, None], float("nan"))
    mask_dead[dead.to(device)] = -1  # sees every node
    out = taps_ops.tree_attention(q_dead, k, v, mask_dead, kv_lens, num_queries=live.to(device))
    assert out.shape == q.shape and out.dtype == q.dtype
    keep = (~dead).to(device)[:, None, :, None]
    assert torch.equal(out.masked_select(keep), full.masked_select(keep))
    assert (out.masked_select(~keep) == 0).all()
    want = tree_attention_ref(q.cpu(), k.cpu(), v.cpu(), mask.cpu(), kv_lens.cpu(), num_queries=live)
    assert (want.masked_select(~keep.cpu()) == 0).all()  # the reference's rows past num_queries are zeros too


def test_num_queries_all_and_none(device):
    q, k, v, mask, kv_lens = make_inputs(3, 4, 2, 6, 64, 50, torch.float32, device)
    full = taps_ops.tree_attention(q, k, v, mask, kv_lens)
    every = torch.full((3,), 6, dtype=torch.int64, device=device)
    assert torch.equal(taps_ops.tree_attention(q, k, v, mask, kv_lens, num_queries=every), full)
    assert (taps_ops.tree_attention(q, k, v, mask, kv_lens, num_queries=every * 0) == 0).all()


@pytest.mark.parametrize("num_queries,message", [
    (torch.tensor([1, 2], dtype=torch.int32), "num_queries"),
    (torch.tensor([1, 2, 3]), "num_queries"),
    (torch.tensor([[1, 2]]), "num_queries"),
    (torch.tensor([1, 8]), "num_queries\\[1\\] = 8 must be in \\[0, N\\] = \\[0, 7\\]"),
    (torch.tensor([-1, 2]), "num_queries\\[0\\] = -1"),
    (torch.tensor([1.0, 2.0]), "num_queries"),
])
def test_num_queries_bad_inputs(num_queries, message):
    q, k, v, mask, kv_lens = make_inputs(2, 4, 2, 7, 64, 40, torch.float32, "cpu")
    with pytest.raises(ValueError, match="taps_ops: tree_attention: " + message):
        taps_ops.tree_attention(q, k, v, mask, kv_lens, num_queries=num_queries)
    with pytest.raises(ValueError, match="taps_ops: tree_attention: " + message):
        torch.ops.taps_ops.tree_attention.default(q, k, v, mask, kv_lens, 0.125, True, None, num_queries)
    with pytest.raises(ValueError, match="taps_ops: tree_attention: " + message):  # validate=False: still on the CPU
        taps_ops.tree_attention(q, k, v, mask, kv_lens, validate=False, num_queries=num_queries)


def test_num_queries_opcheck_and_wrapper(device):
    q, k, v, mask, kv_lens = make_inputs(2, 4, 2, 7, 64, 40, torch.float32, device)
    live = torch.tensor([3, 7], device=device)
    torch.library.opcheck(torch.ops.taps_ops.tree_attention.default, (q, k, v, mask, kv_lens, 0.125, True, None, live))
    want = torch.ops.taps_ops.tree_attention.default(q, k, v, mask, kv_lens, 0.125, True, None, live)
    assert torch.equal(taps_ops.tree_attention(q, k, v, mask, kv_lens, 0.125, num_queries=live), want)
    # the fast entry declines a tensor subclass; torch.ops takes it, same result
    sub = live.as_subclass(torch.Tensor).view(2)
    assert torch.equal(taps_ops.tree_attention(q, k, v, mask, kv_lens, 0.125, num_queries=sub), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads_q,heads_kv,head_dim", [(8, 4, 32), (32, 8, 128), (4, 4, 64), (6, 2, 16), (16, 2, 32)])
def test_decoding_rows_same_bits_as_a_tree(dtype, heads_q, heads_kv, head_dim):
    """A decoding step's query (one node: G rows per KV head) and a short chain's (2-4 nodes) come out bit for bit
    as those nodes' rows of a large tree's call (20 and 40 nodes: 2 x 20 to 16 x 40 rows per KV head) over the
    same keys. On the CPU every path sums each score over the head dim in order and P * V over the keys in
    order, whatever a KV head's row count chooses (few rows: attend_fast at AVX2; half-precision V read in
    place or through a widened copy), so a plain step's attention is the tree step's."""
    torch.manual_seed(head_dim + heads_q)
    for nodes in (20, 40):
        q, k, v, mask, kv_lens = make_inputs(2, heads_q, heads_kv, nodes, head_dim, 300, dtype, "cpu", ragged=False)
        kv_lens[1] = 137
        full = taps_ops.tree_attention(q, k, v, mask, kv_lens)
        for live in (1, 2, 4):
            few = taps_ops.tree_attention(q, k, v, mask, kv_lens, num_queries=torch.tensor([live, live]))
            assert torch.equal(few[:, :, :live], full[:, :, :live]), (nodes, live)
