// The CUDA rms_norm kernel of taps/rms_norm_kernel.cuh (a warp per row, shuffle-down reduction), run under
// the host CUDA emulation (tests/cpp/emu/cuda_runtime.h), against the CPU kernel's norm::row, bit for bit:
// float32, bfloat16 and float16 rows, widths below, at and above one warp's 32 lanes and not a multiple of
// 32, a row count that leaves the last block part empty, a padded x row stride, grouped weights. Also the
// core's float -> bfloat16 / float16 rounding against exhaustive and edge cases.
// Not shown: device memory-model effects, the device's own sqrt / division (IEEE by default), performance.
#include <cuda_runtime.h>  // the emulation header (tests/cpp/emu is first on the include path)

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "taps/rms_norm_kernel.cuh"

#include "check.h"

namespace {

using taps_test::check;
using taps_test::rng;

float uniform(float lo, float hi) { return lo + (hi - lo) * float(rng() % 1000000) / 1e6f; }

template <int T>
void store_value(std::vector<uint16_t>& bits16, std::vector<float>& bits32, size_t i, float v) {
  if constexpr (T == taps::norm::kF32) {
    bits32[i] = v;
  } else if constexpr (T == taps::norm::kBF16) {
    bits16[i] = taps::norm::float_to_bf16(v);
  } else {
    bits16[i] = taps::norm::float_to_f16(v);
  }
}

template <int T>
void norm_case(int64_t rows, int64_t width, int64_t groups, int64_t pad, const char* name) {
  constexpr bool wide = T == taps::norm::kF32;
  const int64_t stride = width + pad;
  std::vector<float> x32(wide ? size_t(rows * stride) : 0), w32(wide ? size_t(groups * width) : 0),
      y32(wide ? size_t(rows * width) : 0), want32(y32.size());
  std::vector<uint16_t> x16(wide ? 0 : size_t(rows * stride)), w16(wide ? 0 : size_t(groups * width)),
      y16(wide ? 0 : size_t(rows * width)), want16(y16.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < stride; ++i) store_value<T>(x16, x32, size_t(r * stride + i), uniform(-4.f, 4.f));
  for (int64_t i = 0; i < groups * width; ++i) store_value<T>(w16, w32, size_t(i), uniform(-2.f, 2.f));
  const void* x = wide ? static_cast<const void*>(x32.data()) : x16.data();
  const void* w = wide ? static_cast<const void*>(w32.data()) : w16.data();
  void* y = wide ? static_cast<void*>(y32.data()) : y16.data();
  void* want = wide ? static_cast<void*>(want32.data()) : want16.data();
  const int64_t elem = wide ? 4 : 2, per = rows / groups;
  taps::norm::launch_rms_norm<T>(x, w, y, rows, width, stride, width, per, 1e-5f, nullptr);
  for (int64_t r = 0; r < rows; ++r)
    taps::norm::row<T>(static_cast<const char*>(x) + r * stride * elem, static_cast<const char*>(w) + (r / per) * width * elem,
                       static_cast<char*>(want) + r * width * elem, width, 1e-5f);
  const size_t bytes = size_t(rows * width * elem);
  check(std::memcmp(y, want, bytes) == 0, std::string("rms_norm ") + name + " rows=" + std::to_string(rows) +
                                              " width=" + std::to_string(width) + " groups=" +
                                              std::to_string(groups) + " pad=" + std::to_string(pad));
}

// float -> bfloat16 / float16 against the wider arithmetic: round to nearest even, overflow, NaN.
void rounding_cases() {
  using taps::norm::bf16_to_float;
  using taps::norm::f16_to_float;
  using taps::norm::float_to_bf16;
  using taps::norm::float_to_f16;
  int bad_bf16 = 0, bad_f16 = 0;
  for (uint32_t h = 0; h < 0x10000u; ++h) {  // every 16-bit pattern round-trips
    const float fb = bf16_to_float(uint16_t(h)), fh = f16_to_float(uint16_t(h));
    if (fb == fb && float_to_bf16(fb) != h) ++bad_bf16;
    if (fh == fh && float_to_f16(fh) != h) ++bad_f16;
  }
  check(bad_bf16 == 0, "bfloat16 round trip of every pattern");
  check(bad_f16 == 0, "float16 round trip of every pattern");
  // midpoints round to even; one ulp above rounds up
  check(float_to_bf16(1.0f + 0.00390625f) == 0x3f80, "bfloat16 tie to even (down)");
  check(float_to_bf16(1.0f + 3 * 0.00390625f) == 0x3f82, "bfloat16 tie to even (up)");
  check(float_to_f16(1.0f + 0.00048828125f) == 0x3c00, "float16 tie to even (down)");
  check(float_to_f16(1.0f + 3 * 0.00048828125f) == 0x3c02, "float16 tie to even (up)");
  check(float_to_f16(65520.0f) == 0x7c00 && float_to_f16(65519.0f) == 0x7bff, "float16 overflow threshold");
  check(float_to_f16(std::ldexp(1.0f, -25)) == 0x0000 && float_to_f16(std::ldexp(1.5f, -25)) == 0x0001,
        "float16 subnormal rounding");
  check(float_to_bf16(NAN) == 0x7fc0 && (float_to_f16(NAN) & 0x7c00) == 0x7c00 && (float_to_f16(NAN) & 0x3ff) != 0,
        "NaN stays NaN");
}

}  // namespace

int main() {
  rng.seed(2026);
  using taps::norm::kBF16;
  using taps::norm::kF16;
  using taps::norm::kF32;
  norm_case<kF32>(9, 64, 1, 0, "f32");     // 3 blocks, the last one with one row
  norm_case<kF32>(5, 7, 1, 3, "f32");      // narrower than a warp, padded rows
  norm_case<kF32>(6, 1000, 3, 5, "f32");   // not a multiple of 32, grouped weights
  norm_case<kBF16>(4, 130, 2, 0, "bf16");
  norm_case<kBF16>(3, 33, 1, 1, "bf16");
  norm_case<kF16>(5, 96, 5, 2, "f16");
  rounding_cases();
  std::printf("emulated CUDA rms_norm vs the CPU row kernel\n");
  return taps_test::finish();
}
