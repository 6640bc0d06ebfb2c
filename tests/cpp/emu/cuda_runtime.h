// Host emulation of the CUDA features the taps kernels use, for testing their block-level logic
// (barriers, warp shuffles and ballots, shared-memory atomics, thread indexing) on a machine without a
// GPU. One OS thread per CUDA thread; the blocks of a grid run one after another, so `__shared__`
// variables become function-local statics shared by the threads of the running block. Warp
// operations exchange values through a per-warp buffer between two warp barriers.
//
// What it cannot show: memory-model or timing effects of real hardware, performance, shared-memory
// limits. It is a test tool, included by tests/cpp/test_emu_*.cpp only (on the include path before the
// real CUDA headers, which are not present on a CPU machine anyway).
#pragma once
#define TAPS_CUDA_EMULATION 1

#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
#define __restrict__

typedef int cudaError_t;
typedef void* cudaStream_t;
constexpr cudaError_t cudaSuccess = 0;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint4 {
  unsigned x, y, z, w;
};

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace taps_emu {
struct State {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<uint64_t> exchange;  // one slot per thread
};
inline State state;

template <class T>
T warp_exchange(T v, int src_lane, bool valid) {
  const int w = int(threadIdx.x) / 32;
  uint64_t raw = 0;
  std::memcpy(&raw, &v, sizeof(T));
  state.exchange[threadIdx.x] = raw;
  state.warps[w]->arrive_and_wait();
  T out = v;
  if (valid) std::memcpy(&out, &state.exchange[size_t(w * 32 + src_lane)], sizeof(T));
  state.warps[w]->arrive_and_wait();
  return out;
}
}  // namespace taps_emu

inline void __syncthreads() { taps_emu::state.block->arrive_and_wait(); }

template <class T>
T __shfl_down_sync(unsigned, T v, int delta) {
  const int lane = int(threadIdx.x) % 32;
  return taps_emu::warp_exchange(v, lane + delta, lane + delta < 32);
}
template <class T>
T __shfl_up_sync(unsigned, T v, int delta) {
  const int lane = int(threadIdx.x) % 32;
  return taps_emu::warp_exchange(v, lane - delta, lane - delta >= 0);
}
template <class T>
T __shfl_sync(unsigned, T v, int src) {
  return taps_emu::warp_exchange(v, src & 31, true);
}
inline unsigned __ballot_sync(unsigned, int pred) {
  const int w = int(threadIdx.x) / 32;
  taps_emu::state.exchange[threadIdx.x] = pred ? 1 : 0;
  taps_emu::state.warps[w]->arrive_and_wait();
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= unsigned(taps_emu::state.exchange[size_t(w * 32 + l)] != 0) << l;
  taps_emu::state.warps[w]->arrive_and_wait();
  return bits;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float atomicAdd(float* p, float v) {
  std::atomic_ref<float> a(*p);
  float old = a.load();
  while (!a.compare_exchange_weak(old, old + v)) {
  }
  return old;
}
inline int atomicMin(int* p, int v) {
  std::atomic_ref<int> a(*p);
  int old = a.load();
  while (v < old && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}

// Runs kernel(args...) over `grid` blocks of `block` threads, block after block.
template <class K, class... A>
void emu_launch(K kernel, dim3 grid, dim3 block, size_t, A... args) {
  using taps_emu::state;
  const unsigned threads = block.x;
  if (threads % 32 != 0) {
    std::fprintf(stderr, "emu_launch: block size must be a multiple of 32\n");
    std::abort();
  }
  blockDim = block;
  gridDim = grid;
  state.block = std::make_unique<std::barrier<>>(threads);
  state.warps.clear();
  for (unsigned w = 0; w < threads / 32; ++w) state.warps.push_back(std::make_unique<std::barrier<>>(32));
  state.exchange.assign(threads, 0);
  for (unsigned b = 0; b < grid.x; ++b) {
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        threadIdx = dim3(t);
        blockIdx = dim3(b);
        kernel(args...);
      });
    }
    for (auto& th : pool) th.join();
  }
}
