// rope, CUDA kernel (no torch headers) and its launcher. Launched by csrc/cuda/rope.cu; compiled on the
// host by tests/cpp/test_emu_rope.cpp under the CUDA emulation.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "taps/rope.h"

namespace taps {
namespace rope {

// x: [R, T, H, D] elements with strides (sr, st, sh, 1); cos, sin: [R, T, D] with strides (cr, ct, 1)
// (one table row per token, shared by its H heads). One thread per (r, t, h, pair): grid-stride over
// R * T * H * (D / 2) pairs.
template <int T>
__global__ void rope_kernel(void* __restrict__ x, const void* __restrict__ cos, const void* __restrict__ sin,
                            int64_t rows, int64_t tokens, int64_t heads, int64_t dim, int64_t sr, int64_t st,
                            int64_t sh, int64_t cr, int64_t ct) {
  constexpr int64_t elem = T == kF32 ? 4 : 2;
  const int64_t half = dim / 2, total = rows * tokens * heads * half;
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; n < total;
       n += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = n % half, h = (n / half) % heads, t = (n / (half * heads)) % tokens,
                  r = n / (half * heads * tokens);
    char* xr = static_cast<char*>(x) + (r * sr + t * st + h * sh) * elem;
    const int64_t table = (r * cr + t * ct) * elem;
    rotate_pair<T>(xr, static_cast<const char*>(cos) + table, static_cast<const char*>(sin) + table, i, half);
  }
}

template <int T>
cudaError_t launch_rope(void* x, const void* cos, const void* sin, int64_t rows, int64_t tokens, int64_t heads,
                        int64_t dim, int64_t sr, int64_t st, int64_t sh, int64_t cr, int64_t ct, cudaStream_t stream) {
  const int64_t total = rows * tokens * heads * (dim / 2);
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t want = (total + threads - 1) / threads;
  const unsigned grid = static_cast<unsigned>(want < 65535 ? want : 65535);
  auto* kernel = &rope_kernel<T>;
  TAPS_LAUNCH(kernel, grid, threads, 0, stream, x, cos, sin, rows, tokens, heads, dim, sr, st, sh, cr, ct);
  return cudaGetLastError();
}

}  // namespace rope
}  // namespace taps
