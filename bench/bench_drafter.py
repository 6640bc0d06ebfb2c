"""Draft cost per expansion level: EAGLE-2 heads (the target's lm_head over the whole vocabulary, or its
rows of a reduced draft vocabulary) against EAGLE-3 heads (their own lm_head over their draft vocabulary)
on the shipped target's shapes.

    PYTHONPATH=python python bench/bench_drafter.py [--batch 1 4] [--top-k 8] [--prefix 256] [--threads 1]

Each drafter is started on random prompts of ``--prefix`` tokens (the target's real features), then one
expansion level is timed: ``forward_nodes`` of K = top_k frontier nodes per request (the drafter forward
the EAGLE-2 expansion runs depth - 1 times per step), and a whole ``draft(depth, top_k)`` (the level
forwards plus the top-k bookkeeping). Times are process time (CPU seconds of this process, so other load
on a shared machine counts less), the median of ``--repeats`` blocks of ``--calls`` calls. The shipped
drafters are used when present (``models/drafters/<family>-math``), else random heads of the same shapes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt_time, print_table  # noqa: E402


def _clock_per_call(fn, calls: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        times.append((time.process_time() - t0) / calls)
    return statistics.median(times)


def _drafters(target, vocab_size: int):
    """{name: drafter} bound to the target: EAGLE-2 full / reduced, EAGLE-3 with its draft vocabulary."""
    import transformers

    from taps import models
    from taps.eagle3 import Eagle3Drafter
    from taps.train.drafter import new_drafter

    out = {}
    try:
        e2 = models.load_drafter("eagle2", "math", target, verify=False)
        note2 = "shipped eagle2-math"
    except FileNotFoundError:
        e2, note2 = new_drafter(target), "random, shipped shape"
    out[f"EAGLE-2, vocab {e2.vocab_size} ({note2})"] = e2
    try:
        e3 = models.load_drafter("eagle3", "math", target, verify=False)
        note3 = "shipped eagle3-math"
    except FileNotFoundError:
        from taps.train.eagle3 import new_eagle3_drafter
        from taps.eagle3 import feature_layers

        e3 = new_eagle3_drafter(target, models.draft_vocab(2048), feature_layers(target.config.num_hidden_layers))
        note3 = "random, shipped shape"
    ids = e3.draft_token_ids().cpu()
    reduced = e2.clone()
    reduced.set_draft_vocab(ids)
    out[f"EAGLE-2, target head rows of {ids.numel()}"] = reduced
    out[f"EAGLE-3, draft vocab {e3.draft_vocab_size} ({note3})"] = e3
    cfg = transformers.LlamaConfig(**{**e3.config.to_dict(), "draft_vocab_size": vocab_size})
    full = Eagle3Drafter(cfg, num_features=e3.num_features)
    full.load_state_dict({k: v for k, v in e3.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")},
                         strict=False)
    full.bind(target)
    out[f"EAGLE-3, draft vocab {vocab_size} (same layer, full head)"] = full
    return out


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from taps import hf, models

    target, _ = models.load_target(verify=False)
    hf.use_taps_attention(target)
    vocab = target.config.vocab_size
    drafters = _drafters(target, vocab)
    rows = []
    for batch in args.batch:
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(6, vocab, (batch, args.prefix), generator=g)
        lens = torch.full((batch,), args.prefix)
        reference = None
        for name, d in drafters.items():
            spec = d.target_features
            cache = hf.TreeKVCache.for_model(target, batch, args.prefix + 8)
            pre = hf.prefill(target, cache, ids, lens, return_hidden=spec == "final",
                             capture_layers=spec if isinstance(spec, tuple) else ())
            feats = pre.hidden_states if spec == "final" else torch.cat([pre.layers[i] for i in spec], -1)
            max_len = args.prefix + 1 + args.depth * args.top_k + 8
            d.start(ids, lens, pre.logits.argmax(-1), feats, max_len)
            k = args.top_k
            tokens = torch.randint(6, vocab, (batch, k), generator=g)
            start = int(d.scratch_start)
            mask = torch.ones((batch, 1, k, start + k), dtype=torch.bool)
            rope = d.lengths.unsqueeze(1).expand(batch, k)
            write = start + torch.arange(k).expand(batch, k)
            parent = torch.zeros((batch, k), dtype=torch.long)
            d.draft(2, k)  # sets the frontier the level-2 forward reads
            level = _clock_per_call(lambda: d.forward_nodes(tokens, parent, write, rope, mask, 2), args.calls,
                                    args.repeats)
            draft = _clock_per_call(lambda: d.draft(args.depth, k, with_entropy=False), max(1, args.calls // 4),
                                    args.repeats)
            d.release()
            reference = reference or level
            rows.append([batch, name, fmt_time(level), f"{level / reference:.2f}", fmt_time(draft)])
    print(f"{torch.get_num_threads()} thread(s), fp32, process time; K = top_k = {args.top_k} frontier nodes per "
          f"request, prefix {args.prefix} tokens, draft depth {args.depth}")
    print_table(["batch", "drafter", "one level (forward_nodes)", "vs EAGLE-2 full",
                 f"draft({args.depth}, {args.top_k})"], rows, title="drafter forward cost per expansion level")


if __name__ == "__main__":
    main()
