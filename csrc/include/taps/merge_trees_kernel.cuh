// merge_trees, CUDA kernel (no torch headers): one thread block per request over its O = T * N
// occurrences, in dynamic shared memory; the same result as merge_trees_request_host
// (taps/merge_trees.h), which tests/cpp/test_emu_trees.cpp checks under the CUDA emulation. Launched by
// csrc/cuda/merge_trees.cu.
//
// The union runs level by level (trie depth d = 1, 2, ...): each occurrence at depth d inserts the
// edge (its parent's merged node, its token) into a shared hash table (atomicCAS on the slot's owner);
// per slot, atomicMin gives the merged node's position key (its id: the smallest occurrence),
// atomicMax its score (as float_to_ordered keys), atomicOr its source. All three are order independent,
// so the result does not depend on thread timing; slot placement may, but nothing reads it but the
// occurrences of that edge. Then select_and_emit_block (taps/tree_kernel.cuh).
//
// Size limits: T <= 63, T * N <= 65535 (16-bit position keys), num_nodes <= 65535, and
// merge_trees_smem_bytes(T * N, num_nodes) (about 90 bytes per occurrence, padded to powers of two, plus
// about 36 bytes per output node) within the device's opt-in shared memory per block (227 KiB on
// H100/H200: T * N up to about 1500 with the default num_nodes, which holds the whole union; 163 KiB on
// A100: about 1000). The binding raises beyond these limits (no global-memory fallback).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "taps/merge_trees.h"
#include "taps/tree_kernel.cuh"

