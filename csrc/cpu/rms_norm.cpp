// rms_norm, CPU kernel: input checks (rms_norm_checks.h), then norm::row (taps/rms_norm.h) on every row,
// parallel over rows. One pass over x and the weight, no temporaries: the point of this op on the CPU is
// to replace the half a dozen operators and temporaries of the composite form (about 10-30 us a call at
// decoding's sizes) with one call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "rms_norm_checks.h"
#include "taps/rms_norm.h"

namespace taps {
namespace {

template <int T>
inline __attribute__((always_inline)) void rows_loop(const char* x, const char* w, char* y, int64_t xs, int64_t width,
                                                     int64_t per, float eps, int64_t lo, int64_t hi) {
  const int64_t elem = T == norm::kF32 ? 4 : 2;
  for (int64_t r = lo; r < hi; ++r) norm::row<T>(x + r * xs, w + (r / per) * width * elem, y + r * width * elem, width, eps);
}

// One clone per instruction set (AVX2 where the CPU has it, else the baseline): wider vectors for the
// same arithmetic. AVX2 has no fused multiply-add (that is the separate FMA set), so the results stay
// those of taps/rms_norm.h, bit for bit, in either clone.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TAPS_NORM_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TAPS_NORM_CLONES
#endif

#define TAPS_NORM_ROWS(name, T)                                                                              \
  TAPS_NORM_CLONES void name(const char* x, const char* w, char* y, int64_t xs, int64_t width, int64_t per, \
                             float eps, int64_t lo, int64_t hi) {                                            \
    rows_loop<T>(x, w, y, xs, width, per, eps, lo, hi);                                                      \
  }
TAPS_NORM_ROWS(rows_f32, norm::kF32)
TAPS_NORM_ROWS(rows_bf16, norm::kBF16)
TAPS_NORM_ROWS(rows_f16, norm::kF16)
#undef TAPS_NORM_ROWS

using RowsFn = void (*)(const char*, const char*, char*, int64_t, int64_t, int64_t, float, int64_t, int64_t);

void run_rows(const RmsNormArgs& a, float eps, RowsFn fn) {
  const int64_t elem = a.x.element_size();
  const char* x = static_cast<const char*>(a.x.data_ptr());
  const char* w = static_cast<const char*>(a.weight.data_ptr());
  char* y = static_cast<char*>(a.out.data_ptr());
  const int64_t xs = a.x.stride(0) * elem, width = a.width, per = a.rows_per_group;
  // rows of a few thousand elements: grain so that tiny calls stay on the calling thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  at::parallel_for(0, a.rows, grain, [&](int64_t lo, int64_t hi) { fn(x, w, y, xs, width, per, eps, lo, hi); });
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RmsNormArgs a = prepare_rms_norm(x, weight, eps);
  TORCH_CHECK(a.x.device().is_cpu(), "taps_ops: rms_norm: x must be on the CPU for the CPU kernel, got ",
              a.x.device());
  if (a.rows == 0 || a.width == 0) return a.out;
  const float e = static_cast<float>(eps);
  switch (a.dtype) {
    case norm::kF32: run_rows(a, e, &rows_f32); break;
    case norm::kBF16: run_rows(a, e, &rows_bf16); break;
    case norm::kF16: run_rows(a, e, &rows_f16); break;
  }
  return a.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("rms_norm", &rms_norm_cpu); }

}  // namespace taps
