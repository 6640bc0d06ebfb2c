// CPU kernel of taps_ops::tree_attention.
//
// q [B, Hq, N, D]; k, v [B, Hkv, S, D]; tree_mask [B, N, W] i64; kv_lens [B] i64 -> out [B, Hq, N, D].
//
// Work item = (request b, KV head, key split). The G * N query rows of one KV head (row r = g * N + i:
// query head hkv * G + g, tree node i) are processed together, so each K/V row is read once per
// group. Keys stream in tiles of kTile: scores of the whole group against the tile (a register-blocked
// q * K^T with the tile transposed to [D][kTile]), online softmax per row, then acc += P * V (register
// blocked axpy). Prefix tiles skip the mask; only tiles reaching the tree tail test bits. When B * Hkv
// alone cannot keep the threads busy, the key range is split and the partial (max, sum, acc) states
// are merged by log-sum-exp (taps/attention.h). Everything accumulates in fp32.
//
// Instruction set: the extension is compiled for the baseline ISA, so at::vec::Vectorized would be
// its generic 8-lane fallback. On x86-64 with GCC the kernel body (the TAPS_ATTN_KERNEL_BODY part
// at the end of this file) is compiled twice: once inside a `#pragma GCC target` AVX-512 region with
// ATen's AVX-512 Vectorized<float> (namespace at::vec::AVX512, so no clash with other translation
// units), and once for the baseline with a plain 16-lane vector struct; the binding picks the
// AVX-512 one when the CPU has it and ATen's own capability (ATEN_CPU_CAPABILITY) allows it.
// Elsewhere (aarch64, clang, ...) the body is compiled once with the default Vectorized<float>.
//
// On AVX-512 hosts fp32 and bf16 (when oneDNN's brgemm runs on AMX) with D % 16 == 0 take the
// GEMM-shaped fast path instead (namespace taps_attn::avx512::fast, after the body include): same work
// items, tiles and online softmax, but both tile products are row-major micro-GEMMs (a hand-written
// 6 x 64 AVX-512 kernel for fp32, at::native::cpublas::brgemm for bf16). fp16 and other head dims use
// the body's kernel.
#ifndef TAPS_ATTN_KERNEL_BODY

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
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <type_traits>
#include <vector>

#include "tree_attention_checks.h"
#include "checks.h"
#include "taps/tree_attention.h"

// at::native::cpublas::brgemm / could_pack (oneDNN ukernels, AMX for bf16): declared by the torch
// releases that define these macros; older headers build without the bf16 brgemm path.
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F32F32F32)
#define TAPS_ATTN_BRGEMM 1
#endif

