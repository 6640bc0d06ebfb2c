#!/usr/bin/env bash
# Compile one CUDA source to an object file (syntax, templates, ptxas) without building the whole
# extension:  tools/check_cu.sh csrc/cuda/verify_tree.cu [python]
# Uses the same flags as setup.py for sm_80 and sm_90a. The object cannot run here (no GPU).
set -euo pipefail
src=$1; py=${2:-python}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
inc=$("$py" - <<'PY'
import glob, os, sysconfig, torch, nvidia
from torch.utils.cpp_extension import include_paths
paths = include_paths("cuda") + [sysconfig.get_paths()["include"]]
for base in nvidia.__path__:
    paths += glob.glob(os.path.join(base, "cu*", "include"))
print(" ".join("-I" + p for p in paths))
PY
)
out=${TMPDIR:-/tmp}/check_cu_$(basename "$src").o
# The defines torch's extension build adds to every nvcc command (keep in step with torch.utils.cpp_extension).
"$CUDA_HOME/bin/nvcc" -std=c++20 -O3 --expt-relaxed-constexpr -lineinfo -Xcompiler -fPIC \
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
  -D__CUDA_NO_HALF2_OPERATORS__ \
  -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90a,code=sm_90a \
  -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H \
  -Icsrc/include -Icsrc $inc -c "$src" -o "$out" ${NVCC_EXTRA:-}
echo "compiled $src -> $out"
