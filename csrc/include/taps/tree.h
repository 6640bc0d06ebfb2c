// Shared tree helpers of build_tree and merge_trees (header-only core, no torch headers).
//
// Both ops reduce to one step, "select and emit" (docs/SEMANTICS.md, build_tree): given candidates
// with a parent (-1 = the root, else an earlier candidate), a score, an effective score
// eff(c) = min(score(c), eff(parent(c))) and a depth, keep the first `num_nodes - 1` real candidates
// ranked by (eff descending, depth ascending, index ascending), then emit them breadth first with
// siblings ordered by (score descending, index ascending), plus depth, ancestor bitmask and padding.
// build_tree's candidate index and merge_trees' position key are both "the index" here.
//
// This header holds:
// - error codes and texts shared by the CPU and CUDA bindings (identical messages on both);
// - order keys (a smaller key ranks first) and the per-node input checks, as TAPS_HD functions;
// - the output row writers (root, padding, ancestor bitmask words);
// - select_and_emit_host: the sequential O(M + K log K) step used by the CPU kernels.
// The same step for one CUDA thread block is select_and_emit_block in taps/tree_kernel.cuh.
#pragma once
#include <cstdint>

#include "taps/common.h"

#if !defined(__CUDA_ARCH__)
#include <algorithm>
#include <vector>
#endif