namespace taps_attn {

// The problem in plain pointers (features contiguous; other dims strided).
template <class T>
struct Problem {
  const T* q;
  const T* k;
  const T* v;
  const int64_t* tree_mask;  // [B, N, W]
  const int64_t* kv_lens;    // [B]
  T* out;                    // [B, Hq, N, D] contiguous
  float* part;               // [splits, B, Hkv, R, D] partial acc (splits > 1)
  float* part_max;           // [splits, B, Hkv, R]
  float* part_sum;           // [splits, B, Hkv, R]
  int64_t q_sb, q_sh, q_sn, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss;
  int64_t batch, heads_q, heads_kv, group, num_nodes, head_dim, cache_len, mask_words, splits;
  float scale;
};

}  // namespace taps_attn

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TAPS_ATTN_X86_AVX512 1
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
namespace taps_attn::avx512 {
using Vec = at::vec::Vectorized<float>;
#define TAPS_ATTN_KERNEL_BODY
#include __FILE__
#undef TAPS_ATTN_KERNEL_BODY

// ---- Fast path (AVX-512 hosts): GEMM-shaped tiles ----------------------------------------------
// Same work items and online softmax as the body above, restructured so that both tile products are
// plain row-major GEMMs C[M][N] (+)= A[M][K] * B[K][N]:
//   S[rows][kFastTile] = Q[rows][D] * Kt[D][kFastTile]   (K tile transposed once per tile, 16x16 blocks)
//   acc[rows][D]      += P[rows][tile] * V[tile][D]        (acc rows rescaled only when their max grew)
// fp32: a register-blocked AVX-512 micro-GEMM (6 rows x 64 columns, 24 accumulators; V read in place).
// bf16 on hosts with AMX (at::native::cpublas::could_pack): at::native::cpublas::brgemm (oneDNN
// ukernel) with K^T and V packed to VNNI pairs; P is rounded to bf16 for P * V like PyTorch's CPU flash
// attention, everything else accumulates in fp32. Scores are scaled in fp32 (q is not pre-rounded).
namespace fast {

// Keys per tile and query rows per block (S block rows x tile fp32 = 64 KiB). fp32: K^T and V tiles of
// 32 KiB stay in L1/L2 for all rows. bf16: long tiles keep the AMX P * V product efficient (K = 256).
template <class T> constexpr int64_t kFastTile = std::is_same_v<T, float> ? 64 : 256;
template <class T> constexpr int64_t kFastRows = std::is_same_v<T, float> ? 256 : 64;

// C[MR x 16 NV] (+)= A[MR x K] * B[K x 16 NV]
template <int MR, int NV>
inline void micro_gemm(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                       bool add) {
  __m512 c[MR][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[m][v] = add ? _mm512_loadu_ps(C + m * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_ps(B + k * ldb + 16 * v);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(A[m * lda + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[m][v] = _mm512_fmadd_ps(a, b[v], c[m][v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + m * ldc + 16 * v, c[m][v]);
}

template <int NV>
inline void gemm_cols(int64_t M, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                      int64_t ldc, bool add) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) micro_gemm<6, NV>(K, A + m * lda, lda, B, ldb, C + m * ldc, ldc, add);
  const float* a = A + m * lda;
  float* c = C + m * ldc;
  switch (M - m) {
    case 5: micro_gemm<5, NV>(K, a, lda, B, ldb, c, ldc, add); break;
    case 4: micro_gemm<4, NV>(K, a, lda, B, ldb, c, ldc, add); break;
    case 3: micro_gemm<3, NV>(K, a, lda, B, ldb, c, ldc, add); break;
    case 2: micro_gemm<2, NV>(K, a, lda, B, ldb, c, ldc, add); break;
    case 1: micro_gemm<1, NV>(K, a, lda, B, ldb, c, ldc, add); break;
    default: break;
  }
}

// C[M][N] (+)= A[M][K] * B[K][N], fp32, N a multiple of 16.
inline void gemm_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                     float* C, int64_t ldc, bool add) {
  int64_t n = 0;
  for (; n + 64 <= N; n += 64) gemm_cols<4>(M, K, A, lda, B + n, ldb, C + n, ldc, add);
  switch ((N - n) / 16) {
    case 3: gemm_cols<3>(M, K, A, lda, B + n, ldb, C + n, ldc, add); break;
    case 2: gemm_cols<2>(M, K, A, lda, B + n, ldb, C + n, ldc, add); break;
    case 1: gemm_cols<1>(M, K, A, lda, B + n, ldb, C + n, ldc, add); break;
    default: break;
  }
}

// 16 x 16 transpose of 32-bit words: out[c] = column c of the rows r[0..16).
inline void transpose16(__m512i r[16]) {
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

// dst[w][j] = word w of key row j (j < tl), 0 for tl <= j < tile; `words` 32-bit words per row.
// fp32: K^T. bf16: the VNNI layout of K^T (word w = features 2w, 2w + 1).
inline void pack_kt(const char* src, int64_t row_bytes, int64_t tl, int64_t words, uint32_t* dst, int64_t tile) {
  for (int64_t j0 = 0; j0 < tile; j0 += 16) {
    int64_t w0 = 0;
    if (j0 + 16 <= tl) {
      for (; w0 + 16 <= words; w0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (j0 + i) * row_bytes + 4 * w0);
        transpose16(r);
        for (int c = 0; c < 16; ++c) _mm512_storeu_si512(dst + (w0 + c) * tile + j0, r[c]);
      }
    }
    for (int64_t w = w0; w < words; ++w)
      for (int64_t j = j0; j < j0 + 16; ++j) {
        uint32_t x = 0;
        if (j < tl) std::memcpy(&x, src + j * row_bytes + 4 * w, 4);
        dst[w * tile + j] = x;
      }
  }
}

// fp32 -> bf16 (round to nearest even; inputs finite) of 16 values.
inline void store_bf16(c10::BFloat16* dst, __m512 x) {
  __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

struct FastScratch {
  std::vector<float> s, acc, row_max, row_sum, qf;
  std::vector<uint32_t> kt, vp;
  std::vector<c10::BFloat16> qh, ph;
  std::vector<uint64_t> vis, valid;
};

template <class T>
constexpr bool kUseBrgemm = !std::is_same_v<T, float>;

// One work item (b, hkv, keys [key_begin, key_end)); leaves the unnormalised state in sc.
template <class T>
void attend_fast(const Problem<T>& p, int64_t b, int64_t hkv, int64_t key_begin, int64_t key_end,
                 const taps::attention::TreeSpan& span, FastScratch& sc) {
  const int64_t rows = p.group * p.num_nodes, D = p.head_dim, N = p.num_nodes;
  constexpr int64_t Tk = kFastTile<T>, Tw = Tk / 64;  // Tw mask words per tile
  const int64_t rb_max = std::min(rows, kFastRows<T>);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  sc.acc.assign(rows * D, 0.0f);
  sc.row_max.assign(rows, neg_inf);
  sc.row_sum.assign(rows, 0.0f);
  sc.s.resize(rb_max * Tk);
  sc.kt.resize(D * Tk);  // fp32: D words x Tk; bf16: D / 2 words x Tk
  sc.vis.resize(N * Tw);
  sc.valid.resize(Tw);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = hkv * p.group + r / N, i = r % N;
    const T* src = p.q + b * p.q_sb + h * p.q_sh + i * p.q_sn;
    if constexpr (kUseBrgemm<T>) {
      sc.qh.resize(rows * D);
      std::memcpy(&sc.qh[r * D], src, sizeof(T) * D);
    } else {
      sc.qf.resize(rows * D);
      std::memcpy(&sc.qf[r * D], src, sizeof(T) * D);
    }
  }
  if constexpr (kUseBrgemm<T>) {
    sc.vp.resize(Tk / 2 * D);
    sc.ph.resize(rb_max * Tk);
  }
  const T* kb = p.k + b * p.k_sb + hkv * p.k_sh;
  const T* vb = p.v + b * p.v_sb + hkv * p.v_sh;
  const __m512 scale = _mm512_set1_ps(p.scale), ninf = _mm512_set1_ps(neg_inf);

  for (int64_t t0 = key_begin; t0 < key_end; t0 += Tk) {
    const int64_t tl = std::min(Tk, key_end - t0);
    const int64_t words = kUseBrgemm<T> ? D / 2 : D;
    pack_kt(reinterpret_cast<const char*>(kb + t0 * p.k_ss), p.k_ss * static_cast<int64_t>(sizeof(T)), tl, words,
            sc.kt.data(), Tk);
    if (kUseBrgemm<T> && t0 + Tk < key_end) {  // bf16: prefetch the next tile's K and V rows into L2
      // (fp32: no measurable change within this machine's noise, so left to the hardware prefetchers)
      const int64_t nl = std::min(Tk, key_end - t0 - Tk);
      for (int64_t j = 0; j < nl; ++j) {
        const char* kr = reinterpret_cast<const char*>(kb + (t0 + Tk + j) * p.k_ss);
        const char* vr = reinterpret_cast<const char*>(vb + (t0 + Tk + j) * p.v_ss);
        for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64) {
          _mm_prefetch(kr + off, _MM_HINT_T1);
          _mm_prefetch(vr + off, _MM_HINT_T1);
        }
      }
    }
    int64_t pv_k = tl;
    if constexpr (kUseBrgemm<T>) {  // V to VNNI pairs [ceil(tl / 2)][D][2], odd tail padded with zeros
      pv_k = (tl + 1) / 2 * 2;
      for (int64_t j2 = 0; j2 < pv_k / 2; ++j2) {
        const T* a = vb + (t0 + 2 * j2) * p.v_ss;
        const T* c = vb + (t0 + 2 * j2 + 1) * p.v_ss;
        const bool has_c = 2 * j2 + 1 < tl;
        for (int64_t d = 0; d < D; d += 16) {
          const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
          const __m512i hi = has_c ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + d)))
                                   : _mm512_setzero_si512();
          _mm512_storeu_si512(&sc.vp[j2 * D + d], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
      }
    }
    // Visible columns of this tile per tree node (bit j = key t0 + j).
    for (int64_t w = 0; w < Tw; ++w) {
      const int64_t n = std::clamp<int64_t>(tl - 64 * w, 0, 64);
      sc.valid[w] = n == 64 ? ~uint64_t{0} : ((uint64_t{1} << n) - 1);
    }
    const bool tail = t0 + tl > span.tree_start;
    if (tail) {
      for (int64_t i = 0; i < N; ++i) {
        const int64_t* mask_row = p.tree_mask + (b * N + i) * p.mask_words;
        uint64_t* bits = &sc.vis[i * Tw];
        for (int64_t w = 0; w < Tw; ++w) bits[w] = 0;
        for (int64_t j = 0; j < tl; ++j)
          if (taps::attention::key_visible(span, mask_row, t0 + j)) bits[j / 64] |= uint64_t{1} << (j % 64);
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += rb_max) {
      const int64_t rb = std::min(rb_max, rows - r0);
      float* S = sc.s.data();
      if constexpr (kUseBrgemm<T>) {
#if defined(TAPS_ATTN_BRGEMM)
        at::native::cpublas::brgemm(rb, Tk, D, D, Tk, Tk, false, &sc.qh[r0 * D],
                                    reinterpret_cast<const c10::BFloat16*>(sc.kt.data()), S, true);
#endif
      } else {
        gemm_f32(rb, Tk, D, &sc.qf[r0 * D], D, reinterpret_cast<const float*>(sc.kt.data()), Tk, S, Tk, false);
      }
      for (int64_t rr = 0; rr < rb; ++rr) {
        const int64_t r = r0 + rr;
        float* s = S + rr * Tk;
        const uint64_t* vis = tail ? &sc.vis[(r % N) * Tw] : sc.valid.data();
        __m512 mx = ninf;
        for (int c = 0; c < Tk / 16; ++c) {  // scale, mask, max
          const __mmask16 k = static_cast<__mmask16>(vis[c / 4] >> (16 * (c % 4)));
          const __m512 x = _mm512_mask_mul_ps(ninf, k, _mm512_loadu_ps(s + 16 * c), scale);
          _mm512_storeu_ps(s + 16 * c, x);
          mx = _mm512_max_ps(mx, x);
        }
        const float old_max = sc.row_max[r];
        const float new_max = std::max(old_max, _mm512_reduce_max_ps(mx));
        if (new_max == neg_inf) {  // nothing visible yet: p = 0, the state stays empty
          for (int c = 0; c < Tk / 16; ++c) {
            if constexpr (kUseBrgemm<T>) store_bf16(&sc.ph[rr * Tk + 16 * c], _mm512_setzero_ps());
            else _mm512_storeu_ps(s + 16 * c, _mm512_setzero_ps());
          }
        } else {
          if (old_max != new_max && old_max != neg_inf) {
            const float alpha = std::exp(old_max - new_max);
            const __m512 al = _mm512_set1_ps(alpha);
            float* a = &sc.acc[r * D];
            for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), al));
            sc.row_sum[r] *= alpha;
          }
          sc.row_max[r] = new_max;
          const __m512 nm = _mm512_set1_ps(new_max);
          __m512 sum = _mm512_setzero_ps();
          for (int c = 0; c < Tk / 16; ++c) {  // p = exp(x - max), row sum
            const __m512 e = Vec(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * c), nm)).exp_u20();
            sum = _mm512_add_ps(sum, e);
            if constexpr (kUseBrgemm<T>) store_bf16(&sc.ph[rr * Tk + 16 * c], e);
            else _mm512_storeu_ps(s + 16 * c, e);
          }
          sc.row_sum[r] += _mm512_reduce_add_ps(sum);
        }
      }
      if constexpr (kUseBrgemm<T>) {
#if defined(TAPS_ATTN_BRGEMM)
        at::native::cpublas::brgemm(rb, D, pv_k, Tk, D, D, true, sc.ph.data(),
                                    reinterpret_cast<const c10::BFloat16*>(sc.vp.data()), &sc.acc[r0 * D], true);
#endif
      } else {
        gemm_f32(rb, D, pv_k, S, Tk, reinterpret_cast<const float*>(vb + t0 * p.v_ss), p.v_ss, &sc.acc[r0 * D], D,
                 true);
      }
    }
  }
}

