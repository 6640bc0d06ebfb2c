// expand_level, the host+device core (no torch headers): one level of an EAGLE-2 expansion, shared by
// the CPU kernel (csrc/cpu/expand_level.cpp, whose loops are host_row / host_request below) and the CUDA
// kernels (taps/expand_level_kernel.cuh).
//
// Conventions (see DESIGN.md, expand_level):
//   logits [R, F, V]: row (r, f) holds the draft logits of frontier node f of request r.
//   Child c = f * k + j of request r is the j-th best token of row (r, f):
//     scores[r, c]  = front_scores[r, f] + log_softmax(logits[r, f])[id]   (float32)
//     tokens[r, c]  = token_map[id] (or id without a map)
//     parents[r, c] = front_cands[r, f]
//   The next frontier: the next_k best children of request r, best first, as child indices c
//   (next_slots = c / k is the parent's frontier slot, next_cands = cand_offset + c).
//   entropy[r] = sum over f of the entropy (nats) of softmax(logits[r, f]) when asked, else 0.
//
// One order everywhere: a higher value first, equal values by the lower index (token id, child index),
// NaN ranked as -inf. So the selection is a function of the values alone, the same on both backends;
// only the log-sum-exp (summation order, the device's expf) may differ in the last float bits.
//
// Row statistics take two passes: the maximum m (with the top-k scan), then s = sum exp(x - m) and, for
// the entropy, t = sum exp(x - m) * (x - m); log-prob = (x - m) - log(s) (torch's log_softmax formula),
// entropy = log(s) - t / s. -inf logits contribute nothing at float precision (clamped_shift); a row of
// only -inf gives log-probs -inf and entropy 0; a NaN or +inf logit makes its row's log-probs and entropy
// NaN (its tokens are still in range). The scan tells the sums about both (finish_sums).
// The sums run in one fixed order, as rms_norm's (taps/rms_norm.h): lane j (0..31) sums elements j,
// j + 32, ... in increasing index, then the lanes combine as a warp's shuffle-down tree, with exp computed
// by exp_clamped below and products and sums kept as separate roundings; so the CPU kernel and the CUDA
// kernel (a warp per row) give the same bits, except where the device's logf differs from the host's
// (log(s) and the entropy's log).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

#include "taps/common.h"
#include "taps/elementwise.h"

