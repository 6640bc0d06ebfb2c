"""End to end, taps' panel products (taps_ops.panel_linear) against the BLAS layouts alone, in one process.

    PYTHONPATH=python python bench/bench_panels_e2e.py [--rows ar,chat,mb,lookup,lookup_auto,mbl_auto]
                                                        [--rounds 3] [--prompts 3] [--compare panels|dtype]

Two copies of the shipped target (fp32), one packed with panels among the layouts ``taps.lean`` times at
load ("P") and one without (``taps.lean.PANELS = False``, as ``TAPS_PANELS=0``: "N"); every row is built on
both, the shipped hass drafters (draft vocabulary 1024) and taps' prompt lookup; rows: ``ar`` (taps
autoregressive), ``chat``, ``mb`` (merged-budget of math and chat), ``lookup``, and ``_auto`` forms
(``taps.Tuner`` on the process clock), ``mbl_auto`` (merged-budget of math, chat and lookup). Rows are
interleaved per prompt (GSM8K and MT-Bench prompts with the chat template, 96 new tokens, T=0), each keeping
its fastest round. Prints tokens/s of both sides, their ratio and each side's ratio to its own taps
autoregressive row.

``--compare dtype``: the two sides are the shipped target in bfloat16 ("bf16") and in float32 ("fp32"), both
with panels among the layouts: on a CPU without bf16 products (or under the ISA switches below) the bf16
side's projections are widened and may be kept as bfloat16 panels, the question being whether its rows are at
least as fast as the float32 ones. Set the ISA switches (``TAPS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``) to run it as an AVX2-only CPU would.
"""

from __future__ import annotations

import argparse
import copy
import time

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_line  # noqa: E402

from taps import PromptLookupDrafter, SpeculativeDecoder, Tuner, lean, models  # noqa: E402
from taps.data import load_eval_prompts  # noqa: E402

SPECS = {"ar": ("autoregressive", []), "chat": ("single", ["chat"]), "mb": ("merged-budget", ["math", "chat"]),
         "lookup": ("single", ["lookup"]), "chat_auto": ("single", ["chat"]),
         "mb_auto": ("merged-budget", ["math", "chat"]), "lookup_auto": ("single", ["lookup"]),
         "mbl_auto": ("merged-budget", ["math", "chat", "lookup"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="ar,chat,mb,lookup,lookup_auto,mbl_auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3, help="per benchmark (GSM8K, MT-Bench)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--compare", default="panels", choices=("panels", "dtype"),
                    help="panels: fp32 with panels (P) against without (N); dtype: bf16 against fp32, both with panels")
    args = ap.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in SPECS]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown} (rows: {', '.join(SPECS)})")
    torch.set_num_threads(1)
    clock = time.process_time
    first, tok = models.load_target(dtype=torch.float32)
    if args.compare == "panels":
        sides = [("P", first, True), ("N", copy.deepcopy(first), False)]
    else:
        sides = [("bf16", models.load_target(dtype=torch.bfloat16)[0], True), ("fp32", first, True)]
    a, b = sides[0][0], sides[1][0]
    prompts = [tok.encode_chat(ex.messages, add_generation_prompt=True)
               for bench in ("gsm8k", "mt_bench") for ex in load_eval_prompts(bench)[:args.prompts]]
    decoders = {}
    try:
        for side, target, panels in sides:
            lean.PANELS = panels
            for row in rows:
                strategy, names = SPECS[row]
                drafters = [PromptLookupDrafter() if n == "lookup" else models.load_drafter("hass", n, target, draft_vocab=1024)
                            for n in names]
                kw = dict(tuner=Tuner(timer=clock)) if row.endswith("_auto") else {}
                dec = SpeculativeDecoder(target, drafters, strategy=strategy, **kw)
                dec.generate([prompts[0]], max_new_tokens=8, eos_token_id=tok.eos_id)  # packs the weights now
                decoders[side, row] = dec
    finally:
        lean.PANELS = True
    best = {(key, i): float("inf") for key in decoders for i in range(len(prompts))}
    tokens = {}
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for key, dec in decoders.items():
                t0 = clock()
                out = dec.generate([prompt], max_new_tokens=args.new_tokens, eos_token_id=tok.eos_id, seed=i)
                best[key, i] = min(best[key, i], clock() - t0)
                tokens[key, i] = len(out.tokens[0])
    tps = {key: sum(tokens[key, i] for i in range(len(prompts))) / sum(best[key, i] for i in range(len(prompts)))
           for key in decoders}
    dtype = "fp32" if args.compare == "panels" else "bf16 and fp32"
    print(f"{machine_line()} | 1 thread, {dtype}, T=0, {len(prompts)} prompts x {args.new_tokens} tokens, "
          f"fastest of {args.rounds} rounds (process time)")
    print(f"{'row':>12} {a + ' tok/s':>10} {b + ' tok/s':>10} {a + ' / ' + b:>11} {a + ' vs ' + a + ' ar':>12} "
          f"{b + ' vs ' + b + ' ar':>12}")
    for row in rows:
        line = f"{row:>12} {tps[a, row]:10.0f} {tps[b, row]:10.0f} {tps[a, row] / tps[b, row]:11.2f}"
        if "ar" in rows:
            line += f" {tps[a, row] / tps[a, 'ar']:12.2f} {tps[b, row] / tps[b, 'ar']:12.2f}"
        print(line)


if __name__ == "__main__":
    main()
