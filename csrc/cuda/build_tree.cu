// build_tree, CUDA kernel binding: the same checks as the CPU kernel, one launch per batch (a block
// per request, taps/build_tree.h), then one small device-to-host copy of the per-request error codes
// (a sync) to raise on bad input. NOTE: compiled but never run on a GPU so far.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "checks.h"
#include "taps/build_tree.h"

namespace taps {

using TreeTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// Defined in csrc/cpu/build_tree.cpp (shared by both backends).
TreeTensors allocate_tree_outputs(const at::Tensor& like, int64_t batch, int64_t num_nodes);
tree::TreeBatch tree_batch(const TreeTensors& out, int64_t num_nodes);
void check_build_tree_inputs(const at::Tensor& scores, const at::Tensor& tokens, const at::Tensor& parents,
                             int64_t num_nodes, const std::optional<at::Tensor>& root_tokens);
[[noreturn]] void raise_build_tree_error(int64_t request, int32_t encoded);

namespace {

TreeTensors build_tree_cuda(const at::Tensor& scores_in, const at::Tensor& tokens_in, const at::Tensor& parents_in,
                            int64_t num_nodes, const std::optional<at::Tensor>& root_tokens_in) {
  check_build_tree_inputs(scores_in, tokens_in, parents_in, num_nodes, root_tokens_in);
  const c10::cuda::CUDAGuard guard(scores_in.device());
  const int64_t B = scores_in.size(0), M = scores_in.size(1);
  TORCH_CHECK(M <= tree::kBuildTreeMaxCandidates, "taps_ops: build_tree: the CUDA kernel supports at most ",
              tree::kBuildTreeMaxCandidates, " candidates per request, got M = ", M);
  TORCH_CHECK(num_nodes <= tree::kMaxOutputNodes, "taps_ops: build_tree: the CUDA kernel supports at most ",
              tree::kMaxOutputNodes, " nodes, got num_nodes = ", num_nodes);
  const size_t smem = tree::build_tree_smem_bytes(M, num_nodes);
  int device = 0, smem_limit = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TORCH_CHECK(smem <= size_t(smem_limit), "taps_ops: build_tree: M = ", M, " candidates and num_nodes = ", num_nodes,
              " need ", smem, " bytes of shared memory per request, more than this device's ", smem_limit,
              "; use fewer candidates or nodes, or run build_tree on the CPU");
  const at::Tensor scores = scores_in.contiguous(), tokens = tokens_in.contiguous(), parents = parents_in.contiguous();
  at::Tensor root_tokens;
  if (root_tokens_in.has_value()) root_tokens = root_tokens_in->contiguous();
  TreeTensors out = allocate_tree_outputs(scores, B, num_nodes);
  at::Tensor errors = at::full({B}, kNoError, scores.options().dtype(at::kInt));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(tree::launch_build_tree(scores.data_ptr<float>(), tokens.data_ptr<int64_t>(),
                                         parents.data_ptr<int64_t>(),
                                         root_tokens.defined() ? root_tokens.data_ptr<int64_t>() : nullptr, B, M,
                                         tree_batch(out, num_nodes), errors.data_ptr<int32_t>(), stream));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Data checks need the codes on the host: one sync. Skipped while the stream is captured into a
  // CUDA graph (the kernel stays in bounds on bad input; the results are then unspecified).
  if (B > 0 && c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
    raise_first_error(errors, raise_build_tree_error);
  }
  return out;
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CUDA, m) { m.impl("build_tree", &taps::build_tree_cuda); }