namespace taps {
namespace tree {

// ---------------------------------------------------------------------------------------------------
// Error codes; a request's error is encoded (taps/common.h) with the first offending candidate m
// (build_tree) or occurrence t * N + i (merge_trees) as its index, so that the CPU (first in index
// order) and CUDA (atomicMin) report the same one.
// ---------------------------------------------------------------------------------------------------
enum Error : int32_t {
  kErrParentRange = 1,     // build_tree: parent of a real candidate not -1 and not in [0, m)
  kErrParentPadding = 2,   // build_tree: parent of a real candidate is a padding candidate
  kErrNaNScore = 3,        // NaN score of a real candidate / node
  kErrRootParent = 4,      // merge_trees: parents[b, t, 0] != -1
  kErrRootMismatch = 5,    // merge_trees: root token differs from tree 0's
  kErrNotTopological = 6,  // merge_trees: real node's parent not in [0, i)
  kErrPaddingOrder = 7,    // merge_trees: real node after a padding node
  kErrBadPadding = 8,      // merge_trees: padding node without token -1 and parent -1
  kErrNaNWeight = 9,       // merge_trees: NaN weight
};

inline const char* error_text(int32_t code) {
  switch (code) {
    case kErrParentRange: return "the parent of a real candidate must be -1 or an earlier candidate index";
    case kErrParentPadding: return "the parent of a real candidate is a padding candidate (token < 0)";
    case kErrNaNScore: return "score is NaN";
    case kErrRootParent: return "the root (node 0) must have parent -1";
    case kErrRootMismatch: return "root token differs from tree 0's root token (all T trees must share the root)";
    case kErrNotTopological: return "a real node's parent must be in [0, i) (topological order)";
    case kErrPaddingOrder: return "a real node follows a padding node (padding must come after all real nodes)";
    case kErrBadPadding: return "a padding node must have token -1 and parent -1";
    case kErrNaNWeight: return "weight is NaN";
    default: return "invalid input";
  }
}

// ---------------------------------------------------------------------------------------------------
// Order keys: a smaller key ranks first.
// ---------------------------------------------------------------------------------------------------

// Key of a float for "descending" order. -0.0 and +0.0 compare equal (as floats do); NaN never
// reaches here (it is an input error; the CUDA kernels map it to -inf before raising).
TAPS_HD uint32_t descending_key(float x) {
  if (x == 0.0f) x = 0.0f;
  return ~float_to_ordered(x);
}

// Selection order: (eff descending, depth ascending, index ascending).
TAPS_HD bool select_less(float eff_a, int32_t depth_a, int32_t idx_a, float eff_b, int32_t depth_b, int32_t idx_b) {
  const uint32_t ka = descending_key(eff_a), kb = descending_key(eff_b);
  if (ka != kb) return ka < kb;
  if (depth_a != depth_b) return depth_a < depth_b;
  return idx_a < idx_b;
}

// Sibling order: (score descending, index ascending).
TAPS_HD bool sibling_less(float score_a, int32_t idx_a, float score_b, int32_t idx_b) {
  const uint32_t ka = descending_key(score_a), kb = descending_key(score_b);
  if (ka != kb) return ka < kb;
  return idx_a < idx_b;
}

// Packed 64-bit forms of the two orders for the CUDA block sort (index, depth < 2^16).
constexpr uint64_t kMaxKey = ~uint64_t(0);  // sorts last: a candidate that is not real
TAPS_HD uint64_t pack_select_key(float eff, int32_t depth, int32_t idx) {
  return (uint64_t(descending_key(eff)) << 32) | (uint64_t(uint32_t(depth) & 0xffffu) << 16) |
         uint64_t(uint32_t(idx) & 0xffffu);
}
TAPS_HD int32_t select_key_index(uint64_t key) { return int32_t(key & 0xffffu); }
// (parent slot + 1, score descending, index): groups siblings, best first.
TAPS_HD uint64_t pack_sibling_key(int32_t parent_slot, float score, int32_t idx) {
  return (uint64_t(uint32_t(parent_slot + 1) & 0xffffu) << 48) | (uint64_t(descending_key(score)) << 16) |
         uint64_t(uint32_t(idx) & 0xffffu);
}
TAPS_HD int32_t sibling_key_index(uint64_t key) { return int32_t(key & 0xffffu); }
TAPS_HD int32_t sibling_key_parent_slot(uint64_t key) { return int32_t(key >> 48) - 1; }

// ---------------------------------------------------------------------------------------------------
// Input checks (one node each, so the CUDA kernels run them in parallel and the CPU in a loop).
// ---------------------------------------------------------------------------------------------------

// build_tree candidate m of a request with M candidates (tokens/parents/scores: that request's rows).
// Returns an Error code (kOk for a padding candidate or a valid real one).
TAPS_HD int32_t check_candidate(int64_t m, const int64_t* tokens, const int64_t* parents, const float* scores) {
  if (tokens[m] < 0) return kOk;  // padding candidate: never kept, parent and score unused
  const int64_t p = parents[m];
  if (p != -1 && (p < 0 || p >= m)) return kErrParentRange;
  if (p >= 0 && tokens[p] < 0) return kErrParentPadding;
  if (scores[m] != scores[m]) return kErrNaNScore;
  return kOk;
}

// merge_trees node i of tree t (tokens/parents/scores: that tree's rows; root_token: tree 0's root
// token of the request; weight: the tree's log-weight, checked at i == 0).
TAPS_HD int32_t check_tree_node(int64_t i, const int64_t* tokens, const int64_t* parents, const float* scores,
                                int64_t root_token, float weight) {
  const int64_t tok = tokens[i], p = parents[i];
  if (i == 0) {
    if (p != -1) return kErrRootParent;
    if (tok != root_token) return kErrRootMismatch;
    if (weight != weight) return kErrNaNWeight;
    return kOk;
  }
  if (tok < 0) return (tok == -1 && p == -1) ? kOk : kErrBadPadding;
  if (i >= 2 && tokens[i - 1] < 0) return kErrPaddingOrder;
  if (p < 0 || p >= i) return kErrNotTopological;
  if (scores[i] != scores[i]) return kErrNaNScore;
  return kOk;
}

// ---------------------------------------------------------------------------------------------------
// Outputs of one request: rows of [B, num_nodes] tensors (tree_mask: [num_nodes, words]).
// ---------------------------------------------------------------------------------------------------
struct TreeRows {
  int64_t* tokens;
  int64_t* parents;
  int64_t* depth;
  int64_t* tree_mask;
  float* scores;
  int64_t* extra;  // candidate_index (build_tree) or source (merge_trees)
  int64_t num_nodes;
  int64_t words;  // ceil(num_nodes / 64)
};

struct TreeBatch {  // [B, ...] contiguous outputs
  int64_t* tokens;
  int64_t* parents;
  int64_t* depth;
  int64_t* tree_mask;
  float* scores;
  int64_t* extra;
  int64_t num_nodes;
  int64_t words;
  TAPS_HD TreeRows request(int64_t b) const {
    const int64_t n = num_nodes;
    return TreeRows{tokens + b * n, parents + b * n, depth + b * n, tree_mask + b * n * words,
                    scores + b * n,  extra + b * n,   n,         words};
  }
};

TAPS_HD float negative_infinity() { return ordered_to_float(0x007fffffu); }  // = float_to_ordered(-inf)

// Padding row i: token -1, parent -1, depth -1, score -inf, extra `padding_extra`, mask row zero.
TAPS_HD void write_padding_row(const TreeRows& out, int64_t i, int64_t padding_extra) {
  out.tokens[i] = -1;
  out.parents[i] = -1;
  out.depth[i] = -1;
  out.scores[i] = negative_infinity();
  out.extra[i] = padding_extra;
  for (int64_t w = 0; w < out.words; ++w) out.tree_mask[i * out.words + w] = 0;
}

// ---------------------------------------------------------------------------------------------------
// select_and_emit, sequential (CPU). Candidates of one request, all arrays of `count` entries:
// parent (-1 = root, else an earlier candidate), token, score, eff, depth (>= 1 for a real candidate,
// <= 0 for one that is never kept), extra (value of the extra output column; nullptr = the index).
// ---------------------------------------------------------------------------------------------------
struct Candidates {
  int64_t count;
  const int32_t* parent;
  const int64_t* token;
  const float* score;
  const float* eff;
  const int32_t* depth;
  const int64_t* extra;
};

#if !defined(__CUDA_ARCH__)
// Scratch of select_and_emit_host, reused across the requests of one CPU task.
struct HostSelectWorkspace {
  std::vector<int32_t> real;         // real candidates; the first K are kept
  std::vector<uint64_t> keys;        // packed order keys (the common case)
  std::vector<int32_t> first_child;  // [count + 1], index parent + 1: first child in `real`
  std::vector<int32_t> num_children; // [count + 1]
  std::vector<int32_t> order;        // [K + 1] output position -> candidate (-1 = root)
  std::vector<int32_t> out_parent;   // [K + 1] output position -> parent's output position
};

// Emits one request's tree into `out`. O(count) selection (nth_element) + O(K log K) sibling sort
// + O(K * words) masks.
inline void select_and_emit_host(const Candidates& c, const TreeRows& out, int64_t root_token, int64_t root_extra,
                                 int64_t padding_extra, HostSelectWorkspace& ws) {
  ws.real.clear();
  const int64_t keep_max = out.num_nodes - 1;
  int64_t keep;
  if (c.count <= 0xffff) {
    // Common case: indices and depths fit 16 bits, so both orders are plain 64-bit keys.
    ws.keys.clear();
    for (int64_t i = 0; i < c.count; ++i)
      if (c.depth[i] >= 1) ws.keys.push_back(pack_select_key(c.eff[i], c.depth[i], int32_t(i)));
    const int64_t num_real = int64_t(ws.keys.size());
    keep = std::min<int64_t>(keep_max, num_real);
    if (keep < num_real) std::nth_element(ws.keys.begin(), ws.keys.begin() + keep, ws.keys.end());
    for (int64_t j = 0; j < keep; ++j) {
      const int32_t i = select_key_index(ws.keys[j]);
      ws.keys[j] = pack_sibling_key(c.parent[i], c.score[i], i);
    }
    std::sort(ws.keys.begin(), ws.keys.begin() + keep);
    ws.real.resize(size_t(keep));
    for (int64_t j = 0; j < keep; ++j) ws.real[j] = sibling_key_index(ws.keys[j]);
  } else {
    for (int64_t i = 0; i < c.count; ++i)
      if (c.depth[i] >= 1) ws.real.push_back(int32_t(i));
    const int64_t num_real = int64_t(ws.real.size());
    keep = std::min<int64_t>(keep_max, num_real);
    auto by_selection = [&c](int32_t a, int32_t b) {
      return select_less(c.eff[a], c.depth[a], a, c.eff[b], c.depth[b], b);
    };
    if (keep < num_real) std::nth_element(ws.real.begin(), ws.real.begin() + keep, ws.real.end(), by_selection);
    // The kept set is closed under ancestors (a parent ranks strictly before its children), so the
    // parent of every kept candidate is the root or kept. Group siblings, best first.
    auto by_sibling = [&c](int32_t a, int32_t b) {
      if (c.parent[a] != c.parent[b]) return c.parent[a] < c.parent[b];
      return sibling_less(c.score[a], a, c.score[b], b);
    };
    std::sort(ws.real.begin(), ws.real.begin() + keep, by_sibling);
  }
  // ws.real[0, keep): the kept candidates grouped by parent (the root's children first), each group
  // in sibling order. The kept set is closed under ancestors (a parent ranks strictly before its
  // children), so every kept candidate's parent is the root or kept.
  ws.first_child.resize(size_t(c.count + 1));
  ws.num_children.resize(size_t(c.count + 1));
  ws.num_children[0] = 0;
  ws.first_child[0] = 0;
  for (int64_t j = 0; j < keep; ++j) ws.num_children[size_t(ws.real[j] + 1)] = 0;
  for (int64_t j = 0; j < keep; ++j) {
    const int32_t p1 = c.parent[ws.real[j]] + 1;
    if (ws.num_children[p1]++ == 0) ws.first_child[p1] = int32_t(j);
  }
  // Breadth first: a queue over output positions; children of each node appended in sibling order,
  // which is exactly (depth, parent's output index, score desc, index asc).
  ws.order.resize(size_t(keep + 1));
  ws.out_parent.resize(size_t(keep + 1));
  ws.order[0] = -1;
  ws.out_parent[0] = -1;
  int64_t tail = 1;
  for (int64_t head = 0; head < tail; ++head) {
    const int32_t p1 = ws.order[head] + 1;
    for (int32_t j = ws.first_child[p1], e = j + ws.num_children[p1]; j < e; ++j) {
      ws.order[tail] = ws.real[j];
      ws.out_parent[tail] = int32_t(head);
      ++tail;
    }
  }
  // tail == keep + 1 here (every kept candidate's parent is the root or kept).
  const int64_t W = out.words;
  out.tokens[0] = root_token;
  out.parents[0] = -1;
  out.depth[0] = 0;
  out.scores[0] = 0.0f;
  out.extra[0] = root_extra;
  for (int64_t w = 0; w < W; ++w) out.tree_mask[w] = w == 0 ? 1 : 0;
  for (int64_t i = 1; i < tail; ++i) {
    const int32_t cand = ws.order[i];
    const int64_t p = ws.out_parent[i];
    out.tokens[i] = c.token[cand];
    out.parents[i] = p;
    out.depth[i] = c.depth[cand];
    out.scores[i] = c.score[cand];
    out.extra[i] = c.extra ? c.extra[cand] : cand;
    int64_t* row = out.tree_mask + i * W;
    const int64_t* parent_row = out.tree_mask + p * W;
    for (int64_t w = 0; w < W; ++w) row[w] = parent_row[w];
    row[i >> 6] |= int64_t(uint64_t(1) << (i & 63));
  }
  for (int64_t i = tail; i < out.num_nodes; ++i) write_padding_row(out, i, padding_extra);
}
#endif  // !__CUDA_ARCH__

}  // namespace tree
}  // namespace taps
