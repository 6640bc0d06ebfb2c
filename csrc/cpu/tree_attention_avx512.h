// tree_attention, CPU: the GEMM-shaped path of AVX-512 hosts, compiled inside the AVX-512 target region
// of csrc/cpu/tree_attention.cpp, in namespace taps::attention::cpu::avx512 after the Vec kernel
// (cpu/tree_attention_vec.h), whose work-item loop (run_items) it shares; included once, with no
// includes of its own.
// Same work items and online softmax as that kernel, restructured so that both tile products are
// plain row-major GEMMs C[M][N] (+)= A[M][K] * B[K][N]:
//   S[rows][tile] = Q[rows][D] * Kt[D][tile]        (K tile transposed once per tile, 16x16 blocks)
//   acc[rows][D] += P[rows][tile] * V[tile][D]      (acc rows rescaled only when their max grew)
// fp32: a register-blocked AVX-512 micro-GEMM (6 rows x 64 columns, 24 accumulators; V read in place).
// bf16 by default: the same fp32 micro-GEMMs, q, K and V widened to fp32 as they are read (exact), so
// the arithmetic is the fp32 path's (P stays fp32, as in the Vec kernel).
// bf16 on hosts with AMX (at::native::cpublas::could_pack), opt-in (TAPS_ATTN_BF16_AMX=1, see use_fast in
// tree_attention.cpp): at::native::cpublas::brgemm (oneDNN
// ukernel) with K^T and V packed to VNNI pairs; P is rounded to bf16 for P * V like PyTorch's CPU flash
// attention, everything else accumulates in fp32. Scores are scaled in fp32 (q is not pre-rounded).
namespace fast {

// Keys per tile and query rows per block (S block rows x tile fp32 = 64 KiB), by whether the products run
// on oneDNN's brgemm (bf16 on AMX, opt-in). fp32 micro-GEMMs: K^T and V tiles of 32 KiB stay in L1/L2 for
// all rows. brgemm: long tiles keep the AMX P * V product efficient (K = 256).
constexpr int64_t fast_tile(bool brgemm) { return brgemm ? 256 : 64; }
constexpr int64_t fast_rows(bool brgemm) { return brgemm ? 64 : 256; }

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

// dst[j][0 .. D) = the bf16 rows src[j * stride ..] widened to fp32 (exact), j < rows; D % 16 == 0.
inline void widen_rows(const c10::BFloat16* src, int64_t stride, int64_t rows, int64_t D, float* dst) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j * stride + d));
      _mm512_storeu_si512(dst + j * D + d, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
}

struct FastScratch {
  std::vector<float> s, acc, row_max, row_sum, qf, kf, vf;
  std::vector<uint32_t> kt, vp;
  std::vector<c10::BFloat16> qh, ph;
  std::vector<uint64_t> vis, valid;
};

