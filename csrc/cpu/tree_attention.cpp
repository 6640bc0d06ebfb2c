// tree_attention, CPU: input checks (checks/tree_attention_checks.h), the kv_lens check, the key splits
// (attention::plan_splits), and the choice of kernel for this CPU.
//
// q [B, Hq, N, D]; k, v [B, Hkv, S, D]; tree_mask [B, N, W] i64; kv_lens [B] i64; tree_nodes T (>= N, default
// N: the last T keys are tree nodes, the queries usually the newest N of them); num_queries [B] i64 (optional:
// request b's first n_b queries only, the rest of its rows zeros) -> out [B, Hq, N, D].
//
// Work item = (request b, KV head, key split). The G * n_b query rows of one KV head (row r = g * n_b + i:
// query head hkv * G + g, tree node i) are processed together, so each K/V row is read once per
// group. Keys stream in tiles: scores of the whole group against the tile, online softmax per row,
// then acc += P * V. Prefix tiles skip the mask; only tiles reaching the tree tail test bits. When
// B * Hkv alone cannot keep the threads busy, the key range is split and the partial results are
// merged by log-sum-exp, planned and laid out as for CUDA (taps/tree_attention.h), except that each
// request's keys are split by its own length. Everything accumulates in fp32.
//
// Kernels (one per instruction-set level, cpu/cpu_isa.h; the extension is compiled for the x86-64 baseline,
// so each vector level is a `#pragma GCC target` region of this file):
// - cpu/tree_attention_vec.h, written over a float vector type `Vec`: compiled in the AVX-512 region with
//   ATen's AVX-512 Vectorized<float> (namespace at::vec::AVX512, so no clash with other translation units),
//   in the AVX2 + FMA region with an 8-lane Vec of its own, and for the baseline with a plain 16-lane
//   struct. Elsewhere (aarch64, clang, ...) it is compiled once with the default Vectorized<float>. It
//   serves head dims the fast path cannot take.
// - cpu/tree_attention_fast.h, written over vector traits `S`, compiled in both vector regions and (4 SSE2
//   lanes, multiply and add) for the x86-64 baseline: the same
//   work items, tiles and online softmax, with both tile products as row-major micro-GEMMs (6 x 64 on
//   AVX-512, 6 x 16 on AVX2; bf16 and fp16 widened to fp32 as they are read), for D % 16 (AVX-512) or D % 8
//   (AVX2) == 0; at AVX2 a KV head of at most 64 query rows takes the scores transposed (keys as the
//   micro-kernel's rows, attend_keys); bf16 on at::native::cpublas::brgemm where it runs on AMX, for
//   head dims >= 64 and >= 16 query rows per KV head (TAPS_ATTN_BF16_AMX: 1 always, 0 never; amx_wanted).
#include <ATen/ATen.h>
#include <ATen/NumericUtils.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/native/Math.h>
#include <ATen/native/cpu/zmath.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/TypeCast.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <bitset>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <type_traits>
#include <vector>

#include "checks/checks.h"
#include "cpu/cpu_isa.h"
#include "cpu/simd_x86.h"
#include "taps/tree_attention.h"
#include "checks/tree_attention_checks.h"

// at::native::cpublas::brgemm / could_pack (oneDNN ukernels, AMX for bf16): declared by the torch
// releases that define these macros; older headers build without the bf16 brgemm path.
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F32F32F32)
#define TAPS_ATTN_BRGEMM 1
#endif

#if defined(TAPS_CPU_X86)
#include <immintrin.h>

