// Header-only core of tree_attention and compact_kv: the tree-mask test, the online-softmax state
// algebra shared by the CPU and CUDA kernels, and (under __CUDACC__) the CUDA kernel templates.
// No torch headers: raw pointers, sizes and strides only.
//
// Conventions (see DESIGN.md, tree_attention):
//   q [B, Hq, N, D]; k, v [B, Hkv, S, D]; query head h reads KV head h / G (G = Hq / Hkv).
//   Request b has L = kv_lens[b] keys; positions L - N .. L - 1 are tree nodes 0 .. N - 1, masked by
//   tree_mask[b, i] (bit j of word j / 64: query node i sees node j); positions < L - N (the prefix)
//   are visible to every query; positions >= L are ignored.
//   A query row that sees no key at all (only possible with a malformed mask) outputs zeros.
//
// Online softmax: a partial result over some keys is (max m, sum l = sum exp(s - m), acc = sum
// exp(s - m) * v), with m = -inf and l = 0, acc = 0 for "no key seen". The final output is acc / l.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "taps/common.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

namespace taps {

// True when query node `i` (whose mask row is `mask_row`, W int64 words) sees tree node `node`.
TAPS_HD bool tree_mask_visible(const int64_t* mask_row, int64_t node) {
  return ((static_cast<uint64_t>(mask_row[node >> 6]) >> (node & 63)) & 1u) != 0;
}

// Tree position bookkeeping of one request: L = kv_lens[b] clamped to [0, S], so that a bad length
// can never make a kernel read past the cache (the bindings reject it before; this is the backstop).
struct TreeSpan {
  int64_t len;         // keys of the request: positions [0, len)
  int64_t tree_start;  // first tree position, len - N (may be negative only for an invalid len < N)
};
TAPS_HD TreeSpan tree_span(int64_t kv_len, int64_t num_nodes, int64_t cache_len) {
  const int64_t len = kv_len < 0 ? 0 : (kv_len > cache_len ? cache_len : kv_len);
  return TreeSpan{len, len - num_nodes};
}

// Is key position `pos` (< span.len) visible to query node i? Prefix positions always are.
TAPS_HD bool key_visible(const TreeSpan& span, const int64_t* mask_row, int64_t pos) {
  const int64_t node = pos - span.tree_start;
  return node < 0 || tree_mask_visible(mask_row, node);
}

// Bit j (0..63): is key tile0 + j visible to the query whose mask row is `mask_row` (W words)? Prefix
// keys are; a tree node is when its mask bit is set. Bits for keys at or past span.len are meaningless
// (callers test the tile length too). At most two mask words are read.
TAPS_HD uint64_t tile_visibility(const TreeSpan& span, const int64_t* mask_row, int64_t mask_words, int64_t tile0) {
  const int64_t n0 = tile0 - span.tree_start;  // tree node of key tile0 (negative: a prefix key)
  if (n0 <= -64) return ~uint64_t(0);
  if (n0 < 0) {  // -n0 prefix keys, then nodes 0, 1, ... (all in word 0: fewer than 64 of them)
    const int np = static_cast<int>(-n0);
    return ((uint64_t(1) << np) - 1) | (static_cast<uint64_t>(mask_row[0]) << np);
  }
  const int64_t w = n0 >> 6;
  const int sh = static_cast<int>(n0 & 63);
  uint64_t bits = w < mask_words ? static_cast<uint64_t>(mask_row[w]) >> sh : 0;
  if (sh != 0 && w + 1 < mask_words) bits |= static_cast<uint64_t>(mask_row[w + 1]) << (64 - sh);
  return bits;
}

// exp(old_max - new_max): the factor that rescales a partial state to a new running max;
// 0 when the old state is empty (old_max = -inf), also when both are -inf (no NaN).
TAPS_HD float softmax_rescale(float old_max, float new_max) {
  return old_max == -INFINITY ? 0.0f : expf(old_max - new_max);
}

// Merge the partial state (max2, sum2, acc2[0..d)) into (max1, sum1, acc1[0..d)).
TAPS_HD void softmax_merge(float& max1, float& sum1, float* acc1, float max2, float sum2, const float* acc2,
                           int64_t d) {
  const float m = max1 > max2 ? max1 : max2;
  const float a1 = softmax_rescale(max1, m), a2 = softmax_rescale(max2, m);
  for (int64_t i = 0; i < d; ++i) acc1[i] = acc1[i] * a1 + acc2[i] * a2;
  sum1 = sum1 * a1 + sum2 * a2;
  max1 = m;
}

// Log-sum-exp combine of `splits` partial states of one row: fills weight[s] so that the final
// output is sum_s weight[s] * acc_s (weight[s] = exp(max_s - M) / sum_t exp(max_t - M) sum_t).
// Partial s sits at max[s * stride], sum[s * stride]. All-empty rows get weight 0 (output 0).
TAPS_HD void lse_combine_weights(const float* max, const float* sum, int64_t splits, int64_t stride,
                                 float* weight) {
  float m = -INFINITY;
  for (int64_t s = 0; s < splits; ++s) m = max[s * stride] > m ? max[s * stride] : m;
  float total = 0.0f;
  for (int64_t s = 0; s < splits; ++s) {
    weight[s] = softmax_rescale(max[s * stride], m);
    total += weight[s] * sum[s * stride];
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int64_t s = 0; s < splits; ++s) weight[s] *= inv;
}

// ---- launch plan of the CUDA tree_attention (host logic, here so that the CPU tests cover it) ----
// Two kernels: the tensor-core kernel (bf16 / fp16, when a KV head's query group has at least 16 rows
// and the rows are 16-byte aligned, on sm_80+) and the SIMT kernel (everything else).
constexpr int kAttnWarps = 4;      // SIMT kernel: warps per block
constexpr int kRowsPerWarp = 4;    // SIMT kernel: query rows per warp
constexpr int kAttnRows = kAttnWarps * kRowsPerWarp;
constexpr int kTileKeys = 32;      // SIMT kernel: keys per K/V tile
constexpr int kMmaKeys = 64;       // tensor-core kernel: keys per K/V tile
constexpr int kMmaMaxWarps = 8;    // tensor-core kernel: at most 8 warps (16-row m-tiles) per block
constexpr int kMaxSplits = 64;     // key splits merged by the combine kernel

// m-tiles (16 query rows each) one warp of the tensor-core kernel holds: its fp32 output accumulator
// is tiles * D / 2 registers per lane, kept at or under 128 (as flash attention 2 does at D = 128; with
// 4 m-tiles at D = 64 ptxas spilled).
TAPS_HD constexpr int mma_warp_tiles(int64_t head_dim) { return head_dim <= 128 ? 2 : 1; }

// Shared memory of the tensor-core kernel: the query rows and two stages of one K and one V tile, all
// rows of D + 8 halves. The padding (a row stride of 4 (mod 8) words) makes the 16-byte row reads of
// ldmatrix on Q, K and V bank-conflict-free. At most 203 KB (D = 256, 128
// rows), within the 227 KB a block may opt in to on sm_90 (sm_80: 163 KB, so D = 256 needs fewer rows
// there: see plan_tree_attention).
TAPS_HD constexpr int64_t mma_smem_bytes(int64_t head_dim, int64_t block_rows) {
  return (block_rows + 4 * kMmaKeys) * (head_dim + 8) * 2;
}

struct AttentionPlan {
  bool mma;            // tensor-core kernel
  int warps;           // tensor-core kernel: warps per block (SIMT: kAttnWarps)
  int64_t smem_limit;  // the device's opt-in shared memory per block (max_smem)
  int64_t block_rows;  // query rows of a KV head's group held per block
  int64_t row_blocks;  // blocks sharing one (request, KV head): ceil(G * N / block_rows)
  int64_t splits;      // key splits (flash-decoding), merged by log-sum-exp when > 1
  int64_t split_keys;  // keys per split, a multiple of the kernel's tile
};

// mma_ok: bf16 / fp16 on an sm_80+ device with 16-byte aligned rows; sms: the device's SM count;
// max_smem: the shared memory a block may opt in to (the tensor-core kernel takes fewer warps, or the
// SIMT kernel runs, when its rows and two K/V stages do not fit).
// Splits: enough blocks for about two waves, at least 256 keys per split.
TAPS_HD AttentionPlan plan_tree_attention(int64_t batch, int64_t heads_kv, int64_t group_rows, int64_t cache_len,
                                          int64_t head_dim, bool mma_ok, int64_t sms, int64_t max_smem) {
  AttentionPlan plan{};
  plan.smem_limit = max_smem;
  plan.mma = mma_ok && group_rows >= 16;
  if (plan.mma) {
    const int64_t m_tiles = ceil_div(group_rows, 16);
    const int64_t warp_rows = int64_t(mma_warp_tiles(head_dim)) * 16;
    // Rows per block: the whole group when the warps can hold it, else as many as they hold; never
    // more shared memory for rows than the group has (round up to whole m-tiles).
    auto rows_for = [&](int64_t warps) {
      const int64_t cap = warps * warp_rows, need = m_tiles * 16;
      return cap < need ? cap : need;
    };
    plan.warps = static_cast<int>(m_tiles < kMmaMaxWarps ? m_tiles : kMmaMaxWarps);
    while (plan.warps > 1 && mma_smem_bytes(head_dim, rows_for(plan.warps)) > max_smem) --plan.warps;
    plan.block_rows = rows_for(plan.warps);
    plan.mma = mma_smem_bytes(head_dim, plan.block_rows) <= max_smem;
  }
  if (!plan.mma) {
    plan.warps = kAttnWarps;
    plan.block_rows = kAttnRows;
  }
  const int64_t tile_keys = plan.mma ? kMmaKeys : kTileKeys;
  plan.row_blocks = ceil_div(group_rows, plan.block_rows);
  const int64_t base = batch * heads_kv * plan.row_blocks;
  int64_t splits = base > 0 ? ceil_div(2 * sms, base) : 1;
  const int64_t by_len = cache_len / 256;
  splits = splits < by_len ? splits : by_len;
  splits = splits < kMaxSplits ? splits : kMaxSplits;
  splits = splits > 1 ? splits : 1;
  plan.split_keys = ceil_div(ceil_div(cache_len, splits), tile_keys) * tile_keys;
  if (plan.split_keys < tile_keys) plan.split_keys = tile_keys;
  plan.splits = ceil_div(cache_len, plan.split_keys);
  if (plan.splits < 1) plan.splits = 1;
  return plan;
}

// compact_kv validity of one request's path (P entries, -1 padded): returns the number of path
// entries to move (up to the first -1), or -1 when the path is invalid (path[0] != 0, not strictly
// increasing, or prefix_len + path[j] >= cache_len, or prefix_len < 0).
TAPS_HD int64_t compact_path_length(const int64_t* path, int64_t path_cols, int64_t prefix_len,
                                    int64_t cache_len) {
  if (prefix_len < 0) return -1;
  int64_t n = 0;
  for (; n < path_cols && path[n] >= 0; ++n) {
    if (n == 0 ? path[0] != 0 : path[n] <= path[n - 1]) return -1;
    if (prefix_len + path[n] >= cache_len) return -1;
  }
  if (n == 0 && path_cols > 0) return -1;  // path[0] must be 0 (the root), not -1
  return n;
}

#if defined(__CUDACC__)

// ---- element conversions (torch builds define __CUDA_NO_*_CONVERSIONS__, so be explicit) ----
TAPS_DEVICE float to_float(float x) { return x; }
TAPS_DEVICE float to_float(__half x) { return __half2float(x); }
TAPS_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> TAPS_DEVICE T from_float(float x);
template <> TAPS_DEVICE float from_float<float>(float x) { return x; }
template <> TAPS_DEVICE __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> TAPS_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// ------------------------------------------------------------------------------------------------
// tree_attention (flash-decoding style, SIMT FMA version).
// NOTE: written without access to a GPU; it compiles for sm_80 / sm_90a but has not been run.
//
// Grid (splits, Hkv * row_blocks, B); block kAttnWarps warps. A block owns kAttnRows = kAttnWarps *
// kRowsPerWarp consecutive rows of one KV head's query group (row r = g * N + i: query head
// hkv * G + g, tree node i; the whole group when G * N <= kAttnRows, otherwise row_blocks blocks share
// the KV head and re-read its K/V tiles, mostly from L2) and one contiguous split of the key range.
// K/V tiles of kTileKeys keys are staged in shared memory as fp32 (rows padded by one float: no
// bank conflicts). Scores: lane j owns key j of the tile; PV: lane owns features lane + 32 * t.
// Prefix tiles take no mask test; only tiles that reach the tree tail do.
// With splits == 1 the block writes out directly; otherwise it writes its partial state
// (max, sum, unnormalised acc) and tree_attention_combine_kernel merges the splits (log-sum-exp).
// ------------------------------------------------------------------------------------------------
struct TreeAttentionParams {
  const void* q;  // [B, Hq, N, D] strides q_stride_{b,h,n}, feature stride 1
  const void* k;  // [B, Hkv, S, D] strides k_stride_{b,h,s}
  const void* v;  // [B, Hkv, S, D] strides v_stride_{b,h,s}
  const int64_t* tree_mask;  // [B, N, W] contiguous
  const int64_t* kv_lens;    // [B]
  void* out;                 // [B, Hq, N, D] contiguous
  float* part_acc;           // [splits, B, Hq, N, D] (splits > 1 only)
  float* part_max;           // [splits, B, Hq, N]
  float* part_sum;           // [splits, B, Hq, N]
  int64_t q_stride_b, q_stride_h, q_stride_n;
  int64_t k_stride_b, k_stride_h, k_stride_s;
  int64_t v_stride_b, v_stride_h, v_stride_s;
  int64_t batch, heads_q, heads_kv, num_nodes, cache_len, mask_words;
  // Set by launch_tree_attention from the plan:
  int64_t splits, split_keys;  // split s covers key positions [s * split_keys, (s + 1) * split_keys)
  int64_t block_rows;          // tensor-core kernel: query rows per block
  float scale;
};

// What a block of either attention kernel works on. Grid (splits, Hkv * row_blocks, B): the block's
// request, key split, KV head, first query row of the head's group (row r = g * N + i: query head
// hkv * G + g, tree node i), its key range [key_begin, key_end) clamped to the request's length, and
// the request's K / V of that head.
template <class T>
struct AttnBlock {
  int split, b;
  int64_t group, rows_total, hkv, row0, key_begin, key_end;
  TreeSpan span;
  const T *q, *k, *v;
};
template <class T>
TAPS_DEVICE AttnBlock<T> attn_block(const TreeAttentionParams& p, int64_t block_rows) {
  AttnBlock<T> a;
  a.split = static_cast<int>(blockIdx.x);
  a.b = static_cast<int>(blockIdx.z);
  a.group = p.heads_q / p.heads_kv;
  a.rows_total = a.group * p.num_nodes;
  const int64_t row_blocks = ceil_div(a.rows_total, block_rows);
  a.hkv = blockIdx.y / row_blocks;
  a.row0 = (blockIdx.y % row_blocks) * block_rows;
  a.span = tree_span(p.kv_lens[a.b], p.num_nodes, p.cache_len);
  a.key_begin = a.split * p.split_keys;
  const int64_t end = a.key_begin + p.split_keys;
  a.key_end = end < a.span.len ? end : a.span.len;
  a.q = static_cast<const T*>(p.q);
  a.k = static_cast<const T*>(p.k) + a.b * p.k_stride_b + a.hkv * p.k_stride_h;
  a.v = static_cast<const T*>(p.v) + a.b * p.v_stride_b + a.hkv * p.v_stride_h;
  return a;
}

template <int D> constexpr int attn_smem_floats() {
  return 2 * kTileKeys * (D + 1) + kAttnRows * D + kAttnRows * kTileKeys;
}

// grid (splits, Hkv * row_blocks, B), block kAttnWarps * 32 threads, dynamic smem attn_smem_floats<D>().
template <class T, int D>
__global__ void __launch_bounds__(kAttnWarps * 32)
tree_attention_kernel(TreeAttentionParams p) {
  static_assert(D % 32 == 0 || D == 80, "head dim");
  constexpr int kPerLane = (D + 31) / 32;  // features per lane in PV (D = 80: 3, last partial)
  TAPS_DYNAMIC_SHARED(float, smem);
  float* k_tile = smem;                                // [kTileKeys][D + 1]
  float* v_tile = k_tile + kTileKeys * (D + 1);        // [kTileKeys][D + 1]
  float* q_rows = v_tile + kTileKeys * (D + 1);        // [kAttnRows][D], pre-scaled
  float* p_rows = q_rows + kAttnRows * D;              // [kAttnRows][kTileKeys]

  const AttnBlock<T> blk = attn_block<T>(p, kAttnRows);
  const int split = blk.split, b = blk.b;
  const int64_t group = blk.group, rows_total = blk.rows_total, hkv = blk.hkv, row0 = blk.row0;
  const int64_t key_begin = blk.key_begin, key_end = blk.key_end;
  const TreeSpan span = blk.span;
  const T *q = blk.q, *kb = blk.k, *vb = blk.v;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Stage this block's query rows (row r -> head hkv * G + r / N, node r % N), scaled.
  for (int idx = threadIdx.x; idx < kAttnRows * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D;
    const int64_t row = row0 + r;
    float x = 0.0f;
    if (row < rows_total) {
      const int64_t h = hkv * group + row / p.num_nodes, i = row % p.num_nodes;
      x = to_float(q[b * p.q_stride_b + h * p.q_stride_h + i * p.q_stride_n + d]) * p.scale;
    }
    q_rows[idx] = x;
  }

  float row_max[kRowsPerWarp], row_sum[kRowsPerWarp], acc[kRowsPerWarp][kPerLane];
  const int64_t* mask_row[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.0f;
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) acc[r][t] = 0.0f;
    const int64_t row = row0 + warp * kRowsPerWarp + r;
    const int64_t i = row < rows_total ? row % p.num_nodes : 0;
    mask_row[r] = p.tree_mask + (b * p.num_nodes + i) * p.mask_words;
  }

