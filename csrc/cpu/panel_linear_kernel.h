// panel_linear, CPU: the register-blocked kernel, written once over a vector traits type `S` and compiled
// once per instruction set inside its target region of csrc/cpu/panel_linear.cpp (namespaces
// taps::panel_cpu::avx512, ::avx2 and ::generic); included once per region, with no includes of its own.
// S: F (S::L floats), load / store / set1 / zero / add / fmadd (fmadd(a, b, c) = a * b + c rounded once);
// load_low / load_high(p) read S::L 32-bit lanes of two bfloat16 each (bfloat16 panels) and widen the low /
// the high halves to float32, exactly (the weight type WT: float, or uint16_t for bfloat16 panels).
// S::kKeepWidened: a bfloat16 product with p.keep_widened (kKeepWidenedRows rows or more) widens each output
// block's panels once (its first row block stores the widened vectors into a float32 copy, thread_scratch) and runs
// the other row blocks over that copy as float32 panels: the same values, the same FMAs in the same order, so the
// same bits.
// Register blocks: S::kMaxRows rows at most (4 or 6; S::kEvenRows: split evenly; S::kInterleaveX: float32 x read
// interleaved by block where the op laid it out so, Problem::xi), S::vecs(rows) output vectors for a block of that
// many rows
// (each must divide kBlockPanels panels' vectors, so that full output blocks take no one-vector tail). bfloat16
// panels: a pair's two halves from one load in every block with S::kPairsAtOnce, else in blocks of at most
// S::kPairRows rows.
//
// y[r][o] = (sum over i of x[r][i] * W[o][i]) + bias[o], the sum accumulated in float32 from i = 0 up, one
// fused multiply-add per term. Every level does the same operations on each output in the same order, so
// the result is the same bits at every level, for any row count, row block and thread count; bfloat16
// panels give the bits of float32 panels holding the same (widened) values.
// The weight is read as panels (taps_ops.pack_panels): panel p = outputs 16p .. 16p + 15, [in][16], so the
// vectors of a block read consecutive cache lines of up to S::vecs(rows) / (16 / L) panels as i advances.
namespace panel {

using F = S::F;
constexpr int L = S::L;
constexpr int64_t kVecsPerPanel = kPanelWidth / L;

// acc[r][v] += x[r][i] * b[v] for the block's rows: one weight vector multiplied into every row from registers.
template <int RB, int KV>
inline void rank1(F (&acc)[RB][KV], const float* x, int64_t ldx, int64_t i, const F (&b)[KV]) {
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const F a = S::set1(x[r * ldx + i]);
#pragma GCC unroll 8
    for (int v = 0; v < KV; ++v) acc[r][v] = S::fmadd(a, b[v], acc[r][v]);
  }
}

// A software prefetch (into L2) of each of the block's weight streams `offset` elements past its read: the
// first row block over an output block reads the panels from memory, a line per stream per step, and the
// hardware prefetchers alone keep too few lines in flight for the rows' multiply-adds to run under the
// reads (a hint: no fault past the end, no change to any result).
template <int KV, typename WT>
inline void prefetch(const WT* const (&w)[KV], int64_t offset) {
#pragma GCC unroll 8
  for (int v = 0; v < KV; ++v) {
    if (L == kPanelWidth || (v % kVecsPerPanel) == 0)  // one per cache line (AVX2: two vectors share a line)
      __builtin_prefetch(w[v] + offset, 0, kPrefetchLocality);
  }
}

// The block's weight streams: output vector v0 + v's lanes in its panel (a lane is 4 bytes: one float32 weight,
// or one output's pair of bfloat16 weights).
template <int KV, typename WT>
inline void streams(const WT* (&w)[KV], const WT* panels, int64_t stride, int64_t v0) {
  constexpr int64_t kPerLane = 4 / sizeof(WT);
#pragma GCC unroll 8
  for (int v = 0; v < KV; ++v)
    w[v] = panels + ((v0 + v) / kVecsPerPanel) * stride + ((v0 + v) % kVecsPerPanel) * L * kPerLane;
}

template <int RB, int KV>
inline void zero(F (&acc)[RB][KV]) {
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < KV; ++v) acc[r][v] = S::zero();
}

