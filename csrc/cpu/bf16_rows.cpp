// The bf16 rows of rms_norm and rope_ with explicit vectors (cpu/bf16_rows.h), compiled per instruction set:
// AVX2 (8 lanes), AVX-512 (16 lanes), and AVX-512 with AVX512-BF16, whose VCVTNEPS2BF16 rounds to nearest
// even in one instruction (NaN and inputs below 2^-126, which it quiets with their payload or flushes to
// zero, take the integer rounding instead). No region enables FMA contraction (AVX-512 brings fused
// multiply-adds with it, so those regions turn contraction off), so every level gives the cores' bits.
#include "cpu/elementwise_cpu.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/simd_x86.h"
#include "taps/rms_norm.h"
#include "taps/rope.h"

#if defined(TAPS_CPU_X86)
#include <immintrin.h>

// round() needs no NaN select in these rows: every NaN that reaches it is a product or sum of bf16 values
// (x86 keeps a NaN operand's payload, whose lower 16 bits are then zero, or makes the default NaN
// 0xffc00000), which the formula leaves a NaN; narrow() writes every NaN as 0x7fc0.

// ---- AVX2, 8 lanes: the cores' rounding in 32-bit integers ------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2")
namespace taps::bf16_rows::avx2 {
struct V {
  using F = __m256;
  using H = __m128i;
  static constexpr int L = 8;
  static H load(const uint16_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static H load_part(const uint16_t* p, int64_t n) {
    alignas(16) uint16_t b[L] = {};
    std::memcpy(b, p, sizeof(uint16_t) * n);
    return _mm_load_si128(reinterpret_cast<const __m128i*>(b));
  }
  static void store(uint16_t* p, H h) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h); }
  static void store_part(uint16_t* p, H h, int64_t n) {
    alignas(16) uint16_t b[L];
    _mm_store_si128(reinterpret_cast<__m128i*>(b), h);
    std::memcpy(p, b, sizeof(uint16_t) * n);
  }
  static F widen(H h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
  // u + 0x7fff + ((u >> 16) & 1): the rounded value in the upper 16 bits (no carry out of bit 31 but for NaN)
  static __m256i rounded(F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  }
  static H narrow(F x) {
    const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
    const __m256i r = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(rounded(x)), nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    const __m256i hi = _mm256_srli_epi32(r, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  }
  static F round(F x) { return _mm256_castsi256_ps(_mm256_and_si256(rounded(x), _mm256_set1_epi32(int(0xffff0000u)))); }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fold(F x) { return x; }
  static float hsum8(F v) { return simd::hsum8(v); }  // lanes + 4, + 2, + 1: the tree's order
};
#include "cpu/bf16_rows.h"
}  // namespace taps::bf16_rows::avx2
#pragma GCC pop_options

// ---- AVX-512, 16 lanes: the same integer rounding, NaN by a mask, tails by masked loads and stores ---------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2")
#pragma GCC optimize("fp-contract=off")
namespace taps::bf16_rows::avx512 {
struct VBase {
  using F = __m512;
  using H = __m256i;
  static constexpr int L = 16;
  static H load(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static __mmask16 first(int64_t n) { return __mmask16((1u << n) - 1); }
  static H load_part(const uint16_t* p, int64_t n) { return _mm256_maskz_loadu_epi16(first(n), p); }
  static void store(uint16_t* p, H h) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h); }
  static void store_part(uint16_t* p, H h, int64_t n) { _mm256_mask_storeu_epi16(p, first(n), h); }
  static F widen(H h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  static __m512i rounded(F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  }
  static H narrow_int(F x) {
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i r = _mm512_mask_mov_epi32(rounded(x), nan, _mm512_set1_epi32(0x7fc00000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
  }
  static F round_int(F x) {
    return _mm512_castsi512_ps(_mm512_and_si512(rounded(x), _mm512_set1_epi32(int(0xffff0000u))));
  }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static __m256 fold(F x) { return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1)); }
  static float hsum8(__m256 v) { return simd::hsum8(v); }
};
struct V : VBase {
  static H narrow(F x) { return narrow_int(x); }
  static F round(F x) { return round_int(x); }
};
#include "cpu/bf16_rows.h"
}  // namespace taps::bf16_rows::avx512
#pragma GCC pop_options

// ---- AVX-512 with AVX512-BF16: VCVTNEPS2BF16, the integer rounding where it differs --------------------------
// VCVTNEPS2BF16 rounds to nearest even but flushes inputs below 2^-126 to zero and quiets NaNs keeping their
// payload: vectors with a denormal lane (or a NaN lane, for narrow) take the integer rounding.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2")
#pragma GCC optimize("fp-contract=off")
namespace taps::bf16_rows::avx512_bf16 {
struct V : avx512::VBase {
  static constexpr int kNaN = 0x01 | 0x80, kDenormal = 0x20;  // VFPCLASSPS categories: QNaN, SNaN; denormal
  static H convert(F x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }
  static H narrow(F x) { return _mm512_fpclass_ps_mask(x, kNaN | kDenormal) != 0 ? narrow_int(x) : convert(x); }
  static F round(F x) { return _mm512_fpclass_ps_mask(x, kDenormal) != 0 ? round_int(x) : widen(convert(x)); }
};
#include "cpu/bf16_rows.h"
}  // namespace taps::bf16_rows::avx512_bf16
#pragma GCC pop_options
#endif  // TAPS_CPU_X86

namespace taps::bf16_rows {

Kind kind(cpu::Isa isa) {
#if defined(TAPS_CPU_X86)
  static const bool bf16 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  if (isa >= cpu::Isa::kAvx512) return bf16 ? Kind::kAvx512Bf16 : Kind::kAvx512;
  if (isa >= cpu::Isa::kAvx2) return Kind::kAvx2;
#endif
  (void)isa;
  return Kind::kNone;
}

void rms_norm_row(Kind k, const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t width, float eps) {
  if (k != Kind::kNone && width < 16) k = Kind::kAvx2;  // fewer elements than 16 lanes: 8 lanes, no masks
  switch (k) {
#if defined(TAPS_CPU_X86)
    case Kind::kAvx512Bf16: return avx512_bf16::rms_norm_bf16_row(x, w, y, width, eps);
    case Kind::kAvx512: return avx512::rms_norm_bf16_row(x, w, y, width, eps);
    case Kind::kAvx2: return avx2::rms_norm_bf16_row(x, w, y, width, eps);
#endif
    default: return norm::row<elementwise::kBF16>(x, w, y, width, eps);
  }
}

void rope_token(Kind k, uint16_t* x, int64_t head_stride, int64_t heads, const uint16_t* c, const uint16_t* s,
                int64_t dim) {
  if (k != Kind::kNone && dim / 2 < 16) k = Kind::kAvx2;  // fewer pairs than 16 lanes: 8 lanes, no masks
  switch (k) {
#if defined(TAPS_CPU_X86)
    case Kind::kAvx512Bf16: return avx512_bf16::rope_bf16_token(x, head_stride, heads, c, s, dim);
    case Kind::kAvx512: return avx512::rope_bf16_token(x, head_stride, heads, c, s, dim);
    case Kind::kAvx2: return avx2::rope_bf16_token(x, head_stride, heads, c, s, dim);
#endif
    default:
      for (int64_t h = 0; h < heads; ++h) rope::row<elementwise::kBF16>(x + h * head_stride, c, s, dim);
  }
}

}  // namespace taps::bf16_rows