  for (int64_t tile0 = key_begin; tile0 < key_end; tile0 += kTileKeys) {
    const int tile_len = static_cast<int>(key_end - tile0 < kTileKeys ? key_end - tile0 : kTileKeys);
    __syncthreads();  // previous tile fully consumed (and q_rows written, first time)
    for (int idx = threadIdx.x; idx < kTileKeys * D; idx += blockDim.x) {
      const int j = idx / D, d = idx % D;
      float kx = 0.0f, vx = 0.0f;
      if (j < tile_len) {
        kx = to_float(kb[(tile0 + j) * p.k_stride_s + d]);
        vx = to_float(vb[(tile0 + j) * p.v_stride_s + d]);
      }
      k_tile[j * (D + 1) + d] = kx;
      v_tile[j * (D + 1) + d] = vx;
    }
    __syncthreads();

    // Scores: lane j <-> key tile0 + j, for the warp's kRowsPerWarp rows.
    float s[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) s[r] = 0.0f;
    const float* krow = k_tile + lane * (D + 1);
    const float* qw = q_rows + warp * kRowsPerWarp * D;
#pragma unroll 8
    for (int d = 0; d < D; ++d) {
      const float kd = krow[d];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) s[r] = fmaf(qw[r * D + d], kd, s[r]);
    }
    const int64_t pos = tile0 + lane;
    const bool in_range = lane < tile_len;
    const bool tail_tile = tile0 + tile_len > span.tree_start;  // only these need the mask
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      bool visible = in_range;
      if (tail_tile && visible) visible = key_visible(span, mask_row[r], pos);
      const float sv = visible ? s[r] : -INFINITY;
      float m = sv;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      const float new_max = fmaxf(row_max[r], m);
      const float alpha = softmax_rescale(row_max[r], new_max);
      const float pj = new_max == -INFINITY ? 0.0f : __expf(sv - new_max);
      row_max[r] = new_max;
      row_sum[r] = row_sum[r] * alpha + pj;  // per-lane partial sum, reduced at the end
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) acc[r][t] *= alpha;
      p_rows[(warp * kRowsPerWarp + r) * kTileKeys + lane] = pj;
    }
    __syncwarp();
    // PV: acc[r][t] += sum_j p[r][j] * v[j][lane + 32 t]
    for (int j = 0; j < tile_len; ++j) {
      const float* vrow = v_tile + j * (D + 1);
      float vx[kPerLane];
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) {
        const int d = lane + 32 * t;
        vx[t] = (D % 32 == 0 || d < D) ? vrow[d < D ? d : 0] : 0.0f;
      }
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float pj = p_rows[(warp * kRowsPerWarp + r) * kTileKeys + j];
#pragma unroll
        for (int t = 0; t < kPerLane; ++t) acc[r][t] = fmaf(pj, vx[t], acc[r][t]);
      }
    }
  }

  // Epilogue: reduce the per-lane sums, then write the normalised output or the partial state.
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    float l = row_sum[r];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    const int64_t row = row0 + warp * kRowsPerWarp + r;
    if (row >= rows_total) continue;
    const int64_t h = hkv * group + row / p.num_nodes, i = row % p.num_nodes;
    const int64_t out_row = ((b * p.heads_q + h) * p.num_nodes + i);
    if (p.splits == 1) {
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      T* o = static_cast<T*>(p.out) + out_row * D;
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) {
        const int d = lane + 32 * t;
        if (D % 32 == 0 || d < D) o[d] = from_float<T>(acc[r][t] * inv);
      }
    } else {
      const int64_t rows_all = p.batch * p.heads_q * p.num_nodes;
      float* pa = p.part_acc + (split * rows_all + out_row) * D;
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) {
        const int d = lane + 32 * t;
        if (D % 32 == 0 || d < D) pa[d] = acc[r][t];
      }
      if (lane == 0) {
        p.part_max[split * rows_all + out_row] = row_max[r];
        p.part_sum[split * rows_all + out_row] = l;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// tree_attention, tensor-core version (bf16 / fp16 inputs, fp32 accumulation).
// NOTE: written without access to a GPU; it compiles for sm_80 / sm_90a and passes the host-emulation
// test (tests/cpp/test_emu_attention.cpp, whose mma and ldmatrix follow the PTX fragment layouts and
// whose cp.async lands only at the wait), but it has not been run on a device.
//
// Grid (splits, Hkv * row_blocks, B); block plan.warps warps (at most kMmaMaxWarps). A block holds
// block_rows (at most warps * MT * 16) rows of one KV head's query group: the whole group when it fits
// (G * N up to 256 rows at D <= 128, 128 at D = 256), so each K/V tile is read from global memory once
// for all of them; larger groups take several row blocks, which re-read the tiles mostly from L2.
// Warp w owns the 16-row m-tiles w, w + warps, ... (MT at most). K / V tiles of kMmaKeys keys are
// staged in shared memory in two cp.async stages (the copy of tile i + 1 overlaps the work on tile i):
//   S = Q K^T   mma.m16n8k16, A fragments from the Q rows and B fragments from the K rows by
//   ldmatrix.x4, fp32;
//   online softmax on the S fragments (a row's 8 key columns per n-tile live in the 4 lanes of a quad:
//   max and sum reduce with two xor shuffles), the tree mask tested only on tiles that reach the tail
//   (one tile_visibility word per row);
//   O += P V    P rounded to the input type and reused in registers as the A fragment (the S layout of
//   n-tiles 2j, 2j + 1 is the A layout of k-step j), B fragments from the row-major V tile by
//   ldmatrix.x4.trans.
// Output / partial state as the SIMT kernel (same combine kernel).
// ------------------------------------------------------------------------------------------------
template <class T> TAPS_DEVICE uint16_t bits16(T x) {
  uint16_t u;
  memcpy(&u, &x, 2);
  return u;
}
template <class T> TAPS_DEVICE T from_bits16(uint16_t u) {
  T x;
  memcpy(&x, &u, 2);
  return x;
}
// Two floats rounded to T, packed low half first (the fragment element order).
template <class T> TAPS_DEVICE uint32_t pack2(float lo, float hi) {
  return uint32_t(bits16(from_float<T>(lo))) | (uint32_t(bits16(from_float<T>(hi))) << 16);
}

// d += a b for one m16n8k16 tile (fragment layout: see the emulation's mma_m16n8k16).
template <class T>
TAPS_DEVICE void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(TAPS_CUDA_EMULATION)
  taps_emu::mma_m16n8k16(d, a, b, [](uint16_t u) { return to_float(from_bits16<T>(u)); });
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // the plan never picks this kernel below sm_80
#endif
}

