// The CUDA expand_level kernels of taps/expand_level_kernel.cuh (a warp per logits row, a block per request),
// run under the host CUDA emulation (tests/cpp/emu/cuda_runtime.h), against the CPU kernel's own loops
// (the core's host_row / host_request: a block-filtered scan for the top k, the sums as 32 lanes side by
// side then the shuffle-down tree, std::partial_sort for the next frontier). Bit for bit on all eight
// outputs and the row entropies (float outputs: equal bits, or both NaN), every output prefilled with
// different garbage on the two sides so that an unwritten element shows.
// Cases, in float32, bfloat16 and float16: vocabularies below, at and above one warp's 32 lanes and not a
// multiple of 32, k = 1, k = V, k = 64, a padded row stride (the padding holds huge values), token_map
// present and absent, with_entropy on and off, next_k = 0 and next_k = F * k, many exact ties (logits and
// front scores from a few integers, so the index tie-breaks decide), signed zeros, -inf logits (and a row
// of only -inf), NaN logits (and a row of only NaN: tokens still in [0, V)), cand_offset > 0 with -1
// parents, F = 0 and R = 0.
// Also the core against plain math: the root level's scores against log-softmax in double, the top-k ids
// against a stable sort, the entropy against the double entropy, exp_clamped against std::exp on
// [-87, 0], clamped_shift's clamping.
// Not shown: the device's own logf (log(s) and the entropy may differ there in the last bits), device
// memory-model effects, performance.
#include <cuda_runtime.h>  // the emulation header (tests/cpp/emu is first on the include path)

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "taps/expand_level_kernel.cuh"

#include "check.h"

namespace {

using taps::expand::Params;
using taps::elementwise::kBF16;
using taps::elementwise::kF16;
using taps::elementwise::kF32;
using taps_test::check;
using taps_test::rnd;
using taps_test::rng;

float uniform(float lo, float hi) { return lo + (hi - lo) * float(rng() % 1000000) / 1e6f; }

const char* dtype_name(int T) { return T == kF32 ? "f32" : T == kBF16 ? "bf16" : "f16"; }

// The CPU kernel's computation on one thread: the core's host_row over every row, then host_request over
// every request (what csrc/cpu/expand_level.cpp runs, in parallel and at each instruction-set level).
template <int T>
void reference(const Params& p) {
  using namespace taps::expand;
  float val[kMaxK];
  int64_t idx[kMaxK];
  for (int64_t row = 0; row < p.rows * p.front; ++row) host_row<T>(p, row, val, idx);
  std::vector<int64_t> order(static_cast<size_t>(p.front * p.k));
  for (int64_t r = 0; r < p.rows; ++r) host_request(p, r, order.data());
}

// One side's output buffers, filled with the byte `garbage`.
struct Outputs {
  std::vector<float> scores, row_entropy, entropy, next_scores;
  std::vector<int64_t> tokens, parents, next_tokens, next_slots, next_cands;
  Outputs(int64_t rows, int64_t front, int64_t k, int64_t next_k, unsigned char garbage) {
    const size_t children = size_t(rows * front * k), next = size_t(rows * next_k);
    scores.resize(children);
    tokens.resize(children);
    parents.resize(children);
    row_entropy.resize(size_t(rows * front));
    entropy.resize(size_t(rows));
    next_scores.resize(next);
    next_tokens.resize(next);
    next_slots.resize(next);
    next_cands.resize(next);
    fill(scores, garbage), fill(tokens, garbage), fill(parents, garbage), fill(row_entropy, garbage);
    fill(entropy, garbage), fill(next_scores, garbage), fill(next_tokens, garbage), fill(next_slots, garbage);
    fill(next_cands, garbage);
  }
  template <class V>
  static void fill(V& v, unsigned char garbage) {
    if (!v.empty()) std::memset(v.data(), garbage, v.size() * sizeof(v[0]));
  }
  void point(Params& p) {
    p.scores = scores.data();
    p.tokens = tokens.data();
    p.parents = parents.data();
    p.row_entropy = row_entropy.data();
    p.entropy = entropy.data();
    p.next_scores = next_scores.data();
    p.next_tokens = next_tokens.data();
    p.next_slots = next_slots.data();
    p.next_cands = next_cands.data();
  }
};

// Equal bits, or both NaN.
bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(std::memcmp(&a[i], &b[i], 4) == 0 || (a[i] != a[i] && b[i] != b[i]))) return false;
  return true;
}
bool same_ints(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 8) == 0);
}

