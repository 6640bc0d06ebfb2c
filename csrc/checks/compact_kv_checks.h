// compact_kv input checks shared by the CPU and CUDA bindings (torch-side; no data access, so no device
// sync).
#pragma once
#include <ATen/ATen.h>

#include <string>

#include "checks/checks.h"

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

}  // namespace taps
