// tree_attention, the host+device core (no torch headers): the tree-mask test, the online-softmax
// algebra, the problem as raw pointers (Params), the layout of the key splits' partial results and the
// planning of the splits, shared by the CPU kernel (csrc/cpu/tree_attention.cpp) and the CUDA kernels
// (taps/tree_attention_kernel.cuh); and the launch plan of the CUDA kernels (host logic, here so that
// the CPU tests cover it).
//
// Conventions (see DESIGN.md, tree_attention):
//   q [B, Hq, N, D]; k, v [B, Hkv, S, D]; query head h reads KV head h / G (G = Hq / Hkv).
//   Request b has L = kv_lens[b] keys; positions L - T .. L - 1 are tree nodes 0 .. T - 1 (T = N unless
//   the caller gives more: queries for only the newest N of T nodes), masked by tree_mask[b, i] (bit j
//   of word j / 64: query i sees node j); positions < L - T (the prefix) are visible to every query;
//   positions >= L are ignored.
//   A query row that sees no key at all (only possible with a malformed mask) outputs zeros.
//   num_queries (optional, [B]): request b's queries are nodes 0 .. n_b - 1 only (n_b = num_queries[b],
//   clamped to [0, N]: live_queries); its rows i >= n_b are not computed and output zeros (a ragged
//   batch of trees in one [B, N] grid costs its real queries, not B x N).
//   The G * n_b query rows of one KV head are processed together: row r = g * n_b + i is query head
//   hkv * G + g, tree node i (n_b = N without num_queries).
//
// Online softmax: a partial result over some keys is (max m, sum l = sum exp(s - m), acc = sum
// exp(s - m) * v), with m = -inf and l = 0, acc = 0 for "no key seen". The final output is acc / l.
#pragma once
#include <cmath>
#include <cstdint>

#include "taps/common.h"

