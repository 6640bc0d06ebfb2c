"""taps_ops.pack_panels / panel_linear: x W^T + b over a float32 weight kept as panels (CPU).

- Agrees with a float64 product within float32 rounding on random inputs of odd sizes (rows 1-33 across
  every row-block size and remainder; outputs across every vector-block tail; any in), with and without a
  bias, for 1-, 2- and 3-D x, non-contiguous x and the empty cases.
- The contract's bits: the same at every ISA level this CPU runs, for a row alone or among others (any
  row count and position) and for any thread count.
- Bad inputs raise ValueError starting "taps_ops: panel_linear:" / "taps_ops: pack_panels:", fuzzed.
"""

import random

import pytest
import torch

import taps_ops
from taps_ops.reference import panel_linear_ref

from conftest import assert_compiles_like_eager, assert_modes_see_op

LEVELS = taps_ops.CPU_ISA_LEVELS
RUNNABLE = LEVELS[: LEVELS.index(taps_ops.cpu_info()["host_isa"]) + 1]


@pytest.fixture
def restore_level():
    before = taps_ops.cpu_info()["isa"]
    yield
    taps_ops.set_cpu_isa(before)


def _close(y, ref, inner):
    # float32 accumulation of `inner` terms: a few ulps of the sum of |terms| per step
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=2e-6 * max(inner, 1) ** 0.5 * 4)


