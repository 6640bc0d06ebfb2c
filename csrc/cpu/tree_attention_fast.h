// tree_attention, CPU: the GEMM-shaped fast path, written once over a vector traits type `S` and compiled
// once per instruction set inside its target region of csrc/cpu/tree_attention.cpp (namespaces
// taps::attention::cpu::avx512, ::avx2 and, for the x86-64 baseline, ::generic, after the Vec kernel,
// cpu/tree_attention_vec.h, whose work-item loop, run_items, it shares); included once per region, with no
// includes of its own.
// S: F (a float vector of S::L lanes), I (the integer vector of the same width), load/store/set1/zero,
// add/sub/mul/max/fmadd, masked_scale(x, bits, scale, ninf) (x * scale where bit l of `bits` is set, ninf
// elsewhere), reduce_max/reduce_add, exp (of non-positive arguments), widen (L bf16 / fp16 values -> fp32,
// exact), store_bf16, transpose (S::L x S::L 32-bit words in place), vnni_pair, kMaxNV (vectors per
// micro-kernel row).
// Same work items and online softmax as the Vec kernel, restructured so that both tile products are
// plain row-major GEMMs C[M][N] (+)= A[M][K] * B[K][N]:
//   S[rows][tile] = Q[rows][D] * Kt[D][tile]        (K tile transposed once per tile, L x L blocks)
//   acc[rows][D] += P[rows][tile] * V[tile][D]      (acc rows rescaled only when their max grew)
// fp32: a register-blocked micro-GEMM (6 rows x kMaxNV vectors: AVX-512 6 x 64 with 24 accumulators,
// AVX2 6 x 16 with 12; V read in place). bf16 / fp16: the same fp32 micro-GEMMs, q, K and V widened to
// fp32 as they are read (exact), so the arithmetic is the fp32 path's (P stays fp32, as in the Vec kernel).
// bf16 on hosts with AMX (at::native::cpublas::could_pack), opt-in (TAPS_ATTN_BF16_AMX=1, see fast_mode in
// tree_attention.cpp; AVX-512 region only): at::native::cpublas::brgemm (oneDNN ukernel) with K^T and V
// packed to VNNI pairs; P is rounded to bf16 for P * V like PyTorch's CPU flash attention, everything else
// accumulates in fp32. Scores are scaled in fp32 (q is not pre-rounded).
namespace fast {

using F = S::F;
constexpr int L = S::L;

// Keys per tile and query rows per block (S block rows x tile fp32 = 64 KiB), by whether the products run
// on oneDNN's brgemm (bf16 on AMX, opt-in). fp32 micro-GEMMs: K^T and V tiles of 32 KiB stay in L1/L2 for
// all rows. brgemm: long tiles keep the AMX P * V product efficient (K = 256).
constexpr int64_t fast_tile(bool brgemm) { return brgemm ? 256 : 64; }
constexpr int64_t fast_rows(bool brgemm) { return brgemm ? 64 : 256; }

// C[MR x L NV] (+)= A[MR x K] * B[K x L NV]
template <int MR, int NV>
inline void micro_gemm(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                       bool add) {
  F c[MR][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[m][v] = add ? S::load(C + m * ldc + L * v) : S::zero();
  for (int64_t k = 0; k < K; ++k) {
    F b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = S::load(B + k * ldb + L * v);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const F a = S::set1(A[m * lda + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[m][v] = S::fmadd(a, b[v], c[m][v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) S::store(C + m * ldc + L * v, c[m][v]);
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

// C[M][N] (+)= A[M][K] * B[K][N], fp32, N a multiple of L.
inline void gemm_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                     float* C, int64_t ldc, bool add) {
  constexpr int kNV = S::kMaxNV;
  int64_t n = 0;
  for (; n + kNV * L <= N; n += kNV * L) gemm_cols<kNV>(M, K, A, lda, B + n, ldb, C + n, ldc, add);
  switch ((N - n) / L) {
    case 3: if constexpr (kNV > 3) gemm_cols<3>(M, K, A, lda, B + n, ldb, C + n, ldc, add); break;
    case 2: if constexpr (kNV > 2) gemm_cols<2>(M, K, A, lda, B + n, ldb, C + n, ldc, add); break;
    case 1: gemm_cols<1>(M, K, A, lda, B + n, ldb, C + n, ldc, add); break;
    default: break;
  }
}

// dst[w][j] = word w of key row j (j < tl), 0 for tl <= j < tile; `words` 32-bit words per row.
// fp32: K^T. bf16 (brgemm): the VNNI layout of K^T (word w = features 2w, 2w + 1).
inline void pack_kt(const char* src, int64_t row_bytes, int64_t tl, int64_t words, uint32_t* dst, int64_t tile) {
  for (int64_t j0 = 0; j0 < tile; j0 += L) {
    int64_t w0 = 0;
    if (j0 + L <= tl) {
      for (; w0 + L <= words; w0 += L) {
        typename S::I r[L];
        for (int i = 0; i < L; ++i) r[i] = S::loadi(src + (j0 + i) * row_bytes + 4 * w0);
        S::transpose(r);
        for (int c = 0; c < L; ++c) S::storei(dst + (w0 + c) * tile + j0, r[c]);
      }
    }
    for (int64_t w = w0; w < words; ++w)
      for (int64_t j = j0; j < j0 + L; ++j) {
        uint32_t x = 0;
        if (j < tl) std::memcpy(&x, src + j * row_bytes + 4 * w, 4);
        dst[w * tile + j] = x;
      }
  }
}

// dst[j][0 .. D) = the half-precision rows src[j * stride ..] widened to fp32 (exact), j < rows; D % L == 0.
template <class T>
inline void widen_rows(const T* src, int64_t stride, int64_t rows, int64_t D, float* dst) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t d = 0; d < D; d += L) S::store(dst + j * D + d, S::widen(src + j * stride + d));
}

struct FastScratch {
  std::vector<float> s, acc, row_max, row_sum, qf, kf, vf;
  std::vector<uint32_t> kt, vp;
  std::vector<c10::BFloat16> qh, ph;
  std::vector<uint64_t> vis, valid;
};

// One work item (b, hkv, keys [key_begin, key_end)); leaves the unnormalised state in sc. B: the products
// on oneDNN's brgemm (bf16 only), else the fp32 micro-GEMMs (bf16 / fp16 inputs widened).
template <class T, bool B>
void attend_fast(const Params& p, int64_t b, int64_t hkv, int64_t key_begin, int64_t key_end, const TreeSpan& span,
                 FastScratch& sc) {
  const int64_t group = p.heads_q / p.heads_kv, rows = group * p.num_nodes, D = p.head_dim, N = p.num_nodes;
  static_assert(!B || std::is_same_v<T, c10::BFloat16>, "brgemm: bf16 only");
  constexpr bool kWiden = !B && !std::is_same_v<T, float>;  // half precision through the fp32 micro-GEMMs
  constexpr int64_t Tk = fast_tile(B), Tw = Tk / 64;  // Tw mask words per tile
  constexpr uint64_t kLaneBits = (uint64_t{1} << L) - 1;
  const int64_t rb_max = std::min(rows, fast_rows(B));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  sc.acc.assign(rows * D, 0.0f);
  sc.row_max.assign(rows, neg_inf);
  sc.row_sum.assign(rows, 0.0f);
  sc.s.resize(rb_max * Tk);
  sc.kt.resize(D * Tk);  // fp32: D words x Tk; bf16 brgemm: D / 2 words x Tk
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
  const F scale = S::set1(p.scale), ninf = S::set1(neg_inf);

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
    if (B && t0 + Tk < key_end) {  // bf16 brgemm: prefetch the next tile's K and V rows into L2
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
        const T* c = 2 * j2 + 1 < tl ? vb + (t0 + 2 * j2 + 1) * p.v_stride_s : nullptr;
        for (int64_t d = 0; d < D; d += L) S::vnni_pair(a + d, c ? c + d : nullptr, &sc.vp[j2 * D + d]);
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
      float* Sc = sc.s.data();
      if constexpr (B) {
#if defined(TAPS_ATTN_BRGEMM)
        at::native::cpublas::brgemm(rb, Tk, D, D, Tk, Tk, false, &sc.qh[r0 * D],
                                    reinterpret_cast<const c10::BFloat16*>(sc.kt.data()), Sc, true);
#endif
      } else {
        gemm_f32(rb, Tk, D, &sc.qf[r0 * D], D, reinterpret_cast<const float*>(sc.kt.data()), Tk, Sc, Tk, false);
      }
      for (int64_t rr = 0; rr < rb; ++rr) {
        const int64_t r = r0 + rr;
        float* s = Sc + rr * Tk;
        const uint64_t* vis = tail ? &sc.vis[(r % N) * Tw] : sc.valid.data();
        F mx = ninf;
        for (int c = 0; c < Tk / L; ++c) {  // scale, mask, max
          const uint32_t bits = static_cast<uint32_t>((vis[(c * L) / 64] >> ((c * L) % 64)) & kLaneBits);
          const F x = S::masked_scale(S::load(s + L * c), bits, scale, ninf);
          S::store(s + L * c, x);
          mx = S::max(mx, x);
        }
        const float old_max = sc.row_max[r];
        const float new_max = std::max(old_max, S::reduce_max(mx));
        if (new_max == neg_inf) {  // nothing visible yet: p = 0, the state stays empty
          for (int c = 0; c < Tk / L; ++c) {
            if constexpr (B) S::store_bf16(&sc.ph[rr * Tk + L * c], S::zero());
            else S::store(s + L * c, S::zero());
          }
        } else {
          if (old_max != new_max && old_max != neg_inf) {
            const float alpha = std::exp(old_max - new_max);
            const F al = S::set1(alpha);
            float* a = &sc.acc[r * D];
            for (int64_t d = 0; d < D; d += L) S::store(a + d, S::mul(S::load(a + d), al));
            sc.row_sum[r] *= alpha;
          }
          sc.row_max[r] = new_max;
          const F nm = S::set1(new_max);
          F sum = S::zero();
          for (int c = 0; c < Tk / L; ++c) {  // p = exp(x - max), row sum
            const F e = S::exp(S::sub(S::load(s + L * c), nm));
            sum = S::add(sum, e);
            if constexpr (B) S::store_bf16(&sc.ph[rr * Tk + L * c], e);
            else S::store(s + L * c, e);
          }
          sc.row_sum[r] += S::reduce_add(sum);
        }
      }
      if constexpr (B) {
#if defined(TAPS_ATTN_BRGEMM)
        at::native::cpublas::brgemm(rb, D, pv_k, Tk, D, D, true, sc.ph.data(),
                                    reinterpret_cast<const c10::BFloat16*>(sc.vp.data()), &sc.acc[r0 * D], true);
#endif
      } else {
        gemm_f32(rb, D, pv_k, Sc, Tk, v_rows, v_ld, &sc.acc[r0 * D], D, true);
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
