"""End-to-end benchmark of the TAPS decoding engine (taps.SpeculativeDecoder) on small random models.

    PYTHONPATH=python python bench/bench_engine.py [--quick] [--device cpu|cuda] [--batch 1 4]

Models (random weights, so that acceptance is meaningful without training):
- target: a Llama of `--layers` layers whose layers after the first are weak residual refinements
  (their output projections scaled by `--refine`), so that early-exit drafters agree with it often;
- drafter A: the target's first layer with its embeddings, norm and head (an "early exit" ModelDrafter);
- drafter B: the same with Gaussian noise on its layer weights (a weaker, different specialist);
- EAGLE: a random EagleDrafter head (profile table only; untrained, so it is rarely accepted).

Tables:
1. tokens/s and tau (emitted tokens per target forward) per strategy against the autoregressive baseline
   (the same loop with a root-only tree), greedy, per batch size;
2. where a decode step's time goes at batch 1: drafting (model forwards vs the expansion around them),
   tree building/merging, target forward, verify_tree, KV compaction, drafter cache updates, Python glue;
   "outside forwards" is everything but the drafter and target forwards (goal: <= 25% at batch 1).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table  # noqa: E402

from taps import EagleDrafter, ModelDrafter, SpeculativeDecoder  # noqa: E402
from taps.synthetic import early_exit, perturbed, refined_llama  # noqa: E402


def build_models(args, device):
    target = refined_llama(args.vocab, args.hidden, args.layers, heads=args.heads, kv_heads=max(1, args.heads // 4),
                           head_scale=args.head_scale, refine=args.refine, seed=0, max_positions=4096)
    a = early_exit(target)
    b = perturbed(a, noise=args.noise, seed=1)
    eagle_cfg = copy.deepcopy(a.config)
    torch.manual_seed(2)
    eagle = EagleDrafter(eagle_cfg)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    return [m.to(device=device, dtype=dtype) for m in (target, a, b)] + [eagle]


STRATS = [
    ("autoregressive", []), ("single", ["A"]), ("single", ["B"]), ("average", ["A", "B"]),
    ("route-confidence", ["A", "B"]), ("route-entropy", ["A", "B"]), ("route-confidence-prompt", ["A", "B"]),
    ("merged", ["A", "B"]), ("merged-budget", ["A", "B"]), ("adaptive", ["A", "B"]),
]


def prompts_for(batch, vocab, length, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length + 3 * i,), generator=g).tolist() for i in range(batch)]


def run(dec, prompts, new_tokens, profile=False):
    t0 = time.perf_counter()
    out = dec.generate(prompts, max_new_tokens=new_tokens, profile=profile)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--head-scale", type=float, default=4.0)
    ap.add_argument("--refine", type=float, default=0.15)
    ap.add_argument("--noise", type=float, default=0.15)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.vocab, args.new_tokens, args.repeats = 256, 4, 4096, 32, 1
        args.batch = args.batch[:1]
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, a, b, eagle = build_models(args, device)
    drafters = {"A": a, "B": b}
    print(f"device {device} ({torch.get_num_threads()} threads), target {args.layers}x{args.hidden} vocab {args.vocab}, "
          f"drafters 1x{args.hidden}; depth {args.depth}, top_k {args.top_k}, budget {args.budget}, "
          f"{args.new_tokens} new tokens, greedy")

    for batch in args.batch:
        prompts = prompts_for(batch, args.vocab, args.prompt_len, seed=batch)
        rows, base = [], None
        for name, ds in STRATS:
            dec = SpeculativeDecoder(target, [ModelDrafter(drafters[d]) for d in ds], strategy=name,
                                     depth=args.depth, top_k=args.top_k, budget=args.budget)
            run(dec, prompts, 4)  # warm-up
            best, out = float("inf"), None
            for _ in range(args.repeats):
                out, sec = run(dec, prompts, args.new_tokens)
                best = min(best, sec)
            toks = sum(len(t) for t in out.tokens)
            tps = toks / best
            if base is None:
                base = tps
            share = "/".join(f"{s:.2f}" for s in out.summary["drafter_share"]) or "-"
            rows.append([name, "+".join(ds) or "-", f"{out.summary['tau']:.2f}", f"{tps:.1f}", f"{tps / base:.2f}x",
                         dec.strategy.num_nodes, share])
        print_table(["strategy", "drafters", "tau", "tokens/s", "vs AR", "nodes", "accepted share"], rows,
                    title=f"Throughput, batch {batch}")

    # Where a step's time goes, batch 1
    prompts = prompts_for(1, args.vocab, args.prompt_len, seed=7)
    cases = [("autoregressive", []), ("single", [ModelDrafter(a)]), ("single", [eagle]),
             ("merged", [ModelDrafter(a), ModelDrafter(b)]), ("merged-budget", [ModelDrafter(a), ModelDrafter(b)])]
    phases = ["draft_forward", "draft", "tree", "target_forward", "verify", "compact", "draft_update", "step"]
    rows = []
    for name, ds in cases:
        dec = SpeculativeDecoder(target, ds, strategy=name, depth=args.depth, top_k=args.top_k, budget=args.budget)
        run(dec, prompts, 4, profile=True)
        out, _ = run(dec, prompts, args.new_tokens, profile=True)
        p = out.profile
        total = sum(p.get(k, 0.0) for k in phases)
        forwards = p.get("draft_forward", 0) + p.get("target_forward", 0) + p.get("draft_update", 0)
        label = name + ("" if not ds else f" ({'eagle' if isinstance(ds[0], EagleDrafter) else 'A' + ('+B' if len(ds) > 1 else '')})")
        rows.append([label, f"{out.summary['tau']:.2f}", f"{total * 1e3:.2f}"]
                    + [f"{100 * p.get(k, 0.0) / total:.0f}%" for k in phases]
                    + [f"{100 * (1 - forwards / total):.0f}%"])
    print_table(["case", "tau", "ms/step", "draft fwd", "expand", "tree", "target fwd", "verify", "compact",
                 "draft update", "glue", "outside fwd"], rows,
                title="Time per decode step, batch 1 (draft fwd / draft update = drafter forwards; expand = the "
                      "expansion's topk/masks; glue = the loop's Python and bookkeeping)")


if __name__ == "__main__":
    main()
