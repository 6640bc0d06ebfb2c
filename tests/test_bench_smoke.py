"""The end-to-end benchmark scripts run (tiny settings) and report lossless output.

The scripts are what users and the GPU check (bench/gpu_check.sh) run; a script broken by an API change
would waste a GPU lease. Nothing here is timed: the tests check that each script finishes, prints its
tables, and that every taps row at temperature 0 reports output identical to Hugging Face's greedy
output (the scripts compare token for token).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script, *args, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, f"{script} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def table_rows(out, title):
    """The data rows of the table whose title line starts with `title`."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(title))
    rows = []
    for ln in lines[start + 3:]:  # title, header, rule
        if not ln.strip():
            break
        rows.append(ln)
    return rows


def test_bench_e2e_shipped_models_and_overhead():
    out = run_bench("bench_e2e.py", "--rows", "autoregressive", "merged-budget", "lookup", "--prompts", "1",
                    "--new-tokens", "8", "--repeats", "1", "--temperatures", "0", "1", "--profile", "--overhead",
                    "--overhead-tokens", "8")
    t0 = table_rows(out, "Shipped models, T=0")
    taps = [r for r in t0 if r.strip().startswith("taps")]  # each row with drafters also as an auto row
    assert len(taps) == 5 and all(" yes " in r for r in taps), t0
    assert sum(" auto " in r for r in taps) == 2 and all(sum(c.endswith("x") for c in r.split()) == 2 for r in taps), t0
    assert len(table_rows(out, "Shipped models, T=1")) == 7
    assert len(table_rows(out, "Where a taps step's time goes")) == 5
    overhead = table_rows(out, "Pure host overhead")
    assert any(r.strip().startswith("taps merged") for r in overhead)


def test_bench_e2e_synthetic_tiny_shape():
    out = run_bench("bench_e2e_synthetic.py", "--shape", "tiny", "--new-tokens", "8", "--repeats", "1",
                    "--corrupt", "0", "1", "--prompt-len", "16")
    rows = table_rows(out, "End to end, synthetic target")
    assert len(rows) == 4 and all(r.rstrip().endswith("yes") for r in rows), rows
    oracle = [r for r in rows if "oracle" in r]
    tau = [float(r.split()[-2]) for r in oracle]
    assert tau[0] > 3.0 and tau[1] == 1.0, rows  # the uncorrupted oracle is accepted, the corrupted never


def test_bench_drafter_runs():
    out = run_bench("bench_drafter.py", "--batch", "1", "--prefix", "32", "--calls", "2", "--repeats", "1",
                    "--depth", "2")
    rows = table_rows(out, "drafter forward cost per expansion level")
    assert len(rows) == 4 and any("EAGLE-3" in r for r in rows), rows


@pytest.mark.parametrize("script,rows", [("bench_rms_norm.py", 10), ("bench_rope.py", 8),
                                         ("bench_expand_level.py", 10)])
def test_elementwise_op_benches_run(script, rows):
    """The rms_norm, rope_ and expand_level microbenchmarks print one line per case with a positive ratio."""
    out = run_bench(script, "--repeats", "5")
    lines = [ln for ln in out.splitlines() if ln.startswith("cpu ")]
    assert len(lines) == rows, out
    for ln in lines:
        ratio = float(ln.split()[-2])
        assert ratio > 0, ln
