// merge_trees, CPU kernel: input checks (checks/merge_trees_checks.h) and at::parallel_for over requests
// calling the core (taps/merge_trees.h), which checks every node (also with validate=False: no sync to
// save, and the core's loop relies on the checks).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "checks/checks.h"
#include "checks/merge_trees_checks.h"
#include "taps/merge_trees.h"

namespace taps {
namespace {

TreeTensors merge_trees_cpu(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& scores,
                            int64_t num_nodes, const std::optional<at::Tensor>& weights, bool /*validate*/) {
  check_merge_trees_inputs(tokens, parents, scores, num_nodes, weights);
  const MergeTreesCall c = MergeTreesCall::prepare(tokens, parents, scores, num_nodes, weights);
  const int64_t B = c.batch, T = c.trees, N = c.nodes;
  const tree::TreeBatch batch = c.outputs();
  const int64_t* tokens_p = c.tokens.data_ptr<int64_t>();
  const int64_t* parents_p = c.parents.data_ptr<int64_t>();
  const float* scores_p = c.scores.data_ptr<float>();
  const float* weights_p = c.weights_ptr();
  std::vector<int32_t> errors(size_t(B), kNoError);
  const int64_t grain = std::max<int64_t>(1, 32768 / (T * N + num_nodes * batch.words + 1));
  at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
    tree::MergeTreesHostWorkspace ws;
    for (int64_t b = begin; b < end; ++b)
      errors[size_t(b)] = tree::merge_trees_request_host(tokens_p + b * T * N, parents_p + b * T * N,
                                                         scores_p + b * T * N, weights_p ? weights_p + b * T : nullptr,
                                                         T, N, batch.request(b), ws);
  });
  raise_first_error(errors.data(), B, [N](int64_t b, int32_t e) { raise_merge_trees_error(b, e, N); });
  return c.out;
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("merge_trees", &taps::merge_trees_cpu); }
