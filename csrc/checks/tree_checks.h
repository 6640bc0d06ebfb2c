// Torch-side pieces shared by the build_tree and merge_trees bindings (CPU and CUDA): their outputs.
#pragma once
#include <ATen/ATen.h>

#include <tuple>

#include "taps/tree.h"

namespace taps {

// tokens, parents, depth [B, num_nodes] i64, tree_mask [B, num_nodes, ceil(num_nodes / 64)] i64,
// scores [B, num_nodes] f32, extra [B, num_nodes] i64 (build_tree: candidate_index; merge_trees: source).
using TreeTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The outputs of a batch of `batch` trees on `like`'s device (uninitialised: the kernels write every entry).
inline TreeTensors allocate_tree_outputs(const at::Tensor& like, int64_t batch, int64_t num_nodes) {
  const auto i64 = like.options().dtype(at::kLong);
  const int64_t words = ceil_div(num_nodes, 64);
  return {at::empty({batch, num_nodes}, i64), at::empty({batch, num_nodes}, i64), at::empty({batch, num_nodes}, i64),
          at::empty({batch, num_nodes, words}, i64), at::empty({batch, num_nodes}, like.options().dtype(at::kFloat)),
          at::empty({batch, num_nodes}, i64)};
}

// The outputs as the core's raw pointers.
inline tree::TreeBatch tree_batch(const TreeTensors& out, int64_t num_nodes) {
  return tree::TreeBatch{std::get<0>(out).data_ptr<int64_t>(), std::get<1>(out).data_ptr<int64_t>(),
                         std::get<2>(out).data_ptr<int64_t>(), std::get<3>(out).data_ptr<int64_t>(),
                         std::get<4>(out).data_ptr<float>(),   std::get<5>(out).data_ptr<int64_t>(),
                         num_nodes,                            ceil_div(num_nodes, 64)};
}

}  // namespace taps