// The sums of a block (+ bias) stored to y.
template <int RB, int KV>
inline void finish(F (&acc)[RB][KV], float* y, int64_t ldy, const float* bias, int64_t v0) {
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < KV; ++v) {
      F out = acc[r][v];
      if (bias != nullptr) out = S::add(out, S::load(bias + (v0 + v) * L));
      S::store(y + r * ldy + (v0 + v) * L, out);
    }
}

// Rows x[0 .. RB) times output vectors v0 .. v0 + KV (each of L outputs), float32 panels. IX: x interleaved by the
// block's rows (input i of its row r at x[i * RB + r], Problem::xi): one pointer for every row's broadcasts.
template <int RB, int KV, bool PF, bool IX = false>
inline void block(const float* x, int64_t ldx, const float* panels, int64_t stride, int64_t in, float* y, int64_t ldy,
                  const float* bias, int64_t v0, int64_t shift, NextBlock& nb) {
  const float* w[KV];
  streams<KV>(w, panels, stride, v0);
  F acc[RB][KV];
  zero(acc);
  for (int64_t i = 0; i < in; ++i) {
    nb.step();
    F b[KV];
    if constexpr (PF) prefetch<KV>(w, i * kPanelWidth + shift);
#pragma GCC unroll 8
    for (int v = 0; v < KV; ++v) b[v] = S::load(w[v] + i * kPanelWidth);
    if constexpr (IX)
      rank1<RB, KV>(acc, x + i * RB, 1, 0, b);
    else
      rank1<RB, KV>(acc, x, ldx, i, b);
  }
  finish<RB, KV>(acc, y, ldy, bias, v0);
}

