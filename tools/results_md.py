"""Markdown tables for docs/RESULTS.md from a `taps eval` results JSON, next to the paper's numbers.

    python tools/results_md.py runs/eval/results.json > /tmp/tables.md
    python tools/results_md.py --paired runs/eval/results.json    # paired row differences +- SE
    python tools/results_md.py --drafters                          # held-out accuracy of the drafters
    python tools/results_md.py --compare eagle3 eagle2 runs/eval/results.json   # one family against another

The paper's acceptance lengths (Llama-3-8B-Instruct target) are those of the authors' repository README
(github.com/Moe-Zbeeb/TAPS, "Main results (acceptance length)"), which presents them as the paper's
tables; rows: MathInstruct, ShareGPT, Mixed 35k+35k, Mixed 70k+70k, Averaged, Confidence Routed, Merged
Trees. Our rows route-entropy, merged-budget and adaptive have no published counterpart. The paper has no
EAGLE-3 rows.
"""

from __future__ import annotations

import json
import math
import sys

BENCHES = ("mt_bench", "gsm8k", "math500", "svamp")
HEAD = ("MT-Bench", "GSM8K", "MATH-500", "SVAMP")
# row -> (paper row name, {family: {temperature: [mt_bench, gsm8k, math500, svamp, avg]}})
PAPER = {
    "math": ("MathInstruct", {"hass": {"0": [2.90, 5.02, 5.35, 3.13, 4.10], "1": [2.31, 4.75, 4.63, 2.46, 3.54]},
                              "eagle2": {"0": [2.54, 5.04, 5.28, 4.81, 4.42], "1": [2.43, 4.71, 4.61, 4.53, 4.07]}}),
    "chat": ("ShareGPT", {"hass": {"0": [3.98, 4.09, 3.98, 4.44, 4.12], "1": [3.50, 4.03, 3.61, 3.95, 3.77]},
                          "eagle2": {"0": [3.57, 3.72, 3.81, 3.71, 3.70], "1": [3.38, 3.72, 3.43, 3.65, 3.54]}}),
    "mixed": ("Mixed 35k+35k", {"hass": {"0": [3.92, 4.77, 5.02, 4.15, 4.47], "1": [3.46, 4.66, 4.47, 4.57, 4.29]},
                                "eagle2": {"0": [3.37, 4.12, 4.44, 4.16, 4.02], "1": [3.10, 4.08, 4.02, 4.03, 3.81]}}),
    "mixed2": ("Mixed 70k+70k", {"hass": {"0": [4.13, 5.53, 5.67, 5.38, 5.18], "1": [3.17, 4.16, 3.42, 4.01, 3.69]},
                                 "eagle2": {"0": [3.75, 4.68, 4.85, 4.64, 4.48], "1": [2.99, 3.76, 3.20, 3.08, 3.26]}}),
    "avg": ("Averaged", {"hass": {"0": [2.29, 2.80, 3.12, 2.13, 2.59], "1": [2.10, 2.78, 2.90, 2.69, 2.62]},
                         "eagle2": {"0": [2.07, 2.53, 2.57, 2.50, 2.42], "1": [2.01, 2.49, 2.42, 2.45, 2.34]}}),
    "route-confidence": ("Confidence Routed",
                         {"hass": {"0": [3.93, 5.01, 5.37, 4.89, 4.80], "1": [3.51, 4.72, 4.55, 4.71, 4.37]},
                          "eagle2": {"0": [3.63, 4.91, 5.25, 4.71, 4.63], "1": [3.36, 4.65, 4.62, 4.46, 4.27]}}),
    "merged": ("Merged Trees", {"hass": {"0": [4.05, 5.42, 5.65, 5.31, 5.11], "1": [3.76, 5.21, 4.98, 5.05, 4.75]},
                                "eagle2": {"0": [3.93, 5.32, 5.63, 5.25, 5.02], "1": [3.55, 5.01, 4.79, 4.93, 4.57]}}),
}
# confidence routing, EAGLE-2, share of MathInstruct per benchmark (temperature not stated)
PAPER_ROUTING = {"mt_bench": 0.188, "gsm8k": 0.908, "math500": 0.970, "svamp": 0.930}


