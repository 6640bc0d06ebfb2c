// expand_level, CUDA binding: input checks and output allocation (checks/expand_level_checks.h), then two
// launches (taps/expand_level_kernel.cuh: a warp per logits row for the top k, the sums and the children,
// then a block per request for its entropy and the next frontier) on the current stream. Same bits as the
// CPU kernel (both follow taps/expand_level.h's order) except where the device's logf differs from the
// host's; the block logic is tested under the host emulation (tests/cpp/test_emu_expand_level.cpp).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks/expand_level_checks.h"
#include "taps/expand_level_kernel.cuh"

namespace taps {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
expand_level_cuda(const at::Tensor& logits, const at::Tensor& front_scores, const at::Tensor& front_cands, int64_t k,
                  int64_t next_k, int64_t cand_offset, const c10::optional<at::Tensor>& token_map,
                  bool with_entropy) {
  const ExpandLevelArgs a = prepare_expand_level(logits, front_scores, front_cands, k, next_k, cand_offset,
                                                 token_map, with_entropy);
  TORCH_CHECK_VALUE(a.logits.is_cuda(),
                    "taps_ops: expand_level: logits must be a CUDA tensor for the CUDA kernel, got ", a.logits.device());
  if (a.rows == 0) return a.outputs();
  const c10::cuda::CUDAGuard guard(a.logits.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const expand::Params p = a.params();
  cudaError_t err = cudaSuccess;
  switch (a.dtype) {
    case elementwise::kF32: err = expand::launch_expand_level<elementwise::kF32>(p, stream); break;
    case elementwise::kBF16: err = expand::launch_expand_level<elementwise::kBF16>(p, stream); break;
    case elementwise::kF16: err = expand::launch_expand_level<elementwise::kF16>(p, stream); break;
  }
  C10_CUDA_CHECK(err);
  return a.outputs();
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CUDA, m) { m.impl("expand_level", &expand_level_cuda); }

}  // namespace taps
