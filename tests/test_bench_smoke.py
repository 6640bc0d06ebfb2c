"""The benchmark scripts run (tiny settings): the end-to-end ones report lossless output, the op ones a
taps column per CPU instruction-set level.

The scripts are what users and the GPU check (bench/gpu_check.sh) run; a script broken by an API change
would waste a GPU lease. Nothing here is timed: the tests check that each script finishes, prints its
tables, and that every taps row at temperature 0 reports output identical to Hugging Face's greedy
output (the scripts compare token for token).
"""

import os
import re
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
                    "--overhead-tokens", "8", "--dtype", "fp32")
    t0 = table_rows(out, "Shipped models, T=0")
    # each row with drafters also as an auto row; autoregressive twice (the control row: the run's noise)
    taps = [r for r in t0 if r.strip().startswith("taps")]
    assert len(taps) == 6 and all(" yes " in r for r in taps), t0
    # (the ratios to HF generate and to taps autoregressive, and the range of the per-round ratios)
    assert sum(" auto " in r for r in taps) == 2 and all(sum(c.endswith("x") for c in r.split()) == 3 for r in taps), t0
    control = next(r for r in taps if "(control)" in r)
    low, high = (float(v) for v in re.search(r"([0-9.]+)-([0-9.]+)x", control).groups())
    assert 0 < low <= high, control
    assert sum("taps autoregressive (control)" in r for r in taps) == 1, t0
    assert len(table_rows(out, "Shipped models, T=1")) == 8
    # a profile table per temperature, each row with the tokens a step emitted (1.00 for autoregressive decoding)
    for t in ("0", "1"):
        prof = table_rows(out, f"Where a taps step's time goes, T={t} ")
        assert len(prof) == 5, prof
        assert prof[0].split()[:3] == ["autoregressive", prof[0].split()[1], "1.00"], prof
    overhead = table_rows(out, "Pure host overhead")
    assert any(r.strip().startswith("taps merged") for r in overhead)


def test_table_drafter_bench_runs(tmp_path):
    """bench/gpu_check.sh's "table" step at tiny settings: a table from held-out GSM8K test problems, then the
    bench's table row (drawn chains at T = 1, greedy at T = 0: output equal to HF's)."""
    table = tmp_path / "t.npz"
    out = run_bench("table_from_test_prompts.py", "--out", str(table), "--prompts", "12", "--new-tokens", "12")
    assert "contexts" in out and table.is_file()
    out = run_bench("bench_e2e.py", "--rows", "autoregressive", "table", "--table", str(table), "--prompts", "1",
                    "--new-tokens", "8", "--repeats", "1", "--temperatures", "0", "1", "--dtype", "fp32",
                    "--sampled-drafts", "on", "--depth", "2", "--top-k", "1", "--budget", "3", "--lookup", "0")
    t0 = [r for r in table_rows(out, "Shipped models, T=0") if "table" in r]
    assert len(t0) == 2 and all(" yes " in r for r in t0), t0
    assert sum("table" in r for r in table_rows(out, "Shipped models, T=1")) == 2


def test_bench_e2e_shipped_table_row():
    """The table row with the shipped table (models/tables/sampled) and its chains of --table-depth: output equal to
    HF's at T = 0, and a row (fixed and auto) at T = 1."""
    out = run_bench("bench_e2e.py", "--rows", "autoregressive", "table", "--prompts", "1", "--new-tokens", "8",
                    "--repeats", "1", "--temperatures", "0", "1", "--dtype", "fp32", "--lookup", "0",
                    "--table-depth", "2")
    assert "(the table row: chains of 2, drawn at T > 0)" in out
    t0 = [r for r in table_rows(out, "Shipped models, T=0") if "table" in r]
    assert len(t0) == 2 and all(" yes " in r for r in t0), t0
    assert sum("table" in r for r in table_rows(out, "Shipped models, T=1")) == 2


def test_bench_e2e_ragged_batch(tmp_path):
    args = ("bench_e2e.py", "--batch", "4", "--rows", "merged-budget", "lookup", "--new-tokens", "8", "--repeats", "1",
            "--temperatures", "0", "--dtype", "fp32", "--clock", "process", "--tuner-dir", str(tmp_path / "tuners"))
    out = run_bench(*args)
    rows = table_rows(out, "Ragged batch of 4, T=0")
    # autoregressive, its control, and each row fixed and auto; every output equal to autoregressive decoding
    assert len(rows) == 6 and all(" yes " in r for r in rows), rows
    assert sum(" auto " in r for r in rows) == 2
    # --tuner-dir: the auto rows' states saved, and a second run starts from them
    saved = sorted(p.name for p in (tmp_path / "tuners").iterdir())
    assert saved == ["batch4-lookup_auto.json", "batch4-merged-budget_auto.json"], saved
    assert "no saved state" in out
    out = run_bench(*args)
    assert out.count("tuner and judge state from") == 2, out
    assert all(" yes " in r for r in table_rows(out, "Ragged batch of 4, T=0"))