// The same over bfloat16 panels [P, in / 2, 16, 2] (inputs in pairs, each output's two weights in one 32-bit
// lane): input 2j's weights are the lanes shifted up by 16 bits, input 2j + 1's the lanes with the low 16
// bits masked off (one operation per vector, exact widening), then the same FMAs in the same order as
// float32 panels (so the same bits for any loop below: S::kPairsAtOnce, S::kPairRows). An odd `in` reads the low half
// of its last pair only (x has no input `in`).
// KEEP: every widened vector also stored into `keep`, float32 panels [.., in, 16] whose first panel holds output
// vector `keep_v0` (kKeepWidened's copy).
template <int RB, int KV, bool PF, bool KEEP = false>
inline void block(const float* x, int64_t ldx, const uint16_t* panels, int64_t stride, int64_t in, float* y,
                  int64_t ldy, const float* bias, int64_t v0, int64_t shift, NextBlock& nb, float* keep = nullptr,
                  int64_t keep_v0 = 0) {
  const uint16_t* w[KV];
  streams<KV>(w, panels, stride, v0);
  float* kw[KV];  // (KEEP) each vector's stream in the copy, laid out as float32 panels (streams)
  if constexpr (KEEP) {
#pragma GCC unroll 8
    for (int v = 0; v < KV; ++v) {
      const int64_t k = v0 - keep_v0 + v;
      kw[v] = keep + (k / kVecsPerPanel) * in * kPanelWidth + (k % kVecsPerPanel) * L;
    }
  }
  F acc[RB][KV];
  zero(acc);
  if constexpr (S::kPairsAtOnce || RB <= S::kPairRows) {
    // both halves of a pair's vectors from one load each: with S::kPairsAtOnce every vector's halves first, then
    // the rows (2 * KV weight registers: AVX-512's 32 hold them); else (blocks of at most S::kPairRows rows) one
    // vector's halves at a time, multiplied into every row (the sums, the rows' two inputs and one vector's halves
    // fit AVX2's 16 registers: half the loads of the loop below). Each sum gets the same FMAs in the same order as
    // in that loop (input 2j, then 2j + 1).
    const int64_t pairs = in / 2;
    for (int64_t j = 0; j < pairs; ++j) {
      nb.step();
      if constexpr (!S::kPairsAtOnce) nb.step();  // (rows_times_block's per_call counts a step an input there)
      if constexpr (PF) prefetch<KV>(w, j * 2 * kPanelWidth + shift);
      if constexpr (S::kPairsAtOnce) {
        F lo[KV], hi[KV];
#pragma GCC unroll 8
        for (int v = 0; v < KV; ++v) {
          lo[v] = S::load_low(w[v] + j * 2 * kPanelWidth);
          hi[v] = S::load_high(w[v] + j * 2 * kPanelWidth);
          if constexpr (KEEP) {
            S::store(kw[v] + 2 * j * kPanelWidth, lo[v]);
            S::store(kw[v] + (2 * j + 1) * kPanelWidth, hi[v]);
          }
        }
        rank1<RB, KV>(acc, x, ldx, 2 * j, lo);
        rank1<RB, KV>(acc, x, ldx, 2 * j + 1, hi);
      } else {
        F a0[RB], a1[RB];
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          a0[r] = S::set1(x[r * ldx + 2 * j]);
          a1[r] = S::set1(x[r * ldx + 2 * j + 1]);
        }
#pragma GCC unroll 8
        for (int v = 0; v < KV; ++v) {
          const F lo = S::load_low(w[v] + j * 2 * kPanelWidth);
          const F hi = S::load_high(w[v] + j * 2 * kPanelWidth);
          if constexpr (KEEP) {
            S::store(kw[v] + 2 * j * kPanelWidth, lo);
            S::store(kw[v] + (2 * j + 1) * kPanelWidth, hi);
          }
#pragma GCC unroll 8
          for (int r = 0; r < RB; ++r) {
            acc[r][v] = S::fmadd(a0[r], lo, acc[r][v]);
            acc[r][v] = S::fmadd(a1[r], hi, acc[r][v]);
          }
        }
      }
    }
    if (in % 2 != 0) {
      F lo[KV];
#pragma GCC unroll 8
      for (int v = 0; v < KV; ++v) {
        lo[v] = S::load_low(w[v] + pairs * 2 * kPanelWidth);
        if constexpr (KEEP) S::store(kw[v] + (in - 1) * kPanelWidth, lo[v]);
      }
      rank1<RB, KV>(acc, x, ldx, in - 1, lo);
    }
  } else {
    // one half at a time, the line loaded twice (the second load hits L1): the registers of float32 panels
    for (int64_t i = 0; i < in; ++i) {
      nb.step();
      const int64_t pair = (i / 2) * 2 * kPanelWidth;
      F b[KV];
      if (i % 2 == 0) {
        if constexpr (PF) prefetch<KV>(w, pair + shift);  // once per line
#pragma GCC unroll 8
        for (int v = 0; v < KV; ++v) b[v] = S::load_low(w[v] + pair);
      } else {
#pragma GCC unroll 8
        for (int v = 0; v < KV; ++v) b[v] = S::load_high(w[v] + pair);
      }
      if constexpr (KEEP) {
#pragma GCC unroll 8
        for (int v = 0; v < KV; ++v) S::store(kw[v] + i * kPanelWidth, b[v]);
      }
      rank1<RB, KV>(acc, x, ldx, i, b);
    }
  }
  finish<RB, KV>(acc, y, ldy, bias, v0);
}

// Rows x[0 .. RB) times the output vectors [v_lo, v_hi): KV at a time, the rest one by one.
// IX: x interleaved (float32 panels only; bfloat16 panels' block takes KEEP in that place, false here).
template <typename WT, int RB, int KV, bool PF, bool IX = false>
inline void row_block(const float* x, int64_t ldx, const WT* panels, int64_t stride, int64_t in, float* y,
                      int64_t ldy, const float* bias, int64_t v_lo, int64_t v_hi, int64_t shift, NextBlock& nb) {
  static_assert(!IX || sizeof(WT) == 4, "interleaved x: float32 panels only");
  int64_t v = v_lo;
  for (; v + KV <= v_hi; v += KV) block<RB, KV, PF, IX>(x, ldx, panels, stride, in, y, ldy, bias, v, shift, nb);
  for (; v < v_hi; ++v) block<RB, 1, PF, IX>(x, ldx, panels, stride, in, y, ldy, bias, v, shift, nb);
}

// The same over bfloat16 panels, storing the widened vectors [v_lo, v_hi) into `keep` (kKeepWidened's copy).
template <int RB, int KV, bool PF>
inline void keeping_row_block(const float* x, int64_t ldx, const uint16_t* panels, int64_t stride, int64_t in,
                              float* y, int64_t ldy, const float* bias, int64_t v_lo, int64_t v_hi, int64_t shift,
                              NextBlock& nb, float* keep) {
  int64_t v = v_lo;
  for (; v + KV <= v_hi; v += KV)
    block<RB, KV, PF, true>(x, ldx, panels, stride, in, y, ldy, bias, v, shift, nb, keep, v_lo);
  for (; v < v_hi; ++v) block<RB, 1, PF, true>(x, ldx, panels, stride, in, y, ldy, bias, v, shift, nb, keep, v_lo);
}