enum Fill {
  kRandom,     // uniform in [-8, 8]
  kTies,       // integers in [-3, 2], front scores from {-2, -1, 0}
  kZeros,      // +0, -0, -1
  kNegInf,     // random with 60 % -inf; request 0's row 0 entirely -inf
  kNaN,        // random with a NaN in row 0; the last row entirely NaN
};
const char* fill_name(Fill f) {
  static const char* names[] = {"random", "ties", "zeros", "-inf", "nan"};
  return names[f];
}

struct Case {
  int64_t rows, front, vocab, k, next_k, pad, cand_offset;
  bool token_map, with_entropy;
  Fill fill;
};

template <int T>
void run_case(const Case& c) {
  const int64_t elem = T == kF32 ? 4 : 2, stride = c.vocab + c.pad, nrows = c.rows * c.front;
  // exactly the rows' extent: the last row has no padding after it
  const int64_t extent = nrows > 0 ? (nrows - 1) * stride + c.vocab : 0;
  std::vector<unsigned char> logits(size_t(std::max<int64_t>(extent, 1) * elem));
  for (int64_t row = 0; row < nrows; ++row) {
    for (int64_t i = 0; i < stride && row * stride + i < extent; ++i) {
      float v = uniform(-8.0f, 8.0f);
      if (i >= c.vocab) {
        v = 1e30f;  // padding: would be the maximum if it were read
      } else if (c.fill == kTies) {
        v = float(rnd(-3, 2));
      } else if (c.fill == kZeros) {
        const int z = rnd(0, 2);
        v = z == 0 ? 0.0f : z == 1 ? -0.0f : -1.0f;
      } else if (c.fill == kNegInf) {
        if (row == 0 || rnd(0, 9) < 6) v = -INFINITY;
      } else if (c.fill == kNaN) {
        if (row == nrows - 1 || (row == 0 && i == c.vocab / 2)) v = NAN;
      }
      taps::elementwise::store_t<T>(logits.data(), row * stride + i, v);
    }
  }
  std::vector<float> front_scores(static_cast<size_t>(nrows));
  std::vector<int64_t> front_cands(static_cast<size_t>(nrows)), token_map(static_cast<size_t>(c.vocab));
  for (auto& s : front_scores) s = c.fill == kTies ? float(-rnd(0, 2)) : uniform(-5.0f, 0.0f);
  for (auto& p : front_cands) p = rnd(0, 3) == 0 ? -1 : rnd(0, 200);
  for (auto& t : token_map) t = rnd(0, 150000);

  Params p{};
  p.logits = logits.data();
  p.front_scores = front_scores.data();
  p.front_cands = front_cands.data();
  p.token_map = c.token_map ? token_map.data() : nullptr;
  p.rows = c.rows;
  p.front = c.front;
  p.vocab = c.vocab;
  p.row_stride = stride;
  p.k = c.k;
  p.next_k = c.next_k;
  p.cand_offset = c.cand_offset;
  p.with_entropy = c.with_entropy;
  Params q = p;
  Outputs dev(c.rows, c.front, c.k, c.next_k, 0xA5), ref(c.rows, c.front, c.k, c.next_k, 0x5A);
  dev.point(p);
  ref.point(q);
  const cudaError_t err = taps::expand::launch_expand_level<T>(p, nullptr);
  reference<T>(q);

  const std::string name = std::string("expand_level ") + dtype_name(T) + " " + fill_name(c.fill) +
                           " R=" + std::to_string(c.rows) + " F=" + std::to_string(c.front) + " V=" +
                           std::to_string(c.vocab) + " k=" + std::to_string(c.k) + " next_k=" +
                           std::to_string(c.next_k) + " pad=" + std::to_string(c.pad) +
                           (c.token_map ? " map" : "") + (c.with_entropy ? " entropy" : "") + ": ";
  check(err == cudaSuccess, name + "launch");
  check(same_floats(dev.scores, ref.scores), name + "scores");
  check(same_ints(dev.tokens, ref.tokens), name + "tokens");
  check(same_ints(dev.parents, ref.parents), name + "parents");
  check(same_floats(dev.row_entropy, ref.row_entropy), name + "row_entropy");
  check(same_floats(dev.entropy, ref.entropy), name + "entropy");
  check(same_floats(dev.next_scores, ref.next_scores), name + "next_scores");
  check(same_ints(dev.next_tokens, ref.next_tokens), name + "next_tokens");
  check(same_ints(dev.next_slots, ref.next_slots), name + "next_slots");
  check(same_ints(dev.next_cands, ref.next_cands), name + "next_cands");

  // Independent of the reference: ids in range (through the map when there is one), parents copied, the
  // next frontier's cands / slots consistent and its scores non-increasing in rank_value.
  bool ids_ok = true, parents_ok = true, next_ok = true;
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t f = 0; f < c.front; ++f)
      for (int64_t j = 0; j < c.k; ++j) {
        const size_t ch = size_t((r * c.front + f) * c.k + j);
        const int64_t t = dev.tokens[ch];
        ids_ok = ids_ok && (c.token_map ? std::count(token_map.begin(), token_map.end(), t) > 0
                                        : t >= 0 && t < c.vocab);
        parents_ok = parents_ok && dev.parents[ch] == front_cands[size_t(r * c.front + f)];
      }
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t n = 0; n < c.next_k; ++n) {
      const size_t e = size_t(r * c.next_k + n);
      const int64_t ch = dev.next_cands[e] - c.cand_offset;
      next_ok = next_ok && ch >= 0 && ch < c.front * c.k && dev.next_slots[e] == ch / c.k;
      if (next_ok && n > 0)
        next_ok = taps::expand::rank_value(dev.next_scores[e - 1]) >= taps::expand::rank_value(dev.next_scores[e]);
    }
  check(ids_ok, name + "token ids in range");
  check(parents_ok, name + "parents are front_cands");
  check(next_ok, name + "next frontier consistent");
  if (c.fill == kNegInf && c.front > 0 && c.rows > 0) {  // row 0: only -inf logits
    bool neg = true;
    for (int64_t j = 0; j < c.k; ++j) neg = neg && dev.scores[size_t(j)] == -INFINITY;
    check(neg && dev.row_entropy[0] == 0.0f, name + "a row of only -inf: scores -inf, entropy 0");
  }
  if (c.fill == kNaN && c.front > 0 && c.rows > 0) {  // row 0 holds a NaN: all its log-probs and entropy NaN
    bool nan = true;
    for (int64_t j = 0; j < c.k; ++j) nan = nan && std::isnan(dev.scores[size_t(j)]);
    check(nan && std::isnan(dev.row_entropy[0]) == c.with_entropy, name + "a row with a NaN: scores, entropy NaN");
  }
}