template <class T>
void attend_items_fast(const Problem<T>& p, int64_t begin, int64_t end) {
  FastScratch sc;
  const int64_t rows = p.group * p.num_nodes, D = p.head_dim;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t split = item % p.splits, bh = item / p.splits;
    const int64_t b = bh / p.heads_kv, hkv = bh % p.heads_kv;
    const taps::attention::TreeSpan span = taps::attention::tree_span(p.kv_lens[b], p.num_nodes, p.cache_len);
    const int64_t split_keys = taps::ceil_div(taps::ceil_div(span.len, p.splits), kFastTile<T>) * kFastTile<T>;
    const int64_t key_begin = std::min(span.len, split * split_keys);
    const int64_t key_end = std::min(span.len, key_begin + split_keys);
    attend_fast(p, b, hkv, key_begin, key_end, span, sc);
    if (p.splits == 1) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = hkv * p.group + r / p.num_nodes, i = r % p.num_nodes;
        T* o = p.out + ((b * p.heads_q + h) * p.num_nodes + i) * D;
        const float inv = sc.row_sum[r] > 0.0f ? 1.0f / sc.row_sum[r] : 0.0f;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(sc.acc[r * D + d] * inv);
      }
    } else {
      const int64_t base = (split * p.batch + b) * p.heads_kv + hkv;  // [splits, B, Hkv]
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(p.part + (base * rows + r) * D, &sc.acc[r * D], sizeof(float) * D);
        p.part_max[base * rows + r] = sc.row_max[r];
        p.part_sum[base * rows + r] = sc.row_sum[r];
      }
    }
  }
