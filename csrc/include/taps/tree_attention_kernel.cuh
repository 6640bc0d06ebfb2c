// tree_attention, CUDA kernels (no torch headers): the SIMT kernel (any dtype), the tensor-core kernel
// (bf16 / fp16 on sm_80+), the combine kernel of the key splits, and the launcher that runs the plan of
// plan_tree_attention (taps/tree_attention.h). Launched by csrc/cuda/tree_attention.cu; compiled on the
// host by tests/cpp/test_emu_attention.cpp under the CUDA emulation, which compares both kernels with a
// reference.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "taps/ptx.cuh"
#include "taps/tree_attention.h"

namespace taps {
namespace attention {

// What a block of either attention kernel works on. Grid (splits, Hkv * row_blocks, B): the block's
// request, key split, KV head, the request's live queries n (live_queries) and group rows G * n, first
// query row of the head's group (row r = g * n + i: query head hkv * G + g, tree node i), its key range
// [key_begin, key_end) clamped to the request's length, and the request's K / V of that head. A block
// with row0 >= rows_total has no live row (the grid is planned for G * N rows): the kernels return at
// once, owing nothing (splits == 1: the binding zeroed the output; else the combine zeroes dead rows).
template <class T>
struct AttnBlock {
  int split, b;
  int64_t group, n, rows_total, hkv, row0, key_begin, key_end;
  TreeSpan span;
  const T *q, *k, *v;
};
template <class T>
TAPS_DEVICE AttnBlock<T> attn_block(const Params& p, int64_t block_rows) {
  AttnBlock<T> a;
  a.split = static_cast<int>(blockIdx.x);
  a.b = static_cast<int>(blockIdx.z);
  a.group = p.heads_q / p.heads_kv;
  a.n = live_queries(p, a.b);
  a.rows_total = a.group * a.n;
  const int64_t row_blocks = ceil_div(a.group * p.num_nodes, block_rows);  // the grid's, planned for N
  a.hkv = blockIdx.y / row_blocks;
  a.row0 = (blockIdx.y % row_blocks) * block_rows;
  a.span = tree_span(p.kv_lens[a.b], p.tree_nodes, p.cache_len);
  const KeyRange keys = split_range(a.span.len, a.split, p.split_keys);
  a.key_begin = keys.begin;
  a.key_end = keys.end;
  a.q = static_cast<const T*>(p.q);
  a.k = static_cast<const T*>(p.k) + a.b * p.k_stride_b + a.hkv * p.k_stride_h;
  a.v = static_cast<const T*>(p.v) + a.b * p.v_stride_b + a.hkv * p.v_stride_h;
  return a;
}

template <int D> constexpr int attn_smem_floats() {
  return 2 * kTileKeys * (D + 1) + kAttnRows * D + kAttnRows * kTileKeys;
}

// ------------------------------------------------------------------------------------------------
// tree_attention (flash-decoding style, SIMT FMA version).
//
// Grid (splits, Hkv * row_blocks, B); block kAttnWarps warps. A block owns kAttnRows = kAttnWarps *
// kRowsPerWarp consecutive rows of one KV head's query group (row r = g * n + i: query head
// hkv * G + g, tree node i; the whole group when G * n <= kAttnRows, otherwise row_blocks blocks share
// the KV head and re-read its K/V tiles, mostly from L2) and one contiguous split of the key range.
// K/V tiles of kTileKeys keys are staged in shared memory as fp32 (rows padded by one float: no
// bank conflicts). Scores: lane j owns key j of the tile; PV: lane owns features lane + 32 * t.
// Prefix tiles take no mask test; only tiles that reach the tree tail do.
// With splits == 1 the block writes out directly; otherwise it writes its partial state
// (max, sum, unnormalised acc) and tree_attention_combine_kernel merges the splits (log-sum-exp).
// ------------------------------------------------------------------------------------------------
// grid (splits, Hkv * row_blocks, B), block kAttnWarps * 32 threads, dynamic smem attn_smem_floats<D>().
template <class T, int D>
__global__ void __launch_bounds__(kAttnWarps * 32)
tree_attention_kernel(Params p) {
  static_assert(D % 32 == 0 || D == 80, "head dim");
  constexpr int kPerLane = (D + 31) / 32;  // features per lane in PV (D = 80: 3, last partial)
  TAPS_DYNAMIC_SHARED(float, smem);
  float* k_tile = smem;                                // [kTileKeys][D + 1]
  float* v_tile = k_tile + kTileKeys * (D + 1);        // [kTileKeys][D + 1]
  float* q_rows = v_tile + kTileKeys * (D + 1);        // [kAttnRows][D], pre-scaled
  float* p_rows = q_rows + kAttnRows * D;              // [kAttnRows][kTileKeys]

  const AttnBlock<T> blk = attn_block<T>(p, kAttnRows);
  if (blk.row0 >= blk.rows_total) return;  // no live row (whole block, before any barrier)
  const int split = blk.split, b = blk.b;
  const int64_t group = blk.group, n = blk.n, rows_total = blk.rows_total, hkv = blk.hkv, row0 = blk.row0;
  const int64_t key_begin = blk.key_begin, key_end = blk.key_end;
  const TreeSpan span = blk.span;
  const T *q = blk.q, *kb = blk.k, *vb = blk.v;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Stage this block's query rows (row r -> head hkv * G + r / n, node r % n), scaled.
  for (int idx = threadIdx.x; idx < kAttnRows * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D;
    const int64_t row = row0 + r;
    float x = 0.0f;
    if (row < rows_total) {
      const int64_t h = hkv * group + row / n, i = row % n;
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
    const int64_t i = row < rows_total ? row % n : 0;
    mask_row[r] = p.tree_mask + (b * p.num_nodes + i) * p.mask_words;  // the mask keeps N rows a request
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
    const int64_t out_row = output_row(p, b, hkv, row, n);
    if (p.splits == 1) {
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      T* o = static_cast<T*>(p.out) + out_row * D;
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) {
        const int d = lane + 32 * t;
        if (D % 32 == 0 || d < D) o[d] = from_float<T>(acc[r][t] * inv);
      }
    } else {
      const int64_t part_row = partial_row(p, split, out_row);
      float* pa = p.part_acc + part_row * D;
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) {
        const int d = lane + 32 * t;
        if (D % 32 == 0 || d < D) pa[d] = acc[r][t];
      }
      if (lane == 0) {
        p.part_max[part_row] = row_max[r];
        p.part_sum[part_row] = l;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// tree_attention, tensor-core version (bf16 / fp16 inputs, fp32 accumulation).
//
// Grid (splits, Hkv * row_blocks, B); block plan.warps warps (at most kMmaMaxWarps). A block holds
// block_rows (at most warps * MT * 16) rows of one KV head's query group (row r = g * n + i, as in the
// SIMT kernel): the whole group when it fits (G * N up to 256 rows at D <= 128, 128 at D = 256), so each
// K/V tile is read from global memory once for all of them; larger groups take several row blocks, which
// re-read the tiles mostly from L2.
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
template <class T, int D>
__global__ void __launch_bounds__(kMmaMaxWarps * 32)
tree_attention_mma_kernel(Params p) {
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
  if (blk.row0 >= blk.rows_total) return;  // no live row (whole block, before any copy or barrier)
  const int split = blk.split, b = blk.b;
  const int64_t group = blk.group, n = blk.n, rows_total = blk.rows_total, hkv = blk.hkv, row0 = blk.row0;
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

  // Stage the block's query rows (row r -> head hkv * G + r / n, node r % n), 16 bytes at a time, while
  // the first K/V tile is in flight.
  for (int64_t idx = threadIdx.x; idx < block_rows * kChunks; idx += blockDim.x) {
    const int64_t r = idx / kChunks;
    const int c = static_cast<int>(idx % kChunks);
    const int64_t row = row0 + r;
    uint4 x = {0u, 0u, 0u, 0u};
    if (row < rows_total) {
      const int64_t h = hkv * group + row / n, i = row % n;
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
          const int64_t node = row < rows_total ? row % n : 0;
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
      const int64_t out_row = output_row(p, b, hkv, row, n);
      if (p.splits == 1) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        uint32_t* o = reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + out_row * D);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) o[nt * 4 + t] = pack2<T>(acc[mt][nt][2 * h] * inv, acc[mt][nt][2 * h + 1] * inv);
      } else {
        const int64_t part_row = partial_row(p, split, out_row);
        float* pa = p.part_acc + part_row * D;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          pa[nt * 8 + 2 * t] = acc[mt][nt][2 * h];
          pa[nt * 8 + 2 * t + 1] = acc[mt][nt][2 * h + 1];
        }
        if (t == 0) {
          p.part_max[part_row] = row_max[mt][h];
          p.part_sum[part_row] = l;
        }
      }
    }
  }
}

// Combine the split partial states (laid out as partial_row says): grid (ceil(rows_all / 4)), block
// (32, 4): one warp per output row [B * Hq * N], lanes over features. Splits are at most kMaxSplits.
// A dead row (node i >= live_queries(p, b); p is the call's Params, read for that only) writes zeros:
// no attention block wrote its partials.
template <class T>
__global__ void tree_attention_combine_kernel(const float* __restrict__ part_acc, const float* __restrict__ part_max,
                                              const float* __restrict__ part_sum, T* __restrict__ out,
                                              int64_t rows_all, int64_t splits, int64_t d, Params p) {
  __shared__ float weights[4][kMaxSplits];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.y;
  if (row >= rows_all) return;
  if (p.num_queries != nullptr && row % p.num_nodes >= live_queries(p, row / (p.heads_q * p.num_nodes))) {
    for (int64_t f = threadIdx.x; f < d; f += 32) out[row * d + f] = from_float<T>(0.0f);
    return;  // the warp's own row: uniform for the warp, before its __syncwarp
  }
  if (threadIdx.x == 0) lse_combine_weights(part_max + row, part_sum + row, splits, rows_all, weights[threadIdx.y]);
  __syncwarp();
  for (int64_t f = threadIdx.x; f < d; f += 32) {
    float x = 0.0f;
    for (int64_t s = 0; s < splits; ++s) x += weights[threadIdx.y][s] * part_acc[(s * rows_all + row) * d + f];
    out[row * d + f] = from_float<T>(x);
  }
}

// The tensor-core kernel's opt-in shared memory. The attribute is per kernel and process-wide: always set
// the same value (the largest block this device can take), so launches from several host threads cannot
// undo each other.
template <class T, int D>
cudaError_t set_mma_smem_limit(int64_t smem_limit) {
  const int64_t most = mma_smem_bytes(D, int64_t(kMmaMaxWarps) * mma_warp_tiles(D) * 16);
  return cudaFuncSetAttribute(tree_attention_mma_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(most < smem_limit ? most : smem_limit));
}

// Blocks of `plan`'s kernel and size (the tensor-core kernel: warps and block_rows; the SIMT kernel: one
// size) one SM of the current device runs at once (the occupancy API; 0 on an error). Cached per device
// and block size: the engine calls this op once a layer.
template <class T, int D>
int blocks_per_sm(const AttentionPlan& plan) {
  constexpr int kDevices = 16, kTiles = kMmaMaxWarps * 2 + 1;  // block_rows / 16 <= warps x 2 m-tiles
  // [device][warps][m-tiles]; the SIMT kernel at [device][0][0]
  static std::atomic<int> cache[kDevices][kMmaMaxWarps + 1][kTiles] = {};
  const bool mma = plan.mma;
  if (mma && (plan.warps < 1 || plan.warps > kMmaMaxWarps)) return 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const int warps = mma ? plan.warps : 0;
  const int64_t tiles = mma ? plan.block_rows / 16 : 0;
  const bool cached = device < kDevices && tiles < kTiles;
  if (cached) {
    const int known = cache[device][warps][tiles].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int blocks = 0;
  if (!mma) {
    const size_t smem = sizeof(float) * attn_smem_floats<D>();
    if (cudaFuncSetAttribute(tree_attention_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, tree_attention_kernel<T, D>, kAttnWarps * 32, smem) !=
            cudaSuccess)
      return 0;
  } else if constexpr (!std::is_same_v<T, float> && D % 16 == 0) {
    if (set_mma_smem_limit<T, D>(plan.smem_limit) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, tree_attention_mma_kernel<T, D>, plan.warps * 32,
                                                      static_cast<size_t>(mma_smem_bytes(D, plan.block_rows))) !=
            cudaSuccess)
      return 0;
  }
  if (cached && blocks > 0) cache[device][warps][tiles].store(blocks, std::memory_order_relaxed);
  return blocks;
}

// Launcher: q [B, Hq, N, D], k/v [B, Hkv, S, D], out [B, Hq, N, D]; `plan` from plan_tree_attention
// for these sizes. The plan's splits, split_keys and block_rows replace those fields of `params`
// (part_* buffers sized for plan.splits when it is > 1).
template <class T, int D>
cudaError_t launch_tree_attention(const Params& params, const AttentionPlan& plan,
                                  cudaStream_t stream) {
  Params p = params;
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
      err = set_mma_smem_limit<T, D>(plan.smem_limit);
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
      p.part_acc, p.part_max, p.part_sum, static_cast<T*>(p.out), rows_all, p.splits, int64_t(D), p);
  return cudaGetLastError();
}

}  // namespace attention
}  // namespace taps
