"""build_tree microbenchmark: plain PyTorch (EAGLE-2 style top-k + mask loop) vs reference.py vs taps_ops.

    python bench/bench_build_tree.py [--quick] [--isa LEVELS]

taps_ops.build_tree has no vector code (taps_ops.cpu_info()["ops"]), so ``--isa`` (see bench/common.py) gives
one taps column whatever levels it names.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (fmt_time, isa_cells, isa_headers, isa_note, op_levels, per_isa,  # noqa: E402
                    print_table, time_call, tree_bench_setup)
from tree_cases import eagle_candidates  # noqa: E402

import taps_ops  # noqa: E402
from taps_ops import reference  # noqa: E402


def plain_build_tree(scores, tokens, parents, num_nodes):
    """What an EAGLE-2 style loop does with plain PyTorch: top-k by score, candidates in index order,
    parents remapped with a scatter, the ancestor mask built node by node (dense [B, K+1, K+1] bool)."""
    batch, _ = scores.shape
    k = num_nodes - 1
    idx = torch.topk(scores, k, dim=-1).indices.sort(-1).values
    pos = torch.full_like(scores, -1, dtype=torch.int64)
    pos.scatter_(1, idx, torch.arange(1, k + 1, device=scores.device).expand(batch, -1))
    par_c = parents.gather(1, idx)
    node_parent = torch.where(par_c < 0, torch.zeros_like(par_c), pos.gather(1, par_c.clamp(min=0)))
    mask = torch.eye(k + 1, dtype=torch.bool, device=scores.device).repeat(batch, 1, 1)
    rows = torch.arange(batch, device=scores.device)
    for i in range(1, k + 1):
        mask[:, i] |= mask[rows, node_parent[:, i - 1]]
    return tokens.gather(1, idx), node_parent, mask


def main():
    args, devices = tree_bench_setup("build_tree")
    levels = op_levels(args.isa, "build_tree")
    configs = [(1, 6, 10, 64), (8, 6, 10, 64), (64, 6, 10, 64), (64, 8, 10, 128)]
    if args.quick:
        configs = configs[:2]
    rows = []
    for batch, depth, top_k, num_nodes in configs:
        scores, tokens, parents = eagle_candidates(batch, depth, top_k, 128256)
        t_ref = float("nan") if args.no_reference else time_call(
            lambda: reference.build_tree_ref(scores, tokens, parents, num_nodes), warmup=1, repeats=3)
        for d in devices:
            s, t, p = scores.to(d), tokens.to(d), parents.to(d)
            t_plain = time_call(lambda: plain_build_tree(s, t, p, num_nodes), d)
            taps = lambda: time_call(lambda: taps_ops.build_tree(s, t, p, num_nodes), d, repeats=50)  # noqa: E731
            times = per_isa(levels, taps) if d == "cpu" else [taps()] + [float("nan")] * (len(levels) - 1)
            rows.append([batch, scores.shape[1], num_nodes, d, fmt_time(t_plain), fmt_time(t_ref),
                         *isa_cells(t_plain, times)])
    print_table(["B", "M", "nodes", "device", "plain torch", "reference.py (cpu)", *isa_headers(levels, "plain")],
                rows)
    print(isa_note("build_tree", levels))


if __name__ == "__main__":
    main()
