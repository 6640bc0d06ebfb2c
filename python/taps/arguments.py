"""Command-line values checked as they are parsed, so that a bad one fails before anything loads.

Every ``taps`` command parses with :class:`ArgumentParser`: a user error is one line on stderr,
``taps <command>: error: <what>``, and exit status 2, as argparse's own usage errors are, but without
the usage block (``--help`` shows it). The ``type=`` helpers below turn a bad value into such a line:

    p.add_argument("--limit", type=int_at_least(0))             # 0 and up
    p.add_argument("--benchmarks", type=name_list(EVAL_SETS))   # "gsm8k,svamp" -> ["gsm8k", "svamp"]

:func:`check_ranges` is the same check for the fields of a config dataclass (the training commands
build one from their options; a bad field raises ValueError, which the command line prints as one line).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["ArgumentParser", "int_at_least", "float_at_least", "float_list", "name_list", "device_name",
           "or_auto", "or_never", "check_ranges"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``<prog>: error: <message>`` on stderr and exit status 2. Sub-parsers
    made by ``add_subparsers().add_parser`` are of this class too (argparse uses the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help shows the usage)\n")


def user_error(prog: str, message: str) -> int:
    """Print ``<prog>: error: <message>`` on stderr (one line) and return exit status 2."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _bound(low, high) -> str:
    """[low, high] in words (high None: no upper bound)."""
    return f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"


def _outside(value, low, high) -> Optional[str]:
    """None when low <= value <= high (high None: no upper bound), else the bound in words."""
    return _bound(low, high) if value < low or (high is not None and value > high) else None


def _bounded(convert: Callable[[str], float], what: str, low, high) -> Callable[[str], float]:
    def parse(text: str):
        value = convert(text)
        bound = _outside(value, low, high)
        if bound:
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {text}")
        return value

    parse.__name__ = what.split()[-1]
    return parse


def int_at_least(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in [low, high] (no upper bound when high is None)."""
    return _bounded(_int, "an integer", low, high)


def float_at_least(low: float, high: Optional[float] = None) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in [low, high] (no upper bound when high is None)."""
    return _bounded(_float, "a number", low, high)


def _or_word(word: str, parse: Callable[[str], object]) -> Callable[[str], object]:
    def parse_or_word(text: str):
        return word if text == word else parse(text)

    parse_or_word.__name__ = getattr(parse, "__name__", "value")
    return parse_or_word


def or_auto(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse ``type``: ``auto``, or a value `parse` accepts (e.g. ``or_auto(int_at_least(2))`` for a
    node budget)."""
    return _or_word("auto", parse)


def or_never(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse ``type``: ``never``, or a value `parse` accepts (e.g. ``or_never(int_at_least(1))``)."""
    return _or_word("never", parse)


def float_list(low: float = -math.inf) -> Callable[[str], List[float]]:
    """An argparse ``type``: a non-empty comma list of finite numbers, each >= low."""
    def parse(text: str) -> List[float]:
        values = [_float(x.strip()) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}")
        bad = [v for v in values if v < low]
        if bad:
            raise argparse.ArgumentTypeError(f"every value must be >= {low:g}, got {bad[0]:g}")
        return values

    parse.__name__ = "numbers"
    return parse


def name_list(choices: Optional[Sequence[str]] = None) -> Callable[[str], List[str]]:
    """An argparse ``type``: a non-empty comma list of names, each one of `choices` (any name when None)."""
    def parse(text: str) -> List[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"expected a comma list of names, got {text!r}")
        bad = [n for n in names if choices is not None and n not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown name(s) {', '.join(bad)}; choose from {', '.join(choices)}")
        return names

    parse.__name__ = "names"
    return parse


def device_name(text: str) -> str:
    """An argparse ``type``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; a CUDA device must be usable."""
    if text == "auto":
        return text
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text}: no CUDA GPU is visible")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text}: only {count} CUDA device(s) are visible")
    return text


def resolve_device(name: str):
    """The torch device of a ``--device`` value (:func:`device_name`): ``auto`` is CUDA where a GPU is visible
    and taps_ops has its CUDA kernels, else the CPU."""
    import torch

    if name == "auto":
        import taps_ops

        name = "cuda" if torch.cuda.is_available() and taps_ops.has_cuda_kernels() else "cpu"
    return torch.device(name)


def check_ranges(obj, bounds: Dict[str, Tuple[float, Optional[float]]], optional: Sequence[str] = (),
                 positive: Sequence[str] = ()) -> None:
    """Raise ValueError naming the first field of `obj` outside its ``(low, high)`` bounds (high None: no
    upper bound) or, for the fields named in `positive`, not > 0; fields named in `optional` may also be
    None."""
    checks = [(name, low, high, False) for name, (low, high) in bounds.items()]
    checks += [(name, 0, None, True) for name in positive]
    for name, low, high, strict in checks:
        value = getattr(obj, name)
        if value is None and name in optional:
            continue
        if value is None or value != value or (strict and value == low) or _outside(value, low, high):
            bound = "> 0" if strict else _bound(low, high)
            raise ValueError(f"{name} (--{name.replace('_', '-')}) must be {bound}, got {value}")
