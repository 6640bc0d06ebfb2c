"""`taps eval`: acceptance length of every drafter and strategy on the evaluation prompts.

For each drafter family (``eagle2``, ``hass``, ``eagle3``), temperature, row and benchmark (MT-Bench, GSM8K,
MATH-500, SVAMP), the prompts are rendered with the chat template and decoded speculatively in batches.
The rows (the paper's tables, :data:`ROWS`):

- single drafters, strategy ``single``: ``math``, ``chat``, ``mixed``, ``mixed2`` and ``avg`` (the shipped
  weight-average checkpoint of the specialists);
- the two specialists together (drafter 0 = math, 1 = chat), each with the
  :class:`taps.SpeculativeDecoder` strategy of the same name: ``route-confidence``, ``route-entropy``,
  ``merged``, ``merged-budget``, ``adaptive``.

Rows whose drafters are absent are skipped with a note. Every row decodes the same batches with the same
seed per (benchmark, batch), so rows are comparable. Per cell (family x temperature x row x benchmark)
the results hold: ``tau`` (mean over prompts of tokens emitted per target verification forward),
``acceptance_rate_per_depth`` (pooled over the prompts), ``route_share`` (routing rows) and
``drafter_share`` (merged / adaptive rows) per specialist, ``nodes_per_step`` (the mean number of real
tree nodes the target verified per step, root included, measured) next to ``nodes_max`` (the configured
tree size: ``budget`` for single / route / merged-budget / adaptive, ``2 * (budget - 1) + 1`` for merged),
the wall time, and ``greedy_mismatches``: at temperature 0 every row is lossless greedy decoding of the
same target, so each prompt's output must equal the first evaluated row's token for token; the count of
prompts that differ is recorded (and a warning printed when it is not zero).

    results = evaluate(target, tok, {"eagle2": {"math": d_math, "chat": d_chat}}, ["gsm8k"],
                       ["math", "chat", "merged"], temperatures=[0.0], limit=10)
    print(format_tables(results))

:func:`run_eval` is the command: it loads the shipped models (:mod:`taps.models`), prints the tables
(:func:`format_tables`), writes the results as JSON and plots the acceptance rate per depth.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
import zlib
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .arguments import device_name, float_list, int_at_least, name_list, resolve_device
from .data import EVAL_SETS
from .models import DATA_NAMES, DTYPES, FAMILIES

__all__ = ["ROWS", "SINGLE_ROWS", "ROW_SPECS", "evaluate", "format_tables", "plot_acceptance", "merge_results",
           "add_eval_arguments", "run_eval", "main"]

#: row name -> (SpeculativeDecoder strategy, data names of its drafters in order)
ROW_SPECS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "math": ("single", ("math",)),
    "chat": ("single", ("chat",)),
    "mixed": ("single", ("mixed",)),
    "mixed2": ("single", ("mixed2",)),
    "avg": ("single", ("avg",)),
    "route-confidence": ("route-confidence", ("math", "chat")),
    "route-entropy": ("route-entropy", ("math", "chat")),
    "merged": ("merged", ("math", "chat")),
    "merged-budget": ("merged-budget", ("math", "chat")),
    "adaptive": ("adaptive", ("math", "chat")),
}
ROWS = tuple(ROW_SPECS)
SINGLE_ROWS = DATA_NAMES  # one drafter each, strategy single
ROUTING_ROWS = ("route-confidence", "route-entropy")
SHARE_ROWS = ("merged", "merged-budget", "adaptive")
DEFAULT_BENCHMARKS = EVAL_SETS
DEFAULT_FAMILIES = FAMILIES

NODES_NOTE = ("nodes_per_step: mean number of real tree nodes (root included) the target verified per "
              "decoding step, measured on the trees the strategy built; nodes_max: the configured tree size")


def temperature_key(t: float) -> str:
    """The JSON key of a temperature: ``"0"``, ``"1"``, ``"0.7"``."""
    return f"{float(t):g}"


def batch_seed(seed: int, benchmark: str, batch_index: int) -> int:
    """The acceptance-coin seed of one batch: a function of (seed, benchmark, batch) only, so every row
    and family decodes a batch with the same random source."""
    return (int(seed) * 1_000_003 + zlib.crc32(benchmark.encode()) * 7_919 + batch_index) % (2 ** 62)


# ------------------------------------------------------------------------------------------- evaluate

def _load_benchmarks(benchmarks, limit: Optional[int]) -> Dict[str, list]:
    """{name: [messages, ...]} from benchmark names (repo data/) or a mapping name -> Examples /
    message lists, each cut to `limit`."""
    if isinstance(benchmarks, Mapping):
        items = list(benchmarks.items())
    else:
        from .data import load_eval_prompts

        items = [(name, load_eval_prompts(name)) for name in benchmarks]
    out = {}
    for name, examples in items:
        examples = list(examples)[:limit] if limit is not None else list(examples)
        out[name] = [getattr(e, "messages", e) for e in examples]
    return out


def _plan(drafters: Mapping[str, Mapping[str, object]], families: Sequence[str], rows: Sequence[str],
          notes: List[str]) -> List[Tuple[str, str, str, list]]:
    """(family, row, strategy, [drafters]) of every row that can run; notes for the others."""
    plan = []
    for family in families:
        have = drafters.get(family) or {}
        if not have:
            notes.append(f"family {family}: no drafters; all its rows skipped")
            continue
        for row in rows:
            strategy, names = ROW_SPECS[row]
            missing = [n for n in names if n not in have]
            if missing:
                notes.append(f"{family}/{row}: skipped, missing drafter(s) "
                             + ", ".join(f"{family}-{n}" for n in missing))
                continue
            plan.append((family, row, strategy, [have[n] for n in names]))
    return plan


def _progress(total: int, enabled: bool):
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(total=total, unit="prompt", desc="taps eval", dynamic_ncols=True)
        except ImportError:
            pass
    return None


def _say(msg: str, bar, stream=None) -> None:
    stream = stream or sys.stdout
    if bar is not None:
        bar.write(msg, file=stream)
    else:
        print(msg, file=stream, flush=True)


def evaluate(target, tokenizer, drafters: Mapping[str, Mapping[str, object]],
             benchmarks: Union[Sequence[str], Mapping[str, Sequence]] = DEFAULT_BENCHMARKS,
             strategies: Sequence[str] = ROWS, temperatures: Sequence[float] = (0.0, 1.0),
             limit: Optional[int] = 20, max_new_tokens: int = 96, depth: int = 5, top_k: int = 8,
             budget: int = 32, seed: int = 0, batch_size: int = 4, progress: bool = True,
             families: Optional[Sequence[str]] = None) -> dict:
    """Decode every benchmark's prompts with every row of every drafter family and temperature.

    Args:
        target: the target causal LM (eval mode; its device is used).
        tokenizer: with ``encode_chat(messages, add_generation_prompt=True)`` and ``eos_id``
            (:class:`taps.chat.ChatTokenizer`).
        drafters: family -> data name -> drafter (e.g. ``{"eagle2": {"math": ..., "chat": ...}}``).
        benchmarks: names of evaluation sets (:data:`taps.data.EVAL_SETS`), or a mapping
            name -> examples (objects with ``.messages``, or message lists).
        strategies: row names (:data:`ROWS`); rows whose drafters are absent are skipped with a note.
        temperatures: target sampling temperatures (0 = greedy).
        limit: prompts per benchmark (None: all).
        max_new_tokens, depth, top_k, budget: decoding settings (budget: nodes of one drafter's tree,
            root included).
        seed: base seed of the acceptance coins (one seed per (benchmark, batch), see :func:`batch_seed`).
        batch_size: prompts per ``generate`` call.
        progress: a tqdm bar over all prompt generations.
        families: the order of families (default: the keys of `drafters`).
    Returns:
        ``{"config", "cells", "tables", "routing", "notes", "greedy_mismatches", "nodes_note"}``: cells is
        a list of dicts (see the module docstring); ``tables[family][temperature][row]`` maps each
        benchmark and ``"avg"`` to tau, ``"nodes"`` to the mean nodes per step and ``"tokens_per_s"`` to
        the decoding speed over its benchmarks;
        ``routing[family][temperature][row][benchmark]`` maps ``"math"`` / ``"chat"`` to the share of
        routed steps.
    """
    from .decoder import SpeculativeDecoder
    from .stats import summarize

    unknown = [r for r in strategies if r not in ROW_SPECS]
    if unknown:
        raise ValueError(f"unknown row(s) {unknown}; choose from {', '.join(ROWS)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    families = list(families) if families is not None else list(drafters)
    temperatures = [float(t) for t in temperatures]
    prompts_text = _load_benchmarks(benchmarks, limit)
    prompts = {name: [list(tokenizer.encode_chat(m, add_generation_prompt=True)) for m in msgs]
               for name, msgs in prompts_text.items()}
    bench_names = list(prompts)
    notes: List[str] = []
    plan = _plan(drafters, families, list(strategies), notes)
    for note in notes:
        print(f"note: {note}", flush=True)

    total = len(plan) * len(temperatures) * sum(len(p) for p in prompts.values())
    bar = _progress(total, progress)
    cells: List[dict] = []
    reference: Dict[Tuple[str, int], List[int]] = {}  # greedy output of the first row, per prompt
    reference_row: Optional[str] = None
    eos = getattr(tokenizer, "eos_id", None)
    started = time.perf_counter()
    try:
        for family, row, strategy, row_drafters in plan:
            decoder = SpeculativeDecoder(target, row_drafters, strategy=strategy, depth=depth, top_k=top_k,
                                         budget=budget, tokenizer=None)
            names = list(ROW_SPECS[row][1])
            for temperature in temperatures:
                for bench in bench_names:
                    rows = prompts[bench]
                    stats, outputs, nodes, steps, wall = [], [], 0, 0, 0.0
                    for i in range(0, len(rows), batch_size):
                        batch = rows[i:i + batch_size]
                        t0 = time.perf_counter()
                        out = decoder.generate(batch, max_new_tokens=max_new_tokens, temperature=temperature,
                                               eos_token_id=eos, seed=batch_seed(seed, bench, i // batch_size))
                        wall += time.perf_counter() - t0
                        nodes += sum(sum(st.tree_nodes) for st in out.stats)
                        steps += sum(len(st.tree_nodes) for st in out.stats)
                        stats.extend(out.stats)
                        outputs.extend(out.tokens)
                        if bar is not None:
                            bar.update(len(batch))
                    cell = _cell(family, row, strategy, names, temperature, bench, stats, summarize(stats),
                                 nodes, steps, decoder, wall)
                    if temperature == 0.0:
                        if reference_row is None:
                            reference_row = f"{family}/{row}"
                        bad = []
                        for p, toks in enumerate(outputs):
                            ref = reference.setdefault((bench, p), toks)
                            if toks != ref:
                                bad.append(p)
                        cell["greedy_mismatches"] = len(bad)
                        cell["greedy_mismatch_prompts"] = bad
                        if bad:
                            _say(f"WARNING: greedy outputs of {family}/{row} on {bench} differ from "
                                 f"{reference_row}'s for {len(bad)} of {len(outputs)} prompts (indices {bad}); "
                                 "lossless decoding must give identical tokens", bar, sys.stderr)
                    cells.append(cell)
    finally:
        if bar is not None:
            bar.close()

    results = {
        "config": dict(benchmarks=bench_names, families=families, rows=list(strategies),
                       temperatures=temperatures, limit=limit, max_new_tokens=max_new_tokens, depth=depth,
                       top_k=top_k, budget=budget, seed=seed, batch_size=batch_size,
                       prompts={b: len(p) for b, p in prompts.items()},
                       device=str(next(target.parameters()).device),
                       dtype=str(next(target.parameters()).dtype).replace("torch.", ""),
                       greedy_reference_row=reference_row),
        "nodes_measured": True,
        "nodes_note": NODES_NOTE,
        "notes": notes,
        "cells": cells,
        "wall_s": round(time.perf_counter() - started, 3),
    }
    results["tables"], results["routing"] = _tables(cells)
    results["greedy_mismatches"] = sum(c.get("greedy_mismatches") or 0 for c in cells)
    if results["greedy_mismatches"]:
        print(f"\n!!! WARNING: {results['greedy_mismatches']} greedy output(s) differ between rows at "
              "temperature 0: speculative decoding should be lossless; see greedy_mismatch_prompts in the "
              "cells !!!\n", file=sys.stderr, flush=True)
    return results


def _cell(family, row, strategy, names, temperature, bench, stats, summary, nodes, steps, decoder, wall) -> dict:
    active = [s.tau for s in stats if s.target_forwards > 0]
    cell = dict(
        family=family, temperature=temperature, row=row, strategy=strategy,
        drafters=[f"{family}-{n}" for n in names], benchmark=bench, prompts=len(stats),
        # mean over the prompts that took at least one verification step (a prompt answered by the
        # prefill's token alone has no tau)
        tau=sum(active) / len(active) if active else float("nan"),
        # per prompt (NaN: no verification step) and the standard error of the mean over the prompts
        tau_per_prompt=[s.tau if s.target_forwards > 0 else float("nan") for s in stats],
        tau_se=(_std(active) / math.sqrt(len(active))) if len(active) > 1 else float("nan"),
        acceptance_rate_per_depth=summary.get("acceptance_rate_per_depth", []),
        # steps whose accepted length reached d = 0 .. depth (the denominators of the rates above)
        steps_reaching_depth=[sum(s.depth_reached[d] for s in stats if d < len(s.depth_reached))
                              for d in range(decoder.depth + 1)],
        new_tokens=summary.get("new_tokens", 0), target_forwards=summary.get("target_forwards", 0),
        nodes_per_step=nodes / steps if steps else float("nan"),
        nodes_max=int(decoder.strategy.num_nodes), budget=int(decoder.budget),
        wall_s=round(wall, 4), tokens_per_s=round(summary.get("new_tokens", 0) / wall, 2) if wall > 0 else float("nan"),
        greedy_mismatches=None,
    )
    if row in ROUTING_ROWS:
        share = summary.get("route_share") or [0.0] * len(names)
        cell["route_share"] = {n: share[i] if i < len(share) else 0.0 for i, n in enumerate(names)}
    if row in SHARE_ROWS:
        share = summary.get("drafter_share") or [0.0] * len(names)
        cell["drafter_share"] = {n: share[i] if i < len(share) else 0.0 for i, n in enumerate(names)}
    return cell


def _std(xs: Sequence[float]) -> float:
    """Sample standard deviation."""
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]  # drop NaN
    return sum(xs) / len(xs) if xs else float("nan")


def _tables(cells: Sequence[dict]) -> Tuple[dict, dict]:
    tables: dict = {}
    routing: dict = {}
    for c in cells:
        t = temperature_key(c["temperature"])
        entry = tables.setdefault(c["family"], {}).setdefault(t, {}).setdefault(c["row"], {})
        entry[c["benchmark"]] = c["tau"]
        entry.setdefault("_nodes", []).append(c["nodes_per_step"])
        entry.setdefault("_speed", []).append((c.get("new_tokens", 0), c.get("wall_s", 0.0)))
        if "route_share" in c:
            routing.setdefault(c["family"], {}).setdefault(t, {}).setdefault(c["row"], {})[c["benchmark"]] = \
                dict(c["route_share"])
    for fam in tables.values():
        for rows in fam.values():
            for entry in rows.values():
                nodes = entry.pop("_nodes")
                speed = entry.pop("_speed")
                entry["avg"] = _mean([v for v in entry.values()])
                entry["nodes"] = _mean(nodes)
                wall = sum(w for _, w in speed)
                entry["tokens_per_s"] = sum(n for n, _ in speed) / wall if wall > 0 else float("nan")
    return tables, routing


# --------------------------------------------------------------------------------------------- output

def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_tables(results: dict) -> str:
    """The results as text: per family and temperature, tau per row (rows) and benchmark (columns, plus
    their mean ``avg``; the best value of each tau column marked ``*``) and the mean tree nodes verified
    per step and the decoding speed (new tokens per second of wall time over all its benchmarks); then, for
    the routing rows, the share of steps routed to each specialist."""
    lines: List[str] = []
    order = list(results.get("config", {}).get("rows") or ROWS)
    for family, temps in results.get("tables", {}).items():
        for temp, rows in temps.items():
            names = [r for r in order if r in rows] + [r for r in rows if r not in order]
            benches = [b for b in results["config"]["benchmarks"] if any(b in rows[r] for r in names)]
            cols = benches + ["avg"]
            best = {c: max((rows[r].get(c, float("nan")) for r in names), key=lambda v: -1e300 if v != v else v)
                    for c in cols}
            lines.append(f"{family}, temperature {temp}: tau (tokens per target forward; * = best per column)")
            width = max([len("row")] + [len(r) for r in names])
            head = f"  {'row':<{width}}" + "".join(f"{c:>10}" for c in cols) + f"{'nodes':>8}{'tok/s':>8}"
            lines.append(head)
            lines.append("  " + "-" * (len(head) - 2))
            for r in names:
                cells = []
                for c in cols:
                    v = rows[r].get(c, float("nan"))
                    mark = "*" if v == v and v == best[c] else " "
                    cells.append(f"{_fmt(v) + mark:>10}")
                lines.append(f"  {r:<{width}}" + "".join(cells) + f"{_fmt(rows[r].get('nodes'), 1):>8}"
                             f"{_fmt(rows[r].get('tokens_per_s'), 0):>8}")
            lines.append("")
            routing = results.get("routing", {}).get(family, {}).get(temp, {})
            if routing:
                lines.append(f"{family}, temperature {temp}: share of steps routed to math / chat")
                rw = max(len(r) for r in routing)
                lines.append(f"  {'row':<{rw}}" + "".join(f"{b:>16}" for b in benches))
                for r in [x for x in order if x in routing]:
                    parts = []
                    for b in benches:
                        s = routing[r].get(b)
                        parts.append(f"{'-':>16}" if s is None else
                                     f"{_fmt(s.get('math', 0.0)) + ' / ' + _fmt(s.get('chat', 0.0)):>16}")
                    lines.append(f"  {r:<{rw}}" + "".join(parts))
                lines.append("")
    if results.get("notes"):
        lines.append("skipped: " + "; ".join(results["notes"]))
    nodes_note = results.get("nodes_note")
    if nodes_note and results.get("tables"):
        lines.append(nodes_note.split(";")[0] + ".")
    if results.get("greedy_mismatches"):
        lines.append(f"WARNING: {results['greedy_mismatches']} greedy output(s) differ between rows at temperature 0")
    return "\n".join(lines).rstrip() + "\n"


def plot_acceptance(results: dict, path: Union[str, Path], min_steps: int = 20) -> Optional[Path]:
    """Plot the acceptance rate per depth of the single-drafter rows: one subplot per benchmark, one row
    of subplots per family, temperature 0 when evaluated (else the first one). A point is drawn only
    when at least `min_steps` steps reached the depth before it. Returns the path, or None (with a
    message) when matplotlib is missing or there is nothing to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)", flush=True)
        return None
    temps = [float(t) for t in results["config"]["temperatures"]]
    if not temps:
        return None
    temp = 0.0 if 0.0 in temps else temps[0]
    cells = [c for c in results["cells"] if c["row"] in SINGLE_ROWS and c["temperature"] == temp]
    if not cells:
        print("plot skipped: no single-drafter rows were evaluated", flush=True)
        return None
    families = [f for f in results["config"]["families"] if any(c["family"] == f for c in cells)]
    benches = [b for b in results["config"]["benchmarks"] if any(c["benchmark"] == b for c in cells)]
    fig, axes = plt.subplots(len(families), len(benches), squeeze=False, sharey=True,
                             figsize=(3.2 * len(benches) + 1, 2.8 * len(families) + 0.6))
    for i, family in enumerate(families):
        for j, bench in enumerate(benches):
            ax = axes[i][j]
            for row in SINGLE_ROWS:
                c = next((c for c in cells if c["family"] == family and c["benchmark"] == bench
                          and c["row"] == row), None)
                if c is None or not c["acceptance_rate_per_depth"]:
                    continue
                rates = c["acceptance_rate_per_depth"]
                reach = c.get("steps_reaching_depth") or []
                # rate at depth d is over the steps that reached d - 1; drop estimates from few steps
                pts = [(d, r) for d, r in enumerate(rates, 1) if d - 1 >= len(reach) or reach[d - 1] >= min_steps]
                if pts:
                    ax.plot([d for d, _ in pts], [r for _, r in pts], marker="o", label=row)
            ax.set_xticks(range(1, int(results["config"]["depth"]) + 1))
            ax.set_title(f"{family} / {bench}", fontsize=9)
            ax.set_xlabel("depth")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("acceptance rate")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for row in axes:
        for ax in row:
            h, lab = ax.get_legend_handles_labels()
            if len(lab) > len(labels):
                handles, labels = h, lab
    if handles:
        fig.legend(handles, labels, loc="upper right", fontsize=8)
    fig.suptitle(f"acceptance rate at depth d given depth d-1 accepted (temperature {temperature_key(temp)}; "
                 f"points from >= {min_steps} steps)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.92, 0.95))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------- command

def _csv(text: str) -> List[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _names(value) -> List[str]:
    """A comma list given as text (a Namespace built by hand) or already split (:func:`add_eval_arguments`)."""
    return _csv(value) if isinstance(value, str) else list(value)


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `taps eval`."""
    p.add_argument("--models", default=None,
                   help="models folder with target/ and drafters/ (default: the repo's models/ or $TAPS_MODELS_DIR)")
    p.add_argument("--benchmarks", default=list(DEFAULT_BENCHMARKS), type=name_list(EVAL_SETS),
                   help="comma list of evaluation sets: " + ", ".join(EVAL_SETS) + " (default all)")
    p.add_argument("--families", default=list(DEFAULT_FAMILIES), type=name_list(),
                   help="comma list of drafter families (default " + ",".join(DEFAULT_FAMILIES) + ")")
    p.add_argument("--strategies", default=list(ROWS), type=name_list(ROWS),
                   help="comma list of rows: " + ", ".join(ROWS) + " (default all)")
    p.add_argument("--temperatures", default=[0.0, 1.0], type=float_list(0.0),
                   help="comma list of sampling temperatures (0 = greedy; default 0,1)")
    p.add_argument("--limit", type=int_at_least(0), default=20, help="prompts per benchmark (0: all)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=96)
    p.add_argument("--depth", type=int_at_least(1), default=5, help="draft tree depth")
    p.add_argument("--top-k", type=int_at_least(1), default=8, help="children per expanded node")
    p.add_argument("--budget", type=int_at_least(2), default=32, help="nodes of one drafter's tree, root included")
    p.add_argument("--batch-size", type=int_at_least(1), default=4, help="prompts per generate call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/eval/results.json", help="results JSON")
    p.add_argument("--plot", default="runs/eval/depth.png", help="acceptance-per-depth PNG ('' to skip)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int_at_least(0), default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--device", default="auto", type=device_name,
                   help="auto | cpu | cuda | cuda:N (auto: cuda when usable)")
    p.add_argument("--dtype", default="auto", choices=("auto",) + tuple(DTYPES),
                   help="the models' dtype (auto: bf16 on CUDA and on CPUs with native bf16, AVX512-BF16 or AMX; "
                        "else fp32)")
    p.add_argument("--no-verify", action="store_true", help="skip the manifest sha256 checks")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="evaluate nothing: combine results files of earlier runs (e.g. one per family, run in "
                        "parallel with --threads 1; a later file's cells replace the same cells of an earlier "
                        "one) into --out, print the tables and plot")


def _finite(obj):
    """NaN / infinity -> None, recursively (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _jsonable(v):
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)


def merge_results(parts: Sequence[dict]) -> dict:
    """One results dict from several (e.g. one per family run in parallel): cells and notes
    concatenated (a later part's cell replaces an earlier one of the same family, temperature, row and
    benchmark: a rerun of some rows), tables and routing recomputed; the config is the first part's, with every part's
    families and commands."""
    if not parts:
        raise ValueError("merge_results: nothing to merge")
    keyed: Dict[tuple, dict] = {}
    for p in parts:  # a later part's cell replaces an earlier one of the same family/temperature/row/benchmark
        for c in p["cells"]:
            keyed[(c["family"], float(c["temperature"]), c["row"], c["benchmark"])] = c
    cells = list(keyed.values())
    for c in cells:  # JSON null -> NaN, as evaluate() holds them
        for k in ("tau", "nodes_per_step"):
            if c.get(k) is None:
                c[k] = float("nan")
    config = dict(parts[0]["config"])
    config["families"] = list(dict.fromkeys(f for p in parts for f in p["config"].get("families", [])))
    config["commands"] = [p["config"].get("command") for p in parts]
    config.pop("command", None)
    out = {"config": config, "nodes_measured": all(p.get("nodes_measured") for p in parts),
           "nodes_note": parts[0].get("nodes_note", NODES_NOTE),
           "notes": [n for p in parts for n in p.get("notes", [])], "cells": cells,
           "wall_s": sum(p.get("wall_s") or 0 for p in parts)}
    out["tables"], out["routing"] = _tables(cells)
    out["greedy_mismatches"] = sum(c.get("greedy_mismatches") or 0 for c in cells)
    return out


def _write_outputs(results: dict, args) -> None:
    print(format_tables(results), end="", flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_finite(results), indent=1, allow_nan=False) + "\n")
        print(f"results: {out}")
    if args.plot:
        png = plot_acceptance(results, args.plot)
        if png is not None:
            print(f"plot: {png}")


def run_eval(args: argparse.Namespace) -> dict:
    """`taps eval`: load the models, :func:`evaluate`, print :func:`format_tables`, write the JSON
    (``args.out``) and the plot (``args.plot``). Returns the results dict."""
    from . import models as M
    if getattr(args, "merge", None):
        results = merge_results([json.loads(Path(f).read_text()) for f in args.merge])
        _write_outputs(results, args)
        return results
    benches, rows, families = _names(args.benchmarks), _names(args.strategies), _names(args.families)
    temperatures = [float(t) for t in (_csv(args.temperatures) if isinstance(args.temperatures, str)
                                       else args.temperatures)]
    bad = [b for b in benches if b not in EVAL_SETS] + [r for r in rows if r not in ROW_SPECS]
    if bad or not benches or not rows or not families or not temperatures or any(t < 0 for t in temperatures):
        raise ValueError(f"bad --benchmarks, --strategies, --families or --temperatures (unknown: {bad or 'none'})")
    root = Path(args.models) if args.models else M.models_dir()
    have = M.available_drafters(root / "drafters")
    unknown = [f for f in families if f not in M.FAMILIES and f not in have]
    if unknown or not any(f in have for f in families):
        raise ValueError(f"no drafters of family {', '.join(unknown or families)} in {root / 'drafters'} "
                         f"(known families: {', '.join(M.FAMILIES)}; present: {', '.join(have) or 'none'})")
    import taps_ops

    device = resolve_device(args.device)
    dtype = M.resolve_dtype(getattr(args, "dtype", "fp32"), device)
    if args.threads:
        torch.set_num_threads(args.threads)
    verify = not args.no_verify
    target, tok = M.load_target(root / "target", dtype=dtype, verify=verify)
    target.to(device)
    needed = sorted({n for r in rows for n in ROW_SPECS[r][1]})
    drafters: Dict[str, Dict[str, object]] = {}
    for family in families:
        for name in needed:
            if name in have.get(family, []):
                drafters.setdefault(family, {})[name] = M.load_drafter(family, name, target, root / "drafters",
                                                                       verify=verify)
    cpu = taps_ops.cpu_info() if device.type == "cpu" else {}
    print(f"target: {root / 'target'} on {device}"
          + (f" ({cpu['cpu']}, taps kernels: {cpu['isa']})" if cpu else "")
          + f", {str(dtype).replace('torch.', '')}"
          + (" (--dtype auto)" if getattr(args, "dtype", None) == "auto" else "") + "; drafters: "
          + (", ".join(f"{f}-{n}" for f, ds in drafters.items() for n in ds) or "none"), flush=True)

    results = evaluate(target, tok, drafters, benches, rows, temperatures, limit=args.limit or None,
                       max_new_tokens=args.max_new_tokens, depth=args.depth, top_k=args.top_k,
                       budget=args.budget, seed=args.seed, batch_size=args.batch_size,
                       progress=not args.no_progress, families=families)
    results["config"]["command"] = shlex.join(sys.argv)
    results["config"]["args"] = {k: _jsonable(v) for k, v in vars(args).items() if k != "func"}
    results["config"]["models"] = str(root)
    print()
    _write_outputs(results, args)
    return results


def main(argv=None) -> int:
    """``python -m taps.eval``: the same as `taps eval`."""
    from .cli import main as taps_main

    return taps_main(["eval"] + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