// One work item (b, hkv, keys [key_begin, key_end)); leaves the unnormalised state in sc. B: the products
// on oneDNN's brgemm (bf16 only), else the fp32 micro-GEMMs (bf16 inputs widened).
template <class T, bool B>
void attend_fast(const Params& p, int64_t b, int64_t hkv, int64_t key_begin, int64_t key_end, const TreeSpan& span,
                 FastScratch& sc) {
  const int64_t group = p.heads_q / p.heads_kv, rows = group * p.num_nodes, D = p.head_dim, N = p.num_nodes;
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>, "fp32 or bf16");
  static_assert(!B || std::is_same_v<T, c10::BFloat16>, "brgemm: bf16 only");
  constexpr bool kWiden = !B && !std::is_same_v<T, float>;  // bf16 through the fp32 micro-GEMMs
  constexpr int64_t Tk = fast_tile(B), Tw = Tk / 64;  // Tw mask words per tile
  const int64_t rb_max = std::min(rows, fast_rows(B));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  sc.acc.assign(rows * D, 0.0f);
  sc.row_max.assign(rows, neg_inf);
  sc.row_sum.assign(rows, 0.0f);
  sc.s.resize(rb_max * Tk);
  sc.kt.resize(D * Tk);  // fp32: D words x Tk; bf16: D / 2 words x Tk
  sc.vis.resize(N * Tw);
  sc.valid.resize(Tw);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = hkv * group + r / N, i = r % N;
    const T* src = static_cast<const T*>(p.q) + b * p.q_stride_b + h * p.q_stride_h + i * p.q_stride_n;
    if constexpr (B) {
      sc.qh.resize(rows * D);
      std::memcpy(&sc.qh[r * D], src, sizeof(T) * D);
    } else if constexpr (kWiden) {
      sc.qf.resize(rows * D);
      widen_rows(src, 0, 1, D, &sc.qf[r * D]);
    } else {
      sc.qf.resize(rows * D);
      std::memcpy(&sc.qf[r * D], src, sizeof(T) * D);
    }
  }
  if constexpr (kWiden) {
    sc.kf.resize(Tk * D);
    sc.vf.resize(Tk * D);
  }
  if constexpr (B) {
    sc.vp.resize(Tk / 2 * D);
    sc.ph.resize(rb_max * Tk);
  }
  const T* kb = static_cast<const T*>(p.k) + b * p.k_stride_b + hkv * p.k_stride_h;
  const T* vb = static_cast<const T*>(p.v) + b * p.v_stride_b + hkv * p.v_stride_h;
  const __m512 scale = _mm512_set1_ps(p.scale), ninf = _mm512_set1_ps(neg_inf);

  for (int64_t t0 = key_begin; t0 < key_end; t0 += Tk) {
    const int64_t tl = std::min(Tk, key_end - t0);
    const int64_t words = B ? D / 2 : D;
    const float* v_rows = nullptr;  // fp32 micro-GEMMs: the tile's V rows, v_ld apart
    int64_t v_ld = p.v_stride_s;
    if constexpr (kWiden) {
      widen_rows(kb + t0 * p.k_stride_s, p.k_stride_s, tl, D, sc.kf.data());
      pack_kt(reinterpret_cast<const char*>(sc.kf.data()), D * static_cast<int64_t>(sizeof(float)), tl, words,
              sc.kt.data(), Tk);
      widen_rows(vb + t0 * p.v_stride_s, p.v_stride_s, tl, D, sc.vf.data());
      v_rows = sc.vf.data();
      v_ld = D;
    } else {
      pack_kt(reinterpret_cast<const char*>(kb + t0 * p.k_stride_s), p.k_stride_s * static_cast<int64_t>(sizeof(T)), tl,
              words, sc.kt.data(), Tk);
      if constexpr (!B) v_rows = reinterpret_cast<const float*>(vb + t0 * p.v_stride_s);
    }
    if (B && t0 + Tk < key_end) {  // bf16: prefetch the next tile's K and V rows into L2
      // (fp32: no measurable change within this machine's noise, so left to the hardware prefetchers)
      const int64_t nl = std::min(Tk, key_end - t0 - Tk);
      for (int64_t j = 0; j < nl; ++j) {
        const char* kr = reinterpret_cast<const char*>(kb + (t0 + Tk + j) * p.k_stride_s);
        const char* vr = reinterpret_cast<const char*>(vb + (t0 + Tk + j) * p.v_stride_s);
        for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64) {
          _mm_prefetch(kr + off, _MM_HINT_T1);
          _mm_prefetch(vr + off, _MM_HINT_T1);
        }
      }
    }
    int64_t pv_k = tl;
    if constexpr (B) {  // V to VNNI pairs [ceil(tl / 2)][D][2], odd tail padded with zeros
      pv_k = (tl + 1) / 2 * 2;
      for (int64_t j2 = 0; j2 < pv_k / 2; ++j2) {
        const T* a = vb + (t0 + 2 * j2) * p.v_stride_s;
        const T* c = vb + (t0 + 2 * j2 + 1) * p.v_stride_s;
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
      for (int64_t i = 0; i < N; ++i) {  // 64 keys a word (tile_visibility), past the tile's end cleared
        const int64_t* mask_row = p.tree_mask + (b * N + i) * p.mask_words;
        uint64_t* bits = &sc.vis[i * Tw];
        for (int64_t w = 0; w < Tw; ++w)
          bits[w] = sc.valid[w] != 0 ? tile_visibility(span, mask_row, p.mask_words, t0 + 64 * w) & sc.valid[w] : 0;
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += rb_max) {
      const int64_t rb = std::min(rb_max, rows - r0);
      float* S = sc.s.data();
      if constexpr (B) {
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
            if constexpr (B) store_bf16(&sc.ph[rr * Tk + 16 * c], _mm512_setzero_ps());
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
            if constexpr (B) store_bf16(&sc.ph[rr * Tk + 16 * c], e);
            else _mm512_storeu_ps(s + 16 * c, e);
          }
          sc.row_sum[r] += _mm512_reduce_add_ps(sum);
        }
      }
      if constexpr (B) {
#if defined(TAPS_ATTN_BRGEMM)
        at::native::cpublas::brgemm(rb, D, pv_k, Tk, D, D, true, sc.ph.data(),
                                    reinterpret_cast<const c10::BFloat16*>(sc.vp.data()), &sc.acc[r0 * D], true);
#endif
      } else {
        gemm_f32(rb, D, pv_k, S, Tk, v_rows, v_ld, &sc.acc[r0 * D], D, true);
      }
    }
  }
}

template <class T, bool B>
void attend_items_fast(const Params& p, int64_t begin, int64_t end) {
  FastScratch sc;
  run_items<T>(p, begin, end, fast_tile(B), [&](int64_t b, int64_t hkv, KeyRange keys, const TreeSpan& span) {
    attend_fast<T, B>(p, b, hkv, keys.begin, keys.end, span, sc);
    return RowStates{sc.acc.data(), p.head_dim, sc.row_max.data(), sc.row_sum.data()};
  });
#if defined(TAPS_ATTN_BRGEMM)
  if constexpr (B) at::native::cpublas::brgemm_release(true);
#endif
}

}  // namespace fast