@pytest.mark.parametrize("out,inner", [(16, 1), (32, 7), (48, 257), (64, 64), (112, 33), (256, 256), (400, 130),
                                       (1024, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_float64_product(out, inner, bias):
    gen = torch.Generator().manual_seed(out * 1000 + inner)
    weight = torch.randn(out, inner, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    panels = taps_ops.pack_panels(weight)
    assert panels.shape == (out // 16, inner, 16)
    assert torch.equal(panels.permute(0, 2, 1).reshape(out, inner), weight)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16, 17, 33):
        x = torch.randn(rows, inner, generator=gen)
        y = taps_ops.panel_linear(x, panels, b)
        assert y.shape == (rows, out) and y.dtype == torch.float32 and y.is_contiguous()
        _close(y, panel_linear_ref(x, panels, b), inner)


def test_shapes_layouts_and_empty_inputs():
    torch.manual_seed(1)
    weight, bias = torch.randn(48, 20), torch.randn(48)
    panels = taps_ops.pack_panels(weight)
    x = torch.randn(3, 5, 20)
    y = taps_ops.panel_linear(x, panels, bias)
    assert y.shape == (3, 5, 48)
    _close(y, torch.nn.functional.linear(x.double(), weight.double(), bias.double()), 20)
    assert torch.equal(taps_ops.panel_linear(x[0, 2], panels, bias), y[0, 2])          # 1-D x
    strided = torch.randn(5, 40)[:, ::2]                                                 # non-contiguous x
    assert torch.equal(taps_ops.panel_linear(strided, panels, bias), taps_ops.panel_linear(strided.contiguous(), panels, bias))
    assert taps_ops.panel_linear(torch.randn(0, 20), panels, bias).shape == (0, 48)
    empty = taps_ops.pack_panels(torch.randn(32, 0))
    assert torch.equal(taps_ops.panel_linear(torch.randn(4, 0), empty), torch.zeros(4, 32))
    b = torch.randn(32)
    assert torch.equal(taps_ops.panel_linear(torch.randn(4, 0), empty, b), b.expand(4, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inner", [1, 2, 63, 64, 256, 768])
def test_panels_are_padded_to_an_odd_line_stride(inner, dtype):
    panels = taps_ops.pack_panels(torch.randn(64, inner), dtype)
    size = panels.element_size()
    lines = panels.stride(0) * size // 64
    assert panels.dtype == dtype and panels.stride(0) * size % 64 == 0 and lines % 2 == 1
    assert panels.stride(0) >= inner * 16


@pytest.mark.parametrize("shape", [(16, 1), (32, 7), (48, 64), (272, 129), (1024, 256), (160, 3074)])
def test_bf16_panels_are_float32_panels_of_the_same_values(shape, restore_level):
    """bfloat16 panels are widened as read: the bits of float32 panels holding the (rounded) weight, at every
    level, row count and position, 1-3 threads; packed from a float32 weight (rounded to nearest even) or a
    bfloat16 one. Row counts past one register block too (from 48 rows the avx2 level widens each output block once
    into a float32 copy that its other row blocks read), with and without a bias."""
    gen = torch.Generator().manual_seed(shape[1])
    weight, bias = torch.randn(*shape, generator=gen), torch.randn(shape[0], generator=gen)
    half = taps_ops.pack_panels(weight, torch.bfloat16)
    assert torch.equal(half, taps_ops.pack_panels(weight.bfloat16()))
    wide = taps_ops.pack_panels(weight.bfloat16().float())
    x = torch.randn(60, shape[1], generator=gen)
    first = None
    for level in RUNNABLE:
        taps_ops.set_cpu_isa(level)
        for b in (None, bias):   # (y with the bias last: the comparisons below)
            y = taps_ops.panel_linear(x, half, b)
            assert torch.equal(y, taps_ops.panel_linear(x, wide, b)), level
            for rows, start in ((1, 0), (3, 7), (8, 11), (7, 33), (13, 2), (19, 21), (31, 9), (48, 12), (53, 0)):
                part = taps_ops.panel_linear(x[start:start + rows], half, b)
                assert torch.equal(part, y[start:start + rows]), (level, rows, start)
            _same_across_threads(x, half, b, y, level)
        first = y if first is None else first
        assert torch.equal(y, first), level
        _close(y, panel_linear_ref(x, half, bias), shape[1])


def _same_across_threads(x, panels, bias, y, level):
    """panel_linear at 2 and 3 threads (the output blocks split between them) gives `y`'s bits."""
    threads = torch.get_num_threads()
    try:
        for n in (2, 3):
            torch.set_num_threads(n)
            assert torch.equal(taps_ops.panel_linear(x, panels, bias), y), (level, n)
    finally:
        torch.set_num_threads(threads)


def _tiles(level, inner):
    """Whether panel_linear multiplies bfloat16 x over bfloat16 panels on AMX tiles: the amx level, `in` a
    multiple of 32 (and the process allowed the tile state, which Linux grants unless a policy forbids it)."""
    return level == "amx" and inner % 32 == 0 and inner > 0


@pytest.mark.parametrize("shape", [(16, 1), (32, 7), (48, 64), (272, 129), (1024, 256), (160, 2), (160, 3074)])
def test_bf16_x_over_bf16_panels(shape, restore_level):
    """bfloat16 x over bfloat16 panels: the float32 sums of x widened, rounded to bfloat16 once (+ bias before
    the rounding), the same bits at every level, row count (1-40: every row block of AVX512-BF16's dot-product
    kernel, which the avx512 level runs on a CPU that has it, and calls of one, two and four blocks of 12 rows,
    whose first block keeps the rotated panels for the others) and position; within bfloat16 rounding of the
    float64 product. At the amx level with `in` a multiple of 32 the AMX tiles' own sums: the same bits for any
    row count, position and thread count, not the other levels' (tdpbf16ps sums each 32 inputs its own way)."""
    gen = torch.Generator().manual_seed(shape[1] + 1)
    weight, bias = torch.randn(*shape, generator=gen), torch.randn(shape[0], generator=gen)
    half = taps_ops.pack_panels(weight, torch.bfloat16)
    x = torch.randn(40, shape[1], generator=gen).bfloat16()
    first = None
    for level in RUNNABLE:
        taps_ops.set_cpu_isa(level)
        for b in (None, bias):
            y = taps_ops.panel_linear(x, half, b)
            assert y.dtype == torch.bfloat16 and y.shape == (40, shape[0])
            if not _tiles(level, shape[1]):
                assert torch.equal(y, taps_ops.panel_linear(x.float(), half, b).bfloat16()), level
            for rows in (*range(1, 10), 12, 13, 16, 19, 24, 25, 31):
                for start in (0, 40 - rows):
                    assert torch.equal(taps_ops.panel_linear(x[start:start + rows], half, b), y[start:start + rows])
            ref = panel_linear_ref(x.float(), half, b)
            torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=1e-5 * shape[1])
        if not _tiles(level, shape[1]):
            first = y if first is None else first
            assert torch.equal(y, first), level
        _same_across_threads(x, half, bias, y, level)
    assert taps_ops.panel_linear(torch.randn(0, shape[1]).bfloat16(), half).dtype == torch.bfloat16
    empty = taps_ops.pack_panels(torch.randn(32, 0), torch.bfloat16)
    assert torch.equal(taps_ops.panel_linear(torch.randn(3, 0).bfloat16(), empty, bias[:32] if shape[0] >= 32 else None),
                       (bias[:32] if shape[0] >= 32 else torch.zeros(32)).bfloat16().expand(3, 32))


AMX = "amx" in RUNNABLE


@pytest.mark.skipif(not AMX, reason="AMX tiles: this CPU has no AMX-BF16")
@pytest.mark.parametrize("out,inner", [(16, 32), (48, 64), (272, 96), (1040, 256), (256, 768), (64, 4096)])
def test_amx_tiles(out, inner, restore_level):
    """bfloat16 x over bfloat16 panels at the amx level (`in` a multiple of 32): AMX tiles, rows in blocks of up
    to 16, four panels a step and the tails (1-3 panels). Each row's bits depend on that row alone: any row count
    (1-40: one to three tile row blocks and their remainders), position and thread count give the same; within
    float32 rounding of the float64 product before the bf16 rounding (the sums near the other levels' to a few
    float32 ulps), with and without a bias."""
    gen = torch.Generator().manual_seed(out + inner)
    weight, bias = torch.randn(out, inner, generator=gen), torch.randn(out, generator=gen)
    half = taps_ops.pack_panels(weight, torch.bfloat16)
    x = torch.randn(40, inner, generator=gen).bfloat16()
    taps_ops.set_cpu_isa("avx512")
    other = taps_ops.panel_linear(x, half, bias)
    taps_ops.set_cpu_isa("amx")
    for b in (None, bias):
        y = taps_ops.panel_linear(x, half, b)
        ref = panel_linear_ref(x.float(), half, b)
        torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=1e-5 * inner)
        for rows in (1, 2, 3, 5, 15, 16, 17, 31, 32, 33, 40):
            for start in {0, 40 - rows, min(7, 40 - rows)}:
                assert torch.equal(taps_ops.panel_linear(x[start:start + rows], half, b), y[start:start + rows]), (rows, start)
        threads = torch.get_num_threads()
        try:
            for n in (2, 3):
                torch.set_num_threads(n)
                assert torch.equal(taps_ops.panel_linear(x, half, b), y), n
        finally:
            torch.set_num_threads(threads)
    # the sums before the rounding: a few float32 ulps from the dot-product / widened kernels' (differences of one
    # bf16 step where a sum sits at a rounding boundary, rarely)
    torch.testing.assert_close(y.float(), other.float(), rtol=2 ** -7, atol=1e-5 * inner)
    assert (y != other).float().mean() < 0.02


@pytest.mark.skipif(not AMX, reason="AMX tiles: this CPU has no AMX-BF16")
def test_amx_tiles_specials(restore_level):
    """Non-finite x and weights propagate as in the other kernels (inf, NaN); a zero row gives the bias; `in`
    not a multiple of 32 keeps the other levels' kernel at the amx level (the same bits as avx512)."""
    taps_ops.set_cpu_isa("amx")
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(64, 64, generator=gen), torch.randn(64, generator=gen)
    weight[5, 3] = float("inf")
    weight[9, 0] = float("nan")
    half = taps_ops.pack_panels(weight, torch.bfloat16)
    x = torch.randn(4, 64, generator=gen).bfloat16()
    x[2] = 0
    x[3, 10] = float("nan")
    y = taps_ops.panel_linear(x, half, bias).float()
    assert torch.isinf(y[:2, 5]).all() and torch.isnan(y[:, 9]).all() and torch.isnan(y[3]).all()
    assert torch.isnan(y[2, 5])                                # 0 * inf
    keep = [i for i in range(64) if i not in (5, 9)]
    assert torch.equal(y[2, keep], bias.bfloat16().float()[keep])
    odd = taps_ops.pack_panels(torch.randn(48, 70, generator=gen), torch.bfloat16)
    xo = torch.randn(9, 70, generator=gen).bfloat16()
    at_amx = taps_ops.panel_linear(xo, odd)
    taps_ops.set_cpu_isa("avx512")
    assert torch.equal(at_amx, taps_ops.panel_linear(xo, odd))


@pytest.mark.skipif(not AMX, reason="AMX tiles: this CPU has no AMX-BF16")
def test_amx_tiles_switch():
    """TAPS_PANEL_AMX=0 (read at load) leaves the tiles out: the amx level then gives the avx512 level's bits."""
    import subprocess
    import sys
    code = ("import torch, taps_ops\n"
            "g = torch.Generator().manual_seed(0)\n"
            "p = taps_ops.pack_panels(torch.randn(4096, 512, generator=g), torch.bfloat16)\n"
            "x = torch.randn(32, 512, generator=g).bfloat16()\n"
            "taps_ops.set_cpu_isa('amx'); a = taps_ops.panel_linear(x, p)\n"
            "taps_ops.set_cpu_isa('avx512'); b = taps_ops.panel_linear(x, p)\n"
            "print(int(torch.equal(a, b)))\n")
    import os
    out = {}
    for flag in ("0", "1"):
        env = dict(os.environ, TAPS_PANEL_AMX=flag)
        out[flag] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True).stdout.strip()
    assert out == {"0": "1", "1": "0"}


def test_the_same_bits_at_every_level_row_count_position_and_thread_count(restore_level):
    """The contract: each output's sum runs in one order, so its bits depend on its own row only. (Row counts of
    every split into register blocks: the avx512 level's even blocks of at most 6 over interleaved x, 7 = 4 + 3,
    13 = 5 + 4 + 4, 41 = 6 x 5 + 11 ...)"""
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(272, 129, generator=gen), torch.randn(272, generator=gen)
    panels = taps_ops.pack_panels(weight)
    x = torch.randn(41, 129, generator=gen)
    results = {}
    for level in RUNNABLE:
        taps_ops.set_cpu_isa(level)
        results[level] = taps_ops.panel_linear(x, panels, bias)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 17, 23):
            for start in (0, 41 - rows, 4):
                part = taps_ops.panel_linear(x[start:start + rows], panels, bias)
                assert torch.equal(part, results[level][start:start + rows]), (level, rows, start)
    first = results[RUNNABLE[0]]
    for level, y in results.items():
        assert torch.equal(y, first), level
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(taps_ops.panel_linear(x, panels, bias), first)
    finally:
        torch.set_num_threads(threads)


def test_prefetches_change_no_bit(restore_level):
    """Software prefetches (by default for weights of >= 4 MiB with panels of >= 32 KiB: this one, both
    dtypes; and the next output block's panels, asked by the row blocks after the first) are hints: the same
    bits with them off, by the rule and forced at several distances, at every level, row count and thread
    count (each thread prefetches within its own output blocks); the settings are validated and restored."""
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(2064, 1026, generator=gen), torch.randn(2064, generator=gen)
    x = torch.randn(19, 1026, generator=gen)
    before = torch.ops.taps_ops._set_panel_prefetch(-1)
    next_before = torch.ops.taps_ops._set_panel_next(True)
    threads = torch.get_num_threads()
    try:
        for dtype in (None, torch.bfloat16):
            panels = taps_ops.pack_panels(weight, dtype)
            for level in RUNNABLE:
                taps_ops.set_cpu_isa(level)
                for xs in (x, x.bfloat16()) if dtype is not None else (x,):   # bf16 x: the dot-product kernel too
                    torch.ops.taps_ops._set_panel_prefetch(0)
                    assert torch.ops.taps_ops._set_panel_next(False) in (False, True)
                    plain = taps_ops.panel_linear(xs, panels, bias)
                    for setting, ahead_next in ((-1, True), (1, False), (24, True), (1000, True), (0, True)):
                        assert torch.ops.taps_ops._set_panel_prefetch(setting) in (0, -1, 1, 24, 1000)
                        torch.ops.taps_ops._set_panel_next(ahead_next)
                        for rows in (1, 5, 8, 9, 12, 16, 19):
                            assert torch.equal(taps_ops.panel_linear(xs[:rows], panels, bias), plain[:rows]), (level, setting)
                    for n in (2, 3):
                        torch.set_num_threads(n)
                        assert torch.equal(taps_ops.panel_linear(xs, panels, bias), plain), (level, n)
                    torch.set_num_threads(threads)
        with pytest.raises(ValueError, match="_set_panel_prefetch: lines must be -1"):
            torch.ops.taps_ops._set_panel_prefetch(-2)
    finally:
        torch.set_num_threads(threads)
        torch.ops.taps_ops._set_panel_prefetch(before)
        torch.ops.taps_ops._set_panel_next(next_before)


def test_every_level_agrees_with_the_reference(restore_level):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 45, generator=gen)
    panels = taps_ops.pack_panels(weight)
    x = torch.randn(10, 45, generator=gen)
    for level in RUNNABLE:
        taps_ops.set_cpu_isa(level)
        _close(taps_ops.panel_linear(x, panels), panel_linear_ref(x, panels), 45)


def _valid():
    return dict(x=torch.randn(3, 24), panels=taps_ops.pack_panels(torch.randn(32, 24)), bias=torch.randn(32))


BAD = {
    "x float64": (lambda a: a.update(x=a["x"].double()), "must be float32"),
    "x bf16": (lambda a: a.update(x=a["x"].bfloat16()), "must be float32"),
    "x scalar": (lambda a: a.update(x=torch.tensor(1.0)), "at least 1 dimension"),
    "x width": (lambda a: a.update(x=torch.randn(3, 23)), "last dimension must be in = 24"),
    "panels 2-D": (lambda a: a.update(panels=torch.randn(32, 24)), "panels must be [out / 16, in, 16]"),
    "panels width": (lambda a: a.update(panels=torch.randn(2, 24, 8)), "panels must be [out / 16, in, 16]"),
    "panels dtype": (lambda a: a.update(panels=a["panels"].double()), "panels float32 or bfloat16"),
    "panels fp16": (lambda a: a.update(panels=a["panels"].half()), "panels float32 or bfloat16"),
    "x fp16, bf16 panels": (lambda a: a.update(x=a["x"].half(), panels=taps_ops.pack_panels(torch.randn(32, 24),
                                                                                             torch.bfloat16)),
                            "must be float32 (or bfloat16 over bfloat16 panels)"),
    "bias bf16": (lambda a: a.update(bias=a["bias"].bfloat16()), "bias must be float32"),
    "bf16 panels 3-D": (lambda a: a.update(panels=torch.randn(2, 24, 16).bfloat16()),
                        "bfloat16 panels must be [out / 16, ceil(in / 2), 16, 2]"),
    "bf16 panels strides": (lambda a: a.update(panels=torch.randn(2, 16, 12, 2).bfloat16().transpose(1, 2)),
                            "bfloat16 panels must have strides"),
    "bf16 x width": (lambda a: a.update(panels=taps_ops.pack_panels(torch.randn(32, 24), torch.bfloat16),
                                        x=torch.randn(3, 21)), "ceil(in / 2) = 12"),
    "panels strides": (lambda a: a.update(panels=torch.randn(2, 16, 24).transpose(1, 2)), "strides"),
    "panels overlap": (lambda a: a.update(panels=torch.randn(24 * 16 + 16).as_strided((2, 24, 16), (16, 16, 1))),
                       "strides"),
    "bias shape": (lambda a: a.update(bias=torch.randn(31)), "bias must be [out] = [32]"),
    "bias 2-D": (lambda a: a.update(bias=torch.randn(1, 32)), "bias must be [out] = [32]"),
    "bias dtype": (lambda a: a.update(bias=a["bias"].double()), "bias must be float32"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_raise_clear_errors(case):
    args = _valid()
    taps_ops.panel_linear(**args)
    mutate, message = BAD[case]
    mutate(args)
    with pytest.raises(ValueError, match="taps_ops: panel_linear: .*" + message.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        taps_ops.panel_linear(**args)


def test_fuzzed_bad_inputs_raise_value_errors_never_crash():
    """Random mutations of a valid call: every one either works (and agrees with the reference) or raises
    a clear ValueError; none crashes or reads out of bounds."""
    rng = random.Random(0)
    for _ in range(300):
        out, inner, rows = 16 * rng.randint(1, 5), rng.randint(0, 40), rng.randint(0, 6)
        x = torch.randn(rows, inner + rng.choice([0, 0, 0, 1, -1]) if inner > 0 else 0)
        panels = taps_ops.pack_panels(torch.randn(out, inner), rng.choice([None, torch.bfloat16]))
        if rng.random() < 0.2:
            panels = panels[:, :, : rng.choice([8, 15])]
        if rng.random() < 0.1:
            panels = panels.contiguous().view(-1)
        bias = rng.choice([None, torch.randn(out), torch.randn(out + 16), torch.randn(out).half()])
        if rng.random() < 0.3:
            x = x.to(rng.choice([torch.bfloat16, torch.bfloat16, torch.float16]))
        try:
            y = taps_ops.panel_linear(x, panels, bias)
        except ValueError as e:
            assert str(e).startswith("taps_ops: panel_linear:"), str(e)
            continue
        if x.dtype == torch.bfloat16:
            assert y.dtype == torch.bfloat16
            torch.testing.assert_close(y.double(), panel_linear_ref(x.float(), panels, bias), rtol=2 ** -7,
                                       atol=1e-5 * max(inner, 1))
            continue
        _close(y, panel_linear_ref(x, panels, bias), inner)


def test_other_devices_raise_a_clear_error():
    args = _valid()
    for name in ("x", "panels", "bias"):
        moved = dict(args, **{name: args[name].to("meta")})
        with pytest.raises(ValueError, match=f"taps_ops: panel_linear: a CPU op, got {name} on meta"):
            taps_ops.panel_linear(**moved)


@pytest.mark.parametrize("case", ["2-D", "out", "dtype", "fp16", "to fp16"])
def test_pack_panels_rejects_what_it_cannot_lay_out(case):
    weight = {"2-D": torch.randn(2, 16, 4), "out": torch.randn(40, 8), "dtype": torch.randn(32, 8).double(),
              "fp16": torch.randn(32, 8).half()}.get(case, torch.randn(32, 8))
    with pytest.raises(ValueError, match="taps_ops: pack_panels:"):
        taps_ops.pack_panels(weight, torch.float16 if case == "to fp16" else None)


def test_fake_tensor_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    args = _valid()
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = torch.ops.taps_ops.panel_linear(torch.empty(2, 7, 24), args["panels"], None)
        half = torch.ops.taps_ops.panel_linear(torch.empty(2, 7, 24, dtype=torch.bfloat16),
                                               taps_ops.pack_panels(torch.randn(32, 24), torch.bfloat16), None)
    assert y.shape == (2, 7, 32) and half.shape == (2, 7, 32) and half.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(24,), (3, 24), (2, 5, 24), (0, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_fast_entry_same_as_torch_ops(shape, bias):
    """taps_ops.panel_linear (and taps.lean's call) take a fast entry for plain CPU tensors, torch.ops for
    anything else: the same bits either way."""
    args = _valid()
    x, b = torch.randn(shape), args["bias"] if bias else None
    want = torch.ops.taps_ops.panel_linear.default(x, args["panels"], b)
    assert torch.equal(taps_ops.panel_linear(x, args["panels"], b), want)
    assert torch.equal(taps_ops._panel_linear_call(x, args["panels"], b), want)
    if taps_ops._panel_linear_fast is not None:
        assert torch.equal(taps_ops._panel_linear_fast(x, args["panels"], b), want)
        assert taps_ops._panel_linear_fast(x, args["panels"], 1.0) is NotImplemented  # torch.ops rejects it
        with pytest.raises(TypeError, match="3 positional arguments"):
            taps_ops._panel_linear_fast(x, args["panels"])


def test_fast_entry_keeps_modes_autograd_and_profiler():
    """The fast entry still dispatches: torch-function and dispatch modes, subclasses, the autograd
    fallback (inputs that need gradients) and the profiler see the op as through torch.ops."""
    args = _valid()
    x, panels, bias = args["x"], args["panels"], args["bias"]
    want = taps_ops.panel_linear(x, panels, bias)
    assert_modes_see_op(lambda: taps_ops.panel_linear(x, panels, bias), torch.ops.taps_ops.panel_linear.default, want)
    assert_compiles_like_eager(lambda *a: (taps_ops.panel_linear(*a),), x, panels, bias)

    class Sub(torch.Tensor):
        pass

    assert torch.equal(taps_ops.panel_linear(x.as_subclass(Sub), panels, bias), want)
    assert torch.equal(taps_ops.panel_linear(x, panels, bias.as_subclass(Sub)), want)

    xg = x.clone().requires_grad_()
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        out = taps_ops.panel_linear(xg, panels, bias)
        assert out.requires_grad and out.grad_fn is not None  # the autograd fallback's node, as with torch.ops
        out.sum().backward()
    with torch.no_grad():
        assert taps_ops.panel_linear(xg, panels, bias).grad_fn is None

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        taps_ops.panel_linear(x, panels, bias)
    assert any(e.name == "taps_ops::panel_linear" for e in prof.events())


def test_bf16_results_round_as_torch_does_at_the_edges(restore_level):
    """bfloat16 x: the float32 sums are rounded to bfloat16 as ``Tensor.bfloat16()`` rounds them, bit for bit,
    also where they are NaN (NaN wherever torch's is), infinite, round up to infinity or are ties (denormals
    left out: AVX512-BF16's dot products flush them, as documented)."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(48, 8, generator=gen)
    weight[0] = 0
    weight[1, 0] = 3e38                      # x[:, 0] = 2 overflows to inf
    half = taps_ops.pack_panels(weight, torch.bfloat16)
    x = torch.randn(6, 8, generator=gen).bfloat16()
    x[0, 0] = float("nan")
    x[1, 0] = float("inf")
    x[2, 0] = 2.0
    x[4, 0] = -float("inf")
    # ties to even and rounding up to infinity: y[:, i] = x[:, i] through an identity weight
    f = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 3.3895e38, -3.3895e38, 1.0, 2.0])
    eye = taps_ops.pack_panels(torch.eye(16)[:, :6].contiguous(), torch.bfloat16)
    for level in RUNNABLE:
        taps_ops.set_cpu_isa(level)
        y = taps_ops.panel_linear(x, half)
        want = taps_ops.panel_linear(x.float(), half).bfloat16()
        nan = want.isnan()   # (NaN bits differ within torch itself: its vector loop writes 0xFFFF, its tail 0x7FC0)
        assert torch.equal(y.isnan(), nan), level
        assert torch.equal(y[~nan].view(torch.int16), want[~nan].view(torch.int16)), level
        sums = taps_ops.panel_linear(f.unsqueeze(0), eye)   # float32 x: the exact values
        assert torch.equal(sums[0, :6], f)
        z = taps_ops.panel_linear(f.bfloat16().float().unsqueeze(0), eye).bfloat16()
        assert torch.equal(taps_ops.panel_linear(f.bfloat16().unsqueeze(0), eye).view(torch.int16),
                           z.view(torch.int16)), level
        assert torch.equal(sums.bfloat16()[0, :6].view(torch.int16), f.bfloat16().view(torch.int16))


def test_bf16_results_past_the_kept_scratch_round_the_same():
    """A bfloat16 product larger than the per-thread scratch panel_linear keeps (2^20 floats: here 130 x 8192)
    gets a temporary and the same rounding; smaller ones after it still agree."""
    gen = torch.Generator().manual_seed(9)
    half = taps_ops.pack_panels(torch.randn(8192, 8, generator=gen), torch.bfloat16)
    for rows in (130, 3, 129):
        x = torch.randn(rows, 8, generator=gen).bfloat16()
        y = taps_ops.panel_linear(x, half)
        assert torch.equal(y.view(torch.int16), taps_ops.panel_linear(x.float(), half).bfloat16().view(torch.int16))
