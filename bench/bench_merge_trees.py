"""merge_trees microbenchmark: a plain-Python trie union (what a user writes) vs reference.py vs taps_ops.

    python bench/bench_merge_trees.py [--quick] [--isa LEVELS]

taps_ops.merge_trees has no vector code (taps_ops.cpu_info()["ops"]), so ``--isa`` (see bench/common.py) gives
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


def plain_trie_union(tokens, parents, scores):
    """Dictionary trie over token paths, per request; returns merged node lists (no budget cut)."""
    out = []
    tok, par, sc = tokens.tolist(), parents.tolist(), scores.tolist()
    for b in range(len(tok)):
        ids, merged = {(): 0}, [(-1, tok[b][0][0], 0.0, 0)]
        for t in range(len(tok[b])):
            key_of = {0: ()}
            for i in range(1, len(tok[b][t])):
                if tok[b][t][i] < 0:
                    break
                key = key_of[par[b][t][i]] + (tok[b][t][i],)
                key_of[i] = key
                if key not in ids:
                    ids[key] = len(merged)
                    merged.append((ids[key[:-1]], key[-1], sc[b][t][i], 1 << t))
                else:
                    p, tk, s, src = merged[ids[key]]
                    merged[ids[key]] = (p, tk, max(s, sc[b][t][i]), src | (1 << t))
        out.append(merged)
    return out


def drafter_trees(batch, num_trees, nodes, vocab, overlap=0.5):
    """T trees per request that share ~`overlap` of their tokens (drafters often agree near the root)."""
    trees = []
    base_s, base_t, base_p = eagle_candidates(batch, 6, 10, vocab, seed=0)
    for t in range(num_trees):
        s, tok, p = eagle_candidates(batch, 6, 10, vocab, seed=t + 1)
        same = torch.rand(tok.shape, generator=torch.Generator().manual_seed(100 + t)) < overlap
        tok = torch.where(same, base_t, tok)
        tree = taps_ops.build_tree(base_s if t == 0 else s, tok, base_p, nodes, root_tokens=torch.zeros(batch, dtype=torch.int64))
        trees.append(tree)
    stack = lambda f: torch.stack([getattr(tr, f) for tr in trees], 1)  # noqa: E731
    return stack("tokens"), stack("parents"), stack("scores")


def main():
    args, devices = tree_bench_setup("merge_trees")
    levels = op_levels(args.isa, "merge_trees")
    configs = [(1, 2, 64), (8, 3, 64), (64, 3, 64), (64, 4, 128)]
    if args.quick:
        configs = configs[:2]
    rows = []
    for batch, num_trees, nodes in configs:
        tokens, parents, scores = drafter_trees(batch, num_trees, nodes, 128256)
        budget = nodes  # equal node budget: the union cut to one drafter's size
        t_plain = time_call(lambda: plain_trie_union(tokens, parents, scores), warmup=1, repeats=3)
        t_ref = float("nan") if args.no_reference else time_call(
            lambda: reference.merge_trees_ref(tokens, parents, scores, budget), warmup=1, repeats=3)
        merged = taps_ops.merge_trees(tokens, parents, scores)
        union = int((merged.tokens >= 0).sum(1).float().mean())
        for d in devices:
            tk, pr, sc = tokens.to(d), parents.to(d), scores.to(d)
            taps = lambda: time_call(lambda: taps_ops.merge_trees(tk, pr, sc, budget), d, repeats=50)  # noqa: E731
            times = per_isa(levels, taps) if d == "cpu" else [taps()] + [float("nan")] * (len(levels) - 1)
            rows.append([batch, num_trees, nodes, union, d, fmt_time(t_plain), fmt_time(t_ref),
                         *isa_cells(t_plain, times)])
    print_table(["B", "T", "N", "union nodes", "device", "plain python trie (cpu)", "reference.py (cpu)",
                 *isa_headers(levels, "plain")], rows)
    print(isa_note("merge_trees", levels))


if __name__ == "__main__":
    main()