// ldmatrix.x4[.trans]: four 8x8 b16 matrices from shared memory; lane l gives the address of row l % 8
// of matrix l / 8 (16-byte aligned) and gets in r[m] the pair at row l / 4, columns 2 (l % 4) and
// 2 (l % 4) + 1 of matrix m, or with Trans the pair at rows 2 (l % 4), 2 (l % 4) + 1 of column l / 4.
// Plain: mma's A fragments from row-major Q and B fragments from K rows; Trans: B fragments from a
// row-major V tile.
template <bool Trans>
TAPS_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(TAPS_CUDA_EMULATION)
  taps_emu::ldmatrix_x4(r, row, Trans);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// 16-byte asynchronous global -> shared copy (cp.async.cg, bypassing L1), and its group fences.
TAPS_DEVICE void cp_async_16(void* smem, const void* gmem) {
#if defined(TAPS_CUDA_EMULATION)
  taps_emu::cp_async16(smem, gmem);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem) : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}
TAPS_DEVICE void cp_async_commit() {
#if defined(TAPS_CUDA_EMULATION)
  taps_emu::cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Wait until at most `Pending` of this thread's committed groups are still in flight.
template <int Pending>
TAPS_DEVICE void cp_async_wait() {
#if defined(TAPS_CUDA_EMULATION)
  taps_emu::cp_async_wait(Pending);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}

template <class T, int D>
__global__ void __launch_bounds__(kMmaMaxWarps * 32)
tree_attention_mma_kernel(TreeAttentionParams p) {
  static_assert(D % 16 == 0, "head dim: a multiple of 16");
  constexpr int MT = mma_warp_tiles(D);
  constexpr int kRow = D + 8;               // Q / K / V shared rows, in halves
  constexpr int kRowWords = kRow / 2;
  constexpr int kTileWords = kMmaKeys * kRowWords;
  constexpr int NT = D / 8;                 // n-tiles of the output
  constexpr int KS = D / 16;                // k-steps of Q K^T
  constexpr int KT = kMmaKeys / 8;          // n-tiles of S
  constexpr int kChunks = D / 8;            // 16-byte chunks of a row
  TAPS_DYNAMIC_SHARED(uint32_t, smem_words);  // (its own name: extern shared arrays of two types clash)
  const int warps = static_cast<int>(blockDim.x / 32);
  const int64_t block_rows = p.block_rows;  // <= warps * MT * 16, a multiple of 16
  uint32_t* q_s = smem_words;                       // [block_rows][kRowWords]
  uint32_t* kv_s = q_s + block_rows * kRowWords;    // two stages of {K, V} tiles, [kMmaKeys][kRowWords] each

  const AttnBlock<T> blk = attn_block<T>(p, block_rows);
  const int split = blk.split, b = blk.b;
  const int64_t group = blk.group, rows_total = blk.rows_total, hkv = blk.hkv, row0 = blk.row0;
  const int64_t key_begin = blk.key_begin, key_end = blk.key_end;
  const TreeSpan span = blk.span;
  const T *q = blk.q, *kb = blk.k, *vb = blk.v;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  // Per m-tile state of this lane: rows g and g + 8 of the tile.
  float acc[MT][NT][4];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mt][h] = -INFINITY;
      row_sum[mt][h] = 0.0f;
    }
  }

  // K / V tiles in two stages: tile it + 1 is copied (cp.async) while tile it is computed. Rows past
  // the split's end are zeroed with plain stores (their P is 0, and 0 x garbage could be NaN).
  const int64_t n_tiles = key_end > key_begin ? ceil_div(key_end - key_begin, kMmaKeys) : 0;
  auto load_tile = [&](int64_t tile, int stage) {
    const int64_t first = key_begin + tile * kMmaKeys;
    const int len = static_cast<int>(key_end - first < kMmaKeys ? key_end - first : kMmaKeys);
    uint32_t* k_dst = kv_s + 2 * stage * kTileWords;
    uint32_t* v_dst = k_dst + kTileWords;
    for (int idx = threadIdx.x; idx < kMmaKeys * kChunks; idx += blockDim.x) {
      const int j = idx / kChunks, c = idx % kChunks;
      const int off = j * kRowWords + 4 * c;
      if (j < len) {
        cp_async_16(k_dst + off, kb + (first + j) * p.k_stride_s + 8 * c);
        cp_async_16(v_dst + off, vb + (first + j) * p.v_stride_s + 8 * c);
      } else {
        *reinterpret_cast<uint4*>(k_dst + off) = uint4{0u, 0u, 0u, 0u};
        *reinterpret_cast<uint4*>(v_dst + off) = uint4{0u, 0u, 0u, 0u};
      }
    }
    cp_async_commit();
  };
  if (n_tiles > 0) load_tile(0, 0);

  // Stage the block's query rows (row r -> head hkv * G + r / N, node r % N), 16 bytes at a time, while
  // the first K/V tile is in flight.
  for (int64_t idx = threadIdx.x; idx < block_rows * kChunks; idx += blockDim.x) {
    const int64_t r = idx / kChunks;
    const int c = static_cast<int>(idx % kChunks);
    const int64_t row = row0 + r;
    uint4 x = {0u, 0u, 0u, 0u};
    if (row < rows_total) {
      const int64_t h = hkv * group + row / p.num_nodes, i = row % p.num_nodes;
      x = *reinterpret_cast<const uint4*>(q + b * p.q_stride_b + h * p.q_stride_h + i * p.q_stride_n + 8 * c);
    }
    *reinterpret_cast<uint4*>(q_s + r * kRowWords + 4 * c) = x;
  }

  for (int64_t it = 0; it < n_tiles; ++it) {
    const int stage = static_cast<int>(it & 1);
    const int64_t tile0 = key_begin + it * kMmaKeys;
    const int tile_len = static_cast<int>(key_end - tile0 < kMmaKeys ? key_end - tile0 : kMmaKeys);
    cp_async_wait<0>();  // this thread's copies of tile it have landed
    // Everyone's copies of tile it (and the query rows, the first time) are visible, and every warp is
    // done with iteration it - 1, so its stage can take tile it + 1, copied while tile it is computed.
    __syncthreads();
    if (it + 1 < n_tiles) load_tile(it + 1, stage ^ 1);
    const uint32_t* k_s = kv_s + 2 * stage * kTileWords;
    const uint32_t* v_s = k_s + kTileWords;
    const bool tail_tile = tile0 + tile_len > span.tree_start;  // only these need the mask

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int64_t tile_row = (int64_t(mt) * warps + warp) * 16;             // block-relative first row
      if (tile_row >= block_rows || row0 + tile_row >= rows_total) continue;  // warp-uniform
      // S = Q K^T for 16 rows x kMmaKeys keys.
      float sc[KT][4];
#pragma unroll
      for (int nt = 0; nt < KT; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
      // A fragments of k-step ks by ldmatrix.x4: lanes 0-15 address rows 0-15 of the m-tile at features
      // 16 ks.., lanes 16-31 the same rows at 16 ks + 8.. (matrices a0, a1, a2, a3). B fragments of
      // n-tiles nt, nt + 1: lanes 0-7 / 8-15 address keys 8 nt + 0..7 at features 16 ks.. / 16 ks + 8..,
      // lanes 16-31 keys 8 nt + 8..15 likewise.
      const uint32_t* qa = q_s + (tile_row + (lane & 15)) * kRowWords + (lane >> 4) * 4;
      const uint32_t* kr = k_s + ((lane & 7) + ((lane >> 4) << 3)) * kRowWords + ((lane >> 3) & 1) * 4;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        uint32_t a[4];
        ldmatrix_x4<false>(a, qa + ks * 8);
#pragma unroll
        for (int nt = 0; nt < KT; nt += 2) {
          uint32_t r[4];
          ldmatrix_x4<false>(r, kr + nt * 8 * kRowWords + ks * 8);
          const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
          mma_m16n8k16<T>(sc[nt], a, b0);
          mma_m16n8k16<T>(sc[nt + 1], a, b1);
        }
      }
      // Online softmax: element e of n-tile nt is row g + 8 (e / 2), key tile0 + nt * 8 + 2t + e % 2.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // The row's visible keys in this tile, as a bit word (tail tiles only: at most two mask words
        // read per row, found here rather than kept in registers across the loop).
        uint64_t vis = ~uint64_t(0);
        if (tail_tile) {
          const int64_t row = row0 + tile_row + g + 8 * h;
          const int64_t node = row < rows_total ? row % p.num_nodes : 0;
          vis = tile_visibility(span, p.tree_mask + (b * p.num_nodes + node) * p.mask_words, p.mask_words, tile0);
        }
        float m = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < KT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = nt * 8 + 2 * t + e;
            const bool visible = key < tile_len && ((vis >> key) & 1u) != 0;
            const float sv = visible ? sc[nt][2 * h + e] * p.scale : -INFINITY;
            sc[nt][2 * h + e] = sv;
            m = fmaxf(m, sv);
          }
        }
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const float new_max = fmaxf(row_max[mt][h], m);
        const float alpha = softmax_rescale(row_max[mt][h], new_max);
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < KT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pj = new_max == -INFINITY ? 0.0f : __expf(sc[nt][2 * h + e] - new_max);
            sc[nt][2 * h + e] = pj;
            sum += pj;
          }
        }
        row_max[mt][h] = new_max;
        row_sum[mt][h] = row_sum[mt][h] * alpha + sum;  // per-lane partial, reduced at the end
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          acc[mt][nt][2 * h] *= alpha;
          acc[mt][nt][2 * h + 1] *= alpha;
        }
      }
      // O += P V: k-step j covers keys 16 j .. 16 j + 15 (S n-tiles 2 j, 2 j + 1).
