// compact_kv, CPU kernel: input checks (checks/compact_kv_checks.h), the path checks (compact::path_length,
// taps/compact_kv.h, with a precise message for the first bad request; also with validate=False: no
// sync to save), then row moves in increasing
// path order (safe although sources and destinations overlap: see taps/compact_kv.h), parallel over
// (tensor, b, h).
//
// caches: list of [B, H, S, D] tensors (K and V of every layer; any floating dtype, one per tensor),
// updated in place; path [B, P] i64 (-1 padded, path[:, 0] == 0, strictly increasing);
// prefix_lens [B] i64.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "checks/checks.h"
#include "checks/compact_kv_checks.h"
#include "taps/compact_kv.h"

namespace taps {
namespace {

struct CacheView {
  char* data;
  int64_t heads, stride_b, stride_h, stride_s, row_bytes;  // strides in bytes
};

void compact_kv_cpu(at::TensorList caches, const at::Tensor& path_in, const at::Tensor& prefix_lens_in,
                    bool /*validate*/) {
  check_compact_kv_path(path_in, prefix_lens_in);
  const int64_t batch = path_in.size(0), path_cols = path_in.size(1);
  TORCH_CHECK_VALUE(path_in.device().is_cpu(), "taps_ops: compact_kv: path must be on the CPU for the CPU kernel, got ",
              path_in.device());

  const int64_t cache_len = check_compact_kv_caches(caches, path_in, batch);
  std::vector<CacheView> views;
  for (const at::Tensor& c : caches) {
    const int64_t e = c.element_size();
    views.push_back({static_cast<char*>(c.data_ptr()), c.size(1), c.stride(0) * e, c.stride(1) * e,
                     c.stride(2) * e, c.size(3) * e});
  }
  const at::Tensor path = path_in.contiguous(), prefix_lens = prefix_lens_in.contiguous();
  // Validate even without caches (the bound against S then needs a cache; skip it).
  const std::vector<int64_t> moves = check_compact_kv_rows(path, prefix_lens, cache_len);
  const int64_t* pp = path.data_ptr<int64_t>();
  const int64_t* pl = prefix_lens.data_ptr<int64_t>();
  if (views.empty() || path_cols <= 1) return;
  const int64_t heads_total = [&] {
    int64_t n = 0;
    for (const auto& v : views) n += v.heads;
    return n;
  }();
  // Items: (b, global head over all tensors).
  std::vector<std::pair<int32_t, int64_t>> head_of(heads_total);
  for (int64_t t = 0, n = 0; t < static_cast<int64_t>(views.size()); ++t)
    for (int64_t h = 0; h < views[t].heads; ++h) head_of[n++] = {static_cast<int32_t>(t), h};
  // Small moves (the common case: a few rows per head) run on the calling thread; threads only pay
  // off for about 1 MiB or more.
  int64_t bytes = 0, max_moves = 0;
  for (const auto& v : views) bytes += v.heads * v.row_bytes;
  for (int64_t b = 0; b < batch; ++b) max_moves = std::max(max_moves, moves[b]);
  bytes *= batch * max_moves;
  const int64_t items = batch * heads_total;
  const int64_t grain = bytes < (int64_t{1} << 20) ? items : std::max<int64_t>(1, items * (int64_t{1} << 18) / bytes);
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / heads_total;
      const auto [t, h] = head_of[item % heads_total];
      const CacheView& v = views[t];
      const int64_t* pb = pp + b * path_cols;
      char* base = v.data + b * v.stride_b + h * v.stride_h;
      for (int64_t j = 1; j < moves[b]; ++j) {
        if (pb[j] == j) continue;
        std::memcpy(base + (pl[b] + j) * v.stride_s, base + (pl[b] + pb[j]) * v.stride_s, v.row_bytes);
      }
    }
  });
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("compact_kv", &taps::compact_kv_cpu); }
