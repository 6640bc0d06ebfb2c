#!/usr/bin/env bash
# One prepared run on a GPU machine (PyTorch already installed, no internet):
# build for the local GPU, run the CUDA tests, compute-sanitizer on small cases, then the benchmarks.
# Writes everything under ${OUT:-gpu_out}/ and prints a short summary last. Budget: well under 10 minutes.
#   OUT=/some/dir bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-16}
PY=${PYTHON:-python}
summary="$OUT/summary.txt"
: >"$summary"
step() { echo "== $1" | tee -a "$summary"; }

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
"$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$summary"

step "build (sm_${TORCH_CUDA_ARCH_LIST})"
start=$(date +%s)
so=$("$PY" tools/dev_build.py --cuda --build-dir build/gpu 2>"$OUT/build.log" | tail -n 1)
echo "build rc=$? in $(( $(date +%s) - start ))s: $so" | tee -a "$summary"
export TAPS_OPS_LIBRARY="$so" PYTHONPATH=python
"$PY" -c "import taps_ops; assert taps_ops.has_cuda_kernels()" || { echo "no CUDA kernels" | tee -a "$summary"; exit 1; }

step "pytest (all, CUDA included)"
timeout 300 "$PY" -m pytest -q --maxfail=25 -p no:cacheprovider tests >"$OUT/pytest.txt" 2>&1
echo "pytest rc=$?: $(tail -n 1 "$OUT/pytest.txt")" | tee -a "$summary"

step "compute-sanitizer (memcheck, racecheck) on small cases"
SAN=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
if [ -x "$SAN" ]; then
  for tool in memcheck racecheck; do
    timeout 120 "$SAN" --tool "$tool" --error-exitcode 9 "$PY" bench/sanitizer_cases.py >"$OUT/sanitizer_$tool.txt" 2>&1
    echo "$tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.txt" | tail -n 1)" | tee -a "$summary"
  done
else
  echo "compute-sanitizer not found" | tee -a "$summary"
fi

step "benchmarks"
for b in bench/bench_verify_tree.py bench/bench_build_tree.py bench/bench_merge_trees.py \
         bench/bench_tree_attention.py bench/bench_compact_kv.py; do
  [ -f "$b" ] || continue
  timeout 150 "$PY" "$b" --no-reference >"$OUT/$(basename "$b" .py).txt" 2>&1 \
    || timeout 150 "$PY" "$b" >"$OUT/$(basename "$b" .py).txt" 2>&1
  echo "$b rc=$?" | tee -a "$summary"
done
cat "$OUT"/bench_*.txt >>"$summary" 2>/dev/null
echo "== done" | tee -a "$summary"
cat "$summary"
