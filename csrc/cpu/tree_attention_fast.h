// tree_attention, CPU: the GEMM-shaped fast path, written once over a vector traits type `S` and compiled
// once per instruction set inside its target region of csrc/cpu/tree_attention.cpp (namespaces
// taps::attention::cpu::avx512, ::avx2 and, for the x86-64 baseline, ::generic, after the Vec kernel,
// cpu/tree_attention_vec.h, whose work-item loop, run_items, it shares); included once per region, with no
// includes of its own.
// S: F (a float vector of S::L lanes), I (the integer vector of the same width), load/store/set1/zero,
// add/sub/mul/max/fmadd, round (to the nearest integer), pow2 (2^n for integral n in [-127, 0], 0 at -127),
// masked_scale(x, bits, scale, ninf) (x * scale where bit l of `bits` is set, ninf elsewhere),
// reduce_max/reduce_add, widen (L bf16 / fp16 values -> fp32, exact), as_int/zeroi/loadi/storei,
// store_bf16, transpose (S::L x S::L 32-bit words in place), vnni_pair, kMaxNV (vectors per micro-kernel row).
// Same work items and online softmax as the Vec kernel, restructured so that both tile products are
// plain row-major GEMMs C[M][N] (+)= A[M][K] * B[K][N]:
//   S[rows][tile] = Q[rows][D] * Kt[D][tile]        (K tile transposed as it is read, L x L blocks)
//   acc[rows][D] = acc * alpha + P[rows][tile] * V[tile][D]   (alpha per row: as the product loads acc)
// Scores are kept in base-2 units, p = 2^(s - max) (exp2 below): the fp32 micro-GEMMs take q multiplied by
// scale * log2(e) once per work item, so a tile of prefix keys needs no pass but the row max; only tiles
// that reach the tree nodes or the end of the keys are masked. A tile's score columns stop at the first
// whole vector past its last key. Rows go through both products in micro-kernel row blocks, so that one
// block's softmax work runs beside the next block's products. The next tile's K and V rows are prefetched
// into L2 while one is computed.
// With S::kKeysAsRows (AVX2), a KV head of at most kKeyRowChunk rows goes through attend_keys instead: the
// scores transposed (keys as the micro-kernel's rows, K read in place), no K^T packed per tile.
// fp32: a register-blocked micro-GEMM (6 rows x kMaxNV vectors: AVX-512 6 x 64 with 24 accumulators,
// AVX2 6 x 16 with 12; V read in place). bf16 / fp16: the same fp32 micro-GEMMs, q, K and V widened to
// fp32 as they are read (exact), so the arithmetic is the fp32 path's (P stays fp32, as in the Vec kernel).
// bf16 on hosts with AMX (at::native::cpublas::could_pack), for head dims >= 64 and >= 16 query rows per KV head
// (TAPS_ATTN_BF16_AMX: 1 always, 0 never; amx_wanted in tree_attention.cpp; AVX-512 region only): at::native::cpublas::brgemm (oneDNN ukernel) with K^T and V
// packed to VNNI pairs; P is rounded to bf16 for P * V like PyTorch's CPU flash attention, everything else
// accumulates in fp32. Its scores are scaled (by scale * log2(e)) in fp32 in the softmax pass (q is not
// pre-rounded).
namespace fast {

using F = S::F;
constexpr int L = S::L;

// Keys per tile and query rows per block (S block rows x tile fp32 = 64 KiB), by whether the products run
// on oneDNN's brgemm (bf16 on AMX, opt-in). fp32 micro-GEMMs: K^T and V tiles of 32 KiB stay in L1/L2 for
// all rows. brgemm: long tiles keep the AMX P * V product efficient (K = 256).
constexpr int64_t fast_tile(bool brgemm) { return brgemm ? 256 : 64; }
constexpr int64_t fast_rows(bool brgemm) { return brgemm ? 64 : 256; }

constexpr float kLog2e = 1.442695041f, kLn2 = 0.6931471806f;

// KV heads of at most this many query rows read half-precision V rows in place, widened as the P * V
// micro-kernel loads them (the same sums as over a widened copy), instead of widening each tile to a scratch
// copy first: with few row blocks the copy's stores and reloads cost more than widening per block (measured:
// a decoding step's attention 7-17% faster, bench/RESULTS.md).
constexpr int64_t kVInPlaceRows = 64;

// 2^x for x <= 0: a degree-5 polynomial for 2^r on r = x - round(x) in [-0.5, 0.5] (fitted for relative
// error with p(0) = 1, so 2^0 is exactly 1; at most 1.6e-7 evaluated in fp32 with FMA), times 2^round(x)
// built in the exponent bits. 0 for x <= -127 (and -inf); NaN propagates (max returns its second operand
// when either is NaN).
inline F exp2_nonpos(F x) {
  x = S::max(S::set1(-127.0f), x);
  const F n = S::round(x);
  const F r = S::sub(x, n);
  F p = S::set1(1.326472731e-3f);
  p = S::fmadd(p, r, S::set1(9.671512991e-3f));
  p = S::fmadd(p, r, S::set1(5.550732836e-2f));
  p = S::fmadd(p, r, S::set1(2.402224541e-1f));
  p = S::fmadd(p, r, S::set1(6.931470037e-1f));
  p = S::fmadd(p, r, S::set1(1.0f));
  return S::mul(p, S::pow2(n));
}

// L fp32 values from p: as they are, or half precision widened (exact).
template <class T>
__attribute__((always_inline)) inline F load_wide(const T* p) {
  if constexpr (std::is_same_v<T, float>) return S::load(p);
  else return S::widen(p);
}

// C[MR x L NV] (+)= A[MR x K] * B[K x L NV]; with `add` and c_scale, row m of C is first multiplied by
// c_scale[m]. kAT: A stored transposed (element (m, k) at A[k * lda + m]). B: fp32, or bf16 / fp16 widened
// as it is read (the same products and sums as over a widened copy).
template <int MR, int NV, bool kAT = false, class TB = float>
inline void micro_gemm(int64_t K, const float* A, int64_t lda, const TB* B, int64_t ldb, float* C, int64_t ldc,
                       bool add, const float* c_scale) {
  F c[MR][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const F cs = S::set1(c_scale != nullptr ? c_scale[m] : 1.0f);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      c[m][v] = add ? S::load(C + m * ldc + L * v) : S::zero();
      if (c_scale != nullptr) c[m][v] = S::mul(c[m][v], cs);
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    F b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = load_wide(B + k * ldb + L * v);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const F a = S::set1(kAT ? A[k * lda + m] : A[m * lda + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[m][v] = S::fmadd(a, b[v], c[m][v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) S::store(C + m * ldc + L * v, c[m][v]);
}

// micro_gemm for MR in 1..6.
template <int NV, bool kAT = false, class TB = float>
inline void micro_gemm_rows(int64_t MR, int64_t K, const float* A, int64_t lda, const TB* B, int64_t ldb, float* C,
                            int64_t ldc, bool add, const float* c_scale) {
  switch (MR) {
    case 6: micro_gemm<6, NV, kAT, TB>(K, A, lda, B, ldb, C, ldc, add, c_scale); break;
    case 5: micro_gemm<5, NV, kAT, TB>(K, A, lda, B, ldb, C, ldc, add, c_scale); break;
    case 4: micro_gemm<4, NV, kAT, TB>(K, A, lda, B, ldb, C, ldc, add, c_scale); break;
    case 3: micro_gemm<3, NV, kAT, TB>(K, A, lda, B, ldb, C, ldc, add, c_scale); break;
    case 2: micro_gemm<2, NV, kAT, TB>(K, A, lda, B, ldb, C, ldc, add, c_scale); break;
    case 1: micro_gemm<1, NV, kAT, TB>(K, A, lda, B, ldb, C, ldc, add, c_scale); break;
    default: break;
  }
}

// block(m, rows) for the micro-kernel row blocks of M rows: blocks of 6; a remainder of 1-3 rows after at
// least one block is taken with the last block as two blocks of 3-5 rows (7 = 4 + 3, 8 = 4 + 4,
// 9 = 5 + 4): a block of 1 or 2 rows has too few accumulators to hide the FMA latency.
template <class Block>
__attribute__((always_inline)) inline void row_blocks(int64_t M, Block&& block) {
  const int64_t full = M > 6 && M % 6 != 0 && M % 6 < 4 ? M / 6 - 1 : M / 6;
  int64_t m = 0;
  for (; m < 6 * full; m += 6) block(m, int64_t{6});
  const int64_t rest = M - m;  // 0..5, or 7..9
  if (rest > 6) {
    block(m, (rest + 1) / 2);
    block(m + (rest + 1) / 2, rest / 2);
  } else if (rest > 0) {
    block(m, rest);
  }
}

// The row blocks of one column block of L NV columns; after_block() runs after each (prefetches).
template <int NV, bool kAT, class TB, class AfterBlock>
__attribute__((always_inline)) inline void gemm_cols(int64_t M, int64_t K, const float* A, int64_t lda, const TB* B,
                                                     int64_t ldb, float* C, int64_t ldc, bool add, const float* c_scale,
                                                     AfterBlock& after_block) {
  row_blocks(M, [&](int64_t m, int64_t mr) __attribute__((always_inline)) {
    micro_gemm_rows<NV, kAT, TB>(mr, K, A + (kAT ? m : m * lda), lda, B, ldb, C + m * ldc, ldc, add,
                                 c_scale ? c_scale + m : nullptr);
    after_block();
  });
}

// C[M][N] (+)= A[M][K] * B[K][N], fp32 (B: or bf16 / fp16 widened as read), N a multiple of L; with `add` and
// c_scale, C's rows are first multiplied by c_scale[0 .. M). after_block() after each micro-kernel block. kAT: A
// stored transposed (element (m, k) at A[k * lda + m]).
template <bool kAT = false, class TB = float, class AfterBlock>
__attribute__((always_inline)) inline void gemm_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                                                    const TB* B, int64_t ldb, float* C, int64_t ldc, bool add,
                                                    const float* c_scale, AfterBlock&& after_block) {
  constexpr int kNV = S::kMaxNV;
  int64_t n = 0;
  for (; n + kNV * L <= N; n += kNV * L)
    gemm_cols<kNV, kAT, TB>(M, K, A, lda, B + n, ldb, C + n, ldc, add, c_scale, after_block);
  switch ((N - n) / L) {
    case 3:
      if constexpr (kNV > 3) gemm_cols<3, kAT, TB>(M, K, A, lda, B + n, ldb, C + n, ldc, add, c_scale, after_block);
      break;
    case 2:
      if constexpr (kNV > 2) gemm_cols<2, kAT, TB>(M, K, A, lda, B + n, ldb, C + n, ldc, add, c_scale, after_block);
      break;
    case 1: gemm_cols<1, kAT, TB>(M, K, A, lda, B + n, ldb, C + n, ldc, add, c_scale, after_block); break;
    default: break;
  }
}

// Micro-kernel blocks of gemm_f32(M, N, ...).
inline int64_t gemm_blocks(int64_t M, int64_t N) {
  int64_t row_blocks_of_m = 0;
  row_blocks(M, [&](int64_t, int64_t) { ++row_blocks_of_m; });
  return row_blocks_of_m * ((N / L + S::kMaxNV - 1) / S::kMaxNV);
}

// L 32-bit words of a key row from word w: fp32 rows and bf16 VNNI pairs as they are (kWidenRow false), or
// L bf16 / fp16 features widened to fp32 (kWidenRow true).
template <bool kWidenRow, class T>
inline typename S::I row_words(const T* row, int64_t w) {
  if constexpr (kWidenRow) return S::as_int(S::widen(row + w));
  else return S::loadi(reinterpret_cast<const char*>(row) + 4 * w);
}

// dst[w][j] = word w of key row j (rows `stride` elements apart, j < tl), 0 for tl <= j < cols; `words`
// 32-bit words per row, `tile` words between dst rows. fp32: K^T. bf16 / fp16 (kWidenRow): K^T widened to
// fp32 (words = D, a multiple of L). bf16 (brgemm): the VNNI layout of K^T (word w = features 2w, 2w + 1).
template <bool kWidenRow, class T>
inline void pack_kt(const T* src, int64_t stride, int64_t tl, int64_t words, uint32_t* dst, int64_t tile,
                    int64_t cols) {
  for (int64_t j0 = 0; j0 < cols; j0 += L) {
    const int64_t keys = std::min<int64_t>(L, tl - j0);  // key rows in this block of L columns
    int64_t w0 = 0;
    if (keys > 0) {
      for (; w0 + L <= words; w0 += L) {
        typename S::I r[L];
        if (keys == L) {
          for (int i = 0; i < L; ++i) r[i] = row_words<kWidenRow>(src + (j0 + i) * stride, w0);
        } else {
          for (int i = 0; i < L; ++i) r[i] = i < keys ? row_words<kWidenRow>(src + (j0 + i) * stride, w0) : S::zeroi();
        }
        S::transpose(r);
        for (int c = 0; c < L; ++c) S::storei(dst + (w0 + c) * tile + j0, r[c]);
      }
    }
    if constexpr (!kWidenRow) {  // words % L (brgemm at small D), and blocks past the keys
      for (int64_t w = w0; w < words; ++w)
        for (int64_t j = j0; j < j0 + L; ++j) {
          uint32_t x = 0;
          if (j < tl) std::memcpy(&x, reinterpret_cast<const char*>(src + j * stride) + 4 * w, 4);
          dst[w * tile + j] = x;
        }
    }
  }
}

// dst[j][0 .. D) = the half-precision rows src[j * stride ..] widened to fp32 (exact), j < rows; D % L == 0.
template <class T>
inline void widen_rows(const T* src, int64_t stride, int64_t rows, int64_t D, float* dst) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t d = 0; d < D; d += L) S::store(dst + j * D + d, S::widen(src + j * stride + d));
}

// The next tile's K and V rows asked into L2 (PREFETCHT1) a few cache lines at a time (step()), spread
// over the work on the current tile: issued all at once they stall the core on its miss queue.
template <class T>
struct TilePrefetch {
  struct Rows {  // `rows` rows from `row` on, `stride` bytes apart, `bytes` each
    const char* row = nullptr;
    int64_t stride = 0, rows = 0, bytes = 0, next = 0, end = 0;  // next, end: byte offsets from row's line
    void start(const T* first, int64_t stride_elems, int64_t n, int64_t row_bytes) {
      stride = stride_elems * static_cast<int64_t>(sizeof(T));
      if (stride == row_bytes) {  // contiguous rows: one span
        row_bytes *= n;
        n = n > 0 ? 1 : 0;
      }
      row = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(first) & ~uintptr_t{63});
      const int64_t offset = static_cast<int64_t>(reinterpret_cast<uintptr_t>(first) & 63);
      rows = n, bytes = row_bytes, next = 0, end = offset + row_bytes;
    }
    void issue(int64_t n) {
      for (; n > 0 && rows > 0; --n) {
        _mm_prefetch(row + next, _MM_HINT_T1);
        next += 64;
        if (next >= end) {  // the next row
          if (--rows == 0) return;
          const char* first = row + (end - bytes) + stride;
          row = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(first) & ~uintptr_t{63});
          next = 0, end = static_cast<int64_t>(reinterpret_cast<uintptr_t>(first) & 63) + bytes;
        }
      }
    }
  };
  Rows k, v;
  int64_t per_step = 0;
  // rows [0, n) of the next tile (k rows `ks` elements apart, v rows `vs`), `bytes` each, over about `steps`
  // calls of step().
  void start(const T* k_rows, int64_t ks, const T* v_rows, int64_t vs, int64_t n, int64_t bytes, int64_t steps) {
    k.start(k_rows, ks, n, bytes);
    v.start(v_rows, vs, n, bytes);
    per_step = (n * (bytes / 64 + 1) + steps - 1) / std::max<int64_t>(steps, 1);
  }
  void step() {
    k.issue(per_step);
    v.issue(per_step);
  }
  void finish() {
    k.issue(std::numeric_limits<int64_t>::max());
    v.issue(std::numeric_limits<int64_t>::max());
  }
};

