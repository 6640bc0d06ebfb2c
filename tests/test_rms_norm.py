"""taps_ops.rms_norm: bit for bit against a plain-torch emulation of its fixed summation order
(csrc/include/taps/rms_norm.h), close to Hugging Face's formula (taps_ops.reference.rms_norm_ref) and to
the LlamaRMSNorm module itself, grouped weights, layouts, and its input checks."""

import pytest
import torch

import taps_ops
from taps_ops.reference import rms_norm_ref

from conftest import assert_compiles_like_eager

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fixed_order_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The op's arithmetic, one float32 rounding per step in its order: lane j (0..31) sums x_j^2,
    x_{j+32}^2, ... in increasing index, the lanes combine as a shuffle-down tree (16, 8, 4, 2, 1), then
    round(round(x * (1 / sqrt(ss / H + eps))) * w) in x's dtype."""
    width = x.shape[-1]
    if x.numel() == 0:
        return torch.empty_like(x)
    rows = x.reshape(-1, width).float()
    w = weight.reshape(-1, width)
    pad = (-width) % 32
    sq = torch.nn.functional.pad(rows * rows, (0, pad)).view(rows.shape[0], -1, 32)
    part = torch.zeros(rows.shape[0], 32)
    for i in range(sq.shape[1]):  # padding adds exact zeros
        part = part + sq[:, i]
    off = 16
    while off:
        part = part[:, :off] + part[:, off:2 * off]
        off //= 2
    ss = part[:, 0]
    # IEEE float32 division and square root: computed in float64 and rounded once, which gives the correctly
    # rounded float32 result (torch's float32 sqrt on the CPU may come from a vector library)
    mean = (ss.double() / width).float()
    root = (mean + torch.tensor(eps, dtype=torch.float32)).double().sqrt().float()
    inv = (1.0 / root.double()).float()
    normed = (rows * inv.unsqueeze(1)).to(x.dtype)
    groups = w.shape[0]
    out = (normed.view(groups, -1, width).float() * w.float().unsqueeze(1)).to(x.dtype)
    return out.reshape(x.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 64), (4, 33), (1, 3, 4099), (2, 2, 2, 96)])
