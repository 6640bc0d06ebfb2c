"""`taps demo`: the shipped models end to end (the README's main job).

1. loads the shipped target and one family of drafters (``models/``; every file checked against its
   manifest's sha256);
2. streams one math answer (a GSM8K test problem) and one chat answer (an MT-Bench question), decoded
   with the merged tree of the math and chat specialists; tokens the target accepted from the drafts
   are marked; each answer is then decoded again by the target alone with Hugging Face ``generate``
   (its own copy of the weights, same dtype and threads) and by taps' own autoregressive decoding, and the
   demo prints the speeds and their ratios and checks that the answers are token for token the same; when
   the streamed decoder has fixed settings, the same drafters with prompt lookup and ``budget="auto"`` (its
   tuner warmed up on two other answers) are timed beside;
3. runs a small evaluation (a few prompts per benchmark, temperature 0) and prints the acceptance-length
   table (`taps eval` runs the full one).
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import time
from typing import List, Optional

import torch

def add_demo_arguments(p) -> None:
    from .arguments import device_name, int_at_least, or_auto
    from .models import DTYPES, FAMILIES
    from .strategies import STRATEGIES

    p.add_argument("--quick", action="store_true", help="fewer prompts and tokens (CI)")
    p.add_argument("--family", default="hass", choices=FAMILIES, help="drafter family")
    p.add_argument("--limit", type=int_at_least(0), default=None,
                   help="prompts per benchmark in the evaluation (default 3, quick 1; 0: no evaluation table)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=None, help="default 96 (quick 40)")
    p.add_argument("--strategy", default="merged", choices=tuple(STRATEGIES), help="strategy of the streamed answers")
    p.add_argument("--lookup", action="store_true",
                   help="add taps' prompt-lookup drafter (taps.PromptLookupDrafter, no weights) to the streamed "
                        "answers' drafters (with --strategy single: it alone, the fastest CPU row of "
                        "bench/RESULTS.md; e.g. --strategy merged-budget --lookup)")
    p.add_argument("--store", default=None,
                   help="the token store prompt lookup also proposes from (models/stores/NAME, `taps train store`; "
                        "default: greedy, the shipped target's greedy answers to training prompts, when present; "
                        "none: no store)")
    p.add_argument("--depth", type=int_at_least(1), default=None, help="default: SpeculativeDecoder's for the device")
    p.add_argument("--top-k", type=int_at_least(1), default=None, help="default: SpeculativeDecoder's for the device")
    p.add_argument("--budget", type=or_auto(int_at_least(2)), default=None,
                   help="nodes of one drafter's tree, root included (default: SpeculativeDecoder's), or auto: "
                        "taps.Tuner chooses each step's drafters, depth and nodes, down to no draft, by measured "
                        "costs (the streamed answers; the evaluation table keeps fixed settings)")
    p.add_argument("--draft-vocab", type=int_at_least(0), default=1024,
                   help="drafters propose only the N most frequent target tokens (0: the whole vocabulary)")
    p.add_argument("--device", default="auto", type=device_name,
                   help="auto | cpu | cuda | cuda:N (auto: cuda when a GPU is visible and taps_ops has its CUDA "
                        "kernels)")
    p.add_argument("--dtype", default="auto", choices=("auto",) + tuple(DTYPES),
                   help="weights and activations, for taps and Hugging Face alike (auto: bf16 on CUDA and where "
                        "the CPU has native bf16, AVX512-BF16 or AMX; else fp32)")
    p.add_argument("--threads", type=int_at_least(0), default=0, help="torch CPU threads (0: default)")
    p.add_argument("--no-color", action="store_true", help="mark accepted tokens with brackets, not colour")


def _top_shapes(stats, top: int = 3) -> str:
    """The draft shapes a tuner chose most often (share of steps), e.g. ``none 80%, 0+1 d3 n8 15%``."""
    hist = stats.shape_histogram
    steps = sum(hist.values())
    return ", ".join(f"{label} {count / steps:.0%}" for label, count in list(hist.items())[:top])


def _left_out(out, names) -> str:
    """``; left out (idle before): the math drafter, ...`` for the drafters a tuned generation left out (idle in
    the generations before it: ``SpeculativeDecoder.leave_out_after``); "" for none. Past `names`: prompt lookup."""
    left = out.summary.get("left_out") or []
    if not left:
        return ""
    return "; left out (idle before): " + ", ".join(names[t] if t < len(names) else "prompt lookup" for t in left)


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
            parts.append(self.mark(piece) if drafted else piece)
        sys.stdout.write("".join(parts))
        sys.stdout.flush()

    def mark(self, piece: str) -> str:
        """`piece` marked line by line, so that no mark spans a line break."""
        return "\n".join((f"\033[32m{x}\033[0m" if self.color else f"[{x}]") if x else x for x in piece.split("\n"))


@torch.no_grad()
def _hf_generate(model, prompt: List[int], new_tokens: int, eos_id: int) -> List[int]:
    """The target's own greedy decoding: Hugging Face ``generate``."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=eos_id, pad_token_id=eos_id)
    return out[0, ids.shape[1]:].tolist()