#if defined(TAPS_ATTN_BRGEMM)
  if constexpr (kUseBrgemm<T>) at::native::cpublas::brgemm_release(true);
#endif
}

}  // namespace fast
}  // namespace taps_attn::avx512
#pragma GCC pop_options

namespace taps_attn::generic {
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
#define TAPS_ATTN_KERNEL_BODY
#include __FILE__
#undef TAPS_ATTN_KERNEL_BODY
}  // namespace taps_attn::generic

#else  // one build with the default Vectorized<float> (NEON on aarch64)
#include <ATen/cpu/vec/vec.h>
namespace taps_attn::generic {
using Vec = at::vec::Vectorized<float>;
#define TAPS_ATTN_KERNEL_BODY
#include __FILE__
#undef TAPS_ATTN_KERNEL_BODY
}  // namespace taps_attn::generic
#endif

namespace taps_attn {
namespace {

bool use_avx512() {
#if defined(TAPS_ATTN_X86_AVX512)
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("fma") && at::get_cpu_capability() == "AVX512";
  return ok;
#else
  return false;
#endif
}

// The GEMM-shaped fast path: AVX-512 hosts, D a multiple of 16; fp32 always, bf16 where oneDNN's
// brgemm ukernel runs on AMX (could_pack). Everything else takes the body's kernel.
template <class T>
bool use_fast(const Problem<T>& p) {
#if defined(TAPS_ATTN_X86_AVX512)
  if (!use_avx512() || p.head_dim % 16 != 0) return false;
  if constexpr (std::is_same_v<T, float>) {
    return true;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(TAPS_ATTN_BRGEMM)
    static const bool amx = at::native::cpublas::could_pack(at::kBFloat16);
    return amx;
#endif
  }
#endif
  return false;
}

template <class T>
void run(const Problem<T>& p) {
  const int64_t items = p.batch * p.heads_kv * p.splits;
  [[maybe_unused]] const bool fast = use_fast(p);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
#if defined(TAPS_ATTN_X86_AVX512)
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
      if (fast) return avx512::fast::attend_items_fast(p, begin, end);
    }
    if (use_avx512()) return avx512::attend_items(p, begin, end);
#endif
    generic::attend_items(p, begin, end);
  });
  if (p.splits == 1) return;
  const int64_t rows = p.batch * p.heads_kv * p.group * p.num_nodes;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
