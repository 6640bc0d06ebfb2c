// verify_tree: the per-request logic, once, for the CPU loop and the CUDA kernel (no torch headers).
//
// docs/SEMANTICS.md is the specification. A request is verified by a walk from the root: at each
// visited node the target row is reduced to a few statistics (max, thresholds, normaliser), the
// children are tested, and the walk moves to an accepted child or emits a token and stops. Only the
// rows of visited nodes are read.
//
// The walk (`verify_walk`) is written once against a "row backend" `Ops`, which supplies the
// collective operations over one logits row:
//   Ops::kLeader             (member bool) true in exactly one participant
//   ops.sync()               barrier (no-op on the CPU)
//   ops.collect_children(parents, n, cur, child_idx) -> count   children of cur in index order
//   ops.max_scan(row, V)     -> RowScan {max, argmax (lowest id), flags}
//   ops.sum(V, g)            -> sum of g(v) over v in [0, V)
//   ops.sum_target(row, V, t) -> sum of target_weight(t, row[v]) (the hot reduction, vectorised)
//   ops.histogram(V, key, g, shift, prefix, bins)  bins[d] = sum of g(v) over v whose key matches
//                            `prefix` above bit shift + 8 and has digit d at `shift`
//   ops.scan_find(V, g, t)   -> FindResult: first v with g(0) + ... + g(v) > t, and the last v with
//                            g(v) > 0 (the rounding fallback)
//   ops.scan_find_target(row, V, target, scratch, distinct, t)  scan_find of the target weights with
//                            the child tokens left out (the draw past the children); a backend may
//                            forward to scan_find_target_generic or skip ahead by block sums
// The CPU backend runs each sequentially in one thread; the CUDA backend runs them with a whole thread
// block (vectorised loads, warp-shuffle reductions), and `kLeader` does the scalar bookkeeping in shared
// memory between barriers. Both see the same `WalkState` and produce the same decisions for the same
// statistics; float sums in different orders may flip a draw only within rounding of a boundary.
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "taps/common.h"

