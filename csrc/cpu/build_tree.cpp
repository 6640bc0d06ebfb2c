// build_tree, CPU kernel: input checks and at::parallel_for over requests calling the core
// (taps/build_tree.h). Also defines the torch-side helpers that the CUDA binding of build_tree and
// both bindings of merge_trees share (declared again where they are used).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "checks.h"
#include "taps/build_tree.h"

namespace taps {

using TreeTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Outputs of build_tree / merge_trees on `like`'s device: tokens, parents, depth [B, num_nodes] i64,
// tree_mask [B, num_nodes, ceil(num_nodes / 64)] i64, scores [B, num_nodes] f32, extra [B, num_nodes] i64.
TreeTensors allocate_tree_outputs(const at::Tensor& like, int64_t batch, int64_t num_nodes) {
  const auto i64 = like.options().dtype(at::kLong);
  const int64_t words = ceil_div(num_nodes, 64);
  return {at::empty({batch, num_nodes}, i64), at::empty({batch, num_nodes}, i64), at::empty({batch, num_nodes}, i64),
          at::empty({batch, num_nodes, words}, i64), at::empty({batch, num_nodes}, like.options().dtype(at::kFloat)),
          at::empty({batch, num_nodes}, i64)};
}

tree::TreeBatch tree_batch(const TreeTensors& out, int64_t num_nodes) {
  return tree::TreeBatch{std::get<0>(out).data_ptr<int64_t>(), std::get<1>(out).data_ptr<int64_t>(),
                         std::get<2>(out).data_ptr<int64_t>(), std::get<3>(out).data_ptr<int64_t>(),
                         std::get<4>(out).data_ptr<float>(),   std::get<5>(out).data_ptr<int64_t>(),
                         num_nodes,                            ceil_div(num_nodes, 64)};
}

// Shapes, dtypes and devices of build_tree's inputs (data checks run in the kernels).
void check_build_tree_inputs(const at::Tensor& scores, const at::Tensor& tokens, const at::Tensor& parents,
                             int64_t num_nodes, const std::optional<at::Tensor>& root_tokens) {
  check_tensor(scores, "build_tree: scores", 2, {at::kFloat});
  check_tensor(tokens, "build_tree: tokens", 2, {at::kLong});
  check_tensor(parents, "build_tree: parents", 2, {at::kLong});
  TORCH_CHECK(tokens.sizes() == scores.sizes() && parents.sizes() == scores.sizes(),
              "taps_ops: build_tree: scores, tokens and parents must all have shape [B, M], got ", scores.sizes(),
              ", ", tokens.sizes(), " and ", parents.sizes());
  check_same_device(scores, tokens, "build_tree: scores", "build_tree: tokens");
  check_same_device(scores, parents, "build_tree: scores", "build_tree: parents");
  TORCH_CHECK_VALUE(num_nodes >= 1, "taps_ops: build_tree: num_nodes must be >= 1 (the root), got ", num_nodes);
  TORCH_CHECK_VALUE(scores.size(1) < (int64_t(1) << 31) / kErrorStride,
                    "taps_ops: build_tree: too many candidates per request: ", scores.size(1));
  if (root_tokens.has_value()) {
    check_tensor(*root_tokens, "build_tree: root_tokens", 1, {at::kLong});
    check_size(*root_tokens, 0, scores.size(0), "build_tree: root_tokens", "B");
    check_same_device(scores, *root_tokens, "build_tree: scores", "build_tree: root_tokens");
  }
}

[[noreturn]] void raise_build_tree_error(int64_t request, int32_t encoded) {
  TORCH_CHECK_VALUE(false, "taps_ops: build_tree: request ", request, ", candidate ", error_index(encoded), ": ",
                    tree::error_text(error_code(encoded)));
  __builtin_unreachable();
}

namespace {

TreeTensors build_tree_cpu(const at::Tensor& scores_in, const at::Tensor& tokens_in, const at::Tensor& parents_in,
                           int64_t num_nodes, const std::optional<at::Tensor>& root_tokens_in) {
  check_build_tree_inputs(scores_in, tokens_in, parents_in, num_nodes, root_tokens_in);
  const at::Tensor scores = scores_in.contiguous(), tokens = tokens_in.contiguous(), parents = parents_in.contiguous();
  at::Tensor root_tokens;
  if (root_tokens_in.has_value()) root_tokens = root_tokens_in->contiguous();
  const int64_t B = scores.size(0), M = scores.size(1);
  TreeTensors out = allocate_tree_outputs(scores, B, num_nodes);
  const tree::TreeBatch batch = tree_batch(out, num_nodes);
  const float* scores_p = scores.data_ptr<float>();
  const int64_t* tokens_p = tokens.data_ptr<int64_t>();
  const int64_t* parents_p = parents.data_ptr<int64_t>();
  const int64_t* root_p = root_tokens.defined() ? root_tokens.data_ptr<int64_t>() : nullptr;
  std::vector<int32_t> errors(size_t(B), kNoError);
  const int64_t grain = std::max<int64_t>(1, 32768 / (M + num_nodes * batch.words + 1));
  at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
    tree::BuildTreeHostWorkspace ws;
    for (int64_t b = begin; b < end; ++b)
      errors[size_t(b)] = tree::build_tree_request_host(scores_p + b * M, tokens_p + b * M, parents_p + b * M, M,
                                                        root_p ? root_p[b] : -1, batch.request(b), ws);
  });
  raise_first_error(errors.data(), B, raise_build_tree_error);
  return out;
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("build_tree", &taps::build_tree_cpu); }
