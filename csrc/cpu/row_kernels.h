// The hot per-row passes of the CPU verify_tree kernel: max (NaN-aware), first index of a value, and the
// sum of target weights sum(x >= thr ? exp((x - m) * inv_t) : 0). A portable scalar version and an
// AVX-512 version (compiled with a per-function target attribute, chosen at run time when the CPU has
// AVX-512F; TAPS_CPU_NO_AVX512=1 forces the portable one). Rows are float32, bfloat16 or float16,
// passed as raw bits so this header needs no torch types.
//
// The AVX-512 exp is a degree-6 polynomial after range reduction (max relative error ~2e-7, i.e. about
// one float ulp); it returns 0 where expf would return a denormal (x < -87.3). Only normalisers use it:
// every decision on a single token uses the core's scalar target_weight.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "taps/elementwise.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TAPS_ROW_AVX512 1
#endif

namespace taps {
namespace rows {

using Dtype = elementwise::Dtype;  // float32, bfloat16, float16 (the elementwise cores' conversions)

inline float load_scalar(const void* row, int64_t i, Dtype t) {
  if (t == Dtype::kF32) return static_cast<const float*>(row)[i];
  const uint16_t h = static_cast<const uint16_t*>(row)[i];
  return t == Dtype::kF16 ? elementwise::f16_to_float(h) : elementwise::bf16_to_float(h);
}

struct MaxResult {
  float max;  // over non-NaN values, -inf if none
  bool nan;
};

// ---- portable -------------------------------------------------------------------------------------
inline MaxResult row_max_scalar(const void* row, int64_t n, Dtype t) {
  MaxResult r{-INFINITY, false};
  for (int64_t i = 0; i < n; ++i) {
    const float x = load_scalar(row, i, t);
    if (x != x) r.nan = true;
    else if (x > r.max) r.max = x;
  }
  return r;
}

inline int64_t row_first_equal_scalar(const void* row, int64_t n, Dtype t, float value) {
  for (int64_t i = 0; i < n; ++i)
    if (load_scalar(row, i, t) == value) return i;
  return -1;
}

inline float row_sum_exp_scalar(const void* row, int64_t n, Dtype t, float m, float inv_t, float thr) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = load_scalar(row, i, t);
    s += x >= thr ? expf((x - m) * inv_t) : 0.0f;
  }
  return s;
}

#ifdef TAPS_ROW_AVX512
#define TAPS_AVX512_FN __attribute__((target("avx512f,fma")))

TAPS_AVX512_FN inline __m512 load16(const void* row, int64_t i, Dtype t) {
  if (t == Dtype::kF32) return _mm512_loadu_ps(static_cast<const float*>(row) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + i));
  if (t == Dtype::kF16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp(x) for x <= 0 (callers pass (x - max) * inv_t); NaN propagates.
TAPS_AVX512_FN inline __m512 exp16(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512 y = _mm512_scalef_ps(p, n);
  // below the normal range: 0 (also for x = -inf, where n is -inf and r NaN)
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(tiny, y, _mm512_setzero_ps());
}

TAPS_AVX512_FN inline MaxResult row_max_avx512(const void* row, int64_t n, Dtype t) {
  __m512 a0 = _mm512_set1_ps(-INFINITY), a1 = a0, a2 = a0, a3 = a0;
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512 x0 = load16(row, i, t), x1 = load16(row, i + 16, t), x2 = load16(row, i + 32, t),
                 x3 = load16(row, i + 48, t);
    nan |= _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q) |
           _mm512_cmp_ps_mask(x2, x2, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x3, x3, _CMP_UNORD_Q);
    a0 = _mm512_max_ps(x0, a0);  // max_ps returns the second operand when the first is NaN
    a1 = _mm512_max_ps(x1, a1);
    a2 = _mm512_max_ps(x2, a2);
    a3 = _mm512_max_ps(x3, a3);
  }
  for (; i + 16 <= n; i += 16) {
    const __m512 x = load16(row, i, t);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    a0 = _mm512_max_ps(x, a0);
  }
  MaxResult r{_mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a0, a1), _mm512_max_ps(a2, a3))), nan != 0};
  for (; i < n; ++i) {
    const float x = load_scalar(row, i, t);
    if (x != x) r.nan = true;
    else if (x > r.max) r.max = x;
  }
  return r;
}

TAPS_AVX512_FN inline int64_t row_first_equal_avx512(const void* row, int64_t n, Dtype t, float value) {
  const __m512 v = _mm512_set1_ps(value);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(load16(row, i, t), v, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(unsigned(eq));
  }
  for (; i < n; ++i)
    if (load_scalar(row, i, t) == value) return i;
  return -1;
}

TAPS_AVX512_FN inline float row_sum_exp_avx512(const void* row, int64_t n, Dtype t, float m, float inv_t, float thr) {
  const __m512 vm = _mm512_set1_ps(m), vi = _mm512_set1_ps(inv_t), vt = _mm512_set1_ps(thr);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 x0 = load16(row, i, t), x1 = load16(row, i + 16, t);
    const __m512 e0 = exp16(_mm512_mul_ps(_mm512_sub_ps(x0, vm), vi));
    const __m512 e1 = exp16(_mm512_mul_ps(_mm512_sub_ps(x1, vm), vi));
    s0 = _mm512_add_ps(s0, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x0, vt, _CMP_GE_OQ), e0));
    s1 = _mm512_add_ps(s1, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x1, vt, _CMP_GE_OQ), e1));
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  for (; i < n; ++i) {
    const float x = load_scalar(row, i, t);
    s += x >= thr ? expf((x - m) * inv_t) : 0.0f;
  }
  return s;
}
#endif  // TAPS_ROW_AVX512

inline bool use_avx512() {
#ifdef TAPS_ROW_AVX512
  static const bool ok = __builtin_cpu_supports("avx512f") && std::getenv("TAPS_CPU_NO_AVX512") == nullptr;
  return ok;
#else
  return false;
#endif
}

inline MaxResult row_max(const void* row, int64_t n, Dtype t) {
#ifdef TAPS_ROW_AVX512
  if (use_avx512()) return row_max_avx512(row, n, t);
#endif
  return row_max_scalar(row, n, t);
}

inline int64_t row_first_equal(const void* row, int64_t n, Dtype t, float value) {
#ifdef TAPS_ROW_AVX512
  if (use_avx512()) return row_first_equal_avx512(row, n, t, value);
#endif
  return row_first_equal_scalar(row, n, t, value);
}

inline float row_sum_exp(const void* row, int64_t n, Dtype t, float m, float inv_t, float thr) {
#ifdef TAPS_ROW_AVX512
  if (use_avx512()) return row_sum_exp_avx512(row, n, t, m, inv_t, thr);
#endif
  return row_sum_exp_scalar(row, n, t, m, inv_t, thr);
}

}  // namespace rows
}  // namespace taps
