// verify_tree, CPU: the hot per-row passes of its kernel (cpu/verify_tree.cpp, their only user): max
// (NaN-aware), first index of a value, the sum of target weights sum(x >= thr ? exp((x - m) * inv_t) : 0), and
// the sums of a drawn node's rejection residuals (row_residual_sum). A portable scalar version, an AVX2 + FMA
// version and an AVX-512 version (per-function target attributes), chosen per call by the kernels'
// instruction-set level (cpu/cpu_isa.h; TAPS_CPU_ISA / taps_ops.set_cpu_isa force a lower one). Rows are
// float32, bfloat16 or float16, passed as raw bits so this header needs no torch types.
//
// The vector exp is a degree-6 polynomial after range reduction (max relative error ~2e-7, i.e. about
// one float ulp), the same in both vector versions; it returns 0 where expf would return a denormal
// (x < -87.3). Only normalisers use it: every decision on a single token uses the core's scalar
// target_weight.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu/cpu_isa.h"
#include "cpu/simd_x86.h"
#include "taps/elementwise.h"

#if defined(TAPS_CPU_X86)
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

// The residual of the recursive rejection after `level` rejections at a drawn node (the core's residual_at on
// the target weight w(x) = x >= thr ? exp((x - m) * inv_t) : 0 and the draft's q, one float division per level
// as there): r_0 = w / z, r_l = max(r_{l-1} - q, 0) / rz[l - 1]. row_residual_sum returns the sum over the row
// of r_level (excess false: the mass a draw past the children scans) or of max(r_level - q, 0) (excess true:
// the normaliser of the next level).
struct Residual {
  float m, inv_t, thr, z;
  const float* rz;  // [level] the earlier levels' normalisers
  int32_t level;
  bool excess;
};

inline float residual_scalar(float x, float q, const Residual& r) {
  float v = (x >= r.thr ? expf((x - r.m) * r.inv_t) : 0.0f) / r.z;
  for (int32_t l = 0; l < r.level; ++l) {
    v = v - q;
    v = (v > 0.0f ? v : 0.0f) / r.rz[l];
  }
  if (r.excess) {
    v = v - q;
    v = v > 0.0f ? v : 0.0f;
  }
  return v;
}

inline float row_residual_sum_scalar(const void* row, const float* q, int64_t n, Dtype t, const Residual& r) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += residual_scalar(load_scalar(row, i, t), q[i], r);
  return s;
}

#ifdef TAPS_ROW_AVX512
#define TAPS_AVX512_FN TAPS_TARGET_AVX512 inline
#define TAPS_AVX2_FN TAPS_TARGET_AVX2_FMA inline

TAPS_AVX512_FN __m512 load16(const void* row, int64_t i, Dtype t) {
  if (t == Dtype::kF32) return _mm512_loadu_ps(static_cast<const float*>(row) + i);
  const uint16_t* h = static_cast<const uint16_t*>(row) + i;
  return t == Dtype::kF16 ? simd::widen_f16x16(h) : simd::widen_bf16x16(h);
}