namespace taps {
namespace attention {

// True when query node `i` (whose mask row is `mask_row`, W int64 words) sees tree node `node`.
TAPS_HD bool tree_mask_visible(const int64_t* mask_row, int64_t node) {
  return ((static_cast<uint64_t>(mask_row[node >> 6]) >> (node & 63)) & 1u) != 0;
}

// Tree position bookkeeping of one request: L = kv_lens[b] clamped to [0, S], so that a bad length
// can never make a kernel read past the cache (the bindings reject it before; this is the backstop).
struct TreeSpan {
  int64_t len;         // keys of the request: positions [0, len)
  int64_t tree_start;  // first tree position, len - T (may be negative only for an invalid len < T)
};
TAPS_HD TreeSpan tree_span(int64_t kv_len, int64_t tree_nodes, int64_t cache_len) {
  const int64_t len = kv_len < 0 ? 0 : (kv_len > cache_len ? cache_len : kv_len);
  return TreeSpan{len, len - tree_nodes};
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

// ---- the problem ---------------------------------------------------------------------------------
struct Params {
  const void* q;             // [B, Hq, N, D] strides q_stride_{b,h,n}, feature stride 1
  const void* k;             // [B, Hkv, S, D] strides k_stride_{b,h,s}, feature stride 1
  const void* v;             // [B, Hkv, S, D] strides v_stride_{b,h,s}, feature stride 1
  const int64_t* tree_mask;  // [B, N, mask_words] contiguous
  const int64_t* kv_lens;    // [B]
  const int64_t* num_queries;  // [B] or null (every request N): queries computed per request, live_queries
  void* out;                 // [B, Hq, N, D] contiguous
  float* part_acc;           // partial results of the key splits (splits > 1 only): see partial_row
  float* part_max;
  float* part_sum;
  int64_t q_stride_b, q_stride_h, q_stride_n;
  int64_t k_stride_b, k_stride_h, k_stride_s;
  int64_t v_stride_b, v_stride_h, v_stride_s;
  int64_t batch, heads_q, heads_kv, num_nodes, head_dim, cache_len, mask_words;
  int64_t tree_nodes;  // T >= N: the last T keys of a request are tree nodes 0..T-1 (mask bits); the N
                       // queries are usually the last N of them (T = N: the queries are the whole tree)
  int64_t splits;      // key splits, merged by log-sum-exp when > 1
  int64_t split_keys;  // CUDA: keys per split, one for every request (the CPU sizes each request's own)
  int64_t block_rows;  // CUDA tensor-core kernel: query rows per block
  float scale;
};

// n_b: the queries of request b that are computed (num_queries[b] clamped to [0, N]; N without it). The
// bindings check the range; the clamp is the backstop, as for kv_lens.
TAPS_HD int64_t live_queries(const Params& p, int64_t b) {
  if (p.num_queries == nullptr) return p.num_nodes;
  const int64_t n = p.num_queries[b];
  return n < 0 ? 0 : (n > p.num_nodes ? p.num_nodes : n);
}

// Output row of query node i of head h in request b: (b * Hq + h) * N + i. For row r = g * n + i of KV
// head hkv's group (n = live_queries(p, b) > 0) that is (b * Hq + hkv * G + g) * N + i.
TAPS_HD int64_t output_row(const Params& p, int64_t b, int64_t hkv, int64_t r, int64_t n) {
  return (b * p.heads_q + hkv * (p.heads_q / p.heads_kv) + r / n) * p.num_nodes + r % n;
}

// Partial results of the key splits, one layout for both backends: split s of output row `row` keeps
// its unnormalised acc at part_acc[partial_row * D, + D) and its max and sum at part_max[partial_row],
// part_sum[partial_row]: arrays [splits, B * Hq * N, D] and [splits, B * Hq * N].
TAPS_HD int64_t partial_row(const Params& p, int64_t split, int64_t row) {
  return split * (p.batch * p.heads_q * p.num_nodes) + row;
}

// ---- key splits (flash-decoding), planned the same way for both backends ---------------------------
constexpr int64_t kMinSplitKeys = 256;

// Splits of the key range when `items` independent work items (requests x KV heads x row blocks) are
// fewer than `target` (what keeps the device busy): about target / items splits, each of at least
// kMinSplitKeys of the `keys` keys, at most max_splits.
TAPS_HD int64_t plan_splits(int64_t items, int64_t target, int64_t keys, int64_t max_splits) {
  int64_t splits = items > 0 ? ceil_div(target, items) : 1;
  const int64_t by_len = keys / kMinSplitKeys;
  splits = splits < by_len ? splits : by_len;
  splits = splits < max_splits ? splits : max_splits;
  return splits > 1 ? splits : 1;
}

// Keys per split when `keys` keys are cut into `splits`: a multiple of the kernel's `tile`, at least one.
TAPS_HD int64_t split_len(int64_t keys, int64_t splits, int64_t tile) {
  const int64_t n = ceil_div(ceil_div(keys, splits), tile) * tile;
  return n < tile ? tile : n;
}

// Keys [begin, end) of split `split` of a request with `len` keys (empty past its end).
struct KeyRange {
  int64_t begin, end;
};
TAPS_HD KeyRange split_range(int64_t len, int64_t split, int64_t split_keys) {
  const int64_t begin = split * split_keys < len ? split * split_keys : len;
  return KeyRange{begin, begin + split_keys < len ? begin + split_keys : len};
}

// ---- launch plan of the CUDA kernels (host logic, here so that the CPU tests cover it) ----------------
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

// Splits of `keys` keys into about `splits` parts of whole tiles of the plan's kernel.
TAPS_HD void set_splits(AttentionPlan& plan, int64_t splits, int64_t keys) {
  plan.split_keys = split_len(keys, splits, plan.mma ? kMmaKeys : kTileKeys);
  plan.splits = ceil_div(keys, plan.split_keys);
  if (plan.splits < 1) plan.splits = 1;
}

// mma_ok: bf16 / fp16 on an sm_80+ device with 16-byte aligned rows; sms: the device's SM count;
// max_smem: the shared memory a block may opt in to (the tensor-core kernel takes fewer warps, or the
// SIMT kernel runs, when its rows and two K/V stages do not fit).
// Splits (plan_splits): enough blocks for about two waves (the CUDA binding
// replans them with plan_gpu_splits once the kernel's residency is known); one split_keys
// for every request (a grid dimension), blocks past a request's keys write an empty partial result.
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
  plan.row_blocks = ceil_div(group_rows, plan.block_rows);
  set_splits(plan, plan_splits(batch * heads_kv * plan.row_blocks, 2 * sms, cache_len, kMaxSplits), cache_len);
  return plan;
}

// The CUDA kernels' splits once their residency is known (`resident`: blocks of this plan's size the
// device runs at once, sms x the occupancy API's blocks per SM; 0 keeps the two-wave plan). Every split
// keeps at least kMinGpuSplitKeys keys, and caches under kMinGpuSplitCache keys are not split (one more
// launch, the combine, costs more than it saves there).
// - The tensor-core kernel: its blocks hold a register file's worth of accumulators (246 registers a
//   thread at D = 128 on sm_90: one 8-warp block per SM), so a wave that spills over by one block costs
//   a whole second wave: the most splits whose blocks all fit in one wave; one split when the blocks
//   fill a wave alone. Measured on an H200 (bench/probe_cuda.py, bf16, D = 128, 64 nodes): B 4 S 2048 best
//   at 4 splits (the two-wave plan's 8: +24%), B 8 S 4096 at 2 (5: +24%), B 1 S 1024 at 8-16 (4: +20%).
// - The SIMT kernel: several small blocks per SM, each a chain of dependent tile loads, so more and
//   shorter blocks keep more loads in flight: up to kSimtWaves waves. On the H200: fp32 B 4 S 2048 (512
//   items) best at 8-16 splits (the plan's 1: +25%), fp32 B 8 D 64 S 1024 at 8 (2: +11%), bf16 N 3 S 4096
//   (8 items) at 32-64 (32 within 6%).
constexpr int64_t kMinGpuSplitKeys = 2 * kMmaKeys;
constexpr int64_t kMinGpuSplitCache = 512;
constexpr int64_t kSimtWaves = 8;
TAPS_HD void plan_gpu_splits(AttentionPlan& plan, int64_t batch, int64_t heads_kv, int64_t cache_len,
                             int64_t resident) {
  if (resident <= 0) return;
  const int64_t items = batch * heads_kv * plan.row_blocks;
  int64_t splits = items <= 0 ? 1 : plan.mma ? resident / items : ceil_div(kSimtWaves * resident, items);
  const int64_t by_len = cache_len < kMinGpuSplitCache ? 1 : cache_len / kMinGpuSplitKeys;
  splits = splits < by_len ? splits : by_len;
  splits = splits < kMaxSplits ? splits : kMaxSplits;
  set_splits(plan, splits > 1 ? splits : 1, cache_len);
}

}  // namespace attention
}  // namespace taps
