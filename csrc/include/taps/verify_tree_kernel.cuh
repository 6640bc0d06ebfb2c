// verify_tree, CUDA kernel templates (no torch headers): the block-parallel row backend and the
// kernels that run the core walk (taps/verify_tree.h) with one thread block per request. Launched by
// csrc/cuda/verify_tree.cu; compiled on the host by tests/cpp/test_emu_verify.cpp under a CUDA
// emulation header to test the block logic without a GPU.
//
// Work per request: the visited rows only (accepted path + 1). Floor: bytes = visited rows x V x
// sizeof(logit) at HBM bandwidth. Passes over a visited row: greedy 1 (max + argmax); sampling 2 (max,
// sum of exp) + 4 radix passes each for top-k and top-p + 1 scan when the draw rejects every child;
// the extra passes usually hit L2 (a 128k fp32 row is 512 KB).
// Small batches: on sm_90+ a cluster of up to 8 blocks shares each request's rows (ClusterOps), so a
// batch smaller than the SM count still spreads its rows over many SMs. Known limit: shared float
// atomics in the radix histogram.
#pragma once
#include <cuda_runtime.h>
#if !defined(TAPS_CUDA_EMULATION)
#include <cooperative_groups.h>
#endif

#include <cstdint>

#include "taps/verify_tree.h"

namespace taps {
namespace verify {

#ifndef TAPS_VERIFY_THREADS
#define TAPS_VERIFY_THREADS 512  // a multiple of 32; the host emulation test uses fewer
#endif
constexpr int kThreads = TAPS_VERIFY_THREADS;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxNodes = 1024;

// Up to 8 floats from one aligned 16-byte load.
template <typename scalar_t>
struct Vec16 {
  static constexpr int kElems = 16 / sizeof(scalar_t);
  __device__ static void load(const scalar_t* p, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    if constexpr (sizeof(scalar_t) == 4) {
      out[0] = __uint_as_float(raw.x);
      out[1] = __uint_as_float(raw.y);
      out[2] = __uint_as_float(raw.z);
      out[3] = __uint_as_float(raw.w);
    } else {
      const scalar_t* e = reinterpret_cast<const scalar_t*>(&raw);
#pragma unroll
      for (int i = 0; i < kElems; ++i) out[i] = float(e[i]);
    }
  }
};

// Calls f(v, x) for every element v in [lo, hi) of a row assigned to this thread: a scalar head up to
// 16-byte alignment, 16-byte vector loads (thread-strided, coalesced), a scalar tail.
template <typename scalar_t, class F>
__device__ __forceinline__ void for_each_element(const scalar_t* row, int64_t lo, int64_t hi, F&& f) {
  constexpr int kE = Vec16<scalar_t>::kElems;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(row + lo);
  int64_t head = lo + int64_t(((16 - (addr & 15)) & 15) / sizeof(scalar_t));
  if ((addr % sizeof(scalar_t)) != 0) head = hi;  // not even element-aligned: all scalar
  if (head > hi) head = hi;
  for (int64_t v = lo + threadIdx.x; v < head; v += kThreads) f(v, float(row[v]));
  const int64_t body = (hi - head) / kE;
  const scalar_t* base = row + head;
  for (int64_t j = threadIdx.x; j < body; j += kThreads) {
    float x[kE];
    Vec16<scalar_t>::load(base + j * kE, x);
#pragma unroll
    for (int i = 0; i < kE; ++i) f(head + j * kE + i, x[i]);
  }
  for (int64_t v = head + body * kE + threadIdx.x; v < hi; v += kThreads) f(v, float(row[v]));
}

struct SharedReduce {
  float f[kWarps];
  int64_t i[kWarps];
  int32_t flags[kWarps];
  RowScan scan;
  float total;
  FindResult found;
  int32_t count;
  int32_t first_thread;
  float exclusive[kThreads];
};

// Block-parallel row backend: every thread of the block participates in each call, and every thread
// gets the same result. The row operations cover the slice [lo, hi) of the vocabulary (the whole row
// for a block per request; one block's part when a thread-block cluster shares a row).
struct BlockOps {
  bool kLeader;
  SharedReduce* red;
  int64_t lo, hi;

  __device__ void sync() const { __syncthreads(); }