#pragma unroll
      for (int j = 0; j < kMmaKeys / 16; ++j) {
        const uint32_t a[4] = {pack2<T>(sc[2 * j][0], sc[2 * j][1]), pack2<T>(sc[2 * j][2], sc[2 * j][3]),
                               pack2<T>(sc[2 * j + 1][0], sc[2 * j + 1][1]),
                               pack2<T>(sc[2 * j + 1][2], sc[2 * j + 1][3])};
        // ldmatrix.x4.trans: lanes 0-7 / 8-15 address keys 16 j + 0..7 / 8..15 of features 8 nt.., lanes
        // 16-31 the same keys of features 8 nt + 8..: the B fragments of n-tiles nt and nt + 1.
        const uint32_t* vr = v_s + (j * 16 + (lane & 15)) * kRowWords + (lane >> 4) * 4;
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
          uint32_t r[4];
          ldmatrix_x4<true>(r, vr + nt * 4);
          const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
          mma_m16n8k16<T>(acc[mt][nt], a, b0);
          mma_m16n8k16<T>(acc[mt][nt + 1], a, b1);
        }
      }
    }
  }

  // Epilogue: reduce the row sums over the quad, then write the output or the partial state.
  const int64_t rows_all = p.batch * p.heads_q * p.num_nodes;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int64_t tile_row = (int64_t(mt) * warps + warp) * 16;
    if (tile_row >= block_rows || row0 + tile_row >= rows_total) continue;  // warp-uniform
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = row_sum[mt][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int64_t row = row0 + tile_row + g + 8 * h;
      if (row >= rows_total) continue;
      const int64_t head = hkv * group + row / p.num_nodes, i = row % p.num_nodes;
      const int64_t out_row = (b * p.heads_q + head) * p.num_nodes + i;
      if (p.splits == 1) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        uint32_t* o = reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + out_row * D);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) o[nt * 4 + t] = pack2<T>(acc[mt][nt][2 * h] * inv, acc[mt][nt][2 * h + 1] * inv);
      } else {
        float* pa = p.part_acc + (split * rows_all + out_row) * D;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          pa[nt * 8 + 2 * t] = acc[mt][nt][2 * h];
          pa[nt * 8 + 2 * t + 1] = acc[mt][nt][2 * h + 1];
        }
        if (t == 0) {
          p.part_max[split * rows_all + out_row] = row_max[mt][h];
          p.part_sum[split * rows_all + out_row] = l;
        }
      }
    }
  }
}

