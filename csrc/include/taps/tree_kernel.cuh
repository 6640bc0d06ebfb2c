// Block-level helpers of the build_tree and merge_trees CUDA kernels (no torch headers): bitonic sort
// and warp scan over shared memory, and select_and_emit_block, the "select and emit" step of
// taps/tree.h for one request by one thread block, over shared-memory arrays; plus the launch of a
// kernel with one block per request. Compiled on the host by tests/cpp/test_emu_trees.cpp under the
// CUDA emulation.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "taps/tree.h"

namespace taps {
namespace tree {

// Most output nodes the CUDA kernels support (16-bit slots in the sibling keys).
constexpr int64_t kMaxOutputNodes = 65535;

// Smallest power of two >= n (n >= 1).
TAPS_HD int32_t next_pow2(int32_t n) {
  int32_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Ascending bitonic sort of n (a power of two) keys in shared memory by the whole block.
// Must be entered by every thread after a __syncthreads(); ends with one.
__device__ inline void block_bitonic_sort(uint64_t* keys, int32_t n) {
  for (int32_t k = 2; k <= n; k <<= 1) {
    for (int32_t j = k >> 1; j > 0; j >>= 1) {
      for (int32_t i = threadIdx.x; i < (n >> 1); i += blockDim.x) {
        const int32_t lo = 2 * i - (i & (j - 1));
        const int32_t hi = lo + j;
        const bool ascending = (lo & k) == 0;
        const uint64_t a = keys[lo], b = keys[hi];
        if ((a > b) == ascending) {
          keys[lo] = b;
          keys[hi] = a;
        }
      }
      __syncthreads();
    }
  }
}

// Exclusive prefix sum of values[lo, hi) into sums[lo, hi), starting at `base`, by warp 0 alone;
// returns base + the segment's total in lane 0 and every lane of warp 0 (others: unspecified).
__device__ inline int32_t warp_exclusive_scan(const int32_t* values, int32_t* sums, int32_t lo, int32_t hi,
                                              int32_t base) {
  const int32_t lane = int32_t(threadIdx.x) & 31;
  int32_t carry = base;
  for (int32_t start = lo; start < hi; start += 32) {
    const int32_t i = start + lane;
    const int32_t v = i < hi ? values[i] : 0;
    int32_t inclusive = v;
    for (int32_t d = 1; d < 32; d <<= 1) {
      const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += up;
    }
    if (i < hi) sums[i] = carry + inclusive - v;
    carry += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  return carry;
}

// Shared-memory scratch of select_and_emit_block for num_nodes outputs (int32 arrays; the sibling keys
// are carved by the caller, 8-byte aligned).
struct BlockSelectScratch {
  uint64_t* sibling_keys;  // [next_pow2(max(num_nodes - 1, 1))]
  int32_t* slot_of;        // [count] candidate -> selection slot (only kept entries are read)
  int32_t* group_begin;    // [num_nodes] index parent slot + 1: first child in sibling-key order
  int32_t* group_end;      // [num_nodes]
  int32_t* pos_of_slot;    // [num_nodes] index slot + 1: output position
  int32_t* out_parent;     // [num_nodes] output position -> parent's output position
  int32_t* out_cand;       // [num_nodes] output position -> candidate
  int32_t* child_count;    // [num_nodes] output position -> kept children
  int32_t* child_before;   // [num_nodes] output position -> children of earlier positions
  int32_t* level;          // [5] kept count, then two segment buffers shared by the block
};

constexpr int32_t kBlockSelectInts = 7;  // int32 arrays of num_nodes entries in BlockSelectScratch

// Shared-memory bytes of the scratch below for num_nodes outputs (sibling keys and int32 arrays; the
// slot_of array is the caller's).
inline size_t block_select_smem_bytes(int64_t num_nodes) {
  const int64_t sib_count = next_pow2(int32_t(num_nodes - 1 > 1 ? num_nodes - 1 : 1));
  return size_t(8 * sib_count + 4 * (kBlockSelectInts * num_nodes + 5));
}

// The scratch over `sibling_keys` (next_pow2(max(num_nodes - 1, 1)) keys), `slot_of` (one entry per
// candidate) and `ints` (kBlockSelectInts * num_nodes + 5 entries).
TAPS_HD BlockSelectScratch block_select_scratch(uint64_t* sibling_keys, int32_t* slot_of, int32_t* ints,
                                                int32_t num_nodes) {
  BlockSelectScratch s;
  s.sibling_keys = sibling_keys;
  s.slot_of = slot_of;
  s.group_begin = ints;
  s.group_end = ints + num_nodes;
  s.pos_of_slot = ints + 2 * num_nodes;
  s.out_parent = ints + 3 * num_nodes;
  s.out_cand = ints + 4 * num_nodes;
  s.child_count = ints + 5 * num_nodes;
  s.child_before = ints + 6 * num_nodes;
  s.level = ints + kBlockSelectInts * num_nodes;
  return s;
}

// select_and_emit by one block. `select_keys[0, key_count)` (key_count a power of two) holds
// pack_select_key(eff, depth, c) for every real candidate c and kMaxKey otherwise; parent, token,
// score, depth are candidate-indexed arrays (shared or global). extra(c) gives the extra column.
// Must be entered by every thread after a __syncthreads(). Candidate indices and depths < 2^16,
// num_nodes <= 2^16.
template <class Extra>
__device__ void select_and_emit_block(uint64_t* select_keys, int32_t key_count, const int32_t* parent,
                                      const int64_t* token, const float* score, const int32_t* depth,
                                      Extra extra, const TreeRows& out, int64_t root_token, int64_t root_extra,
                                      int64_t padding_extra, const BlockSelectScratch& s) {
  const int32_t tid = int32_t(threadIdx.x), nthreads = int32_t(blockDim.x);
  const int32_t num_nodes = int32_t(out.num_nodes);
  block_bitonic_sort(select_keys, key_count);
  // keep = min(num_nodes - 1, number of real candidates): the real keys sort first.
  const int32_t limit = num_nodes - 1 < key_count ? num_nodes - 1 : key_count;
  if (tid == 0) s.level[0] = limit;
  __syncthreads();
  for (int32_t j = tid; j < limit; j += nthreads)
    if (select_keys[j] == kMaxKey && (j == 0 || select_keys[j - 1] != kMaxKey)) s.level[0] = j;
  __syncthreads();
  const int32_t keep = s.level[0];
  const int32_t sib_count = next_pow2(keep > 1 ? keep : 1);
  for (int32_t j = tid; j < keep; j += nthreads) s.slot_of[select_key_index(select_keys[j])] = j;
  for (int32_t i = tid; i < num_nodes; i += nthreads) {
    s.group_begin[i] = 0;
    s.group_end[i] = 0;
    s.child_count[i] = 0;
    s.out_parent[i] = 0;  // defensive: every row 1..keep is assigned below for any input
    s.out_cand[i] = -1;
  }
  __syncthreads();
  // Sibling groups: sort kept candidates by (parent slot, score desc, index).
  for (int32_t j = tid; j < sib_count; j += nthreads) {
    if (j < keep) {
      const int32_t c = select_key_index(select_keys[j]);
      const int32_t p = parent[c];
      s.sibling_keys[j] = pack_sibling_key(p < 0 ? -1 : s.slot_of[p], score[c], c);
    } else {
      s.sibling_keys[j] = kMaxKey;
    }
  }
  __syncthreads();
  block_bitonic_sort(s.sibling_keys, sib_count);
  for (int32_t j = tid; j < keep; j += nthreads) {
    const int32_t ps1 = sibling_key_parent_slot(s.sibling_keys[j]) + 1;
    if (j == 0 || sibling_key_parent_slot(s.sibling_keys[j - 1]) + 1 != ps1) s.group_begin[ps1] = j;
    if (j == keep - 1 || sibling_key_parent_slot(s.sibling_keys[j + 1]) + 1 != ps1) s.group_end[ps1] = j + 1;
  }
  if (tid == 0) {
    s.pos_of_slot[0] = 0;
    s.out_parent[0] = -1;
    s.out_cand[0] = -1;
    s.child_count[0] = 0;
    // Iteration d reads the segment [lo, hi) of output positions at depth d - 1 from
    // level[1 + 2 * ((d - 1) & 1)] and writes depth d's to the other buffer (double buffered, so one
    // barrier per phase suffices).
    s.level[1] = 0;
    s.level[2] = 1;
  }
  __syncthreads();
  if (tid == 0) s.child_count[0] = s.group_end[0] - s.group_begin[0];
  __syncthreads();
  // Breadth-first positions, one level per iteration: a node's position is
  // 1 + (children of all earlier positions) + (its rank among its siblings).
  for (int32_t d = 1;; ++d) {
    const int32_t* cur = s.level + 1 + 2 * ((d - 1) & 1);
    int32_t* next = s.level + 1 + 2 * (d & 1);
    const int32_t lo = cur[0], hi = cur[1];
    if (hi <= lo || hi > keep) break;  // uniform: every thread reads the same values
    if (tid < 32) {
      const int32_t base = lo == 0 ? 0 : s.child_before[lo - 1] + s.child_count[lo - 1];
      const int32_t total = warp_exclusive_scan(s.child_count, s.child_before, lo, hi, base);
      if (tid == 0) {
        next[0] = hi;
        next[1] = 1 + total;
      }
    }
    __syncthreads();
    for (int32_t j = tid; j < keep; j += nthreads) {
      const int32_t c = sibling_key_index(s.sibling_keys[j]);
      if (depth[c] != d) continue;
      const int32_t ps1 = sibling_key_parent_slot(s.sibling_keys[j]) + 1;
      const int32_t parent_pos = s.pos_of_slot[ps1];
      const int32_t pos = 1 + s.child_before[parent_pos] + (j - s.group_begin[ps1]);
      const int32_t own1 = s.slot_of[c] + 1;
      s.pos_of_slot[own1] = pos;
      s.out_parent[pos] = parent_pos;
      s.out_cand[pos] = c;
      s.child_count[pos] = s.group_end[own1] - s.group_begin[own1];
    }
    __syncthreads();
  }
  // Rows. Real rows 0..keep, padding after.
  for (int32_t i = tid; i < num_nodes; i += nthreads) {
    if (i > keep) {
      out.tokens[i] = -1;
      out.parents[i] = -1;
      out.depth[i] = -1;
      out.scores[i] = negative_infinity();
      out.extra[i] = padding_extra;
    } else if (i == 0) {
      out.tokens[0] = root_token;
      out.parents[0] = -1;
      out.depth[0] = 0;
      out.scores[0] = 0.0f;
      out.extra[0] = root_extra;
    } else {
      const int32_t c = s.out_cand[i] < 0 ? 0 : s.out_cand[i];
      out.tokens[i] = token[c];
      out.parents[i] = s.out_parent[i];
      out.depth[i] = depth[c];
      out.scores[i] = score[c];
      out.extra[i] = extra(c);
    }
  }
  // Ancestor bitmask: one thread per (row, word) walks the row's ancestors (depth steps).
  const int32_t words = int32_t(out.words);
  for (int32_t e = tid; e < num_nodes * words; e += nthreads) {
    const int32_t i = e / words, w = e - i * words;
    uint64_t bits = 0;
    if (i <= keep) {
      for (int32_t q = i; q > 0; q = s.out_parent[q])
        if ((q >> 6) == w) bits |= uint64_t(1) << (q & 63);
      if (w == 0) bits |= 1;
    }
    out.tree_mask[e] = int64_t(bits);
  }
}

// Launches `kernel` with one block of `threads` threads per request (grid B) and `smem` bytes of
// dynamic shared memory, opting in to more than 48 KiB when needed. Returns the launch error, if any.
template <class Kernel, class... Args>
inline cudaError_t launch_block_per_request(Kernel kernel, int64_t B, int threads, size_t smem, cudaStream_t stream,
                                            Args... args) {
  if (B == 0) return cudaSuccess;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  TAPS_LAUNCH(kernel, unsigned(B), threads, smem, stream, args...);
  return cudaGetLastError();
}

}  // namespace tree
}  // namespace taps