// Rows x[0 .. RB) times the output vectors [v_lo, v_hi) with RB's register block (RB <= S::kMaxRows).
// With a prefetch shift (elements of WT past each weight stream's read; 0: none) or without.
template <typename WT, int RB, bool IX>
inline void rows_block_of(const Problem& p, const float* x, int64_t ldx, int64_t r, int64_t v_lo, int64_t v_hi,
                          int64_t shift, NextBlock& nb) {
  if (shift > 0)
    row_block<WT, RB, S::vecs(RB), true, IX>(x, ldx, static_cast<const WT*>(p.panels), p.panel_stride, p.in,
                                             p.y + r * p.out, p.out, p.bias, v_lo, v_hi, shift, nb);
  else
    row_block<WT, RB, S::vecs(RB), false, IX>(x, ldx, static_cast<const WT*>(p.panels), p.panel_stride, p.in,
                                              p.y + r * p.out, p.out, p.bias, v_lo, v_hi, 0, nb);
}

template <typename WT, int RB>
inline void rows_block(const Problem& p, int64_t r, int64_t v_lo, int64_t v_hi, int64_t shift, NextBlock& nb) {
  if constexpr (S::kInterleaveX && sizeof(WT) == 4) {
    if (p.xi != nullptr)  // (x interleaved by the register blocks: Problem::xi, interleave_x)
      return rows_block_of<WT, RB, true>(p, p.xi + r * p.in, 0, r, v_lo, v_hi, shift, nb);
  }
  rows_block_of<WT, RB, false>(p, p.x + r * p.in, p.in, r, v_lo, v_hi, shift, nb);
}

// kKeepWidened: rows [r, r + RB) of a bfloat16 product of several row blocks; the first (r == 0) widens the output
// vectors [v_lo, v_hi) into `keep` as it multiplies them, the others multiply `keep` as float32 panels.
template <int RB>
inline void kept_rows_block(const Problem& p, int64_t r, int64_t v_lo, int64_t v_hi, int64_t shift, NextBlock& nb,
                            float* keep) {
  constexpr int KV = S::vecs(RB);
  const float* x = p.x + r * p.in;
  float* y = p.y + r * p.out;
  if (r == 0) {
    const auto* panels = static_cast<const uint16_t*>(p.panels);
    if (shift > 0)
      keeping_row_block<RB, KV, true>(x, p.in, panels, p.panel_stride, p.in, y, p.out, p.bias, v_lo, v_hi, shift, nb, keep);
    else
      keeping_row_block<RB, KV, false>(x, p.in, panels, p.panel_stride, p.in, y, p.out, p.bias, v_lo, v_hi, 0, nb, keep);
    return;
  }
  // (the copy's vectors counted from v_lo: y and the bias from there too)
  row_block<float, RB, KV, false>(x, p.in, keep, p.in * kPanelWidth, p.in, y + v_lo * L, p.out,
                                  p.bias == nullptr ? nullptr : p.bias + v_lo * L, 0, v_hi - v_lo, 0, nb);
}

// The rows of the register block after the first `done` of `rows`: S::kMaxRows (the last fewer), or with
// S::kEvenRows as even as they go (Problem::xi is laid out by these blocks).
inline int64_t block_rows(int64_t rows, int64_t done) {
  if constexpr (S::kEvenRows) return even_block_rows(rows, done, S::kMaxRows);
  return std::min<int64_t>(S::kMaxRows, rows - done);
}

// Problem::xi of float32 x [rows, in] (S::kInterleaveX): each register block of rows (block_rows) from row r0 at
// out + r0 * in, its row r's input i at i * rb + r: the layout the blocks above read, made from the same split.
inline void interleave_x(const float* x, int64_t rows, int64_t in, float* out) {
  for (int64_t r0 = 0, rb = 0; r0 < rows; r0 += rb) {
    rb = block_rows(rows, r0);
    interleave_rows(x + r0 * in, in, rb, out + r0 * in);
  }
}

