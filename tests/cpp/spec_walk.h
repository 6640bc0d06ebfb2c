// verify_tree written out from docs/SEMANTICS.md with plain loops in double precision, sharing no code
// with taps/verify_tree.h: the independent reference the emulated CUDA kernel is checked against (the
// kernel calls verify_walk itself, so a misreading of the spec there would be in both).
//
// Besides the result, each request gets a margin: the smallest distance, relative to the mass, of any
// of its decisions from a boundary (an inverse-CDF coin from a partial sum, an acceptance coin from
// r / q, a top-p cut from the mass at the cut). The float kernels may decide differently from this
// double walk only where the margin is within float rounding.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace spec {

struct Result {
  std::vector<int64_t> tokens, path;  // [N], -1 padded
  int64_t accepted = 0;
  double margin = std::numeric_limits<double>::infinity();
};

// Weights w of the target distribution at a row (T > 0): top-k keeps every token >= the k-th largest
// value; top-p keeps a token when the kept mass strictly above its value is below P * Z.
inline std::vector<double> weights(const float* row, int64_t vocab, float temperature, int64_t top_k, float top_p,
                                   double* margin) {
  std::vector<double> x(row, row + vocab), w(size_t(vocab), 0.0);
  std::vector<bool> kept(size_t(vocab), true);
  if (top_k > 0 && top_k < vocab) {
    std::vector<double> sorted = x;
    std::sort(sorted.begin(), sorted.end(), std::greater<double>());
    for (int64_t v = 0; v < vocab; ++v) kept[size_t(v)] = x[size_t(v)] >= sorted[size_t(top_k - 1)];
  }
  const double m = *std::max_element(x.begin(), x.end());
  double z = 0.0;
  for (int64_t v = 0; v < vocab; ++v) {
    if (kept[size_t(v)]) w[size_t(v)] = std::exp((x[size_t(v)] - m) / double(temperature));
    z += w[size_t(v)];
  }
  if (top_p < 1.0f) {
    const double cut = double(top_p) * z;
    std::vector<double> keep_w(size_t(vocab), 0.0);
    for (int64_t v = 0; v < vocab; ++v) {
      if (!kept[size_t(v)]) continue;
      double above = 0.0;  // kept mass strictly above x_v
      for (int64_t u = 0; u < vocab; ++u)
        if (kept[size_t(u)] && x[size_t(u)] > x[size_t(v)]) above += w[size_t(u)];
      *margin = std::min(*margin, std::fabs(above - cut) / z);
      if (above < cut) keep_w[size_t(v)] = w[size_t(v)];
    }
    w = keep_w;
  }
  return w;
}

// Inverse-CDF draw over `order` with coin u: the first token whose running sum exceeds u * Z, else the
// last one with a positive weight.
inline int64_t draw(const std::vector<double>& w, const std::vector<int64_t>& order, double u, double* margin) {
  double z = 0.0;
  for (int64_t t : order) z += w[size_t(t)];
  const double target = u * z;
  double acc = 0.0;
  int64_t found = -1, last = -1;
  for (int64_t t : order) {
    acc += w[size_t(t)];
    if (w[size_t(t)] > 0.0) last = t;
    *margin = std::min(*margin, std::fabs(acc - target) / z);
    if (found < 0 && acc > target && w[size_t(t)] > 0.0) found = t;
  }
  return found >= 0 ? found : last;
}

// One request: logits [N, V], q [N, V] or nullptr, tokens / parents / uniforms [N].
inline Result walk(const float* logits, const float* q, const int64_t* tokens, const int64_t* parents,
                   const float* uniforms, int64_t n, int64_t vocab, float temperature, int64_t top_k, float top_p) {
  Result r;
  r.tokens.assign(size_t(n), -1);
  r.path.assign(size_t(n), -1);
  r.path[0] = 0;
  std::vector<std::vector<int64_t>> children(static_cast<size_t>(n));
  for (int64_t i = 1; i < n && parents[i] >= 0; ++i) children[size_t(parents[i])].push_back(i);
  int64_t cur = 0, emitted = -1;
  double coin = uniforms[0];
  while (emitted < 0) {
    const float* row = logits + cur * vocab;
    const auto& kids = children[size_t(cur)];
    int64_t next = -1;
    if (!(temperature > 0.0f)) {
      const int64_t y = std::max_element(row, row + vocab) - row;  // the first maximum
      for (int64_t c : kids)
        if (tokens[c] == y) {
          next = c;
          break;
        }
      if (next < 0) emitted = y;
    } else if (q == nullptr) {
      const std::vector<double> w = weights(row, vocab, temperature, top_k, top_p, &r.margin);
      std::vector<int64_t> order;
      std::vector<bool> is_child(size_t(vocab), false);
      for (int64_t c : kids)
        if (!is_child[size_t(tokens[c])]) {
          is_child[size_t(tokens[c])] = true;
          order.push_back(tokens[c]);
        }
      for (int64_t v = 0; v < vocab; ++v)
        if (!is_child[size_t(v)]) order.push_back(v);
      const int64_t y = draw(w, order, uniforms[cur], &r.margin);
      for (int64_t c : kids)
        if (tokens[c] == y) {
          next = c;
          break;
        }
      if (next < 0) emitted = y;
    } else {
      std::vector<double> res = weights(row, vocab, temperature, top_k, top_p, &r.margin);
      double z = 0.0;
      for (double v : res) z += v;
      for (double& v : res) v /= z;
      const float* qrow = q + cur * vocab;
      for (int64_t c : kids) {
        const int64_t s = tokens[c];
        const double qs = qrow[s], rs = res[size_t(s)], u = uniforms[c];
        r.margin = std::min(r.margin, qs > 0.0 ? std::fabs(u - rs / qs) : rs);
        if (u * qs < rs) {
          next = c;
          coin = qs <= rs ? u : u * qs / rs;
          break;
        }
        double sum = 0.0;
        std::vector<double> excess(static_cast<size_t>(vocab));
        for (int64_t v = 0; v < vocab; ++v) sum += excess[size_t(v)] = std::max(res[size_t(v)] - double(qrow[v]), 0.0);
        if (sum > 0.0)
          for (int64_t v = 0; v < vocab; ++v) res[size_t(v)] = excess[size_t(v)] / sum;
      }
      if (next < 0) {
        std::vector<int64_t> ids(static_cast<size_t>(vocab));
        for (int64_t v = 0; v < vocab; ++v) ids[size_t(v)] = v;
        emitted = draw(res, ids, coin, &r.margin);
      }
    }
    if (next >= 0) {
      r.tokens[size_t(r.accepted)] = tokens[next];
      r.path[size_t(++r.accepted)] = next;
      cur = next;
      if (q == nullptr || !(temperature > 0.0f)) coin = uniforms[cur];
    }
  }
  r.tokens[size_t(r.accepted)] = emitted;
  return r;
}

}  // namespace spec