  __device__ int32_t collect_children(const int64_t* parents, int64_t n, int64_t cur, int32_t* out) const {
    // Ordered stream compaction of {i : parents[i] == cur, cur < i < n}: warp ballots, warp offsets.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int32_t base = 0;
    for (int64_t tile = cur + 1; tile < n; tile += kThreads) {
      const int64_t i = tile + threadIdx.x;
      const bool child = i < n && parents[i] == cur;
      const unsigned ballot = __ballot_sync(0xffffffffu, child);
      __syncthreads();  // red->i is free
      if (lane == 0) red->i[warp] = __popc(ballot);
      __syncthreads();
      int32_t offset = base;
      for (int w = 0; w < warp; ++w) offset += int32_t(red->i[w]);
      if (child) out[offset + __popc(ballot & ((1u << lane) - 1u))] = int32_t(i);
      for (int w = 0; w < kWarps; ++w) base += int32_t(red->i[w]);
    }
    __syncthreads();
    return base;
  }

  __device__ static RowScan shfl_scan(RowScan s, int delta) {
    RowScan o;
    o.max = __shfl_down_sync(0xffffffffu, s.max, delta);
    o.argmax = __shfl_down_sync(0xffffffffu, s.argmax, delta);
    o.flags = __shfl_down_sync(0xffffffffu, s.flags, delta);
    return o;
  }

  template <typename scalar_t>
  __device__ RowScan max_scan(const scalar_t* row, int64_t) const {
    RowScan s = verify::scan_identity();
    for_each_element(row, lo, hi, [&](int64_t v, float x) { s = verify::combine_scan(s, verify::scan_one(x, v)); });
    for (int d = 16; d > 0; d >>= 1) s = verify::combine_scan(s, shfl_scan(s, d));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
      red->f[warp] = s.max;
      red->i[warp] = s.argmax;
      red->flags[warp] = s.flags;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      RowScan r = verify::scan_identity();
      for (int w = 0; w < kWarps; ++w) r = verify::combine_scan(r, RowScan{red->f[w], red->i[w], red->flags[w]});
      red->scan = r;
    }
    __syncthreads();
    return red->scan;
  }

  __device__ float block_sum(float x) const {
    for (int d = 16; d > 0; d >>= 1) x += __shfl_down_sync(0xffffffffu, x, d);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red->f[warp] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
      float t = 0.0f;
      for (int w = 0; w < kWarps; ++w) t += red->f[w];
      red->total = t;
    }
    __syncthreads();
    return red->total;
  }

  template <typename scalar_t>
  __device__ float sum_target(const scalar_t* row, int64_t, const Target& t) const {
    float acc = 0.0f;
    for_each_element(row, lo, hi, [&](int64_t, float x) { acc += verify::target_weight(t, x); });
    return block_sum(acc);
  }

  template <class G>
  __device__ float sum(int64_t, const G& g) const {
    float acc = 0.0f;
    for (int64_t v = lo + threadIdx.x; v < hi; v += kThreads) acc += g(v);
    return block_sum(acc);
  }

  template <class KeyFn, class G>
  __device__ void histogram(int64_t, const KeyFn& key, const G& g, int shift, uint32_t prefix,
                            float* bins) const {
    __syncthreads();  // every thread has finished reading the previous bins
    for (int d = threadIdx.x; d < 256; d += kThreads) bins[d] = 0.0f;
    __syncthreads();
    const uint32_t high_mask = shift >= 24 ? 0u : uint32_t((~uint64_t(0) << (shift + 8)) & 0xffffffffu);
    for (int64_t v = lo + threadIdx.x; v < hi; v += kThreads) {
      const uint32_t k = key(v);
      if ((k & high_mask) != (prefix & high_mask)) continue;
      const float w = g(v);
      if (w != 0.0f) atomicAdd(&bins[(k >> shift) & 255u], w);
    }
    __syncthreads();
  }

  // First v whose running sum of g exceeds t: each thread sums a contiguous chunk, a block exclusive
  // scan of the chunk sums finds the crossing chunk, whose thread rescans it.
  template <class Row>
  __device__ FindResult scan_find_target(const Row& row, int64_t vocab, const Target& t, const verify::Scratch& s,
                                      int32_t distinct, float x) const {
    return verify::scan_find_target_generic(*this, row, vocab, t, s, distinct, x);
  }

