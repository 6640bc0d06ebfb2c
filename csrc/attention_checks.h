// tree_attention and compact_kv input checks shared by the CPU and CUDA bindings (torch-side; no data
// access, so no device sync).
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <string>

#include "checks.h"
#include "taps/common.h"

namespace taps {

// q [B, Hq, N, D]; k, v [B, Hkv, S, D]; tree_mask [B, N, W >= ceil(N / 64)]; kv_lens [B]; finite scale.
inline void check_tree_attention_inputs(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                        const at::Tensor& tree_mask_in, const at::Tensor& kv_lens_in, double scale) {
  const auto floats = {at::kFloat, at::kBFloat16, at::kHalf};
  check_tensor(q_in, "tree_attention: q [B, Hq, N, D]", 4, floats);
  check_tensor(k_in, "tree_attention: k [B, Hkv, S, D]", 4, floats);
  check_tensor(v_in, "tree_attention: v [B, Hkv, S, D]", 4, floats);
  check_tensor(tree_mask_in, "tree_attention: tree_mask [B, N, W]", 3, {at::kLong});
  check_tensor(kv_lens_in, "tree_attention: kv_lens [B]", 1, {at::kLong});
  check_same_device(q_in, k_in, "q", "tree_attention: k");
  check_same_device(q_in, v_in, "q", "tree_attention: v");
  check_same_device(q_in, tree_mask_in, "q", "tree_attention: tree_mask");
  check_same_device(q_in, kv_lens_in, "q", "tree_attention: kv_lens");
  TORCH_CHECK(k_in.scalar_type() == q_in.scalar_type() && v_in.scalar_type() == q_in.scalar_type(),
              "taps_ops: tree_attention: q, k and v must have one dtype, got ", q_in.scalar_type(), ", ",
              k_in.scalar_type(), ", ", v_in.scalar_type());
  const int64_t batch = q_in.size(0), heads_q = q_in.size(1), num_nodes = q_in.size(2), head_dim = q_in.size(3);
  const int64_t heads_kv = k_in.size(1);
  check_size(k_in, 0, batch, "tree_attention: k", "B");
  check_size(k_in, 3, head_dim, "tree_attention: k", "D (q's head dim)");
  TORCH_CHECK(v_in.sizes() == k_in.sizes(), "taps_ops: tree_attention: v must have k's shape ", k_in.sizes(),
              ", got ", v_in.sizes());
  TORCH_CHECK(heads_kv > 0 && heads_q % heads_kv == 0, "taps_ops: tree_attention: Hq = ", heads_q,
              " must be a multiple of Hkv = ", heads_kv);
  check_size(tree_mask_in, 0, batch, "tree_attention: tree_mask", "B");
  check_size(tree_mask_in, 1, num_nodes, "tree_attention: tree_mask", "N");
  TORCH_CHECK(tree_mask_in.size(2) >= ceil_div(num_nodes, 64), "taps_ops: tree_attention: tree_mask needs ",
              "at least ceil(N / 64) = ", ceil_div(num_nodes, 64), " words per row, got shape ",
              tree_mask_in.sizes());
  check_size(kv_lens_in, 0, batch, "tree_attention: kv_lens", "B");
  TORCH_CHECK(std::isfinite(scale), "taps_ops: tree_attention: scale must be finite, got ", scale);
}

// Every cache [B, H, S, D]: defined, floating, on path's device, batch B, contiguous last dimension, one
// length S for all. Returns S (-1 without caches).
inline int64_t check_compact_kv_caches(at::TensorList caches, const at::Tensor& path, int64_t batch) {
  int64_t cache_len = -1;
  for (size_t t = 0; t < caches.size(); ++t) {
    const at::Tensor& c = caches[t];
    const std::string name = "compact_kv: caches[" + std::to_string(t) + "] [B, H, S, D]";
    TORCH_CHECK(c.defined(), "taps_ops: ", name, " is undefined");
    TORCH_CHECK(c.dim() == 4, "taps_ops: ", name, " must have 4 dimensions, got shape ", c.sizes());
    TORCH_CHECK(c.is_floating_point(), "taps_ops: ", name, " must have a floating dtype, got ", c.scalar_type());
    check_same_device(path, c, "path", name.c_str());
    TORCH_CHECK(c.size(0) == batch, "taps_ops: ", name, " dimension 0 must be B = ", batch, ", got shape ",
                c.sizes());
    TORCH_CHECK(c.size(3) <= 1 || c.stride(3) == 1, "taps_ops: ", name,
                " must have a contiguous last dimension (it is updated in place), got strides ", c.strides());
    TORCH_CHECK(cache_len < 0 || c.size(2) == cache_len, "taps_ops: ", name, " has S = ", c.size(2),
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
