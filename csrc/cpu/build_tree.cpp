// build_tree, CPU kernel: input checks (checks/build_tree_checks.h) and at::parallel_for over requests
// calling the core (taps/build_tree.h), which checks every candidate (also with validate=False: no
// sync to save, and the core's loop relies on the checks).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "checks/build_tree_checks.h"
#include "checks/checks.h"
#include "taps/build_tree.h"

namespace taps {
namespace {

TreeTensors build_tree_cpu(const at::Tensor& scores, const at::Tensor& tokens, const at::Tensor& parents,
                           int64_t num_nodes, const std::optional<at::Tensor>& root_tokens, bool /*validate*/) {
  check_build_tree_inputs(scores, tokens, parents, num_nodes, root_tokens);
  const BuildTreeCall c = BuildTreeCall::prepare(scores, tokens, parents, num_nodes, root_tokens);
  const int64_t B = c.batch, M = c.candidates;
  const tree::TreeBatch batch = c.outputs();
  const float* scores_p = c.scores.data_ptr<float>();
  const int64_t* tokens_p = c.tokens.data_ptr<int64_t>();
  const int64_t* parents_p = c.parents.data_ptr<int64_t>();
  const int64_t* root_p = c.root_tokens_ptr();
  std::vector<int32_t> errors(size_t(B), kNoError);
  const int64_t grain = std::max<int64_t>(1, 32768 / (M + num_nodes * batch.words + 1));
  at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
    tree::BuildTreeHostWorkspace ws;
    for (int64_t b = begin; b < end; ++b)
      errors[size_t(b)] = tree::build_tree_request_host(scores_p + b * M, tokens_p + b * M, parents_p + b * M, M,
                                                        root_p ? root_p[b] : -1, batch.request(b), ws);
  });
  raise_first_error(errors.data(), B, raise_build_tree_error);
  return c.out;
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("build_tree", &taps::build_tree_cpu); }
