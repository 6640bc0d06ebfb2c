"""A small n-gram table of the shipped target's T = 1 distributions, built from GSM8K *test* problems the
benchmarks never use (from --skip on; bench_e2e.py uses the first few), for a quick check of the table drafter
on a machine without the shared training data (bench/gpu_check.sh's "table" step). A real table comes from
``taps train table`` (training prompts, thousands of them).

    PYTHONPATH=python python bench/table_from_test_prompts.py --out /tmp/t1.npz [--device cuda] [--prompts 400]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the table file to write (.npz)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--skip", type=int, default=100, help="GSM8K test problems left out at the start")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from taps import models
    from taps.data import load_eval_prompts
    from taps.train.table import build_table

    target, tok = models.load_target()
    target.to(args.device)
    problems = load_eval_prompts("gsm8k")[args.skip:args.skip + args.prompts]
    prompts = [tok.encode_chat(ex.messages, add_generation_prompt=True) for ex in problems]
    started = time.time()
    table = build_table(target, prompts, new_tokens=args.new_tokens, batch=args.batch, temperature=1.0, seed=1,
                        meta={"source": f"gsm8k test problems {args.skip}..{args.skip + len(prompts) - 1}"})
    table.save(args.out)
    print(f"table: {len(prompts)} prompts, {table.num_contexts} contexts, {time.time() - started:.1f} s on "
          f"{args.device} -> {args.out}")


if __name__ == "__main__":
    main()
