// Header-only core: shared by the CPU kernels (compiled by the host compiler) and the CUDA kernels
// (compiled by nvcc). No torch headers here: raw pointers, sizes and plain structs only.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define TAPS_HD __host__ __device__ __forceinline__
#define TAPS_DEVICE __device__ __forceinline__
#else
#define TAPS_HD inline
#define TAPS_DEVICE inline
#endif

// Kernel launch that the host emulation (tests/cpp/emu) can replace: TAPS_LAUNCH(kernel, grid, block,
// shared_bytes, stream, args...). `kernel` must be one token (take a pointer to a template instance).
#if defined(TAPS_CUDA_EMULATION)
#define TAPS_LAUNCH(kernel, grid, block, smem, stream, ...) emu_launch(kernel, grid, block, smem, __VA_ARGS__)
#else
#define TAPS_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#endif

namespace taps {

// Order-preserving map of a float to uint32 (a < b  <=>  key(a) < key(b), for non-NaN values),
// used by the radix threshold searches. -0.0 and +0.0 map to neighbouring keys.
TAPS_HD uint32_t float_to_ordered(float x) {
  union { float f; uint32_t u; } v{x};
  return (v.u & 0x80000000u) ? ~v.u : (v.u | 0x80000000u);
}
TAPS_HD float ordered_to_float(uint32_t k) {
  union { uint32_t u; float f; } v{(k & 0x80000000u) ? (k & 0x7fffffffu) : ~k};
  return v.f;
}

TAPS_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace taps