TAPS_AVX512_FN MaxResult row_max_avx512(const void* row, int64_t n, Dtype t) {
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

TAPS_AVX512_FN int64_t row_first_equal_avx512(const void* row, int64_t n, Dtype t, float value) {
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

TAPS_AVX512_FN float row_sum_exp_avx512(const void* row, int64_t n, Dtype t, float m, float inv_t, float thr) {
  const __m512 vm = _mm512_set1_ps(m), vi = _mm512_set1_ps(inv_t), vt = _mm512_set1_ps(thr);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 x0 = load16(row, i, t), x1 = load16(row, i + 16, t);
    const __m512 e0 = simd::exp16(_mm512_mul_ps(_mm512_sub_ps(x0, vm), vi));
    const __m512 e1 = simd::exp16(_mm512_mul_ps(_mm512_sub_ps(x1, vm), vi));
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
// (max(a, 0) returns 0 for a NaN a, as the scalar `a > 0 ? a : 0` does; exp16 returns 0 below -87.3)
TAPS_AVX512_FN float row_residual_sum_avx512(const void* row, const float* q, int64_t n, Dtype t, const Residual& r) {
  const __m512 vm = _mm512_set1_ps(r.m), vi = _mm512_set1_ps(r.inv_t), vt = _mm512_set1_ps(r.thr),
               vz = _mm512_set1_ps(r.z), zero = _mm512_setzero_ps();
  __m512 s0 = zero;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = load16(row, i, t), vq = _mm512_loadu_ps(q + i);
    const __m512 w = simd::exp16(_mm512_mul_ps(_mm512_sub_ps(x, vm), vi));
    __m512 v = _mm512_div_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vt, _CMP_GE_OQ), w), vz);
    for (int32_t l = 0; l < r.level; ++l)
      v = _mm512_div_ps(_mm512_max_ps(_mm512_sub_ps(v, vq), zero), _mm512_set1_ps(r.rz[l]));
    if (r.excess) v = _mm512_max_ps(_mm512_sub_ps(v, vq), zero);
    s0 = _mm512_add_ps(s0, v);
  }
  float s = _mm512_reduce_add_ps(s0);
  for (; i < n; ++i) s += residual_scalar(load_scalar(row, i, t), q[i], r);
  return s;
}

// ---- AVX2 + FMA: the AVX-512 passes on 8 lanes --------------------------------------------------------
TAPS_AVX2_FN __m256 load8(const void* row, int64_t i, Dtype t) {
  if (t == Dtype::kF32) return _mm256_loadu_ps(static_cast<const float*>(row) + i);
  const uint16_t* h = static_cast<const uint16_t*>(row) + i;
  return t == Dtype::kF16 ? simd::widen_f16x8(h) : simd::widen_bf16x8(h);
}

TAPS_AVX2_FN MaxResult row_max_avx2(const void* row, int64_t n, Dtype t) {
  __m256 a0 = _mm256_set1_ps(-INFINITY), a1 = a0, a2 = a0, a3 = a0;
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256 x0 = load8(row, i, t), x1 = load8(row, i + 8, t), x2 = load8(row, i + 16, t),
                 x3 = load8(row, i + 24, t);
    nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(x0, x0, _CMP_UNORD_Q), _mm256_cmp_ps(x1, x1, _CMP_UNORD_Q)),
                                         _mm256_or_ps(_mm256_cmp_ps(x2, x2, _CMP_UNORD_Q), _mm256_cmp_ps(x3, x3, _CMP_UNORD_Q))));
    a0 = _mm256_max_ps(x0, a0);  // max_ps returns the second operand when the first is NaN
    a1 = _mm256_max_ps(x1, a1);
    a2 = _mm256_max_ps(x2, a2);
    a3 = _mm256_max_ps(x3, a3);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 x = load8(row, i, t);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    a0 = _mm256_max_ps(x, a0);
  }
  MaxResult r{simd::hmax8(_mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3))), _mm256_movemask_ps(nan) != 0};
  for (; i < n; ++i) {
    const float x = load_scalar(row, i, t);
    if (x != x) r.nan = true;
    else if (x > r.max) r.max = x;
  }
  return r;
}

TAPS_AVX2_FN int64_t row_first_equal_avx2(const void* row, int64_t n, Dtype t, float value) {
  const __m256 v = _mm256_set1_ps(value);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(load8(row, i, t), v, _CMP_EQ_OQ));
    if (eq) return i + __builtin_ctz(unsigned(eq));
  }
  for (; i < n; ++i)
    if (load_scalar(row, i, t) == value) return i;
  return -1;
}