// ---- AVX-512 region: ATen's AVX-512 Vectorized<float> for the Vec kernel, 16-lane traits for the fast path
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
// GCC's target pragma does not define the ISA macros in C++; sleef.h and the vec headers test them.
#if !defined(__AVX512F__)
#define TAPS_ATTN_DEFINED_ISA_MACROS
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#endif
#include <ATen/cpu/vec/vec.h>
#if defined(TAPS_ATTN_DEFINED_ISA_MACROS)
#undef __AVX__
#undef __AVX2__
#undef __FMA__
#undef __F16C__
#undef __AVX512F__
#undef __AVX512BW__
#undef __AVX512VL__
#undef __AVX512DQ__
#endif
namespace taps::attention::cpu::avx512 {
using Vec = at::vec::Vectorized<float>;
struct S {
  using F = __m512;
  using I = __m512i;
  static constexpr int L = 16, kMaxNV = 4;
  static constexpr bool kKeysAsRows = false;  // attend_keys (cpu/tree_attention_fast.h) never taken
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F zero() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) {  // 2^n for integral n in [-127, 0] in the exponent bits (n = -127: 0)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static F masked_scale(F x, uint32_t bits, F scale, F ninf) {
    return _mm512_mask_mul_ps(ninf, static_cast<__mmask16>(bits), x, scale);
  }
  static float reduce_max(F x) { return _mm512_reduce_max_ps(x); }
  static float reduce_add(F x) { return _mm512_reduce_add_ps(x); }
  static F widen(const c10::BFloat16* p) { return simd::widen_bf16x16(p); }
  static F widen(const c10::Half* p) { return simd::widen_f16x16(p); }
  static I as_int(F x) { return _mm512_castps_si512(x); }
  static I zeroi() { return _mm512_setzero_si512(); }
  static I loadi(const void* p) { return _mm512_loadu_si512(p); }
  static void storei(void* p, I x) { _mm512_storeu_si512(p, x); }
  // fp32 -> bf16 (round to nearest even; inputs finite) of 16 values.
  static void store_bf16(c10::BFloat16* dst, F x) {
    __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
  }
  // dst[l] = a[l] | c[l] << 16 (c null: 0), 16 values: a VNNI pair of bf16 rows.
  static void vnni_pair(const c10::BFloat16* a, const c10::BFloat16* c, uint32_t* dst) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
    const __m512i hi = c ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)))
                         : _mm512_setzero_si512();
    _mm512_storeu_si512(dst, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
  // 16 x 16 transpose of 32-bit words: out[c] = column c of the rows r[0..16).
  __attribute__((always_inline)) static void transpose(I r[16]) {
    __m512i t[16], u[16];
    for (int k = 0; k < 8; ++k) {
      t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
      t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int g = 0; g < 4; ++g) {
      u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
      u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
      u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
      u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    // u[4 g + c] holds, in 128-bit lane L, column 4 L + c of rows 4 g .. 4 g + 3.
    for (int c = 0; c < 4; ++c) {
      const __m512i ab_lo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), ab_hi = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
      const __m512i cd_lo = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44),
                    cd_hi = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
      r[c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
      r[4 + c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);
      r[8 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
      r[12 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);
    }
  }
};
#include "cpu/tree_attention_vec.h"
#include "cpu/tree_attention_fast.h"
}  // namespace taps::attention::cpu::avx512
#undef CPU_CAPABILITY
#undef CPU_CAPABILITY_AVX512
#pragma GCC pop_options