def test_bitwise_fixed_order(device, dtype, shape):
    torch.manual_seed(sum(shape) * 7 + DTYPES.index(dtype))
    x = (torch.randn(shape) * 3).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    got = taps_ops.rms_norm(x.to(device), w.to(device), 1e-6).cpu()
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    assert torch.equal(got, fixed_order_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_close_to_hugging_face_formula(device, dtype):
    """Only the order of the sum of squares differs from Hugging Face's form: float32 results within a
    few ulps, half-precision results within one unit of their last place."""
    torch.manual_seed(1)
    x = (torch.randn(6, 11, 333) * 5).to(dtype)
    w = (torch.rand(333) + 0.5).to(dtype)
    got = taps_ops.rms_norm(x.to(device), w.to(device), 1e-5).cpu().float()
    want = rms_norm_ref(x, w, 1e-5).float()
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if dtype != torch.float32:  # almost every element equal
        assert (got == want).float().mean() > 0.99


def test_matches_llama_rms_norm_module():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        mod = LlamaRMSNorm(200, eps=1e-6).to(dtype)
        with torch.no_grad():
            mod.weight.copy_(torch.randn(200))
            x = torch.randn(3, 9, 200).to(dtype)
            want = mod(x)
            got = taps_ops.rms_norm(x, mod.weight, 1e-6)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert transformers is not None


def test_grouped_weights(device):
    """weight [G, H]: x's rows in G consecutive blocks, block g normalised with weight[g]."""
    torch.manual_seed(3)
    groups, rows, width = 3, 5, 70
    x = torch.randn(groups, rows, width)
    w = torch.randn(groups, width)
    got = taps_ops.rms_norm(x.to(device), w.to(device), 1e-6).cpu()
    for g in range(groups):
        assert torch.equal(got[g], taps_ops.rms_norm(x[g], w[g], 1e-6))
    assert torch.equal(got, fixed_order_ref(x, w, 1e-6))
    # the rows may have any leading shape: [G * R, H] and [G, R, 1, H] group alike
    assert torch.equal(taps_ops.rms_norm(x.reshape(groups * rows, width).to(device), w.to(device), 1e-6).cpu(),
                       got.reshape(groups * rows, width))


def test_layouts(device):
    """Strided and transposed inputs give the result of their contiguous copies."""
    torch.manual_seed(4)
    base = torch.randn(8, 10, 48)
    w = torch.randn(48)
    for x in (base[:, ::2], base.transpose(0, 1), base[..., ::1][:, 3:7]):
        got = taps_ops.rms_norm(x.to(device), w.to(device), 1e-6).cpu()
        assert torch.equal(got, taps_ops.rms_norm(x.contiguous(), w, 1e-6))
    # a strided last dimension is copied first
    x = torch.randn(4, 96)[:, ::2]
    assert torch.equal(taps_ops.rms_norm(x.to(device), w.to(device), 1e-6).cpu(),
                       taps_ops.rms_norm(x.contiguous(), w, 1e-6))


def test_special_values():
    """Zero rows give zeros (eps keeps the root finite); a NaN spreads over its own row only; an infinity
    makes its row NaN / zero as the formula says."""
    x = torch.zeros(3, 40)
    x[1, 5] = float("nan")
    x[2] = 1.0
    w = torch.ones(40)
    got = taps_ops.rms_norm(x, w, 1e-6)
    assert torch.equal(got[0], torch.zeros(40))
    assert torch.isnan(got[1]).all()
    torch.testing.assert_close(got[2], torch.ones(40), rtol=1e-6, atol=1e-6)
    for dtype in (torch.bfloat16, torch.float16):
        got = taps_ops.rms_norm(x.to(dtype), w.to(dtype), 1e-6)
        assert torch.isnan(got[1]).all() and torch.equal(got[0].float(), torch.zeros(40))
    big = torch.full((1, 8), 60000.0, dtype=torch.float16)  # x^2 overflows float16, not float32
    torch.testing.assert_close(taps_ops.rms_norm(big, torch.ones(8, dtype=torch.float16), 0.0).float(),
                               torch.ones(1, 8))


def special_bf16(shape, generator) -> torch.Tensor:
    """bf16 values with every kind the bf16 rows round specially mixed in: NaNs of several payloads and signs,
    infinities, zeros of both signs, subnormals, and values whose products fall below 2^-126."""
    x = (torch.randn(shape, generator=generator) * 3).to(torch.bfloat16)
    bits = x.view(torch.int16)
    pick = torch.rand(shape, generator=generator)
    specials = torch.tensor([0x7FC0, 0x7FFF, 0xFFC1 - 0x10000, 0x7F81, 0x7F80, 0xFF80 - 0x10000, 0x0000,
                             0x8000 - 0x10000, 0x0001, 0x807F - 0x10000, 0x0080, 0x00FF], dtype=torch.int16)
    which = torch.randint(0, len(specials), shape, generator=generator)
    bits[pick < 0.05] = specials[which[pick < 0.05]]
    tiny = (pick >= 0.05) & (pick < 0.15)
    x[tiny] = (torch.randn(int(tiny.sum()), generator=generator) * 2e-38).to(torch.bfloat16)
    return x


@pytest.mark.parametrize("width", [1, 7, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100, 257])
def test_bf16_special_values_bitwise(width):
    # NaN payloads, infinities, signed zeros, subnormal inputs and products (the explicit-vector rows round
    # those lanes by the integer formula): the cores' bits, NaN as 0x7fc0
    g = torch.Generator().manual_seed(width)
    x = special_bf16((9, width), g)
    x[0] = (torch.randn(width, generator=g) * 1e-36).to(torch.bfloat16)  # a row of tiny values
    x[1, : max(1, width // 3)] = 1e30  # one large part: the rest of the row's products fall below 2^-126
    w = special_bf16((width,), g)
    w[: width // 2] = torch.randn(width // 2, generator=g).to(torch.bfloat16)
    assert_bf16_bits(taps_ops.rms_norm(x, w, 1e-6), fixed_order_ref(x, w, 1e-6))


def assert_bf16_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits, and NaN as the cores' 0x7fc0 wherever `want` is NaN (torch's vectorised float -> bfloat16
    conversion writes NaN as 0xffff, its scalar one as 0x7fc0)."""
    nan = torch.isnan(want)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert bool((got.view(torch.int16)[nan] == 0x7FC0).all())


def test_empty():
    assert taps_ops.rms_norm(torch.zeros(0, 5), torch.ones(5), 1e-6).shape == (0, 5)
    assert taps_ops.rms_norm(torch.zeros(3, 0), torch.ones(0), 1e-6).shape == (3, 0)


@pytest.mark.parametrize("case", range(10))
def test_bad_inputs_raise(case):
    x, w = torch.randn(4, 6), torch.randn(6)
    bad = [
        (x.long(), w.long(), 1e-6, "float32, bfloat16 or float16"),
        (x, w.double(), 1e-6, "must match"),
        (x.bfloat16(), w, 1e-6, "must match"),
        (x, torch.randn(5), 1e-6, "last dimension must be H = 6"),
        (x, torch.randn(3, 6), 1e-6, "must divide"),
        (x, torch.randn(2, 3, 6), 1e-6, r"\[H\] or \[G, H\]"),
        (x, w, -1.0, "eps"),
        (x, w, float("inf"), "eps"),
        (x, w, float("nan"), "eps"),
        (torch.tensor(1.0), torch.ones(()), 1e-6, "at least 1 dimension"),
    ][case]
    with pytest.raises(ValueError, match=bad[3]):
        taps_ops.rms_norm(*bad[:3])


def test_fuzz_validation():
    """Random shapes and dtypes: either a result equal to the fixed-order reference or a clear error."""
    gen = torch.Generator().manual_seed(5)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int32]
    for _ in range(200):
        dims = int(torch.randint(1, 4, (), generator=gen))
        shape = [int(torch.randint(0, 6, (), generator=gen)) for _ in range(dims)]
        wshape = [int(torch.randint(1, 4, (), generator=gen)), shape[-1]] if torch.rand((), generator=gen) < 0.4 \
            else [shape[-1] + int(torch.randint(-1, 2, (), generator=gen)) * (torch.rand((), generator=gen) < 0.2)]
        xd, wd = dtypes[int(torch.randint(0, 4, (), generator=gen))], dtypes[int(torch.randint(0, 4, (), generator=gen))]
        x = torch.randn(shape).to(xd)
        w = torch.randn([max(s, 0) for s in wshape]).to(wd)
        try:
            got = taps_ops.rms_norm(x, w, 1e-5)
        except ValueError as e:
            assert str(e).startswith("taps_ops: rms_norm:"), e
            continue
        assert xd == wd and xd != torch.int32 and w.shape[-1] == x.shape[-1]
        assert torch.equal(got, fixed_order_ref(x, w, 1e-5))


def test_compiles():
    x, w = torch.randn(3, 4, 40), torch.randn(40)
    assert_compiles_like_eager(lambda a, b: (taps_ops.rms_norm(a, b, 1e-6),), x, w)


@pytest.mark.skipif(not (torch.cuda.is_available() and taps_ops.has_cuda_kernels()), reason="no GPU or no CUDA kernels")
def test_cuda_bitwise_equals_cpu():
    torch.manual_seed(6)
    for dtype in DTYPES:
        for shape in ((1, 64), (37, 4096), (5, 3, 130), (2, 1)):
            x = (torch.randn(shape) * 2).to(dtype)
            w = torch.randn(shape[-1]).to(dtype)
            assert torch.equal(taps_ops.rms_norm(x.cuda(), w.cuda(), 1e-6).cpu(), taps_ops.rms_norm(x, w, 1e-6))
