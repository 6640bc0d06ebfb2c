"""taps_ops.rope_: bit for bit against torch's evaluation of ``x * cos + x.roll(D // 2, -1) * sin``
(taps_ops.reference.rope_ref) in every dtype, equal to Hugging Face's apply_rotary_pos_emb through
taps.lean.RopeTable's signed sin, in place on strided views (the q and k heads of a fused qkv output,
leaving v alone), and its input checks."""

import pytest
import torch

import taps_ops
from taps_ops.reference import rope_ref

from conftest import assert_compiles_like_eager

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 3, 4, 16), (3, 7, 5, 64), (1, 9, 2, 128), (2, 1, 3, 6)])
def test_bitwise_against_torch_expression(device, dtype, shape):
    torch.manual_seed(sum(shape) + DTYPES.index(dtype))
    x = (torch.randn(shape) * 4).to(dtype)
    cos = torch.randn(shape[0], shape[1], shape[3]).to(dtype)
    sin = torch.randn(shape[0], shape[1], shape[3]).to(dtype)
    want = rope_ref(x, cos, sin)
    got = x.clone().to(device)  # .to("cpu") would not copy
    out = taps_ops.rope_(got, cos.to(device), sin.to(device))
    assert out is got
    assert torch.equal(got.cpu(), want)
    # [R, T, 1, D] tables give the same
    again = x.clone().to(device)
    taps_ops.rope_(again, cos.unsqueeze(2).to(device), sin.unsqueeze(2).to(device))
    assert torch.equal(again.cpu(), want)


@pytest.mark.parametrize("dim", [2, 6, 16, 18, 32, 34, 64, 66, 128])
def test_bf16_special_values_bitwise(dim):
    # NaN payloads, infinities, signed zeros, subnormal inputs and products (the explicit-vector rows round
    # those lanes by the integer formula): torch's bits, NaN as the cores' 0x7fc0
    from test_rms_norm import assert_bf16_bits, special_bf16
    g = torch.Generator().manual_seed(dim)
    x = special_bf16((2, 5, 3, dim), g)
    cos, sin = special_bf16((2, 5, dim), g), special_bf16((2, 5, dim), g)
    want = rope_ref(x, cos, sin)
    got = x.clone()
    taps_ops.rope_(got, cos, sin)
    assert_bf16_bits(got, want)


def test_fused_qkv_view_in_place(device):
    """The q and k heads of a [R, T, Hq + 2 Hkv, D] projection, rotated together through a strided view;
    v untouched."""
    torch.manual_seed(1)
    heads, kv, dim = 4, 2, 32
    qkv = torch.randn(3, 5, heads + 2 * kv, dim, device=device)
    cos, sin = torch.randn(3, 5, 1, dim, device=device), torch.randn(3, 5, 1, dim, device=device)
    before = qkv.clone()
    view = qkv[:, :, :heads + kv]
    assert not view.is_contiguous()
    taps_ops.rope_(view, cos, sin)
    assert torch.equal(qkv[:, :, :heads + kv].cpu(), rope_ref(before[:, :, :heads + kv], cos, sin).cpu())
    assert torch.equal(qkv[:, :, heads + kv:], before[:, :, heads + kv:])


def test_expanded_and_strided_tables(device):
    """Tables may be expanded views (stride 0 over rows) or slices of a larger table."""
    torch.manual_seed(2)
    x = torch.randn(4, 6, 3, 8, device=device)
    table_cos, table_sin = torch.randn(1, 10, 8, device=device), torch.randn(1, 10, 8, device=device)
    cos, sin = table_cos[:, 2:8].expand(4, 6, 8), table_sin[:, 2:8].expand(4, 6, 8)
    want = rope_ref(x.cpu(), cos.cpu().contiguous(), sin.cpu().contiguous())
    taps_ops.rope_(x, cos, sin)
    assert torch.equal(x.cpu(), want)


