"""Timing and table helpers shared by the microbenchmarks in bench/.

Timing: median of repeats after warm-up; CUDA timings use CUDA events on the current stream and can
flush L2 between repeats (so a kernel is not measured on a cache-warm input it would not see in a
decoding loop). Results are printed as aligned tables with ratios against a reference column, because
absolute times on a shared machine are noisy and ratios measured side by side are not.

Instruction-set levels: every op benchmark takes ``--isa`` (add_isa_argument / isa_levels) and times the
taps op once per level (per_isa, which runs a callable under taps_ops.set_cpu_isa and restores the level
after), next to its PyTorch reference measured once; op_levels drops the levels at which an op runs the
same code as a higher one (taps_ops.cpu_info()["ops"]).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Callable, Iterator, Sequence, TypeVar

import torch

T = TypeVar("T")
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
    import taps_ops

    return ", ".join(parts) + " | " + taps_ops.cpu_info()["summary"]


def peak_flops(levels: Sequence[str]) -> dict:
    """FLOP/s of one core's fp32 multiply-adds at each level, measured by the library (a few ms a level: a
    throughput loop of the level's vectors, at the clock the core runs now); {} with a library built without
    the measurement."""
    import taps_ops  # noqa: F401  (loads the library)

    if not hasattr(torch.ops.taps_ops, "_cpu_peak_flops"):
        return {}
    return {lv: torch.ops.taps_ops._cpu_peak_flops(lv) for lv in levels}


def add_isa_argument(ap) -> None:
    """The --isa option of the op benchmarks (read it with isa_levels)."""
    ap.add_argument("--isa", default=None, metavar="LEVELS",
                    help="comma list of taps CPU instruction-set levels to time (scalar, avx2, avx512, amx). Default: "
                         "every level up to the one in force (the CPU's, or TAPS_CPU_ISA's), highest first, avx512 "
                         "left out when amx is in force (the same code but for tree_attention's bf16 AMX path)")


def isa_levels(spec: str | None) -> list[str]:
    """The levels `--isa` asks for, in its order; by default every level up to the one in force, highest first
    (without avx512 under amx). Exits with a message for an unknown level or one above the CPU's."""
    import taps_ops

    levels = taps_ops.CPU_ISA_LEVELS
    info = taps_ops.cpu_info()
    if not spec:
        top = levels.index(info["isa"])
        return [lv for lv in reversed(levels[:top + 1]) if not (lv == "avx512" and levels[top] == "amx")]
    asked = [lv.strip() for lv in spec.split(",") if lv.strip()]
    for lv in asked:
        if lv not in levels:
            raise SystemExit(f"--isa: unknown level {lv!r} (levels: {', '.join(levels)})")
        if levels.index(lv) > levels.index(info["host_isa"]):
            raise SystemExit(f"--isa: this CPU runs at most {info['host_isa']}, not {lv}")
    return asked


@contextlib.contextmanager
def cpu_isa(level: str) -> Iterator[None]:
    """Runs the body with the taps CPU kernels at `level`, then restores the level in force before."""
    import taps_ops

    previous = taps_ops.set_cpu_isa(level)
    try:
        yield
    finally:
        taps_ops.set_cpu_isa(previous)


def per_isa(levels: Sequence[str], fn: Callable[[], T]) -> list[T]:
    """fn() once under each level, in order (a timing function, typically)."""
    out = []
    for level in levels:
        with cpu_isa(level):
            out.append(fn())
    return out


def op_levels(levels: Sequence[str], op: str) -> list[str]:
    """`levels` as the code `op` runs at each (taps_ops.cpu_info()["ops"]), repeats dropped: e.g. amx, avx2,
    scalar -> avx2, scalar for an op whose best code is AVX2; a single level for an op without vector code."""
    import taps_ops

    out: list[str] = []
    for level in levels:
        with cpu_isa(level):
            used = taps_ops.cpu_info()["ops"][op]
        if used not in out:
            out.append(used)
    return out


def isa_note(op: str, levels: Sequence[str]) -> str:
    """The line under a table saying which levels its taps columns are (after op_levels)."""
    import taps_ops

    with cpu_isa(taps_ops.cpu_info()["host_isa"]):
        vector = taps_ops.cpu_info()["ops"][op] != "scalar"
    if not vector:
        return f"{op} has no vector code: one taps column, the same at every instruction-set level."
    return f"taps columns: {op} at instruction-set level {', '.join(levels)} (taps_ops.set_cpu_isa)."


def isa_headers(levels: Sequence[str], ref: str) -> list[str]:
    """Two columns per level: the taps time and the ratio `ref` time / taps time."""
    return [h for lv in levels for h in (f"taps {lv}", f"x {ref}")]


def isa_cells(ref_time: float, times: Sequence[float]) -> list[str]:
    """The cells under isa_headers: each level's time and ref_time over it ("-" where either is NaN)."""
    return [c for t in times for c in (fmt_time(t), f"{ref_time / t:.2f}x" if ref_time == ref_time and t == t else "-")]


def bench_devices() -> list[str]:
    """The devices a benchmark runs on: "cpu", then "cuda" where a GPU and the CUDA kernels are there.
    TAPS_BENCH_DEVICES (a comma-separated list, e.g. "cuda") narrows it: a GPU check skips the CPU rows."""
    import taps_ops

    found = ["cpu"] + (["cuda"] if torch.cuda.is_available() and taps_ops.has_cuda_kernels() else [])
    wanted = os.environ.get("TAPS_BENCH_DEVICES", "").replace(" ", "")
    if not wanted:
        return found
    unknown = sorted(set(wanted.split(",")) - {"cpu", "cuda"})
    if unknown:
        raise SystemExit(f"TAPS_BENCH_DEVICES: unknown device(s) {unknown}; accepted: cpu, cuda")
    return [d for d in found if d in wanted.split(",")]


def tree_bench_setup(op: str):
    """The command line (--quick, --no-reference, --isa) and the devices of the tree benchmarks; prints the
    header line. Returns (args, devices); args.isa holds the levels (isa_levels)."""
    import argparse

    import taps_ops

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-reference", action="store_true", help="skip the slow reference column")
    add_isa_argument(ap)
    args = ap.parse_args()
    args.isa = isa_levels(args.isa)
    print(f"{op} | {machine_line()}")
    return args, bench_devices()