// ---- AVX2 + FMA region: an 8-lane Vec for the Vec kernel (ATen's vec headers are taken by the region
// above), 8-lane traits for the fast path
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
namespace taps::attention::cpu::avx2 {
struct Vec {
  __m256 x;
  Vec() = default;
  explicit Vec(float s) : x(_mm256_set1_ps(s)) {}
  explicit Vec(__m256 v) : x(v) {}
  static constexpr int size() { return 8; }
  static Vec loadu(const float* p) { return Vec(_mm256_loadu_ps(p)); }
  void store(float* p) const { _mm256_storeu_ps(p, x); }
  Vec exp_u20() const { return Vec(simd::exp8(x)); }  // arguments here are <= 0 (x - running max) or -inf
  Vec operator-(const Vec& o) const { return Vec(_mm256_sub_ps(x, o.x)); }
  Vec operator+(const Vec& o) const { return Vec(_mm256_add_ps(x, o.x)); }
  Vec operator*(const Vec& o) const { return Vec(_mm256_mul_ps(x, o.x)); }
};
inline Vec fmadd(const Vec& a, const Vec& b, const Vec& c) { return Vec(_mm256_fmadd_ps(a.x, b.x, c.x)); }
inline Vec maximum(const Vec& a, const Vec& b) { return Vec(_mm256_max_ps(a.x, b.x)); }
struct S {
  using F = __m256;
  using I = __m256i;
  static constexpr int L = 8, kMaxNV = 2;
  static constexpr bool kKeysAsRows = true;  // attend_keys for KV heads of up to 64 query rows
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F zero() { return _mm256_setzero_ps(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) {  // 2^n for integral n in [-127, 0] in the exponent bits (n = -127: 0)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static F masked_scale(F x, uint32_t bits, F scale, F ninf) {
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane), lane);
    return _mm256_blendv_ps(ninf, _mm256_mul_ps(x, scale), _mm256_castsi256_ps(on));
  }
  static float reduce_max(F x) { return simd::hmax8(x); }
  static float reduce_add(F x) { return simd::hsum8(x); }
  static F widen(const c10::BFloat16* p) { return simd::widen_bf16x8(p); }
  static F widen(const c10::Half* p) { return simd::widen_f16x8(p); }
  static I as_int(F x) { return _mm256_castps_si256(x); }
  static I zeroi() { return _mm256_setzero_si256(); }
  static I loadi(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static void storei(void* p, I x) { _mm256_storeu_si256(static_cast<__m256i*>(p), x); }
  static void store_bf16(c10::BFloat16* dst, F x) {  // round to nearest even; inputs finite
    __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
  }
  static void vnni_pair(const c10::BFloat16* a, const c10::BFloat16* c, uint32_t* dst) {
    const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
    const __m256i hi = c ? _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)))
                         : _mm256_setzero_si256();
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_or_si256(lo, _mm256_slli_epi32(hi, 16)));
  }
  // 8 x 8 transpose of 32-bit words: out[c] = column c of the rows r[0..8).
  __attribute__((always_inline)) static void transpose(I r[8]) {
    __m256 t[8], u[8];
    for (int k = 0; k < 4; ++k) {
      const __m256 a = _mm256_castsi256_ps(r[2 * k]), b = _mm256_castsi256_ps(r[2 * k + 1]);
      t[2 * k] = _mm256_unpacklo_ps(a, b);
      t[2 * k + 1] = _mm256_unpackhi_ps(a, b);
    }
    for (int g = 0; g < 2; ++g) {
      u[4 * g + 0] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
      u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
      u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
      u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
    }
    // u[4 g + c] holds, in 128-bit lane h, column 4 h + c of rows 4 g .. 4 g + 3.
    for (int c = 0; c < 4; ++c) {
      r[c] = _mm256_castps_si256(_mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
      r[4 + c] = _mm256_castps_si256(_mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
    }
  }
};
#include "cpu/tree_attention_vec.h"
#include "cpu/tree_attention_fast.h"
}  // namespace taps::attention::cpu::avx2
#pragma GCC pop_options

