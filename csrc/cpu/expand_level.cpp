// expand_level, CPU kernel: input checks (expand_level_checks.h), then every logits row (parallel over
// rows): one scan for the top k (taps/expand_level.h's order; the first is the maximum), one pass for the sums, run
// as 32 lanes side by side in the core's order (so the bits are the CUDA kernel's), and the k children
// written; then every request (parallel over requests): its entropy and the next frontier by a partial
// sort in the same order. The point of the op on the CPU is to replace the dozen operators of an
// expansion level (log_softmax, topk, the entropy, the token map, the cumulative scores, the parents, the
// frontier's topk and gathers: about 50 us a level at decoding's sizes) with one call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "cpu/elementwise_cpu.h"
#include "expand_level_checks.h"
#include "taps/expand_level.h"

namespace taps {
namespace {

using expand::kLanes;
using expand::kMaxK;

// Row (r, f): the top k and the sums, then its children.
template <int T>
inline __attribute__((always_inline)) void row_loop(const expand::Params& p, int64_t lo, int64_t hi) {
  const int64_t elem = T == elementwise::kF32 ? 4 : 2;
  float val[kMaxK];
  int64_t idx[kMaxK];
  const int k = static_cast<int>(p.k);
  for (int64_t row = lo; row < hi; ++row) {
    const char* x = static_cast<const char*>(p.logits) + row * p.row_stride * elem;
    expand::topk_init(val, idx, k);
    // The scan, 32 elements at a time: a vectorised test whether any element reaches the current k-th
    // value (or is NaN), then the scalar insertion only for such blocks (few once the list has filled).
    bool has_nan = false;
    auto push = [&](int64_t i) {
      const float x_i = elementwise::load_t<T>(x, i);
      has_nan |= x_i != x_i;
      const float v = expand::rank_value(x_i);
      if (expand::better(v, i, val[k - 1], idx[k - 1])) expand::topk_push(val, idx, k, v, i);
    };
    int64_t b0 = 0;
    for (; b0 + kLanes <= p.vocab; b0 += kLanes) {
      const float thr = val[k - 1];
      int hit = 0;
      for (int lane = 0; lane < kLanes; ++lane) {
        const float x_i = elementwise::load_t<T>(x, b0 + lane);
        hit |= int(x_i >= thr) | int(x_i != x_i);
      }
      if (hit)
        for (int lane = 0; lane < kLanes; ++lane) push(b0 + lane);
    }
    for (; b0 < p.vocab; ++b0) push(b0);
    const float m = val[0];  // the best element is the row's maximum (NaN as -inf)
    float s[kLanes], t[kLanes];
    for (int lane = 0; lane < kLanes; ++lane) s[lane] = t[lane] = 0.0f;
    int64_t i0 = 0;
    for (; i0 + kLanes <= p.vocab; i0 += kLanes)
      for (int lane = 0; lane < kLanes; ++lane) expand::sum_terms(elementwise::load_t<T>(x, i0 + lane), m, s[lane], t[lane]);
    for (int lane = 0; i0 + lane < p.vocab; ++lane) expand::sum_terms(elementwise::load_t<T>(x, i0 + lane), m, s[lane], t[lane]);
    for (int off = kLanes / 2; off > 0; off /= 2)
      for (int lane = 0; lane < off; ++lane) {
        s[lane] = expand::add(s[lane], s[lane + off]);
        t[lane] = expand::add(t[lane], t[lane + off]);
      }
    expand::finish_sums(has_nan, m, s[0], t[0]);
    const float log_s = expand::log_sum(s[0]);
    const int64_t r = row / p.front, f = row % p.front;
    for (int j = 0; j < k; ++j)
      expand::write_child(p, r, f, j, idx[j], expand::log_prob(elementwise::load_t<T>(x, idx[j]), m, log_s));
    p.row_entropy[row] = p.with_entropy ? expand::row_entropy(s[0], t[0]) : 0.0f;
  }
}

TAPS_AVX2_CLONES void rows_f32(const expand::Params& p, int64_t lo, int64_t hi) { row_loop<elementwise::kF32>(p, lo, hi); }
TAPS_AVX2_CLONES void rows_bf16(const expand::Params& p, int64_t lo, int64_t hi) { row_loop<elementwise::kBF16>(p, lo, hi); }
TAPS_AVX2_CLONES void rows_f16(const expand::Params& p, int64_t lo, int64_t hi) { row_loop<elementwise::kF16>(p, lo, hi); }

// Request r: its entropy and the next_k best children (best first).
void request_loop(const expand::Params& p, int64_t lo, int64_t hi) {
  const int64_t children = p.front * p.k;
  std::vector<int64_t> order(static_cast<size_t>(children));
  for (int64_t r = lo; r < hi; ++r) {
    p.entropy[r] = expand::request_entropy(p, r);
    if (p.next_k == 0) continue;
    const float* sc = p.scores + r * children;
    std::iota(order.begin(), order.end(), int64_t(0));
    std::partial_sort(order.begin(), order.begin() + p.next_k, order.end(), [sc](int64_t a, int64_t b) {
      return expand::better(expand::rank_value(sc[a]), a, expand::rank_value(sc[b]), b);
    });
    for (int64_t rank = 0; rank < p.next_k; ++rank) expand::write_next(p, r, rank, order[rank]);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
expand_level_cpu(const at::Tensor& logits, const at::Tensor& front_scores, const at::Tensor& front_cands, int64_t k,
                 int64_t next_k, int64_t cand_offset, const c10::optional<at::Tensor>& token_map, bool with_entropy) {
  ExpandLevelArgs a = prepare_expand_level(logits, front_scores, front_cands, k, next_k, cand_offset, token_map,
                                           with_entropy);
  TORCH_CHECK(a.logits.device().is_cpu(), "taps_ops: expand_level: logits must be on the CPU for the CPU kernel, got ",
              a.logits.device());
  const expand::Params p = a.params();
  const int64_t rows = a.rows * a.front;
  at::parallel_for(0, rows, elementwise_grain(a.vocab), [&](int64_t lo, int64_t hi) {
    switch (a.dtype) {
      case elementwise::kF32: rows_f32(p, lo, hi); break;
      case elementwise::kBF16: rows_bf16(p, lo, hi); break;
      case elementwise::kF16: rows_f16(p, lo, hi); break;
    }
  });
  at::parallel_for(0, a.rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(a.front * a.k, 1)),
                   [&](int64_t lo, int64_t hi) { request_loop(p, lo, hi); });
  return a.outputs();
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("expand_level", &expand_level_cpu); }

}  // namespace taps
