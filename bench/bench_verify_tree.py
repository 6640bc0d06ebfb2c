"""verify_tree microbenchmark: plain PyTorch vs reference.py vs taps_ops (CPU, CUDA when present).

    python bench/bench_verify_tree.py [--batch 8] [--nodes 64] [--vocab 128256] [--accept 0.7] [--quick] [--isa LEVELS]

"plain torch" is what a user writes without taps_ops: argmax (greedy) or softmax (sampling) over every
node's row, then the walk in Python. taps_ops reads only the rows it visits (the accepted path plus
one). The floor is the time to read those visited rows at the device's measured read bandwidth
(a max-reduction over 512 MB). On the CPU taps runs once per instruction-set level (``--isa``, see
bench/common.py), next to plain torch and the reference measured once.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (bench_devices, add_isa_argument, fmt_time, isa_levels, isa_note, machine_line, op_levels,  # noqa: E402
                    per_isa, print_table, time_call)

import taps_ops  # noqa: E402
from taps_ops import reference  # noqa: E402


def make_case(batch, nodes, vocab, accept, dtype, device, seed=0):
    """A random tree per request and logits that accept each node's first child w.p. ~`accept`."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, nodes), -1, dtype=torch.int64)
    for i in range(1, nodes):
        # shallow-biased random parents, like an EAGLE-2 tree (many children near the root)
        parents[:, i] = (torch.rand(batch, generator=g) ** 2 * i).long()
    tokens = torch.randint(0, vocab, (batch, nodes), generator=g)
    logits = torch.randn(batch, nodes, vocab, generator=g) * 2.0
    first_child = torch.full((batch, nodes), -1, dtype=torch.int64)
    for i in range(nodes - 1, 0, -1):
        first_child[torch.arange(batch), parents[:, i]] = i
    boost = (torch.rand(batch, nodes, generator=g) < accept) & (first_child >= 0)
    b_idx, n_idx = boost.nonzero(as_tuple=True)
    logits[b_idx, n_idx, tokens[b_idx, first_child[b_idx, n_idx]]] += 16.0
    uniforms = torch.rand(batch, nodes, generator=g)
    return (logits.to(device=device, dtype=dtype), tokens.to(device), parents.to(device), uniforms.to(device))


def plain_torch_verify(logits, tokens, parents, temperature, generator=None):
    """Verification as written with plain PyTorch: full-row argmax/softmax for every node, then a walk."""
    batch, nodes, _ = logits.shape
    if temperature == 0:
        target = logits.argmax(-1)  # [B, N]: every row read
    else:
        probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, N, V] materialised
    tokens_l, parents_l = tokens.tolist(), parents.tolist()
    out_tokens = torch.full((batch, nodes), -1, dtype=torch.int64)
    num_accepted = torch.zeros(batch, dtype=torch.int64)
    target_l = target.tolist() if temperature == 0 else None
    for b in range(batch):
        children = [[] for _ in range(nodes)]
        for i in range(1, nodes):
            if parents_l[b][i] >= 0:
                children[parents_l[b][i]].append(i)
        cur, emitted = 0, []
        while True:
            if temperature == 0:
                y = target_l[b][cur]
            else:
                y = int(torch.multinomial(probs[b, cur], 1, generator=generator))
            nxt = next((c for c in children[cur] if tokens_l[b][c] == y), None)
            emitted.append(y)
            if nxt is None:
                break
            cur = nxt
        out_tokens[b, : len(emitted)] = torch.tensor(emitted)
        num_accepted[b] = len(emitted) - 1
    return out_tokens, num_accepted


def read_bandwidth(device) -> float:
    """Bytes per second read by a max-reduction over 512 MB (the read rate the floor assumes)."""
    n = 128 * 1024 * 1024  # 512 MB of float32
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    t = time_call(lambda: torch.amax(src), device, warmup=2, repeats=10)
    return src.numel() * 4 / t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--accept", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke run)")
    ap.add_argument("--no-reference", action="store_true")
    add_isa_argument(ap)
    args = ap.parse_args()
    levels = op_levels(isa_levels(args.isa), "verify_tree")
    if args.quick:
        args.batch, args.nodes, args.vocab, args.repeats = 4, 16, 5003, 3
    print(f"verify_tree: B={args.batch} N={args.nodes} V={args.vocab} | {machine_line()}")
    devices = bench_devices()
    bandwidth = {d: read_bandwidth(d) for d in devices}
    for d in devices:
        print(f"read bandwidth {d}: {bandwidth[d] / 1e9:.1f} GB/s (torch.amax over 512 MB)")

    rows = {d: [] for d in devices}
    for dtype in (torch.float32, torch.bfloat16):
        for temperature in (0.0, 1.0):
            logits, tokens, parents, uniforms = make_case(args.batch, args.nodes, args.vocab, args.accept, dtype, "cpu")
            out = taps_ops.verify_tree(logits, tokens, parents, temperature=temperature, uniforms=uniforms)
            visited_rows = int((out.num_accepted + 1).sum())
            floor_bytes = visited_rows * args.vocab * logits.element_size()
            t_ref = float("nan")
            if not args.no_reference:
                t_ref = time_call(lambda: reference.verify_tree_ref(
                    logits, tokens, parents, temperature=temperature, top_k=0, top_p=1.0, draft_probs=None,
                    uniforms=uniforms), "cpu", warmup=1, repeats=max(1, args.repeats // 3))
            case = f"{str(dtype).replace('torch.', '')} T={temperature:g}"
            mean_acc = f"{out.num_accepted.float().mean():.2f}"
            for d in devices:
                lg, tk, pr, un = (x.to(d) for x in (logits, tokens, parents, uniforms))
                t_plain = time_call(lambda: plain_torch_verify(lg, tk, pr, temperature), d, repeats=args.repeats)
                taps = lambda: time_call(lambda: taps_ops.verify_tree(lg, tk, pr, temperature=temperature,  # noqa: E731
                                                                      uniforms=un), d,
                                         repeats=args.repeats * (10 if d == "cuda" else 1), flush=(d == "cuda"))
                times = per_isa(levels, taps) if d == "cpu" else [taps()]
                floor = floor_bytes / bandwidth[d]
                cells = [c for t in times for c in (fmt_time(t), f"{t_plain / t:.1f}x", f"{100 * floor / t:.0f}%")]
                rows[d].append([case, mean_acc, fmt_time(t_plain), fmt_time(t_ref), fmt_time(floor), *cells])
    for d in devices:
        cols = [f"taps {lv}" for lv in levels] if d == "cpu" else ["taps_ops"]
        print_table(["case", "accepted", "plain torch", "reference.py (cpu)", "floor",
                     *[h for c in cols for h in (c, "vs plain", "of floor")]], rows[d], title=f"{d}:")
    print(isa_note("verify_tree", levels))
    print("floor = visited rows x V x dtype bytes at the device's read bandwidth; 'of floor' = floor / time.")

if __name__ == "__main__":
    main()