  template <class G>
  __device__ FindResult scan_find(int64_t, const G& g, float t) const {
    const int64_t chunk = (hi - lo + kThreads - 1) / kThreads;
    const int64_t c_lo = lo + int64_t(threadIdx.x) * chunk;
    const int64_t c_hi = c_lo + chunk < hi ? c_lo + chunk : hi;
    float local = 0.0f;
    int64_t last = -1;
    for (int64_t v = c_lo; v < c_hi; ++v) {
      const float w = g(v);
      if (w > 0.0f) {
        local += w;
        last = v;
      }
    }
    // exclusive scan of `local` over threads
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float incl = local;
    for (int d = 1; d < 32; d <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += y;
    }
    __syncthreads();
    if (lane == 31) red->f[warp] = incl;
    if (threadIdx.x == 0) {
      red->first_thread = kThreads;
      red->found = FindResult{-1, -1};
    }
    __syncthreads();
    float warp_base = 0.0f;
    for (int w = 0; w < warp; ++w) warp_base += red->f[w];
    const float excl = warp_base + incl - local;
    if (local > 0.0f && excl + local > t) atomicMin(&red->first_thread, int(threadIdx.x));
    // last positive v over the block (`last` is reduced in place: the rescan below does not need it)
    for (int d = 16; d > 0; d >>= 1) {
      const int64_t o = __shfl_down_sync(0xffffffffu, last, d);
      last = o > last ? o : last;
    }
    __syncthreads();
    if (lane == 0) red->i[warp] = last;
    __syncthreads();
    if (int(threadIdx.x) == red->first_thread) {
      // Rescan the crossing chunk sequentially; if rounding keeps the running sum at or below t, take
      // the chunk's last positive token (the crossing is within rounding of its end).
      float acc = excl;
      int64_t pick = -1, chunk_last = -1;
      for (int64_t v = c_lo; v < c_hi && pick < 0; ++v) {
        const float w = g(v);
        if (w > 0.0f) {
          chunk_last = v;
          acc += w;
          if (t < acc) pick = v;
        }
      }
      red->found.first = pick >= 0 ? pick : chunk_last;
    }
    if (threadIdx.x == 0) {
      int64_t m = -1;
      for (int w = 0; w < kWarps; ++w) m = red->i[w] > m ? red->i[w] : m;
      red->found.last = m;
    }
    __syncthreads();
    return red->found;
  }
};

// errors [B] int32: per-request checks (validate=True), one thread per request.
static __global__ void verify_check_kernel(const int64_t* tokens, const int64_t* parents, const float* uniforms,
                                    const float* temperature, const int64_t* top_k, const float* top_p,
                                    int64_t batch, int64_t n, int64_t vocab, int32_t* errors) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  errors[b] = verify::check_request(tokens + b * n, parents + b * n, uniforms + b * n, n, vocab, temperature[b],
                                    top_k[b], top_p[b]);
}

// Shared memory of one block: the walk's scratch, reductions and state, plus the exchange area read by
// the other blocks of a cluster.
struct ClusterExchange {
  RowScan scan, scan_result;
  float f, f_result;
  FindResult found, found_result;
  float hist[256];
};

struct VerifySmem {
  int32_t child_idx[kMaxNodes];
  int32_t sorted_tokens[kMaxNodes];
  float residual_z[kMaxNodes];
  float bins[256];
  uint8_t first_of_token[kMaxNodes];
  SharedReduce red;
  ClusterExchange x;
  verify::WalkState st;
};

// Thread-block cluster primitives (sm_90+; the cluster kernel is never launched on older GPUs).
__device__ __forceinline__ void cluster_sync() {
#if defined(TAPS_CUDA_EMULATION)
  taps_emu::cluster_sync();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#else
  __trap();
#endif
}
__device__ __forceinline__ unsigned cluster_rank() {
#if defined(TAPS_CUDA_EMULATION)
  return taps_emu::cluster_rank();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().block_rank();
#else
  return 0;
#endif
}
template <class T>
__device__ __forceinline__ T* cluster_map(T* p, unsigned rank) {
#if defined(TAPS_CUDA_EMULATION)
  return taps_emu::cluster_map(p, rank);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(p, rank);
#else
  return p;
#endif
}

// Row backend for a row shared by the `size` blocks of a cluster: each block reduces its slice with
// BlockOps, then the slices' partials are combined in rank order through distributed shared memory, so
// every block gets bitwise the same result and keeps an identical copy of the walk state (its thread 0
// is a leader; the blocks write identical outputs). Children lists are built by each block alone.
struct ClusterOps {
  bool kLeader;
  BlockOps block;
  ClusterExchange* x;
  unsigned rank, size;

  __device__ void sync() const { __syncthreads(); }

  __device__ int32_t collect_children(const int64_t* parents, int64_t n, int64_t cur, int32_t* out) const {
    return block.collect_children(parents, n, cur, out);
  }