namespace taps {
namespace verify {

// ---------------------------------------------------------------------------------------------------
// Error codes; a request's error is encoded with the offending node as its index (taps/common.h).
// ---------------------------------------------------------------------------------------------------
enum Error : int32_t {
  kErrRootParent = 1,
  kErrParentRange = 2,
  kErrTokenRange = 3,
  kErrPadding = 4,
  kErrTemperature = 5,
  kErrTopK = 6,
  kErrTopP = 7,
  kErrUniform = 8,
  kErrNaNLogits = 9,
  kErrInfLogits = 10,
  kErrNoFiniteLogit = 11,
  kErrDraftProbs = 12,
};

inline const char* error_text(int32_t code) {
  switch (code) {
    case kErrRootParent: return "parents[b, 0] must be -1 (node 0 is the root)";
    case kErrParentRange: return "a real node's parent must be in [0, i) (topological order)";
    case kErrTokenRange: return "a real node's token must be in [0, V)";
    case kErrPadding: return "padding nodes (token -1, parent -1) must come after all real nodes";
    case kErrTemperature: return "temperature must be finite and >= 0";
    case kErrTopK: return "top_k must be >= 0 (0 = off)";
    case kErrTopP: return "top_p must be in (0, 1]";
    case kErrUniform: return "uniforms must be in [0, 1)";
    case kErrNaNLogits: return "logits contain NaN at a visited node";
    case kErrInfLogits: return "logits contain +inf at a visited node";
    case kErrNoFiniteLogit: return "logits at a visited node have no finite value (all -inf)";
    case kErrDraftProbs: return "draft_probs contain a negative or NaN value at a tested token";
    default: return "invalid input";
  }
}

// Checks of one request's tree and parameters (validate=True). Returns kNoError or the encoded first error.
// tokens, parents: [N] of request b; uniforms [N].
TAPS_HD int32_t check_request(const int64_t* tokens, const int64_t* parents, const float* uniforms, int64_t n,
                              int64_t vocab, float temperature, int64_t top_k, float top_p) {
  if (!(temperature >= 0.0f) || !(temperature < INFINITY)) return encode_error(0, kErrTemperature);
  if (top_k < 0) return encode_error(0, kErrTopK);
  if (!(top_p > 0.0f && top_p <= 1.0f)) return encode_error(0, kErrTopP);
  if (n > 0 && parents[0] != -1) return encode_error(0, kErrRootParent);
  bool in_padding = false;
  for (int64_t i = 0; i < n; ++i) {
    const float u = uniforms[i];
    if (!(u >= 0.0f && u < 1.0f)) return encode_error(i, kErrUniform);
    if (i == 0) continue;
    const int64_t tok = tokens[i], par = parents[i];
    if (tok == -1 && par == -1) {
      in_padding = true;
      continue;
    }
    if (in_padding) return encode_error(i, kErrPadding);
    if (tok < 0 || tok >= vocab) return encode_error(i, tok == -1 ? kErrPadding : kErrTokenRange);
    if (par < 0 || par >= i) return encode_error(i, kErrParentRange);
  }
  return kNoError;
}

// ---------------------------------------------------------------------------------------------------
// Row statistics and the target weights w(x).
// ---------------------------------------------------------------------------------------------------
enum RowFlags : int32_t { kRowNaN = 1, kRowPosInf = 2 };

struct RowScan {
  float max;         // max over non-NaN values (-inf if none)
  int64_t argmax;    // lowest index attaining max (0 if none)
  int32_t flags;     // RowFlags
};

// Combine two partial scans (a covers lower indices than b, or ties are resolved by index).
TAPS_HD RowScan combine_scan(RowScan a, RowScan b) {
  RowScan r;
  r.flags = a.flags | b.flags;
  if (b.max > a.max || (b.max == a.max && b.argmax < a.argmax)) {
    r.max = b.max;
    r.argmax = b.argmax;
  } else {
    r.max = a.max;
    r.argmax = a.argmax;
  }
  return r;
}

TAPS_HD RowScan scan_identity() { return RowScan{-INFINITY, INT64_MAX, 0}; }

TAPS_HD RowScan scan_one(float x, int64_t v) {
  if (x != x) return RowScan{-INFINITY, INT64_MAX, kRowNaN};
  return RowScan{x, v, x == INFINITY ? int32_t(kRowPosInf) : 0};
}

// The target distribution at a node: w(x) = exp((x - max) / T) when x >= threshold (float compare, so
// -0.0 and +0.0 tie), else 0; p = w / z.
struct Target {
  float max;
  float inv_temperature;
  float threshold;  // -inf: every token is kept
  float z;
};

TAPS_HD float target_weight(const Target& t, float x) {
  return x >= t.threshold ? expf((x - t.max) * t.inv_temperature) : 0.0f;
}

// Radix search for the largest key K such that F(K) = sum of g(v) over v with key(v) >= K reaches
// `target` (> 0). Four passes over 8-bit digits, most significant first; `bins` holds 256 floats.
// Returns the key (an existing key whenever F(smallest key) >= target).
template <class Ops, class KeyFn, class WeightFn>
TAPS_HD uint32_t radix_threshold(Ops& ops, int64_t vocab, const KeyFn& key, const WeightFn& g, float target,
                                 float* bins) {
  uint32_t prefix = 0;
  float above = 0.0f;  // mass of keys above the current prefix's range
  for (int shift = 24; shift >= 0; shift -= 8) {
    ops.histogram(vocab, key, g, shift, prefix, bins);
    int chosen = 0;
    for (int d = 255; d >= 0; --d) {
      if (above + bins[d] >= target) {
        chosen = d;
        break;
      }
      above += bins[d];
    }
    prefix |= uint32_t(chosen) << shift;
  }
  return prefix;
}

// Statistics of the target at one row (temperature > 0): max, top-k / top-p threshold, normaliser.
template <class Ops, class Row>
TAPS_HD Target target_stats(Ops& ops, const Row& row, int64_t vocab, float temperature, int64_t top_k, float top_p,
                            float* bins, RowScan* scan_out) {
  const RowScan scan = ops.max_scan(row, vocab);
  *scan_out = scan;
  Target t{scan.max, 1.0f / temperature, -INFINITY, 0.0f};
  auto key = [&](int64_t v) { return float_to_ordered(float(row[v])); };
  if (top_k > 0 && top_k < vocab) {
    auto one = [&](int64_t) { return 1.0f; };
    t.threshold = ordered_to_float(radix_threshold(ops, vocab, key, one, float(top_k), bins));
  }
  if (top_p < 1.0f) {
    const float z_k = ops.sum_target(row, vocab, t);
    auto w = [&](int64_t v) { return target_weight(t, float(row[v])); };
    if (z_k > 0.0f) t.threshold = ordered_to_float(radix_threshold(ops, vocab, key, w, top_p * z_k, bins));
  }
  t.z = ops.sum_target(row, vocab, t);
  return t;
}

// ---------------------------------------------------------------------------------------------------
// The walk.
// ---------------------------------------------------------------------------------------------------
struct FindResult {
  int64_t first;  // first v whose running sum exceeds t, or -1
  int64_t last;   // last v with g(v) > 0, or -1
};

// Per-request inputs of the walk. scalar_t: logits element type; prob_t: draft_probs element type.
template <typename scalar_t, typename prob_t>
struct Request {
  const scalar_t* logits;       // [N, V]
  const prob_t* draft_probs;    // [N, V] or nullptr
  const int64_t* tokens;        // [N]
  const int64_t* parents;       // [N]
  const float* uniforms;        // [N]
  int64_t n, vocab;
  float temperature, top_p;
  int64_t top_k;
};

// Scratch of one walk, sized for n nodes (child lists) — shared memory on CUDA, a stack/heap buffer on CPU.
struct Scratch {
  int32_t* child_idx;       // [n] children of the current node, sibling order
  int32_t* sorted_tokens;   // [n] distinct valid child tokens, ascending (for the "is a child token" test)
  uint8_t* first_of_token;  // [n] child j is the first sibling with its token
  float* residual_z;        // [n] normalisers of the rejection residuals (draft_probs mode)
  float* bins;              // [256] radix histogram
};

// Walk state, written by the leader and read by all participants after a sync.
struct WalkState {
  int64_t cur;
  int64_t num_accepted;
  int64_t emit;          // emitted bonus/correction token, -1 while walking
  int64_t pick;          // child picked at the current node, -1 = none
  int32_t num_children;
  int32_t num_distinct;
  int32_t error;
  float coin;
  float remaining;       // the part of the coin's target left after the children (deterministic mode)
  int32_t residual_level;
};

// Sort the distinct valid child tokens (insertion sort into sorted_tokens: n is small in practice;
// O(C^2) worst case for one node with C children) and flag the first sibling of each token.
TAPS_HD void prepare_children(const int64_t* tokens, int64_t vocab, const Scratch& s, WalkState& st) {
  int32_t u = 0;
  for (int32_t j = 0; j < st.num_children; ++j) {
    const int64_t tok = tokens[s.child_idx[j]];
    s.first_of_token[j] = 0;
    if (tok < 0 || tok >= vocab) continue;
    // binary search for tok in sorted_tokens[0, u)
    int32_t lo = 0, hi = u;
    while (lo < hi) {
      const int32_t mid = (lo + hi) >> 1;
      if (s.sorted_tokens[mid] < tok) lo = mid + 1; else hi = mid;
    }
    if (lo < u && s.sorted_tokens[lo] == tok) continue;  // repeated sibling token
    for (int32_t k = u; k > lo; --k) s.sorted_tokens[k] = s.sorted_tokens[k - 1];
    s.sorted_tokens[lo] = int32_t(tok);
    ++u;
    s.first_of_token[j] = 1;
  }
  st.num_distinct = u;
}

TAPS_HD bool is_child_token(const Scratch& s, int32_t count, int64_t v) {
  int32_t lo = 0, hi = count;
  while (lo < hi) {
    const int32_t mid = (lo + hi) >> 1;
    if (s.sorted_tokens[mid] < v) lo = mid + 1; else hi = mid;
  }
  return lo < count && s.sorted_tokens[lo] == v;
}

// The draw past the children: the first non-child token whose running target weight exceeds t.
template <class Ops, class Row>
TAPS_HD FindResult scan_find_target_generic(Ops& ops, const Row& row, int64_t vocab, const Target& target,
                                            const Scratch& s, int32_t distinct, float t) {
  auto g = [&](int64_t v) { return is_child_token(s, distinct, v) ? 0.0f : target_weight(target, float(row[v])); };
  return ops.scan_find(vocab, g, t);
}

// Residual of the recursive rejection after `level` rejections at a node, at token v:
// r_0 = w / z, r_l = max(r_{l-1} - q, 0) / residual_z[l - 1].
TAPS_HD float residual_at(float w_over_z, float q, const float* residual_z, int32_t level) {
  float r = w_over_z;
  for (int32_t l = 0; l < level; ++l) {
    r = r - q;
    r = (r > 0.0f ? r : 0.0f) / residual_z[l];
  }
  return r;
}

// max(r_level - q, 0) at a token: the mass a rejection at `level` leaves (summed: the next level's normaliser).
TAPS_HD float residual_excess(const Target& t, float x, float q, const float* residual_z, int32_t level) {
  const float e = residual_at(target_weight(t, x) / t.z, q, residual_z, level) - q;
  return e > 0.0f ? e : 0.0f;
}

// The weight a draw past a drawn node's children gives a token: the target weight with no rejection at the node
// (level 0; total t.z), the residual r_level after `level` rejections (total 1).
TAPS_HD float residual_weight(const Target& t, float x, float q, const float* residual_z, int32_t level) {
  return level == 0 ? target_weight(t, x) : residual_at(target_weight(t, x) / t.z, q, residual_z, level);
}

// Backends that offer the residual passes as their own ops (static constexpr bool kResidualPasses = true and
// residual_sum(row, q, V, target, residual_z, level) -> float, the sum of residual_excess over the row;
// residual_find(row, q, V, target, residual_z, level, t) -> FindResult, scan_find of residual_weight): the CPU's
// vectorised ones. Others (the CUDA block backend) run the generic ops.sum / ops.scan_find over the same terms.
template <class Ops, class = void>
struct residual_passes : std::false_type {};
template <class Ops>
struct residual_passes<Ops, std::void_t<decltype(Ops::kResidualPasses)>> : std::bool_constant<Ops::kResidualPasses> {};

// Output rows of one request: out_tokens [N], path [N] (pre-filled with -1 by the caller),
// num_accepted [1], error [1].
struct Outputs {
  int64_t* tokens;
  int64_t* path;
  int64_t* num_accepted;
  int32_t* error;
};

// The walk of one request. Every participant calls it; `ops` makes the collective calls collective.
// With validate, a visited row with NaN / +inf / no finite value stops the walk with an error.
template <class Ops, typename scalar_t, typename prob_t>
TAPS_HD void verify_walk(Ops& ops, const Request<scalar_t, prob_t>& rq, const Scratch& s, WalkState& st,
                         const Outputs& out, bool validate) {
  const bool greedy = !(rq.temperature > 0.0f);
  const bool sampled_children = rq.draft_probs != nullptr && !greedy;
  if (ops.kLeader) {
    st.cur = 0;
    st.num_accepted = 0;
    st.emit = -1;
    st.error = kNoError;
    st.coin = rq.uniforms[0];
    out.path[0] = 0;
  }
  ops.sync();
  for (int64_t step = 0; step < rq.n; ++step) {
    const int64_t cur = st.cur;
    const scalar_t* row = rq.logits + cur * rq.vocab;
    const int32_t count = ops.collect_children(rq.parents, rq.n, cur, s.child_idx);
    if (ops.kLeader) {
      st.num_children = count;
      st.pick = -1;
      st.residual_level = 0;
      prepare_children(rq.tokens, rq.vocab, s, st);
    }
    ops.sync();
    RowScan scan;
    Target target{};
    if (greedy) {
      scan = ops.max_scan(row, rq.vocab);
    } else {
      target = target_stats(ops, row, rq.vocab, rq.temperature, rq.top_k, rq.top_p, s.bins, &scan);
    }
    if (validate && (scan.flags != 0 || !(scan.max > -INFINITY))) {
      if (ops.kLeader) {
        st.error = encode_error(cur, (scan.flags & kRowNaN) ? kErrNaNLogits
                                     : (scan.flags & kRowPosInf) ? kErrInfLogits : kErrNoFiniteLogit);
      }
      ops.sync();
      break;
    }
    const int64_t argmax = scan.argmax < rq.vocab ? scan.argmax : 0;

    if (greedy) {
      if (ops.kLeader) {
        for (int32_t j = 0; j < st.num_children; ++j) {
          if (rq.tokens[s.child_idx[j]] == argmax) {
            st.pick = s.child_idx[j];
            break;
          }
        }
        if (st.pick < 0) st.emit = argmax;
      }
    } else if (!sampled_children) {
      // Deterministic candidates: inverse CDF with the distinct child tokens first.
      if (ops.kLeader) {
        const float t = st.coin * target.z;
        float acc = 0.0f;
        for (int32_t j = 0; j < st.num_children; ++j) {
          if (!s.first_of_token[j]) continue;
          acc += target_weight(target, float(row[rq.tokens[s.child_idx[j]]]));
          if (t < acc) {
            st.pick = s.child_idx[j];
            break;
          }
        }
        st.remaining = t - acc;
      }
      ops.sync();
      if (st.pick < 0) {
        const FindResult found = ops.scan_find_target(row, rq.vocab, target, s, st.num_distinct, st.remaining);
        if (ops.kLeader) {
          int64_t y = found.first >= 0 ? found.first : found.last;
          if (y < 0) {  // every kept token is a child token and rounding left the coin past them all
            for (int32_t j = st.num_children - 1; j >= 0 && y < 0; --j) {
              const int64_t tok = rq.tokens[s.child_idx[j]];
              if (s.first_of_token[j] && target_weight(target, float(row[tok])) > 0.0f) y = tok;
            }
          }
          st.emit = y >= 0 ? y : argmax;  // no positive weight at all (invalid row, validate=False)
        }
      }
    } else {
      // Sampled children: recursive rejection sampling over the siblings.
      const prob_t* qrow = rq.draft_probs + cur * rq.vocab;
      for (int32_t j = 0; j < st.num_children; ++j) {
        const int32_t level = st.residual_level;
        if (ops.kLeader) {
          const int64_t c = s.child_idx[j];
          const int64_t tok = rq.tokens[c];
          if (tok >= 0 && tok < rq.vocab) {
            const float q = float(qrow[tok]);
            if (validate && !(q >= 0.0f)) st.error = encode_error(cur, kErrDraftProbs);
            const float r = residual_at(target_weight(target, float(row[tok])) / target.z, q, s.residual_z, level);
            const float u = rq.uniforms[c];
            if (u * q < r) {
              st.pick = c;
              st.coin = q <= r ? u : u * q / r;
            }
          }
        }
        ops.sync();
        if (st.pick >= 0 || st.error != kNoError) break;
        // rejected: r <- max(r - q, 0) / sum(max(r - q, 0))
        float z;
        if constexpr (residual_passes<Ops>::value) {
          z = ops.residual_sum(row, qrow, rq.vocab, target, s.residual_z, level);
        } else {
          z = ops.sum(rq.vocab, [&](int64_t v) {
            return residual_excess(target, float(row[v]), float(qrow[v]), s.residual_z, level);
          });
        }
        if (ops.kLeader && z > 0.0f) {
          s.residual_z[level] = z;
          st.residual_level = level + 1;
        }
        ops.sync();
      }
      if (st.error != kNoError) break;
      if (st.pick < 0) {
        const int32_t level = st.residual_level;
        const float total = level == 0 ? target.z : 1.0f;
        FindResult found;
        if constexpr (residual_passes<Ops>::value) {
          found = ops.residual_find(row, qrow, rq.vocab, target, s.residual_z, level, st.coin * total);
        } else {
          found = ops.scan_find(rq.vocab, [&](int64_t v) {
            return residual_weight(target, float(row[v]), float(qrow[v]), s.residual_z, level);
          }, st.coin * total);
        }
        if (ops.kLeader) st.emit = found.first >= 0 ? found.first : (found.last >= 0 ? found.last : argmax);
      }
    }

    if (ops.kLeader) {
      if (st.pick >= 0) {
        st.num_accepted += 1;
        out.path[st.num_accepted] = st.pick;
        out.tokens[st.num_accepted - 1] = rq.tokens[st.pick];
        st.cur = st.pick;
        if (!sampled_children) st.coin = rq.uniforms[st.pick];
      } else {
        out.tokens[st.num_accepted] = st.emit;
      }
    }
    ops.sync();
    if (st.pick < 0) break;
  }
  if (ops.kLeader) {
    *out.num_accepted = st.num_accepted;
    *out.error = st.error;
  }
}

}  // namespace verify
}  // namespace taps
