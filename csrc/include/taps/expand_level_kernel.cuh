// expand_level, CUDA kernels (no torch headers) and their launcher. Launched by csrc/cuda/expand_level.cu;
// compiled on the host by tests/cpp/test_emu_expand_level.cpp under the CUDA emulation.
//
// Two kernels on one stream, the second reading what the first wrote:
//   expand_rows_kernel      a warp per logits row (r, f): the top k, the sums, the k children and the
//                           row's entropy (taps/expand_level.h's arithmetic, in the CPU kernel's order);
//   expand_requests_kernel  a block per request r: its entropy and the next frontier.
// Same bits as the CPU kernel (csrc/cpu/expand_level.cpp) except where the device's logf differs from the
// host's (log(s), the entropy's log).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "taps/expand_level.h"

namespace taps {
namespace expand {

constexpr int kRowsPerBlock = 4;                  // expand_rows_kernel: one warp per row
constexpr int kRequestThreads = 256;              // expand_requests_kernel: threads per request
constexpr int kChildrenPerLane = kMaxK / kLanes;  // children a lane writes at most

// The best of the warp's 32 (value, index) pairs by better(), on every lane (xor butterfly). The indices
// of the lanes' pairs are distinct (or sentinels), so the order is total and every lane ends with the
// same pair.
TAPS_DEVICE void warp_best(float& v, int64_t& i) {
  for (int off = kLanes / 2; off > 0; off /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, i, off);
    if (better(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// logits: rows * front rows of `vocab` elements, `row_stride` elements apart. Warp w of block b owns row
// b * kRowsPerBlock + w = r * front + f:
//   1. lane l scans elements l, l + 32, ... (kAhead loads at a time: load_ahead) keeping its own top k
//      (topk_push on rank_value'd values, in increasing index: the lane's list is the CPU scan's restricted
//      to the lane's elements) and whether it saw a NaN (the warp's: a ballot);
//   2. the warp merges the 32 sorted lists in k rounds: each lane offers its head (-inf with the largest
//      index once its list is spent: never chosen, as the row has vocab >= k real elements), warp_best
//      picks the winner, its lane advances; lane j % 32 keeps child j's token id. The round-0 winner is
//      the CPU's val[0], the row maximum m (the first of equal maxima, so even a zero's sign agrees);
//   3. lane l's sums over its elements (lane_sums, kAhead loads at a time), combined by shuffle-down with
//      offsets 16 .. 1 (the CPU's tree), lane 0's result broadcast, then finish_sums;
//   4. lane j % 32 writes child j (write_child), lane 0 the row's entropy.
template <int T>
__global__ void __launch_bounds__(kRowsPerBlock * kLanes) expand_rows_kernel(const Params p) {
  const int lane = threadIdx.x % kLanes;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  if (row >= p.rows * p.front) return;  // the whole warp: a row belongs to one warp
  const int64_t elem = T == kF32 ? 4 : 2;
  const char* x = static_cast<const char*>(p.logits) + row * p.row_stride * elem;
  const int k = static_cast<int>(p.k);

  float val[kMaxK];
  int64_t idx[kMaxK];
  topk_init(val, idx, k);
  bool has_nan = false;
  for (int64_t base = lane; base < p.vocab; base += kLanes * kAhead) {
    float ahead[kAhead];
    load_ahead<T>(x, p.vocab, base, ahead);
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t i = base + u * kLanes;
      if (i >= p.vocab) break;
      const float x_i = ahead[u];
      has_nan |= x_i != x_i;
      const float v = rank_value(x_i);
      if (better(v, i, val[k - 1], idx[k - 1])) topk_push(val, idx, k, v, i);
    }
  }
  has_nan = __ballot_sync(0xffffffffu, has_nan) != 0u;

  int64_t mine[kChildrenPerLane] = {};  // child j's token id, on lane j % 32
  float m = -INFINITY;
  int head = 0;
  for (int j = 0; j < k; ++j) {
    float v = head < k ? val[head] : -INFINITY;
    int64_t i = head < k ? idx[head] : INT64_MAX;
    const int64_t offered = i;
    warp_best(v, i);
    if (i == offered) ++head;  // distinct indices: the winner's own lane
    if (j == 0) m = v;
    if (lane == j % kLanes) mine[j / kLanes] = i;
  }

  float s = 0.0f, t = 0.0f;
  lane_sums<T>(x, p.vocab, lane, m, s, t);
  for (int off = kLanes / 2; off > 0; off /= 2) {
    s = add(s, __shfl_down_sync(0xffffffffu, s, off));
    t = add(t, __shfl_down_sync(0xffffffffu, t, off));
  }
  s = __shfl_sync(0xffffffffu, s, 0);
  t = __shfl_sync(0xffffffffu, t, 0);
  finish_sums(has_nan, m, s, t);

  const float log_s = log_sum(s);
  const int64_t r = row / p.front, f = row % p.front;
  for (int j = lane; j < k; j += kLanes) {
    const int64_t id = mine[j / kLanes];
    write_child(p, r, f, j, id, log_prob(load_t<T>(x, id), m, log_s));
  }
  if (lane == 0) p.row_entropy[row] = p.with_entropy ? row_entropy(s, t) : 0.0f;
}

// Block r = request r: thread 0 writes its entropy (request_entropy, over the row entropies of
// expand_rows_kernel); every child c in [0, front * k) counts its rank, the number of children before it
// in better() order on rank_value(scores), and the ones ranked below next_k write next-frontier entry
// `rank` (write_next). The order is total (distinct child indices), so the ranks are a permutation and
// the next frontier is the CPU's partial sort exactly. O((front * k)^2) comparisons per request, a child's
// count stopping at next_k.
__global__ void __launch_bounds__(kRequestThreads) expand_requests_kernel(const Params p) {
  const int64_t r = blockIdx.x;
  if (threadIdx.x == 0) p.entropy[r] = request_entropy(p, r);
  if (p.next_k == 0) return;
  const int64_t children = p.front * p.k;
  const float* sc = p.scores + r * children;
  for (int64_t c = threadIdx.x; c < children; c += blockDim.x) {
    const float v = rank_value(sc[c]);
    int64_t rank = 0;
    for (int64_t o = 0; o < children && rank < p.next_k; ++o)
      if (better(rank_value(sc[o]), o, v, c)) ++rank;
    if (rank < p.next_k) write_next(p, r, rank, c);
  }
}

// Both kernels on `stream` (Params: taps/expand_level.h; 1 <= k <= kMaxK, k <= vocab, next_k <= front * k).
template <int T>
cudaError_t launch_expand_level(const Params& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const int64_t rows = p.rows * p.front;
  if (rows > 0) {
    const unsigned grid = static_cast<unsigned>(ceil_div(rows, kRowsPerBlock));
    auto* kernel = &expand_rows_kernel<T>;
    TAPS_LAUNCH(kernel, grid, kRowsPerBlock * kLanes, 0, stream, p);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  auto* requests = &expand_requests_kernel;
  TAPS_LAUNCH(requests, static_cast<unsigned>(p.rows), kRequestThreads, 0, stream, p);
  return cudaGetLastError();
}

}  // namespace expand
}  // namespace taps
