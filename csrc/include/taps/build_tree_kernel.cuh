// build_tree, CUDA kernel (no torch headers): one thread block per request, all per-request state in
// dynamic shared memory. Depth and effective score by pointer jumping, then select_and_emit_block
// (taps/tree_kernel.cuh): the same result as build_tree_request_host (taps/build_tree.h), which
// tests/cpp/test_emu_trees.cpp checks under the CUDA emulation. Launched by csrc/cuda/build_tree.cu.
//
// Size limits: M <= 65535 candidates and num_nodes <= 65535 (16-bit fields of the sort keys), and the
// shared memory of build_tree_smem_bytes(M, num_nodes) (about 40 bytes per candidate, padded to a power
// of two for the sort, plus about 36 bytes per output node) must fit the device's opt-in limit per block
// (227 KiB on H100/H200 and 163 KiB on A100: M up to about 4000 with num_nodes = 64). The binding
// raises beyond these limits (no global-memory fallback).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "taps/build_tree.h"
#include "taps/tree_kernel.cuh"

namespace taps {
namespace tree {

constexpr int kBuildTreeThreads = 512;
constexpr int64_t kBuildTreeMaxCandidates = 65535;

// Bytes of shared memory used per block (the layout of build_tree_kernel below).
inline size_t build_tree_smem_bytes(int64_t M, int64_t num_nodes) {
  const int64_t key_count = next_pow2(int32_t(M > 1 ? M : 1));
  return size_t(8 * key_count + 4 * (8 * M)) + block_select_smem_bytes(num_nodes);
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
  // anc[0] is free once the jumping is done.
  const BlockSelectScratch scratch = block_select_scratch(sibling_keys, anc[0], parent + 8 * M, num_nodes);

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
  return launch_block_per_request(build_tree_kernel, B, kBuildTreeThreads, build_tree_smem_bytes(M, out.num_nodes),
                                  stream, scores, tokens, parents, root_tokens, int32_t(M), out, errors);
}

}  // namespace tree
}  // namespace taps
