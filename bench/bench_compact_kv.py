"""Microbenchmark of taps_ops.compact_kv: the in-place move of the accepted path's KV entries.

    PYTHONPATH=python python bench/bench_compact_kv.py [--repeats 7]

Columns: a plain-PyTorch in-place version (index_select + index_copy_ per request and tensor, what a
model runner would write without this op), the reference (taps_ops.reference.compact_kv_ref, which
allocates new tensors; small sizes only), taps on CPU, taps on CUDA when present; median of `repeats`.
For CUDA, "GB/s" counts the bytes moved (read + write of each moved row).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import taps_ops
from taps_ops.reference import compact_kv_ref


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
    args = ap.parse_args()
    torch.manual_seed(0)
    shapes = [  # B, layers, H, S, D, path length, dtype
        (1, 4, 8, 512, 128, 6, torch.float32),
        (4, 32, 8, 2048, 128, 6, torch.bfloat16),
        (8, 32, 8, 4096, 128, 8, torch.bfloat16),
    ]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and taps_ops.has_cuda_kernels() else [])
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, median of {args.repeats}")
    print(f"{'device':6} {'B':>2} {'L':>3} {'H':>2} {'S':>5} {'D':>4} {'P':>2} {'dtype':>8} "
          f"{'torch ms':>9} {'ref ms':>9} {'taps ms':>9} {'x torch':>8} {'GB/s':>7}")
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
            t_taps = timed(lambda: taps_ops.compact_kv(caches, path, prefix), args.repeats, cuda)
            moved = 2 * (plen - 1) * b * h * d * caches[0].element_size() * len(caches)
            ref = f"{t_ref * 1e3:9.3f}" if t_ref else f"{'-':>9}"
            bw = f"{moved / t_taps / 1e9:7.1f}" if cuda else f"{'-':>7}"
            print(f"{device:6} {b:2} {layers:3} {h:2} {s:5} {d:4} {plen:2} {str(dt)[6:]:>8} {t_torch * 1e3:9.3f} "
                  f"{ref} {t_taps * 1e3:9.3f} {t_torch / t_taps:8.1f} {bw}")


if __name__ == "__main__":
    main()