namespace taps {
namespace tree {

constexpr int kMergeTreesThreads = 512;
constexpr int64_t kMergeTreesMaxOccurrences = 65535;

inline size_t merge_trees_smem_bytes(int64_t O, int64_t num_nodes) {
  const int64_t key_count = next_pow2(int32_t(O > 1 ? O : 1));
  const int64_t slots = next_pow2(int32_t(2 * O > 2 ? 2 * O : 2));
  return size_t(8 * (key_count + O + slots) + 4 * (8 * O + 3 * slots)) + block_select_smem_bytes(num_nodes);
}

struct SourceExtra {
  const uint64_t* slot_source;
  const int32_t* slot_of_node;
  __device__ int64_t operator()(int32_t c) const { return int64_t(slot_source[slot_of_node[c]]); }
};

// tokens, parents, scores: [B, T, N]; weights: [B, T] or nullptr; out: [B, num_nodes] (+ mask words);
// errors: [B] int32, kNoError on entry, set to the encoded error of the first bad node (index t * N + i).
// grid = B, block = kMergeTreesThreads, dynamic shared memory = merge_trees_smem_bytes(T * N, num_nodes).
__global__ void __launch_bounds__(kMergeTreesThreads)
    merge_trees_kernel(const int64_t* __restrict__ tokens, const int64_t* __restrict__ parents,
                       const float* __restrict__ scores, const float* __restrict__ weights, int32_t T, int32_t N,
                       TreeBatch out_batch, int32_t* __restrict__ errors) {
  TAPS_DYNAMIC_SHARED(unsigned char, smem);
  const int64_t b = blockIdx.x;
  const int32_t tid = int32_t(threadIdx.x), nthreads = int32_t(blockDim.x);
  const int32_t O = T * N;
  const int32_t num_nodes = int32_t(out_batch.num_nodes);
  const int32_t key_count = next_pow2(O > 1 ? O : 1);
  const int32_t sib_count = next_pow2(num_nodes - 1 > 1 ? num_nodes - 1 : 1);
  const int32_t slots = next_pow2(2 * O > 2 ? 2 * O : 2);
  tokens += b * O;
  parents += b * O;
  scores += b * O;
  if (weights) weights += b * T;

  uint64_t* select_keys = reinterpret_cast<uint64_t*>(smem);
  uint64_t* sibling_keys = select_keys + key_count;
  int64_t* token = reinterpret_cast<int64_t*>(sibling_keys + sib_count);  // [O]
  uint64_t* slot_source = reinterpret_cast<uint64_t*>(token + O);         // [slots]
  int32_t* parent = reinterpret_cast<int32_t*>(slot_source + slots);      // [O] input parent (sanitized)
  int32_t* node_parent = parent + O;  // [O] parent's merged node (its smallest occurrence), -1 = root
  int32_t* node = parent + 2 * O;     // [O] merged node (smallest occurrence) of each occurrence
  int32_t* slot = parent + 3 * O;     // [O] hash slot of each occurrence
  int32_t* depth = parent + 4 * O;    // [O] trie depth, -1 until reached (root 0)
  float* score = reinterpret_cast<float*>(parent + 5 * O);       // [O] score + weight
  float* eff = reinterpret_cast<float*>(parent + 6 * O);         // [O] effective score of a merged node
  float* node_score = reinterpret_cast<float*>(parent + 7 * O);  // [O] max score of a merged node
  int32_t* slot_owner = parent + 8 * O;                          // [slots] occurrence that claimed it
  int32_t* slot_node = slot_owner + slots;                       // [slots] atomicMin of occurrences
  uint32_t* slot_score = reinterpret_cast<uint32_t*>(slot_node + slots);  // [slots] atomicMax, ordered
  // slot_owner is free once the union is done.
  const BlockSelectScratch scratch = block_select_scratch(
      sibling_keys, slot_owner, reinterpret_cast<int32_t*>(slot_score + slots), num_nodes);

  // Load and check. Bad nodes are reported through `errors` and made unreachable (never given a
  // depth), NaN scores become -inf, so everything stays in bounds.
  const int64_t root_token = tokens[0];
  for (int32_t o = tid; o < O; o += nthreads) {
    const int32_t t = o / N, i = o - t * N;
    const float w = weights ? weights[t] : 0.0f;
    const int32_t code = check_tree_node(i, tokens + t * N, parents + t * N, scores + t * N, root_token, w);
    if (code != kOk) atomicMin(errors + b, encode_error(o, code));
    const int64_t tok = tokens[o], p = parents[o];
    const bool real = i >= 1 && tok >= 0 && p >= 0 && p < i;
    float s = scores[o] + w;
    if (s != s) s = negative_infinity();
    token[o] = tok;
    parent[o] = real ? int32_t(p) : -1;
    depth[o] = i == 0 ? 0 : -1;
    score[o] = s;
    node[o] = -1;
    slot[o] = -1;
  }
  for (int32_t h = tid; h < slots; h += nthreads) {
    slot_owner[h] = -1;
    slot_node[h] = 0x7fffffff;  // atomicMin identity
    slot_score[h] = 0;
    slot_source[h] = 0;
  }
  __syncthreads();
  for (int32_t d = 1;; ++d) {
    // Reach depth d: occurrences whose parent is at depth d - 1. Marked in slot[] (kReached) and given
    // their depth only after the barrier: depths are read across threads in this phase, so none is
    // written in it (no shared-memory race, even a benign one).
    constexpr int32_t kReached = -2;
    int reached = 0;
    for (int32_t o = tid; o < O; o += nthreads) {
      const int32_t p = parent[o];
      if (p < 0 || depth[o] >= 0) continue;
      const int32_t po = o - (o % N) + p;
      if (depth[po] != d - 1) continue;
      slot[o] = kReached;
      node_parent[o] = p == 0 ? -1 : node[po];
      reached = 1;
    }
    if (!__syncthreads_or(reached)) break;
    // Insert the edges (node_parent, token) of depth d.
    for (int32_t o = tid; o < O; o += nthreads) {
      if (slot[o] != kReached) continue;
      depth[o] = d;
      const int32_t np = node_parent[o];
      const int64_t tok = token[o];
      uint32_t h = trie_edge_hash(np, tok) & uint32_t(slots - 1);
      for (;; h = (h + 1) & uint32_t(slots - 1)) {
        int32_t owner = static_cast<volatile int32_t*>(slot_owner)[h];
        if (owner < 0) {
          owner = atomicCAS(slot_owner + h, -1, o);
          if (owner < 0) break;  // claimed
        }
        if (node_parent[owner] == np && token[owner] == tok) break;
      }
      slot[o] = int32_t(h);
      atomicMin(slot_node + h, o);
      atomicMax(slot_score + h, float_to_ordered(score[o]));
      atomicOr(reinterpret_cast<unsigned long long*>(slot_source + h), (unsigned long long)(1) << (o / N));
    }
    __syncthreads();
    for (int32_t o = tid; o < O; o += nthreads) {
      if (depth[o] != d) continue;
      const int32_t h = slot[o];
      const int32_t n = slot_node[h];
      node[o] = n;
      if (n == o) {
        const float s = ordered_to_float(slot_score[h]);
        const int32_t np = node_parent[o];
        node_score[o] = s;
        eff[o] = np < 0 ? s : fminf(s, eff[np]);
      }
    }
    __syncthreads();
  }
  // Merged nodes are the occurrences that are their own node.
  for (int32_t j = tid; j < key_count; j += nthreads)
    select_keys[j] = (j < O && depth[j] >= 1 && node[j] == j) ? pack_select_key(eff[j], depth[j], j) : kMaxKey;
  __syncthreads();
  const uint64_t all_trees = (uint64_t(1) << T) - 1;
  select_and_emit_block(select_keys, key_count, node_parent, token, node_score, depth,
                        SourceExtra{slot_source, slot}, out_batch.request(b), root_token,
                        /*root_extra=*/int64_t(all_trees), /*padding_extra=*/0, scratch);
}

// Launches merge_trees_kernel for B requests on `stream` (sizes within the limits above, checked by the
// binding). Returns the launch error, if any.
inline cudaError_t launch_merge_trees(const int64_t* tokens, const int64_t* parents, const float* scores,
                                      const float* weights, int64_t B, int64_t T, int64_t N, const TreeBatch& out,
                                      int32_t* errors, cudaStream_t stream) {
  return launch_block_per_request(merge_trees_kernel, B, kMergeTreesThreads,
                                  merge_trees_smem_bytes(T * N, out.num_nodes), stream, tokens, parents, scores,
                                  weights, int32_t(T), int32_t(N), out, errors);
}

}  // namespace tree
}  // namespace taps
