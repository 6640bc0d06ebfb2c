"""What ``taps serve`` serves and its limits: command-line flags and an optional JSON or TOML file.

A config file holds the same settings as the flags (flags win over the file; relative paths are read
from the file's folder)::

    target = "/models/Llama-3.1-8B-Instruct"     # omitted: the shipped target (models/target)
    dtype = "bf16"                               # auto, fp32, bf16
    strategy = "merged-budget"                   # the default strategy of a request
    default_drafters = ["eagle", "lookup"]       # a request's drafters when it names none (default: all)
    budget = "auto"                              # nodes of one drafter's tree, or auto (taps.Tuner)
    tuner_dir = "tuners"                         # the tuners' state kept between runs (default: none)
    retire_after = "never"                       # steps a drafter the tuner never chooses stays (default 32)
    judge_window = 32                            # steps a window of the batch's judge (taps.judge), or "never"
    engine = "process"                           # where the decoding loop runs: process (default), thread
    depth = 5
    top_k = 8

    [drafters]                                   # name -> "KIND[:PATH]" or {kind, path, ...options}
    eagle = "eagle:/models/EAGLE3-LLaMA3.1-Instruct-8B"
    small = {kind = "model", path = "/models/Llama-3.2-1B-Instruct"}
    lookup = {kind = "lookup", max_ngram = 3}
    # recalled = {kind = "lookup", store = "greedy"}   # prompt lookup with a token store (models/stores/greedy)

    [limits]
    max_batch = 16                # requests decoded at once
    max_queue = 64                # requests waiting beyond those (429 past it)
    timeout = 600                 # seconds a request may take, queueing included
    default_max_tokens = 256      # a request's max_tokens when it gives none
    max_tokens = 1024             # the most a request may ask for (default: the model's context)

Drafter kinds: ``shipped`` (PATH is a shipped drafter, ``<family>-<data>`` such as ``hass-math``, for the
shipped target), ``eagle`` (an EAGLE-1/2, HASS or EAGLE-3 checkpoint folder:
``EagleDrafter.from_pretrained``), ``model`` (a small causal LM folder sharing the target's tokenizer:
``ModelDrafter``), ``lookup`` (``PromptLookupDrafter``, no path; options ``max_ngram``, ``min_ngram``,
``depth``, ``store`` (a token store it also proposes from: a name in models/stores such as ``greedy``, the shipped
target's, or a path to a store folder or .npz file; ``taps train store``) and ``store_ngram``), ``table`` (PATH is an
n-gram table of the target's distributions, a .npz file or a folder holding table.npz, ``taps train table``:
``NgramTableDrafter``, drawn drafts where a request samples; option ``min_count``). Without drafters named, the
shipped target gets ``math`` (``shipped:hass-math``), ``chat`` (``shipped:hass-chat``), ``lookup`` and ``table``
(the shipped n-gram table, models/tables/sampled), and a request that names none drafts with ``table`` alone
(unless ``default_drafters`` says otherwise); another target gets ``lookup``.

Every value is checked here, before a model loads: a bad one raises ValueError with one line naming
the flag or the file's key.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

__all__ = ["DrafterSpec", "ServeConfig", "DRAFTER_KINDS", "add_serve_arguments", "config_from_args",
           "parse_drafter", "load_config_file", "strategy_problem",
           "SERVE_DESCRIPTION", "SERVE_EPILOG"]

#: drafter kinds and whether they take a path
DRAFTER_KINDS = {"shipped": True, "eagle": True, "model": True, "lookup": False, "table": True}
#: options a drafter kind takes beyond its path
_KIND_OPTIONS = {"shipped": {"draft_vocab"}, "eagle": set(), "model": set(),
                 "lookup": {"max_ngram", "min_ngram", "depth", "store", "store_ngram"}, "table": {"min_count"}}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TOP_KEYS = {"target", "dtype", "device", "model_name", "host", "port", "strategy", "default_drafters", "depth",
             "top_k", "budget", "threads", "draft_vocab", "drafters", "limits", "log_level", "tuner_dir",
             "retire_after", "judge_window", "engine"}
_LIMIT_KEYS = {"max_batch", "max_queue", "timeout", "default_max_tokens", "max_tokens"}
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
#: where the decoding loop runs (ServeConfig.engine; "auto" besides)
ENGINES = ("process", "thread")


@dataclass
class DrafterSpec:
    """One drafter the server loads: its kind, path (None for ``lookup``) and options."""

    kind: str
    path: Optional[str] = None
    options: Dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        return self.kind + (f":{self.path}" if self.path else "")


@dataclass
class ServeConfig:
    """Everything ``taps serve`` needs, checked (see the module docstring for each setting)."""

    target: Optional[str] = None
    dtype: str = "auto"
    device: str = "auto"
    model_name: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8000
    #: None: the defaults for the target (see the module docstring)
    drafters: Optional[Dict[str, DrafterSpec]] = None
    strategy: str = "merged-budget"
    default_drafters: Optional[List[str]] = None
    depth: Optional[int] = None
    top_k: Optional[int] = None
    budget: Union[int, str, None] = "auto"
    threads: int = 0
    draft_vocab: int = 1024
    max_batch: int = 16
    max_queue: int = 64
    timeout: float = 600.0
    default_max_tokens: int = 256
    max_tokens: Optional[int] = None
    log_level: str = "info"
    #: a folder where each decoder's tuner keeps its state between runs (None: none kept)
    tuner_dir: Optional[str] = None
    #: SpeculativeDecoder.retire_after of the tuned decoders: steps (taps.decoder.RETIRE_AFTER), or "never"
    retire_after: Union[int, str] = 32
    #: the tuned batches' taps.judge.WindowJudge: steps a window, or "never" (every step the tuner's)
    judge_window: Union[int, str] = 32
    #: where the decoding loop runs: "process" (a child process that loads its own copy of the models:
    #: the event loop's HTTP work no longer holds up its steps), "thread" (a thread of the server's
    #: process), "auto" (process when the server loads the models from this config, thread when a caller
    #: passes loaded ones)
    engine: str = "auto"

    def __post_init__(self):
        if self.drafters is None:
            self.drafters = default_drafters(self.shipped_target)

    @property
    def shipped_target(self) -> bool:
        return self.target is None

    @property
    def retire_steps(self) -> Optional[int]:
        """:attr:`retire_after` as ``SpeculativeDecoder.retire_after`` takes it (None for "never")."""
        return None if self.retire_after == "never" else int(self.retire_after)

    @property
    def judge(self):
        """``ContinuousBatch(judge=)`` of a tuned batch: a new :class:`taps.judge.WindowJudge` of
        :attr:`judge_window` steps ("auto" for the default one), or None for "never"."""
        if self.judge_window == "never":
            return None
        from ..judge import WindowJudge

        return WindowJudge(window=int(self.judge_window))

    def check(self) -> "ServeConfig":
        """ValueError unless the drafters, the default drafters and the strategy go together."""
        if not self.shipped_target:
            shipped = [n for n, s in self.drafters.items() if s.kind == "shipped"]
            if shipped:
                raise ValueError(f"drafter {shipped[0]}: shipped drafters are trained for the shipped target only, "
                                 f"not {self.target}")
        if self.default_drafters is not None:
            unknown = [n for n in self.default_drafters if n not in self.drafters]
            if unknown:
                raise ValueError(f"default drafters: unknown drafter {unknown[0]!r}; the server's drafters: "
                                 f"{', '.join(self.drafters) or 'none'}")
            if len(set(self.default_drafters)) != len(self.default_drafters):
                raise ValueError("default drafters: a drafter is named twice")
        problem = strategy_problem(self.strategy, self.request_drafters())
        if problem:
            raise ValueError(f"strategy: {problem}" + ("; set --default-drafters" if "drafter" in problem else ""))
        return self

    def drafter_names(self) -> List[str]:
        return list(self.drafters)

    def request_drafters(self) -> List[str]:
        """A request's drafters when it names none: :attr:`default_drafters`; unset, every drafter, except on a
        server of the shipped target's default drafters (:data:`SHIPPED_REQUEST_DRAFTERS`: the n-gram table)."""
        if self.default_drafters is not None:
            return list(self.default_drafters)
        if self.shipped_target and self.drafters == default_drafters(True) and \
                set(SHIPPED_REQUEST_DRAFTERS) <= set(self.drafters):
            return list(SHIPPED_REQUEST_DRAFTERS)
        return list(self.drafters)