@pytest.mark.parametrize("vocab", [[], ["--draft-vocab", "100"]], ids=["full-vocab", "draft-vocab"])
def test_bench_e2e_synthetic_tiny_shape(vocab):
    """Every row equals HF greedy; the oracle head is accepted when uncorrupted, never when fully corrupted,
    with its whole vocabulary or a reduced one (which holds the continuation's tokens)."""
    out = run_bench("bench_e2e_synthetic.py", "--shape", "tiny", "--new-tokens", "8", "--repeats", "1",
                    "--corrupt", "0", "1", "--prompt-len", "16", "--dtype", "fp32", *vocab)
    rows = table_rows(out, "End to end, synthetic target")
    assert len(rows) == 6 and all(r.rstrip().endswith("yes") for r in rows), rows  # + an auto row per p
    fixed = [r for r in rows if "oracle" in r and "auto" not in r]
    auto = [r for r in rows if "oracle" in r and "auto" in r]
    tau = [float(r.split()[-2]) for r in fixed]
    assert tau[0] > 3.0 and tau[1] == 1.0, rows  # the uncorrupted oracle is accepted, the corrupted never
    assert len(auto) == 2 and float(auto[1].split()[-2]) == 1.0, rows
    costs = out.split("The tuners' measured costs (batch 1)")[1].strip().splitlines()
    assert len(costs) == 2 and all("forward 1 nodes" in c for c in costs) and "append of 1 token" in costs[0], out


def test_peaked_synthetic_target_keeps_its_argmax_in_bf16():
    """bench_e2e_synthetic's peaked target: each position's argmax is its token's successor perm[t], by a
    margin that bf16 does not flip (the fp32 and bf16 forwards agree everywhere; the plain random target's
    near-flat logits are what derailed the bf16 oracle)."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "bench"))
    import bench_e2e_synthetic as synthetic

    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    synthetic.peak_target(model, seed=5)
    # lm_head row perm[t] holds the embedding of t: token t's successor is perm[t]
    successor = torch.randperm(4096, generator=torch.Generator().manual_seed(5))
    ids = torch.randint(0, 4096, (1, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fp32 = model.eval()(ids).logits[0]
        bf16 = model.to(torch.bfloat16)(ids).logits[0].float()
    assert torch.equal(fp32.argmax(-1), successor[ids[0]])
    assert torch.equal(bf16.argmax(-1), successor[ids[0]])
    top2 = fp32.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1]) / fp32.std(dim=-1)).min() > 5.0


def test_bench_drafter_runs():
    out = run_bench("bench_drafter.py", "--batch", "1", "--prefix", "32", "--calls", "2", "--repeats", "1",
                    "--depth", "2")
    rows = table_rows(out, "drafter forward cost per expansion level")
    assert len(rows) == 4 and any("EAGLE-3" in r for r in rows), rows


@pytest.mark.parametrize("script,rows", [("bench_rms_norm.py", 10), ("bench_rope.py", 8),
                                         ("bench_expand_level.py", 10)])
def test_elementwise_op_benches_run(script, rows):
    """The rms_norm, rope_ and expand_level microbenchmarks print one line per case with a positive ratio
    per instruction-set level, the lowest (scalar) included when asked for."""
    out = run_bench(script, "--repeats", "5", "--isa", "scalar")
    lines = [ln for ln in out.splitlines() if ln.startswith("cpu ")]
    assert len(lines) == rows, out
    for ln in lines:
        ratio = float(ln.split()[-2])
        assert ratio > 0, ln
    header = next(ln for ln in out.splitlines() if ln.startswith("device"))
    assert "taps scalar us" in header, out
    assert "taps kernels:" in out, out  # taps_ops.cpu_info()["summary"] in the machine line


def test_isa_levels_by_default_and_asked_for():
    """--isa: every level up to the one in force, highest first (avx512 left out under amx); a list in its
    order; an unknown level is a clear error."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from common import cpu_isa, isa_levels, op_levels
    finally:
        sys.path.pop(0)
    import taps_ops

    levels = isa_levels(None)
    in_force = taps_ops.cpu_info()["isa"]
    assert levels[0] == in_force and levels[-1] == "scalar"
    assert ("avx512" in levels) == (in_force == "avx512")
    assert isa_levels("scalar") == ["scalar"]
    with pytest.raises(SystemExit, match="unknown level"):
        isa_levels("sse9")
    assert op_levels(levels, "build_tree") == ["scalar"]
    with cpu_isa("scalar"):
        assert taps_ops.cpu_info()["isa"] == "scalar"
    assert taps_ops.cpu_info()["isa"] == in_force


