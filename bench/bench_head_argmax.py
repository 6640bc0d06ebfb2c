"""Microbenchmark of taps_ops.head_argmax (the greedy token of each row under a head kept as panels, from an int8
screen) against the full product's argmax, on the CPU.

    PYTHONPATH=python python bench/bench_head_argmax.py [--rows 1,4,8,16] [--isa LEVELS] [--rounds 7]

The head is the shipped target's (8,192 x 256) and x its final hidden states over a GSM8K prompt (the screen's
candidates depend on how peaked the rows are: random x would not say what decoding sees). Columns per level
(``--isa``, bench/common.py): ``panel_linear(x, panels)`` (the product greedy verification computes without the
screen; its walk then reads a visited row's argmax in verify_tree, a few microseconds), ``head_argmax`` and the ratio, for float32 panels and x (an fp32 model) and for bfloat16 panels and x (a
bf16 model: bf16 logits, one bf16 step of margin), and the floor of the screen: the larger of reading the int8
screen once at ``--gbps`` and its multiply-adds at the level's int8 rate (64 a cycle with AVX512-VNNI, 32 with
AVX2; --ghz). The exact rows of the candidates' panels come on top of it. Every time is the fastest of
``--rounds`` rounds, the two alternating.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_isa_argument, cpu_isa, isa_levels, machine_line  # noqa: E402

import taps_ops  # noqa: E402


def fastest(fns: dict, calls: int, rounds: int) -> dict:
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gbps", type=float, default=25.0, help="memory bandwidth for the floor column")
    ap.add_argument("--ghz", type=float, default=3.5, help="clock for the floor column")
    add_isa_argument(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    from taps import models
    from taps.data import load_eval_prompts

    target, tok = models.load_target(dtype=torch.float32)
    prompt = tok.encode_chat(load_eval_prompts("gsm8k")[0].messages, add_generation_prompt=True)
    states = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    weight = target.get_output_embeddings().weight.detach()
    out, inner = weight.shape
    levels = isa_levels(args.isa)
    print(f"{machine_line()} | threads 1, fastest of {args.rounds} rounds; head {out} x {inner}, x: the target's "
          f"final states over a GSM8K prompt")
    head = f"{'dtype':>6} {'rows':>4} " + " ".join(
        f"{lv + ' product':>15} {lv + ' screen':>14} {'ratio':>6} {'floor':>7}" for lv in levels)
    print(head)
    print("-" * len(head))
    for dtype in (torch.float32, torch.bfloat16):
        w = weight.to(dtype)
        panels = taps_ops.pack_panels(w)
        screen, meta = taps_ops.pack_head_screen(w)
        for rows in [int(r) for r in args.rows.split(",")]:
            x = states[-rows:].to(dtype).contiguous()
            want = taps_ops.panel_linear(x, panels).argmax(-1)
            cells = []
            for level in levels:
                with cpu_isa(level):
                    assert torch.equal(taps_ops.head_argmax(x, screen, meta, panels), want)
                    calls = 3 if level == "scalar" else 30
                    t = fastest({"full": lambda: taps_ops.panel_linear(x, panels),
                                 "screen": lambda: taps_ops.head_argmax(x, screen, meta, panels)},
                                calls, args.rounds)
                vnni = level in ("avx512", "amx") and "avx512_vnni" in taps_ops.cpu_info()["features"]
                per_cycle = 64 if vnni else 32 if level != "scalar" else 1
                floor = max(out * inner / (args.gbps * 1e9), rows * out * inner / (per_cycle * args.ghz * 1e9))
                cells.append(f"{t['full'] * 1e6:13.1f}us {t['screen'] * 1e6:12.1f}us {t['full'] / t['screen']:5.2f}x "
                             f"{floor * 1e6:5.0f}us")
            print(f"{str(dtype).split('.')[-1]:>6} {rows:4} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