struct FastScratch {
  std::vector<float> s, acc, row_max, row_sum, tile_max, alpha, qf, vf;
  std::vector<uint32_t> kt, vp;
  std::vector<c10::BFloat16> qh, ph;
  std::vector<uint64_t> vis, valid;
  std::vector<float> kf, qt;   // attend_keys: widened K rows, q^T
  std::vector<uint32_t> lanes; // attend_keys: visible rows (lane bits) per tail key and row vector
};

// One work item (b, hkv, keys [key_begin, key_end)); leaves the unnormalised state in sc (row maxima in
// natural units). B: the products on oneDNN's brgemm (bf16 only), else the fp32 micro-GEMMs (bf16 / fp16
// inputs widened).
template <class T, bool B>
void attend_fast(const Params& p, int64_t b, int64_t hkv, int64_t key_begin, int64_t key_end, const TreeSpan& span,
                 FastScratch& sc) {
  // N: the request's live queries (rows r = g * N + i); its mask rows sit p.num_nodes apart
  const int64_t N = live_queries(p, b), group = p.heads_q / p.heads_kv, rows = group * N, D = p.head_dim;
  static_assert(!B || std::is_same_v<T, c10::BFloat16>, "brgemm: bf16 only");
  constexpr bool kWiden = !B && !std::is_same_v<T, float>;  // half precision through the fp32 micro-GEMMs
  constexpr int64_t Tk = fast_tile(B), Tw = Tk / 64;  // Tw mask words per tile
  constexpr uint64_t kLaneBits = (uint64_t{1} << L) - 1;
  const int64_t rb_max = std::min(rows, fast_rows(B));
  const bool v_in_place = kWiden && rows <= kVInPlaceRows;  // half precision V widened as the product reads it
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float log2_scale = p.scale * kLog2e;
  sc.acc.resize(rows * D);
  for (int64_t i = 0; i < rows * D; i += L) S::store(&sc.acc[i], S::zero());  // D % L == 0
  sc.row_max.assign(rows + L, neg_inf);  // + L: the per-row updates run L rows at a time
  sc.row_sum.assign(rows + L, 0.0f);
  sc.tile_max.assign(rb_max + L, neg_inf);
  sc.alpha.resize(rb_max + L);
  sc.s.resize(rb_max * Tk);
  sc.kt.resize(D * Tk);  // fp32: D words x Tk; bf16 brgemm: D / 2 words x Tk
  sc.vis.resize(N * Tw);
  sc.valid.resize(Tw);
  if constexpr (B) sc.qh.resize(rows * D);
  else sc.qf.resize(rows * D);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = hkv * group + r / N, i = r % N;
    const T* src = static_cast<const T*>(p.q) + b * p.q_stride_b + h * p.q_stride_h + i * p.q_stride_n;
    if constexpr (B) {
      std::memcpy(&sc.qh[r * D], src, sizeof(T) * D);
    } else {  // q * scale * log2(e), in fp32
      const F qs = S::set1(log2_scale);
      for (int64_t d = 0; d < D; d += L) {
        F x;
        if constexpr (kWiden) x = S::widen(src + d);
        else x = S::load(src + d);
        S::store(&sc.qf[r * D + d], S::mul(x, qs));
      }
    }
  }
  if constexpr (kWiden)
    if (!v_in_place) sc.vf.resize(Tk * D);  // (the widened copy of a tile's V rows)
  if constexpr (B) {
    sc.vp.resize(Tk / 2 * D);
    sc.ph.resize(rb_max * Tk);
  }
  const T* kb = static_cast<const T*>(p.k) + b * p.k_stride_b + hkv * p.k_stride_h;
  const T* vb = static_cast<const T*>(p.v) + b * p.v_stride_b + hkv * p.v_stride_h;
  // the masked pass scales the brgemm's scores; the fp32 micro-GEMMs' are scaled already (x * 1 is exact)
  const F score_scale = S::set1(B ? log2_scale : 1.0f), ninf = S::set1(neg_inf);
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  TilePrefetch<T> prefetch;
  const auto prefetch_step = [&] { prefetch.step(); };

  for (int64_t t0 = key_begin; t0 < key_end; t0 += Tk) {
    const int64_t tl = std::min(Tk, key_end - t0);
    const int64_t cols = B ? Tk : (tl + L - 1) / L * L;  // score columns (brgemm: the whole tile)
    const T* k_tile = kb + t0 * p.k_stride_s;
    const T* v_tile = vb + t0 * p.v_stride_s;
    // the next tile's K and V rows into L2, spread over this tile's micro-kernel blocks and softmax rows
    prefetch.start(k_tile + Tk * p.k_stride_s, p.k_stride_s, v_tile + Tk * p.v_stride_s, p.v_stride_s,
                   std::clamp<int64_t>(key_end - t0 - Tk, 0, Tk), row_bytes,
                   B ? rows : gemm_blocks(rows, cols) + gemm_blocks(rows, D));
    const float* v_rows = nullptr;  // fp32 micro-GEMMs: the tile's V rows, v_ld apart
    int64_t v_ld = p.v_stride_s;
    if constexpr (B) {
      pack_kt<false>(k_tile, p.k_stride_s, tl, D / 2, sc.kt.data(), Tk, Tk);
    } else {
      pack_kt<kWiden>(k_tile, p.k_stride_s, tl, D, sc.kt.data(), Tk, cols);
      if constexpr (kWiden) {
        if (!v_in_place) widen_rows(v_tile, p.v_stride_s, tl, D, sc.vf.data());
        v_rows = sc.vf.data();
        v_ld = D;
      } else {
        v_rows = reinterpret_cast<const float*>(v_tile);
      }
    }
    int64_t pv_k = tl;
    if constexpr (B) {  // V to VNNI pairs [ceil(tl / 2)][D][2], odd tail padded with zeros
      pv_k = (tl + 1) / 2 * 2;
      for (int64_t j2 = 0; j2 < pv_k / 2; ++j2) {
        const T* a = v_tile + 2 * j2 * p.v_stride_s;
        const T* c = 2 * j2 + 1 < tl ? a + p.v_stride_s : nullptr;
        for (int64_t d = 0; d < D; d += L) S::vnni_pair(a + d, c ? c + d : nullptr, &sc.vp[j2 * D + d]);
      }
    }
    // Visible columns of this tile per tree node (bit j = key t0 + j).
    for (int64_t w = 0; w < Tw; ++w) {
      const int64_t n = std::clamp<int64_t>(tl - 64 * w, 0, 64);
      sc.valid[w] = n == 64 ? ~uint64_t{0} : ((uint64_t{1} << n) - 1);
    }
    const bool tail = t0 + tl > span.tree_start;
    const bool masked = B || tail || tl < cols;  // else every score column is a visible prefix key
    if (tail) {
      for (int64_t i = 0; i < N; ++i) {  // 64 keys a word (tile_visibility), past the tile's end cleared
        const int64_t* mask_row = p.tree_mask + (b * p.num_nodes + i) * p.mask_words;
        uint64_t* bits = &sc.vis[i * Tw];
        for (int64_t w = 0; w < Tw; ++w)
          bits[w] = sc.valid[w] != 0 ? tile_visibility(span, mask_row, p.mask_words, t0 + 64 * w) & sc.valid[w] : 0;
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += rb_max) {
      const int64_t rb = std::min(rb_max, rows - r0);
      float* Sc = sc.s.data();
      // the tile's max of row r0 + rr (scores scaled for brgemm, masked)
      const auto tile_max = [&](int64_t rr) __attribute__((always_inline)) {
        float* s = Sc + rr * Tk;
        F mx = ninf;
        if (masked) {
          const uint64_t* vis = tail ? &sc.vis[((r0 + rr) % N) * Tw] : sc.valid.data();
          for (int c = 0; c < cols / L; ++c) {
            const uint32_t bits = static_cast<uint32_t>((vis[(c * L) / 64] >> ((c * L) % 64)) & kLaneBits);
            const F x = S::masked_scale(S::load(s + L * c), bits, score_scale, ninf);
            S::store(s + L * c, x);
            mx = S::max(mx, x);
          }
        } else {
          for (int c = 0; c < cols / L; ++c) mx = S::max(mx, S::load(s + L * c));
        }
        sc.tile_max[rr] = S::reduce_max(mx);
      };
      // p = 2^(x - max) of row r0 + rr, its sum
      const auto probabilities = [&](int64_t rr) __attribute__((always_inline)) {
        const int64_t r = r0 + rr;
        float* s = Sc + rr * Tk;
        const float row_max = sc.row_max[r];
        if (row_max == neg_inf) {  // nothing visible yet: p = 0, the state stays empty
          for (int c = 0; c < cols / L; ++c) {
            if constexpr (B) S::store_bf16(&sc.ph[rr * Tk + L * c], S::zero());
            else S::store(s + L * c, S::zero());
          }
          return;
        }
        const F nm = S::set1(row_max);
        F sum = S::zero();
        for (int c = 0; c < cols / L; ++c) {
          const F e = exp2_nonpos(S::sub(S::load(s + L * c), nm));
          sum = S::add(sum, e);
          if constexpr (B) S::store_bf16(&sc.ph[rr * Tk + L * c], e);
          else S::store(s + L * c, e);
        }
        sc.row_sum[r] += S::reduce_add(sum);
      };
      // S = Q K^T and each row's tile max. fp32: a row block at a time, so that the max pass of one block
      // runs beside the products of the next.
      if constexpr (B) {
#if defined(TAPS_ATTN_BRGEMM)
        at::native::cpublas::brgemm(rb, Tk, D, D, Tk, Tk, false, &sc.qh[r0 * D],
                                    reinterpret_cast<const c10::BFloat16*>(sc.kt.data()), Sc, true);
#endif
        for (int64_t rr = 0; rr < rb; ++rr) {
          prefetch.step();
          tile_max(rr);
        }
      } else {
        row_blocks(rb, [&](int64_t m, int64_t mr) __attribute__((always_inline)) {
          gemm_f32(mr, cols, D, &sc.qf[(r0 + m) * D], D, reinterpret_cast<const float*>(sc.kt.data()), Tk,
                   Sc + m * Tk, Tk, false, nullptr, prefetch_step);
          for (int64_t rr = m; rr < m + mr; ++rr) tile_max(rr);
        });
      }
      for (int64_t rr = 0; rr < rb; rr += L) {  // L rows at a time: the new max, the old state's factor
        const F old_max = S::load(&sc.row_max[r0 + rr]);
        const F new_max = S::max(old_max, S::load(&sc.tile_max[rr]));
        // 2^(old - new): 0 when the old state is empty (old = -inf; also new = -inf, where the NaN of
        // -inf - -inf is replaced by -127)
        const F alpha = exp2_nonpos(S::max(S::sub(old_max, new_max), S::set1(-127.0f)));
        S::store(&sc.alpha[rr], alpha);
        S::store(&sc.row_max[r0 + rr], new_max);
        S::store(&sc.row_sum[r0 + rr], S::mul(S::load(&sc.row_sum[r0 + rr]), alpha));
      }
      // acc = acc * alpha + P V. fp32: a row block at a time (its probabilities, then its product).
      if constexpr (B) {
        for (int64_t rr = 0; rr < rb; ++rr) {
          probabilities(rr);
          if (sc.alpha[rr] != 1.0f) {  // brgemm accumulates into acc as it is: rescale it here
            const F al = S::set1(sc.alpha[rr]);
            float* a = &sc.acc[(r0 + rr) * D];
            for (int64_t d = 0; d < D; d += L) S::store(a + d, S::mul(S::load(a + d), al));
          }
        }
#if defined(TAPS_ATTN_BRGEMM)
        at::native::cpublas::brgemm(rb, D, pv_k, Tk, D, D, true, sc.ph.data(),
                                    reinterpret_cast<const c10::BFloat16*>(sc.vp.data()), &sc.acc[r0 * D], true);
#endif
      } else {
        row_blocks(rb, [&](int64_t m, int64_t mr) __attribute__((always_inline)) {
          for (int64_t rr = m; rr < m + mr; ++rr) probabilities(rr);
          if (kWiden && v_in_place)
            gemm_f32<false, T>(mr, D, pv_k, Sc + m * Tk, Tk, v_tile, p.v_stride_s, &sc.acc[(r0 + m) * D], D, true,
                               &sc.alpha[m], prefetch_step);
          else
            gemm_f32(mr, D, pv_k, Sc + m * Tk, Tk, v_rows, v_ld, &sc.acc[(r0 + m) * D], D, true, &sc.alpha[m],
                     prefetch_step);
        });
      }
    }
    prefetch.finish();
  }
  for (int64_t r = 0; r < rows; ++r)  // base-2 maxima to natural units (the key splits' combine)
    if (sc.row_max[r] != neg_inf) sc.row_max[r] *= kLn2;
}