// Combine the split partial states: grid (ceil(rows_all / 4)), block (32, 4): one warp per output
// row [B * Hq * N], lanes over features. Splits are at most kMaxSplits.
template <class T>
__global__ void tree_attention_combine_kernel(const float* __restrict__ part_acc, const float* __restrict__ part_max,
                                              const float* __restrict__ part_sum, T* __restrict__ out,
                                              int64_t rows_all, int64_t splits, int64_t d) {
  __shared__ float weights[4][kMaxSplits];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.y;
  if (row >= rows_all) return;
  if (threadIdx.x == 0) lse_combine_weights(part_max + row, part_sum + row, splits, rows_all, weights[threadIdx.y]);
  __syncwarp();
  for (int64_t f = threadIdx.x; f < d; f += 32) {
    float x = 0.0f;
    for (int64_t s = 0; s < splits; ++s) x += weights[threadIdx.y][s] * part_acc[(s * rows_all + row) * d + f];
    out[row * d + f] = from_float<T>(x);
  }
}

// Launcher: q [B, Hq, N, D], k/v [B, Hkv, S, D], out [B, Hq, N, D]; `plan` from plan_tree_attention
// for these sizes. The plan's splits, split_keys and block_rows replace those fields of `params`
// (part_* buffers sized for plan.splits when it is > 1).
template <class T, int D>
cudaError_t launch_tree_attention(const TreeAttentionParams& params, const AttentionPlan& plan,
                                  cudaStream_t stream) {
  TreeAttentionParams p = params;
  p.splits = plan.splits;
  p.split_keys = plan.split_keys;
  p.block_rows = plan.block_rows;
  dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.heads_kv * plan.row_blocks),
            static_cast<unsigned>(p.batch));
  cudaError_t err = cudaSuccess;
  if (plan.mma && (std::is_same_v<T, float> || D % 16 != 0)) return cudaErrorInvalidValue;  // not a plan for T
  if constexpr (!std::is_same_v<T, float> && D % 16 == 0) {
    if (plan.mma) {
      const int64_t smem = mma_smem_bytes(D, plan.block_rows);
      if (plan.block_rows > int64_t(plan.warps) * mma_warp_tiles(D) * 16) return cudaErrorInvalidValue;
      // The opt-in attribute is per kernel and process-wide: always set the same value (the largest
      // block this device can take), so launches from several host threads cannot undo each other.
      const int64_t most = mma_smem_bytes(D, int64_t(kMmaMaxWarps) * mma_warp_tiles(D) * 16);
      err = cudaFuncSetAttribute(tree_attention_mma_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(most < plan.smem_limit ? most : plan.smem_limit));
      if (err != cudaSuccess) return err;
      auto* kernel = &tree_attention_mma_kernel<T, D>;
      TAPS_LAUNCH(kernel, grid, plan.warps * 32, static_cast<size_t>(smem), stream, p);
    }
  }
  if (!plan.mma) {
    const size_t smem = sizeof(float) * attn_smem_floats<D>();
    err = cudaFuncSetAttribute(tree_attention_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    auto* kernel = &tree_attention_kernel<T, D>;
    TAPS_LAUNCH(kernel, grid, kAttnWarps * 32, smem, stream, p);
  }
  err = cudaGetLastError();
  if (err != cudaSuccess || p.splits == 1) return err;
  const int64_t rows_all = p.batch * p.heads_q * p.num_nodes;
  auto* combine = &tree_attention_combine_kernel<T>;
  TAPS_LAUNCH(combine, static_cast<unsigned>((rows_all + 3) / 4), dim3(32, 4), 0, stream,
      p.part_acc, p.part_max, p.part_sum, static_cast<T*>(p.out), rows_all, p.splits, int64_t(D));
  return cudaGetLastError();
}

// ------------------------------------------------------------------------------------------------
// compact_kv: one cache tensor [B, H, S, D] viewed as rows of `row_units` units of type U (U = a
// 1..16 byte word chosen by alignment). Grid (ceil(row_units / blockDim.x), H, B): each thread owns
// some unit columns of one (b, h) and walks the path in increasing order, so every source row is
// read before any write of that column could overwrite it (dst j = prefix + j < prefix + path[k]
// for all k > j since the path is strictly increasing from 0; equal positions are skipped).
// Invalid paths (see compact_path_length) are left untouched: never an out-of-bounds access.
// Not run on a GPU yet (compiled only).
// ------------------------------------------------------------------------------------------------
template <class U>
__global__ void compact_kv_kernel(U* __restrict__ cache, int64_t stride_b, int64_t stride_h, int64_t stride_s,
                                  int64_t row_units, int64_t cache_len, const int64_t* __restrict__ path,
                                  int64_t path_cols, const int64_t* __restrict__ prefix_lens) {
  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t* pb = path + b * path_cols;
  const int64_t prefix = prefix_lens[b];
  const int64_t n = compact_path_length(pb, path_cols, prefix, cache_len);
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

#endif  // __CUDACC__

}  // namespace taps
