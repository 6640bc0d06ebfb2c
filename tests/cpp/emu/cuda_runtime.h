// Host emulation of the CUDA features the taps kernels use, for testing their block-level logic
// (barriers, warp shuffles and ballots, shared-memory atomics, thread indexing, the m16n8k16 tensor-core
// mma, ldmatrix, cp.async) on a machine without a GPU. One OS thread per CUDA thread; the blocks of a
// grid run one after another, so `__shared__` variables become function-local statics shared by the
// threads of the running block, and the dynamic shared memory of a launch (TAPS_DYNAMIC_SHARED in
// taps/common.h) is one host buffer, refilled with garbage bytes before each block. Warp operations
// exchange values through a per-warp buffer between two warp barriers. Launches go through emu_launch
// (TAPS_LAUNCH in taps/common.h). Blocks may be 1-, 2- or 3-dimensional; the linear thread index x + y *
// bx + z * bx * by gives the warp, as on a GPU. A thread that returns early leaves the block's and its
// warp's barriers (like an exited CUDA thread).
//
// What it cannot show: memory-model or timing effects of real hardware (every barrier here is a full
// fence; warps never run ahead of each other inside a warp-synchronous section), performance, register
// or shared-memory limits beyond the opt-in size check below, fp32 rounding differences of the device
// math (`__expf` is expf, fmaf is the host's). Since blocks run one at a time, races between blocks
// (global-memory atomics across blocks, write-after-read across blocks) are never exercised. Only the
// features listed below exist; a kernel using anything else fails to compile.
//
// It is a test tool, included by tests/cpp/test_emu_*.cpp only (on the include path before the real CUDA
// headers, which are not present on a CPU machine anyway). It defines __CUDACC__ (not __CUDA_ARCH__)
// after including the standard headers, so the core headers compile both their host code and their CUDA
// kernels into the same test.
#pragma once
#define TAPS_CUDA_EMULATION 1

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <numbers>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__
#define __align__(n) alignas(n)

typedef int cudaError_t;
typedef void* cudaStream_t;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
// No-op: the emulated shared memory has no per-kernel limit (emu_launch checks the device's maximum).
template <class K>
cudaError_t cudaFuncSetAttribute(K, cudaFuncAttribute, int) {
  return cudaSuccess;
}