#if defined(TAPS_ATTN_X86_AVX512)
    if (use_avx512()) return avx512::combine_rows(p, begin, end);
#endif
    generic::combine_rows(p, begin, end);
  });
}

at::Tensor tree_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                              const at::Tensor& tree_mask_in, const at::Tensor& kv_lens_in, double scale,
                              bool /*validate: the CPU always checks kv_lens (no sync to save)*/) {
  taps::check_tree_attention_inputs(q_in, k_in, v_in, tree_mask_in, kv_lens_in, scale);
  const int64_t batch = q_in.size(0), heads_q = q_in.size(1), num_nodes = q_in.size(2), head_dim = q_in.size(3);
  const int64_t heads_kv = k_in.size(1), cache_len = k_in.size(2);

  const at::Tensor kv_lens = kv_lens_in.contiguous();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= num_nodes && lens[b] <= cache_len, "taps_ops: tree_attention: kv_lens[", b, "] = ",
                lens[b], " must be in [N, S] = [", num_nodes, ", ", cache_len, "]");
  }
  auto feature_contiguous = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const at::Tensor q = feature_contiguous(q_in), k = feature_contiguous(k_in), v = feature_contiguous(v_in);
  const at::Tensor tree_mask = tree_mask_in.contiguous();
  at::Tensor out = at::empty({batch, heads_q, num_nodes, head_dim}, q.options());
  if (out.numel() == 0) return out;

  const int64_t group = heads_q / heads_kv, rows = group * num_nodes;
  // Key splits: only when B * Hkv work items cannot feed the threads; at least 256 keys per split.
  const int64_t threads = at::get_num_threads(), base = batch * heads_kv;
  int64_t splits = 1;
  if (base < 4 * threads) {
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; ++b) max_len = std::max(max_len, lens[b]);
    splits = std::max<int64_t>(1, std::min(taps::ceil_div(4 * threads, base), max_len / 256));
  }
  at::Tensor part, part_max, part_sum;
  if (splits > 1) {
    auto f32 = q.options().dtype(at::kFloat);
    part = at::empty({splits, batch, heads_kv, rows, head_dim}, f32);
    part_max = at::empty({splits, batch, heads_kv, rows}, f32);
    part_sum = at::empty({splits, batch, heads_kv, rows}, f32);
  }

  auto launch = [&](auto tag) {
    using scalar_t = decltype(tag);
    Problem<scalar_t> p{};
    p.q = q.data_ptr<scalar_t>();
    p.k = k.data_ptr<scalar_t>();
    p.v = v.data_ptr<scalar_t>();
    p.tree_mask = tree_mask.data_ptr<int64_t>();
    p.kv_lens = lens;
    p.out = out.data_ptr<scalar_t>();
    p.part = splits > 1 ? part.data_ptr<float>() : nullptr;
    p.part_max = splits > 1 ? part_max.data_ptr<float>() : nullptr;
    p.part_sum = splits > 1 ? part_sum.data_ptr<float>() : nullptr;
    p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_sn = q.stride(2);
    p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_ss = k.stride(2);
    p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_ss = v.stride(2);
    p.batch = batch, p.heads_q = heads_q, p.heads_kv = heads_kv, p.group = group, p.num_nodes = num_nodes;
    p.head_dim = head_dim, p.cache_len = cache_len, p.mask_words = tree_mask.size(2), p.splits = splits;
    p.scale = static_cast<float>(scale);
    run(p);
  };
  switch (q.scalar_type()) {
    case at::kFloat: launch(float{}); break;
    case at::kBFloat16: launch(c10::BFloat16{}); break;
    default: launch(c10::Half{}); break;
  }
  return out;
}

}  // namespace
}  // namespace taps_attn

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("tree_attention", &taps_attn::tree_attention_cpu); }

