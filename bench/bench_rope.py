"""Microbenchmark of taps_ops.rope_ against the torch expression the lean forwards used before it.

    PYTHONPATH=python python bench/bench_rope.py [--repeats 2000] [--isa LEVELS]

Rows: the q and k heads of a fused qkv projection's output at decoding sizes (rows x tokens, heads,
head dim; fp32 and bf16). Columns: torch's ``qk * cos + qk.roll(D // 2, -1) * sin`` (with the split of
q and k out of qkv, as taps.lean ran it), taps_ops.rope_ in place on the qkv view, the ratio, and the
floor: the bytes the op must move (read and write q and k, read the tables) at ``--gbps`` (default 20 GB/s
for one core of the development CPU). Mean over ``repeats`` calls after a warm-up; on CUDA (when present)
synchronised around the loop. On the CPU the op runs once per instruction-set level (``--isa``, see
bench/common.py), next to the torch expression measured once.
"""

from __future__ import annotations

import torch

import taps_ops
from bench_rms_norm import compare, start  # noqa: E402  (bench/ is on the path when run as a script)


def rotation_tables(rows: int, tokens: int, dim: int, device, dtype):
    """cos and sin tables [rows, tokens, 1, dim] of random angles, sin with rotate_half's sign on its first
    half (as taps.lean.RopeTable holds them): each call is a rotation, so the benchmark's thousands of
    in-place calls on one tensor keep its values normal (random tables would grow them to inf / NaN and
    shrink others to subnormals, whose arithmetic is many times slower)."""
    angle = torch.rand(rows, tokens, 1, dim // 2, device=device) * 6.2832
    cos, sin = angle.cos(), angle.sin()
    return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)


def main() -> None:
    args, devices = start(__doc__, "rope_", f"{'R x T':>7} {'Hq+Hkv':>6} {'D':>4} {'dtype':>8}")
    for device in devices:
        for rows, tokens, heads, kv, dim in ((1, 8, 4, 2, 16), (1, 32, 4, 2, 16), (1, 32, 32, 8, 128),
                                             (4, 64, 32, 8, 128)):
            for dt in (torch.float32, torch.bfloat16):
                qkv = torch.randn(rows, tokens, heads + 2 * kv, dim, device=device).to(dt)
                cos, sin = rotation_tables(rows, tokens, dim, device, dt)

                def composite():
                    qk, _ = qkv.split([heads + kv, kv], dim=2)
                    return qk * cos + qk.roll(dim // 2, -1) * sin

                compare(args, device, f"{f'{rows}x{tokens}':>7} {heads + kv:6} {dim:4} {str(dt)[6:]:>8}", composite,
                        lambda: taps_ops.rope_(qkv[:, :, :heads + kv], cos, sin),
                        (2 * (heads + kv) + 2) * rows * tokens * dim * qkv.element_size())


if __name__ == "__main__":
    main()
