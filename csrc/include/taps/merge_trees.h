// merge_trees, per request (header-only core): trie union of T trees under their shared root, then
// the selection and output step of build_tree (taps/tree.h) with the position key in place of the
// candidate index (docs/SEMANTICS.md, merge_trees).
//
// A merged node is identified by its token path; its position key is the smallest (t, i), i.e. the
// smallest occurrence id o = t * N + i, among its occurrences. Its score is the max over occurrences
// of score + weight[t], its source the OR of 1 << t, its depth the trie depth. The CUDA kernel is in
// taps/merge_trees_kernel.cuh.
#pragma once
#include <cstdint>

#include "taps/tree.h"

namespace taps {
namespace tree {

constexpr int64_t kMaxTrees = 63;

// Hash of a trie edge (parent merged node, token); both backends use it (the results never depend on
// it: it only places keys in the tables).
TAPS_HD uint32_t trie_edge_hash(int32_t parent, int64_t token) {
  uint64_t h = uint64_t(token) * 0x9E3779B97F4A7C15ull ^ (uint64_t(uint32_t(parent + 1)) * 0xC2B2AE3D27D4EB4Full);
  h ^= h >> 31;
  h *= 0xD6E8FEB86659FD93ull;
  h ^= h >> 32;
  return uint32_t(h);
}

// Max in the order of float_to_ordered (so -0.0 < +0.0 on both backends).
TAPS_HD float ordered_max(float a, float b) { return float_to_ordered(b) > float_to_ordered(a) ? b : a; }

#if !defined(__CUDA_ARCH__)
struct MergeTreesHostWorkspace {
  std::vector<int32_t> node_of;     // [T * N] occurrence -> merged node (-1 for roots and padding)
  std::vector<int32_t> table;       // [capacity] merged node or -1; open addressing
  std::vector<int32_t> parent;      // merged nodes, in creation (= position key) order
  std::vector<int64_t> token;
  std::vector<float> score;
  std::vector<float> eff;
  std::vector<int32_t> depth;
  std::vector<int64_t> source;
  HostSelectWorkspace select;
};

// One request on the CPU. tokens, parents, scores: the request's [T, N] rows (contiguous); weights:
// its [T] log-weights or nullptr. Returns kNoError or the encoded error of the first bad node in (t, i)
// order, index t * N + i (outputs then unset).
// Occurrences are visited in position-key order, so merged nodes are created in that order and their
// index is a valid tie-breaker; parents always come before children.
inline int32_t merge_trees_request_host(const int64_t* tokens, const int64_t* parents, const float* scores,
                                        const float* weights, int64_t T, int64_t N, const TreeRows& out,
                                        MergeTreesHostWorkspace& ws) {
  const int64_t root_token = tokens[0];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < N; ++i) {
      const int32_t code =
          check_tree_node(i, tokens + t * N, parents + t * N, scores + t * N, root_token, weights ? weights[t] : 0.0f);
      if (code != kOk) return encode_error(t * N + i, code);
    }
  int64_t capacity = 2;
  while (capacity < 2 * T * N) capacity <<= 1;
  ws.node_of.assign(size_t(T * N), -1);
  ws.table.assign(size_t(capacity), -1);
  ws.parent.clear();
  ws.token.clear();
  ws.score.clear();
  ws.depth.clear();
  ws.source.clear();
  for (int64_t t = 0; t < T; ++t) {
    const float w = weights ? weights[t] : 0.0f;
    for (int64_t i = 1; i < N; ++i) {
      const int64_t tok = tokens[t * N + i];
      if (tok < 0) break;  // padding: the rest of the tree is padding
      const int32_t p = ws.node_of[size_t(t * N + parents[t * N + i])];  // -1: the root
      const float s = scores[t * N + i] + w;
      uint32_t h = trie_edge_hash(p, tok) & uint32_t(capacity - 1);
      for (;; h = (h + 1) & uint32_t(capacity - 1)) {
        const int32_t id = ws.table[h];
        if (id < 0) {  // new merged node
          const int32_t fresh = int32_t(ws.parent.size());
          ws.table[h] = fresh;
          ws.parent.push_back(p);
          ws.token.push_back(tok);
          ws.score.push_back(s);
          ws.depth.push_back(p < 0 ? 1 : ws.depth[size_t(p)] + 1);
          ws.source.push_back(int64_t(uint64_t(1) << t));
          ws.node_of[size_t(t * N + i)] = fresh;
          break;
        }
        if (ws.parent[size_t(id)] == p && ws.token[size_t(id)] == tok) {
          ws.score[size_t(id)] = ordered_max(ws.score[size_t(id)], s);
          ws.source[size_t(id)] |= int64_t(uint64_t(1) << t);
          ws.node_of[size_t(t * N + i)] = id;
          break;
        }
      }
    }
  }
  const int64_t U = int64_t(ws.parent.size());
  ws.eff.resize(size_t(U));
  for (int64_t u = 0; u < U; ++u) {
    const int32_t p = ws.parent[size_t(u)];
    const float s = ws.score[size_t(u)];
    ws.eff[size_t(u)] = p < 0 ? s : (s < ws.eff[size_t(p)] ? s : ws.eff[size_t(p)]);
  }
  const Candidates c{U, ws.parent.data(), ws.token.data(), ws.score.data(), ws.eff.data(), ws.depth.data(),
                     ws.source.data()};
  const int64_t all_trees = int64_t((uint64_t(1) << T) - 1);
  select_and_emit_host(c, out, root_token, /*root_extra=*/all_trees, /*padding_extra=*/0, ws.select);
  return kNoError;
}
#endif  // !__CUDA_ARCH__

}  // namespace tree
}  // namespace taps
