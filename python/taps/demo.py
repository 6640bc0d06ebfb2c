"""`taps demo`: the shipped models end to end (the README's main job).

1. loads the shipped target and one family of drafters (``models/``; every file checked against its
   manifest's sha256);
2. streams one math answer (a GSM8K test problem) and one chat answer (an MT-Bench question), decoded
   with the merged tree of the math and chat specialists; tokens the target accepted from the drafts
   are marked, and each answer is checked against the target's own greedy output;
3. runs a small evaluation (a few prompts per benchmark, temperature 0) and prints the acceptance-length
   table (`taps eval` runs the full one).
"""

from __future__ import annotations

import sys
import time
from typing import List

import torch

DEMO_ROWS = ("math", "chat", "mixed", "mixed2", "avg", "route-confidence", "route-entropy", "merged",
             "merged-budget", "adaptive")


def add_demo_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="fewer prompts and tokens (CI)")
    p.add_argument("--family", default="hass", choices=("eagle2", "hass", "eagle3"), help="drafter family")
    p.add_argument("--limit", type=int, default=None, help="prompts per benchmark in the evaluation (default 3, "
                                                           "quick 1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 96 (quick 40)")
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--budget", type=int, default=32, help="nodes of one drafter's tree, root included")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--no-color", action="store_true", help="mark accepted tokens with brackets, not colour")


class _Marker:
    """Streams decoded text, marking the tokens a step accepted from the drafts (all but the step's last)."""

    def __init__(self, tok, color: bool):
        self.tok, self.color = tok, color
        self.ids: List[int] = []
        self.text = ""

    def __call__(self, _b: int, new: List[int]) -> None:
        parts = []
        for i, t in enumerate(new):
            self.ids.append(t)
            full = self.tok.decode(self.ids, skip_special_tokens=True)
            piece, self.text = full[len(self.text):], full
            drafted = i < len(new) - 1
            if drafted and piece:
                piece = f"\033[32m{piece}\033[0m" if self.color else f"[{piece}]"
            parts.append(piece)
        sys.stdout.write("".join(parts))
        sys.stdout.flush()


def demo(args) -> int:
    from . import models
    from .decoder import SpeculativeDecoder
    from .eval import evaluate, format_tables
    from .train.data import load_eval_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    limit = args.limit if args.limit is not None else (1 if args.quick else 3)
    new_tokens = args.max_new_tokens or (40 if args.quick else 96)
    color = sys.stdout.isatty() and not args.no_color
    t0 = time.time()
    target, tok = models.load_target()
    have = models.available_drafters().get(args.family, [])
    if not {"math", "chat"} <= set(have):
        raise SystemExit(f"taps demo: the {args.family} math and chat drafters are missing from "
                         f"{models.models_dir() / 'drafters'} (found {have}); see docs/TRAINING.md")
    drafters = {name: models.load_drafter(args.family, name, target) for name in have}
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in drafters["math"].parameters())
    print(f"TAPS demo: target {n_t / 1e6:.1f}M parameters (models/target), {args.family} drafters "
          f"{', '.join(sorted(drafters))} ({n_d / 1e6:.2f}M parameters each, plus the target's embeddings "
          f"and lm_head); every file matches its manifest sha256. Loaded in {time.time() - t0:.1f}s.\n")

    settings = dict(depth=args.depth, top_k=args.top_k, budget=args.budget)
    merged = SpeculativeDecoder(target, [drafters["math"], drafters["chat"]], strategy="merged", **settings)
    plain = SpeculativeDecoder(target, [], strategy="autoregressive")
    mark = "green" if color else "[brackets]"
    print(f"1. Streaming, greedy, merged tree of the math and chat specialists (budget {args.budget} nodes each); "
          f"tokens accepted from the drafts in {mark}, the rest are the target's own.")
    for title, bench in (("math (GSM8K test)", "gsm8k"), ("chat (MT-Bench)", "mt_bench")):
        ex = load_eval_prompts(bench)[0]
        prompt = tok.encode_chat(ex.messages, add_generation_prompt=True)
        print(f"\n--- {title}: {ex.messages[-1]['content'][:300]}")
        print("--- answer: ", end="")
        t1 = time.time()
        out = merged.generate([prompt], max_new_tokens=new_tokens, eos_token_id=tok.eos_id,
                              stream=_Marker(tok, color))
        dt = time.time() - t1
        ref = plain.generate([prompt], max_new_tokens=new_tokens, eos_token_id=tok.eos_id)
        s = out.stats[0]
        share = s.drafter_share
        print(f"\n--- {s.new_tokens} tokens in {s.target_forwards + 1} target forwards (tau {s.tau:.2f}, "
              f"{dt:.1f}s); accepted draft tokens proposed by the math drafter {share[0]:.0%}, the chat drafter "
              f"{share[1]:.0%} (both when they agree); identical to the target's own greedy output: "
              f"{out.tokens == ref.tokens}")

    rows = [r for r in DEMO_ROWS if r in have or r not in ("math", "chat", "mixed", "mixed2", "avg")]
    print(f"\n2. Acceptance length tau (tokens per target forward) on {limit} prompt(s) per benchmark, temperature 0, "
          f"{new_tokens} new tokens (`taps eval` runs the full table):\n")
    res = evaluate(target, tok, {args.family: drafters}, strategies=rows, temperatures=[0.0], limit=limit,
                   max_new_tokens=new_tokens, seed=0, batch_size=4, progress=not args.quick, **settings)
    print(format_tables(res))
    if res.get("greedy_mismatches"):
        print("taps demo: speculative greedy output differed from another row's: a bug", file=sys.stderr)
        return 1
    print(f"demo finished in {time.time() - t0:.0f}s")
    return 0