  // Combine one value per block in rank order; every thread of every block gets the result.
  template <class T, class Combine>
  __device__ T allreduce(T part, T* slot, T* result, Combine combine) const {
    if (threadIdx.x == 0) *slot = part;
    cluster_sync();
    if (threadIdx.x == 0) {
      T acc = *cluster_map(slot, 0);
      for (unsigned r = 1; r < size; ++r) acc = combine(acc, *cluster_map(slot, r));
      *result = acc;
    }
    cluster_sync();  // results visible; no block reuses its slot before every block has read it
    return *result;
  }

  template <typename scalar_t>
  __device__ RowScan max_scan(const scalar_t* row, int64_t vocab) const {
    return allreduce(block.max_scan(row, vocab), &x->scan, &x->scan_result,
                     [](RowScan a, RowScan b) { return verify::combine_scan(a, b); });
  }

  __device__ float add_all(float part) const {
    return allreduce(part, &x->f, &x->f_result, [](float a, float b) { return a + b; });
  }

  template <typename scalar_t>
  __device__ float sum_target(const scalar_t* row, int64_t vocab, const Target& t) const {
    return add_all(block.sum_target(row, vocab, t));
  }

  template <class G>
  __device__ float sum(int64_t vocab, const G& g) const {
    return add_all(block.sum(vocab, g));
  }

  template <class KeyFn, class G>
  __device__ void histogram(int64_t vocab, const KeyFn& key, const G& g, int shift, uint32_t prefix,
                            float* bins) const {
    block.histogram(vocab, key, g, shift, prefix, x->hist);  // this slice's bins
    cluster_sync();
    for (int d = threadIdx.x; d < 256; d += kThreads) {
      float total = 0.0f;
      for (unsigned r = 0; r < size; ++r) total += cluster_map(x->hist, r)[d];
      bins[d] = total;
    }
    cluster_sync();
  }

  // Each block scans its slice with the coin's target shifted by the mass of the lower slices; the
  // lowest rank that finds a crossing wins.
  template <class G>
  __device__ FindResult scan_find(int64_t vocab, const G& g, float t) const {
    const float mine = block.sum(vocab, g);
    if (threadIdx.x == 0) x->f = mine;
    cluster_sync();
    float below = 0.0f;
    for (unsigned r = 0; r < rank; ++r) below += *cluster_map(&x->f, r);
    cluster_sync();
    const FindResult part = block.scan_find(vocab, g, t - below);
    return allreduce(part, &x->found, &x->found_result, [](FindResult a, FindResult b) {
      return FindResult{a.first >= 0 ? a.first : b.first, a.last > b.last ? a.last : b.last};
    });
  }

  template <class Row>
  __device__ FindResult scan_find_target(const Row& row, int64_t vocab, const Target& t, const verify::Scratch& s,
                                         int32_t distinct, float value) const {
    return verify::scan_find_target_generic(*this, row, vocab, t, s, distinct, value);
  }
};

// The walk of request b with a row backend `ops` over the block's shared memory `sm`.
template <class Ops, typename scalar_t, typename prob_t>
__device__ __forceinline__ void run_request(Ops& ops, VerifySmem& sm, int64_t b, const scalar_t* logits,
                                            const prob_t* draft_probs, const int64_t* tokens, const int64_t* parents,
                                            const float* uniforms, const float* temperature, const int64_t* top_k,
                                            const float* top_p, int64_t n, int64_t vocab, bool validate,
                                            int64_t* out_tokens, int64_t* num_accepted, int64_t* path,
                                            int32_t* errors) {
  verify::Scratch scratch{sm.child_idx, sm.sorted_tokens, sm.first_of_token, sm.residual_z, sm.bins};
  const int64_t off = b * n;
  verify::Request<scalar_t, prob_t> rq{logits + off * vocab, draft_probs ? draft_probs + off * vocab : nullptr,
                                       tokens + off, parents + off, uniforms + off, n, vocab, temperature[b],
                                       top_p[b], top_k[b]};
  verify::Outputs out{out_tokens + off, path + off, num_accepted + b, errors + b};
  verify::verify_walk(ops, rq, scratch, sm.st, out, validate);
}

