// rope_, CUDA binding: input checks (checks/rope_checks.h) and one launch (taps/rope_kernel.cuh, a thread per
// rotated pair) on the current stream. Same bits as the CPU kernel (both follow taps/rope.h); its block
// logic is tested under the host emulation (tests/cpp/test_emu_rope.cpp).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks/rope_checks.h"
#include "taps/rope_kernel.cuh"

namespace taps {
namespace {

void rope_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const RopeArgs a = prepare_rope(x, cos, sin);
  TORCH_CHECK_VALUE(x.is_cuda(), "taps_ops: rope_: x must be a CUDA tensor for the CUDA kernel, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t sr = x.stride(0), st = x.stride(1), sh = x.stride(2), cr = a.cos.stride(0), ct = a.cos.stride(1);
  cudaError_t err = cudaSuccess;
  switch (a.dtype) {
    case elementwise::kF32:
      err = rope::launch_rope<elementwise::kF32>(x.data_ptr(), a.cos.data_ptr(), a.sin.data_ptr(), a.rows, a.tokens,
                                                 a.heads, a.dim, sr, st, sh, cr, ct, stream);
      break;
    case elementwise::kBF16:
      err = rope::launch_rope<elementwise::kBF16>(x.data_ptr(), a.cos.data_ptr(), a.sin.data_ptr(), a.rows, a.tokens,
                                                  a.heads, a.dim, sr, st, sh, cr, ct, stream);
      break;
    case elementwise::kF16:
      err = rope::launch_rope<elementwise::kF16>(x.data_ptr(), a.cos.data_ptr(), a.sin.data_ptr(), a.rows, a.tokens,
                                                 a.heads, a.dim, sr, st, sh, cr, ct, stream);
      break;
  }
  C10_CUDA_CHECK(err);
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CUDA, m) { m.impl("rope_", &rope_cuda); }

}  // namespace taps
