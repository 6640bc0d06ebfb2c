"""Microbenchmark of taps_ops.panel_linear (x W^T over a weight kept as taps' panels) against torch's float32
products of a few rows, on the CPU.

    PYTHONPATH=python python bench/bench_panel_linear.py [--rows 1,2,4,8,16,32] [--isa LEVELS] [--quick] [--bf16]
    PYTHONPATH=python python bench/bench_panel_linear.py --cold [--rows 1,4,8,16] [--bf16]

Rows of the table: the shipped target's projections and head (hidden 256, intermediate 768, vocabulary
8192) and one Llama-7B-sized projection, each at a decoding step's and a draft tree's row counts. Columns:
torch's fastest of ``F.linear`` over the [out, in] weight and ``mm`` over an [in, out] copy (the BLAS forms
taps.lean times at load), taps at each instruction-set level (``--isa``, bench/common.py), the ratio, and the
floor: the larger of reading the weight once at ``--gbps`` (default 25 GB/s, one core of the development
CPU reading from DRAM; a weight that fits the L2 cache reads faster, so small weights can beat it) and the
multiply-adds at the level's measured fp32 peak. Every time is the fastest of ``--rounds`` rounds of
calls, torch and taps alternating (a burst of load hits them alike).

``--bf16``: taps' panels in bfloat16 (the weight rounded; widened to float32 as read, half the bytes), against
the same float32 torch products: what a bfloat16 model gets on a CPU without bf16 products, where torch's
alternative is the widened float32 weight (taps.lean keeps the faster, timed at load). The floor then counts
2 bytes a weight.

``--bf16-x``: x in bfloat16 too, over bfloat16 panels (bfloat16 out; AVX512-BF16's dot products at the avx512
level on a CPU that has them, the other levels widen x: the same bits), against torch's bfloat16 products of the
same rounded weight: ``F.linear`` and oneDNN's over a packed copy (what a bfloat16 model runs in torch).

``--cold``: weights read from memory, as a large model's layers are in a decoding step: each product cycles over
enough copies of its weight (``--cold-mib`` together) that no cache holds the one it reads; the shapes of a
0.5B Llama's layers (hidden 1280, MLP 3584) and the shipped head; columns: torch, taps with its software
prefetches off, with the next output block's panels not asked ahead (``_set_panel_next(False)``; asked by the row
blocks after the first, from 16 rows on), and by default (both on; the streams' own
prefetches, ``_set_panel_prefetch``: 24 cache lines ahead for weights of >= 4 MiB with panels of >= 32 KiB), and the
ratios.

torch runs at the process's own level: to compare on an AVX2-only machine from an AVX-512 one, set
``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 TAPS_CPU_ISA=avx2``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_isa_argument, cpu_isa, isa_levels, machine_line, op_levels, peak_flops  # noqa: E402

import taps_ops  # noqa: E402

SHAPES = [  # name, out, in
    ("target qkv", 512, 256), ("target o", 256, 256), ("target gate_up", 1536, 256), ("target down", 256, 768),
    ("target head", 8192, 256), ("7B q / o", 4096, 4096),
]


def best_time(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gbps", type=float, default=25.0, help="memory bandwidth for the floor column")
    ap.add_argument("--quick", action="store_true", help="the shipped target's shapes at 1, 4 and 16 rows")
    ap.add_argument("--bf16", action="store_true", help="taps' panels in bfloat16 (the weight rounded)")
    ap.add_argument("--bf16-x", action="store_true",
                    help="x in bfloat16 too (bfloat16 panels; AVX512-BF16 dot products where the CPU has them), "
                         "against torch's bfloat16 products (F.linear and oneDNN over a packed copy)")
    ap.add_argument("--cold", action="store_true", help="weights read from memory (see above)")
    ap.add_argument("--cold-mib", type=int, default=256, help="--cold: MiB of copies per weight")
    add_isa_argument(ap)
    args = ap.parse_args()
    args.bf16 = args.bf16 or args.bf16_x
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if args.cold:
        cold_table(args)
        return
    levels = op_levels(isa_levels(args.isa), "panel_linear")
    rows_list = [1, 4, 16] if args.quick else [int(r) for r in args.rows.split(",")]
    shapes = SHAPES[:5] if args.quick else SHAPES
    peaks = peak_flops(levels)
    print(f"{machine_line()} | threads {torch.get_num_threads()}, fastest of {args.rounds} rounds")
    print(f"taps columns: panel_linear ({'bfloat16' if args.bf16 else 'float32'} panels) at level "
          f"{', '.join(levels)}{'; x in bfloat16, torch in bfloat16' if args.bf16_x else ''}; fp32 peak per level (measured): "
          + ", ".join(f"{lv} {peaks[lv] / 1e9:.0f} GFLOP/s" for lv in levels if lv in peaks))
    head = f"{'weight':>15} {'out x in':>11} {'rows':>4} {'torch us':>9} " + " ".join(
        f"{'taps ' + lv + ' us':>15} {'x torch':>7} {'floor us':>8}" for lv in levels)
    print(head)
    print("-" * len(head))
    gen = torch.Generator().manual_seed(0)
    for name, out, inner in shapes:
        weight = torch.randn(out, inner, generator=gen)
        transposed = weight.t().contiguous()
        panels = taps_ops.pack_panels(weight, torch.bfloat16 if args.bf16 else None)
        weight_bytes = out * inner * panels.element_size()
        calls = max(3, min(200, int(2e8 / (out * inner * 4))))
        for rows in rows_list:
            x = torch.randn(rows, inner, generator=gen)
            forms = {"linear": lambda: F.linear(x, weight), "mm": lambda: torch.mm(x, transposed)}
            if args.bf16_x:
                x = x.bfloat16()
                forms = _torch_bf16_forms(x, weight)
            for lv in levels:
                forms[lv] = (lambda lv=lv: _at(lv, lambda: taps_ops.panel_linear(x, panels)))
            best = dict.fromkeys(forms, float("inf"))
            for fn in forms.values():
                fn()
            for _ in range(args.rounds):
                for key, fn in forms.items():
                    if key in levels:
                        with cpu_isa(key):
                            best[key] = min(best[key], best_time(lambda: taps_ops.panel_linear(x, panels), calls))
                    else:
                        best[key] = min(best[key], best_time(fn, calls))
            t_torch = min(best[k] for k in forms if k not in levels)
            cells = []
            for lv in levels:
                floor = max(weight_bytes / (args.gbps * 1e9), 2 * rows * out * inner / peaks.get(lv, float("inf")))
                cells.append(f"{best[lv] * 1e6:15.1f} {t_torch / best[lv]:6.3f}x {floor * 1e6:8.1f}")
            print(f"{name:>15} {f'{out}x{inner}':>11} {rows:4} {t_torch * 1e6:9.1f} " + " ".join(cells), flush=True)


COLD_SHAPES = [  # name, out, in
    ("0.5B qkv", 1792, 1280), ("0.5B o", 1280, 1280), ("0.5B gate_up", 7168, 1280), ("0.5B down", 1280, 3584),
    ("target head", 8192, 256),
]


def cold_table(args) -> None:
    """Products over weights read from memory (``--cold``): torch's fastest BLAS form, taps without and with its
    software prefetches; every form once per round on the same cycle of copies, the fastest round kept."""
    rows_list = [1, 4, 16] if args.quick else [int(r) for r in args.rows.split(",")]
    shapes = COLD_SHAPES[1:3] + COLD_SHAPES[4:] if args.quick else COLD_SHAPES
    dtype = torch.bfloat16 if args.bf16 else None
    print(f"{machine_line()} | threads {torch.get_num_threads()}, fastest of {args.rounds} rounds; taps kernels at "
          f"{taps_ops.cpu_info()['isa']}, {'bfloat16' if args.bf16 else 'float32'} panels; weights read from memory "
          f"(each product cycles over {args.cold_mib} MiB of copies)")
    head = (f"{'weight':>13} {'out x in':>10} {'rows':>4} {'torch us':>9} {'taps us':>8} {'no next us':>10} "
            f"{'prefetch us':>11} {'prefetch / off':>14} {'/ no next':>9} {'x torch':>7} {'GB/s':>6}")
    print(head)
    print("-" * len(head))
    gen = torch.Generator().manual_seed(0)
    before = torch.ops.taps_ops._set_panel_prefetch(-1)
    next_before = torch.ops.taps_ops._set_panel_next(True)
    try:
        for name, out, inner in shapes:
            copies = max(2, min(64, (args.cold_mib << 20) // (out * inner * 4)))
            weights = [torch.randn(out, inner, generator=gen) for _ in range(copies)]
            transposed = [w.t().contiguous() for w in weights]
            panels = [taps_ops.pack_panels(w, dtype) for w in weights]
            weight_bytes = out * inner * panels[0].element_size()
            for rows in rows_list:
                x = torch.randn(rows, inner, generator=gen)

                if args.bf16_x:
                    x = x.bfloat16()
                    halves = [w.bfloat16() for w in weights]
                    packed = [_packed_bf16(w) for w in halves]

                def cycle(fn, setting=None):
                    if setting is not None:  # (streams' lines ahead, the next block asked ahead)
                        torch.ops.taps_ops._set_panel_prefetch(setting[0])
                        torch.ops.taps_ops._set_panel_next(setting[1])
                    t0 = time.perf_counter()
                    for i in range(copies):
                        fn(i)
                    return (time.perf_counter() - t0) / copies
                forms = {"linear": lambda: cycle(lambda i: F.linear(x, weights[i])),
                         "mm": lambda: cycle(lambda i: torch.mm(x, transposed[i]))}
                if args.bf16_x:
                    forms = {"linear": lambda: cycle(lambda i: F.linear(x, halves[i]))}
                    if packed[0] is not None:
                        forms["packed"] = lambda: cycle(lambda i: torch.ops.mkldnn._linear_pointwise(
                            x, packed[i], None, "none", [], ""))
                forms |= {
                         "off": lambda: cycle(lambda i: taps_ops.panel_linear(x, panels[i]), (0, False)),
                         "no next": lambda: cycle(lambda i: taps_ops.panel_linear(x, panels[i]), (-1, False)),
                         "on": lambda: cycle(lambda i: taps_ops.panel_linear(x, panels[i]), (-1, True))}
                best = dict.fromkeys(forms, float("inf"))
                for _ in range(args.rounds):
                    for key, fn in forms.items():
                        best[key] = min(best[key], fn())
                t_torch = min(best[k] for k in forms if k not in ("off", "no next", "on"))
                print(f"{name:>13} {f'{out}x{inner}':>10} {rows:4} {t_torch * 1e6:9.1f} {best['off'] * 1e6:8.1f} "
                      f"{best['no next'] * 1e6:10.1f} {best['on'] * 1e6:11.1f} {best['on'] / best['off']:13.3f}x "
                      f"{best['on'] / best['no next']:8.3f}x {t_torch / best['on']:6.3f}x "
                      f"{weight_bytes / best['on'] / 1e9:6.1f}", flush=True)
            del weights, transposed, panels
    finally:
        torch.ops.taps_ops._set_panel_prefetch(before)
        torch.ops.taps_ops._set_panel_next(next_before)


def _packed_bf16(weight):
    """oneDNN's packed copy of a bfloat16 weight (what taps.lean keeps for torch's bf16 products), or None."""
    from taps.lean import pack_weight
    return pack_weight(weight)


def _torch_bf16_forms(x, weight):
    """torch's bfloat16 products of x [rows, in] bf16 by weight [out, in] (rounded to bf16): F.linear and, where
    oneDNN packs it, the packed copy."""
    half = weight.bfloat16()
    forms = {"linear": lambda: F.linear(x, half)}
    packed = _packed_bf16(half)
    if packed is not None:
        forms["packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return forms


def _at(level, fn):
    with cpu_isa(level):
        return fn()


if __name__ == "__main__":
    main()