def f2(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def main(path: str) -> None:
    res = json.load(open(path))
    tables, routing = res["tables"], res.get("routing", {})
    cfg = res["config"]
    print(f"Settings: {cfg.get('limit')} prompts per benchmark, {cfg.get('max_new_tokens')} new tokens, depth "
          f"{cfg.get('depth')}, top-k {cfg.get('top_k')}, budget {cfg.get('budget')} nodes per drafter tree, "
          f"seed {cfg.get('seed')}, {cfg.get('dtype')} on {cfg.get('device')}.\n")
    for fam in ("hass", "eagle2", "eagle3"):
        for t in ("0", "1"):
            tab = tables.get(fam, {}).get(t)
            if not tab:
                continue
            name = NAMES[fam]
            print(f"### {name}, temperature {t}\n")
            print("| row | " + " | ".join(HEAD) + " | avg | nodes/step | paper row | paper: " + " / ".join(HEAD)
                  + " / avg |")
            print("|" + " --- |" * (len(HEAD) + 5))
            best = {b: max((v.get(b, float("nan")) for v in tab.values() if v.get(b) is not None),
                           default=float("nan")) for b in BENCHES + ("avg",)}
            order = ["math", "chat", "mixed", "mixed2", "avg", "route-confidence", "route-entropy", "merged",
                     "merged-budget", "adaptive"]
            for row in [r for r in order if r in tab] + [r for r in tab if r not in order]:
                vals = tab[row]
                cells = []
                for b in BENCHES + ("avg",):
                    x = vals.get(b)
                    s = f2(x)
                    cells.append(f"**{s}**" if x is not None and abs(x - best[b]) < 1e-9 else s)
                paper = PAPER.get(row)
                if paper and fam in paper[1]:
                    pname, pv = paper[0], " / ".join(f2(x) for x in paper[1][fam][t])
                else:
                    pname, pv = "(none)", "-"
                print(f"| {row} | " + " | ".join(cells) + f" | {vals.get('nodes', float('nan')):.1f} | {pname} | {pv} |")
            print()
    print("### Confidence / entropy routing: share of steps routed to the math drafter\n")
    print("| family | T | row | " + " | ".join(HEAD) + " |")
    print("|" + " --- |" * (len(HEAD) + 3))
    for fam, by_t in routing.items():
        for t, rows in by_t.items():
            for row, per_b in rows.items():
                print(f"| {fam} | {t} | {row} | " + " | ".join(f2(per_b.get(b, {}).get("math")) for b in BENCHES) + " |")
    print("| paper (EAGLE-2) | ? | route-confidence | " + " | ".join(f2(PAPER_ROUTING[b]) for b in BENCHES) + " |")


def drafters(root: str = "models/drafters") -> None:
    """Held-out top-1 agreement (acc@1, acc@3) of every shipped drafter, from its manifest."""
    import pathlib

    print("| drafter | tokens | steps | train time | math acc@1 | math acc@3 | chat acc@1 | chat acc@3 |")
    print("|" + " --- |" * 8)
    for fam in ("eagle2", "hass", "eagle3"):
        for d in ("math", "chat", "mixed", "mixed2"):
            p = pathlib.Path(root) / f"{fam}-{d}" / "manifest.json"
            if not p.is_file():
                continue
            m = json.loads(p.read_text())
            h = m["final_heldout"]
            print(f"| {fam}-{d} | {m['tokens_seen']:,} | {m['steps']} | {m['elapsed_s'] / 60:.1f} min | "
                  f"{h['math']['acc@1']:.3f} | {h['math']['acc@3']:.3f} | {h['chat']['acc@1']:.3f} | "
                  f"{h['chat']['acc@3']:.3f} |")


NAMES = {"hass": "HASS", "eagle2": "EAGLE-2", "eagle3": "EAGLE-3"}


def compare(fam_a: str, fam_b: str, path: str) -> None:
    """Family A against family B row by row: mean tau over the benchmarks, their ratio, and the paired
    per-prompt difference (same prompts and coins) pooled over the benchmarks, +- its standard error."""
    import statistics

    res = json.load(open(path))
    cells = {(c["family"], c["temperature"], c["row"], c["benchmark"]): c for c in res["cells"]}
    temps = sorted({t for f, t, _, _ in cells if f in (fam_a, fam_b)})
    order = ["math", "chat", "mixed", "mixed2", "avg", "route-confidence", "route-entropy", "merged",
             "merged-budget", "adaptive"]
    print(f"| T | row | {NAMES.get(fam_a, fam_a)} avg tau | {NAMES.get(fam_b, fam_b)} avg tau | ratio | "
          "paired difference per prompt | standard error | prompts |")
    print("|" + " --- |" * 8)
    for t in temps:
        for row in order:
            ta, tb, diffs = [], [], []
            for bench in BENCHES:
                ca, cb = cells.get((fam_a, t, row, bench)), cells.get((fam_b, t, row, bench))
                if not ca or not cb:
                    continue
                ta.append(ca["tau"])
                tb.append(cb["tau"])
                diffs += [x - y for x, y in zip(ca.get("tau_per_prompt") or [], cb.get("tau_per_prompt") or [])
                          if x is not None and y is not None]
            if not ta:
                continue
            a, b = statistics.mean(ta), statistics.mean(tb)
            se = f"{statistics.stdev(diffs) / len(diffs) ** 0.5:.3f}" if len(diffs) > 1 else "-"
            mean = f"{statistics.mean(diffs):+.3f}" if diffs else "-"
            print(f"| {t:g} | {row} | {a:.2f} | {b:.2f} | {a / b:.3f} | {mean} | {se} | {len(diffs)} |")


PAIRS = (("merged-budget", "route-confidence"), ("adaptive", "merged-budget"), ("merged", "route-confidence"),
         ("route-confidence", "route-entropy"), ("mixed2", "merged"), ("math", "avg"), ("chat", "avg"))


def paired(path: str) -> None:
    """Per-prompt paired differences of tau between rows (the same prompts and coins), pooled over the
    benchmarks: mean +- standard error. Needs cells with tau_per_prompt."""
    import statistics

    res = json.load(open(path))
    cells = {(c["family"], c["temperature"], c["row"], c["benchmark"]): c for c in res["cells"]}
    keys = sorted({(f, t) for f, t, _, _ in cells})
    print("| family | T | A - B | mean difference of tau per prompt | standard error | prompts |")
    print("|" + " --- |" * 6)
    for fam, t in keys:
        for a, b in PAIRS:
            diffs = []
            for bench in BENCHES:
                ca, cb = cells.get((fam, t, a, bench)), cells.get((fam, t, b, bench))
                if not ca or not cb or "tau_per_prompt" not in ca or "tau_per_prompt" not in cb:
                    continue
                diffs += [x - y for x, y in zip(ca["tau_per_prompt"], cb["tau_per_prompt"])
                          if x is not None and y is not None]
            if len(diffs) > 1:
                se = statistics.stdev(diffs) / len(diffs) ** 0.5
                print(f"| {fam} | {t:g} | {a} - {b} | {statistics.mean(diffs):+.3f} | {se:.3f} | {len(diffs)} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--paired"]:
        paired(sys.argv[2])
        sys.exit(0)
    if sys.argv[1:2] == ["--compare"]:
        compare(*sys.argv[2:5])
        sys.exit(0)
    if sys.argv[1:2] == ["--drafters"]:
        drafters(*sys.argv[2:3])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "runs/eval/results.json")
