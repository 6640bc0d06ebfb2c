// merge_trees, CUDA binding: the checks of the CPU binding (checks/merge_trees_checks.h) and the device's size
// limits, one launch per batch (a block per request, taps/merge_trees_kernel.cuh), then with validate
// one small device-to-host copy of the per-request error codes (a sync) to raise on bad input.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "checks/checks.h"
#include "cuda/cuda_checks.h"
#include "checks/merge_trees_checks.h"
#include "taps/merge_trees_kernel.cuh"

namespace taps {
namespace {

TreeTensors merge_trees_cuda(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& scores,
                             int64_t num_nodes, const std::optional<at::Tensor>& weights, bool validate) {
  check_merge_trees_inputs(tokens, parents, scores, num_nodes, weights);
  const c10::cuda::CUDAGuard guard(tokens.device());
  const int64_t B = tokens.size(0), T = tokens.size(1), N = tokens.size(2);
  TORCH_CHECK_VALUE(T * N <= tree::kMergeTreesMaxOccurrences,
                    "taps_ops: merge_trees: the CUDA kernel supports at most ",
                    tree::kMergeTreesMaxOccurrences, " nodes per request (T * N), got T * N = ", T * N);
  TORCH_CHECK_VALUE(num_nodes <= tree::kMaxOutputNodes, "taps_ops: merge_trees: the CUDA kernel supports at most ",
                    tree::kMaxOutputNodes, " nodes, got num_nodes = ", num_nodes);
  check_shared_memory(tree::merge_trees_smem_bytes(T * N, num_nodes), "merge_trees",
                      c10::str("T * N = ", T * N, " input nodes and num_nodes = ", num_nodes),
                      "use fewer or smaller trees, or run merge_trees on the CPU");
  if (validate) check_validate_allowed("merge_trees");
  const MergeTreesCall c = MergeTreesCall::prepare(tokens, parents, scores, num_nodes, weights);
  const at::Tensor errors = at::full({B}, kNoError, c.scores.options().dtype(at::kInt));
  C10_CUDA_CHECK(tree::launch_merge_trees(c.tokens.data_ptr<int64_t>(), c.parents.data_ptr<int64_t>(),
                                          c.scores.data_ptr<float>(), c.weights_ptr(), B, T, N, c.outputs(),
                                          errors.data_ptr<int32_t>(), at::cuda::getCurrentCUDAStream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Without validate the kernel stays in bounds on bad input (bad nodes are unreachable, NaN scores
  // -inf); the results are then unspecified.
  if (validate && B > 0)
    raise_first_error(errors, [N](int64_t b, int32_t e) { raise_merge_trees_error(b, e, N); });
  return c.out;
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CUDA, m) { m.impl("merge_trees", &taps::merge_trees_cuda); }
