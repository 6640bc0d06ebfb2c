// The bf16 rows of rms_norm and rope_ with explicit vectors, written once over a vector traits type `V` and
// compiled once per instruction set inside its target region of csrc/cpu/bf16_rows.cpp (no include guard,
// no includes of its own). They give the bits of the header-only cores (taps/rms_norm.h, taps/rope.h):
// the same products and sums, each rounded on its own (no FMA: the regions enable none, or turn off
// contraction), in the same order, and the cores' round-to-nearest-even (V::narrow: NaN -> 0x7fc0).
// V: F (L floats), H (L bf16), load / load_part (L or the first n < L bf16 values, zeros after), store /
// store_part, widen (H -> F, exact), narrow (F -> H, round to nearest even), round (F -> the nearest bf16
// value as F), zero, set1, add, mul, fold (partial sums down to 8 lanes by the lane tree's first steps:
// lane l += lane l + L / 2), hsum8 (the tree's last steps on 8 lanes: +4, +2, +1).

// rms_norm of one bf16 row (taps/rms_norm.h, norm::row): the sum of squares in 32 lanes (lane l: x_l, x_{l+32},
// ... in increasing index), the lanes' shuffle-down tree, inv = 1 / sqrt(ss / H + eps), y = round(round(x *
// inv) * w).
inline void rms_norm_bf16_row(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t width, float eps) {
  constexpr int kVecs = norm::kLanes / V::L;  // vectors of partial sums
  typename V::F part[kVecs];
  for (int v = 0; v < kVecs; ++v) part[v] = V::zero();
  int64_t i0 = 0;
  for (; i0 + norm::kLanes <= width; i0 += norm::kLanes)
    for (int v = 0; v < kVecs; ++v) {
      const typename V::F e = V::widen(V::load(x + i0 + v * V::L));
      part[v] = V::add(part[v], V::mul(e, e));
    }
  if (i0 < width) {  // the last partial block, zero-padded: lanes that add +0 keep their sum (sums are >= +0)
    uint16_t tail[norm::kLanes] = {};
    std::memcpy(tail, x + i0, sizeof(uint16_t) * (width - i0));
    for (int v = 0; v < kVecs; ++v) {
      const typename V::F e = V::widen(V::load(tail + v * V::L));
      part[v] = V::add(part[v], V::mul(e, e));
    }
  }
  // the tree: offsets 16, 8, ... while the lanes span vectors, then inside the last
  for (int n = kVecs; n > 1; n /= 2)
    for (int v = 0; v < n / 2; ++v) part[v] = V::add(part[v], part[v + n / 2]);
  const typename V::F inv = V::set1(norm::inverse_rms(V::hsum8(V::fold(part[0])), width, eps));
  const auto normed = [&](typename V::H xs, typename V::H ws) {
    return V::narrow(V::mul(V::round(V::mul(V::widen(xs), inv)), V::widen(ws)));
  };
  int64_t i = 0;
  for (; i + V::L <= width; i += V::L) V::store(y + i, normed(V::load(x + i), V::load(w + i)));
  if (i < width)
    V::store_part(y + i, normed(V::load_part(x + i, width - i), V::load_part(w + i, width - i)), width - i);
}

// rope of one token's bf16 head rows in place (taps/rope.h, rope::row on each): pairs (i, i + D / 2), L pairs
// a vector, the token's table rows c, s widened once for all `heads` rows (`head_stride` elements apart).
inline void rope_bf16_token(uint16_t* x, int64_t head_stride, int64_t heads, const uint16_t* c, const uint16_t* s,
                            int64_t dim) {
  const int64_t half = dim / 2;
  const auto rotate = [&](int64_t i, int64_t n) {  // pairs i .. i + n - 1 of every head, n <= L
    const auto load = [&](const uint16_t* p) { return V::widen(n == V::L ? V::load(p) : V::load_part(p, n)); };
    const typename V::F c_lo = load(c + i), s_lo = load(s + i), c_hi = load(c + i + half), s_hi = load(s + i + half);
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* row = x + h * head_stride;
      const typename V::F a = load(row + i), b = load(row + i + half);
      const typename V::H lo = V::narrow(V::add(V::round(V::mul(a, c_lo)), V::round(V::mul(b, s_lo))));
      const typename V::H hi = V::narrow(V::add(V::round(V::mul(b, c_hi)), V::round(V::mul(a, s_hi))));
      if (n == V::L) {
        V::store(row + i, lo);
        V::store(row + i + half, hi);
      } else {
        V::store_part(row + i, lo, n);
        V::store_part(row + i + half, hi, n);
      }
    }
  };
  int64_t i = 0;
  for (; i + V::L <= half; i += V::L) rotate(i, V::L);
  if (i < half) rotate(i, half - i);
}
