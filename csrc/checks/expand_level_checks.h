// expand_level input checks and output allocation shared by the CPU and CUDA bindings (torch-side; no
// data access).
#pragma once
#include <ATen/ATen.h>

#include "checks/checks.h"
#include "taps/expand_level.h"

namespace taps {

struct ExpandLevelArgs {
  at::Tensor logits;        // [R * F, V], last dimension contiguous
  at::Tensor front_scores;  // [R, F] f32 contiguous
  at::Tensor front_cands;   // [R, F] i64 contiguous
  at::Tensor token_map;     // [V] i64 contiguous, or undefined
  at::Tensor scores, tokens, parents, entropy, next_scores, next_tokens, next_slots, next_cands;
  at::Tensor row_entropy;   // [R, F] f32 scratch
  elementwise::Dtype dtype;
  int64_t rows, front, vocab, k, next_k, cand_offset;
  bool with_entropy;

  // The kernels' view (pointers into the tensors above).
  expand::Params params() const {
    expand::Params p{};
    p.logits = logits.data_ptr();
    p.front_scores = front_scores.data_ptr<float>();
    p.front_cands = front_cands.data_ptr<int64_t>();
    p.token_map = token_map.defined() ? token_map.data_ptr<int64_t>() : nullptr;
    p.scores = scores.data_ptr<float>();
    p.tokens = tokens.data_ptr<int64_t>();
    p.parents = parents.data_ptr<int64_t>();
    p.row_entropy = row_entropy.data_ptr<float>();
    p.entropy = entropy.data_ptr<float>();
    p.next_scores = next_scores.data_ptr<float>();
    p.next_tokens = next_tokens.data_ptr<int64_t>();
    p.next_slots = next_slots.data_ptr<int64_t>();
    p.next_cands = next_cands.data_ptr<int64_t>();
    p.rows = rows;
    p.front = front;
    p.vocab = vocab;
    p.row_stride = logits.stride(0);
    p.k = k;
    p.next_k = next_k;
    p.cand_offset = cand_offset;
    p.with_entropy = with_entropy;
    return p;
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
  outputs() const {
    return {scores, tokens, parents, entropy, next_scores, next_tokens, next_slots, next_cands};
  }
};

// logits [R, F, V] f32/bf16/f16 (any strides); front_scores [R, F] f32; front_cands [R, F] i64;
// 1 <= k <= min(V, 64); 0 <= next_k <= F * k; cand_offset >= 0; token_map [V] i64 or undefined; all on
// one device.
inline ExpandLevelArgs prepare_expand_level(const at::Tensor& logits, const at::Tensor& front_scores,
                                            const at::Tensor& front_cands, int64_t k, int64_t next_k,
                                            int64_t cand_offset, const c10::optional<at::Tensor>& token_map,
                                            bool with_entropy) {
  TORCH_CHECK_VALUE(logits.defined(), "taps_ops: expand_level: logits is undefined");
  TORCH_CHECK_VALUE(logits.dim() == 3, "taps_ops: expand_level: logits must be [R, F, V], got shape ", logits.sizes());
  ExpandLevelArgs a;
  a.dtype = elementwise_dtype(logits, "expand_level", "logits");
  a.rows = logits.size(0);
  a.front = logits.size(1);
  a.vocab = logits.size(2);
  check_tensor(front_scores, "expand_level: front_scores", 2, {at::kFloat});
  check_tensor(front_cands, "expand_level: front_cands", 2, {at::kLong});
  check_same_device(logits, front_scores, "logits", "expand_level: front_scores");
  check_same_device(logits, front_cands, "logits", "expand_level: front_cands");
  TORCH_CHECK_VALUE(front_scores.size(0) == a.rows && front_scores.size(1) == a.front,
                    "taps_ops: expand_level: front_scores must be [R, F] = [", a.rows, ", ", a.front, "], got shape ",
                    front_scores.sizes());
  TORCH_CHECK_VALUE(front_cands.size(0) == a.rows && front_cands.size(1) == a.front,
                    "taps_ops: expand_level: front_cands must be [R, F] = [", a.rows, ", ", a.front, "], got shape ",
                    front_cands.sizes());
  TORCH_CHECK_VALUE(a.vocab >= 1, "taps_ops: expand_level: logits must have at least one token (V >= 1), got shape ",
                    logits.sizes());
  TORCH_CHECK_VALUE(k >= 1 && k <= a.vocab && k <= expand::kMaxK, "taps_ops: expand_level: k must be in [1, min(V, ",
                    expand::kMaxK, ")] (V = ", a.vocab, "), got ", k);
  TORCH_CHECK_VALUE(next_k >= 0 && next_k <= a.front * k, "taps_ops: expand_level: next_k must be in [0, F * k] = [0, ",
                    a.front * k, "], got ", next_k);
  TORCH_CHECK_VALUE(cand_offset >= 0, "taps_ops: expand_level: cand_offset must be >= 0, got ", cand_offset);
  if (token_map.has_value() && token_map->defined()) {
    check_tensor(*token_map, "expand_level: token_map", 1, {at::kLong});
    check_same_device(logits, *token_map, "logits", "expand_level: token_map");
    TORCH_CHECK_VALUE(token_map->size(0) == a.vocab, "taps_ops: expand_level: token_map must have V = ", a.vocab,
                      " entries (one target id per draft token), got shape ", token_map->sizes());
    a.token_map = token_map->contiguous();
  }
  a.k = k;
  a.next_k = next_k;
  a.cand_offset = cand_offset;
  a.with_entropy = with_entropy;
  a.logits = logits.reshape({a.rows * a.front, a.vocab});
  if (a.vocab > 1 && a.logits.stride(1) != 1) a.logits = a.logits.contiguous();
  a.front_scores = front_scores.contiguous();
  a.front_cands = front_cands.contiguous();
  const auto f32 = logits.options().dtype(at::kFloat), i64 = logits.options().dtype(at::kLong);
  const int64_t children = a.front * k;
  a.scores = at::empty({a.rows, children}, f32);
  a.tokens = at::empty({a.rows, children}, i64);
  a.parents = at::empty({a.rows, children}, i64);
  a.entropy = at::empty({a.rows}, f32);
  a.row_entropy = at::empty({a.rows, a.front}, f32);
  a.next_scores = at::empty({a.rows, next_k}, f32);
  a.next_tokens = at::empty({a.rows, next_k}, i64);
  a.next_slots = at::empty({a.rows, next_k}, i64);
  a.next_cands = at::empty({a.rows, next_k}, i64);
  return a;
}

}  // namespace taps