def test_equals_hugging_face_rotary():
    """Through taps.lean.RopeTable (sin carrying rotate_half's sign) the op gives Hugging Face's
    apply_rotary_pos_emb, bit for bit, in float32 and bfloat16."""
    pytest.importorskip("transformers")
    import transformers
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from taps.lean import RopeTable

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    torch.manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        table = RopeTable(rotary, dtype)
        table.ensure(200, torch.device("cpu"))
        pos = torch.randint(0, 200, (2, 7))
        q = torch.randn(2, 4, 7, 16).to(dtype)   # Hugging Face's layout [B, H, T, D]
        k = torch.randn(2, 2, 7, 16).to(dtype)
        with torch.no_grad():
            cos_hf, sin_hf = rotary(q, pos)
            want_q, want_k = apply_rotary_pos_emb(q, k, cos_hf.to(dtype), sin_hf.to(dtype))
        cos, sin = table(pos)
        got = torch.cat([q, k], 1).transpose(1, 2).contiguous()  # [B, T, H, D]
        taps_ops.rope_(got, cos, sin)
        assert torch.equal(got[:, :, :4].transpose(1, 2), want_q)
        assert torch.equal(got[:, :, 4:].transpose(1, 2), want_k)
        # positions every row shares, as views of the table: the same rows as the gathered ones
        for shared, shape in ((range(5, 12), (2, 7)), (range(9, 10), (2, 7))):
            gathered = torch.tensor(list(shared)).expand(2, 7) if len(shared) > 1 else torch.full((2, 7), 9)
            for view, rows in zip(table(shared, shape), table(gathered)):
                assert view.shape == rows.shape and torch.equal(view, rows)


def test_empty():
    for shape in ((0, 3, 2, 4), (2, 0, 2, 4), (2, 3, 0, 4), (2, 3, 2, 0)):
        x = torch.randn(shape)
        taps_ops.rope_(x, torch.zeros(shape[0], shape[1], shape[3]), torch.zeros(shape[0], shape[1], shape[3]))


@pytest.mark.parametrize("case", range(10))
def test_bad_inputs_raise(case):
    x = torch.randn(2, 3, 4, 8)
    c = torch.randn(2, 3, 8)
    bad = [
        (x.long(), c.long(), c.long(), "float32, bfloat16 or float16"),
        (x[..., :7], c[..., :7], c[..., :7], "must be even"),
        (x, c.double(), c, "must match"),
        (x, c, c.bfloat16(), "must match"),
        (x[0], c, c, "4 dimensions"),
        (x, c[:1], c[:1], r"\[R, T, D\]"),
        (x, torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8), "size 1 in dimension 2"),
        (x, c, torch.randn(2, 3, 16)[..., ::2], "contiguous last dimension"),
        (torch.randn(2, 3, 4, 16)[..., ::2], c, c, "contiguous last dimension"),
        (x, c, c.transpose(0, 1).contiguous().transpose(0, 1), "same strides"),
    ][case]
    with pytest.raises(ValueError, match=bad[3]):
        taps_ops.rope_(*bad[:3])


def test_fuzz_validation():
    """Random shapes, dtypes and table shapes: either the reference's values in place or a clear error."""
    gen = torch.Generator().manual_seed(4)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

    def pick(n):
        return int(torch.randint(0, n, (), generator=gen))

    for _ in range(200):
        shape = [pick(4), pick(4), pick(4), pick(5) * 2 + pick(2) * (pick(3) == 0)]
        tshape = [shape[0], shape[1], shape[3]] if pick(4) else [pick(4), pick(4), shape[3] + pick(2)]
        xd, cd = dtypes[pick(4)], dtypes[pick(4)]
        x = torch.randn(shape).to(xd)
        cos, sin = torch.randn(tshape).to(cd), torch.randn(tshape).to(cd)
        before = x.clone()
        try:
            taps_ops.rope_(x, cos, sin)
        except ValueError as e:
            assert str(e).startswith("taps_ops: rope_:"), e
            assert torch.equal(x, before)  # nothing written
            continue
        assert xd == cd and xd != torch.float64 and shape[3] % 2 == 0 and tshape == [shape[0], shape[1], shape[3]]
        assert torch.equal(x, rope_ref(before, cos, sin))


def test_compiles():
    x, c, s = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8)

    def fn(x, c, s):
        y = x.clone()
        taps_ops.rope_(y, c, s)
        return (y,)

    assert_compiles_like_eager(fn, x, c, s)


@pytest.mark.skipif(not (torch.cuda.is_available() and taps_ops.has_cuda_kernels()), reason="no GPU or no CUDA kernels")
def test_cuda_bitwise_equals_cpu():
    torch.manual_seed(5)
    for dtype in DTYPES:
        x = (torch.randn(3, 17, 12, 128) * 3).to(dtype)
        c, s = torch.randn(3, 17, 1, 128).to(dtype), torch.randn(3, 17, 1, 128).to(dtype)
        a, b = x.clone(), x.cuda()
        taps_ops.rope_(a[:, :, :10], c, s)
        taps_ops.rope_(b[:, :, :10], c.cuda(), s.cuda())
        assert torch.equal(a, b.cpu())
