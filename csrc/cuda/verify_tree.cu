// verify_tree, CUDA binding: input checks, dtype dispatch, the launch (taps/verify_kernel.cuh) on the
// current stream, and with validate one device sync to raise errors. UNVERIFIED: this code compiles
// for sm_80 / sm_90a in CI but has not yet run on a GPU; bench/gpu_check.sh is the prepared first run.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdlib>
#include <optional>

#include "checks.h"
#include "taps/verify_kernel.cuh"
#include "verify_checks.h"

namespace taps {
namespace {

// Blocks per request: on sm_90+ a cluster of up to 8 blocks shares a request's rows when the batch
// alone would leave SMs idle (each block keeps >= 4096 tokens of a row). TAPS_VERIFY_CLUSTER=1 forces
// one block per request; 2, 4 or 8 force that cluster size (sm_90+).
int cluster_size_for(int64_t batch, int64_t vocab) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  if (prop->major < 9) return 1;
  if (const char* env = std::getenv("TAPS_VERIFY_CLUSTER")) {
    const int forced = std::atoi(env);
    TORCH_CHECK(forced == 1 || forced == 2 || forced == 4 || forced == 8,
                "taps_ops: TAPS_VERIFY_CLUSTER must be 1, 2, 4 or 8, got '", env, "'");
    return forced;
  }
  int c = 1;
  while (c < 8 && batch * 2 * c <= prop->multiProcessorCount && vocab / (2 * c) >= 4096) c *= 2;
  return c;
}

template <typename logit_t, typename prob_t>
void launch(const at::Tensor& logits, const at::Tensor* draft_probs, const at::Tensor& tokens,
            const at::Tensor& parents, const at::Tensor& uniforms, const at::Tensor& temperature,
            const at::Tensor& top_k, const at::Tensor& top_p, bool validate, at::Tensor& out_tokens,
            at::Tensor& num_accepted, at::Tensor& path, at::Tensor& errors) {
  // The kernel templates take torch's element types (c10::BFloat16 / c10::Half convert to float on the
  // device; torch builds with the CUDA types' own conversions switched off).
  verify_cuda::VerifyArgs<logit_t, prob_t> a{
      logits.data_ptr<logit_t>(), draft_probs ? draft_probs->data_ptr<prob_t>() : nullptr,
      tokens.data_ptr<int64_t>(), parents.data_ptr<int64_t>(), uniforms.data_ptr<float>(),
      temperature.data_ptr<float>(), top_k.data_ptr<int64_t>(), top_p.data_ptr<float>(),
      logits.size(0), logits.size(1), logits.size(2), validate, cluster_size_for(logits.size(0), logits.size(2)),
      out_tokens.data_ptr<int64_t>(), num_accepted.data_ptr<int64_t>(), path.data_ptr<int64_t>(),
      errors.data_ptr<int32_t>()};
  C10_CUDA_CHECK(verify_cuda::launch_verify_tree(a, at::cuda::getCurrentCUDAStream()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_cuda(
    const at::Tensor& logits_in, const at::Tensor& tokens_in, const at::Tensor& parents_in,
    const at::Tensor& temperature_in, const at::Tensor& top_k_in, const at::Tensor& top_p_in,
    const std::optional<at::Tensor>& draft_probs_in, const at::Tensor& uniforms_in, bool validate) {
  check_verify_inputs(logits_in, tokens_in, parents_in, temperature_in, top_k_in, top_p_in, draft_probs_in,
                      uniforms_in);
  TORCH_CHECK(logits_in.size(1) <= verify_cuda::kMaxNodes, "taps_ops: verify_tree: the CUDA kernel supports trees of up to ",
              verify_cuda::kMaxNodes, " nodes, got N = ", logits_in.size(1));
  TORCH_CHECK(logits_in.size(0) < (int64_t(1) << 31), "taps_ops: verify_tree: batch too large for one launch");
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous(), tokens = tokens_in.contiguous(),
                   parents = parents_in.contiguous(), temperature = temperature_in.contiguous(),
                   top_k = top_k_in.contiguous(), top_p = top_p_in.contiguous(), uniforms = uniforms_in.contiguous();
  at::Tensor draft_probs;
  if (draft_probs_in.has_value()) draft_probs = draft_probs_in->contiguous();
  const int64_t batch = logits.size(0), n = logits.size(1);
  auto i64 = logits.options().dtype(at::kLong);
  at::Tensor out_tokens = at::full({batch, n}, -1, i64);
  at::Tensor path = at::full({batch, n}, -1, i64);
  at::Tensor num_accepted = at::zeros({batch}, i64);
  at::Tensor errors = at::zeros({batch}, logits.options().dtype(at::kInt));
  if (batch == 0) return {out_tokens, num_accepted, path};
  auto run = [&](auto logit_tag) {
    using logit_t = decltype(logit_tag);
    const at::Tensor* dp = draft_probs.defined() ? &draft_probs : nullptr;
    if (dp == nullptr || draft_probs.scalar_type() == at::kFloat) {
      launch<logit_t, float>(logits, dp, tokens, parents, uniforms, temperature, top_k, top_p, validate, out_tokens,
                             num_accepted, path, errors);
    } else {  // the dtype of logits (checked)
      launch<logit_t, logit_t>(logits, dp, tokens, parents, uniforms, temperature, top_k, top_p, validate,
                               out_tokens, num_accepted, path, errors);
    }
  };
  switch (logits.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    default: run(c10::Half{}); break;  // the dtypes were checked
  }
  if (validate) raise_verify_error(errors);  // one device sync
  return {out_tokens, num_accepted, path};
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CUDA, m) { m.impl("verify_tree", &verify_tree_cuda); }

}  // namespace taps