def strategy_problem(strategy: Any, drafters: List[str]) -> Optional[str]:
    """Why `strategy` cannot decode with `drafters` (names), or None when it can (``autoregressive``
    ignores them). A strategy that replaces its drafters (checkpoint averaging) is checked on their count
    only here; the decoder checks the rest when it is made."""
    from ..strategies import Strategy, make_strategy, strategy_class

    if not isinstance(strategy, str):
        return f"a strategy is a name, got {strategy!r}"
    try:
        cls = strategy_class(strategy)
        count = 0 if cls.max_drafters == 0 else len(drafters)
        if cls.prepare_drafters.__func__ is Strategy.prepare_drafters.__func__:
            make_strategy(strategy, count, 16)
        elif not cls.min_drafters <= count <= cls.max_drafters:
            return f"strategy {strategy!r} takes {cls.min_drafters} to {cls.max_drafters} drafters, got {count}"
    except ValueError as e:
        return str(e).replace("pass drafters=[]", "name none").replace(
            " (got an empty list); use strategy='autoregressive' for plain decoding", ", got none")
    return None


def default_drafters(shipped_target: bool) -> Dict[str, DrafterSpec]:
    """The drafters a server has when none are named: for the shipped target its two HASS heads, prompt lookup
    and the shipped n-gram table (``models/tables/sampled``, where it is); for another target prompt lookup."""
    if shipped_target:
        out = {"math": DrafterSpec("shipped", "hass-math"), "chat": DrafterSpec("shipped", "hass-chat"),
               "lookup": DrafterSpec("lookup")}
        table = _shipped_table()
        if table is not None:
            out["table"] = DrafterSpec("table", table)
        return out
    return {"lookup": DrafterSpec("lookup")}