template <int T>
void all_cases() {
  const Case cases[] = {
      {3, 5, 1000, 8, 10, 0, 17, true, true, kRandom},
      {3, 5, 1000, 8, 10, 3, 0, false, false, kRandom},
      {1, 2, 512, 8, 16, 0, 0, false, true, kRandom},       // V a whole number of 8-load rounds (8 x 32 x 2)
      {1, 2, 2049, 10, 20, 1, 0, true, true, kTies},        // one element past them
      {1, 1, 7, 7, 7, 0, 0, false, true, kRandom},         // k = V = F * k = next_k
      {2, 3, 77, 5, 15, 3, 4, true, true, kRandom},         // V not a multiple of 32, next_k = F * k
      {2, 2, 20, 4, 0, 1, 0, false, true, kRandom},         // V < 32, next_k = 0
      {2, 4, 50, 1, 4, 0, 9, true, false, kRandom},         // k = 1
      {1, 2, 64, 64, 100, 0, 0, false, true, kRandom},      // k = V = 64
      {2, 2, 100, 64, 128, 5, 3, true, true, kTies},        // k = 64 < V, next_k = F * k
      {2, 4, 300, 10, 25, 0, 5, false, true, kTies},
      {3, 3, 33, 6, 18, 2, 1, true, true, kTies},
      {2, 3, 70, 9, 12, 0, 0, false, true, kZeros},
      {2, 3, 200, 8, 20, 0, 2, true, true, kNegInf},
      {2, 2, 40, 16, 32, 1, 0, false, true, kNegInf},      // fewer finite logits than k
      {2, 2, 100, 6, 12, 0, 0, false, true, kNaN},
      {1, 3, 31, 4, 5, 2, 7, true, false, kNaN},
      {2, 0, 10, 3, 0, 0, 0, false, true, kRandom},         // F = 0: entropy 0, nothing else
      {0, 3, 10, 3, 2, 0, 0, true, true, kRandom},          // R = 0: nothing
  };
  for (const Case& c : cases) run_case<T>(c);
}

