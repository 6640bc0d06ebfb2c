// merge_trees, CPU kernel: input checks and at::parallel_for over requests calling the core
// (taps/merge_trees.h). Also defines the torch-side checks that the CUDA binding shares.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "checks.h"
#include "taps/merge_trees.h"

namespace taps {

using TreeTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// Defined in csrc/cpu/build_tree.cpp.
TreeTensors allocate_tree_outputs(const at::Tensor& like, int64_t batch, int64_t num_nodes);
tree::TreeBatch tree_batch(const TreeTensors& out, int64_t num_nodes);

// Shapes, dtypes and devices of merge_trees' inputs (data checks run in the kernels).
void check_merge_trees_inputs(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& scores,
                              int64_t num_nodes, const std::optional<at::Tensor>& weights) {
  check_tensor(tokens, "merge_trees: tokens", 3, {at::kLong});
  check_tensor(parents, "merge_trees: parents", 3, {at::kLong});
  check_tensor(scores, "merge_trees: scores", 3, {at::kFloat});
  TORCH_CHECK(parents.sizes() == tokens.sizes() && scores.sizes() == tokens.sizes(),
              "taps_ops: merge_trees: tokens, parents and scores must all have shape [B, T, N], got ", tokens.sizes(),
              ", ", parents.sizes(), " and ", scores.sizes());
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
    TORCH_CHECK(weights->size(0) == tokens.size(0) && weights->size(1) == T,
                "taps_ops: merge_trees: weights must have shape [B, T] = [", tokens.size(0), ", ", T, "], got ",
                weights->sizes());
    check_same_device(tokens, *weights, "merge_trees: tokens", "merge_trees: weights");
  }
}

[[noreturn]] void raise_merge_trees_error(int64_t request, int32_t encoded, int64_t N) {
  const int64_t o = error_index(encoded);
  TORCH_CHECK_VALUE(false, "taps_ops: merge_trees: request ", request, ", tree ", o / N, ", node ", o % N, ": ",
                    tree::error_text(error_code(encoded)));
  __builtin_unreachable();
}

namespace {

TreeTensors merge_trees_cpu(const at::Tensor& tokens_in, const at::Tensor& parents_in, const at::Tensor& scores_in,
                            int64_t num_nodes, const std::optional<at::Tensor>& weights_in) {
  check_merge_trees_inputs(tokens_in, parents_in, scores_in, num_nodes, weights_in);
  const at::Tensor tokens = tokens_in.contiguous(), parents = parents_in.contiguous(), scores = scores_in.contiguous();
  at::Tensor weights;
  if (weights_in.has_value()) weights = weights_in->contiguous();
  const int64_t B = tokens.size(0), T = tokens.size(1), N = tokens.size(2);
  TreeTensors out = allocate_tree_outputs(scores, B, num_nodes);
  const tree::TreeBatch batch = tree_batch(out, num_nodes);
  const int64_t* tokens_p = tokens.data_ptr<int64_t>();
  const int64_t* parents_p = parents.data_ptr<int64_t>();
  const float* scores_p = scores.data_ptr<float>();
  const float* weights_p = weights.defined() ? weights.data_ptr<float>() : nullptr;
  std::vector<int32_t> errors(size_t(B), kNoError);
  const int64_t grain = std::max<int64_t>(1, 32768 / (T * N + num_nodes * batch.words + 1));
  at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
    tree::MergeTreesHostWorkspace ws;
    for (int64_t b = begin; b < end; ++b)
      errors[size_t(b)] = tree::merge_trees_request_host(tokens_p + b * T * N, parents_p + b * T * N,
                                                         scores_p + b * T * N, weights_p ? weights_p + b * T : nullptr,
                                                         T, N, batch.request(b), ws);
  });
  raise_first_error(errors.data(), B, [N](int64_t b, int32_t encoded) { raise_merge_trees_error(b, encoded, N); });
  return out;
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("merge_trees", &taps::merge_trees_cpu); }
