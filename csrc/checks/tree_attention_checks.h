// tree_attention input checks, input preparation and output allocation, shared by the CPU and CUDA
// bindings (torch-side; no data access, so no device sync).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/MaybeOwned.h>

#include <cmath>
#include <optional>

#include "checks/checks.h"
#include "taps/tree_attention.h"

namespace taps {

// q [B, Hq, N, D]; k, v [B, Hkv, S, D]; tree_mask [B, N, W >= ceil(T / 64)]; kv_lens [B]; finite scale;
// T = tree_nodes (>= N) or N; num_queries [B] int64 when given (its values are checked by the backends: on the CPU
// always, on CUDA with validate). Returns T, the tree's node count.
inline int64_t check_tree_attention_inputs(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                        const at::Tensor& tree_mask_in, const at::Tensor& kv_lens_in, double scale,
                                        std::optional<int64_t> tree_nodes,
                                        const std::optional<at::Tensor>& num_queries = std::nullopt) {
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
  TORCH_CHECK_VALUE(k_in.scalar_type() == q_in.scalar_type() && v_in.scalar_type() == q_in.scalar_type(),
                    "taps_ops: tree_attention: q, k and v must have one dtype, got ", q_in.scalar_type(), ", ",
                    k_in.scalar_type(), ", ", v_in.scalar_type());
  const int64_t batch = q_in.size(0), heads_q = q_in.size(1), num_nodes = q_in.size(2), head_dim = q_in.size(3);
  const int64_t heads_kv = k_in.size(1);
  check_size(k_in, 0, batch, "tree_attention: k", "B");
  check_size(k_in, 3, head_dim, "tree_attention: k", "D (q's head dim)");
  TORCH_CHECK_VALUE(v_in.sizes() == k_in.sizes(), "taps_ops: tree_attention: v must have k's shape ", k_in.sizes(),
                    ", got ", v_in.sizes());
  TORCH_CHECK_VALUE(heads_kv > 0 && heads_q % heads_kv == 0, "taps_ops: tree_attention: Hq = ", heads_q,
                    " must be a multiple of Hkv = ", heads_kv);
  check_size(tree_mask_in, 0, batch, "tree_attention: tree_mask", "B");
  check_size(tree_mask_in, 1, num_nodes, "tree_attention: tree_mask", "N");
  TORCH_CHECK_VALUE(!tree_nodes.has_value() || *tree_nodes >= num_nodes, "taps_ops: tree_attention: tree_nodes = ",
                    tree_nodes.value_or(0), " must be at least N = ", num_nodes, " (the queries are tree nodes)");
  const int64_t tree = tree_nodes.value_or(num_nodes);
  TORCH_CHECK_VALUE(tree_mask_in.size(2) >= ceil_div(tree, 64), "taps_ops: tree_attention: tree_mask needs ",
                    "at least ceil(T / 64) = ", ceil_div(tree, 64), " words per row (T = ", tree,
                    " tree nodes), got shape ", tree_mask_in.sizes());
  check_size(kv_lens_in, 0, batch, "tree_attention: kv_lens", "B");
  if (num_queries.has_value()) {
    check_tensor(*num_queries, "tree_attention: num_queries [B]", 1, {at::kLong});
    check_same_device(q_in, *num_queries, "q", "tree_attention: num_queries");
    check_size(*num_queries, 0, batch, "tree_attention: num_queries", "B");
  }
  TORCH_CHECK_VALUE(std::isfinite(scale), "taps_ops: tree_attention: scale must be finite, got ", scale);
  return tree;
}

// One call's tensors: q, k, v with contiguous features, tree_mask and kv_lens contiguous, the output
// allocated; with params() the core's view of them. Inputs already in that layout are borrowed (the caller's
// tensors outlive the call), not copied: a copy's reference count change takes the GIL when Python owns the
// tensor, a few hundred ns a tensor.
struct TreeAttentionCall {
  c10::MaybeOwned<at::Tensor> q, k, v, tree_mask, kv_lens, num_queries;  // num_queries: undefined when not given
  at::Tensor out;                               // out [B, Hq, N, D] in q's dtype
  at::Tensor part_acc, part_max, part_sum;      // partial results of the key splits (splits > 1)

  static TreeAttentionCall prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& tree_mask, const at::Tensor& kv_lens,
                                   const std::optional<at::Tensor>& num_queries = std::nullopt) {
    auto feature_contiguous = [](const at::Tensor& t) {
      return t.stride(3) == 1 ? c10::MaybeOwned<at::Tensor>::borrowed(t)
                              : c10::MaybeOwned<at::Tensor>::owned(t.contiguous());
    };
    TreeAttentionCall c;
    c.q = feature_contiguous(q);
    c.k = feature_contiguous(k);
    c.v = feature_contiguous(v);
    c.tree_mask = tree_mask.expect_contiguous();
    c.kv_lens = kv_lens.expect_contiguous();
    c.num_queries = num_queries.has_value() ? num_queries->expect_contiguous() : c10::MaybeOwned<at::Tensor>::owned(at::Tensor());
    c.out = at::empty(q.sizes(), c.q->options());
    return c;
  }

  // The core's Params for `splits` key splits, allocating the partial results when splits > 1 (their
  // layout: attention::partial_row). split_keys and block_rows are left 0 for the backend to set.
  attention::Params params(double scale, int64_t splits, int64_t tree_nodes) {
    const int64_t batch = q->size(0), heads_q = q->size(1), num_nodes = q->size(2), head_dim = q->size(3);
    if (splits > 1) {
      const auto f32 = q->options().dtype(at::kFloat);
      part_acc = at::empty({splits, batch, heads_q, num_nodes, head_dim}, f32);
      part_max = at::empty({splits, batch, heads_q, num_nodes}, f32);
      part_sum = at::empty({splits, batch, heads_q, num_nodes}, f32);
    }
    attention::Params p{};
    p.q = q->data_ptr();
    p.k = k->data_ptr();
    p.v = v->data_ptr();
    p.tree_mask = tree_mask->data_ptr<int64_t>();
    p.kv_lens = kv_lens->data_ptr<int64_t>();
    p.num_queries = num_queries->defined() ? num_queries->data_ptr<int64_t>() : nullptr;
    p.out = out.data_ptr();
    p.part_acc = splits > 1 ? part_acc.data_ptr<float>() : nullptr;
    p.part_max = splits > 1 ? part_max.data_ptr<float>() : nullptr;
    p.part_sum = splits > 1 ? part_sum.data_ptr<float>() : nullptr;
    p.q_stride_b = q->stride(0), p.q_stride_h = q->stride(1), p.q_stride_n = q->stride(2);
    p.k_stride_b = k->stride(0), p.k_stride_h = k->stride(1), p.k_stride_s = k->stride(2);
    p.v_stride_b = v->stride(0), p.v_stride_h = v->stride(1), p.v_stride_s = v->stride(2);
    p.batch = batch, p.heads_q = heads_q, p.heads_kv = k->size(1), p.num_nodes = num_nodes, p.head_dim = head_dim;
    p.cache_len = k->size(2), p.mask_words = tree_mask->size(2), p.tree_nodes = tree_nodes;
    p.splits = splits;
    p.scale = static_cast<float>(scale);
    return p;
  }
};

}  // namespace taps