// The root level of f32 rows (front_scores 0) against plain math in double: log-softmax within 1e-5, the
// top-k ids those of a stable sort on (-value, index), the entropy within 1e-4 relative.
void plain_math(bool integer_logits) {
  const int64_t R = 2, F = 3, V = 1000, k = 16;
  std::vector<float> logits(size_t(R * F * V)), front_scores(size_t(R * F), 0.0f);
  std::vector<int64_t> front_cands(size_t(R * F), -1);
  for (auto& x : logits) x = integer_logits ? float(rnd(-6, 6)) : uniform(-6.0f, 6.0f);
  Params p{};
  p.logits = logits.data();
  p.front_scores = front_scores.data();
  p.front_cands = front_cands.data();
  p.rows = R;
  p.front = F;
  p.vocab = V;
  p.row_stride = V;
  p.k = k;
  p.next_k = 0;
  p.with_entropy = true;
  Outputs out(R, F, k, 0, 0xA5);
  out.point(p);
  taps::expand::launch_expand_level<kF32>(p, nullptr);
  double worst_score = 0.0, worst_entropy = 0.0;
  bool ids_ok = true;
  for (int64_t r = 0; r < R; ++r) {
    double request = 0.0;
    for (int64_t f = 0; f < F; ++f) {
      const float* x = logits.data() + (r * F + f) * V;
      double m = -INFINITY, s = 0.0, t = 0.0;
      for (int64_t i = 0; i < V; ++i) m = std::max(m, double(x[i]));
      for (int64_t i = 0; i < V; ++i) s += std::exp(double(x[i]) - m);
      for (int64_t i = 0; i < V; ++i) {
        const double lp = double(x[i]) - m - std::log(s);
        t -= std::exp(lp) * lp;
      }
      request += t;
      std::vector<int64_t> order(static_cast<size_t>(V));
      std::iota(order.begin(), order.end(), int64_t(0));
      std::stable_sort(order.begin(), order.end(), [x](int64_t a, int64_t b) { return x[a] > x[b]; });
      for (int64_t j = 0; j < k; ++j) {
        const size_t c = size_t((r * F + f) * k + j);
        ids_ok = ids_ok && out.tokens[c] == order[size_t(j)];
        const double want = double(x[order[size_t(j)]]) - m - std::log(s);
        worst_score = std::max(worst_score, std::fabs(double(out.scores[c]) - want));
      }
      worst_entropy = std::max(worst_entropy, std::fabs(double(out.row_entropy[size_t(r * F + f)]) - t) / t);
    }
    worst_entropy = std::max(worst_entropy, std::fabs(double(out.entropy[size_t(r)]) - request) / request);
  }
  const std::string name = integer_logits ? "plain math (integer logits): " : "plain math (random logits): ";
  check(ids_ok, name + "top-k ids are a stable sort's");
  check(worst_score <= 1e-5, name + "scores within 1e-5 of log-softmax in double (worst " +
                                 std::to_string(worst_score) + ")");
  check(worst_entropy <= 1e-4, name + "entropy within 1e-4 relative (worst " + std::to_string(worst_entropy) + ")");
}