#else  // TAPS_ATTN_KERNEL_BODY ------------------------------------------------------------------------
// Kernel body, compiled once per instruction set inside namespace taps_attn::<isa> with `Vec` defined.

constexpr int kVL = Vec::size();
constexpr int64_t kTile = 32;                 // keys per tile
constexpr int kTileVecs = static_cast<int>(kTile) / kVL;
constexpr int kQkRows = kTileVecs <= 2 ? 8 : 2;  // register block of the q * K^T micro-kernel
constexpr int kPvRows = 4, kPvVecs = 4;          // register block of the P * V micro-kernel
static_assert(kTile % kVL == 0, "tile must be a whole number of vectors");

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(c10::Half x) { return static_cast<float>(x); }

// s[r][t] = sum_d q[r][d] * kt[d][t] for ROWS rows (q row stride dp), all kTile columns.
template <int ROWS>
inline void qk_block(const float* q, int64_t dp, const float* kt, int64_t d_len, float* s) {
  Vec acc[ROWS][kTileVecs];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < kTileVecs; ++c) acc[r][c] = Vec(0.0f);
  for (int64_t d = 0; d < d_len; ++d) {
    Vec kv[kTileVecs];
    for (int c = 0; c < kTileVecs; ++c) kv[c] = Vec::loadu(kt + d * kTile + c * kVL);
    for (int r = 0; r < ROWS; ++r) {
      const Vec qb(q[r * dp + d]);
      for (int c = 0; c < kTileVecs; ++c) acc[r][c] = fmadd(qb, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < kTileVecs; ++c) acc[r][c].store(s + r * kTile + c * kVL);
}

// acc[r][0 .. VECS * kVL) = acc[r] * alpha[r] + sum_{j < tile_len} p[r][j] * vt[j][...] for ROWS rows.
template <int ROWS, int VECS>
inline void pv_block(float* acc, int64_t dp, const float* alpha, const float* p, const float* vt,
                     int64_t tile_len) {
  Vec a[ROWS][VECS];
  for (int r = 0; r < ROWS; ++r) {
    const Vec al(alpha[r]);
    for (int c = 0; c < VECS; ++c) a[r][c] = Vec::loadu(acc + r * dp + c * kVL) * al;
  }
  for (int64_t j = 0; j < tile_len; ++j) {
    Vec vv[VECS];
    for (int c = 0; c < VECS; ++c) vv[c] = Vec::loadu(vt + j * dp + c * kVL);
    for (int r = 0; r < ROWS; ++r) {
      const Vec pb(p[r * kTile + j]);
      for (int c = 0; c < VECS; ++c) a[r][c] = fmadd(pb, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < VECS; ++c) a[r][c].store(acc + r * dp + c * kVL);
}

template <int ROWS>
inline void pv_rows(float* acc, int64_t dp, const float* alpha, const float* p, const float* vt, int64_t tile_len) {
  int64_t c = 0;
  for (; c + kPvVecs * kVL <= dp; c += kPvVecs * kVL) pv_block<ROWS, kPvVecs>(acc + c, dp, alpha, p, vt + c, tile_len);
  for (; c < dp; c += kVL) pv_block<ROWS, 1>(acc + c, dp, alpha, p, vt + c, tile_len);
}

// Per-thread scratch, reused across the work items of one parallel_for chunk.
struct Scratch {
  std::vector<float> q, acc, s, kt, vt, row_max, row_sum, alpha;
};

// One work item: rows of KV head `hkv` of request b over keys [key_begin, key_end). Leaves the
// unnormalised state in sc.acc / sc.row_max / sc.row_sum (rows x dp).
template <class T>
void attend(const Problem<T>& p, int64_t b, int64_t hkv, int64_t key_begin, int64_t key_end,
            const taps::attention::TreeSpan& span, Scratch& sc) {
  const int64_t rows = p.group * p.num_nodes, d_len = p.head_dim;
  const int64_t dp = taps::ceil_div(d_len, kVL) * kVL;
  sc.q.assign(rows * dp, 0.0f);
  sc.acc.assign(rows * dp, 0.0f);
  sc.s.resize(rows * kTile);
  sc.kt.resize(d_len * kTile);
  sc.vt.assign(kTile * dp, 0.0f);
  sc.row_max.assign(rows, -std::numeric_limits<float>::infinity());
  sc.row_sum.assign(rows, 0.0f);
  sc.alpha.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = hkv * p.group + r / p.num_nodes, i = r % p.num_nodes;
    const T* src = p.q + b * p.q_sb + h * p.q_sh + i * p.q_sn;
    for (int64_t d = 0; d < d_len; ++d) sc.q[r * dp + d] = to_f(src[d]) * p.scale;
  }
  const T* kb = p.k + b * p.k_sb + hkv * p.k_sh;
  const T* vb = p.v + b * p.v_sb + hkv * p.v_sh;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  for (int64_t t0 = key_begin; t0 < key_end; t0 += kTile) {
    const int64_t tile_len = std::min(kTile, key_end - t0);
    // Stage the tile: K transposed to [D][kTile] (zero columns past tile_len), V as [kTile][dp].
    for (int64_t j = 0; j < kTile; ++j) {
      if (j < tile_len) {
        const T* kr = kb + (t0 + j) * p.k_ss;
        const T* vr = vb + (t0 + j) * p.v_ss;
        for (int64_t d = 0; d < d_len; ++d) sc.kt[d * kTile + j] = to_f(kr[d]);
        for (int64_t d = 0; d < d_len; ++d) sc.vt[j * dp + d] = to_f(vr[d]);
      } else {
        for (int64_t d = 0; d < d_len; ++d) sc.kt[d * kTile + j] = 0.0f;
      }
    }
    // Scores for every row of the group.
    int64_t r = 0;
    for (; r + kQkRows <= rows; r += kQkRows) qk_block<kQkRows>(&sc.q[r * dp], dp, sc.kt.data(), d_len, &sc.s[r * kTile]);
    for (; r < rows; ++r) qk_block<1>(&sc.q[r * dp], dp, sc.kt.data(), d_len, &sc.s[r * kTile]);
    // Mask (tail tiles and the ragged end only), then the online-softmax update of each row.
    const bool tail = t0 + tile_len > span.tree_start;
    for (r = 0; r < rows; ++r) {
      float* s = &sc.s[r * kTile];
      for (int64_t j = tile_len; j < kTile; ++j) s[j] = neg_inf;
      if (tail) {
        const int64_t* mask_row = p.tree_mask + (b * p.num_nodes + r % p.num_nodes) * p.mask_words;
        for (int64_t j = std::max<int64_t>(0, span.tree_start - t0); j < tile_len; ++j)
          if (!taps::attention::key_visible(span, mask_row, t0 + j)) s[j] = neg_inf;
      }
      Vec m(neg_inf);
      for (int c = 0; c < kTileVecs; ++c) m = maximum(m, Vec::loadu(s + c * kVL));
      alignas(64) float lanes[kVL];
      m.store(lanes);
      float tile_max = neg_inf;
      for (int l = 0; l < kVL; ++l) tile_max = std::max(tile_max, lanes[l]);
      const float new_max = std::max(sc.row_max[r], tile_max);
      if (new_max == neg_inf) {  // nothing visible yet: p = 0, state stays empty
        for (int64_t j = 0; j < kTile; ++j) s[j] = 0.0f;
        sc.alpha[r] = 1.0f;
        continue;
      }
      sc.alpha[r] = taps::attention::softmax_rescale(sc.row_max[r], new_max);
      sc.row_max[r] = new_max;
      const Vec nm(new_max);
      Vec sum(0.0f);
      for (int c = 0; c < kTileVecs; ++c) {
        const Vec e = (Vec::loadu(s + c * kVL) - nm).exp_u20();
        e.store(s + c * kVL);
        sum = sum + e;
      }
      sum.store(lanes);
      float tile_sum = 0.0f;
      for (int l = 0; l < kVL; ++l) tile_sum += lanes[l];
      sc.row_sum[r] = sc.row_sum[r] * sc.alpha[r] + tile_sum;
    }
    // acc = acc * alpha + P * V
    r = 0;
    for (; r + kPvRows <= rows; r += kPvRows)
      pv_rows<kPvRows>(&sc.acc[r * dp], dp, &sc.alpha[r], &sc.s[r * kTile], sc.vt.data(), tile_len);
    for (; r < rows; ++r) pv_rows<1>(&sc.acc[r * dp], dp, &sc.alpha[r], &sc.s[r * kTile], sc.vt.data(), tile_len);
  }
}

// Work items [begin, end) of (b, hkv, split), split fastest.
template <class T>
void attend_items(const Problem<T>& p, int64_t begin, int64_t end) {
  Scratch sc;
  const int64_t rows = p.group * p.num_nodes, d_len = p.head_dim;
  const int64_t dp = taps::ceil_div(d_len, kVL) * kVL;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t split = item % p.splits, bh = item / p.splits;
    const int64_t b = bh / p.heads_kv, hkv = bh % p.heads_kv;
    const taps::attention::TreeSpan span = taps::attention::tree_span(p.kv_lens[b], p.num_nodes, p.cache_len);
    const int64_t split_keys = taps::ceil_div(taps::ceil_div(span.len, p.splits), kTile) * kTile;
    const int64_t key_begin = std::min(span.len, split * split_keys);
    const int64_t key_end = std::min(span.len, key_begin + split_keys);
    attend(p, b, hkv, key_begin, key_end, span, sc);
    if (p.splits == 1) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = hkv * p.group + r / p.num_nodes, i = r % p.num_nodes;
        T* o = p.out + ((b * p.heads_q + h) * p.num_nodes + i) * d_len;
        const float inv = sc.row_sum[r] > 0.0f ? 1.0f / sc.row_sum[r] : 0.0f;
        for (int64_t d = 0; d < d_len; ++d) o[d] = static_cast<T>(sc.acc[r * dp + d] * inv);
      }
    } else {
      const int64_t base = (split * p.batch + b) * p.heads_kv + hkv;  // [splits, B, Hkv]
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(p.part + (base * rows + r) * d_len, &sc.acc[r * dp], sizeof(float) * d_len);
        p.part_max[base * rows + r] = sc.row_max[r];
        p.part_sum[base * rows + r] = sc.row_sum[r];
      }
    }
  }
}