namespace taps::attention::cpu::generic {
// Baseline-ISA stand-in for Vectorized<float>: fixed-size loops the compiler vectorizes.
struct Vec {
  static constexpr int kSize = 16;
  float x[kSize];
  Vec() = default;
  explicit Vec(float s) { for (int i = 0; i < kSize; ++i) x[i] = s; }
  static constexpr int size() { return kSize; }
  static Vec loadu(const float* p) { Vec r; std::memcpy(r.x, p, sizeof(r.x)); return r; }
  void store(float* p) const { std::memcpy(p, x, sizeof(x)); }
  Vec exp_u20() const { Vec r; for (int i = 0; i < kSize; ++i) r.x[i] = std::exp(x[i]); return r; }
  Vec operator-(const Vec& o) const { Vec r; for (int i = 0; i < kSize; ++i) r.x[i] = x[i] - o.x[i]; return r; }
  Vec operator+(const Vec& o) const { Vec r; for (int i = 0; i < kSize; ++i) r.x[i] = x[i] + o.x[i]; return r; }
  Vec operator*(const Vec& o) const { Vec r; for (int i = 0; i < kSize; ++i) r.x[i] = x[i] * o.x[i]; return r; }
};
inline Vec fmadd(const Vec& a, const Vec& b, const Vec& c) {
  Vec r;
  for (int i = 0; i < Vec::kSize; ++i) r.x[i] = a.x[i] * b.x[i] + c.x[i];
  return r;
}
inline Vec maximum(const Vec& a, const Vec& b) {
  Vec r;
  for (int i = 0; i < Vec::kSize; ++i) r.x[i] = a.x[i] > b.x[i] ? a.x[i] : b.x[i];
  return r;
}
#include "cpu/tree_attention_vec.h"
// The fast path at the baseline level too: SSE2 (every x86-64 CPU), 4 lanes, multiply and add (no FMA).
struct S {
  using F = __m128;
  using I = __m128i;
  static constexpr int L = 4, kMaxNV = 2;
  static constexpr bool kKeysAsRows = false;  // attend_keys (cpu/tree_attention_fast.h) never taken
  static F load(const float* p) { return _mm_loadu_ps(p); }
  static void store(float* p, F x) { _mm_storeu_ps(p, x); }
  static F set1(float x) { return _mm_set1_ps(x); }
  static F zero() { return _mm_setzero_ps(); }
  static F add(F a, F b) { return _mm_add_ps(a, b); }
  static F sub(F a, F b) { return _mm_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm_mul_ps(a, b); }
  static F max(F a, F b) { return _mm_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm_add_ps(_mm_mul_ps(a, b), c); }
  static F round(F x) { return _mm_cvtepi32_ps(_mm_cvtps_epi32(x)); }  // |x| <= 127 here; MXCSR: to nearest
  static F pow2(F n) {  // 2^n for integral n in [-127, 0] in the exponent bits (n = -127: 0)
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_add_epi32(_mm_cvtps_epi32(n), _mm_set1_epi32(127)), 23));
  }
  static F masked_scale(F x, uint32_t bits, F scale, F ninf) {
    const __m128i lane = _mm_setr_epi32(1, 2, 4, 8);
    const F on = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(_mm_set1_epi32(static_cast<int>(bits)), lane), lane));
    return _mm_or_ps(_mm_and_ps(on, _mm_mul_ps(x, scale)), _mm_andnot_ps(on, ninf));
  }
  static float reduce_max(F x) {
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
  }
  static float reduce_add(F x) {
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
  }
  static F widen(const c10::BFloat16* p) {
    const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
  }
  static F widen(const c10::Half* p) {  // no F16C at the baseline
    return _mm_setr_ps(static_cast<float>(p[0]), static_cast<float>(p[1]), static_cast<float>(p[2]),
                       static_cast<float>(p[3]));
  }
  static I as_int(F x) { return _mm_castps_si128(x); }
  static I zeroi() { return _mm_setzero_si128(); }
  static I loadi(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
  static void storei(void* p, I x) { _mm_storeu_si128(static_cast<__m128i*>(p), x); }
  __attribute__((always_inline)) static void transpose(I r[4]) {
    F a = _mm_castsi128_ps(r[0]), b = _mm_castsi128_ps(r[1]), c = _mm_castsi128_ps(r[2]), d = _mm_castsi128_ps(r[3]);
    _MM_TRANSPOSE4_PS(a, b, c, d);
    r[0] = _mm_castps_si128(a), r[1] = _mm_castps_si128(b), r[2] = _mm_castps_si128(c), r[3] = _mm_castps_si128(d);
  }
  // The bf16 brgemm path runs only at the amx level; these keep its code compiling here.
  static void store_bf16(c10::BFloat16* dst, F x) {
    alignas(16) float v[4];
    _mm_store_ps(v, x);
    for (int l = 0; l < 4; ++l) dst[l] = c10::BFloat16(v[l]);
  }
  static void vnni_pair(const c10::BFloat16* a, const c10::BFloat16* c, uint32_t* dst) {
    for (int l = 0; l < 4; ++l) dst[l] = uint32_t(a[l].x) | (c ? uint32_t(c[l].x) << 16 : 0u);
  }
};
#include "cpu/tree_attention_fast.h"
}  // namespace taps::attention::cpu::generic

