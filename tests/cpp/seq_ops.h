// A minimal sequential row backend for the verify core, used by the C++ tests as the plain
// reference walk (plain loops, children by scanning parents).
#pragma once
#include <cstdint>

#include "taps/verify_tree.h"

namespace taps {

struct SeqOps {
  static constexpr bool kLeader = true;
  void sync() const {}
  int32_t collect_children(const int64_t* parents, int64_t n, int64_t cur, int32_t* out) const {
    int32_t c = 0;
    for (int64_t i = cur + 1; i < n; ++i)
      if (parents[i] == cur) out[c++] = int32_t(i);
    return c;
  }
  verify::RowScan max_scan(const float* row, int64_t vocab) const {
    verify::RowScan s = verify::scan_identity();
    for (int64_t v = 0; v < vocab; ++v) s = verify::combine_scan(s, verify::scan_one(row[v], v));
    return s;
  }
  float sum_target(const float* row, int64_t vocab, const verify::Target& t) const {
    return sum(vocab, [&](int64_t v) { return verify::target_weight(t, row[v]); });
  }
  template <class G>
  float sum(int64_t vocab, const G& g) const {
    float s = 0;
    for (int64_t v = 0; v < vocab; ++v) s += g(v);
    return s;
  }
  template <class K, class G>
  void histogram(int64_t vocab, const K& key, const G& g, int shift, uint32_t prefix, float* bins) const {
    for (int d = 0; d < 256; ++d) bins[d] = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      const uint32_t k = key(v);
      if (shift < 24 && (k >> (shift + 8)) != (prefix >> (shift + 8))) continue;
      bins[(k >> shift) & 255u] += g(v);
    }
  }
  template <class Row>
  verify::FindResult scan_find_target(const Row& row, int64_t vocab, const verify::Target& t,
                                      const verify::Scratch& s, int32_t distinct, float x) const {
    return verify::scan_find_target_generic(*this, row, vocab, t, s, distinct, x);
  }

  template <class G>
  verify::FindResult scan_find(int64_t vocab, const G& g, float t) const {
    float acc = 0;
    int64_t last = -1;
    for (int64_t v = 0; v < vocab; ++v) {
      const float w = g(v);
      if (w > 0) {
        last = v;
        acc += w;
        if (t < acc) return {v, v};
      }
    }
    return {-1, last};
  }
};

}  // namespace taps
