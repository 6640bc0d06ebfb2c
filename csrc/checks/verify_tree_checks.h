// verify_tree input checks shared by the CPU and CUDA bindings (torch-side).
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "checks/checks.h"
#include "taps/verify_tree.h"

namespace taps {

// Shapes, dtypes, devices (no data access: safe without a device sync).
inline void check_verify_inputs(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
                                const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                                const std::optional<at::Tensor>& draft_probs, const at::Tensor& uniforms) {
  const auto floats = {at::kFloat, at::kBFloat16, at::kHalf};
  check_tensor(logits, "verify_tree: logits [B, N, V]", 3, floats);
  const int64_t batch = logits.size(0), n = logits.size(1), vocab = logits.size(2);
  TORCH_CHECK_VALUE(vocab >= 1, "taps_ops: verify_tree: logits must have V >= 1, got shape ", logits.sizes());
  TORCH_CHECK_VALUE(n >= 1 || batch == 0, "taps_ops: verify_tree: a tree needs N >= 1 nodes (the root), got shape ",
                    logits.sizes());
  TORCH_CHECK_VALUE(vocab < (int64_t(1) << 31), "taps_ops: verify_tree: V must be < 2^31, got ", vocab);
  check_tensor(tokens, "verify_tree: tokens [B, N]", 2, {at::kLong});
  check_tensor(parents, "verify_tree: parents [B, N]", 2, {at::kLong});
  check_tensor(uniforms, "verify_tree: uniforms [B, N]", 2, {at::kFloat});
  for (const at::Tensor* t : {&tokens, &parents, &uniforms}) {
    TORCH_CHECK_VALUE(t->size(0) == batch && t->size(1) == n,
                      "taps_ops: verify_tree: tokens, parents and uniforms must be [B, N] = [",
                      batch, ", ", n, "] to match logits ", logits.sizes(), ", got ", t->sizes());
  }
  check_tensor(temperature, "verify_tree: temperature [B]", 1, {at::kFloat});
  check_tensor(top_k, "verify_tree: top_k [B]", 1, {at::kLong});
  check_tensor(top_p, "verify_tree: top_p [B]", 1, {at::kFloat});
  for (const at::Tensor* t : {&temperature, &top_k, &top_p}) {
    TORCH_CHECK_VALUE(t->size(0) == batch, "taps_ops: verify_tree: temperature, top_k and top_p must be [B] = [", batch,
                      "], got ", t->sizes());
  }
  const char* names[] = {"tokens", "parents", "temperature", "top_k", "top_p", "uniforms"};
  const at::Tensor* ts[] = {&tokens, &parents, &temperature, &top_k, &top_p, &uniforms};
  for (int i = 0; i < 6; ++i) check_same_device(logits, *ts[i], "logits", names[i]);
  if (draft_probs.has_value()) {
    check_tensor(*draft_probs, "verify_tree: draft_probs [B, N, V]", 3, floats);
    TORCH_CHECK_VALUE(draft_probs->sizes() == logits.sizes(),
                      "taps_ops: verify_tree: draft_probs must have the shape of logits ",
                      logits.sizes(), ", got ", draft_probs->sizes());
    check_same_device(logits, *draft_probs, "logits", "draft_probs");
    TORCH_CHECK_VALUE(draft_probs->scalar_type() == at::kFloat || draft_probs->scalar_type() == logits.scalar_type(),
                      "taps_ops: verify_tree: draft_probs must be float32 or the dtype of logits (",
                      logits.scalar_type(), "), got ", draft_probs->scalar_type());
  }
}

// One call's tensors: the inputs made contiguous and the outputs allocated (-1 padded), shared by the
// CPU and CUDA bindings.
struct VerifyCall {
  at::Tensor logits, tokens, parents, temperature, top_k, top_p, uniforms, draft_probs;  // draft_probs may be undefined
  at::Tensor out_tokens, num_accepted, path, errors;  // [B, N], [B], [B, N] int64; errors [B] int32
  bool validate;

  static VerifyCall prepare(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
                            const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                            const std::optional<at::Tensor>& draft_probs, const at::Tensor& uniforms, bool validate) {
    VerifyCall c;
    c.logits = logits.contiguous();
    c.tokens = tokens.contiguous();
    c.parents = parents.contiguous();
    c.temperature = temperature.contiguous();
    c.top_k = top_k.contiguous();
    c.top_p = top_p.contiguous();
    c.uniforms = uniforms.contiguous();
    if (draft_probs.has_value()) c.draft_probs = draft_probs->contiguous();
    const int64_t batch = logits.size(0), n = logits.size(1);
    const auto i64 = logits.options().dtype(at::kLong);
    c.out_tokens = at::full({batch, n}, -1, i64);
    c.path = at::full({batch, n}, -1, i64);
    c.num_accepted = at::zeros({batch}, i64);
    c.errors = at::full({batch}, kNoError, logits.options().dtype(at::kInt));
    c.validate = validate;
    return c;
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> outputs() const { return {out_tokens, num_accepted, path}; }

  // Calls f.template operator()<logit_t, prob_t>() with the element types of logits and draft_probs
  // (prob_t = float without draft_probs; draft_probs are float32 or logits' dtype, as checked).
  template <class F>
  void dispatch(F&& f) const {
    auto with_logits = [&]<typename logit_t>() {
      if (!draft_probs.defined() || draft_probs.scalar_type() == at::kFloat) f.template operator()<logit_t, float>();
      else f.template operator()<logit_t, logit_t>();
    };
    switch (logits.scalar_type()) {
      case at::kFloat: with_logits.template operator()<float>(); break;
      case at::kBFloat16: with_logits.template operator()<c10::BFloat16>(); break;
      default: with_logits.template operator()<c10::Half>(); break;  // the dtypes were checked
    }
  }
};

// errors: [B] int32, one encoded error per request. Raises for the first request with an error.
inline void raise_verify_error(const at::Tensor& errors) {
  raise_first_error(errors, [](int64_t b, int32_t encoded) {
    TORCH_CHECK_VALUE(false, "taps_ops: verify_tree: request ", b, ", node ", error_index(encoded), ": ",
                      verify::error_text(error_code(encoded)));
  });
}

}  // namespace taps
