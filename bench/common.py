"""Timing and table helpers shared by the microbenchmarks in bench/.

Timing: median of repeats after warm-up; CUDA timings use CUDA events on the current stream and can
flush L2 between repeats (so a kernel is not measured on a cache-warm input it would not see in a
decoding loop). Results are printed as aligned tables with ratios against a reference column, because
absolute times on a shared machine are noisy and ratios measured side by side are not.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

_L2_FLUSH: dict = {}


def flush_l2(device: torch.device) -> None:
    """Overwrite a 256 MB buffer, larger than any current GPU's L2 cache."""
    buf = _L2_FLUSH.get(device)
    if buf is None:
        buf = _L2_FLUSH[device] = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32, device=device)
    buf.zero_()


def time_call(fn: Callable[[], object], device: torch.device | str = "cpu", *, warmup: int = 3,
              repeats: int = 20, min_seconds: float = 0.0, flush: bool = False) -> float:
    """Median seconds per call of fn()."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            if flush:
                flush_l2(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        t_end = time.perf_counter() + min_seconds
        while len(times) < repeats or time.perf_counter() < t_end:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fmt_time(seconds: float) -> str:
    if seconds != seconds:  # NaN: not measured
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> None:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if title:
        print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def machine_line() -> str:
    import os
    import platform

    parts = [f"torch {torch.__version__}", f"{os.cpu_count()} CPU threads (torch uses {torch.get_num_threads()})",
             platform.processor() or platform.machine()]
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    return ", ".join(parts)


def tree_bench_setup(op: str):
    """The command line (--quick, --no-reference) and the devices of the tree benchmarks; prints the
    header line. Returns (args, devices)."""
    import argparse

    import taps_ops

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-reference", action="store_true", help="skip the slow reference column")
    args = ap.parse_args()
    print(f"{op} | {machine_line()}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and taps_ops.has_cuda_kernels() else [])
    return args, devices
