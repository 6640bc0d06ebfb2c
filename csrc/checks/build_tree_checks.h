// build_tree input checks, input preparation and output allocation, shared by the CPU and CUDA bindings
// (torch-side).
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "checks/checks.h"
#include "taps/tree.h"
#include "checks/tree_checks.h"

namespace taps {

// Shapes, dtypes and devices of build_tree's inputs (data checks run in the kernels).
inline void check_build_tree_inputs(const at::Tensor& scores, const at::Tensor& tokens, const at::Tensor& parents,
                                    int64_t num_nodes, const std::optional<at::Tensor>& root_tokens) {
  check_tensor(scores, "build_tree: scores", 2, {at::kFloat});
  check_tensor(tokens, "build_tree: tokens", 2, {at::kLong});
  check_tensor(parents, "build_tree: parents", 2, {at::kLong});
  TORCH_CHECK_VALUE(tokens.sizes() == scores.sizes() && parents.sizes() == scores.sizes(),
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

// The error of request `request` (encoded with the candidate's index).
[[noreturn]] inline void raise_build_tree_error(int64_t request, int32_t encoded) {
  TORCH_CHECK_VALUE(false, "taps_ops: build_tree: request ", request, ", candidate ", error_index(encoded), ": ",
                    tree::error_text(error_code(encoded)));
  __builtin_unreachable();
}

// One call's tensors: the inputs made contiguous and the outputs allocated.
struct BuildTreeCall {
  at::Tensor scores, tokens, parents, root_tokens;  // [B, M] f32, i64, i64; root_tokens [B] or undefined
  TreeTensors out;
  int64_t batch, candidates, num_nodes;

  static BuildTreeCall prepare(const at::Tensor& scores, const at::Tensor& tokens, const at::Tensor& parents,
                               int64_t num_nodes, const std::optional<at::Tensor>& root_tokens) {
    BuildTreeCall c;
    c.scores = scores.contiguous();
    c.tokens = tokens.contiguous();
    c.parents = parents.contiguous();
    if (root_tokens.has_value()) c.root_tokens = root_tokens->contiguous();
    c.batch = scores.size(0);
    c.candidates = scores.size(1);
    c.num_nodes = num_nodes;
    c.out = allocate_tree_outputs(c.scores, c.batch, num_nodes);
    return c;
  }

  const int64_t* root_tokens_ptr() const { return root_tokens.defined() ? root_tokens.data_ptr<int64_t>() : nullptr; }
  tree::TreeBatch outputs() const { return tree_batch(out, num_nodes); }
};

}  // namespace taps
