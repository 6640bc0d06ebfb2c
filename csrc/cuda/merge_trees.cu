// merge_trees, CUDA kernel binding: the same checks as the CPU kernel, one launch per batch (a block
// per request, taps/merge_trees.h), then one small device-to-host copy of the per-request error codes
// (a sync) to raise on bad input. NOTE: compiled but never run on a GPU so far.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "checks.h"
#include "taps/merge_trees.h"

namespace taps {

using TreeTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// Defined in csrc/cpu/build_tree.cpp and csrc/cpu/merge_trees.cpp (shared by both backends).
TreeTensors allocate_tree_outputs(const at::Tensor& like, int64_t batch, int64_t num_nodes);
tree::TreeBatch tree_batch(const TreeTensors& out, int64_t num_nodes);
void check_merge_trees_inputs(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& scores,
                              int64_t num_nodes, const std::optional<at::Tensor>& weights);
[[noreturn]] void raise_merge_trees_error(int64_t request, int32_t encoded, int64_t N);

namespace {

TreeTensors merge_trees_cuda(const at::Tensor& tokens_in, const at::Tensor& parents_in, const at::Tensor& scores_in,
                             int64_t num_nodes, const std::optional<at::Tensor>& weights_in) {
  check_merge_trees_inputs(tokens_in, parents_in, scores_in, num_nodes, weights_in);
  const c10::cuda::CUDAGuard guard(tokens_in.device());
  const int64_t B = tokens_in.size(0), T = tokens_in.size(1), N = tokens_in.size(2);
  TORCH_CHECK(T * N <= tree::kMergeTreesMaxOccurrences, "taps_ops: merge_trees: the CUDA kernel supports at most ",
              tree::kMergeTreesMaxOccurrences, " nodes per request (T * N), got T * N = ", T * N);
  TORCH_CHECK(num_nodes <= tree::kMaxOutputNodes, "taps_ops: merge_trees: the CUDA kernel supports at most ",
              tree::kMaxOutputNodes, " nodes, got num_nodes = ", num_nodes);
  const size_t smem = tree::merge_trees_smem_bytes(T * N, num_nodes);
  int device = 0, smem_limit = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TORCH_CHECK(smem <= size_t(smem_limit), "taps_ops: merge_trees: T * N = ", T * N, " input nodes and num_nodes = ",
              num_nodes, " need ", smem, " bytes of shared memory per request, more than this device's ", smem_limit,
              "; use fewer or smaller trees, or run merge_trees on the CPU");
  const at::Tensor tokens = tokens_in.contiguous(), parents = parents_in.contiguous(), scores = scores_in.contiguous();
  at::Tensor weights;
  if (weights_in.has_value()) weights = weights_in->contiguous();
  TreeTensors out = allocate_tree_outputs(scores, B, num_nodes);
  at::Tensor errors = at::full({B}, kNoError, scores.options().dtype(at::kInt));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(tree::launch_merge_trees(tokens.data_ptr<int64_t>(), parents.data_ptr<int64_t>(),
                                          scores.data_ptr<float>(), weights.defined() ? weights.data_ptr<float>() : nullptr,
                                          B, T, N, tree_batch(out, num_nodes), errors.data_ptr<int32_t>(), stream));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Data checks need the codes on the host: one sync. Skipped while the stream is captured into a
  // CUDA graph (the kernel stays in bounds on bad input; the results are then unspecified).
  if (B > 0 && c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
    raise_first_error(errors, [N](int64_t b, int32_t encoded) { raise_merge_trees_error(b, encoded, N); });
  }
  return out;
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CUDA, m) { m.impl("merge_trees", &taps::merge_trees_cuda); }
