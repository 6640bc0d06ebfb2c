// build_tree, per request (header-only core): EAGLE-2 style candidates -> one ancestor-closed tree
// of num_nodes nodes (docs/SEMANTICS.md, build_tree). The selection and output steps are shared with
// merge_trees in taps/tree.h; this file computes each candidate's depth and effective score.
#pragma once
#include <cstdint>

#include "taps/tree.h"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif

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

// ---------------------------------------------------------------------------------------------------
// CUDA: one thread block per request; all per-request state in dynamic shared memory.
// NOTE: compiled (sm_80, sm_90a) but never run on a GPU so far.
//
// Size limits: M <= 65535 candidates and num_nodes <= 65535 (16-bit fields of the sort keys), and the
// shared memory of build_tree_smem_bytes(M, num_nodes) (about 40 bytes per candidate, padded to a power
// of two for the sort, plus about 36 bytes per output node) must fit the device's opt-in limit per block
// (227 KiB on H100/H200 and 163 KiB on A100: M up to about 4000 with num_nodes = 64). The binding
// raises beyond these limits (no global-memory fallback).
// ---------------------------------------------------------------------------------------------------
#if defined(__CUDACC__)
namespace taps {
namespace tree {

constexpr int kBuildTreeThreads = 512;
constexpr int64_t kBuildTreeMaxCandidates = 65535;

// Bytes of shared memory used per block (the layout of build_tree_kernel below).
inline size_t build_tree_smem_bytes(int64_t M, int64_t num_nodes) {
  const int64_t key_count = next_pow2(int32_t(M > 1 ? M : 1));
  const int64_t sib_count = next_pow2(int32_t(num_nodes - 1 > 1 ? num_nodes - 1 : 1));
  return size_t(8 * (key_count + sib_count) + 4 * (8 * M) + 4 * (kBlockSelectInts * num_nodes + 5));
}

struct CandidateIndexExtra {
  __device__ int64_t operator()(int32_t c) const { return c; }
};

// scores, tokens, parents: [B, M]; root_tokens: [B] or nullptr; out: [B, num_nodes] (+ mask words);
// errors: [B] int32, kNoError on entry, set to the encoded error of the first bad candidate.
// grid = B, block = kBuildTreeThreads, dynamic shared memory = build_tree_smem_bytes(M, num_nodes).
__global__ void __launch_bounds__(kBuildTreeThreads)
    build_tree_kernel(const float* __restrict__ scores, const int64_t* __restrict__ tokens,
                      const int64_t* __restrict__ parents, const int64_t* __restrict__ root_tokens, int32_t M,
                      TreeBatch out_batch, int32_t* __restrict__ errors) {
  TAPS_DYNAMIC_SHARED(unsigned char, smem);
  const int64_t b = blockIdx.x;
  const int32_t tid = int32_t(threadIdx.x), nthreads = int32_t(blockDim.x);
  const int32_t num_nodes = int32_t(out_batch.num_nodes);
  const int32_t key_count = next_pow2(M > 1 ? M : 1);
  const int32_t sib_count = next_pow2(num_nodes - 1 > 1 ? num_nodes - 1 : 1);
  scores += b * M;
  tokens += b * M;
  parents += b * M;

  // Layout (8-byte arrays first).
  uint64_t* select_keys = reinterpret_cast<uint64_t*>(smem);
  uint64_t* sibling_keys = select_keys + key_count;
  int32_t* parent = reinterpret_cast<int32_t*>(sibling_keys + sib_count);  // sanitized parent
  int32_t* const anc[2] = {parent + M, parent + 2 * M};  // pointer jumping, double buffered
  int32_t* const dep[2] = {parent + 3 * M, parent + 4 * M};
  float* const eff[2] = {reinterpret_cast<float*>(parent + 5 * M), reinterpret_cast<float*>(parent + 6 * M)};
  float* score = reinterpret_cast<float*>(parent + 7 * M);
  int32_t* select_ints = parent + 8 * M;
  BlockSelectScratch scratch;
  scratch.sibling_keys = sibling_keys;
  scratch.slot_of = anc[0];  // free once the jumping is done
  scratch.group_begin = select_ints;
  scratch.group_end = select_ints + num_nodes;
  scratch.pos_of_slot = select_ints + 2 * num_nodes;
  scratch.out_parent = select_ints + 3 * num_nodes;
  scratch.out_cand = select_ints + 4 * num_nodes;
  scratch.child_count = select_ints + 5 * num_nodes;
  scratch.child_before = select_ints + 6 * num_nodes;
  scratch.level = select_ints + kBlockSelectInts * num_nodes;

  // Load and check. A bad candidate is reported through `errors` and sanitized so that the rest
  // stays in bounds: a bad parent becomes the root, a NaN score -inf.
  for (int32_t m = tid; m < M; m += nthreads) {
    const int32_t code = check_candidate(m, tokens, parents, scores);
    if (code != kOk) atomicMin(errors + b, encode_error(m, code));
    const bool real = tokens[m] >= 0;
    const int64_t p = parents[m];
    const bool parent_ok = real && p >= 0 && p < m && tokens[p] >= 0;
    float s = scores[m];
    if (s != s) s = negative_infinity();
    parent[m] = parent_ok ? int32_t(p) : -1;
    anc[0][m] = parent[m];
    dep[0][m] = real ? 1 : 0;
    eff[0][m] = s;
    score[m] = s;
  }
  __syncthreads();
  // Pointer jumping: (eff, dep) of m aggregate the path from m up to, not including, anc(m); after
  // ceil(log2(max depth)) + 1 rounds every anc is -1 and they cover the whole path to the root:
  // eff = min of the scores on it, dep = its length.
  // (Pointers swapped each round rather than arrays indexed by the round, which would live on the stack.)
  int32_t *anc_cur = anc[0], *anc_nxt = anc[1], *dep_cur = dep[0], *dep_nxt = dep[1];
  float *eff_cur = eff[0], *eff_nxt = eff[1];
  for (;;) {
    int any = 0;
    for (int32_t m = tid; m < M; m += nthreads) {
      const int32_t a = anc_cur[m];
      if (a >= 0) {
        eff_nxt[m] = fminf(eff_cur[m], eff_cur[a]);
        dep_nxt[m] = dep_cur[m] + dep_cur[a];
        anc_nxt[m] = anc_cur[a];
        any |= anc_nxt[m] >= 0;
      } else {
        eff_nxt[m] = eff_cur[m];
        dep_nxt[m] = dep_cur[m];
        anc_nxt[m] = -1;
      }
    }
    int32_t* t32 = anc_cur;
    anc_cur = anc_nxt;
    anc_nxt = t32;
    t32 = dep_cur;
    dep_cur = dep_nxt;
    dep_nxt = t32;
    float* tf = eff_cur;
    eff_cur = eff_nxt;
    eff_nxt = tf;
    if (!__syncthreads_or(any)) break;
  }
  const int32_t* depth = dep_cur;
  for (int32_t j = tid; j < key_count; j += nthreads)
    select_keys[j] = (j < M && depth[j] >= 1) ? pack_select_key(eff_cur[j], depth[j], j) : kMaxKey;
  __syncthreads();
  const int64_t root_token = root_tokens ? root_tokens[b] : -1;
  select_and_emit_block(select_keys, key_count, parent, tokens, score, depth, CandidateIndexExtra{},
                        out_batch.request(b), root_token, /*root_extra=*/-1, /*padding_extra=*/-1, scratch);
}

// Launches build_tree_kernel for a batch of B requests on `stream`. Sizes must be within the limits
// above (checked by the binding). Returns the launch error, if any.
inline cudaError_t launch_build_tree(const float* scores, const int64_t* tokens, const int64_t* parents,
                                     const int64_t* root_tokens, int64_t B, int64_t M, const TreeBatch& out,
                                     int32_t* errors, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  const size_t smem = build_tree_smem_bytes(M, out.num_nodes);
  if (smem > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(build_tree_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  TAPS_LAUNCH(build_tree_kernel, unsigned(B), kBuildTreeThreads, smem, stream, scores, tokens, parents, root_tokens,
              int32_t(M), out, errors);
  return cudaGetLastError();
}

}  // namespace tree
}  // namespace taps
#endif  // __CUDACC__