#else  // one build with the default Vectorized<float> (NEON on aarch64)
#include <ATen/cpu/vec/vec.h>
namespace taps::attention::cpu::generic {
using Vec = at::vec::Vectorized<float>;
#include "cpu/tree_attention_vec.h"
}  // namespace taps::attention::cpu::generic
#endif

namespace taps::attention::cpu {
namespace {

// The kernel for this call, by the kernels' instruction-set level (cpu/cpu_isa.h, read once per call):
enum class Kernel {
  kGeneric,      // the Vec kernel for the baseline
  kFastBaseline, // the GEMM-shaped path at the baseline (x86-64: SSE2): D % 4 == 0
  kVecAvx2,      // the Vec kernel, AVX2 + FMA
  kVecAvx512,    // the Vec kernel, AVX-512
  kFastAvx2,     // the GEMM-shaped path, AVX2 + FMA: D % 8 == 0 (fp32; bf16 / fp16 widened to fp32 as read)
  kFastAvx512,   // the GEMM-shaped path, AVX-512: D % 16 == 0 (likewise)
  kBrgemmAmx,    // bf16 on oneDNN's brgemm ukernel (AMX): see amx_wanted
};
// The brgemm path rounds P to bf16 for the P * V product (as PyTorch's CPU flash attention does), which
// moves the output enough to flip near-tie greedy tokens: on an AMX host it made one of the demo's two
// answers of the shipped bf16 target (head dim 32) differ from the target's own greedy output, while fp32 P
// gave both. Measured on an AMX Xeon (1 thread, bench/RESULTS.md), brgemm against the fp32 micro-GEMMs:
// 1.3x at the shipped shape, 0.8x at 4 query rows per KV head, 1.0x at 8, 1.8x at 16, 2.8-3.0x at 64-256
// (head dim 128). So, by TAPS_ATTN_BF16_AMX (read once per process): "1" every bf16 call with a head dim
// that is a multiple of 16, "0" none, unset (or anything else) the calls where it pays and P in bf16 is
// what the model's own attention does: head dims of 64 and more (real models' heads; the shipped mini
// target's 32 keeps fp32 P) with at least 16 query rows per KV head (G x N: a tree, not a decoding step).
// Only at the amx level, where could_pack says the ukernel runs on AMX.
constexpr int64_t kAmxMinHeadDim = 64, kAmxMinRows = 16;

inline bool amx_wanted(const Params& p) {
  static const int mode = [] {  // 1 always, 0 never, -1 by the shape
    const char* flag = std::getenv("TAPS_ATTN_BF16_AMX");
    if (flag != nullptr && std::strcmp(flag, "1") == 0) return 1;
    if (flag != nullptr && std::strcmp(flag, "0") == 0) return 0;
    return -1;
  }();
  if (mode >= 0) return mode == 1;
  return p.head_dim >= kAmxMinHeadDim && (p.heads_q / p.heads_kv) * p.num_nodes >= kAmxMinRows;
}
template <class T>
Kernel choose_kernel(const Params& p) {
#if defined(TAPS_CPU_X86)
  const taps::cpu::Isa isa = taps::cpu::isa();
  if (isa >= taps::cpu::Isa::kAvx512) {
#if defined(TAPS_ATTN_BRGEMM)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (isa >= taps::cpu::Isa::kAmx && p.head_dim % 16 == 0 && amx_wanted(p) &&
          at::native::cpublas::could_pack(at::kBFloat16))
        return Kernel::kBrgemmAmx;
    }
#endif
    return p.head_dim % avx512::S::L == 0 ? Kernel::kFastAvx512 : Kernel::kVecAvx512;
  }
  if (isa >= taps::cpu::Isa::kAvx2) return p.head_dim % avx2::S::L == 0 ? Kernel::kFastAvx2 : Kernel::kVecAvx2;
  if (p.head_dim % generic::S::L == 0) return Kernel::kFastBaseline;
#endif
  (void)p;
  return Kernel::kGeneric;
}

