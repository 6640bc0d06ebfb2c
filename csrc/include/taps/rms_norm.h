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

namespace taps {
namespace norm {

enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

constexpr int kLanes = 32;

TAPS_HD float bits_to_float(uint32_t u) {
  union { uint32_t u; float f; } v{u};
  return v.f;
}
TAPS_HD uint32_t float_to_bits(float f) {
  union { float f; uint32_t u; } v{f};
  return v.u;
}

TAPS_HD float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// Round to nearest even, as torch's float -> bfloat16 conversion (NaN -> the quiet NaN 0x7fc0).
TAPS_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t r = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return f != f ? uint16_t(0x7fc0) : r;  // a select, so that loops of it vectorise
}

TAPS_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float32
    const float m = float(mant) * 5.9604644775390625e-8f;
    return sign ? -m : m;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | mant << 13);
  return bits_to_float(sign | (exp + 112u) << 23 | mant << 13);
}

// Round to nearest even (IEEE binary16: overflow to inf, gradual underflow).
TAPS_HD uint16_t float_to_f16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);       // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);       // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                                       // below 2^-14: subnormal or zero
    const float a = bits_to_float(abs);
    // a * 2^24 is the subnormal's mantissa; add-and-subtract rounds it to an integer (nearest even)
    const float r = (a * 16777216.0f + 8388608.0f) - 8388608.0f;
    return uint16_t(sign | uint16_t(r));
  }
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);    // RNE on the 13 dropped bits
  return uint16_t(sign | uint16_t((rounded - 0x38000000u) >> 13));
}




// Products and sums without contraction into a fused multiply-add (nvcc contracts by default).
TAPS_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TAPS_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// 1 / sqrt(ss / width + eps).
TAPS_HD float inverse_rms(float ss, int64_t width, float eps) {
  const float mean = width > 0 ? ss / float(width) : 0.0f;
  return 1.0f / sqrtf(add(mean, eps));
}


template <int T>
TAPS_HD float load_t(const void* row, int64_t i) {
  if constexpr (T == kF32) {
    return static_cast<const float*>(row)[i];
  } else if constexpr (T == kBF16) {
    return bf16_to_float(static_cast<const uint16_t*>(row)[i]);
  } else {
    return f16_to_float(static_cast<const uint16_t*>(row)[i]);
  }
}

template <int T>
TAPS_HD float round_t(float f) {
  if constexpr (T == kF32) {
    return f;
  } else if constexpr (T == kBF16) {
    return bf16_to_float(float_to_bf16(f));
  } else {
    return f16_to_float(float_to_f16(f));
  }
}

template <int T>
TAPS_HD void store_t(void* row, int64_t i, float f) {
  if constexpr (T == kF32) {
    static_cast<float*>(row)[i] = f;
  } else if constexpr (T == kBF16) {
    static_cast<uint16_t*>(row)[i] = float_to_bf16(f);
  } else {
    static_cast<uint16_t*>(row)[i] = float_to_f16(f);
  }
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
