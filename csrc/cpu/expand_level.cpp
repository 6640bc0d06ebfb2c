// expand_level, CPU kernel: input checks (checks/expand_level_checks.h), then every logits row (parallel over
// rows; expand::host_row of the core: the top k by a block-filtered scan, the sums as 32 lanes side by
// side in the core's order, so the bits are the CUDA kernel's, and the k children), then every request
// (parallel over requests; expand::host_request: its entropy and the next frontier by a partial sort in
// the same order). The row loops are compiled for AVX2 as well (run_rows, cpu/cpu_isa.h). The point of the op on
// the CPU is to replace the dozen operators of an expansion level (log_softmax, topk, the entropy, the
// token map, the cumulative scores, the parents, the frontier's topk and gathers: about 50 us a level at
// decoding's sizes) with one call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu/elementwise_cpu.h"
#include "checks/expand_level_checks.h"
#include "taps/expand_level.h"

namespace taps {
namespace {

template <int T>
inline __attribute__((always_inline)) void row_loop(const expand::Params& p, int64_t lo, int64_t hi) {
  float val[expand::kMaxK];
  int64_t idx[expand::kMaxK];
  for (int64_t row = lo; row < hi; ++row) expand::host_row<T>(p, row, val, idx);
}


void request_loop(const expand::Params& p, int64_t lo, int64_t hi) {
  std::vector<int64_t> order(static_cast<size_t>(p.front * p.k));
  for (int64_t r = lo; r < hi; ++r) expand::host_request(p, r, order.data());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
expand_level_cpu(const at::Tensor& logits, const at::Tensor& front_scores, const at::Tensor& front_cands, int64_t k,
                 int64_t next_k, int64_t cand_offset, const c10::optional<at::Tensor>& token_map, bool with_entropy) {
  ExpandLevelArgs a = prepare_expand_level(logits, front_scores, front_cands, k, next_k, cand_offset, token_map,
                                           with_entropy);
  TORCH_CHECK_VALUE(a.logits.device().is_cpu(), "taps_ops: expand_level: logits must be on the CPU for the CPU kernel, got ",
              a.logits.device());
  const expand::Params p = a.params();
  const int64_t rows = a.rows * a.front;
  const bool avx2 = elementwise_avx2();
  at::parallel_for(0, rows, elementwise_grain(a.vocab), [&](int64_t lo, int64_t hi) {
    switch (a.dtype) {
      case elementwise::kF32: run_rows(avx2, [&] { row_loop<elementwise::kF32>(p, lo, hi); }); break;
      case elementwise::kBF16: run_rows(avx2, [&] { row_loop<elementwise::kBF16>(p, lo, hi); }); break;
      case elementwise::kF16: run_rows(avx2, [&] { row_loop<elementwise::kF16>(p, lo, hi); }); break;
    }
  });
  at::parallel_for(0, a.rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(a.front * a.k, 1)),
                   [&](int64_t lo, int64_t hi) { request_loop(p, lo, hi); });
  return a.outputs();
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("expand_level", &expand_level_cpu); }

}  // namespace taps