// Distance in float ulps (both finite, same sign or zero).
int64_t ulps(float a, float b) {
  return std::llabs(int64_t(taps::float_to_ordered(a)) - int64_t(taps::float_to_ordered(b)));
}

// exp_clamped on its domain [-87, 0] against std::exp; clamped_shift's clamping.
void exp_cases() {
  using taps::expand::clamped_shift;
  using taps::expand::exp_clamped;
  int64_t worst = 0;
  float worst_x = 0.0f;
  auto probe = [&](float x) {
    const int64_t d = ulps(exp_clamped(x), std::exp(x));
    if (d > worst) worst = d, worst_x = x;
  };
  const int n = 1000000;
  for (int i = 0; i <= n; ++i) probe(-87.0f * float(i) / float(n));  // 0 down to -87
  for (int i = 0; i < n; ++i) probe(-uniform(0.0f, 87.0f));
  float x = -87.0f;
  for (int j = 0; j < 1000; ++j, x = std::nextafter(x, 0.0f)) probe(x);
  x = -0.0f;
  for (int j = 0; j < 1000; ++j, x = std::nextafter(x, -1.0f)) probe(x);
  probe(0.0f);
  check(worst <= 2, "exp_clamped within 2 ulp of std::exp on [-87, 0] (worst " + std::to_string(worst) +
                        " ulp at " + std::to_string(worst_x) + ")");
  check(exp_clamped(0.0f) == 1.0f && exp_clamped(-0.0f) == 1.0f, "exp_clamped(0) = 1");
  auto bits = [](float v) { return taps::elementwise::float_to_bits(v); };
  check(bits(clamped_shift(-INFINITY, 0.0f)) == bits(-87.0f) && bits(clamped_shift(-100.0f, 1.0f)) == bits(-87.0f) &&
            bits(clamped_shift(-3e38f, 3e38f)) == bits(-87.0f),
        "clamped_shift: -inf and below -87 to -87");
  check(bits(clamped_shift(NAN, 1.0f)) == bits(-0.0f) && bits(clamped_shift(2.0f, 1.0f)) == bits(-0.0f) &&
            bits(clamped_shift(1.0f, 1.0f)) == bits(-0.0f) && bits(clamped_shift(-0.0f, 0.0f)) == bits(-0.0f),
        "clamped_shift: NaN (positive), positive and zero differences to -0");
  check(bits(clamped_shift(-1.5f, 2.25f)) == bits(-3.75f) && bits(clamped_shift(-80.0f, 7.0f)) == bits(-87.0f) &&
            bits(clamped_shift(-79.5f, 7.0f)) == bits(-86.5f),
        "clamped_shift: differences in [-87, 0] kept");
  // -inf logits next to a finite maximum add nothing at float precision: a row (0, -inf, ..., -inf) sums to 1
  float s = 0.0f, t = 0.0f;
  taps::expand::sum_terms(0.0f, 0.0f, s, t);
  for (int i = 0; i < 1000; ++i) taps::expand::sum_terms(-INFINITY, 0.0f, s, t);
  check(s == 1.0f && std::fabs(t) < 1e-30f, "-inf logits add nothing to s (and next to nothing to t)");
}

}  // namespace

int main() {
  rng.seed(2026);
  all_cases<kF32>();
  all_cases<kBF16>();
  all_cases<kF16>();
  plain_math(false);
  plain_math(true);
  exp_cases();
  std::printf("emulated CUDA expand_level vs the CPU kernel's computation, and the core vs plain math\n");
  return taps_test::finish();
}