@pytest.mark.parametrize("script,args,title,rows", [
    ("bench_tree_attention.py", ["--quick", "--repeats", "1", "--no-reference", "--threads", "1"], "CPU,", 3),
    ("bench_verify_tree.py", ["--quick", "--no-reference", "--repeats", "1"], "cpu:", 4),
    ("bench_build_tree.py", ["--quick", "--no-reference"], "B ", 2),
    ("bench_merge_trees.py", ["--quick", "--no-reference"], "B ", 2),
    ("bench_compact_kv.py", ["--quick", "--no-reference", "--repeats", "1"], "device", 1),
])
def test_tree_op_benches_run(script, args, title, rows):
    """The other op microbenchmarks print their CPU table with one taps column per level they run (the
    scalar level asked for here too) and a positive ratio against the reference in each."""
    out = run_bench(script, *args, "--isa", "scalar")
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(title))
    if title.endswith((",", ":")):  # a title line above the header
        start += 1
    header, rule = lines[start], lines[start + 1]
    data = []
    for ln in lines[start + 2:]:  # print_table's rows are as wide as its rule
        if len(ln) != len(rule):
            break
        data.append(ln)
    assert "taps scalar" in header, out
    assert len(data) == rows, out
    for ln in data:
        ratios = [float(c[:-1]) for c in ln.split() if c.endswith("x") and c[:-1].replace(".", "").isdigit()]
        assert ratios and all(r > 0 for r in ratios), ln


def test_panel_linear_cold_bench_runs():
    """bench_panel_linear.py --cold: a line per shape and row count with the prefetch ratios (against no
    prefetches and against no next-block prefetch) and the ratio to torch (nothing timed)."""
    out = run_bench("bench_panel_linear.py", "--cold", "--quick", "--rounds", "1", "--cold-mib", "8")
    assert "weights read from memory" in out, out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith(("0.5B", "target head"))]
    assert len(lines) == 9, out
    for ln in lines:
        ratios = [float(c[:-1]) for c in ln.split() if c.endswith("x") and c[:-1].replace(".", "").isdigit()]
        assert len(ratios) == 3 and all(r > 0 for r in ratios), ln


@pytest.mark.parametrize("half", [False, True])
def test_panel_linear_bench_runs(half):
    """bench_panel_linear.py: one line per shape and row count, a taps column with a positive ratio per level
    asked for (AVX2 where the CPU has it: the scalar level's std::fma calls take seconds here, and
    tests/test_panel_linear.py covers that level); float32 or bfloat16 panels."""
    import taps_ops

    levels = ["avx2"] if taps_ops.cpu_info()["host_isa"] != "scalar" else ["scalar"]
    out = run_bench("bench_panel_linear.py", "--quick", "--rounds", "1", "--isa", ",".join(levels),
                    *(["--bf16"] if half else []))
    assert ("bfloat16 panels" if half else "float32 panels") in out, out
    header = next(ln for ln in out.splitlines() if ln.strip().startswith("weight"))
    for lv in levels:
        assert f"taps {lv} us" in header, out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("target ")]
    assert len(lines) == 15, out
    for ln in lines:
        ratios = [float(c[:-1]) for c in ln.split() if c.endswith("x") and c[:-1].replace(".", "").isdigit()]
        assert len(ratios) == len(levels) and all(r > 0 for r in ratios), ln


def test_panels_e2e_bench_runs():
    out = run_bench("bench_panels_e2e.py", "--rows", "ar,lookup", "--rounds", "1", "--prompts", "1",
                    "--new-tokens", "8")
    lines = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("ar ", "lookup "))]
    assert [ln[0] for ln in lines] == ["ar", "lookup"], out
    assert all(float(v) > 0 for ln in lines for v in ln[1:]), out


def test_batching_bench_runs():
    """bench_batching.py: the load on ContinuousBatch, a row per decoder with its ratio to taps
    autoregressive, the time breakdown and the tree widths of the speculative row."""
    out = run_bench("bench_batching.py", "--requests", "4", "--max-batch", "2", "--max-tokens", "6", "--rounds", "1",
                    "--warmup", "0", "--strategy", "single", "--drafters", "lookup")
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("taps autoregressive", "control", "single"))]
    assert len(rows) >= 3 and all(r[-1].endswith("x") for r in rows[:3]), out
    assert "where the time went" in out and "tree widths verified" in out, out


def test_tuner_simulation_bench_runs():
    out = run_bench("bench_tuner_sim.py", "--rates", "0", "0.7", "--tokens", "24", "--seeds", "2")
    rows = table_rows(out, "Tuner against simulated drafts")
    assert len(rows) == 2 and all(r.split()[2].endswith("x") for r in rows), rows
    out = run_bench("bench_tuner_sim.py", "--rates", "0.5", "--tokens", "16", "--seeds", "1", "--no-candidates",
                    "--forward", "1:1,16:2", "--explore", "0.05", "--others", "0")
    assert len(table_rows(out, "Tuner against simulated drafts")) == 1
    out = run_bench("bench_tuner_sim.py", "--rates", "0.8", "--tokens", "40", "--seeds", "1", "--switch", "10")
    assert "0.8 / 0 every 10" in table_rows(out, "Tuner against simulated drafts")[0]
