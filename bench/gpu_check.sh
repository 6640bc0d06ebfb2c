#!/usr/bin/env bash
# One prepared run on a GPU machine (PyTorch already installed, no internet): build for the local GPU (or
# load a library built elsewhere against the same torch), run the CUDA op tests, the benchmarks, an
# end-to-end run, compute-sanitizer on small cases. Writes everything under ${OUT:-gpu_out}/ and prints a
# short summary last.
#   OUT=/some/dir bash bench/gpu_check.sh
# Budget: BUDGET_S seconds in all (default 540, under a 10-minute call limit). Each step is skipped, with a
# line in the summary, when less time is left than it may take; every step's output is in $OUT as soon as it
# ends, so a run cut short still returns what it did: the summary in $OUT/summary.txt, every step's log in
# $OUT/logs.tgz (refreshed after each step; one archive, since a device call returns at most 8 files).
# STEPS picks the steps and their order (default "test bench-core e2e engine sanitize probe bench-rest";
# the library is always loaded first). bench-core: tree_attention and verify_tree; bench-rest: the other op
# benchmarks; engine: bench/bench_e2e.py on the shipped models on the GPU (fp32, greedy = HF greedy; batch 1,
# then a ragged batch of 8); probe: bench/probe_cuda.py's knob sweeps; table (not in the default STEPS): a
# small n-gram table of the shipped target (bench/table_from_test_prompts.py) and its drawn chains at T = 1.
# e2e: bench/bench_e2e_synthetic.py, a Llama-3-8B-shaped target (random weights, bf16) with an EAGLE-shaped
# drafter of controlled acceptance, tokens/s against Hugging Face generate and taps autoregressive.
# TAPS_PREBUILT=path/to/taps_ops_dev_cuda.so: use that library when it loads with its CUDA kernels (built with
# tools/dev_build.py --cuda against this machine's torch version), else build here into build/gpu (cached:
# seconds when nothing changed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-16}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
command -v "$PY" >/dev/null || PY=python3
BUDGET_S=${BUDGET_S:-540}
STEPS=${STEPS:-test bench-core e2e engine sanitize probe bench-rest}
START=$(date +%s)
summary="$OUT/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
step() { tar czf "$OUT/logs.tgz" -C "$LOGS" . ; say "== $1 (at $(( $(date +%s) - START ))s)"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
# afford SECONDS NAME: true when SECONDS fit in what is left, else a summary line and false
afford() {
  if [ "$(left)" -lt "$1" ]; then say "skipped $2: $(left)s left, needs up to $1s"; return 1; fi
}
# cap SECONDS: SECONDS, or what is left of the budget when that is less
cap() { local l; l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }

nvidia-smi >"$LOGS/nvidia-smi.txt" 2>&1
"$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$summary"

has_cuda() { TAPS_OPS_LIBRARY="$1" PYTHONPATH=python "$PY" -c "import taps_ops; assert taps_ops.has_cuda_kernels()" 2>>"$LOGS/build.log"; }
so=""
if [ -n "${TAPS_PREBUILT:-}" ] && [ -f "$TAPS_PREBUILT" ] && has_cuda "$(realpath "$TAPS_PREBUILT")"; then
  so=$(realpath "$TAPS_PREBUILT")
  say "library: prebuilt $TAPS_PREBUILT"
else
  step "build (sm_${TORCH_CUDA_ARCH_LIST})"
  so=$("$PY" tools/dev_build.py --cuda --build-dir build/gpu 2>>"$LOGS/build.log" | tail -n 1)
  say "build rc=$? in $(( $(date +%s) - START ))s: $so"
  has_cuda "$so" || { say "no CUDA kernels (build.log)"; tail -n 30 "$LOGS/build.log"; exit 1; }
fi
export TAPS_OPS_LIBRARY="$so" PYTHONPATH=python

run_test() {
  afford 60 "pytest" || return
  step "pytest: the CUDA cases of the op tests (-k cuda; CI runs the CPU ones)"
  timeout "$(cap 170)" "$PY" -m pytest -q --maxfail=25 -p no:cacheprovider -k cuda --durations=12 \
    tests/test_verify_tree.py tests/test_build_tree.py tests/test_merge_trees.py tests/test_tree_attention.py \
    tests/test_compact_kv.py tests/test_rms_norm.py tests/test_rope.py tests/test_expand_level.py \
    tests/test_drawn_trees.py tests/test_decoder_layer.py >"$LOGS/pytest.txt" 2>&1
  say "pytest rc=$?: $(tail -n 1 "$LOGS/pytest.txt")"
  grep -E "^(FAILED|ERROR)" "$LOGS/pytest.txt" | head -n 25 >>"$summary"
}

run_sanitize() {
  afford 60 "compute-sanitizer" || return
  step "compute-sanitizer (memcheck, racecheck) on small cases"
  local san tool
  san=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
  [ -x "$san" ] || { say "compute-sanitizer not found"; return; }
  for tool in memcheck racecheck; do
    afford 25 "$tool" || continue
    timeout "$(cap 60)" "$san" --tool "$tool" --error-exitcode 9 "$PY" bench/sanitizer_cases.py >"$LOGS/sanitizer_$tool.txt" 2>&1
    say "$tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/sanitizer_$tool.txt" | tail -n 1)"
  done
}

