"""``taps train table``: an n-gram table of the target's own next-token distributions (:mod:`taps.drafters.table`).

The target answers a sample of the training prompts (as ``taps train store``: GSM8K / MATH train and ShareGPT
first turns, evaluation prompts dropped), at temperature 1 by default, then reads each prompt with its answer
once (teacher forced): its distribution at every answer position, truncated to its ``keep`` most likely tokens,
is averaged per context of up to ``max_order`` tokens (:meth:`NgramTable.from_distributions`). The folder holds
``table.npz`` and a manifest with the target's weights digest.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

from ..drafters.table import NgramTable
from .data import REPO_ROOT

__all__ = ["build_table", "write_table", "TABLE_FILE"]

TABLE_FILE = "table.npz"


def build_table(target, prompts: Sequence[Sequence[int]], *, new_tokens: int = 128, batch: int = 8,
                temperature: float = 1.0, seed: int = 0, max_order: int = 3, entries: int = 16, min_count: int = 3,
                keep: int = 32, quiet: bool = False, meta: Optional[dict] = None) -> NgramTable:
    """The table of the target's distributions over its own answers to `prompts` (token id lists).

    Args:
        new_tokens, batch, temperature, seed: how the answers are generated (ragged batches of the
            autoregressive decoder; batch i draws with seed + i).
        max_order, entries, min_count: the table's (:meth:`NgramTable.from_distributions`).
        keep: the target's most likely tokens kept at each position before averaging.
    """
    import numpy as np
    import torch

    from ..drafters.base import target_vocab_size
    from .store import answers

    if new_tokens < 1 or batch < 1 or keep < 1:
        raise ValueError("build_table: new_tokens, batch and keep must be >= 1")
    prompts = [list(p) for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise ValueError("build_table: need at least one prompt, none of them empty")
    vocab = target_vocab_size(target)
    device = next(target.parameters()).device
    rows = []
    for p, t in answers(target, prompts, new_tokens=new_tokens, batch=batch, temperature=temperature, seed=seed,
                        desc="taps train table", quiet=quiet):
        seq = p + t
        with torch.no_grad():
            logits = target(torch.tensor([seq], device=device)).logits[0, :-1].float()
        top = torch.softmax(logits, -1).topk(min(keep, vocab), -1)
        rows.append((np.asarray(seq), top.indices.cpu().numpy(), top.values.cpu().numpy(), len(p) - 1))
    return NgramTable.from_distributions(rows, vocab, max_order=max_order, entries=entries, min_count=min_count,
                                         meta=meta)


def write_table(args) -> Path:
    """``taps train table``: build a table of the target's distributions and write it with its manifest."""
    from .store import save_with_manifest, start_answers

    target, tok, prompts, meta, started = start_answers(args, "table", f", contexts of up to {args.max_order} tokens")
    encoded = [tok.encode_chat(m, add_generation_prompt=True)[-512:] for m in prompts]
    table = build_table(target, encoded, new_tokens=args.new_tokens, batch=args.batch,
                        temperature=args.temperature, seed=args.seed, max_order=args.max_order,
                        entries=args.entries, min_count=args.min_count, meta=meta)
    out = Path(args.out)
    save_with_manifest(out, TABLE_FILE, table.save, {
        "kind": "ngram-table", **meta, "contexts": table.num_contexts, "max_order": table.max_order,
        "entries": args.entries, "min_count": args.min_count, "elapsed_s": round(time.time() - started, 1),
        "command": (f"taps train table --math {args.math} --chat {args.chat} --new-tokens {args.new_tokens} "
                    f"--temperature {args.temperature} --max-order {args.max_order} --entries "
                    f"{args.entries} --min-count {args.min_count} --seed {args.seed}")})
    print(f"[train table] saved {out / TABLE_FILE}: {table.num_contexts} contexts", flush=True)
    return out


def add_table_arguments(p) -> None:
    from ..arguments import int_at_least
    from .store import add_answer_arguments

    add_answer_arguments(p, REPO_ROOT / "models" / "tables" / "t1", 3000, 2000, 1.0, 1)
    p.add_argument("--max-order", type=int_at_least(0), default=3, help="the longest context (tokens)")
    p.add_argument("--entries", type=int_at_least(1), default=16, help="tokens kept per context")
    p.add_argument("--min-count", type=int_at_least(1), default=3,
                   help="positions a context of order >= 1 needs to be kept")
