// rope_, CPU kernel: input checks (checks/rope_checks.h), then rope::row (taps/rope.h) on every (r, t, h) head row
// in place, parallel over (r, t). One pass, no temporaries: in the lean forwards it replaces the five
// operators of `x * cos + x.roll(D / 2, -1) * sin` and their temporaries.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu/elementwise_cpu.h"
#include "checks/rope_checks.h"
#include "taps/rope.h"

namespace taps {
namespace {

struct RopeView {
  char* x;
  const char* cos;
  const char* sin;
  int64_t tokens, heads, dim, sr, st, sh, cr, ct;  // strides in bytes
};

template <int T>
inline __attribute__((always_inline)) void rows_loop(const RopeView& v, int64_t lo, int64_t hi) {
  for (int64_t n = lo; n < hi; ++n) {
    const int64_t r = n / v.tokens, t = n % v.tokens;
    const int64_t table = r * v.cr + t * v.ct;
    for (int64_t h = 0; h < v.heads; ++h)
      rope::row<T>(v.x + r * v.sr + t * v.st + h * v.sh, v.cos + table, v.sin + table, v.dim);
  }
}


void rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const RopeArgs a = prepare_rope(x, cos, sin);
  TORCH_CHECK_VALUE(x.device().is_cpu(), "taps_ops: rope_: x must be on the CPU for the CPU kernel, got ", x.device());
  if (a.rows * a.tokens * a.heads * a.dim == 0) return;
  const int64_t e = x.element_size();
  const RopeView v{static_cast<char*>(x.data_ptr()), static_cast<const char*>(a.cos.data_ptr()),
                   static_cast<const char*>(a.sin.data_ptr()), a.tokens, a.heads, a.dim, x.stride(0) * e,
                   x.stride(1) * e, x.stride(2) * e, a.cos.stride(0) * e, a.cos.stride(1) * e};
  const bool avx2 = elementwise_avx2();
  const bf16_rows::Kind bf16 = bf16_rows::kind(cpu::isa());
  at::parallel_for(0, a.rows * a.tokens, elementwise_grain(a.heads * a.dim), [&](int64_t lo, int64_t hi) {
    switch (a.dtype) {
      case elementwise::kF32: run_rows(avx2, [&] { rows_loop<elementwise::kF32>(v, lo, hi); }); break;
      case elementwise::kBF16:
        if (bf16 == bf16_rows::Kind::kNone) {
          run_rows(avx2, [&] { rows_loop<elementwise::kBF16>(v, lo, hi); });
          break;
        }
        for (int64_t n = lo; n < hi; ++n) {
          const int64_t r = n / v.tokens, t = n % v.tokens, table = r * v.cr + t * v.ct;
          bf16_rows::rope_token(bf16, reinterpret_cast<uint16_t*>(v.x + r * v.sr + t * v.st), v.sh / 2, v.heads,
                                reinterpret_cast<const uint16_t*>(v.cos + table),
                                reinterpret_cast<const uint16_t*>(v.sin + table), v.dim);
        }
        break;
      case elementwise::kF16: run_rows(avx2, [&] { rows_loop<elementwise::kF16>(v, lo, hi); }); break;
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("rope_", &rope_cpu); }

}  // namespace taps
