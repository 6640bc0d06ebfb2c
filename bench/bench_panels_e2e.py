"""End to end, taps' panel products (taps_ops.panel_linear) against the BLAS layouts alone, in one process.

    PYTHONPATH=python python bench/bench_panels_e2e.py [--rows ar,chat,mb,lookup,lookup_auto,mbl_auto]
                                                        [--rounds 3] [--prompts 3]

Two copies of the shipped target (fp32), one packed with panels among the layouts ``taps.lean`` times at
load ("P") and one without (``taps.lean.PANELS = False``, as ``TAPS_PANELS=0``: "N"); every row is built on
both, the shipped hass drafters (draft vocabulary 1024) and taps' prompt lookup; rows: ``ar`` (taps
autoregressive), ``chat``, ``mb`` (merged-budget of math and chat), ``lookup``, and ``_auto`` forms
(``taps.Tuner`` on the process clock), ``mbl_auto`` (merged-budget of math, chat and lookup). Rows are
interleaved per prompt (GSM8K and MT-Bench prompts with the chat template, 96 new tokens, T=0), each keeping
its fastest round. Prints tokens/s of both sides, their ratio and each side's ratio to its own taps
autoregressive row. Set the ISA switches (``TAPS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2
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
    args = ap.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in SPECS]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown} (rows: {', '.join(SPECS)})")
    torch.set_num_threads(1)
    clock = time.process_time
    with_panels, tok = models.load_target(dtype=torch.float32)
    without = copy.deepcopy(with_panels)
    prompts = [tok.encode_chat(ex.messages, add_generation_prompt=True)
               for bench in ("gsm8k", "mt_bench") for ex in load_eval_prompts(bench)[:args.prompts]]
    decoders = {}
    try:
        for side, target in (("P", with_panels), ("N", without)):
            lean.PANELS = side == "P"
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
    print(f"{machine_line()} | 1 thread, fp32, T=0, {len(prompts)} prompts x {args.new_tokens} tokens, "
          f"fastest of {args.rounds} rounds (process time)")
    print(f"{'row':>12} {'P tok/s':>8} {'N tok/s':>8} {'P / N':>6} {'P vs P ar':>9} {'N vs N ar':>9}")
    for row in rows:
        line = f"{row:>12} {tps['P', row]:8.0f} {tps['N', row]:8.0f} {tps['P', row] / tps['N', row]:6.2f}"
        if "ar" in rows:
            line += f" {tps['P', row] / tps['P', 'ar']:9.2f} {tps['N', row] / tps['N', 'ar']:9.2f}"
        print(line)


if __name__ == "__main__":
    main()
