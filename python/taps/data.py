"""Data files the runtime reads: the evaluation prompts (MT-Bench first turns, GSM8K test, MATH-500, SVAMP,
in the repo's ``data/`` with their licenses), the GSM8K / MATH record formats, and the record checks every
loader shares (:mod:`taps.train.data` builds the training collections on them).

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
from typing import Callable, Iterator, List, Optional, Tuple

from .chat import ChatFormatError, validate_messages

REPO_ROOT = Path(__file__).resolve().parents[2]


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
