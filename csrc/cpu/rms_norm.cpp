// rms_norm, CPU kernel: input checks (checks/rms_norm_checks.h), then norm::row (taps/rms_norm.h) on every row,
// parallel over rows. One pass over x and the weight, no temporaries: the point of this op on the CPU is
// to replace the half a dozen operators and temporaries of the composite form (about 10-30 us a call at
// decoding's sizes) with one call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu/elementwise_cpu.h"
#include "checks/rms_norm_checks.h"
#include "taps/rms_norm.h"

namespace taps {
namespace {

struct NormView {
  const char* x;
  const char* w;
  char* y;
  int64_t x_stride, width, rows_per_group, elem;  // x_stride in bytes
  float eps;
};

template <int T>
inline __attribute__((always_inline)) void rows_loop(const NormView& v, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r)
    norm::row<T>(v.x + r * v.x_stride, v.w + (r / v.rows_per_group) * v.width * v.elem, v.y + r * v.width * v.elem,
                 v.width, v.eps);
}


at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RmsNormArgs a = prepare_rms_norm(x, weight, eps);
  TORCH_CHECK_VALUE(a.x.device().is_cpu(), "taps_ops: rms_norm: x must be on the CPU for the CPU kernel, got ",
              a.x.device());
  if (a.rows == 0 || a.width == 0) return a.out;
  const int64_t e = a.x.element_size();
  const NormView v{static_cast<const char*>(a.x.data_ptr()), static_cast<const char*>(a.weight.data_ptr()),
                   static_cast<char*>(a.out.data_ptr()), a.x.stride(0) * e, a.width, a.rows_per_group, e,
                   static_cast<float>(eps)};
  const bool avx2 = elementwise_avx2();
  const bf16_rows::Kind bf16 = bf16_rows::kind(cpu::isa());
  at::parallel_for(0, a.rows, elementwise_grain(a.width), [&](int64_t lo, int64_t hi) {
    switch (a.dtype) {
      case elementwise::kF32: run_rows(avx2, [&] { rows_loop<elementwise::kF32>(v, lo, hi); }); break;
      case elementwise::kBF16:
        if (bf16 == bf16_rows::Kind::kNone) {
          run_rows(avx2, [&] { rows_loop<elementwise::kBF16>(v, lo, hi); });
          break;
        }
        for (int64_t r = lo; r < hi; ++r)
          bf16_rows::rms_norm_row(bf16, reinterpret_cast<const uint16_t*>(v.x + r * v.x_stride),
                                  reinterpret_cast<const uint16_t*>(v.w + (r / v.rows_per_group) * v.width * v.elem),
                                  reinterpret_cast<uint16_t*>(v.y + r * v.width * v.elem), v.width, v.eps);
        break;
      case elementwise::kF16: run_rows(avx2, [&] { rows_loop<elementwise::kF16>(v, lo, hi); }); break;
    }
  });
  return a.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("rms_norm", &rms_norm_cpu); }

}  // namespace taps