// One emulated device, one block per SM (only the launch plan's occupancy query asks).
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
template <class K>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, K, int, size_t) {
  *blocks = 1;
  return cudaSuccess;
}

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint2 {
  unsigned x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace taps_emu {
// Reusable barrier (mutex + condition variable). std::barrier of libstdc++ 12 waits on a 1-byte phase
// through a slow proxy (a whole test took a minute of mostly idle waiting); this one is plain.
class Barrier {
 public:
  explicit Barrier(unsigned count) : expected_(count) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t gen = generation_;
    if (++arrived_ == expected_) {
      complete();
    } else {
      cv_.wait(lock, [&] { return generation_ != gen; });
    }
  }
  // Arrives at the current phase and leaves all later ones (an exited thread).
  void arrive_and_drop() {
    std::lock_guard<std::mutex> lock(mutex_);
    --expected_;
    if (arrived_ == expected_ && expected_ > 0) complete();
  }

 private:
  void complete() {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  unsigned expected_, arrived_ = 0;
  uint64_t generation_ = 0;
};

// Largest dynamic shared memory a block may opt in to (H100 / H200: 227 KiB); a launch asking more
// would fail on the device, so emu_launch aborts.
constexpr size_t kMaxDynamicSharedBytes = 227 * 1024;

// One emulated block: its barriers, warp exchange slots and dynamic shared memory.
struct BlockState {
  std::unique_ptr<Barrier> block;
  std::vector<std::unique_ptr<Barrier>> warps;
  std::vector<uint64_t> exchange;        // one slot per thread
  std::vector<uint32_t> mma_words;       // mma_m16n8k16: 6 fragment words per thread
  std::atomic<int> reduce[3];            // __syncthreads_{or,and,count}: rotating slots
  std::vector<uint64_t> dynamic_shared;  // 8-byte words (16-byte alignment via operator new is enough)
};

struct State {
  size_t dynamic_bytes = 0;
  unsigned block_override = 0;  // see BlockSize
  size_t max_dynamic_bytes_seen = 0;
  // the blocks running now: one, or the blocks of one thread-block cluster
  std::vector<std::unique_ptr<BlockState>> blocks;
  std::unique_ptr<Barrier> cluster;
};
inline State state;
inline thread_local BlockState* cur = nullptr;  // the calling thread's block
inline thread_local unsigned cluster_rank_ = 0;
inline thread_local unsigned linear_tid = 0;
inline thread_local unsigned reduce_calls = 0;

// Forces every launch in its scope to `threads` threads per block (1-D). Valid only for kernels that
// use blockDim rather than a compile-time thread count (e.g. build_tree / merge_trees, whose real
// launch uses 512 threads: 512 OS threads per block would be slow here).
struct BlockSize {
  unsigned saved;
  explicit BlockSize(unsigned threads) : saved(state.block_override) { state.block_override = threads; }
  ~BlockSize() { state.block_override = saved; }
};

inline void* dynamic_shared() { return cur->dynamic_shared.data(); }

// Thread-block clusters (emu_launch_cluster): barrier over all threads of the cluster, the block's
// rank, and distributed shared memory (a pointer into this block's dynamic shared memory mapped to the
// same offset in block `rank`'s). Static __shared__ variables are not per block here: cluster kernels
// must keep everything in dynamic shared memory.
inline void cluster_sync() { state.cluster->arrive_and_wait(); }
inline unsigned cluster_rank() { return cluster_rank_; }
template <class T>
T* cluster_map(T* p, unsigned rank) {
  const char* base = reinterpret_cast<const char*>(cur->dynamic_shared.data());
  const ptrdiff_t offset = reinterpret_cast<const char*>(p) - base;
  if (offset < 0 || size_t(offset) >= state.dynamic_bytes || rank >= state.blocks.size()) {
    std::fprintf(stderr, "cluster_map: pointer outside dynamic shared memory or rank %u out of range\n", rank);
    std::abort();
  }
  return reinterpret_cast<T*>(reinterpret_cast<char*>(state.blocks[rank]->dynamic_shared.data()) + offset);
}

inline unsigned warp_of_thread() { return linear_tid / 32; }
inline int lane() { return int(linear_tid % 32); }

template <class T>
T warp_exchange(T v, int src_lane, bool valid) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>, "warp value type");
  const unsigned w = warp_of_thread();
  uint64_t raw = 0;
  std::memcpy(&raw, &v, sizeof(T));
  cur->exchange[linear_tid] = raw;
  cur->warps[w]->arrive_and_wait();
  T out = v;
  if (valid) std::memcpy(&out, &cur->exchange[size_t(w * 32 + unsigned(src_lane))], sizeof(T));
  cur->warps[w]->arrive_and_wait();
  return out;
}

