"""``taps train vocab``: token counts of the drafters' training data, for reduced draft vocabularies.

Counts every token of the training blocks the drafters are trained on (:func:`taps.train.drafter.
domain_blocks`: the same conversations, decontaminated against the evaluation prompts, the held-out
part excluded) and writes them as ``token_counts.json`` into the target's folder (:mod:`taps.vocab`),
updating its manifest. ``taps.vocab.draft_vocab(folder, n)`` then gives the ``n`` most frequent ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from .data import REPO_ROOT

__all__ = ["count_training_tokens", "write_token_counts"]


def count_training_tokens(tok, vocab_size: int, tokens_per_domain: int, *, seq_len: int = 512,
                          heldout_tokens: int = 16_384, seed: int = 0, shared=None, sharegpt=None):
    """(counts int64 [V], source dict) over ``tokens_per_domain`` training tokens of math and of chat."""
    from taps.vocab import count_tokens

    from .drafter import domain_blocks

    blocks, source = [], {"tokens_per_domain": tokens_per_domain, "seed": seed, "seq_len": seq_len,
                          "heldout_tokens_excluded": heldout_tokens, "domains": {}}
    for domain in ("math", "chat"):
        train, _, info = domain_blocks(domain, tok, tokens=tokens_per_domain, heldout_tokens=heldout_tokens,
                                       seq_len=seq_len, seed=seed, shared=shared, sharegpt=sharegpt)
        blocks.append(train)
        source["domains"][domain] = {"train_tokens": info["train_tokens"],
                                     "conversations_used": info["conversations_used"]}
    return count_tokens(blocks, vocab_size), source


def write_token_counts(target_dir: Path, tokens_per_domain: int, seed: int = 0, shared=None,
                       sharegpt: Optional[Path] = None) -> Path:
    """Count, write ``target_dir/token_counts.json`` and add it to ``target_dir/manifest.json``."""
    from taps.models import load_target
    from taps.vocab import coverage, save_token_counts, top_tokens

    from ..files import sha256_file

    target, tok = load_target(target_dir)
    vocab = int(target.get_output_embeddings().weight.shape[0])
    counts, source = count_training_tokens(tok, vocab, tokens_per_domain, seed=seed, shared=shared, sharegpt=sharegpt)
    shown = Path(target_dir).resolve()
    shown = shown.relative_to(REPO_ROOT) if shown.is_relative_to(REPO_ROOT) else shown
    source["command"] = f"taps train vocab --target {shown} --tokens {tokens_per_domain} --seed {seed}"
    source["coverage"] = {str(n): round(coverage(counts, top_tokens(counts, n)), 4)
                          for n in (256, 512, 1024, 2048, 4096) if n <= vocab}
    path = save_token_counts(target_dir, counts, source)
    manifest_path = Path(target_dir) / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        manifest.setdefault("files", {})[path.name] = sha256_file(path)
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"[train vocab] {path}: {int(counts.sum()):,} tokens counted; share covered by the n most frequent: "
          + ", ".join(f"{n}: {c:.1%}" for n, c in source["coverage"].items()), flush=True)
    return path
