// rms_norm, header-only core: the per-row arithmetic shared by the CPU kernel and the CUDA kernel, so
// that both give the same bits.
//
// One row x[0..H-1] (float32, bfloat16 or float16, as raw bits) and its weight w[0..H-1] (same dtype):
//   ss   = sum x_i^2 in float32, in a fixed order: lane j (0..31) sums x_j, x_{j+32}, ... in increasing
//          index, then the lanes combine as a warp's shuffle-down tree (offsets 16, 8, 4, 2, 1);
//   inv  = 1 / sqrt(ss / H + eps)                                   (IEEE float32 sqrt and division)
//   y_i  = round(round(x_i * inv) * w_i)                            (round = to the row's dtype, RNE)
// which is Hugging Face's Llama RMSNorm (`weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)`) up
// to the order of the sum. Products and sums are separate roundings (no fused multiply-add), on the host
// and on the device alike.
#pragma once
#include <cmath>
#include <cstdint>

#include "taps/common.h"
#include "taps/elementwise.h"

namespace taps {
namespace norm {

using namespace elementwise;  // Dtype, load_t / round_t / store_t, mul / add

constexpr int kLanes = 32;

// 1 / sqrt(ss / width + eps).
TAPS_HD float inverse_rms(float ss, int64_t width, float eps) {
  const float mean = width > 0 ? ss / float(width) : 0.0f;
  return 1.0f / sqrtf(add(mean, eps));
}


// Output element of x (weight w) in a row whose inverse RMS is `inv`.
template <int T>
TAPS_HD float normed_t(float x, float inv, float w) { return mul(round_t<T>(mul(x, inv)), w); }

// Lane `lane`'s partial sum of squares: x_lane^2 + x_{lane+32}^2 + ... in increasing index (the CUDA
// kernel: lane = the thread's lane in its warp).
template <int T>
TAPS_HD float lane_sum_squares(const void* row, int64_t width, int lane) {
  float s = 0.0f;
  for (int64_t i = lane; i < width; i += kLanes) {
    const float x = load_t<T>(row, i);
    s = add(s, mul(x, x));
  }
  return s;
}

// The whole row on one thread (the CPU kernel), in the order of the module comment: the lanes' partial
// sums run side by side over blocks of 32 elements (which the compiler may vectorise: each lane's own
// order is unchanged), then the shuffle-down tree.
template <int T>
inline void row(const void* x, const void* w, void* y, int64_t width, float eps) {
  float part[kLanes];
  for (int lane = 0; lane < kLanes; ++lane) part[lane] = 0.0f;
  int64_t i0 = 0;
  for (; i0 + kLanes <= width; i0 += kLanes)
    for (int lane = 0; lane < kLanes; ++lane) {
      const float v = load_t<T>(x, i0 + lane);
      part[lane] = add(part[lane], mul(v, v));
    }
  for (int lane = 0; i0 + lane < width; ++lane) {
    const float v = load_t<T>(x, i0 + lane);
    part[lane] = add(part[lane], mul(v, v));
  }
  for (int off = kLanes / 2; off > 0; off /= 2)
    for (int lane = 0; lane < off; ++lane) part[lane] = add(part[lane], part[lane + off]);
  const float inv = inverse_rms(part[0], width, eps);
  for (int64_t i = 0; i < width; ++i) store_t<T>(y, i, normed_t<T>(load_t<T>(x, i), inv, load_t<T>(w, i)));
}

}  // namespace norm
}  // namespace taps
