"""Where the CUDA ops' time goes: knob sweeps for tuning (needs a GPU; not a benchmark of record).

    PYTHONPATH=python python bench/probe_cuda.py [--repeats 20] [--quick]

tree_attention: per shape, torch SDPA with a dense mask, taps with validate=True (the default: a device
sync for the kv_lens check) and validate=False, then taps with the key splits forced to 1, 2, 4 ... 64
(TAPS_ATTN_SPLITS; the plan's own choice is printed). verify_tree: validate on / off, each
with the cluster size forced (TAPS_VERIFY_CLUSTER) or the op's own. Times are CUDA-event medians
(bench/common.time_call); the K/V bytes at the device-to-device copy rate are the floor.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tree_attention import random_tree_mask  # noqa: E402
from bench_verify_tree import make_case  # noqa: E402
from common import fmt_time, machine_line, print_table, time_call  # noqa: E402

import taps_ops  # noqa: E402
from taps_ops.reference import tree_attention_dense_mask  # noqa: E402

SPLITS = (1, 2, 4, 8, 16, 32, 64)
SHAPES = [  # B, Hq, Hkv, N, D, S, dtype
    (1, 8, 4, 16, 32, 216, torch.bfloat16),
    (8, 16, 16, 32, 64, 1024, torch.float32),
    (4, 32, 8, 64, 128, 2048, torch.float32),
    (4, 32, 8, 64, 128, 2048, torch.bfloat16),
    (1, 32, 8, 64, 128, 1024, torch.bfloat16),
    (8, 32, 8, 64, 128, 4096, torch.bfloat16),
    (1, 32, 8, 3, 128, 4096, torch.bfloat16),
]


def forced(name: str, value) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = str(value)


def attention(args) -> None:
    rows = []
    for (b, hq, hkv, n, d, s, dt) in SHAPES[:3] if args.quick else SHAPES:
        q = torch.randn(b, hq, n, d, dtype=dt, device="cuda")
        k = torch.randn(b, hkv, s, d, dtype=dt, device="cuda")
        v = torch.randn(b, hkv, s, d, dtype=dt, device="cuda")
        kv_lens = torch.full((b,), s, dtype=torch.int64, device="cuda")
        mask = random_tree_mask(b, n, "cuda")
        dense = tree_attention_dense_mask(mask, kv_lens, s)[:, None]
        t = lambda fn: time_call(fn, "cuda", repeats=args.repeats)  # noqa: E731
        sdpa = t(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True))
        checked = t(lambda: taps_ops.tree_attention(q, k, v, mask, kv_lens))
        cells = []
        for sp in (None, *SPLITS):
            forced("TAPS_ATTN_SPLITS", sp)
            cells.append(t(lambda: taps_ops.tree_attention(q, k, v, mask, kv_lens, validate=False)))
        forced("TAPS_ATTN_SPLITS", None)
        mma = dt != torch.float32 and hq // hkv * n >= 16
        floor = 2 * b * hkv * s * d * k.element_size() / 4.1e12
        best = min(range(len(SPLITS)), key=lambda i: cells[1 + i])
        rows.append([b, hq, hkv, n, d, s, str(dt)[6:], "mma" if mma else "simt", fmt_time(floor), fmt_time(sdpa),
                     fmt_time(checked), fmt_time(cells[0]), *[fmt_time(c) for c in cells[1:]],
                     f"{SPLITS[best]}: {sdpa / cells[1 + best]:.2f}x sdpa"])
    print_table(["B", "Hq", "Hkv", "N", "D", "S", "dtype", "kernel", "floor", "sdpa", "taps", "no validate",
                 *[f"splits {sp}" for sp in SPLITS], "best"], rows,
                title="tree_attention (floor: K/V bytes at 4.1 TB/s; 'taps' validates kv_lens: one device sync)")


def verify(args) -> None:
    rows = []
    for dt in (torch.float32, torch.bfloat16):
        for temp in (0.0, 1.0):
            logits, tokens, parents, uniforms = (x.cuda() for x in make_case(8, 64, 128256, 0.7, dt, "cpu"))
            cells = []
            for validate in (True, False):
                for cluster in (None, 1, 2, 4, 8):
                    forced("TAPS_VERIFY_CLUSTER", cluster)
                    cells.append(time_call(lambda: taps_ops.verify_tree(
                        logits, tokens, parents, temperature=temp, uniforms=uniforms, validate=validate),
                        "cuda", repeats=args.repeats))
            forced("TAPS_VERIFY_CLUSTER", None)
            rows.append([str(dt)[6:], temp, *[fmt_time(c) for c in cells]])
    print_table(["dtype", "T", *[f"{'val' if v else 'noval'} c{c or 'auto'}" for v in (1, 0)
                                 for c in (None, 1, 2, 4, 8)]], rows,
                title="verify_tree B=8 N=64 V=128256 (validate on / off x cluster size)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one", type=int, default=None, metavar="I",
                    help="only call tree_attention on shape I (validate=False) 8 times, for a profiler: "
                         "ncu --launch-skip 4 --launch-count 1 -k regex:tree_attention python bench/probe_cuda.py --one I")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and taps_ops.has_cuda_kernels()):
        raise SystemExit("probe_cuda.py needs a GPU and taps_ops built with its CUDA kernels")
    if args.one is not None:
        b, hq, hkv, n, d, s, dt = SHAPES[args.one]
        q = torch.randn(b, hq, n, d, dtype=dt, device="cuda")
        k, v = (torch.randn(b, hkv, s, d, dtype=dt, device="cuda") for _ in range(2))
        mask, kv_lens = random_tree_mask(b, n, "cuda"), torch.full((b,), s, dtype=torch.int64, device="cuda")
        for _ in range(8):
            taps_ops.tree_attention(q, k, v, mask, kv_lens, validate=False)
        torch.cuda.synchronize()
        print("shape", SHAPES[args.one])
        return
    print(machine_line())
    attention(args)
    verify(args)


if __name__ == "__main__":
    main()