// attend_fast with the keys as the micro-kernels' rows (S::kKeysAsRows): the scores transposed,
//   St[tile][rows] = K[tile][D] * Qt[D][rows]      (K rows read in place as the broadcast side; q^T packed
//                                                   once per work item, rows padded to whole vectors)
//   acc[rows][D] = acc * alpha + P[rows][tile] * V[tile][D]   (P read transposed from St)
// so no K^T is packed per tile, a tile's keys stop at its last key (no masked columns past it), and the
// online softmax runs L rows a lane (a row's max and sum over the tile's keys without horizontal
// reductions). Tail tiles take each key's visible rows as lane bits. bf16 / fp16: K rows widened
// to fp32 once per tile, V rows as the P * V micro-kernel reads them.
constexpr int64_t kKeyRowChunk = 64;  // attend_keys: the most query rows of a KV head (a multiple of every L)
constexpr int64_t kKeysMinRows = 8;   // attend_items_fast: KV heads of at most this many rows may skip attend_keys

template <class T>
void attend_keys(const Params& p, int64_t b, int64_t hkv, int64_t key_begin, int64_t key_end, const TreeSpan& span,
                 FastScratch& sc) {
  // N: the request's live queries (rows r = g * N + i); its mask rows sit p.num_nodes apart
  const int64_t N = live_queries(p, b), group = p.heads_q / p.heads_kv, rows = group * N, D = p.head_dim;
  constexpr bool kWiden = !std::is_same_v<T, float>;
  constexpr int64_t Tk = fast_tile(false);
  static_assert(Tk <= 64, "one mask word per tile");
  const int64_t Rp = (rows + L - 1) / L * L, RV = Rp / L;  // rows padded to whole vectors
  TORCH_INTERNAL_ASSERT(Rp <= kKeyRowChunk, "attend_keys: more query rows than kKeyRowChunk");
  static_assert(kKeyRowChunk <= kVInPlaceRows, "attend_keys reads half-precision V rows in place");
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float log2_scale = p.scale * kLog2e;
  sc.acc.resize(rows * D);
  for (int64_t i = 0; i < rows * D; i += L) S::store(&sc.acc[i], S::zero());  // D % L == 0
  sc.row_max.assign(Rp, neg_inf);
  sc.row_sum.assign(Rp, 0.0f);
  sc.alpha.resize(Rp);
  sc.s.resize(Tk * Rp);
  sc.qt.assign(D * Rp, 0.0f);
  sc.vis.resize(N);
  sc.lanes.resize(Tk * RV);
  for (int64_t r = 0; r < rows; ++r) {  // q^T * scale * log2(e), in fp32
    const int64_t h = hkv * group + r / N, i = r % N;
    const T* src = static_cast<const T*>(p.q) + b * p.q_stride_b + h * p.q_stride_h + i * p.q_stride_n;
    for (int64_t d = 0; d < D; ++d) sc.qt[d * Rp + r] = static_cast<float>(src[d]) * log2_scale;
  }
  if constexpr (kWiden) sc.kf.resize(Tk * D);
  const T* kb = static_cast<const T*>(p.k) + b * p.k_stride_b + hkv * p.k_stride_h;
  const T* vb = static_cast<const T*>(p.v) + b * p.v_stride_b + hkv * p.v_stride_h;
  const F ninf = S::set1(neg_inf), one = S::set1(1.0f);
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  TilePrefetch<T> prefetch;
  const auto prefetch_step = [&] { prefetch.step(); };

  for (int64_t t0 = key_begin; t0 < key_end; t0 += Tk) {
    const int64_t tl = std::min(Tk, key_end - t0);
    const T* k_tile = kb + t0 * p.k_stride_s;
    const T* v_tile = vb + t0 * p.v_stride_s;
    prefetch.start(k_tile + Tk * p.k_stride_s, p.k_stride_s, v_tile + Tk * p.v_stride_s, p.v_stride_s,
                   std::clamp<int64_t>(key_end - t0 - Tk, 0, Tk), row_bytes,
                   gemm_blocks(tl, Rp) + gemm_blocks(rows, D));
    const float* k_rows = reinterpret_cast<const float*>(k_tile);  // K rows, k_ld apart: fp32 as they are
    int64_t k_ld = p.k_stride_s;
    if constexpr (kWiden) {  // half precision: widened once per tile (the broadcast side of the micro-kernel)
      widen_rows(k_tile, p.k_stride_s, tl, D, sc.kf.data());
      k_rows = sc.kf.data(), k_ld = D;
    }
    const bool tail = t0 + tl > span.tree_start;
    if (tail) {  // lane l of row vector v: row v L + l sees key t0 + j
      for (int64_t i = 0; i < N; ++i)
        sc.vis[i] = tile_visibility(span, p.tree_mask + (b * p.num_nodes + i) * p.mask_words, p.mask_words, t0);
      for (int64_t v = 0; v < RV; ++v) {
        uint64_t word[L];  // the keys row v L + l sees (none for the padding)
        for (int64_t l = 0, r = v * L; l < L; ++l, ++r) word[l] = r < rows ? sc.vis[r % N] : 0;
        for (int64_t j = 0; j < tl; ++j) {
          uint32_t bits = 0;
          for (int l = 0; l < L; ++l) bits |= static_cast<uint32_t>((word[l] >> j) & 1) << l;
          sc.lanes[j * RV + v] = bits;
        }
      }
    }
    // every row at once: at most kKeyRowChunk, so that their scores (tile x rows) stay in L1 for P * V
    {
      float* St = sc.s.data();  // [tl][Rp]
      gemm_f32(tl, Rp, D, k_rows, k_ld, sc.qt.data(), Rp, St, Rp, false, nullptr, prefetch_step);
      for (int64_t v = 0; v < RV; ++v) {  // the online softmax, L rows at a time
        float* s = St + v * L;
        F m4[4] = {ninf, ninf, ninf, ninf};  // four chains: the max's latency, not its throughput
        if (tail) {
          for (int64_t j = 0; j < tl; ++j) {
            const F x = S::masked_scale(S::load(s + j * Rp), sc.lanes[j * RV + v], one, ninf);
            S::store(s + j * Rp, x);
            m4[j & 3] = S::max(m4[j & 3], x);
          }
        } else {
          int64_t j = 0;
          for (; j + 4 <= tl; j += 4)
            for (int c = 0; c < 4; ++c) m4[c] = S::max(m4[c], S::load(s + (j + c) * Rp));
          for (; j < tl; ++j) m4[0] = S::max(m4[0], S::load(s + j * Rp));
        }
        const F mx = S::max(S::max(m4[0], m4[1]), S::max(m4[2], m4[3]));
        const F old_max = S::load(&sc.row_max[v * L]);
        const F new_max = S::max(old_max, mx);
        // 2^(old - new): 0 when the old state is empty (old = -inf; also new = -inf, where the NaN of
        // -inf - -inf is replaced by -127)
        const F alpha = exp2_nonpos(S::max(S::sub(old_max, new_max), S::set1(-127.0f)));
        S::store(&sc.alpha[v * L], alpha);
        S::store(&sc.row_max[v * L], new_max);
        // rows with nothing visible yet (new = -inf): p = 2^(-inf - lowest) = 0, the state stays empty
        const F nm = S::max(new_max, S::set1(std::numeric_limits<float>::lowest()));
        F sum[2] = {S::zero(), S::zero()};
        for (int64_t j = 0; j < tl; ++j) {
          const F e = exp2_nonpos(S::sub(S::load(s + j * Rp), nm));
          sum[j & 1] = S::add(sum[j & 1], e);
          S::store(s + j * Rp, e);
        }
        S::store(&sc.row_sum[v * L], S::add(S::mul(S::load(&sc.row_sum[v * L]), alpha), S::add(sum[0], sum[1])));
      }
      // the rows short of the padding
      gemm_f32<true, T>(rows, D, tl, St, Rp, v_tile, p.v_stride_s, sc.acc.data(), D, true, sc.alpha.data(),
                        prefetch_step);
    }
    prefetch.finish();
  }
  for (int64_t r = 0; r < rows; ++r)  // base-2 maxima to natural units (the key splits' combine)
    if (sc.row_max[r] != neg_inf) sc.row_max[r] *= kLn2;
}

