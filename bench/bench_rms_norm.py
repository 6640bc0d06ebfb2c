"""Microbenchmark of taps_ops.rms_norm against the composite form the lean forwards used before it.

    PYTHONPATH=python python bench/bench_rms_norm.py [--repeats 2000]

Rows: decoding-sized inputs (rows x H: a drafter level of 8 nodes, a 32-node tree, a 64-token prefill
chunk), float32 and bfloat16. Columns: Hugging Face's form in torch (``F.rms_norm`` for float32;
``F.rms_norm(x.float()).to(dtype) * w`` for bfloat16, what taps.lean.Norm ran), taps_ops.rms_norm, the
ratio, and the floor: the bytes the op must move (read x and the weight, write y) at the machine's
memory bandwidth (``--gbps``, default 20 GB/s for one core of the development CPU). The small calls
are bound by the dispatch (a few us), far above that floor; the large ones re-read data that sits in the
cache, so they can beat a DRAM floor. Mean over
``repeats`` calls after a warm-up; on CUDA (when present) synchronised around the loop.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import taps_ops


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


def start(description: str):
    """The arguments of the elementwise-op benchmarks (this one and bench_rope.py), torch set up for them
    (threads, no autograd), and the devices to run on; prints the header line."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gbps", type=float, default=20.0, help="memory bandwidth for the floor column")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and taps_ops.has_cuda_kernels() else [])
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, mean of {args.repeats} calls")
    return args, devices


def compare(args, device: str, label: str, torch_fn, taps_fn, moved_bytes: int) -> None:
    """One table line: ``label``, then the torch form's and the op's time per call, their ratio and the
    floor (``moved_bytes`` at ``--gbps`` on the CPU, 4 TB/s on CUDA)."""
    cuda = device == "cuda"
    gbps = 4000.0 if cuda else args.gbps
    t_torch = per_call(torch_fn, args.repeats, cuda)
    t_taps = per_call(taps_fn, args.repeats, cuda)
    print(f"{device:6} {label} {t_torch * 1e6:9.2f} {t_taps * 1e6:8.2f} {t_torch / t_taps:8.2f} "
          f"{moved_bytes / (gbps * 1e9) * 1e6:9.3f}")


def main() -> None:
    args, devices = start(__doc__)
    print(f"{'device':6} {'rows':>5} {'H':>5} {'dtype':>8} {'torch us':>9} {'taps us':>8} {'x torch':>8} "
          f"{'floor us':>9}")
    for device in devices:
        for rows, width in ((8, 64), (32, 64), (8, 1024), (32, 4096), (64, 4096)):
            for dt in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, width, device=device).to(dt)
                w = torch.randn(width, device=device).to(dt)
                compare(args, device, f"{rows:5} {width:5} {str(dt)[6:]:>8}", lambda: composite(x, w, 1e-6),
                        lambda: taps_ops.rms_norm(x, w, 1e-6), (2 * rows * width + width) * x.element_size())


if __name__ == "__main__":
    main()
