// rms_norm, CUDA binding: input checks (checks/rms_norm_checks.h) and one launch (taps/rms_norm_kernel.cuh, a
// warp per row) on the current stream. Same bits as the CPU kernel: both follow taps/rms_norm.h's order.
// Its block logic is tested under the host emulation (tests/cpp/test_emu_rms_norm.cpp).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks/rms_norm_checks.h"
#include "taps/rms_norm_kernel.cuh"

namespace taps {
namespace {

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RmsNormArgs a = prepare_rms_norm(x, weight, eps);
  TORCH_CHECK_VALUE(a.x.is_cuda(), "taps_ops: rms_norm: x must be a CUDA tensor for the CUDA kernel, got ",
                    a.x.device());
  if (a.rows == 0 || a.width == 0) return a.out;
  const c10::cuda::CUDAGuard guard(a.x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float e = static_cast<float>(eps);
  const int64_t xs = a.x.stride(0), ys = a.width, per = a.rows_per_group;
  cudaError_t err = cudaSuccess;
  switch (a.dtype) {
    case elementwise::kF32:
      err = norm::launch_rms_norm<norm::kF32>(a.x.data_ptr(), a.weight.data_ptr(), a.out.data_ptr(), a.rows, a.width,
                                              xs, ys, per, e, stream);
      break;
    case elementwise::kBF16:
      err = norm::launch_rms_norm<norm::kBF16>(a.x.data_ptr(), a.weight.data_ptr(), a.out.data_ptr(), a.rows,
                                               a.width, xs, ys, per, e, stream);
      break;
    case elementwise::kF16:
      err = norm::launch_rms_norm<norm::kF16>(a.x.data_ptr(), a.weight.data_ptr(), a.out.data_ptr(), a.rows,
                                              a.width, xs, ys, per, e, stream);
      break;
  }
  C10_CUDA_CHECK(err);
  return a.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CUDA, m) { m.impl("rms_norm", &rms_norm_cuda); }

}  // namespace taps