@contextlib.contextmanager
def _no_progress_bars():
    """Hugging Face's progress bars (its "Loading weights" bar) off inside the block."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _target_story(folder) -> str:
    """What the shipped target is, from its manifest: size, training tokens and machine."""
    try:
        m = json.loads((folder / "manifest.json").read_text())
        threads = m.get("train_config", {}).get("threads") or "all"
        trained = (f"trained on {m['tokens_seen'] / 1e6:.0f}M tokens in {m['elapsed_s'] / 60:.0f} min on "
                   f"{threads} {m.get('device', 'cpu').upper()} cores")
    except (OSError, ValueError, KeyError, TypeError):
        trained = "trained on a few million tokens"
    return trained


def _same_line(tokens: List[int], hf: List[int], own: Optional[List[int]]) -> str:
    """Whether `tokens` are the target's own greedy output: Hugging Face generate's (`hf`) in fp32; in
    half precision taps' autoregressive decoding's (`own`, its tokens), with HF's beside it."""
    if own is None:
        return f"identical to the target's own greedy output (Hugging Face generate): {tokens == hf}"
    ref = own
    return (f"identical to the target's own greedy output (taps autoregressive, same dtype): {tokens == ref}; "
            f"to Hugging Face generate's: {tokens == hf}" + ("" if tokens == hf else
                                                             " (its one-token forwards round differently in bf16)"))