# bench_ops SECONDS FILE...: each benchmark's CUDA rows (TAPS_BENCH_DEVICES=cuda), at most SECONDS each
bench_ops() {
  local t=$1 b name; shift
  for b in "$@"; do
    [ -f "$b" ] || continue
    afford 20 "$b" || continue
    name=$(basename "$b" .py)
    case "$name" in
      bench_rms_norm|bench_rope|bench_expand_level) args=(--repeats 500) ;;  # op vs its torch form
      *) args=(--no-reference) ;;
    esac
    TAPS_BENCH_DEVICES=cuda timeout "$(cap "$t")" "$PY" "$b" "${args[@]}" >"$LOGS/$name.txt" 2>&1
    say "$b rc=$?"
    cat "$LOGS/$name.txt" >>"$summary"
  done
}

run_e2e() {
  afford 100 "e2e" || return
  step "end to end: Llama-3-8B-shaped target, controlled-acceptance EAGLE drafter (fixed and budget=auto; a 32k draft vocabulary as EAGLE-3's), vs HF generate and taps autoregressive"
  # bf16, what users run: the synthetic target is peaked (bench_e2e_synthetic.peak_target), so bf16's rounding
  # no longer derails the oracle as it did on the plain random model (tau 1.00 at p = 0, 2026-12-04); then fp32
  # at two points (the 2026-12-04 fp32 rows were on the plain model: --flat)
  timeout "$(cap 150)" "$PY" bench/bench_e2e_synthetic.py --shape llama3-8b --dtype bf16 --new-tokens 96 --repeats 2 \
    --corrupt 0 0.2 0.5 1 --draft-vocab 32000 >"$LOGS/bench_e2e_synthetic_bf16.txt" 2>&1
  say "e2e bf16 rc=$?"
  tail -n 14 "$LOGS/bench_e2e_synthetic_bf16.txt" >>"$summary"
  afford 60 "e2e fp32" || return
  timeout "$(cap 100)" "$PY" bench/bench_e2e_synthetic.py --shape llama3-8b --dtype fp32 --new-tokens 96 --repeats 2 \
    --corrupt 0 0.5 --draft-vocab 32000 >"$LOGS/bench_e2e_synthetic_fp32.txt" 2>&1
  say "e2e fp32 rc=$?"
  tail -n 10 "$LOGS/bench_e2e_synthetic_fp32.txt" >>"$summary"
}