// grid: [B] (one block per request) or [B * C] (clusters of C blocks share a request's rows);
// block: kThreads; dynamic shared memory: sizeof(VerifySmem).
// logits, draft_probs [B, N, V]; tokens, parents, uniforms [B, N]; temperature, top_p [B] f32; top_k [B];
// out_tokens, path [B, N] (pre-filled -1); num_accepted [B]; errors [B] (in: check results when
// validating; out: walk errors).
template <typename scalar_t, typename prob_t, bool kCluster>
__global__ void __launch_bounds__(kThreads) verify_tree_kernel(
    const scalar_t* logits, const prob_t* draft_probs, const int64_t* tokens, const int64_t* parents,
    const float* uniforms, const float* temperature, const int64_t* top_k, const float* top_p, int64_t n,
    int64_t vocab, bool validate, int64_t* out_tokens, int64_t* num_accepted, int64_t* path, int32_t* errors,
    int cluster_size) {
  TAPS_DYNAMIC_SHARED(unsigned char, smem_raw);
  VerifySmem& sm = *reinterpret_cast<VerifySmem*>(smem_raw);
  const int64_t b = int64_t(blockIdx.x) / cluster_size;
  // Every block of a cluster reads the same flag before any block can write errors (the walk starts
  // with a cluster-wide reduction), so a cluster returns as a whole.
  if (validate && errors[b] != kNoError) return;
  if constexpr (kCluster) {
    const unsigned rank = cluster_rank();
    // slices of whole 16-element groups, so that every slice start keeps the row's alignment
    const int64_t per = ((vocab + cluster_size - 1) / cluster_size + 15) / 16 * 16;
    const int64_t lo = int64_t(rank) * per < vocab ? int64_t(rank) * per : vocab;
    const int64_t hi = lo + per < vocab ? lo + per : vocab;
    ClusterOps ops{threadIdx.x == 0, BlockOps{threadIdx.x == 0, &sm.red, lo, hi}, &sm.x, rank,
                   unsigned(cluster_size)};
    run_request(ops, sm, b, logits, draft_probs, tokens, parents, uniforms, temperature, top_k, top_p, n, vocab,
                validate, out_tokens, num_accepted, path, errors);
  } else {
    BlockOps ops{threadIdx.x == 0, &sm.red, 0, vocab};
    run_request(ops, sm, b, logits, draft_probs, tokens, parents, uniforms, temperature, top_k, top_p, n, vocab,
                validate, out_tokens, num_accepted, path, errors);
  }
}

// Arguments of one verify_tree launch (all device pointers; see verify_tree_kernel for shapes).
template <typename scalar_t, typename prob_t>
struct VerifyArgs {
  const scalar_t* logits;
  const prob_t* draft_probs;  // nullptr: deterministic candidates
  const int64_t* tokens;
  const int64_t* parents;
  const float* uniforms;
  const float* temperature;
  const int64_t* top_k;
  const float* top_p;
  int64_t batch, n, vocab;
  bool validate;
  int cluster_size;  // 1: a block per request; 2..8 (sm_90+): a cluster of blocks shares each row
  int64_t* out_tokens;
  int64_t* num_accepted;
  int64_t* path;
  int32_t* errors;
};

// Requires n <= kMaxNodes. With validate, runs the per-request checks first (errors [B]).
template <typename scalar_t, typename prob_t>
cudaError_t launch_verify_tree(const VerifyArgs<scalar_t, prob_t>& a, cudaStream_t stream) {
  if (a.batch == 0) return cudaSuccess;
  if (a.validate) {
    TAPS_LAUNCH(verify_check_kernel, unsigned((a.batch + 127) / 128), 128, 0, stream,
        a.tokens, a.parents, a.uniforms, a.temperature, a.top_k, a.top_p, a.batch, a.n, a.vocab, a.errors);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  const size_t smem = sizeof(VerifySmem);
  if (a.cluster_size <= 1) {
    auto* kernel = &verify_tree_kernel<scalar_t, prob_t, false>;
    TAPS_LAUNCH(kernel, unsigned(a.batch), kThreads, smem, stream,
        a.logits, a.draft_probs, a.tokens, a.parents, a.uniforms, a.temperature, a.top_k, a.top_p, a.n, a.vocab,
        a.validate, a.out_tokens, a.num_accepted, a.path, a.errors, 1);
    return cudaGetLastError();
  }
  auto* kernel = &verify_tree_kernel<scalar_t, prob_t, true>;
  return TAPS_LAUNCH_CLUSTER(kernel, unsigned(a.batch * a.cluster_size), kThreads, smem, stream, a.cluster_size,
      a.logits, a.draft_probs, a.tokens, a.parents, a.uniforms, a.temperature, a.top_k, a.top_p, a.n, a.vocab,
      a.validate, a.out_tokens, a.num_accepted, a.path, a.errors, a.cluster_size);
}

}  // namespace verify
}  // namespace taps
