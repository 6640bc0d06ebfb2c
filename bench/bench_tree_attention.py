"""Microbenchmark of taps_ops.tree_attention against PyTorch SDPA with a dense boolean mask.

    PYTHONPATH=python python bench/bench_tree_attention.py [--repeats 7] [--quick] [--threads T] [--isa LEVELS]

Columns: SDPA (torch.nn.functional.scaled_dot_product_attention, dense bool mask [B, 1, N, S],
enable_gqa=True), the float64-free reference (taps_ops.reference.tree_attention_ref in the input dtype,
small sizes only), taps; median of `repeats` timed runs each. Speedups are SDPA time / taps time on the
same device; on the CPU SDPA and taps (at each level) run in alternation, one call each per round, and
"x sdpa" is the median of the rounds' ratios, so that a machine whose speed drifts (a shared one) moves
both sides of each ratio alike.

CPU: one taps column per instruction-set level (``--isa``, see bench/common.py), SDPA and the reference
measured once, and per level the floor: the larger of the FLOPs (4 * B * Hq * N * S * D) at the level's
peak (threads x one core's fp32 multiply-add rate at that level, measured at start by a throughput loop of
the level's vectors and printed in the first line; with ``--ghz``, threads x GHz x FLOP per cycle: 8
scalar, 32 AVX2 (two 8-lane FMAs), 64 AVX-512 and AMX; the kernels compute in fp32, bf16 widened, except
bf16 at amx where its AMX path runs (head dim >= 64, >= 16 rows per KV head; TAPS_ATTN_BF16_AMX=1 always,
0 never), whose tile products can beat this floor) and the K/V bytes at
``--gbps``; "% floor" is floor / taps time.
The first rows are the shipped target's attention (B 1, Hq 8, Hkv 4, D 32, a 16-node tree after ~200
cached keys), fp32 and bf16; the last rows decoding steps (N = 1: the shipped target's, Llama-3-8B heads at 4k
keys and a batch of 8 at 1k; SDPA without a mask took as long on the development CPU: 92 against 97 us at the
shipped shape in bf16). A second table times ragged batches of trees in one [B, N] grid (a packed prompt
lookup batch of the shipped target; merged trees of different sizes): taps over the whole grid against taps
with ``num_queries`` (each request's real nodes only), and SDPA over the grid.

CUDA (when present): "GB/s" is the K/V bytes of the visible keys (2 * B * Hkv * sum(kv_lens) * D * elem)
over the taps time, and "% copy" that rate over the device-to-device copy rate measured first (a 1 GiB
copy: its read plus write bytes over its time), the practical ceiling of HBM bandwidth. On CUDA,
Llama-3-8B head shapes at S = 1k, 4k, 32k run too; bf16 / fp16 rows with G * N >= 16 take the
tensor-core kernel ("kernel" column). "x flashinfer" is FlashInfer's single_prefill_with_kv_cache with
the same custom mask over taps (B = 1, when installed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (bench_devices, add_isa_argument, cpu_isa, fmt_time, isa_levels, machine_line, op_levels,  # noqa: E402
                    peak_flops, print_table)

import taps_ops  # noqa: E402
from taps_ops.reference import tree_attention_dense_mask, tree_attention_ref  # noqa: E402

# FLOP per cycle and core of the fp32 arithmetic at each level (fused multiply-add counted as two)
FLOP_PER_CYCLE = {"scalar": 8, "avx2": 32, "avx512": 64, "amx": 64}


def random_tree_mask(batch: int, num_nodes: int, device) -> torch.Tensor:
    """A random ancestor bitmask of random trees (parent of node i uniform in [0, i))."""
    words = (num_nodes + 63) // 64
    mask = torch.zeros(batch, num_nodes, words, dtype=torch.int64)
    for b in range(batch):
        rows = [0] * num_nodes
        rows[0] = 1
        for i in range(1, num_nodes):
            parent = int(torch.randint(0, i, ()))
            rows[i] = rows[parent] | (1 << i)
        for i in range(num_nodes):
            for w in range(words):
                word = (rows[i] >> (64 * w)) & ((1 << 64) - 1)
                mask[b, i, w] = word - (1 << 64) if word >= (1 << 63) else word
    return mask.to(device)


def timed(fn, repeats: int, cuda: bool) -> float:
    """Median seconds of `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def alternating(reference, fn, levels, repeats: int):
    """CPU: `reference` and `fn` at each instruction-set level in `levels` called in turn, one call each per
    round, after one warm-up call each: (reference's median seconds, [fn's median per level], [median over
    the rounds of reference / fn per level])."""
    def once(f) -> float:
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    reference()
    for level in levels:
        with cpu_isa(level):
            fn()
    ref_times, times = [], [[] for _ in levels]
    for _ in range(repeats):
        ref_times.append(once(reference))
        for i, level in enumerate(levels):
            with cpu_isa(level):
                times[i].append(once(fn))
    ratios = [statistics.median(r / t for r, t in zip(ref_times, ts)) for ts in times]
    return statistics.median(ref_times), [statistics.median(ts) for ts in times], ratios


def copy_bandwidth(repeats: int) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), repeats, True)


def flashinfer_time(q, k, v, dense, repeats):
    """FlashInfer's single-request prefill with the same dense custom mask (B = 1), when importable.
    Never run by this project yet (FlashInfer was not available where the benchmark last ran)."""
    try:
        import flashinfer
    except ImportError:
        return None
    q_nhd = q[0].transpose(0, 1).contiguous()  # [N, Hq, D]
    mask = dense[0, 0].contiguous()            # [N, S] bool
    return timed(lambda: flashinfer.single_prefill_with_kv_cache(q_nhd, k[0], v[0], custom_mask=mask,
                                                                 kv_layout="HND"), repeats, True)


def max_ghz() -> float:
    """The highest "cpu MHz" of /proc/cpuinfo, in GHz (2.0 where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(ln.split(":")[1]) for ln in f if ln.startswith("cpu MHz")]
    except OSError:
        mhz = []
    return max(mhz) / 1e3 if mhz else 2.0


def level_peaks(levels, ghz) -> tuple[dict, str]:
    """FLOP/s of one core at each level and how they were found: at ``ghz`` GHz (when given) by the
    FLOP-per-cycle table, else measured (common.peak_flops), the /proc/cpuinfo clock for a library that
    cannot measure."""
    measured = {} if ghz else peak_flops(levels)
    if measured:
        rates = ", ".join(f"{lv} {measured[lv] / 1e9:.0f}" for lv in levels)
        return measured, f"fp32 peak per core, measured: {rates} GFLOP/s"
    ghz = ghz or max_ghz()
    return ({lv: ghz * 1e9 * FLOP_PER_CYCLE[lv] for lv in levels},
            f"fp32 peak per core: {ghz:.2f} GHz x FLOP/cycle of the level "
            f"({', '.join(f'{lv} {FLOP_PER_CYCLE[lv]}' for lv in levels)})")


def case(batch, heads_q, heads_kv, num_nodes, head_dim, cache_len, dtype, repeats, device, reference=True,
         levels=()):
    """SDPA, the reference and taps timed on one shape; on the CPU taps once per level in `levels` (a list
    under row["taps"]), else once."""
    cuda = device == "cuda"
    q = torch.randn(batch, heads_q, num_nodes, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, heads_kv, cache_len, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, heads_kv, cache_len, head_dim, dtype=dtype, device=device)
    kv_lens = torch.full((batch,), cache_len, dtype=torch.int64, device=device)
    tree_mask = random_tree_mask(batch, num_nodes, device)
    dense = tree_attention_dense_mask(tree_mask, kv_lens, cache_len)[:, None]
    row = {}
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)  # noqa: E731
    taps_call = lambda: taps_ops.tree_attention(q, k, v, tree_mask, kv_lens)  # noqa: E731
    if cuda:
        row["sdpa"], row["taps"] = timed(sdpa, repeats, cuda), timed(taps_call, repeats, cuda)
    else:
        row["sdpa"], row["taps"], row["x_sdpa"] = alternating(sdpa, taps_call, levels, repeats)
    small = reference and batch * heads_q * num_nodes * cache_len <= 2_000_000
    row["ref"] = timed(lambda: tree_attention_ref(q, k, v, tree_mask, kv_lens, dtype=dtype), repeats, cuda) \
        if small else None
    row["flashinfer"] = flashinfer_time(q, k, v, dense, repeats) if cuda and batch == 1 else None
    kv_bytes = 2 * batch * heads_kv * cache_len * head_dim * k.element_size()
    return row, kv_bytes


def ragged_case(batch, heads_q, heads_kv, num_nodes, head_dim, cache_len, dtype, live, repeats, levels):
    """A ragged batch of trees in one [B, N] grid (request b's real nodes 0 .. live[b] - 1): SDPA over the grid,
    taps over the grid, and taps with num_queries=live, alternating per round (CPU); per level
    (taps grid, taps live, grid / live by the median round)."""
    q = torch.randn(batch, heads_q, num_nodes, head_dim, dtype=dtype)
    k = torch.randn(batch, heads_kv, cache_len, head_dim, dtype=dtype)
    v = torch.randn(batch, heads_kv, cache_len, head_dim, dtype=dtype)
    kv_lens = torch.full((batch,), cache_len, dtype=torch.int64)
    tree_mask = random_tree_mask(batch, num_nodes, "cpu")
    dense = tree_attention_dense_mask(tree_mask, kv_lens, cache_len)[:, None]
    nq = torch.tensor(live, dtype=torch.int64)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)  # noqa: E731
    t_sdpa, grid, _ = alternating(sdpa, lambda: taps_ops.tree_attention(q, k, v, tree_mask, kv_lens), levels, repeats)
    rows = []
    for level, t_grid in zip(levels, grid):
        grid_call = lambda: taps_ops.tree_attention(q, k, v, tree_mask, kv_lens)  # noqa: E731
        with cpu_isa(level):
            _, [t_live], [x] = alternating(grid_call, lambda: taps_ops.tree_attention(
                q, k, v, tree_mask, kv_lens, num_queries=nq), [level], repeats)
        rows.append((t_grid, t_live, x))
    return t_sdpa, rows


def cpu_tables(args, shapes, levels, peaks, peak_note, threads) -> None:
    """The CPU tables: taps at each instruction-set level against SDPA, then the ragged batches."""
    cpu_rows = []
    for (b, hq, hkv, n, d, s, dt) in shapes:
        row, kv_bytes = case(b, hq, hkv, n, d, s, dt, args.repeats, "cpu", not args.no_reference, levels)
        flops = 4 * b * hq * n * s * d
        cells = []
        for level, t, x in zip(levels, row["taps"], row["x_sdpa"]):
            floor = max(flops / (threads * peaks[level]), kv_bytes / (args.gbps * 1e9))
            cells += [fmt_time(t), f"{x:.2f}x", fmt_time(floor), f"{100 * floor / t:.0f}%"]
        cpu_rows.append([b, hq, hkv, n, d, s, str(dt)[6:], fmt_time(row["sdpa"]),
                         fmt_time(row["ref"]) if row["ref"] else "-", *cells])
    print_table(["B", "Hq", "Hkv", "N", "D", "S", "dtype", "sdpa", "ref",
                 *[h for lv in levels for h in (f"taps {lv}", "x sdpa", "floor", "% floor")]], cpu_rows,
                title=f"CPU, {threads} thread(s): taps at instruction-set level {', '.join(levels)}")
    print(f"floor = max(FLOPs at threads x the level's peak ({peak_note}), K/V bytes at {args.gbps:g} GB/s)")
    ragged = [  # B, Hq, Hkv, N, D, S, dtype, real nodes per request
        (8, 8, 4, 16, 32, 300, torch.float32, [16, 2, 3, 1, 1, 0, 0, 0]),  # the shipped target: prompt lookup at batch 8
        (8, 8, 4, 16, 32, 300, torch.bfloat16, [4, 3, 3, 3, 3, 3, 2, 2]),
        (4, 32, 8, 64, 128, 1024, torch.float32, [64, 17, 5, 30]),         # merged trees of different sizes
    ]
    if args.quick:
        ragged = ragged[:1]
    ragged_rows = []
    for (b, hq, hkv, n, d, s, dt, live) in ragged:
        t_sdpa, per_level = ragged_case(b, hq, hkv, n, d, s, dt, live, args.repeats, levels)
        cells = [c for (t_grid, t_live, x) in per_level for c in (fmt_time(t_grid), fmt_time(t_live), f"{x:.2f}x",
                                                                    f"{t_sdpa / t_live:.2f}x")]
        ragged_rows.append([b, hq, hkv, n, d, s, str(dt)[6:], f"{sum(live)}/{b * n}", fmt_time(t_sdpa), *cells])
    print()
    print_table(["B", "Hq", "Hkv", "N", "D", "S", "dtype", "real", "sdpa",
                 *[h for lv in levels for h in (f"taps {lv} grid", "num_queries", "x grid", "x sdpa")]], ragged_rows,
                title="CPU, a ragged batch of trees in one [B, N] grid: taps over every query against taps with "
                      "num_queries (the real nodes only); x grid: the median round's ratio")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="small sizes only")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--no-reference", action="store_true", help="skip the plain-PyTorch reference column")
    ap.add_argument("--ghz", type=float, default=None, help="core clock for the CPU floor, times the level's "
                    "FLOP per cycle (default: each level's multiply-add rate measured at start)")
    ap.add_argument("--gbps", type=float, default=20.0, help="memory bandwidth for the CPU floor (default 20 GB/s, "
                    "one core of the development CPU)")
    add_isa_argument(ap)
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    levels = op_levels(isa_levels(args.isa), "tree_attention")
    torch.manual_seed(0)
    shapes = [  # B, Hq, Hkv, N, D, S, dtype
        (1, 8, 4, 16, 32, 216, torch.float32),  # the shipped target: 16 tree nodes after 200 cached keys
        (1, 8, 4, 16, 32, 216, torch.bfloat16),
        (1, 8, 2, 7, 64, 257, torch.float32),
        (2, 32, 8, 16, 128, 1000, torch.float32),
        (8, 16, 16, 32, 64, 1024, torch.float32),
        (4, 32, 8, 64, 128, 2048, torch.float32),
        (4, 32, 8, 64, 128, 2048, torch.bfloat16),
        (1, 32, 8, 64, 128, 8192, torch.bfloat16),
        (1, 32, 8, 64, 128, 8192, torch.float32),
        # decoding steps: one query (G rows per KV head), the shipped target after ~200 keys and Llama-3-8B heads
        (1, 8, 4, 1, 32, 216, torch.float32),
        (1, 8, 4, 1, 32, 216, torch.bfloat16),
        (1, 32, 8, 1, 128, 4096, torch.bfloat16),
        (8, 32, 8, 1, 128, 1024, torch.bfloat16),
    ]
    gpu_shapes = [  # Llama-3-8B heads, a 64-node tree: S = 1k, 4k, 32k (and a batch of 8)
        (1, 32, 8, 64, 128, 1024, torch.bfloat16),
        (1, 32, 8, 64, 128, 4096, torch.bfloat16),
        (1, 32, 8, 64, 128, 32768, torch.bfloat16),
        (8, 32, 8, 64, 128, 4096, torch.bfloat16),
        (1, 32, 8, 64, 128, 4096, torch.float16),
        (1, 32, 8, 3, 128, 4096, torch.bfloat16),  # 12 rows per KV head: the SIMT kernel
        (1, 32, 8, 64, 128, 4096, torch.float32),
    ]
    if args.quick:
        shapes, gpu_shapes = shapes[:3], gpu_shapes[:2]
    devices = bench_devices()
    peaks, peak_note = level_peaks(levels, args.ghz)
    print(f"tree_attention | {machine_line()} | CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"median of {args.repeats} (CPU: SDPA and taps alternating; x sdpa: the median round's ratio) | {peak_note}")
    threads = torch.get_num_threads()
    if "cpu" in devices:
        cpu_tables(args, shapes, levels, peaks, peak_note, threads)
    if "cuda" not in devices:
        return
    ceiling = copy_bandwidth(args.repeats)
    print(f"\n{torch.cuda.get_device_name()}: device-to-device copy {ceiling / 1e9:.0f} GB/s")
    header = f"{'device':6} {'B':>2} {'Hq':>3} {'Hkv':>3} {'N':>4} {'D':>4} {'S':>5} {'dtype':>8} {'kernel':>6} " \
             f"{'sdpa ms':>9} {'ref ms':>9} {'taps ms':>9} {'x sdpa':>7} {'x ref':>7} {'GB/s':>7} {'% copy':>6} " \
             f"{'x flashinfer':>12}"
    print(header)
    for (b, hq, hkv, n, d, s, dt) in shapes + gpu_shapes:
        row, kv_bytes = case(b, hq, hkv, n, d, s, dt, args.repeats, "cuda", not args.no_reference)
        ref = f"{row['ref'] * 1e3:9.2f}" if row["ref"] else f"{'-':>9}"
        x_ref = f"{row['ref'] / row['taps']:7.2f}" if row["ref"] else f"{'-':>7}"
        kernel = "mma" if dt != torch.float32 and hq // hkv * n >= 16 else "simt"
        rate = kv_bytes / row["taps"]
        x_fi = f"{row['flashinfer'] / row['taps']:.2f}" if row["flashinfer"] else "-"
        print(f"{'cuda':6} {b:2} {hq:3} {hkv:3} {n:4} {d:4} {s:5} {str(dt)[6:]:>8} {kernel:>6} "
              f"{row['sdpa'] * 1e3:9.2f} {ref} {row['taps'] * 1e3:9.3f} {row['sdpa'] / row['taps']:7.2f} "
              f"{x_ref} {rate / 1e9:7.1f} {100 * rate / ceiling:6.1f} {x_fi:>12}")


if __name__ == "__main__":
    main()
