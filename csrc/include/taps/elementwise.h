// Element access and rounding shared by the elementwise ops' cores (rms_norm, rope): float32, bfloat16
// and float16 elements as raw bits (no torch or CUDA half types, so the host and nvcc compile the same
// code), round-to-nearest-even conversions as torch's, and float products and sums kept as separate
// roundings (no contraction into a fused multiply-add, which nvcc does by default), so that a CPU kernel
// and a CUDA kernel built on these give the same bits. The CPU verify_tree row passes (cpu/verify_tree_rows.h)
// read their rows through the same conversions.
#pragma once
#include <cstdint>

#include "taps/common.h"

namespace taps {
namespace elementwise {

enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

TAPS_HD float bits_to_float(uint32_t u) {
  union { uint32_t u; float f; } v{u};
  return v.f;
}
TAPS_HD uint32_t float_to_bits(float f) {
  union { float f; uint32_t u; } v{f};
  return v.u;
}

TAPS_HD float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// f rounded to nearest even at bfloat16's precision, as float bits: the upper 16 bits are torch's float ->
// bfloat16 conversion (NaN -> the quiet NaN 0x7fc0), the lower 16 are 0. Non-NaN inputs never carry out of
// bit 31 (that needs bits 30..16 all set: a NaN). One 32-bit select, so that loops of it vectorise without
// narrowing first.
TAPS_HD uint32_t bf16_rounded_bits(float f) {
  const uint32_t u = float_to_bits(f);
  return f != f ? 0x7fc00000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}

// Round to nearest even, as torch's float -> bfloat16 conversion (NaN -> the quiet NaN 0x7fc0).
TAPS_HD uint16_t float_to_bf16(float f) { return uint16_t(bf16_rounded_bits(f) >> 16); }

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
    return bits_to_float(bf16_rounded_bits(f));
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

}  // namespace elementwise
}  // namespace taps