// Warp-wide mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 with D = C (d += A B),
// fragments laid out as the PTX ISA specifies ("Matrix Fragments for mma.m16n8k16 with floating point
// type"); lane = 4 * g + t (g = groupID, t = threadID_in_group); element pairs pack low half first:
//   A (16 x 16, 4 words): a[0] rows g, cols 2t, 2t+1; a[1] row g+8, cols 2t, 2t+1;
//                         a[2] row g, cols 2t+8, 2t+9; a[3] row g+8, cols 2t+8, 2t+9.
//   B (16 x 8, 2 words):  b[0] rows 2t, 2t+1 of col g; b[1] rows 2t+8, 2t+9 of col g.
//   C / D (16 x 8 fp32):  d[0], d[1] row g, cols 2t, 2t+1; d[2], d[3] row g+8, cols 2t, 2t+1.
// `to_float` converts one 16-bit element. Products are summed in float in k order (the tensor core's
// internal order and rounding are not specified; the tests allow for that).
template <class ToFloat>
void mma_m16n8k16(float* d, const uint32_t* a, const uint32_t* b, ToFloat to_float) {
  const unsigned w = warp_of_thread();
  uint32_t* mine = cur->mma_words.data() + size_t(linear_tid) * 6;
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b[0];
  mine[5] = b[1];
  cur->warps[w]->arrive_and_wait();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const uint32_t* f = cur->mma_words.data() + size_t(w * 32 + unsigned(l)) * 6;
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1);
      A[row][col] = to_float(uint16_t(f[i] & 0xffffu));
      A[row][col + 1] = to_float(uint16_t(f[i] >> 16));
    }
    for (int i = 0; i < 2; ++i) {
      B[2 * t + 8 * i][g] = to_float(uint16_t(f[4 + i] & 0xffffu));
      B[2 * t + 8 * i + 1][g] = to_float(uint16_t(f[4 + i] >> 16));
    }
  }
  cur->warps[w]->arrive_and_wait();
  const int g = lane() / 4, t = lane() % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    float sum = d[i];
    for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
    d[i] = sum;
  }
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l supplies the address of row l % 8 of 8x8
// matrix l / 8 (16 bytes of 16-bit elements); lane l receives in r[m] the element pair of matrix m at
// row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1, or with .trans the pair at rows 2 (l % 4) and
// 2 (l % 4) + 1 of column l / 4 (low half first).
inline void check_aligned16(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    std::fprintf(stderr, "%s: address %p is not 16-byte aligned\n", what, p);
    std::abort();
  }
}
inline bool in_dynamic_shared(const void* p, size_t bytes) {
  const char* base = reinterpret_cast<const char*>(cur->dynamic_shared.data());
  const char* c = reinterpret_cast<const char*>(p);
  return c >= base && c + bytes <= base + state.dynamic_bytes;
}
inline void ldmatrix_x4(uint32_t* r, const void* row, bool trans) {
  check_aligned16(row, "ldmatrix");
  if (!in_dynamic_shared(row, 16)) {
    std::fprintf(stderr, "ldmatrix: row address outside the block's dynamic shared memory\n");
    std::abort();
  }
  const unsigned w = warp_of_thread();
  cur->exchange[linear_tid] = reinterpret_cast<uint64_t>(row);
  cur->warps[w]->arrive_and_wait();
  const int l = lane();
  auto at = [&](int m, int i, int j) {  // element (i, j) of matrix m
    const auto* p = reinterpret_cast<const uint16_t*>(cur->exchange[size_t(w * 32 + unsigned(m * 8 + i))]);
    return uint32_t(p[j]);
  };
  for (int m = 0; m < 4; ++m) {
    const int a = l / 4, b = 2 * (l % 4);
    r[m] = trans ? (at(m, b, a) | (at(m, b + 1, a) << 16)) : (at(m, a, b) | (at(m, a, b + 1) << 16));
  }
  cur->warps[w]->arrive_and_wait();
}

// cp.async.cg.shared.global (16 bytes), commit_group and wait_group: the copies a thread issued are
// done, oldest group first, when it waits; until then the destination holds garbage (0xA5 bytes,
// written at issue). So a read before the wait and barrier, or an issue into a buffer other threads
// still read, gives wrong values, as it may on a GPU.
struct AsyncCopy {
  void* dst;
  const void* src;
};
inline thread_local std::vector<AsyncCopy> async_open;                 // issued, not committed
inline thread_local std::vector<std::vector<AsyncCopy>> async_groups;  // committed, oldest first
inline void cp_async16(void* dst, const void* src) {
  check_aligned16(dst, "cp.async destination");
  check_aligned16(src, "cp.async source");
  if (!in_dynamic_shared(dst, 16)) {
    std::fprintf(stderr, "cp.async: destination outside the block's dynamic shared memory\n");
    std::abort();
  }
  std::memset(dst, 0xA5, 16);
  async_open.push_back({dst, src});
}
inline void cp_async_commit() {
  async_groups.push_back(std::move(async_open));
  async_open.clear();
}
inline void cp_async_wait(int pending) {
  while (int(async_groups.size()) > pending) {
    for (const AsyncCopy& c : async_groups.front()) std::memcpy(c.dst, c.src, 16);
    async_groups.erase(async_groups.begin());
  }
}

