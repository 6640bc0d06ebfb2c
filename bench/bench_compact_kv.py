"""Microbenchmark of taps_ops.compact_kv: the in-place move of the accepted path's KV entries.

    PYTHONPATH=python python bench/bench_compact_kv.py [--repeats 7] [--quick] [--isa LEVELS]

Columns: a plain-PyTorch in-place version (index_select + index_copy_ per request and tensor, what a
model runner would write without this op), the reference (taps_ops.reference.compact_kv_ref, which
allocates new tensors; small sizes only), taps on CPU, taps on CUDA when present; median of `repeats`.
For CUDA, "GB/s" counts the bytes moved (read + write of each moved row). The op has no vector code
(memcpy; taps_ops.cpu_info()["ops"]), so ``--isa`` (see bench/common.py) gives one taps column whatever
levels it names.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (bench_devices, add_isa_argument, fmt_time, isa_cells, isa_headers, isa_levels, isa_note,  # noqa: E402
                    machine_line, op_levels, per_isa, print_table)

import taps_ops  # noqa: E402
from taps_ops.reference import compact_kv_ref  # noqa: E402


def timed(fn, repeats: int, cuda: bool) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torch_in_place(caches, path, prefix_lens):
    for b in range(path.shape[0]):
        n = int((path[b] >= 0).sum())
        src = path[b, :n] + prefix_lens[b]
        dst = torch.arange(n, device=path.device) + prefix_lens[b]
        for c in caches:
            c[b].index_copy_(1, dst, c[b].index_select(1, src))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-reference", action="store_true", help="skip the plain-PyTorch reference column")
    ap.add_argument("--quick", action="store_true", help="the smallest shape only")
    add_isa_argument(ap)
    args = ap.parse_args()
    levels = op_levels(isa_levels(args.isa), "compact_kv")
    torch.manual_seed(0)
    shapes = [  # B, layers, H, S, D, path length, dtype
        (1, 4, 8, 512, 128, 6, torch.float32),
        (4, 32, 8, 2048, 128, 6, torch.bfloat16),
        (8, 32, 8, 4096, 128, 8, torch.bfloat16),
    ]
    if args.quick:
        shapes = shapes[:1]
    devices = bench_devices()
    print(f"compact_kv | {machine_line()} | median of {args.repeats}")
    rows = []
    for device in devices:
        cuda = device == "cuda"
        for (b, layers, h, s, d, plen, dt) in shapes:
            caches = [torch.randn(b, h, s, d, device=device).to(dt) for _ in range(2 * layers)]
            prefix = torch.randint(0, s - 64, (b,), device=device)
            path = torch.full((b, 16), -1, dtype=torch.int64)
            for i in range(b):
                path[i, :plen] = torch.cat([torch.zeros(1, dtype=torch.int64),
                                            (torch.randperm(63)[: plen - 1] + 1).sort().values])
            path = path.to(device)
            t_torch = timed(lambda: torch_in_place(caches, path, prefix), args.repeats, cuda)
            small = b * layers <= 8 and not args.no_reference
            t_ref = timed(lambda: compact_kv_ref(caches, path, prefix), args.repeats, cuda) if small else None
            taps = lambda: timed(lambda: taps_ops.compact_kv(caches, path, prefix), args.repeats, cuda)  # noqa: E731
            times = [taps()] + [float("nan")] * (len(levels) - 1) if cuda else per_isa(levels, taps)
            moved = 2 * (plen - 1) * b * h * d * caches[0].element_size() * len(caches)
            rows.append([device, b, layers, h, s, d, plen, str(dt)[6:], fmt_time(t_torch),
                         fmt_time(t_ref) if t_ref else "-", *isa_cells(t_torch, times),
                         f"{moved / times[0] / 1e9:.1f}" if cuda else "-"])
    print_table(["device", "B", "L", "H", "S", "D", "P", "dtype", "torch", "ref", *isa_headers(levels, "torch"),
                 "GB/s"], rows)
    print(isa_note("compact_kv", levels))

if __name__ == "__main__":
    main()
