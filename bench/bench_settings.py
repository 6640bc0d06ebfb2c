"""Tree settings against speed: tokens/s of taps over a grid of (depth, top_k, budget), as a ratio to
Hugging Face ``generate`` measured between the grid points (the shipped models, batch 1).

    PYTHONPATH=python python bench/bench_settings.py --threads 1 --dtype bf16 --rows merged-budget chat
    PYTHONPATH=python python bench/bench_settings.py --temperature 1 --depth 2 3 --top-k 2 3 4 --budget 6 10 16

Acceptance grows with the tree, but on a CPU every node costs target compute and every level a drafter
forward, so the fastest settings are smaller than the most accepting ones; this table is how
``SpeculativeDecoder``'s per-device defaults (``taps.decoder.DEFAULT_SETTINGS``) were chosen. Each grid
point runs the prompts once; HF ``generate`` runs again every ``--hf-every`` points and each point is
compared with the nearest HF run, so slow drifts of a shared machine cancel.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import ROW_SPECS, HFRunner, TapsRunner  # noqa: E402
from common import print_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                    help="auto: bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16, AMX), else fp32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--family", default="hass")
    ap.add_argument("--rows", nargs="+", default=["merged-budget", "chat"], choices=sorted(ROW_SPECS))
    ap.add_argument("--depth", type=int, nargs="+", default=[3, 4, 5])
    ap.add_argument("--top-k", type=int, nargs="+", default=[3, 4, 6])
    ap.add_argument("--budget", type=int, nargs="+", default=[12, 16, 24])
    ap.add_argument("--draft-vocab", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=3, help="per benchmark (GSM8K, MT-Bench)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--hf-every", type=int, default=4)
    ap.add_argument("--clock", default="process", choices=("wall", "process"))
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of both sides (0: greedy)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from taps import PromptLookupDrafter, SpeculativeDecoder, models
    from taps.data import load_eval_prompts

    dtype = models.resolve_dtype(args.dtype)
    target, tok = models.load_target(dtype=dtype)
    import copy
    hf = HFRunner(copy.deepcopy(target), tok.eos_id)
    drafters = {d: models.load_drafter(args.family, d, target, draft_vocab=args.draft_vocab) for d in ("math", "chat")}
    prompts = [tok.encode_chat(ex.messages, add_generation_prompt=True)
               for bench in ("gsm8k", "mt_bench") for ex in load_eval_prompts(bench)[:args.prompts]]
    clock = time.process_time if args.clock == "process" else time.perf_counter

    def timed(runner):
        t0 = clock()
        outs, stats = runner(prompts, args.new_tokens, args.temperature, 0)
        return clock() - t0, outs, stats

    hf(prompts[:1], 4, 0.0, 0)
    hf_speed, _ = None, None
    rows = []
    points = [p for p in itertools.product(args.rows, args.depth, args.top_k, args.budget)
              if p[3] <= p[2] + (p[1] - 1) * p[2] * p[2] + 1]
    for i, (row, depth, k, budget) in enumerate(points):
        if i % args.hf_every == 0:
            sec, outs, _ = timed(hf)
            hf_speed = sum(len(o) for o in outs) / sec
        strategy, names = ROW_SPECS[row]
        ds = [PromptLookupDrafter() if n == "lookup" else drafters[n] for n in names]
        dec = SpeculativeDecoder(target, ds, strategy=strategy, depth=depth, top_k=k, budget=budget)
        runner = TapsRunner(dec, tok.eos_id)
        runner(prompts[:1], 4, 0.0, 0)
        sec, outs, stats = timed(runner)
        speed = sum(len(o) for o in outs) / sec
        tau = sum(s.stats[0].tau for s in stats) / len(stats)
        rows.append([row, depth, k, budget, f"{tau:.2f}", f"{speed:.0f}", f"{hf_speed:.0f}", f"{speed / hf_speed:.2f}x"])
        print("  ".join(str(c) for c in rows[-1]), flush=True)
    rows.sort(key=lambda r: (r[0], -float(r[-1][:-1])))
    print_table(["row", "depth", "top_k", "budget", "tau", "tokens/s", "HF tokens/s", "vs HF"], rows,
                title=f"Tree settings vs speed ({str(dtype).replace('torch.', '')}, T={args.temperature:g}, {args.threads} thread(s), draft vocabulary "
                      f"{args.draft_vocab or 'full'}, {len(prompts)} prompts, {args.new_tokens} new tokens, "
                      f"{args.clock} time; fastest first per row)")


if __name__ == "__main__":
    main()