template <class T, bool B>
void attend_items_fast(const Params& p, int64_t begin, int64_t end) {
  FastScratch sc;
  // attend_keys where a KV head's rows fit one chunk of it; with more rows the K^T packing is a smaller share
  // of a tile's work than the chunks' re-reads of the K and V tiles cost (measured: 256 rows, D = 128, 4-6%
  // slower through attend_keys)
  // Not for a decoding step's few rows (kKeysMinRows) in half precision or at head dims <= 64: one vector of
  // query rows, mostly padding, against K rows widened to a scratch copy per tile cost more than transposing K
  // (measured at AVX2: a decoding step's attention 15-38% faster through attend_fast; fp32 at D = 128 slower,
  // bench/RESULTS.md). Either way the same bits: both sum each score over d in order, and P * V over keys.
  const int64_t head_rows = (p.heads_q / p.heads_kv) * p.num_nodes;
  [[maybe_unused]] const bool keys_as_rows =
      head_rows <= kKeyRowChunk && !(head_rows <= kKeysMinRows && (!std::is_same_v<T, float> || p.head_dim <= 64));
  run_items<T>(p, begin, end, fast_tile(B), [&](int64_t b, int64_t hkv, KeyRange keys, const TreeSpan& span) {
    if constexpr (!B && S::kKeysAsRows) {
      if (keys_as_rows) {
        attend_keys<T>(p, b, hkv, keys.begin, keys.end, span, sc);
        return RowStates{sc.acc.data(), p.head_dim, sc.row_max.data(), sc.row_sum.data()};
      }
    }
    attend_fast<T, B>(p, b, hkv, keys.begin, keys.end, span, sc);
    return RowStates{sc.acc.data(), p.head_dim, sc.row_max.data(), sc.row_sum.data()};
  });
#if defined(TAPS_ATTN_BRGEMM)
  if constexpr (B) at::native::cpublas::brgemm_release(true);
#endif
}

}  // namespace fast