run_engine() {
  afford 60 "engine" || return
  step "engine on the GPU: the shipped models (head dim 32) in fp32, greedy, every row = HF greedy?"
  timeout "$(cap 120)" "$PY" bench/bench_e2e.py --device cuda --dtype fp32 --temperatures 0 --repeats 1 --prompts 2 \
    --new-tokens 48 --rows autoregressive math merged-budget lookup merged-budget+lookup >"$LOGS/bench_e2e_cuda.txt" 2>&1
  say "engine rc=$?"
  tail -n 20 "$LOGS/bench_e2e_cuda.txt" >>"$summary"
  afford 60 "engine batch" || return
  step "engine on the GPU: one ragged batch of 8 (GSM8K + MT-Bench), fp32, greedy, against taps autoregressive"
  timeout "$(cap 120)" "$PY" bench/bench_e2e.py --device cuda --dtype fp32 --temperatures 0 --repeats 1 --batch 8 \
    --new-tokens 32 --rows autoregressive merged-budget lookup merged-budget+lookup >"$LOGS/bench_e2e_cuda_batch.txt" 2>&1
  say "engine batch rc=$?"
  tail -n 14 "$LOGS/bench_e2e_cuda_batch.txt" >>"$summary"
}

run_table() {
  afford 120 "table" || return
  step "n-gram table drafter at T = 1 on the GPU (shipped models, fp32): does a drawn 3-node chain (tau ~1.5) pay where a few nodes cost what one does?"
  timeout "$(cap 60)" "$PY" bench/table_from_test_prompts.py --device cuda --prompts 400 --threads 8 \
    --out "$OUT/t1_table.npz" >"$LOGS/table_build.txt" 2>&1
  say "table build rc=$?"
  tail -n 1 "$LOGS/table_build.txt" >>"$summary"
  [ -f "$OUT/t1_table.npz" ] || return
  timeout "$(cap 90)" "$PY" bench/bench_e2e.py --device cuda --dtype fp32 --temperatures 1 --repeats 2 --prompts 3 \
    --new-tokens 64 --rows autoregressive table --table "$OUT/t1_table.npz" --sampled-drafts on --depth 2 --top-k 1 \
    --budget 3 >"$LOGS/bench_e2e_cuda_table.txt" 2>&1
  say "table bench rc=$?"
  tail -n 8 "$LOGS/bench_e2e_cuda_table.txt" >>"$summary"
  rm -f "$OUT/t1_table.npz"
}

run_probe() {
  afford 60 "probe" || return
  step "probe: tree_attention's key splits and validation, verify_tree's cluster size (bench/probe_cuda.py)"
  timeout "$(cap 90)" "$PY" bench/probe_cuda.py --repeats 20 >"$LOGS/probe_cuda.txt" 2>&1
  say "probe rc=$?"
  cat "$LOGS/probe_cuda.txt" >>"$summary"
}

for s in $STEPS; do
  case "$s" in
    build) ;;  # always done above
    test) run_test ;;
    sanitize) run_sanitize ;;
    bench-core) step "benchmarks: tree_attention, verify_tree (CUDA rows)"
                bench_ops 75 bench/bench_tree_attention.py bench/bench_verify_tree.py ;;
    bench-rest) step "benchmarks: the other ops (CUDA rows)"
                bench_ops 45 bench/bench_build_tree.py bench/bench_merge_trees.py bench/bench_compact_kv.py \
                  bench/bench_rms_norm.py bench/bench_rope.py bench/bench_expand_level.py ;;
    bench) step "benchmarks (CUDA rows)"
           bench_ops 75 bench/bench_tree_attention.py bench/bench_verify_tree.py
           bench_ops 45 bench/bench_build_tree.py bench/bench_merge_trees.py bench/bench_compact_kv.py \
             bench/bench_rms_norm.py bench/bench_rope.py bench/bench_expand_level.py ;;
    e2e) run_e2e ;;
    engine) run_engine ;;
    probe) run_probe ;;
    table) run_table ;;
    *) say "unknown step $s (accepted: build test bench bench-core bench-rest e2e engine probe sanitize table)" ;;
  esac
done
tar czf "$OUT/logs.tgz" -C "$LOGS" .
say "== done in $(( $(date +%s) - START ))s"
echo; cat "$summary"