// Block-wide reduction with one barrier: call k accumulates into slot k % 3 and clears slot
// (k + 1) % 3, whose last readers (call k - 2) finished before the barrier of call k - 1.
enum class Reduce { kOr, kAnd, kCount };
inline int block_reduce(int pred, Reduce op) {
  const unsigned k = reduce_calls++;
  std::atomic<int>& slot = cur->reduce[k % 3];
  if (op == Reduce::kAnd) {
    if (!pred) slot.fetch_add(1);  // counts the false predicates
  } else if (pred) {
    slot.fetch_add(1);
  }
  if (linear_tid == 0) cur->reduce[(k + 1) % 3].store(0);
  cur->block->arrive_and_wait();
  const int n = slot.load();
  switch (op) {
    case Reduce::kOr: return n != 0;
    case Reduce::kAnd: return n == 0;
    default: return n;
  }
}
}  // namespace taps_emu

inline void __syncthreads() { taps_emu::cur->block->arrive_and_wait(); }
inline int __syncthreads_or(int pred) { return taps_emu::block_reduce(pred, taps_emu::Reduce::kOr); }
inline int __syncthreads_and(int pred) { return taps_emu::block_reduce(pred, taps_emu::Reduce::kAnd); }
inline int __syncthreads_count(int pred) { return taps_emu::block_reduce(pred, taps_emu::Reduce::kCount); }
// Full-warp barrier only (the mask is ignored).
inline void __syncwarp(unsigned = 0xffffffffu) {
  taps_emu::cur->warps[taps_emu::warp_of_thread()]->arrive_and_wait();
}

