"""`taps demo`: the shipped models end to end (the README's main job).

1. loads the shipped target and one family of drafters (``models/``; every file checked against its
   manifest's sha256);
2. streams one math answer (a GSM8K test problem) and one chat answer (an MT-Bench question), decoded
   with the merged tree of the math and chat specialists; tokens the target accepted from the drafts
   are marked; each answer is then decoded again by the target alone with Hugging Face ``generate``
   (its own copy of the weights, same dtype and threads), and the demo prints both speeds and their
   ratio and checks that the answers are token for token the same;
3. runs a small evaluation (a few prompts per benchmark, temperature 0) and prints the acceptance-length
   table (`taps eval` runs the full one).
"""

from __future__ import annotations

import copy
import sys
import time
from typing import List

import torch

def add_demo_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="fewer prompts and tokens (CI)")
    p.add_argument("--family", default="hass", choices=("eagle2", "hass", "eagle3"), help="drafter family")
    p.add_argument("--limit", type=int, default=None, help="prompts per benchmark in the evaluation (default 3, "
                                                           "quick 1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 96 (quick 40)")
    p.add_argument("--strategy", default="merged", help="strategy of the streamed answers")
    p.add_argument("--lookup", action="store_true",
                   help="add taps' prompt-lookup drafter (taps.PromptLookupDrafter, no weights) to the streamed "
                        "answers' drafters (with --strategy single: it alone, the fastest CPU row of "
                        "bench/RESULTS.md; e.g. --strategy merged-budget --lookup --dtype bf16)")
    p.add_argument("--depth", type=int, default=None, help="default: SpeculativeDecoder's for the device")
    p.add_argument("--top-k", type=int, default=None, help="default: SpeculativeDecoder's for the device")
    p.add_argument("--budget", type=int, default=None,
                   help="nodes of one drafter's tree, root included (default: SpeculativeDecoder's)")
    p.add_argument("--draft-vocab", type=int, default=1024,
                   help="drafters propose only the N most frequent target tokens (0: the whole vocabulary)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="weights and activations, for taps and Hugging Face alike")
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


@torch.no_grad()
def _hf_generate(model, prompt: List[int], new_tokens: int, eos_id: int) -> List[int]:
    """The target's own greedy decoding: Hugging Face ``generate``."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=eos_id, pad_token_id=eos_id)
    return out[0, ids.shape[1]:].tolist()


def demo(args) -> int:
    from . import models
    from .decoder import SpeculativeDecoder
    from .eval import ROWS, SINGLE_ROWS, evaluate, format_tables
    from .data import load_eval_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    limit = args.limit if args.limit is not None else (1 if args.quick else 3)
    new_tokens = args.max_new_tokens or (40 if args.quick else 96)
    color = sys.stdout.isatty() and not args.no_color
    t0 = time.time()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target, tok = models.load_target(dtype=dtype)
    reference = copy.deepcopy(target)  # Hugging Face generate on its own copy, untouched by taps
    have = models.available_drafters().get(args.family, [])
    if not {"math", "chat"} <= set(have):
        raise SystemExit(f"taps demo: the {args.family} math and chat drafters are missing from "
                         f"{models.models_dir() / 'drafters'} (found {have}); see docs/TRAINING.md")
    drafters = {name: models.load_drafter(args.family, name, target, draft_vocab=args.draft_vocab or None)
                for name in have}
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in drafters["math"].parameters())
    print(f"TAPS demo: target {n_t / 1e6:.1f}M parameters (models/target), {args.family} drafters "
          f"{', '.join(sorted(drafters))} ({n_d / 1e6:.2f}M parameters each, plus the target's embeddings "
          f"and lm_head); every file matches its manifest sha256. Loaded in {time.time() - t0:.1f}s.\n")

    settings = {k: v for k, v in dict(depth=args.depth, top_k=args.top_k, budget=args.budget).items() if v is not None}
    pair = [drafters["math"], drafters["chat"]]
    # single: the math drafter alone, or with --lookup the prompt-lookup drafter alone (bench_e2e's lookup row)
    streamed = pair if args.strategy != "single" else ([] if args.lookup else pair[:1])
    names = ["the math drafter", "the chat drafter"][:len(streamed)] + (["prompt lookup"] if args.lookup else [])
    if args.lookup:
        from .ngram import PromptLookupDrafter

        streamed = streamed + [PromptLookupDrafter()]
    merged = SpeculativeDecoder(target, streamed, strategy=args.strategy, **settings)
    mark = "green" if color else "[brackets]"
    vocab = f"{args.draft_vocab} most frequent tokens" if args.draft_vocab else "the whole vocabulary"
    print(f"1. Streaming, greedy, {args.strategy} strategy with {' and '.join(names)} (depth {merged.depth}, "
          f"top_k {merged.top_k}, {merged.budget} nodes per drafter; draft vocabulary: {vocab}; {args.dtype}, "
          f"{torch.get_num_threads()} thread(s)); tokens accepted from the drafts in {mark}, the rest are the "
          "target's own.")
    merged.generate([tok.encode_text("warm-up")], max_new_tokens=4)  # one-time setup outside the timings
    _hf_generate(reference, [1, 2, 3], 2, tok.eos_id)
    for title, bench in (("math (GSM8K test)", "gsm8k"), ("chat (MT-Bench)", "mt_bench")):
        ex = load_eval_prompts(bench)[0]
        prompt = tok.encode_chat(ex.messages, add_generation_prompt=True)
        print(f"\n--- {title}: {ex.messages[-1]['content'][:300]}")
        print("--- answer: ", end="")
        t1 = time.perf_counter()
        out = merged.generate([prompt], max_new_tokens=new_tokens, eos_token_id=tok.eos_id,
                              stream=_Marker(tok, color))
        dt = time.perf_counter() - t1
        t1 = time.perf_counter()
        ref = _hf_generate(reference, prompt, new_tokens, tok.eos_id)
        dt_hf = time.perf_counter() - t1
        s = out.stats[0]
        speed, speed_hf = s.new_tokens / dt, len(ref) / dt_hf
        shares = ", ".join(f"{name} {share:.0%}" for name, share in zip(names, s.drafter_share))
        print(f"\n--- {s.new_tokens} tokens in {s.target_forwards + 1} target forwards (tau {s.tau:.2f}); accepted "
              f"draft tokens proposed by {shares} (several when they agree)\n--- speed: taps {speed:.0f} tokens/s, "
              f"Hugging Face generate {speed_hf:.0f} tokens/s: "
              f"{speed / speed_hf:.2f}x; identical to the target's own greedy output: {out.tokens[0] == ref}")

    rows = [r for r in ROWS if r in have or r not in SINGLE_ROWS]  # single rows need their drafter
    print(f"\n2. Acceptance length tau (tokens per target forward) on {limit} prompt(s) per benchmark, temperature 0, "
          f"{new_tokens} new tokens (`taps eval` runs the full table):\n")
    res = evaluate(target, tok, {args.family: drafters}, strategies=rows, temperatures=[0.0], limit=limit,
                   max_new_tokens=new_tokens, seed=0, batch_size=4, progress=not args.quick,
                   depth=merged.depth, top_k=merged.top_k, budget=merged.budget)
    print(format_tables(res))
    if res.get("greedy_mismatches"):
        print("taps demo: speculative greedy output differed from another row's: a bug", file=sys.stderr)
        return 1
    print(f"demo finished in {time.time() - t0:.0f}s")
    return 0
