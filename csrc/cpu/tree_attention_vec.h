// tree_attention, CPU: the kernel written over a float vector type `Vec`, compiled once per instruction
// set (csrc/cpu/tree_attention.cpp includes it inside namespace taps::attention::cpu::<isa>, with `Vec`
// defined there): register-blocked q * K^T against a K tile transposed to [D][kTile], the online
// softmax per row (taps/tree_attention.h), acc += P * V; the work-item loop shared with the AVX-512
// GEMM-shaped path (run_items); the log-sum-exp combine of the key splits.
// No include guard: included once per instruction set.

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

// One work item: the G * n rows of KV head `hkv` of request b (n = live_queries(p, b) > 0) over keys
// [key_begin, key_end). Leaves the unnormalised state in sc.acc / sc.row_max / sc.row_sum (rows x dp).
template <class T>
void attend(const Params& p, int64_t b, int64_t hkv, int64_t key_begin, int64_t key_end, const TreeSpan& span,
            Scratch& sc) {
  const int64_t n = live_queries(p, b), group = p.heads_q / p.heads_kv, rows = group * n, d_len = p.head_dim;
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
    const int64_t h = hkv * group + r / n, i = r % n;
    const T* src = static_cast<const T*>(p.q) + b * p.q_stride_b + h * p.q_stride_h + i * p.q_stride_n;
    for (int64_t d = 0; d < d_len; ++d) sc.q[r * dp + d] = to_f(src[d]) * p.scale;
  }
  const T* kb = static_cast<const T*>(p.k) + b * p.k_stride_b + hkv * p.k_stride_h;
  const T* vb = static_cast<const T*>(p.v) + b * p.v_stride_b + hkv * p.v_stride_h;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  for (int64_t t0 = key_begin; t0 < key_end; t0 += kTile) {
    const int64_t tile_len = std::min(kTile, key_end - t0);
    // Stage the tile: K transposed to [D][kTile] (zero columns past tile_len), V as [kTile][dp].
    for (int64_t j = 0; j < kTile; ++j) {
      if (j < tile_len) {
        const T* kr = kb + (t0 + j) * p.k_stride_s;
        const T* vr = vb + (t0 + j) * p.v_stride_s;
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
        const int64_t* mask_row = p.tree_mask + (b * p.num_nodes + r % n) * p.mask_words;
        for (int64_t j = std::max<int64_t>(0, span.tree_start - t0); j < tile_len; ++j)
          if (!key_visible(span, mask_row, t0 + j)) s[j] = neg_inf;
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
      sc.alpha[r] = softmax_rescale(sc.row_max[r], new_max);
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

// The unnormalised state of one work item's rows (row r of the KV head's group at acc[r * acc_stride]).
struct RowStates {
  const float* acc;
  int64_t acc_stride;
  const float* max;
  const float* sum;
};

// Work items [begin, end) of (b, hkv, split), split fastest: each request's keys cut into p.splits
// ranges of whole `tile`s (split_len / split_range), attend(b, hkv, keys, span) -> RowStates for the
// range (its G * n live rows, n = live_queries(p, b)), then the rows written normalised (one split) or as
// partial results (several; partial_row). The rows of nodes n .. N - 1 are written as zeros (one split) or
// as empty partial results (the combine gives them zeros).
template <class T, class Attend>
void run_items(const Params& p, int64_t begin, int64_t end, int64_t tile, Attend&& attend) {
  const int64_t group = p.heads_q / p.heads_kv, N = p.num_nodes, D = p.head_dim;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t split = item % p.splits, bh = item / p.splits;
    const int64_t b = bh / p.heads_kv, hkv = bh % p.heads_kv;
    const int64_t n = live_queries(p, b), rows = group * n;
    for (int64_t g = 0; g < group && n < N; ++g) {  // the rows not computed
      const int64_t row0 = output_row(p, b, hkv, g * N, N);
      if (p.splits == 1) {
        std::memset(static_cast<T*>(p.out) + (row0 + n) * D, 0, sizeof(T) * (N - n) * D);
      } else {
        const int64_t part0 = partial_row(p, split, row0);
        std::memset(p.part_acc + (part0 + n) * D, 0, sizeof(float) * (N - n) * D);
        std::fill(p.part_max + part0 + n, p.part_max + part0 + N, -std::numeric_limits<float>::infinity());
        std::fill(p.part_sum + part0 + n, p.part_sum + part0 + N, 0.0f);
      }
    }
    if (n == 0) continue;
    const TreeSpan span = tree_span(p.kv_lens[b], p.tree_nodes, p.cache_len);
    const KeyRange keys = split_range(span.len, split, split_len(span.len, p.splits, tile));
    const RowStates st = attend(b, hkv, keys, span);
    for (int64_t r = 0; r < rows; ++r) {
      const float* acc = st.acc + r * st.acc_stride;
      const int64_t row = output_row(p, b, hkv, r, n);
      if (p.splits == 1) {
        T* o = static_cast<T*>(p.out) + row * D;
        const float inv = st.sum[r] > 0.0f ? 1.0f / st.sum[r] : 0.0f;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] * inv);
      } else {
        const int64_t part_row = partial_row(p, split, row);
        std::memcpy(p.part_acc + part_row * D, acc, sizeof(float) * D);
        p.part_max[part_row] = st.max[r];
        p.part_sum[part_row] = st.sum[r];
      }
    }
  }
}

template <class T>
void attend_items(const Params& p, int64_t begin, int64_t end) {
  Scratch sc;
  const int64_t dp = taps::ceil_div(p.head_dim, kVL) * kVL;
  run_items<T>(p, begin, end, kTile, [&](int64_t b, int64_t hkv, KeyRange keys, const TreeSpan& span) {
    attend<T>(p, b, hkv, keys.begin, keys.end, span, sc);
    return RowStates{sc.acc.data(), dp, sc.row_max.data(), sc.row_sum.data()};
  });
}

// Log-sum-exp combine of the split partial results; output rows [begin, end) of [B * Hq * N].
template <class T>
void combine_rows(const Params& p, int64_t begin, int64_t end) {
  const int64_t D = p.head_dim;
  const int64_t stride = partial_row(p, 1, 0);  // between splits
  std::vector<float> weight(p.splits), acc(D);
  for (int64_t row = begin; row < end; ++row) {
    lse_combine_weights(p.part_max + row, p.part_sum + row, p.splits, stride, weight.data());
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t s = 0; s < p.splits; ++s) {
      const float* src = p.part_acc + partial_row(p, s, row) * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += weight[s] * src[d];
    }
    T* o = static_cast<T*>(p.out) + row * D;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d]);
  }
}
