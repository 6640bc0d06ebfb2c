#!/usr/bin/env bash
# One prepared run on a GPU machine (PyTorch already installed, no internet):
# build for the local GPU, run the CUDA tests, compute-sanitizer on small cases, then the benchmarks.
# Writes everything under ${OUT:-gpu_out}/ and prints a short summary last.
#   OUT=/some/dir bash bench/gpu_check.sh
# Budget: BUDGET_S seconds in all (default 540, under a 10-minute call limit). Each step is skipped,
# with a line in the summary, when less time is left than it may take; every step's output is in $OUT
# as soon as it ends, so a run cut short still returns what it did. STEPS picks steps (default all:
# "build test sanitize bench e2e"); a second call can run e.g. STEPS="build bench" (the build is cached in
# build/gpu and takes seconds when nothing changed). e2e: bench/bench_e2e_synthetic.py, a Llama-3-8B-shaped
# target (random weights, bf16) with an EAGLE-shaped drafter of controlled acceptance, tokens/s against
# Hugging Face generate at tau 1 to depth + 1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-16}
PY=${PYTHON:-python}
BUDGET_S=${BUDGET_S:-540}
STEPS=${STEPS:-build test sanitize bench e2e}
START=$(date +%s)
summary="$OUT/summary.txt"
: >"$summary"
step() { echo "== $1 (at $(( $(date +%s) - START ))s)" | tee -a "$summary"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
# afford SECONDS NAME: true when SECONDS fit in what is left, else a summary line and false
afford() {
  if [ "$(left)" -lt "$1" ]; then echo "skipped $2: $(left)s left, needs up to $1s" | tee -a "$summary"; return 1; fi
}

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
"$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$summary"

step "build (sm_${TORCH_CUDA_ARCH_LIST})"
so=$("$PY" tools/dev_build.py --cuda --build-dir build/gpu 2>"$OUT/build.log" | tail -n 1)
echo "build rc=$? in $(( $(date +%s) - START ))s: $so" | tee -a "$summary"
export TAPS_OPS_LIBRARY="$so" PYTHONPATH=python
"$PY" -c "import taps_ops; assert taps_ops.has_cuda_kernels()" || { echo "no CUDA kernels" | tee -a "$summary"; exit 1; }

if wanted test && afford 200 "pytest"; then
  step "pytest (the op tests, CUDA included; CI runs the rest)"
  timeout 180 "$PY" -m pytest -q --maxfail=25 -p no:cacheprovider tests/test_verify_tree.py tests/test_build_tree.py \
    tests/test_merge_trees.py tests/test_tree_attention.py tests/test_compact_kv.py tests/test_hf_hook.py \
    tests/test_rms_norm.py tests/test_rope.py tests/test_expand_level.py tests/test_drawn_trees.py \
    >"$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?: $(tail -n 1 "$OUT/pytest.txt")" | tee -a "$summary"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -n 25 >>"$summary"
fi

if wanted sanitize && afford 130 "compute-sanitizer"; then
  step "compute-sanitizer (memcheck, racecheck) on small cases"
  SAN=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
  if [ -x "$SAN" ]; then
    for tool in memcheck racecheck; do
      timeout 60 "$SAN" --tool "$tool" --error-exitcode 9 "$PY" bench/sanitizer_cases.py >"$OUT/sanitizer_$tool.txt" 2>&1
      echo "$tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.txt" | tail -n 1)" | tee -a "$summary"
    done
  else
    echo "compute-sanitizer not found" | tee -a "$summary"
  fi
fi

if wanted bench; then
  step "benchmarks"
  # the CPU columns at the host's own level only (the lower levels are the dev machine's business)
  isa=$("$PY" -c 'import taps_ops; print(taps_ops.cpu_info()["isa"])' 2>/dev/null || echo scalar)
  for b in bench/bench_tree_attention.py bench/bench_verify_tree.py bench/bench_build_tree.py \
           bench/bench_merge_trees.py bench/bench_compact_kv.py; do
    [ -f "$b" ] || continue
    afford 95 "$b" || continue
    timeout 90 "$PY" "$b" --no-reference --isa "$isa" >"$OUT/$(basename "$b" .py).txt" 2>&1
    echo "$b rc=$?" | tee -a "$summary"
  done
  for b in bench/bench_rms_norm.py bench/bench_rope.py bench/bench_expand_level.py; do  # op vs torch form
    afford 40 "$b" || continue
    timeout 35 "$PY" "$b" --repeats 500 --isa "$isa" >"$OUT/$(basename "$b" .py).txt" 2>&1
    echo "$b rc=$?" | tee -a "$summary"
  done
  cat "$OUT"/bench_*.txt >>"$summary" 2>/dev/null
fi
if wanted e2e && afford 190 "e2e"; then
  step "end to end: Llama-3-8B-shaped target, controlled-acceptance EAGLE drafter (fixed and budget=auto; a 32k draft vocabulary as EAGLE-3's), vs HF generate and taps autoregressive"
  timeout 180 "$PY" bench/bench_e2e_synthetic.py --shape llama3-8b --new-tokens 96 --repeats 2 \
    --corrupt 0 0.2 0.5 1 --draft-vocab 32000 >"$OUT/bench_e2e_synthetic.txt" 2>&1
  echo "e2e rc=$?" | tee -a "$summary"
  tail -n 16 "$OUT/bench_e2e_synthetic.txt" >>"$summary"
fi
echo "== done in $(( $(date +%s) - START ))s" | tee -a "$summary"
cat "$summary"
