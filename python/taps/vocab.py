"""Draft vocabularies: the target tokens a drafter may propose, chosen by their frequency in training data.

A drafter's head over the whole vocabulary is most of a small drafter's cost (the shipped heads: 8192
rows of 256 for 8 frontier nodes, against one 256-wide decoder layer). Restricting the head to the most
frequent target tokens (as EAGLE-3's ``d2t`` does) cuts that cost in proportion, and loses only the
acceptance of the rare tokens it can no longer propose; verification is unchanged, so decoding stays
lossless. :meth:`taps.drafters.Drafter.set_draft_vocab` applies one.

Token counts are stored beside a model as ``token_counts.json``::

    {"vocab_size": V, "counts": [c_0, ..., c_{V-1}], "source": {...how they were counted...}}

``taps train vocab`` writes them from the drafters' training data (:mod:`taps.train.vocab`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = ["COUNTS_FILE", "count_tokens", "top_tokens", "coverage", "save_token_counts", "load_token_counts",
           "draft_vocab"]

COUNTS_FILE = "token_counts.json"


def count_tokens(blocks: Iterable[Tensor], vocab_size: int) -> Tensor:
    """Occurrences of every id in [0, vocab_size) over token tensors of any shape -> int64 [V]."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for b in blocks:
        b = torch.as_tensor(b).reshape(-1).long()
        if b.numel() and (int(b.min()) < 0 or int(b.max()) >= vocab_size):
            raise ValueError(f"count_tokens: ids must be in [0, {vocab_size})")
        counts += torch.bincount(b, minlength=vocab_size)
    return counts


def top_tokens(counts: Tensor, size: int) -> Tensor:
    """The `size` most frequent ids (ties: the lower id), in increasing id order -> int64 [size]."""
    counts = torch.as_tensor(counts)
    if not 1 <= size <= counts.numel():
        raise ValueError(f"top_tokens: size must be in [1, {counts.numel()}], got {size}")
    order = torch.argsort(-counts.long(), stable=True)
    return order[:size].sort().values


def coverage(counts: Tensor, ids: Tensor) -> float:
    """Share of all counted occurrences that fall on `ids`."""
    counts = torch.as_tensor(counts).double()
    total = float(counts.sum())
    return float(counts[torch.as_tensor(ids)].sum()) / total if total else 0.0


def save_token_counts(folder: Union[str, os.PathLike], counts: Tensor, source: Optional[dict] = None) -> Path:
    """Write ``folder/token_counts.json``; returns its path."""
    path = Path(folder) / COUNTS_FILE
    data = {"vocab_size": int(counts.numel()), "counts": [int(c) for c in counts.tolist()], "source": source or {}}
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return path


def load_token_counts(folder: Union[str, os.PathLike]) -> Tuple[Tensor, dict]:
    """(counts int64 [V], source) from ``folder/token_counts.json``; ValueError when missing or malformed."""
    path = Path(folder) / COUNTS_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no token counts (write them with `taps train vocab`)")
    try:
        data = json.loads(path.read_text())
        counts = torch.tensor(data["counts"], dtype=torch.int64)
        if counts.dim() != 1 or counts.numel() != int(data["vocab_size"]) or bool((counts < 0).any()):
            raise ValueError("counts do not match vocab_size or are negative")
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: malformed token counts ({e})") from None
    return counts, data.get("source", {})


def draft_vocab(folder: Union[str, os.PathLike], size: int) -> Tensor:
    """The `size` most frequent target ids by ``folder/token_counts.json`` (for
    :meth:`taps.drafters.Drafter.set_draft_vocab`)."""
    counts, _ = load_token_counts(folder)
    return top_tokens(counts, size)
