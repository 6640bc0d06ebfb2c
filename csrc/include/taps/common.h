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

// A launch whose blocks form thread-block clusters of `cluster` blocks along x (sm_90+), returning the
// launch's cudaError_t: TAPS_LAUNCH_CLUSTER(kernel, grid, block, smem, stream, cluster, args...).
#if defined(TAPS_CUDA_EMULATION)
#define TAPS_LAUNCH_CLUSTER(kernel, grid, block, smem, stream, cluster, ...) \
  emu_launch_cluster(kernel, grid, block, smem, cluster, __VA_ARGS__)
#elif defined(__CUDACC__)
template <class Kernel, class... Args>
inline cudaError_t taps_launch_cluster(Kernel kernel, unsigned grid, unsigned block, size_t smem,
                                       cudaStream_t stream, int cluster, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = unsigned(cluster);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}
#define TAPS_LAUNCH_CLUSTER(kernel, grid, block, smem, stream, cluster, ...) \
  taps_launch_cluster(kernel, grid, block, smem, stream, cluster, __VA_ARGS__)
#endif

// Dynamic shared memory of a kernel, 16-byte aligned, sized by the launch: TAPS_DYNAMIC_SHARED(type, name)
// declares `type name[]` (a pointer to the emulation's per-block buffer under the host emulation, where
// `extern __shared__` cannot be expressed: its `__shared__` is `static`).
#if defined(TAPS_CUDA_EMULATION)
#define TAPS_DYNAMIC_SHARED(type, name) type* const name = static_cast<type*>(taps_emu::dynamic_shared())
#else
#define TAPS_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]
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

// Errors of the data checks, one encoding for every op. Each op numbers its error codes from 1 (its
// `Error` enum; kOk = 0 says "this element is fine"); a request's error is the encoding
// `index * kErrorStride + code` of its first bad element (a node, a candidate, ...), or kNoError when
// there is none. A smaller encoding is an earlier element, so the CPU loops stop at the first error and
// CUDA kernels that check elements in parallel keep the same one with atomicMin.
constexpr int32_t kOk = 0;
constexpr int32_t kErrorStride = 16;
constexpr int32_t kNoError = 0x7fffffff;
TAPS_HD int32_t encode_error(int64_t index, int32_t code) { return int32_t(index) * kErrorStride + code; }
TAPS_HD int32_t error_code(int32_t encoded) { return encoded % kErrorStride; }
TAPS_HD int64_t error_index(int32_t encoded) { return encoded / kErrorStride; }

}  // namespace taps
