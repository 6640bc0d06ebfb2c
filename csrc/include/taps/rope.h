// rope, header-only core: rotary position embedding of one head row in place, the arithmetic shared by
// the CPU and CUDA kernels (so both give the same bits).
//
// A row x[0..D-1] (D even, half = D / 2) of one head at one token, and that token's table rows cos[0..D-1]
// and sin[0..D-1], where sin carries rotate_half's sign (sin[i] < 0 role for i < half; see
// taps.lean.RopeTable). In x's dtype, each product and the sum rounded (as torch evaluates
// `x * cos + x.roll(half, -1) * sin`, which is Hugging Face's `x * cos + rotate_half(x) * sin`):
//   y[i]        = round(round(x[i] * cos[i]) + round(x[i + half] * sin[i]))
//   y[i + half] = round(round(x[i + half] * cos[i + half]) + round(x[i] * sin[i + half]))      i < half
// Each pair (i, i + half) reads only its own two elements, so a row is rotated in place pair by pair.
#pragma once
#include <cstdint>

#include "taps/common.h"
#include "taps/elementwise.h"

namespace taps {
namespace rope {

using namespace elementwise;

// Pair i (< half) of row x (in place) with table rows c, s.
template <int T>
TAPS_HD void rotate_pair(void* x, const void* c, const void* s, int64_t i, int64_t half) {
  const float a = load_t<T>(x, i), b = load_t<T>(x, i + half);
  const float lo = add(round_t<T>(mul(a, load_t<T>(c, i))), round_t<T>(mul(b, load_t<T>(s, i))));
  const float hi = add(round_t<T>(mul(b, load_t<T>(c, i + half))), round_t<T>(mul(a, load_t<T>(s, i + half))));
  store_t<T>(x, i, lo);
  store_t<T>(x, i + half, hi);
}

// A whole row on one thread (the CPU kernel).
template <int T>
inline void row(void* x, const void* c, const void* s, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) rotate_pair<T>(x, c, s, i, half);
}

}  // namespace rope
}  // namespace taps
