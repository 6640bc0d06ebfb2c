// build_tree, per request (header-only core): EAGLE-2 style candidates -> one ancestor-closed tree
// of num_nodes nodes (docs/SEMANTICS.md, build_tree). The selection and output steps are shared with
// merge_trees in taps/tree.h; this file computes each candidate's depth and effective score. The CUDA
// kernel is in taps/build_tree_kernel.cuh.
#pragma once
#include <cstdint>

#include "taps/tree.h"

namespace taps {
namespace tree {

#if !defined(__CUDA_ARCH__)
struct BuildTreeHostWorkspace {
  std::vector<int32_t> parent;
  std::vector<int32_t> depth;
  std::vector<float> eff;
  HostSelectWorkspace select;
};

// One request on the CPU. scores, tokens, parents: the request's [M] rows; out: its output rows.
// Returns kNoError, or the encoded error of the first bad candidate m (outputs then unset).
// O(M) for depth / eff / validation, then select_and_emit_host.
inline int32_t build_tree_request_host(const float* scores, const int64_t* tokens, const int64_t* parents, int64_t M,
                                       int64_t root_token, const TreeRows& out, BuildTreeHostWorkspace& ws) {
  ws.parent.resize(size_t(M));
  ws.depth.resize(size_t(M));
  ws.eff.resize(size_t(M));
  for (int64_t m = 0; m < M; ++m) {
    const int32_t code = check_candidate(m, tokens, parents, scores);
    if (code != kOk) return encode_error(m, code);
    if (tokens[m] < 0) {  // padding candidate: never kept
      ws.parent[m] = -1;
      ws.depth[m] = -1;
      ws.eff[m] = negative_infinity();
      continue;
    }
    // Parents come first, so one forward pass gives depth and eff = min(score, eff(parent)).
    const int64_t p = parents[m];
    ws.parent[m] = int32_t(p);
    ws.depth[m] = p < 0 ? 1 : ws.depth[p] + 1;
    ws.eff[m] = p < 0 ? scores[m] : (scores[m] < ws.eff[p] ? scores[m] : ws.eff[p]);
  }
  const Candidates c{M, ws.parent.data(), tokens, scores, ws.eff.data(), ws.depth.data(), nullptr};
  select_and_emit_host(c, out, root_token, /*root_extra=*/-1, /*padding_extra=*/-1, ws.select);
  return kNoError;
}
#endif  // !__CUDA_ARCH__

}  // namespace tree
}  // namespace taps
