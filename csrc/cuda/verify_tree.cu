// verify_tree, CUDA binding: input checks (checks/verify_tree_checks.h), dtype dispatch, the launch
// (taps/verify_tree_kernel.cuh) on the current stream, and with validate one device sync to raise errors.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdlib>
#include <optional>

#include "checks/checks.h"
#include "cuda/cuda_checks.h"
#include "taps/verify_tree_kernel.cuh"
#include "checks/verify_tree_checks.h"

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
    TORCH_CHECK_VALUE(forced == 1 || forced == 2 || forced == 4 || forced == 8,
                      "taps_ops: TAPS_VERIFY_CLUSTER must be 1, 2, 4 or 8, got '", env, "'");
    return forced;
  }
  int c = 1;
  while (c < 8 && batch * 2 * c <= prop->multiProcessorCount && vocab / (2 * c) >= 4096) c *= 2;
  return c;
}

template <typename logit_t, typename prob_t>
void launch(const VerifyCall& c) {
  // The kernel templates take torch's element types (c10::BFloat16 / c10::Half convert to float on the
  // device; torch builds with the CUDA types' own conversions switched off).
  verify::VerifyArgs<logit_t, prob_t> a{
      c.logits.data_ptr<logit_t>(), c.draft_probs.defined() ? c.draft_probs.data_ptr<prob_t>() : nullptr,
      c.tokens.data_ptr<int64_t>(), c.parents.data_ptr<int64_t>(), c.uniforms.data_ptr<float>(),
      c.temperature.data_ptr<float>(), c.top_k.data_ptr<int64_t>(), c.top_p.data_ptr<float>(),
      c.logits.size(0), c.logits.size(1), c.logits.size(2), c.validate,
      cluster_size_for(c.logits.size(0), c.logits.size(2)),
      c.out_tokens.data_ptr<int64_t>(), c.num_accepted.data_ptr<int64_t>(), c.path.data_ptr<int64_t>(),
      c.errors.data_ptr<int32_t>()};
  C10_CUDA_CHECK(verify::launch_verify_tree(a, at::cuda::getCurrentCUDAStream()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_cuda(
    const at::Tensor& logits_in, const at::Tensor& tokens_in, const at::Tensor& parents_in,
    const at::Tensor& temperature_in, const at::Tensor& top_k_in, const at::Tensor& top_p_in,
    const std::optional<at::Tensor>& draft_probs_in, const at::Tensor& uniforms_in, bool validate) {
  check_verify_inputs(logits_in, tokens_in, parents_in, temperature_in, top_k_in, top_p_in, draft_probs_in,
                      uniforms_in);
  TORCH_CHECK_VALUE(logits_in.size(1) <= verify::kMaxNodes,
                    "taps_ops: verify_tree: the CUDA kernel supports trees of up to ",
                    verify::kMaxNodes, " nodes, got N = ", logits_in.size(1));
  TORCH_CHECK_VALUE(logits_in.size(0) < (int64_t(1) << 31), "taps_ops: verify_tree: batch too large for one launch");
  const c10::cuda::CUDAGuard guard(logits_in.device());
  if (validate) check_validate_allowed("verify_tree");
  const VerifyCall call = VerifyCall::prepare(logits_in, tokens_in, parents_in, temperature_in, top_k_in, top_p_in,
                                              draft_probs_in, uniforms_in, validate);
  if (logits_in.size(0) == 0) return call.outputs();
  call.dispatch([&]<typename logit_t, typename prob_t>() { launch<logit_t, prob_t>(call); });
  if (validate) raise_verify_error(call.errors);  // one device sync
  return call.outputs();
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CUDA, m) { m.impl("verify_tree", &taps::verify_tree_cuda); }