def _shipped_table() -> Optional[str]:
    from ..models import models_dir

    folder = models_dir() / "tables" / "sampled"
    return str(folder / "table.npz") if (folder / "table.npz").is_file() else None


#: a request's drafters, when it names none, on a server of the shipped target's default drafters: the n-gram table
#: alone. Measured (AMX Xeon, bf16, 1 thread, ``bench/bench_serve.py`` and ``bench/bench_batching.py``: 64 chat
#: requests, 8 at a time): the heads and prompt lookup merged served at 0.88x the autoregressive server at mixed
#: temperatures (their upkeep per request; the tuner chose plain steps) and 0.98x greedy, the table at 0.99-1.00x
#: and 1.07x (bench/RESULTS.md).
SHIPPED_REQUEST_DRAFTERS = ["table"]


# ---------------------------------------------------------------------------------------------------
# values

def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name == "auto":
        raise ValueError(f"{where}: drafter name {name!r} must be letters, digits, '_', '.' or '-' (not 'auto')")
    return name


def _check_int(value: Any, where: str, low: int, high: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{where} must be an integer {bound}, got {value!r}")
    return value


def _check_number(value: Any, where: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            (positive and value <= 0):
        raise ValueError(f"{where} must be a number > 0, got {value!r}")
    return float(value)


def _check_folder(path: str, where: str) -> str:
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{where}: {path} is not a model folder (no config.json there)")
    return str(folder)


def data_file(path: Path, name: str) -> Path:
    """A token store's or n-gram table's file: `path` itself when it names a .npz file, else `name` in that folder."""
    return path if path.suffix == ".npz" else path / name


def _check_table(path: str, where: str) -> str:
    """A table drafter's path: a .npz file, or a folder holding table.npz (`taps train table`); the file's path."""
    file = data_file(Path(path), "table.npz")
    if not file.is_file():
        raise ValueError(f"{where}: no n-gram table at {path} (a .npz file, or a folder with table.npz; "
                         "`taps train table` builds one)")
    return str(file)


def store_path(value: str) -> Optional[Path]:
    """A lookup drafter's ``store`` value as a path (a .npz file, or a store folder named with a folder or as an
    absolute path), or None for the name of a store in models/stores."""
    path = Path(value)
    return path if path.suffix == ".npz" or len(path.parts) > 1 or path.is_absolute() else None


def _check_store(value: Any, where: str, base: Optional[Path] = None) -> str:
    """A lookup drafter's token store: a store folder (store.npz and its manifest, `taps train store`) or a
    .npz file, by path (relative to the config file's folder), or the name of one in models/stores."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a store's name (models/stores/NAME) or path, got {value!r}")
    path = store_path(value)
    if path is not None:
        if base is not None and not path.is_absolute():
            path = base / path
        if not data_file(path, "store.npz").is_file():
            raise ValueError(f"{where}: no token store at {path} (a folder with store.npz, or a .npz file; "
                             "`taps train store` builds one)")
        return str(path)
    from ..models import models_dir

    if not _NAME.match(value) or not (models_dir() / "stores" / value / "store.npz").is_file():
        raise ValueError(f"{where}: no token store named {value!r} in {models_dir() / 'stores'} "
                         "(`taps train store --out` builds one)")
    return value


def parse_drafter(text: str, where: str = "--drafter") -> "tuple[str, DrafterSpec]":
    """``NAME=KIND[:PATH]`` -> (name, spec); ValueError naming `where` on a bad one."""
    name, eq, rest = text.partition("=")
    if not eq:
        raise ValueError(f"{where}: expected NAME=KIND[:PATH] (kinds: {', '.join(DRAFTER_KINDS)}), got {text!r}")
    return _check_name(name.strip(), where), _spec_from_string(rest.strip(), f"{where} {name.strip()}")


def _spec_from_string(text: str, where: str, base: Optional[Path] = None) -> DrafterSpec:
    kind, _, path = text.partition(":")
    return _spec_from_dict({"kind": kind, **({"path": path} if path else {})}, where, base)


def _spec_from_dict(raw: Any, where: str, base: Optional[Path] = None) -> DrafterSpec:
    if isinstance(raw, str):
        return _spec_from_string(raw, where, base)
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected \"KIND[:PATH]\" or a table with kind and path, got {raw!r}")
    raw = dict(raw)
    kind = raw.pop("kind", None)
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"{where}: unknown drafter kind {kind!r}; choose from {', '.join(DRAFTER_KINDS)}")
    path = raw.pop("path", None)
    if DRAFTER_KINDS[kind]:
        if not isinstance(path, str) or not path:
            raise ValueError(f"{where}: a {kind} drafter needs a path ({kind}:PATH)")
        if kind == "shipped":
            from ..models import DATA_NAMES, FAMILIES

            family, _, data = path.partition("-")
            if family not in FAMILIES or data not in DATA_NAMES:
                raise ValueError(f"{where}: shipped drafter {path!r} must be <family>-<data> with family one of "
                                 f"{', '.join(FAMILIES)} and data one of {', '.join(DATA_NAMES)}")
        else:
            if base is not None:
                path = str(base / path)
            path = _check_table(path, where) if kind == "table" else _check_folder(path, where)
    elif path is not None:
        raise ValueError(f"{where}: a {kind} drafter takes no path")
    unknown = set(raw) - _KIND_OPTIONS[kind]
    if unknown:
        allowed = ", ".join(sorted(_KIND_OPTIONS[kind])) or "none"
        raise ValueError(f"{where}: unknown option(s) {', '.join(sorted(unknown))} for a {kind} drafter "
                         f"(options: {allowed})")
    for key, value in raw.items():
        if key == "store":
            raw[key] = _check_store(value, f"{where} store", base)
        else:
            _check_int(value, f"{where} {key}", 0 if key == "draft_vocab" else 1)
    if kind == "lookup" and raw.get("min_ngram", 1) > raw.get("max_ngram", max(3, raw.get("min_ngram", 1))):
        # (an unset min_ngram is min(2, max_ngram): PromptLookupDrafter's default)
        raise ValueError(f"{where}: min_ngram must be <= max_ngram")
    return DrafterSpec(kind, path, raw)


def load_config_file(path: str) -> Dict[str, Any]:
    """The settings of a JSON (``.json``) or TOML (any other name) config file, with its keys checked
    (values are checked by :func:`config_from_args`); ValueError on an unreadable or malformed file."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as e:
        raise ValueError(f"--config: cannot read {path} ({e.strerror or e})") from None
    if file.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config: {path} is not valid JSON ({e})") from None
    else:
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise ValueError(f"--config: reading TOML ({path}) needs Python 3.11 or the tomli package; "
                                 "or give a .json file") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config: {path} is not valid TOML ({e})") from None
    limits = data.get("limits", {}) if isinstance(data, dict) else None
    for table, keys, what in ((data, _TOP_KEYS, "settings"), (limits, _LIMIT_KEYS, "limits")):
        if not isinstance(table, dict):
            raise ValueError(f"--config: {path}: {what} must be a table (a JSON object)")
        unknown = set(table) - keys
        if unknown:
            raise ValueError(f"--config: {path}: unknown {what} {', '.join(sorted(unknown))} (known {what}: "
                             f"{', '.join(sorted(keys))})")
    return data


# ---------------------------------------------------------------------------------------------------
# the command line

SERVE_DESCRIPTION = """\
Serve the shipped models (or any Hugging Face causal LM with EAGLE / small-LM drafters and prompt lookup)
over the OpenAI API: POST /v1/chat/completions and /v1/completions (streaming as server-sent events),
GET /v1/models, /health and /metrics (Prometheus). Requests join the running batch between decoding
steps. A request may choose its strategy and drafters with a "taps" extra field; every answer reports
tau, the drafters' shares of the accepted tokens and the draft shapes in a "taps" block."""

SERVE_EPILOG = """\
examples:
  taps serve                                      the shipped models on 127.0.0.1:8000
  taps serve --strategy merged --budget 16 --max-batch 8
  taps serve --target /models/Llama-3.1-8B-Instruct --dtype bf16 \\
             --drafter eagle=eagle:/models/EAGLE3-LLaMA3.1-Instruct-8B --drafter lookup=lookup
  taps serve --config serve.toml                  the same settings from a JSON or TOML file

  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d \\
    '{"model": "taps-mini", "messages": [{"role": "user", "content": "What is 17 * 23?"}],
      "max_tokens": 64, "temperature": 0, "taps": {"strategy": "merged-budget", "drafters": ["math", "lookup"]}}'

README.md, "Serving", describes the config file, the taps extra and the limits."""


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``taps serve``; each value checked as it is parsed (the file and the combination of
    values by :func:`config_from_args`, still before anything loads)."""
    from ..arguments import device_name, int_at_least, name_list, or_auto, or_never
    from ..models import DTYPES

    def drafter(text: str):
        try:
            return parse_drafter(text, "drafter")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    def positive_seconds(text: str) -> float:
        try:
            return _check_number(float(text), "a timeout")
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}") from None

    g = p.add_argument_group("model")
    g.add_argument("--config", metavar="FILE",
                   help="settings from a JSON (.json) or TOML file (the flags below override it); see "
                        "README.md, 'Serving'")
    g.add_argument("--target", metavar="PATH",
                   help="a Hugging Face causal LM folder (default: the shipped target, models/target)")
    g.add_argument("--model-name", metavar="NAME", help="the model id clients ask for (default: taps-mini for the shipped target, "
                                        "else the target folder's name)")
    g.add_argument("--dtype", choices=("auto",) + tuple(DTYPES),
                   help="weights and activations (default auto: bf16 on CUDA and on a CPU with native bf16, "
                        "else fp32)")
    g.add_argument("--device", type=device_name, help="auto (default: cuda when visible), cpu, cuda or cuda:N")
    g.add_argument("--drafter", type=drafter, action="append", metavar="NAME=KIND[:PATH]",
                   help="a drafter requests may name (repeat the flag); kinds: shipped:<family>-<data> (e.g. "
                        "shipped:hass-math), eagle:PATH (EAGLE / HASS / EAGLE-3 checkpoint), model:PATH (a small LM "
                        "sharing the tokenizer), lookup (prompt lookup), table:PATH (an n-gram table, taps train table). "
                        "Default: math, chat, lookup and table for the "
                        "shipped target, lookup for another")
    g.add_argument("--draft-vocab", type=int_at_least(0), metavar="N",
                   help="shipped drafters propose only the N most frequent tokens (default 1024; 0: all)")
    g = p.add_argument_group("decoding (a request may choose its own strategy and drafters)")
    g.add_argument("--strategy", metavar="NAME", help="default strategy (default merged-budget; any of taps' strategies)")
    g.add_argument("--default-drafters", type=name_list(), metavar="A,B",
                   help="drafters of a request that names none (default: all; the shipped target's default "
                        "drafters: table); 'none' for none")
    g.add_argument("--depth", type=int_at_least(1), metavar="N", help="tree depth (default: SpeculativeDecoder's for the device)")
    g.add_argument("--top-k", type=int_at_least(1), metavar="K", help="children per node (default: SpeculativeDecoder's)")
    g.add_argument("--budget", type=or_auto(int_at_least(2)), metavar="N|auto",
                   help="nodes of one drafter's tree, root included, or auto (default): taps.Tuner chooses "
                        "each step's drafters, depth and nodes, down to no draft, by measured costs")
    g.add_argument("--tuner-dir", metavar="DIR",
                   help="keep each decoder's tuner state (measured costs, acceptance, the window judge's verdicts) in DIR between runs: loaded "
                        "when the decoder is made (state measured on another model, CPU, dtype or thread count is "
                        "skipped), saved when the server stops; a restarted server does not learn again")
    g.add_argument("--retire-after", type=or_never(int_at_least(1)), metavar="N|never",
                   help="a drafter that runs a model and that the tuner has not chosen for N steps leaves the "
                        "running batch until it empties (default 32): its upkeep at every join, drop and plan "
                        "stops; 'never' keeps every drafter (a load whose mix of requests changes)")
    g.add_argument("--judge-window", type=or_never(int_at_least(1)), metavar="N|never",
                   help="a tuned batch's steps run in windows of N (default 32), each judged against plain "
                        "steps: where the tuner's windows gave fewer tokens a second, the next 1, 2, 4 ... 16 run "
                        "plain (taps.judge.WindowJudge); 'never': every step the tuner's")
    g = p.add_argument_group("server and limits")
    g.add_argument("--host", metavar="ADDRESS", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int_at_least(0, 65535), metavar="PORT", help="port (default 8000; 0: a free one)")
    g.add_argument("--max-batch", type=int_at_least(1), metavar="N", help="requests decoded at once (default 16)")
    g.add_argument("--max-queue", type=int_at_least(0), metavar="N",
                   help="requests waiting beyond those; more get 429 (default 64)")
    g.add_argument("--timeout", type=positive_seconds, metavar="SECONDS",
                   help="seconds a request may take, queueing included (default 600)")
    g.add_argument("--default-max-tokens", type=int_at_least(1), metavar="N",
                   help="max_tokens of a request that gives none (default 256)")
    g.add_argument("--max-tokens", type=int_at_least(1), metavar="N",
                   help="the most tokens a request may ask for (default: the model's context; 4096 where its "
                        "config states none)")
    g.add_argument("--threads", type=int_at_least(0), metavar="N", help="torch CPU threads (default 0: torch's default)")
    g.add_argument("--engine", choices=ENGINES, help="where the decoding loop runs: process (default: a process of its "
                                                     "own, which loads its own copy of the models, so that the HTTP "
                                                     "work does not hold up its steps) or thread (a thread of the "
                                                     "server's process: the models in memory once)")
    g.add_argument("--log-level", choices=LOG_LEVELS, help="uvicorn's log level (default info)")


_FLAT = ("target", "dtype", "device", "model_name", "host", "port", "strategy", "default_drafters", "depth", "top_k",
         "budget", "threads", "draft_vocab", "log_level", "tuner_dir", "retire_after", "judge_window", "engine")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The checked :class:`ServeConfig` of parsed ``taps serve`` options (their config file read and
    checked first, the flags over it); ValueError naming the flag or key on a bad value. Loads nothing
    but the config file."""
    from ..models import DTYPES

    file: Dict[str, Any] = {}
    base: Optional[Path] = None
    where = {}
    if getattr(args, "config", None):
        file = load_config_file(args.config)
        base = Path(args.config).resolve().parent
    settings: Dict[str, Any] = {}
    for keys, table, prefix in ((_FLAT, file, ""), (sorted(_LIMIT_KEYS), file.get("limits", {}), "limits.")):
        for key in keys:
            flag = getattr(args, key, None)
            if flag is not None:
                settings[key], where[key] = flag, "--" + key.replace("_", "-")
            elif key in table:
                settings[key], where[key] = table[key], f"{args.config}: {prefix}{key}"
    cfg = ServeConfig()

    def path_of(key: str) -> str:  # a path setting; a file's is relative to the file's folder
        value = settings[key]
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where[key]} must be a path, got {value!r}")
        return str(base / value) if base is not None and not where[key].startswith("--") else value

    if "target" in settings:
        cfg.target = _check_folder(path_of("target"), where["target"])
    if "dtype" in settings:
        if settings["dtype"] not in ("auto",) + tuple(DTYPES):
            raise ValueError(f"{where['dtype']} must be one of auto, {', '.join(DTYPES)}, got {settings['dtype']!r}")
        cfg.dtype = settings["dtype"]
    if "device" in settings:
        from ..arguments import device_name

        try:
            cfg.device = device_name(str(settings["device"]))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{where['device']}: {e}") from None
    for key in ("model_name", "host"):
        if key in settings:
            if not isinstance(settings[key], str) or not settings[key].strip():
                raise ValueError(f"{where[key]} must be a non-empty string, got {settings[key]!r}")
            setattr(cfg, key, settings[key])
    if "tuner_dir" in settings:
        folder = path_of("tuner_dir")
        if Path(folder).exists() and not Path(folder).is_dir():
            raise ValueError(f"{where['tuner_dir']}: {folder} is not a folder")
        cfg.tuner_dir = folder
    if "log_level" in settings:
        if settings["log_level"] not in LOG_LEVELS:
            raise ValueError(f"{where['log_level']} must be one of {', '.join(LOG_LEVELS)}")
        cfg.log_level = settings["log_level"]
    if "port" in settings:
        cfg.port = _check_int(settings["port"], where["port"], 0, 65535)
    for key, low in (("depth", 1), ("top_k", 1), ("threads", 0), ("draft_vocab", 0), ("max_batch", 1),
                     ("max_queue", 0), ("default_max_tokens", 1), ("max_tokens", 1)):
        if key in settings:
            setattr(cfg, key, _check_int(settings[key], where[key], low))
    if "timeout" in settings:
        cfg.timeout = _check_number(settings["timeout"], where["timeout"])
    if "retire_after" in settings:
        steps = settings["retire_after"]
        cfg.retire_after = steps if steps == "never" else _check_int(steps, where["retire_after"] + " (or 'never')", 1)
    if "judge_window" in settings:
        steps = settings["judge_window"]
        cfg.judge_window = steps if steps == "never" else _check_int(steps, where["judge_window"] + " (or 'never')", 1)
    if "engine" in settings:
        if settings["engine"] not in ENGINES + ("auto",):
            raise ValueError(f"{where['engine']} must be one of {', '.join(ENGINES + ('auto',))}, "
                             f"got {settings['engine']!r}")
        cfg.engine = settings["engine"]
    if "budget" in settings:
        budget = settings["budget"]
        cfg.budget = budget if budget == "auto" else _check_int(budget, where["budget"] + " (or 'auto')", 2)

    # drafters: the flags replace the file's; neither: the defaults for the target
    if getattr(args, "drafter", None):
        cfg.drafters = {}
        for name, spec in args.drafter:
            if name in cfg.drafters:
                raise ValueError(f"--drafter: {name} is named twice")
            cfg.drafters[name] = spec
    elif "drafters" in file:
        raw = file["drafters"]
        if not isinstance(raw, dict):
            raise ValueError(f"{args.config}: drafters must be a table of name -> \"KIND[:PATH]\" or {{kind, path}}")
        cfg.drafters = {_check_name(n, f"{args.config}: drafters"): _spec_from_dict(v, f"{args.config}: drafters.{n}",
                                                                                     base)
                        for n, v in raw.items()}
    else:
        cfg.drafters = default_drafters(cfg.shipped_target)
    if "default_drafters" in settings:
        names = settings["default_drafters"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{where['default_drafters']} must be a list of drafter names")
        cfg.default_drafters = [] if names == ["none"] else names
    if "strategy" in settings:
        if not isinstance(settings["strategy"], str):
            raise ValueError(f"{where['strategy']} must be a strategy name")
        cfg.strategy = settings["strategy"]
    return cfg.check()
