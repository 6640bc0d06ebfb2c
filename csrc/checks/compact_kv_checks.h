// compact_kv input checks shared by the CPU and CUDA bindings (torch-side; no data access, so no device
// sync).
#pragma once
#include <ATen/ATen.h>

#include <climits>
#include <cstdlib>
#include <string>
#include <vector>

#include "checks/checks.h"
#include "taps/compact_kv.h"

namespace taps {

// Every cache [B, H, S, D]: defined, floating, on path's device, batch B, contiguous last dimension, one
// length S for all. Returns S (-1 without caches).
inline int64_t check_compact_kv_caches(at::TensorList caches, const at::Tensor& path, int64_t batch) {
  int64_t cache_len = -1;
  for (size_t t = 0; t < caches.size(); ++t) {
    const at::Tensor& c = caches[t];
    const std::string name = "compact_kv: caches[" + std::to_string(t) + "] [B, H, S, D]";
    TORCH_CHECK_VALUE(c.defined(), "taps_ops: ", name, " is undefined");
    TORCH_CHECK_VALUE(c.dim() == 4, "taps_ops: ", name, " must have 4 dimensions, got shape ", c.sizes());
    TORCH_CHECK_VALUE(c.is_floating_point(), "taps_ops: ", name, " must have a floating dtype, got ", c.scalar_type());
    check_same_device(path, c, "path", name.c_str());
    TORCH_CHECK_VALUE(c.size(0) == batch, "taps_ops: ", name, " dimension 0 must be B = ", batch, ", got shape ",
                      c.sizes());
    TORCH_CHECK_VALUE(c.size(3) <= 1 || c.stride(3) == 1, "taps_ops: ", name,
                      " must have a contiguous last dimension (it is updated in place), got strides ", c.strides());
    TORCH_CHECK_VALUE(cache_len < 0 || c.size(2) == cache_len, "taps_ops: ", name, " has S = ", c.size(2),
                      " but caches[0] has S = ", cache_len, "; all caches must have one length");
    cache_len = c.size(2);
  }
  return cache_len;
}

// path [B, P], prefix_lens [B] on one device.
inline void check_compact_kv_path(const at::Tensor& path, const at::Tensor& prefix_lens) {
  check_tensor(path, "compact_kv: path [B, P]", 2, {at::kLong});
  check_tensor(prefix_lens, "compact_kv: prefix_lens [B]", 1, {at::kLong});
  check_size(prefix_lens, 0, path.size(0), "compact_kv: prefix_lens", "B (path's batch)");
  check_same_device(path, prefix_lens, "path", "compact_kv: prefix_lens");
}

// Throws the precise message for request b, whose path row pb [cols] with prefix length prefix failed
// compact::path_length against cache_len (INT64_MAX without caches). Shared by both backends, so the
// CUDA binding (which checks on the device first) reports what the CPU one does.
[[noreturn]] inline void throw_compact_kv_path_error(int64_t b, const int64_t* pb, int64_t cols, int64_t prefix,
                                                     int64_t cache_len) {
  TORCH_CHECK_VALUE(cols == 0 || pb[0] == 0, "taps_ops: compact_kv: path[", b, ", 0] must be 0 (the root), got ", pb[0]);
  TORCH_CHECK_VALUE(prefix >= 0, "taps_ops: compact_kv: prefix_lens[", b, "] = ", prefix, " must be >= 0");
  for (int64_t j = 1; j < cols && pb[j] >= 0; ++j)
    TORCH_CHECK_VALUE(pb[j] > pb[j - 1], "taps_ops: compact_kv: path[", b, "] must be strictly increasing before its ",
                      "first -1, got ", pb[j - 1], " then ", pb[j], " at column ", j);
  TORCH_CHECK_VALUE(false, "taps_ops: compact_kv: prefix_lens[", b, "] + path[", b, ", j] must be < S = ", cache_len,
                    " (prefix_lens[", b, "] = ", prefix, ")");
  std::abort();  // unreachable: the check above always throws
}

// The per-request path checks on host tensors path [B, P], prefix_lens [B] (contiguous int64): returns the
// number of rows each request moves, or throws the first bad request's message.
inline std::vector<int64_t> check_compact_kv_rows(const at::Tensor& path, const at::Tensor& prefix_lens,
                                                  int64_t cache_len) {
  const int64_t batch = path.size(0), cols = path.size(1);
  const int64_t* pp = path.data_ptr<int64_t>();
  const int64_t* pl = prefix_lens.data_ptr<int64_t>();
  const int64_t bound = cache_len < 0 ? INT64_MAX : cache_len;
  std::vector<int64_t> moves(batch);
  for (int64_t b = 0; b < batch; ++b) {
    moves[b] = compact::path_length(pp + b * cols, cols, pl[b], bound);
    if (moves[b] < 0) throw_compact_kv_path_error(b, pp + b * cols, cols, pl[b], cache_len);
  }
  return moves;
}

}  // namespace taps
