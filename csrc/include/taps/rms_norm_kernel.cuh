// rms_norm, CUDA kernel (no torch headers) and its launcher. Launched by csrc/cuda/rms_norm.cu; compiled on
// the host by tests/cpp/test_emu_rms_norm.cpp under the CUDA emulation.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "taps/rms_norm.h"

namespace taps {
namespace norm {

constexpr int kRowsPerBlock = 4;  // one warp per row

// x, y: [rows, width] (row stride `stride` elements, last dimension contiguous); w: [groups, width]
// contiguous, row r using weight row r / rows_per_group. Each warp owns one row: lane j sums the squares
// of elements j, j + 32, ... (taps/rms_norm.h's order), the warp combines them with shuffle-down
// (offsets 16 .. 1, the order of norm::row), then every lane writes its elements.
template <int T>
__global__ void rms_norm_kernel(const void* __restrict__ x, const void* __restrict__ w, void* __restrict__ y,
                                int64_t rows, int64_t width, int64_t x_stride, int64_t y_stride,
                                int64_t rows_per_group, float eps) {
  const int lane = threadIdx.x % kLanes;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  if (r >= rows) return;
  const int64_t elem = T == kF32 ? 4 : 2;
  const char* xr = static_cast<const char*>(x) + r * x_stride * elem;
  const char* wr = static_cast<const char*>(w) + (r / rows_per_group) * width * elem;
  char* yr = static_cast<char*>(y) + r * y_stride * elem;
  float s = lane_sum_squares<T>(xr, width, lane);
  for (int off = kLanes / 2; off > 0; off /= 2) s = add(s, __shfl_down_sync(0xffffffffu, s, off));
  const float inv = inverse_rms(__shfl_sync(0xffffffffu, s, 0), width, eps);
  for (int64_t i = lane; i < width; i += kLanes) store_t<T>(yr, i, normed_t<T>(load_t<T>(xr, i), inv, load_t<T>(wr, i)));
}

template <int T>
cudaError_t launch_rms_norm(const void* x, const void* w, void* y, int64_t rows, int64_t width, int64_t x_stride,
                            int64_t y_stride, int64_t rows_per_group, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  auto* kernel = &rms_norm_kernel<T>;
  TAPS_LAUNCH(kernel, grid, kRowsPerBlock * kLanes, 0, stream, x, w, y, rows, width, x_stride, y_stride,
      rows_per_group, eps);
  return cudaGetLastError();
}

}  // namespace norm
}  // namespace taps
