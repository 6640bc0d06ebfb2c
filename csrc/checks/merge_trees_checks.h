// merge_trees input checks, input preparation and output allocation, shared by the CPU and CUDA
// bindings (torch-side).
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "checks/checks.h"
#include "taps/merge_trees.h"
#include "checks/tree_checks.h"

namespace taps {

// Shapes, dtypes and devices of merge_trees' inputs (data checks run in the kernels).
inline void check_merge_trees_inputs(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& scores,
                                     int64_t num_nodes, const std::optional<at::Tensor>& weights) {
  check_tensor(tokens, "merge_trees: tokens", 3, {at::kLong});
  check_tensor(parents, "merge_trees: parents", 3, {at::kLong});
  check_tensor(scores, "merge_trees: scores", 3, {at::kFloat});
  TORCH_CHECK_VALUE(parents.sizes() == tokens.sizes() && scores.sizes() == tokens.sizes(),
                    "taps_ops: merge_trees: tokens, parents and scores must all have shape [B, T, N], got ",
                    tokens.sizes(), ", ", parents.sizes(), " and ", scores.sizes());
  check_same_device(tokens, parents, "merge_trees: tokens", "merge_trees: parents");
  check_same_device(tokens, scores, "merge_trees: tokens", "merge_trees: scores");
  const int64_t T = tokens.size(1), N = tokens.size(2);
  TORCH_CHECK_VALUE(T >= 1 && T <= tree::kMaxTrees, "taps_ops: merge_trees: the number of trees T must be in [1, ",
                    tree::kMaxTrees, "] (source is an int64 bitmask), got ", T);
  TORCH_CHECK_VALUE(N >= 1, "taps_ops: merge_trees: trees need at least the root node (N >= 1), got N = ", N);
  TORCH_CHECK_VALUE(T * N < (int64_t(1) << 31) / kErrorStride,
                    "taps_ops: merge_trees: too many nodes per request: T * N = ", T * N);
  TORCH_CHECK_VALUE(num_nodes >= 1, "taps_ops: merge_trees: num_nodes must be >= 1 (the root), got ", num_nodes);
  if (weights.has_value()) {
    check_tensor(*weights, "merge_trees: weights", 2, {at::kFloat});
    TORCH_CHECK_VALUE(weights->size(0) == tokens.size(0) && weights->size(1) == T,
                      "taps_ops: merge_trees: weights must have shape [B, T] = [", tokens.size(0), ", ", T, "], got ",
                      weights->sizes());
    check_same_device(tokens, *weights, "merge_trees: tokens", "merge_trees: weights");
  }
}

// The error of request `request` (encoded with the occurrence t * N + i as its index).
[[noreturn]] inline void raise_merge_trees_error(int64_t request, int32_t encoded, int64_t N) {
  const int64_t o = error_index(encoded);
  TORCH_CHECK_VALUE(false, "taps_ops: merge_trees: request ", request, ", tree ", o / N, ", node ", o % N, ": ",
                    tree::error_text(error_code(encoded)));
  __builtin_unreachable();
}

// One call's tensors: the inputs made contiguous and the outputs allocated.
struct MergeTreesCall {
  at::Tensor tokens, parents, scores, weights;  // [B, T, N] i64, i64, f32; weights [B, T] f32 or undefined
  TreeTensors out;
  int64_t batch, trees, nodes, num_nodes;  // B, T, N, output nodes

  static MergeTreesCall prepare(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& scores,
                                int64_t num_nodes, const std::optional<at::Tensor>& weights) {
    MergeTreesCall c;
    c.tokens = tokens.contiguous();
    c.parents = parents.contiguous();
    c.scores = scores.contiguous();
    if (weights.has_value()) c.weights = weights->contiguous();
    c.batch = tokens.size(0);
    c.trees = tokens.size(1);
    c.nodes = tokens.size(2);
    c.num_nodes = num_nodes;
    c.out = allocate_tree_outputs(c.scores, c.batch, num_nodes);
    return c;
  }

  const float* weights_ptr() const { return weights.defined() ? weights.data_ptr<float>() : nullptr; }
  tree::TreeBatch outputs() const { return tree_batch(out, num_nodes); }
};

}  // namespace taps
