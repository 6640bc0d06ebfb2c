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
constexpr int kAttnWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr int kAttnRows = kAttnWarps * kRowsPerWarp;
constexpr int kTileKeys = 32;

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
  int64_t splits, split_keys;  // split s covers key positions [s * split_keys, (s + 1) * split_keys)
  float scale;
};

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

  const int split = blockIdx.x, b = blockIdx.z;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t rows_total = group * p.num_nodes;
  const int64_t row_blocks = (rows_total + kAttnRows - 1) / kAttnRows;
  const int64_t hkv = blockIdx.y / row_blocks;
  const int64_t row0 = (blockIdx.y % row_blocks) * kAttnRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const TreeSpan span = tree_span(p.kv_lens[b], p.num_nodes, p.cache_len);
  const int64_t key_begin = split * p.split_keys;
  int64_t key_end = key_begin + p.split_keys;
  key_end = key_end < span.len ? key_end : span.len;

  const T* q = static_cast<const T*>(p.q);
  const T* kb = static_cast<const T*>(p.k) + b * p.k_stride_b + hkv * p.k_stride_h;
  const T* vb = static_cast<const T*>(p.v) + b * p.v_stride_b + hkv * p.v_stride_h;

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

// Combine the split partial states: grid (ceil(rows_all / 4)), block (32, 4): one warp per output
// row [B * Hq * N], lanes over features. Splits are at most kMaxSplits.
constexpr int kMaxSplits = 64;
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

// Launcher: q [B, Hq, N, D], k/v [B, Hkv, S, D], out [B, Hq, N, D]; p.splits / p.split_keys chosen
// by the caller (splits <= kMaxSplits; part_* buffers sized for splits when splits > 1).
template <class T, int D>
cudaError_t launch_tree_attention(const TreeAttentionParams& p, cudaStream_t stream) {
  const int64_t rows_total = (p.heads_q / p.heads_kv) * p.num_nodes;
  const int64_t row_blocks = (rows_total + kAttnRows - 1) / kAttnRows;
  const size_t smem = sizeof(float) * attn_smem_floats<D>();
  cudaError_t err = cudaFuncSetAttribute(tree_attention_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.heads_kv * row_blocks),
            static_cast<unsigned>(p.batch));
  auto* kernel = &tree_attention_kernel<T, D>;
  TAPS_LAUNCH(kernel, grid, kAttnWarps * 32, smem, stream, p);
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