// Every row of x times the output vectors [v_lo, v_hi) (a block that stays in L2 while the row blocks
// pass over it): blocks of S::kMaxRows rows, then one block of the rest, so that up to kMaxRows rows
// read the weight once. The first row block reads the block's panels from memory: with p.ahead > 0 it
// prefetches each weight stream p.ahead cache lines past its read. The row blocks after it read them from L2
// and leave memory idle: from kNextMinRows rows they ask the next output block's panels (bytes [next_first,
// next_last)) into L2 (NextBlock), so that its first row block reads L2 too.
template <typename WT>
inline void rows_times_block(const Problem& p, int64_t v_lo, int64_t v_hi, const char* next_first, const char* next_last) {
  constexpr int64_t kLine = 64 / sizeof(WT);  // elements of a cache line: one step of a stream
  const int64_t per_call = S::kPairsAtOnce && sizeof(WT) == 2 ? p.in / 2 : p.in;  // NextBlock steps of a block()
  NextBlock none, nb = next_block(next_first, next_last, p.rows, v_hi - v_lo, per_call, S::kMaxRows, &S::vecs,
                                  &block_rows);
  if constexpr (S::kKeepWidened && sizeof(WT) == 2) {
    // (p.keep_widened: the op's decision; not where the float32 copy would pass kKeepMostBytes: a long `in`)
    if (p.keep_widened && (v_hi - v_lo) * L * p.in * 4 <= kKeepMostBytes) {
      float* keep = thread_scratch<float>((v_hi - v_lo) * L * p.in);
      for (int64_t r = 0; r < p.rows;) {
        const int64_t rb = block_rows(p.rows, r);
        const int64_t shift = r == 0 ? p.ahead * kLine : 0;
        NextBlock& f = r == 0 ? none : nb;
        switch (rb) {
          case 1: kept_rows_block<1>(p, r, v_lo, v_hi, shift, f, keep); break;
          case 2: kept_rows_block<2>(p, r, v_lo, v_hi, shift, f, keep); break;
          case 3: kept_rows_block<3>(p, r, v_lo, v_hi, shift, f, keep); break;
          case 4: kept_rows_block<4>(p, r, v_lo, v_hi, shift, f, keep); break;
          case 5: kept_rows_block<5>(p, r, v_lo, v_hi, shift, f, keep); break;
          default: if constexpr (S::kMaxRows >= 6) kept_rows_block<6>(p, r, v_lo, v_hi, shift, f, keep); break;
        }
        r += rb;
      }
      return;
    }
  }
  for (int64_t r = 0; r < p.rows;) {
    const int64_t rb = block_rows(p.rows, r);
    const int64_t shift = r == 0 ? p.ahead * kLine : 0;
    NextBlock& f = r == 0 ? none : nb;
    switch (rb) {
      case 1: rows_block<WT, 1>(p, r, v_lo, v_hi, shift, f); break;
      case 2: rows_block<WT, 2>(p, r, v_lo, v_hi, shift, f); break;
      case 3: rows_block<WT, 3>(p, r, v_lo, v_hi, shift, f); break;
      case 4: rows_block<WT, 4>(p, r, v_lo, v_hi, shift, f); break;
      case 5: rows_block<WT, 5>(p, r, v_lo, v_hi, shift, f); break;
      case 6: rows_block<WT, 6>(p, r, v_lo, v_hi, shift, f); break;
      case 7: if constexpr (S::kMaxRows >= 7) rows_block<WT, 7>(p, r, v_lo, v_hi, shift, f); break;
      default: if constexpr (S::kMaxRows >= 8) rows_block<WT, 8>(p, r, v_lo, v_hi, shift, f); break;
    }
    r += rb;
  }
}

// Every row of x times the output panels [panel_lo, panel_hi) (float32 or bfloat16 panels, p.bf16); the bytes
// [next_first, next_last) are the next output block's (see rows_times_block).
inline void run(const Problem& p, int64_t panel_lo, int64_t panel_hi, const char* next_first, const char* next_last) {
  if (p.bf16)
    rows_times_block<uint16_t>(p, panel_lo * kVecsPerPanel, panel_hi * kVecsPerPanel, next_first, next_last);
  else
    rows_times_block<float>(p, panel_lo * kVecsPerPanel, panel_hi * kVecsPerPanel, next_first, next_last);
}

}  // namespace panel