// Shuffles: width 32 only; the mask is ignored (all 32 lanes must take part, as the kernels do).
template <class T>
T __shfl_down_sync(unsigned, T v, int delta) {
  const int lane = taps_emu::lane();
  return taps_emu::warp_exchange(v, lane + delta, lane + delta < 32);
}
template <class T>
T __shfl_up_sync(unsigned, T v, int delta) {
  const int lane = taps_emu::lane();
  return taps_emu::warp_exchange(v, lane - delta, lane - delta >= 0);
}
template <class T>
T __shfl_sync(unsigned, T v, int src) {
  return taps_emu::warp_exchange(v, src & 31, true);
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  return taps_emu::warp_exchange(v, (taps_emu::lane() ^ lane_mask) & 31, true);
}
inline unsigned __ballot_sync(unsigned, int pred) {
  using taps_emu::cur;
  const unsigned w = taps_emu::warp_of_thread();
  cur->exchange[taps_emu::linear_tid] = pred ? 1 : 0;
  cur->warps[w]->arrive_and_wait();
  unsigned bits = 0;
  for (unsigned l = 0; l < 32; ++l) bits |= unsigned(cur->exchange[size_t(w * 32 + l)] != 0) << l;
  cur->warps[w]->arrive_and_wait();
  return bits;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __expf(float x) { return std::exp(x); }

// Atomics (on shared or global memory alike), returning the old value as CUDA does.
inline float atomicAdd(float* p, float v) {
  std::atomic_ref<float> a(*p);
  float old = a.load();
  while (!a.compare_exchange_weak(old, old + v)) {
  }
  return old;
}
template <class T>
T atomic_min_max_(T* p, T v, bool is_min) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while ((is_min ? v < old : v > old) && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
inline int atomicMin(int* p, int v) { return atomic_min_max_(p, v, true); }
inline unsigned atomicMin(unsigned* p, unsigned v) { return atomic_min_max_(p, v, true); }
inline int atomicMax(int* p, int v) { return atomic_min_max_(p, v, false); }
inline unsigned atomicMax(unsigned* p, unsigned v) { return atomic_min_max_(p, v, false); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline unsigned atomicOr(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_or(v); }
inline unsigned long long atomicOr(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).fetch_or(v);
}
inline int atomicCAS(int* p, int compare, int v) {
  std::atomic_ref<int>(*p).compare_exchange_strong(compare, v);
  return compare;  // the old value (compare_exchange writes it back on failure)
}
inline unsigned atomicCAS(unsigned* p, unsigned compare, unsigned v) {
  std::atomic_ref<unsigned>(*p).compare_exchange_strong(compare, v);
  return compare;
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long compare, unsigned long long v) {
  std::atomic_ref<unsigned long long>(*p).compare_exchange_strong(compare, v);
  return compare;
}

// Runs kernel(args...) over the `grid` blocks, `cluster` blocks at a time (the blocks of one thread-
// block cluster run together; clusters run one after another), one OS thread per CUDA thread;
// `smem` bytes of dynamic shared memory per block, filled with the byte 0xA5 before every block (a
// kernel that reads shared memory it did not write sees garbage, as on a GPU).
template <class K, class... A>
cudaError_t emu_launch_cluster(K kernel, dim3 grid, dim3 block, size_t smem, int cluster, A... args) {
  using taps_emu::state;
  if (state.block_override) block = dim3(state.block_override);
  const unsigned threads = block.x * block.y * block.z;
  if (threads == 0 || threads % 32 != 0 || threads > 1024) {
    std::fprintf(stderr, "emu_launch: %u threads per block (need a multiple of 32, at most 1024)\n", threads);
    std::abort();
  }
  if (smem > taps_emu::kMaxDynamicSharedBytes) {
    std::fprintf(stderr, "emu_launch: %zu bytes of dynamic shared memory (device maximum %zu)\n", smem,
                 taps_emu::kMaxDynamicSharedBytes);
    std::abort();
  }
  if (cluster < 1 || cluster > 8 || grid.x % unsigned(cluster) != 0 || grid.y != 1 || grid.z != 1) {
    if (cluster != 1) {
      std::fprintf(stderr, "emu_launch_cluster: cluster of %d blocks with grid %u x %u x %u\n", cluster, grid.x,
                   grid.y, grid.z);
      std::abort();
    }
  }
  state.max_dynamic_bytes_seen = std::max(state.max_dynamic_bytes_seen, smem);
  blockDim = block;
  gridDim = grid;
  state.dynamic_bytes = smem;
  const unsigned per = unsigned(cluster);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned first = 0; first < grid.x; first += per) {
        state.blocks.clear();
        for (unsigned r = 0; r < per; ++r) {
          auto b = std::make_unique<taps_emu::BlockState>();
          b->block = std::make_unique<taps_emu::Barrier>(threads);
          for (unsigned w = 0; w < threads / 32; ++w) b->warps.push_back(std::make_unique<taps_emu::Barrier>(32));
          b->exchange.assign(threads, 0);
          b->mma_words.assign(size_t(threads) * 6, 0);
          for (auto& x : b->reduce) x.store(0);
          b->dynamic_shared.assign((smem + 7) / 8 + 2, 0);
          std::memset(b->dynamic_shared.data(), 0xA5, b->dynamic_shared.size() * 8);
          state.blocks.push_back(std::move(b));
        }
        state.cluster = std::make_unique<taps_emu::Barrier>(threads * per);
        std::vector<std::thread> pool;
        pool.reserve(threads * per);
        for (unsigned r = 0; r < per; ++r) {
          for (unsigned t = 0; t < threads; ++t) {
            pool.emplace_back([&, r, t] {
              taps_emu::cur = state.blocks[r].get();
              taps_emu::cluster_rank_ = r;
              taps_emu::linear_tid = t;
              taps_emu::reduce_calls = 0;
              threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
              blockIdx = dim3(first + r, by, bz);
              taps_emu::async_open.clear();
              taps_emu::async_groups.clear();
              kernel(args...);
              if (!taps_emu::async_open.empty() || !taps_emu::async_groups.empty()) {
                std::fprintf(stderr, "emu_launch: a thread exited with cp.async copies not waited for\n");
                std::abort();
              }
              // An exited thread no longer takes part in barriers (as on the GPU since Volta).
              taps_emu::cur->warps[t / 32]->arrive_and_drop();
              taps_emu::cur->block->arrive_and_drop();
              state.cluster->arrive_and_drop();
            });
          }
        }
        for (auto& th : pool) th.join();
      }
  return cudaSuccess;
}

template <class K, class... A>
void emu_launch(K kernel, dim3 grid, dim3 block, size_t smem, A... args) {
  emu_launch_cluster(kernel, grid, block, smem, 1, args...);
}

#if !defined(__CUDACC__)
#define __CUDACC__ 1  // after the standard headers above (glibc / libstdc++ test it)
#endif
