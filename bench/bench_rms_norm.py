"""Microbenchmark of taps_ops.rms_norm against the composite form the lean forwards used before it.

    PYTHONPATH=python python bench/bench_rms_norm.py [--repeats 2000] [--isa LEVELS]

Rows: decoding-sized inputs (rows x H: a drafter level of 8 nodes, a 32-node tree, a 64-token prefill
chunk), float32 and bfloat16. Columns: Hugging Face's form in torch (``F.rms_norm`` for float32;
``F.rms_norm(x.float()).to(dtype) * w`` for bfloat16, what taps.lean.Norm ran), taps_ops.rms_norm, the
ratio, and the floor: the bytes the op must move (read x and the weight, write y) at the machine's
memory bandwidth (``--gbps``, default 20 GB/s for one core of the development CPU). The small calls
are bound by the dispatch (a few us), far above that floor; the large ones re-read data that sits in the
cache, so they can beat a DRAM floor. Mean over
``repeats`` calls after a warm-up; on CUDA (when present) synchronised around the loop. On the CPU the op
runs once per instruction-set level (``--isa``, see bench/common.py; the levels at which it runs the same
code are one column), next to the torch form measured once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_devices, add_isa_argument, isa_levels, isa_note, machine_line, op_levels, per_isa  # noqa: E402

import taps_ops  # noqa: E402


def per_call(fn, repeats: int, cuda: bool) -> float:
    for _ in range(20):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def composite(x, w, eps):
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * w


def start(description: str, op: str | None, columns: str, ref: str = "torch", taps: str = "taps"):
    """The arguments of the per-call op benchmarks (this one, bench_rope.py, bench_expand_level.py,
    bench_decoder_layer.py), torch set up for them (threads, no autograd), and the devices to run on; prints
    the header line. `columns` is the header of the case columns, `ref` and `taps` name the two timed
    forms; args.levels holds the CPU instruction-set levels to run `op` at (every level asked for when op is
    None)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gbps", type=float, default=20.0, help="memory bandwidth for the floor column")
    add_isa_argument(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    levels = isa_levels(args.isa)
    args.levels = op_levels(levels, op) if op else levels
    args.columns, args.names, args.header_for = columns, (ref, taps), None
    devices = bench_devices()
    print(f"{machine_line()} | threads {torch.get_num_threads()}, mean of {args.repeats} calls")
    if op:
        print(isa_note(op, args.levels))
    return args, devices


def compare(args, device: str, label: str, torch_fn, taps_fn, moved_bytes: int) -> None:
    """One table line: ``label``, then the torch form's time per call, the op's and the ratio (on the CPU
    at each of args.levels) and the floor (``moved_bytes`` at ``--gbps`` on the CPU, 4 TB/s on CUDA).
    Prints the header first when the device changes."""
    cuda = device == "cuda"
    ref, taps = args.names
    cols = [taps] if cuda else [f"{taps} {lv}" for lv in args.levels]
    widths = [max(8, len(c) + 3) for c in cols]
    if args.header_for != device:
        args.header_for = device
        print(f"{'device':6} {args.columns} {ref + ' us':>9} "
              + " ".join(f"{c + ' us':>{w}} {'x ' + ref:>8}" for c, w in zip(cols, widths)) + f" {'floor us':>9}")
    gbps = 4000.0 if cuda else args.gbps
    t_torch = per_call(torch_fn, args.repeats, cuda)
    measure = lambda: per_call(taps_fn, args.repeats, cuda)  # noqa: E731
    times = [measure()] if cuda else per_isa(args.levels, measure)
    print(f"{device:6} {label} {t_torch * 1e6:9.2f} "
          + " ".join(f"{t * 1e6:{w}.2f} {t_torch / t:8.2f}" for t, w in zip(times, widths))
          + f" {moved_bytes / (gbps * 1e9) * 1e6:9.3f}")


def main() -> None:
    args, devices = start(__doc__, "rms_norm", f"{'rows':>5} {'H':>5} {'dtype':>8}")
    for device in devices:
        for rows, width in ((8, 64), (32, 64), (8, 1024), (32, 4096), (64, 4096)):
            for dt in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, width, device=device).to(dt)
                w = torch.randn(width, device=device).to(dt)
                compare(args, device, f"{rows:5} {width:5} {str(dt)[6:]:>8}", lambda: composite(x, w, 1e-6),
                        lambda: taps_ops.rms_norm(x, w, 1e-6), (2 * rows * width + width) * x.element_size())


if __name__ == "__main__":
    main()