template <class T>
void run(const Params& p) {
  const int64_t items = p.batch * p.heads_kv * p.splits;
  const Kernel kernel = choose_kernel<T>(p);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    switch (kernel) {
#if defined(TAPS_CPU_X86)
      case Kernel::kBrgemmAmx:
#if defined(TAPS_ATTN_BRGEMM)
        if constexpr (std::is_same_v<T, c10::BFloat16>) return avx512::fast::attend_items_fast<T, true>(p, begin, end);
#endif
        break;
      case Kernel::kFastAvx512: return avx512::fast::attend_items_fast<T, false>(p, begin, end);
      case Kernel::kVecAvx512: return avx512::attend_items<T>(p, begin, end);
      case Kernel::kFastAvx2: return avx2::fast::attend_items_fast<T, false>(p, begin, end);
      case Kernel::kVecAvx2: return avx2::attend_items<T>(p, begin, end);
      case Kernel::kFastBaseline: return generic::fast::attend_items_fast<T, false>(p, begin, end);
#endif
      default: break;
    }
    generic::attend_items<T>(p, begin, end);
  });
  if (p.splits == 1) return;
  const int64_t rows = p.batch * p.heads_q * p.num_nodes;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
#if defined(TAPS_CPU_X86)
    if (kernel == Kernel::kFastAvx512 || kernel == Kernel::kVecAvx512 || kernel == Kernel::kBrgemmAmx)
      return avx512::combine_rows<T>(p, begin, end);
    if (kernel == Kernel::kFastAvx2 || kernel == Kernel::kVecAvx2) return avx2::combine_rows<T>(p, begin, end);
#endif
    generic::combine_rows<T>(p, begin, end);
  });
}

}  // namespace
}  // namespace taps::attention::cpu

namespace taps {
namespace {

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& tree_mask, const at::Tensor& kv_lens, double scale,
                              bool /*validate: the CPU always checks kv_lens and num_queries (no sync to save)*/,
                              std::optional<int64_t> tree_nodes, const std::optional<at::Tensor>& num_queries) {
  const int64_t tree = check_tree_attention_inputs(q, k, v, tree_mask, kv_lens, scale, tree_nodes, num_queries);
  const int64_t batch = q.size(0), heads_kv = k.size(1), cache_len = k.size(2), num_nodes = q.size(2);
  TreeAttentionCall call = TreeAttentionCall::prepare(q, k, v, tree_mask, kv_lens, num_queries);
  const int64_t* lens = call.kv_lens->data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(lens[b] >= tree && lens[b] <= cache_len, "taps_ops: tree_attention: kv_lens[", b, "] = ",
                lens[b], " must be in [T, S] = [", tree, ", ", cache_len, "] (T: tree nodes)");
  }
  if (call.num_queries->defined()) {
    const int64_t* live = call.num_queries->data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK_VALUE(live[b] >= 0 && live[b] <= num_nodes, "taps_ops: tree_attention: num_queries[", b, "] = ",
                        live[b], " must be in [0, N] = [0, ", num_nodes, "]");
    }
  }
  if (call.out.numel() == 0) return call.out;
  // Key splits when B * Hkv work items cannot feed the threads (4 items a thread); no cap on their
  // number (the combine has no fixed buffer).
  const int64_t max_len = *std::max_element(lens, lens + batch);
  const int64_t splits = attention::plan_splits(batch * heads_kv, 4 * at::get_num_threads(), max_len,
                                                std::numeric_limits<int64_t>::max());
  const attention::Params p = call.params(scale, splits, tree);
  switch (call.q->scalar_type()) {
    case at::kFloat: attention::cpu::run<float>(p); break;
    case at::kBFloat16: attention::cpu::run<c10::BFloat16>(p); break;
    default: attention::cpu::run<c10::Half>(p); break;
  }
  return call.out;
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("tree_attention", &taps::tree_attention_cpu); }
