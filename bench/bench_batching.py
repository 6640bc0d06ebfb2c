"""Continuous batching without HTTP: the load of ``bench_serve.py`` on :class:`taps.batching.ContinuousBatch`.

    PYTHONPATH=python python bench/bench_batching.py --threads 1 --rounds 3

The same requests as the server bench (GSM8K test and MT-Bench first turns in turn, in the shipped target's
chat template, temperatures cycling through ``--temperatures``), all queued at once and admitted up to
``--max-batch`` at a time, decoded by the server's decoders (its default drafters and settings, or
``--strategy`` / ``--drafters``): taps autoregressive, a second autoregressive decoder as the control (its
ratio to the first is the run's noise), and each speculative row. The rows take turns within every round
(``--rounds``, the fastest kept), so a drifting machine moves them alike; times are of this process's CPU
(``--clock process``, the default) or the wall.

Printed per row: tokens/s of the whole load (admission, prefill and decoding), the decoding steps, the mean
tokens a request gains per step (tau), the ratio to taps autoregressive; then where the time went (the
calls of :class:`~taps.batching.ContinuousBatch` and :class:`~taps.decoder.SpeculativeDecoder` that a
load makes, ms per step), and the tree widths the speculative rows verified. With the CPU
(``taps_ops.cpu_info()["summary"]``) and the torch threads.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table  # noqa: E402

#: the calls timed in the breakdown: (owner, method)
_TIMED = [("decoder", "_verify"), ("batch", "_admit"), ("batch", "_keep"), ("decoder", "start"), ("decoder", "join"), ("decoder", "drop"),
          ("decoder", "_plan"), ("decoder", "_draft"), ("decoder", "_tree"),
          ("decoder", "_commit"), ("decoder", "_read_back"), ("decoder", "_advance_drafters"),
          ("decoder", "_record")]


class Timers:
    """Seconds spent in the methods of `_TIMED` (exclusive of nothing: ``_admit`` holds ``start`` and
    ``join``, ``_keep`` holds ``drop``), switched on and off around a load."""

    def __init__(self, clock):
        from taps import batching, decoder

        self.clock, self.on = clock, False
        self.totals: Dict[str, float] = collections.defaultdict(float)
        self.widths: Dict[tuple, int] = collections.Counter()
        owners = {"batch": batching.ContinuousBatch, "decoder": decoder.SpeculativeDecoder}
        verify = decoder.SpeculativeDecoder._verify

        def counted(dec, state, tree, *args, **kwargs):
            if self.on:
                self.widths[(state.batch, tree.tokens.shape[1])] += 1
            return verify(dec, state, tree, *args, **kwargs)
        decoder.SpeculativeDecoder._verify = counted
        for owner, name in _TIMED:
            self._wrap(owners[owner], name)

    def _wrap(self, cls, name):
        inner = getattr(cls, name)
        clock, totals = self.clock, self.totals

        def timed(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            t0 = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[name] += clock() - t0
        setattr(cls, name, timed)


def load_prompts(tokenizer, count: int) -> List[List[int]]:
    """`count` prompts as token ids in the chat template: GSM8K test and MT-Bench first turns in turn."""
    from taps.data import load_eval_prompts

    math, chat = load_eval_prompts("gsm8k"), load_eval_prompts("mt_bench")
    out = []
    for i in range(count):
        source = math if i % 2 == 0 else chat
        out.append(tokenizer.encode_chat(source[(i // 2) % len(source)].messages, add_generation_prompt=True))
    return out


def run_load(decoder, prompts, temperatures, max_tokens: int, max_batch: int, clock, seed: int):
    """(tokens, steps, seconds, tau) of the whole load on a fresh ContinuousBatch."""
    from taps.batching import ContinuousBatch, SamplingParams

    batch = ContinuousBatch(decoder, max_batch=max_batch)
    for i, ids in enumerate(prompts):
        batch.add(i, ids, SamplingParams(max_new_tokens=max_tokens, temperature=temperatures[i % len(temperatures)],
                                         seed=seed + i))
    tokens = steps = forwards = 0
    t0 = clock()
    while batch:
        for event in batch.step():
            tokens += len(event.tokens)
            if event.finish_reason is not None:
                forwards += event.stats.target_forwards
        steps += 1
    seconds = clock() - t0
    return tokens, steps, seconds, tokens / max(forwards, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,0.7,1", help="comma list, cycled over the requests")
    ap.add_argument("--strategy", help="the speculative rows' strategy (default: the server's)")
    ap.add_argument("--drafters", default=None,
                    help="the speculative rows' drafters, comma list (default: the server's); ';' separates rows")
    ap.add_argument("--fixed", action="store_true", help="also each speculative row with the fixed draft settings")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; every row runs once per round, the fastest kept")
    ap.add_argument("--warmup", type=int, default=16, help="requests of an untimed load per row first")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="fp32", help="auto, fp32 or bf16")
    ap.add_argument("--clock", default="process", choices=("process", "wall"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import taps_ops
    import torch
    from taps.decoder import SpeculativeDecoder
    from taps.serve import ServeConfig
    from taps.serve.engine import load_models

    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    cfg = ServeConfig(dtype=args.dtype)
    models = load_models(cfg)
    strategy = args.strategy or cfg.strategy
    sets = [s.split(",") for s in args.drafters.split(";")] if args.drafters else [cfg.request_drafters()]
    for names in sets:
        unknown = [n for n in names if n not in models.drafters]
        if unknown:
            ap.error(f"--drafters: unknown {unknown}; the server has {sorted(models.drafters)}")

    def decoder(strategy, names=(), auto=True):
        dec = SpeculativeDecoder(models.target, [models.drafters[n] for n in names], strategy, depth=cfg.depth,
                                 top_k=cfg.top_k, budget="auto" if auto else cfg.budget if cfg.budget != "auto" else None,
                                 tokenizer=models.tokenizer)
        dec.retire_after = cfg.retire_steps  # as taps serve's
        return dec

    rows = {"taps autoregressive": decoder("autoregressive"), "control (autoregressive)": decoder("autoregressive")}
    for names in sets:
        rows[f"{strategy} {'+'.join(names)} auto"] = decoder(strategy, names)
        if args.fixed:
            rows[f"{strategy} {'+'.join(names)} fixed"] = decoder(strategy, names, auto=False)
    prompts = load_prompts(models.tokenizer, args.requests)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    print(f"bench_batching: {models.name} ({args.dtype}, {args.threads} torch thread(s)); CPU: "
          f"{taps_ops.cpu_info()['summary']}")
    print(f"load: {args.requests} requests (GSM8K and MT-Bench in turn), max_batch {args.max_batch}, max_tokens "
          f"{args.max_tokens}, temperatures {args.temperatures}; {args.rounds} rounds, the fastest kept; "
          f"{args.clock} clock; depth {cfg.depth}, top_k {cfg.top_k}")

    timers = Timers(clock)
    for dec in rows.values():
        if args.warmup:
            run_load(dec, prompts[:args.warmup], temperatures, args.max_tokens, args.max_batch, clock, args.seed)
    best: Dict[str, tuple] = {}
    spent: Dict[str, Dict[str, float]] = {}
    widths: Dict[str, collections.Counter] = {}
    for r in range(args.rounds):
        for name, dec in rows.items():
            timers.totals.clear()
            timers.widths.clear()
            timers.on = True
            result = run_load(dec, prompts, temperatures, args.max_tokens, args.max_batch, clock, args.seed)
            timers.on = False
            if name not in best or result[2] < best[name][2]:
                best[name] = result
                spent[name] = dict(timers.totals)
                widths[name] = collections.Counter(timers.widths)
            print(f"  round {r + 1}: {name}: {result[0] / result[2]:.0f} tokens/s, {result[1]} steps", flush=True)

    ar = best["taps autoregressive"]
    table = []
    for name, (tokens, steps, seconds, tau) in best.items():
        table.append([name, tokens, steps, f"{tau:.2f}", f"{seconds:.2f}", f"{tokens / seconds:.0f}",
                      f"{1e3 * seconds / steps:.2f}", f"{(tokens / seconds) / (ar[0] / ar[2]):.2f}x"])
    print_table(["row", "tokens", "steps", "tau", "seconds", "tokens/s", "ms/step", "vs taps AR"], table,
                title="continuous batching, the whole load (fastest round)")
    names = list(best)
    table = []
    for _, call in _TIMED:
        table.append([call] + [f"{1e3 * spent[n].get(call, 0.0) / best[n][1]:.3f}" for n in names])
    table.append(["(whole load)"] + [f"{1e3 * best[n][2] / best[n][1]:.3f}" for n in names])
    print_table(["ms per step in"] + names, table,
                title="where the time went (ms per step; _admit holds start and join, _keep holds drop)")
    for name in names[2:]:
        shown = ", ".join(f"batch {b} x {w}: {c}" for (b, w), c in sorted(widths[name].items()))
        print(f"{name}: tree widths verified (steps): {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
