// compact_kv, CUDA kernel (no torch headers) and its launcher. Launched by csrc/cuda/compact_kv.cu;
// compiled on the host by tests/cpp/test_emu_attention.cpp under the CUDA emulation.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "taps/compact_kv.h"

namespace taps {
namespace compact {

// One cache tensor [B, H, S, D] viewed as rows of `row_units` units of type U (U = a
// 1..16 byte word chosen by alignment). Grid (ceil(row_units / blockDim.x), H, B): each thread owns
// some unit columns of one (b, h) and walks the path in increasing order, so every source row is
// read before any write of that column could overwrite it (dst j = prefix + j < prefix + path[k]
// for all k > j since the path is strictly increasing from 0; equal positions are skipped).
// Invalid paths (see path_length in taps/compact_kv.h) are left untouched: never an out-of-bounds access.
template <class U>
__global__ void compact_kv_kernel(U* __restrict__ cache, int64_t stride_b, int64_t stride_h, int64_t stride_s,
                                  int64_t row_units, int64_t cache_len, const int64_t* __restrict__ path,
                                  int64_t path_cols, const int64_t* __restrict__ prefix_lens) {
  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t* pb = path + b * path_cols;
  const int64_t prefix = prefix_lens[b];
  const int64_t n = path_length(pb, path_cols, prefix, cache_len);
  if (col >= row_units || n <= 0) return;
  U* base = cache + b * stride_b + h * stride_h + col;
  for (int64_t j = 1; j < n; ++j) {
    if (pb[j] == j) continue;
    base[(prefix + j) * stride_s] = base[(prefix + pb[j]) * stride_s];
  }
}

// Strides in units of U. Launches nothing when there is nothing to move.
template <class U>
cudaError_t launch_compact_kv(U* cache, int64_t batch, int64_t heads, int64_t cache_len, int64_t row_units,
                              int64_t stride_b, int64_t stride_h, int64_t stride_s, const int64_t* path,
                              int64_t path_cols, const int64_t* prefix_lens, cudaStream_t stream) {
  if (batch == 0 || heads == 0 || row_units == 0 || path_cols <= 1) return cudaSuccess;
  const int threads = row_units >= 128 ? 128 : 32;
  dim3 grid(static_cast<unsigned>((row_units + threads - 1) / threads), static_cast<unsigned>(heads),
            static_cast<unsigned>(batch));
  auto* kernel = &compact_kv_kernel<U>;
  TAPS_LAUNCH(kernel, grid, threads, 0, stream, cache, stride_b, stride_h, stride_s, row_units, cache_len,
      path, path_cols, prefix_lens);
  return cudaGetLastError();
}

}  // namespace compact
}  // namespace taps
