// build_tree, CUDA binding: the checks of the CPU binding (checks/build_tree_checks.h) and the device's size
// limits, one launch per batch (a block per request, taps/build_tree_kernel.cuh), then with validate
// one small device-to-host copy of the per-request error codes (a sync) to raise on bad input.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "checks/build_tree_checks.h"
#include "checks/checks.h"
#include "cuda/cuda_checks.h"
#include "taps/build_tree_kernel.cuh"

namespace taps {
namespace {

TreeTensors build_tree_cuda(const at::Tensor& scores, const at::Tensor& tokens, const at::Tensor& parents,
                            int64_t num_nodes, const std::optional<at::Tensor>& root_tokens, bool validate) {
  check_build_tree_inputs(scores, tokens, parents, num_nodes, root_tokens);
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t B = scores.size(0), M = scores.size(1);
  TORCH_CHECK_VALUE(M <= tree::kBuildTreeMaxCandidates, "taps_ops: build_tree: the CUDA kernel supports at most ",
                    tree::kBuildTreeMaxCandidates, " candidates per request, got M = ", M);
  TORCH_CHECK_VALUE(num_nodes <= tree::kMaxOutputNodes, "taps_ops: build_tree: the CUDA kernel supports at most ",
                    tree::kMaxOutputNodes, " nodes, got num_nodes = ", num_nodes);
  check_shared_memory(tree::build_tree_smem_bytes(M, num_nodes), "build_tree",
                      c10::str("M = ", M, " candidates and num_nodes = ", num_nodes),
                      "use fewer candidates or nodes, or run build_tree on the CPU");
  if (validate) check_validate_allowed("build_tree");
  const BuildTreeCall c = BuildTreeCall::prepare(scores, tokens, parents, num_nodes, root_tokens);
  const at::Tensor errors = at::full({B}, kNoError, c.scores.options().dtype(at::kInt));
  C10_CUDA_CHECK(tree::launch_build_tree(c.scores.data_ptr<float>(), c.tokens.data_ptr<int64_t>(),
                                         c.parents.data_ptr<int64_t>(), c.root_tokens_ptr(), B, M, c.outputs(),
                                         errors.data_ptr<int32_t>(), at::cuda::getCurrentCUDAStream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Without validate the kernel stays in bounds on bad input (a bad parent becomes the root, a NaN
  // score -inf); the results are then unspecified.
  if (validate && B > 0) raise_first_error(errors, raise_build_tree_error);
  return c.out;
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CUDA, m) { m.impl("build_tree", &taps::build_tree_cuda); }