def demo(args) -> int:
    import taps_ops

    from . import models
    from .decoder import SpeculativeDecoder
    from .eval import ROWS, SINGLE_ROWS, evaluate, format_tables
    from .data import load_eval_prompts

    if args.lookup and args.strategy in ("average", "autoregressive"):
        raise ValueError(f"--lookup does not combine with --strategy {args.strategy} (prompt lookup has no "
                         "weights to average)" if args.strategy == "average" else
                         "--lookup does not combine with --strategy autoregressive (the target alone)")
    if args.threads:
        torch.set_num_threads(args.threads)
    limit = args.limit if args.limit is not None else (1 if args.quick else 3)
    new_tokens = args.max_new_tokens or (40 if args.quick else 96)
    color = sys.stdout.isatty() and not args.no_color
    t0 = time.time()
    from .arguments import resolve_device

    device = resolve_device(args.device)
    dtype = models.resolve_dtype(args.dtype, device)
    dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    cpu = taps_ops.cpu_info()
    bf16_note = "native bf16" if cpu.get("native_bf16") else "no native bf16"
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} ({device})"
        why = " (--dtype auto: bf16 on CUDA)" if args.dtype == "auto" else ""
    else:
        where = f"{cpu['cpu']} (taps kernels: {cpu['isa']}, {bf16_note})"
        why = f" (--dtype auto: {'the CPU has' if dtype == torch.bfloat16 else 'the CPU lacks'} native bf16)" \
            if args.dtype == "auto" else ""
    have = models.available_drafters().get(args.family, [])
    if not {"math", "chat"} <= set(have) and (models.models_dir() / "target" / "config.json").is_file():
        raise FileNotFoundError(f"the {args.family} math and chat drafters are missing from "
                                f"{models.models_dir() / 'drafters'} (found {have or 'none'}); see docs/TRAINING.md")
    with _no_progress_bars():
        target, tok = models.load_target(dtype=dtype)
        target.to(device)  # the drafters load onto the target's device
        drafters = {name: models.load_drafter(args.family, name, target, draft_vocab=args.draft_vocab or None)
                    for name in have}
        store_name = args.store or ("greedy" if (models.models_dir() / "stores" / "greedy").is_dir() else "none")
        store = None if store_name == "none" else models.load_store(store_name)
    reference = copy.deepcopy(target)  # Hugging Face generate on its own copy, untouched by taps
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in drafters["math"].parameters())
    print(f"TAPS demo on {where}, {dtype_name}{why}, "
          f"{torch.get_num_threads()} thread(s).\n"
          f"The target (models/target) is a {n_t / 1e6:.1f}M-parameter model "
          f"{_target_story(models.models_dir() / 'target')}: it writes fluent-looking nonsense, as a model that "
          "small does; what the demo shows is how many of the drafters' tokens the target accepts, and the speed.\n"
          f"Drafters: {args.family} {', '.join(sorted(drafters))} ({n_d / 1e6:.2f}M parameters each, plus the target's "
          f"embeddings and lm_head); "
          + (f"prompt lookup's token store: models/stores/{store_name} ({store.num_sequences:,} answers of the target "
             f"to training prompts, {len(store):,} tokens); " if store is not None else "")
          + f"every file matches its manifest sha256. Loaded in {time.time() - t0:.1f}s.\n")

    settings = {k: v for k, v in dict(depth=args.depth, top_k=args.top_k, budget=args.budget).items() if v is not None}
    pair = [drafters["math"], drafters["chat"]]
    # single: the math drafter alone, or with --lookup the prompt-lookup drafter alone (bench_e2e's lookup row)
    streamed = {"single": [] if args.lookup else pair[:1], "autoregressive": []}.get(args.strategy, pair)
    lookup_name = "prompt lookup" + (" with its token store" if store is not None else "")
    names = ["the math drafter", "the chat drafter"][:len(streamed)] + ([lookup_name] if args.lookup else [])
    if args.lookup:
        from .drafters import PromptLookupDrafter

        streamed = streamed + [PromptLookupDrafter(store=store)]
    merged = SpeculativeDecoder(target, streamed, strategy=args.strategy, **settings)
    mark = "green" if color else "[brackets]"
    vocab = f"{args.draft_vocab} most frequent tokens" if args.draft_vocab else "the whole vocabulary"
    print(f"1. Streaming, greedy, {args.strategy} strategy with {' and '.join(names) or 'no drafter'} (depth {merged.depth}, "
          f"top_k {merged.top_k}, {merged.budget} nodes per drafter"
          f"{'; budget auto: a tuner chooses each step within these, down to no draft' if merged.tuner else ''}; draft vocabulary: {vocab}; {dtype_name}, "
          f"{torch.get_num_threads()} thread(s)); tokens accepted from the drafts in {mark}, the rest are the "
          "target's own.")
    # the engine's own autoregressive decoding: the second speed reference (a speed-up that comes from a leaner
    # forward is not a speculative one) and, in bf16, the greedy reference (Hugging Face's one-token
    # forwards round differently from a tree forward there; README, "Speculative decoding"; HF's shown too)
    own = SpeculativeDecoder(target, [], strategy="autoregressive")
    # without a tuner: the same drafters with prompt lookup and budget="auto" beside, timed on each answer (on a
    # CPU fixed trees of trained drafters often lose to autoregressive decoding; the tuner drafts only where a
    # draft pays, prompt lookup's matches first)
    tuned = None
    if merged.tuner is None and args.strategy not in ("average", "autoregressive"):
        from .drafters import PromptLookupDrafter

        extra = [] if args.lookup else [PromptLookupDrafter(store=store)]
        tuned = SpeculativeDecoder(target, streamed + extra, strategy=args.strategy,
                                   **dict(settings, budget="auto"))
    for dec in (merged, own) + ((tuned,) if tuned is not None else ()):  # one-time setup outside the timings
        dec.generate([tok.encode_text("warm-up")], max_new_tokens=4)
    if tuned is not None:  # the tuner learns its costs and the drafters' acceptance on two other answers first
        for bench in ("gsm8k", "mt_bench"):
            warm = load_eval_prompts(bench)[1]
            tuned.generate([tok.encode_chat(warm.messages, add_generation_prompt=True)], max_new_tokens=new_tokens,
                           eos_token_id=tok.eos_id)
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
        t1 = time.perf_counter()
        plain = own.generate([prompt], max_new_tokens=new_tokens, eos_token_id=tok.eos_id).tokens[0]
        dt_own = time.perf_counter() - t1
        if tuned is not None:
            t1 = time.perf_counter()
            auto = tuned.generate([prompt], max_new_tokens=new_tokens, eos_token_id=tok.eos_id)
            dt_auto = time.perf_counter() - t1
        s = out.stats[0]
        speed, speed_hf, speed_own = s.new_tokens / dt, len(ref) / dt_hf, len(plain) / dt_own
        shares = ", ".join(f"{name} {share:.0%}" for name, share in zip(names, s.drafter_share)) or "no drafter"
        chose = f"; the tuner's drafts: {_top_shapes(s)}" if s.draft_shapes else ""
        print(f"\n--- {s.new_tokens} tokens in {s.target_forwards + 1} target forwards (tau {s.tau:.2f}); accepted "
              f"draft tokens proposed by {shares} (several when they agree){chose}\n--- speed: taps {speed:.0f} "
              f"tokens/s: {speed / speed_hf:.2f}x Hugging Face generate ({speed_hf:.0f} tokens/s), "
              f"{speed / speed_own:.2f}x taps autoregressive ({speed_own:.0f} tokens/s); "
              f"{_same_line(out.tokens[0], ref, plain if dtype != torch.float32 else None)}")
        if tuned is not None:
            a = auto.stats[0]
            speed_auto = a.new_tokens / dt_auto
            print(f"--- with {lookup_name} and budget=\"auto\" (`--lookup --budget auto`; its tuner warmed up on two "
                  f"other answers): taps {speed_auto:.0f} "
                  f"tokens/s, {speed_auto / speed_hf:.2f}x Hugging Face generate, {speed_auto / speed_own:.2f}x taps "
                  f"autoregressive (tau {a.tau:.2f}; the tuner's drafts: {_top_shapes(a)}{_left_out(auto, names)}); "
                  f"same output: {auto.tokens[0] == out.tokens[0]}")

    if not limit:
        print(f"\ndemo finished in {time.time() - t0:.0f}s")
        return 0
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