namespace taps {
namespace expand {

using elementwise::Dtype;
using elementwise::kBF16;
using elementwise::kF16;
using elementwise::kF32;

constexpr int kMaxK = 64;  // children per frontier node (top_k) at most

// NaN ranks as -inf (so NaN never displaces a number, and a row of NaN still yields in-range indices).
TAPS_HD float rank_value(float v) { return v != v ? -INFINITY : v; }

// Does (a, ia) come before (b, ib)? Higher value first, then lower index.
TAPS_HD bool better(float a, int64_t ia, float b, int64_t ib) { return a > b || (a == b && ia < ib); }

// A running top-k list of capacity k, best first: val / idx [k], filled with sentinels that every real
// element beats (-inf with the largest index).
TAPS_HD void topk_init(float* val, int64_t* idx, int k) {
  for (int j = 0; j < k; ++j) {
    val[j] = -INFINITY;
    idx[j] = INT64_MAX;
  }
}

// Insert (v, i) (v already passed through rank_value) if it beats the list's last entry.
TAPS_HD void topk_push(float* val, int64_t* idx, int k, float v, int64_t i) {
  if (!better(v, i, val[k - 1], idx[k - 1])) return;
  int j = k - 1;
  while (j > 0 && better(v, i, val[j - 1], idx[j - 1])) {
    val[j] = val[j - 1];
    idx[j] = idx[j - 1];
    --j;
  }
  val[j] = v;
  idx[j] = i;
}

constexpr int kLanes = 32;

using elementwise::add;
using elementwise::load_t;
using elementwise::mul;

// x - m (x a logit, m its row's maximum, finite) as the sums use it: clamped to [-87, -0] (a NaN or a
// positive value to -0, -inf and anything below -87 to -87) on the float's bits, with integer min / max
// only, so that the loop has no branch and vectorises. Below -87, exp is under float's normal range:
// such a logit (or a -inf one) adds at most 2^-125 to s and 87 * 2^-125 to |t| (nothing at float
// precision next to the maximum's 1).
TAPS_HD float clamped_shift(float x, float m) {
  uint32_t u = elementwise::float_to_bits(add(x, -m));
  u = u > 0x80000000u ? u : 0x80000000u;  // +0, positive values and positive NaN: -0
  u = u < 0xc2ae0000u ? u : 0xc2ae0000u;  // below -87 (and -inf, negative NaN): -87
  return elementwise::bits_to_float(u);
}

// exp(d) for d in [-87, 0], within 2 float ulp: 2^n * p(r) with n = round(d / ln 2) and r = d - n ln 2 in
// two parts (Cody-Waite), p the degree-7 Taylor polynomial; products and sums kept separate.
TAPS_HD float exp_clamped(float d) {
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = add(add(mul(d, 1.44269504088896341f), magic), -magic);
  const float r = add(add(d, -mul(n, 0.693359375f)), mul(n, 2.12194440e-4f));
  float p = 1.0f / 5040.0f;
  p = add(mul(p, r), 1.0f / 720.0f);
  p = add(mul(p, r), 1.0f / 120.0f);
  p = add(mul(p, r), 1.0f / 24.0f);
  p = add(mul(p, r), 1.0f / 6.0f);
  p = add(mul(p, r), 0.5f);
  p = add(mul(p, r), 1.0f);
  p = add(mul(p, r), 1.0f);
  return mul(p, elementwise::bits_to_float(uint32_t(int32_t(n) + 127) << 23));
}

// One element's terms of the sums: exp(x - m) into s and exp(x - m) * (x - m) into t (computed whether
// the entropy is asked or not: the same loop either way).
TAPS_HD void sum_terms(float x, float m, float& s, float& t) {
  const float d = clamped_shift(x, m);
  const float e = exp_clamped(d);
  s = add(s, e);
  t = add(t, mul(e, d));
}

// Elements base, base + 32, ... (kAhead of them; 0 past the row's end) of a row, loaded before any is used:
// the CUDA kernel's warp scans a whole row alone, and one load at a time in its dependent loops left it
// waiting on memory (425 us for 8 rows of 32000 on an H200, 0.43x torch's topk + log_softmax). The scans
// use them in the order of one load at a time, so the results keep their bits.
constexpr int kAhead = 8;
template <int T>
TAPS_HD void load_ahead(const void* row, int64_t vocab, int64_t base, float (&out)[kAhead]) {
  for (int u = 0; u < kAhead; ++u) {
    const int64_t i = base + u * kLanes;
    out[u] = i < vocab ? load_t<T>(row, i) : 0.0f;
  }
}

// Lane `lane`'s partial sums over elements lane, lane + 32, ... of a row, in that order (kAhead loads at a
// time: load_ahead); the CUDA kernel: the lane of its warp; the CPU kernel runs the 32 lanes side by side,
// see cpu/expand_level.cpp, in the same order.
template <int T>
TAPS_HD void lane_sums(const void* row, int64_t vocab, int lane, float m, float& s, float& t) {
  for (int64_t base = lane; base < vocab; base += kLanes * kAhead) {
    float ahead[kAhead];
    load_ahead<T>(row, vocab, base, ahead);
    for (int u = 0; u < kAhead; ++u)
      if (base + u * kLanes < vocab) sum_terms(ahead[u], m, s, t);
  }
}

// The row's combined sums, given what the scan saw: a NaN logit, or a +inf one (m = +inf: inf - inf, as
// torch's log_softmax gives NaN there; the lanes' terms would depend on the NaN's sign bit, which differs
// between the host and the device), makes them NaN; a row of only -inf (m = -inf, where the lanes' clamped
// terms mean nothing) has none.
TAPS_HD void finish_sums(bool has_nan, float m, float& s, float& t) {
  if (has_nan || m == INFINITY) {
    s = t = NAN;
  } else if (m == -INFINITY) {
    s = t = 0.0f;
  }
}

// x - m for the log-probs: -inf for every logit of a row whose maximum is -inf.
TAPS_HD float shifted(float x, float m) { return m == -INFINITY ? -INFINITY : add(x, -m); }

// log(s); 0 for an empty sum (a row of only -inf, whose log-probs are -inf through shifted()); NaN stays.
TAPS_HD float log_sum(float s) { return s == 0.0f ? 0.0f : logf(s); }

// log-softmax of a logit from the row's maximum m and log(s).
TAPS_HD float log_prob(float x, float m, float log_s) { return add(shifted(x, m), -log_s); }

// Entropy (nats) of the softmax from s and t: log(s) - t / s; 0 for a row with no finite logit.
TAPS_HD float row_entropy(float s, float t) { return s == 0.0f ? 0.0f : add(logf(s), -(t / s)); }

// The problem as raw pointers. Outputs contiguous; logits rows `row_stride` elements apart (last dim
// contiguous), front_scores / front_cands contiguous [R, F].
struct Params {
  const void* logits;
  const float* front_scores;
  const int64_t* front_cands;
  const int64_t* token_map;  // [V] or nullptr
  float* scores;             // [R, F * k]
  int64_t* tokens;           // [R, F * k]
  int64_t* parents;          // [R, F * k]
  float* row_entropy;        // [R, F] scratch: the entropy of each row (with_entropy)
  float* entropy;            // [R]
  float* next_scores;        // [R, next_k]
  int64_t* next_tokens;      // [R, next_k]
  int64_t* next_slots;       // [R, next_k]
  int64_t* next_cands;       // [R, next_k]
  int64_t rows, front, vocab, row_stride, k, next_k, cand_offset;
  bool with_entropy;
};

// Write child j of row (r, f) whose token id is `id` and log-prob `logp`.
TAPS_HD void write_child(const Params& p, int64_t r, int64_t f, int64_t j, int64_t id, float logp) {
  const int64_t c = r * p.front * p.k + f * p.k + j;
  p.scores[c] = add(p.front_scores[r * p.front + f], logp);
  p.tokens[c] = p.token_map != nullptr ? p.token_map[id] : id;
  p.parents[c] = p.front_cands[r * p.front + f];
}

// Write the next frontier's entry `rank` of request r: child c.
TAPS_HD void write_next(const Params& p, int64_t r, int64_t rank, int64_t c) {
  const int64_t src = r * p.front * p.k + c, dst = r * p.next_k + rank;
  p.next_scores[dst] = p.scores[src];
  p.next_tokens[dst] = p.tokens[src];
  p.next_slots[dst] = c / p.k;
  p.next_cands[dst] = p.cand_offset + c;
}

// Request r's entropy: its rows' entropies summed in frontier order (0 without with_entropy).
TAPS_HD float request_entropy(const Params& p, int64_t r) {
  float e = 0.0f;
  if (p.with_entropy)
    for (int64_t f = 0; f < p.front; ++f) e = add(e, p.row_entropy[r * p.front + f]);
  return e;
}

// ---- the CPU kernel's loops (host only): csrc/cpu/expand_level.cpp runs them inside its instruction-set
// clones; the emulation test of the CUDA kernels runs them as its reference ---------------------------

// Logits row `row` = r * F + f: the top k, the sums, the k children and the row's entropy. val / idx:
// scratch of kMaxK. The scan goes 32 elements at a time: a vectorised test whether any element reaches
// the current k-th value (or is NaN), then the scalar insertion only for such blocks (few once the list
// has filled); the first of the top k is the row's maximum. The sums run as the 32 lanes side by side
// (each lane's own order unchanged, so the compiler may vectorise), then the shuffle-down tree.
// (always inlined: into each instruction-set clone of the CPU kernel's loop, which vectorises it there)
template <int T>
inline __attribute__((always_inline)) void host_row(const Params& p, int64_t row, float* val, int64_t* idx) {
  const int64_t elem = T == kF32 ? 4 : 2;
  const int k = static_cast<int>(p.k);
  const char* x = static_cast<const char*>(p.logits) + row * p.row_stride * elem;
  topk_init(val, idx, k);
  bool has_nan = false;
  auto push = [&](int64_t i) {
    const float x_i = load_t<T>(x, i);
    has_nan |= x_i != x_i;
    const float v = rank_value(x_i);
    if (better(v, i, val[k - 1], idx[k - 1])) topk_push(val, idx, k, v, i);
  };
  int64_t b0 = 0;
  for (; b0 + kLanes <= p.vocab; b0 += kLanes) {
    const float thr = val[k - 1];
    int hit = 0;
    for (int lane = 0; lane < kLanes; ++lane) {
      const float x_i = load_t<T>(x, b0 + lane);
      hit |= int(x_i >= thr) | int(x_i != x_i);
    }
    if (hit)
      for (int lane = 0; lane < kLanes; ++lane) push(b0 + lane);
  }
  for (; b0 < p.vocab; ++b0) push(b0);
  const float m = val[0];
  float s[kLanes], t[kLanes];
  for (int lane = 0; lane < kLanes; ++lane) s[lane] = t[lane] = 0.0f;
  int64_t i0 = 0;
  for (; i0 + kLanes <= p.vocab; i0 += kLanes)
    for (int lane = 0; lane < kLanes; ++lane) sum_terms(load_t<T>(x, i0 + lane), m, s[lane], t[lane]);
  for (int lane = 0; i0 + lane < p.vocab; ++lane) sum_terms(load_t<T>(x, i0 + lane), m, s[lane], t[lane]);
  for (int off = kLanes / 2; off > 0; off /= 2)
    for (int lane = 0; lane < off; ++lane) {
      s[lane] = add(s[lane], s[lane + off]);
      t[lane] = add(t[lane], t[lane + off]);
    }
  finish_sums(has_nan, m, s[0], t[0]);
  const float log_s = log_sum(s[0]);
  const int64_t r = row / p.front, f = row % p.front;
  for (int j = 0; j < k; ++j) write_child(p, r, f, j, idx[j], log_prob(load_t<T>(x, idx[j]), m, log_s));
  p.row_entropy[row] = p.with_entropy ? row_entropy(s[0], t[0]) : 0.0f;
}

// Request r: its entropy and the next_k best children, best first, by a partial sort in the one order.
// order: scratch of F * k.
inline void host_request(const Params& p, int64_t r, int64_t* order) {
  p.entropy[r] = request_entropy(p, r);
  if (p.next_k == 0) return;
  const int64_t children = p.front * p.k;
  const float* sc = p.scores + r * children;
  std::iota(order, order + children, int64_t(0));
  std::partial_sort(order, order + p.next_k, order + children, [sc](int64_t a, int64_t b) {
    return better(rank_value(sc[a]), a, rank_value(sc[b]), b);
  });
  for (int64_t rank = 0; rank < p.next_k; ++rank) write_next(p, r, rank, order[rank]);
}

}  // namespace expand
}  // namespace taps
