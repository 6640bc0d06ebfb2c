"""Microbenchmark of taps_ops.expand_level against the composite form the expansion ran before it.

    PYTHONPATH=python python bench/bench_expand_level.py [--repeats 2000] [--isa LEVELS]

Rows: one expansion level, R requests x F frontier nodes x V draft-vocabulary logits, top_k 8 (a root
level F = 1, a frontier of 8, batches of 4; V = 512, a reduced draft vocabulary of 1,024 and 32,000, a
full one), float32 and bfloat16. Columns: the composite in torch (log_softmax, topk, the draft-to-target
map, the cumulative scores and parents, the frontier's topk and gathers: what taps.expansion ran per
level), taps_ops.expand_level, the ratio, and the floor: reading the logits once at the machine's memory
bandwidth (``--gbps``; the op also computes one exp per logit, about V * R * F / 8 vector instructions,
below the read at these sizes). Mean over ``repeats`` calls after a warm-up; on CUDA (when present)
synchronised around the loop. On the CPU the op runs once per instruction-set level (``--isa``, see
bench/common.py), next to the composite measured once.
"""

from __future__ import annotations

import torch

import taps_ops
from bench_rms_norm import compare, start  # noqa: E402  (bench/ is on the path when run as a script)


def composite(logits, front_score, front_cand, k, token_map, offset):
    """One level as taps.expansion computed it in torch operators (without the entropy)."""
    rows, front = front_score.shape
    logp = torch.log_softmax(logits, -1, dtype=torch.float32)
    child_logp, child_tok = logp.topk(k, dim=-1)
    child_tok = token_map[child_tok]
    cum = (front_score.unsqueeze(-1) + child_logp).reshape(rows, front * k)
    child_tok = child_tok.reshape(rows, front * k)
    parents = front_cand.repeat_interleave(k, dim=1)
    score, idx = cum.topk(k, dim=-1)
    return cum, child_tok, parents, score, child_tok.gather(1, idx), idx // k, offset + idx


def main() -> None:
    args, devices = start(__doc__, "expand_level", f"{'R':>3} {'F':>3} {'V':>6} {'dtype':>8}")
    k = 8
    for device in devices:
        for rows, front, vocab in ((1, 1, 512), (1, 8, 512), (1, 8, 1024), (4, 8, 1024), (1, 8, 32000)):
            for dt in (torch.float32, torch.bfloat16):
                logits = torch.randn(rows, front, vocab, device=device).to(dt)
                score = torch.randn(rows, front, device=device)
                cand = torch.arange(front, device=device).expand(rows, front).contiguous()
                token_map = torch.randperm(4 * vocab, device=device)[:vocab]
                compare(args, device, f"{rows:3} {front:3} {vocab:6} {str(dt)[6:]:>8}",
                        lambda: composite(logits, score, cand, k, token_map, 8),
                        lambda: taps_ops.expand_level(logits, score, cand, k, k, 8, token_map),
                        logits.numel() * logits.element_size())


if __name__ == "__main__":
    main()