TAPS_AVX2_FN float row_sum_exp_avx2(const void* row, int64_t n, Dtype t, float m, float inv_t, float thr) {
  const __m256 vm = _mm256_set1_ps(m), vi = _mm256_set1_ps(inv_t), vt = _mm256_set1_ps(thr);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 x0 = load8(row, i, t), x1 = load8(row, i + 8, t);
    const __m256 e0 = simd::exp8(_mm256_mul_ps(_mm256_sub_ps(x0, vm), vi));
    const __m256 e1 = simd::exp8(_mm256_mul_ps(_mm256_sub_ps(x1, vm), vi));
    s0 = _mm256_add_ps(s0, _mm256_and_ps(_mm256_cmp_ps(x0, vt, _CMP_GE_OQ), e0));
    s1 = _mm256_add_ps(s1, _mm256_and_ps(_mm256_cmp_ps(x1, vt, _CMP_GE_OQ), e1));
  }
  float s = simd::hsum8(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) {
    const float x = load_scalar(row, i, t);
    s += x >= thr ? expf((x - m) * inv_t) : 0.0f;
  }
  return s;
}
TAPS_AVX2_FN float row_residual_sum_avx2(const void* row, const float* q, int64_t n, Dtype t, const Residual& r) {
  const __m256 vm = _mm256_set1_ps(r.m), vi = _mm256_set1_ps(r.inv_t), vt = _mm256_set1_ps(r.thr),
               vz = _mm256_set1_ps(r.z), zero = _mm256_setzero_ps();
  __m256 s0 = zero;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = load8(row, i, t), vq = _mm256_loadu_ps(q + i);
    const __m256 w = simd::exp8(_mm256_mul_ps(_mm256_sub_ps(x, vm), vi));
    __m256 v = _mm256_div_ps(_mm256_and_ps(_mm256_cmp_ps(x, vt, _CMP_GE_OQ), w), vz);
    for (int32_t l = 0; l < r.level; ++l)
      v = _mm256_div_ps(_mm256_max_ps(_mm256_sub_ps(v, vq), zero), _mm256_set1_ps(r.rz[l]));
    if (r.excess) v = _mm256_max_ps(_mm256_sub_ps(v, vq), zero);
    s0 = _mm256_add_ps(s0, v);
  }
  float s = simd::hsum8(s0);
  for (; i < n; ++i) s += residual_scalar(load_scalar(row, i, t), q[i], r);
  return s;
}
#endif  // TAPS_ROW_AVX512

// Each pass takes the level it runs at (cpu::isa(), read once per op call on the calling thread).
inline MaxResult row_max(const void* row, int64_t n, Dtype t, cpu::Isa isa) {
#ifdef TAPS_ROW_AVX512
  if (isa >= cpu::Isa::kAvx512) return row_max_avx512(row, n, t);
  if (isa >= cpu::Isa::kAvx2) return row_max_avx2(row, n, t);
#endif
  return row_max_scalar(row, n, t);
}

inline int64_t row_first_equal(const void* row, int64_t n, Dtype t, float value, cpu::Isa isa) {
#ifdef TAPS_ROW_AVX512
  if (isa >= cpu::Isa::kAvx512) return row_first_equal_avx512(row, n, t, value);
  if (isa >= cpu::Isa::kAvx2) return row_first_equal_avx2(row, n, t, value);
#endif
  return row_first_equal_scalar(row, n, t, value);
}

inline float row_sum_exp(const void* row, int64_t n, Dtype t, float m, float inv_t, float thr, cpu::Isa isa) {
#ifdef TAPS_ROW_AVX512
  if (isa >= cpu::Isa::kAvx512) return row_sum_exp_avx512(row, n, t, m, inv_t, thr);
  if (isa >= cpu::Isa::kAvx2) return row_sum_exp_avx2(row, n, t, m, inv_t, thr);
#endif
  return row_sum_exp_scalar(row, n, t, m, inv_t, thr);
}

inline float row_residual_sum(const void* row, const float* q, int64_t n, Dtype t, const Residual& r, cpu::Isa isa) {
#ifdef TAPS_ROW_AVX512
  if (isa >= cpu::Isa::kAvx512) return row_residual_sum_avx512(row, q, n, t, r);
  if (isa >= cpu::Isa::kAvx2) return row_residual_sum_avx2(row, q, n, t, r);
#endif
  return row_residual_sum_scalar(row, q, n, t, r);
}

}  // namespace rows
}  // namespace taps