// Log-sum-exp combine of the split states; rows [begin, end) of [B, Hkv, R].
template <class T>
void combine_rows(const Problem<T>& p, int64_t begin, int64_t end) {
  const int64_t rows = p.group * p.num_nodes, d_len = p.head_dim;
  const int64_t stride = p.batch * p.heads_kv * rows;  // between splits
  std::vector<float> weight(p.splits), acc(d_len);
  for (int64_t row = begin; row < end; ++row) {
    taps::attention::lse_combine_weights(p.part_max + row, p.part_sum + row, p.splits, stride, weight.data());
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t s = 0; s < p.splits; ++s) {
      const float* src = p.part + (s * stride + row) * d_len;
      for (int64_t d = 0; d < d_len; ++d) acc[d] += weight[s] * src[d];
    }
    const int64_t bh = row / rows, r = row % rows;
    const int64_t b = bh / p.heads_kv, hkv = bh % p.heads_kv;
    const int64_t h = hkv * p.group + r / p.num_nodes, i = r % p.num_nodes;
    T* o = p.out + ((b * p.heads_q + h) * p.num_nodes + i) * d_len;
    for (int64_t d = 0; d < d_len; ++d) o[d] = static_cast<T>(acc[d]);
  }
}

#endif  // TAPS_ATTN_KERNEL_BODY
