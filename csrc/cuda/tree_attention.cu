// tree_attention, CUDA binding: input checks (checks/tree_attention_checks.h), with validate the kv_lens and
// num_queries range checks, the launch plan (attention::plan_tree_attention), dispatch over dtype and head
// dim, and the launch (taps/tree_attention_kernel.cuh) on the current stream.
//
// q [B, Hq, N, D]; k, v [B, Hkv, S, D]; tree_mask [B, N, W] i64; kv_lens [B] i64; tree_nodes T (>= N, default
// N); num_queries [B] i64 (optional: request b's first n_b queries only, the rest of its rows zeros)
// -> out [B, Hq, N, D].
// Head dims 32, 64, 80, 96, 128, 256 (compile-time dispatch); other head dims up to 256 are zero-padded to
// the next of those (q, k, v copied per call, so slower; the padded features add 0 to every score and
// their output columns are dropped); fp32 / bf16 / fp16. bf16 / fp16 with at
// least 16 query rows per KV head (G * N >= 16) run the tensor-core kernel, the rest the SIMT kernel.
// TAPS_ATTN_SPLITS=n (1..64) forces n key splits instead of the plan's (tuning experiments only).
// The plan and grid are sized for N queries a request (num_queries stays on the device): blocks without
// a live row return at once.
//
// The range checks (T <= kv_lens[b] <= S, T = tree_nodes or N; 0 <= num_queries[b] <= N) read device data:
// they cost small reductions and one device-to-host sync per call (a single copy of both flags;
// validate=False skips it). The kernels clamp kv_lens to [0, S] and num_queries to [0, N] anyway, so even
// unchecked bad values never read out of bounds.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include "checks/checks.h"
#include "cuda/cuda_checks.h"
#include "taps/tree_attention_kernel.cuh"
#include "checks/tree_attention_checks.h"

namespace taps {
namespace {

// The compiled head dims, ascending.
constexpr int64_t kHeadDims[] = {32, 64, 80, 96, 128, 256};

// with_kernel_kind(dtype, head_dim, f): f(Kind<T, D>{}) for the kernels' element type T of `dtype` and the head
// dim D (one of kHeadDims): the one dispatch of the launch and of the occupancy query.
template <class T, int D>
struct Kind {
  using type = T;
  static constexpr int dim = D;
};
template <class T, class F>
void with_head_dim(int64_t head_dim, F&& f) {
  switch (head_dim) {
    case 32: f(Kind<T, 32>{}); break;
    case 64: f(Kind<T, 64>{}); break;
    case 80: f(Kind<T, 80>{}); break;
    case 96: f(Kind<T, 96>{}); break;
    case 128: f(Kind<T, 128>{}); break;
    case 256: f(Kind<T, 256>{}); break;
    default: TORCH_CHECK_VALUE(false, "taps_ops: tree_attention: no CUDA kernel for head dim ", head_dim);
  }
}
template <class F>
void with_kernel_kind(at::ScalarType dtype, int64_t head_dim, F&& f) {
  switch (dtype) {
    case at::kFloat: with_head_dim<float>(head_dim, f); break;
    case at::kBFloat16: with_head_dim<__nv_bfloat16>(head_dim, f); break;
    default: with_head_dim<__half>(head_dim, f); break;
  }
}

at::Tensor tree_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                               const at::Tensor& tree_mask_in, const at::Tensor& kv_lens_in, double scale,
                               bool validate, std::optional<int64_t> tree_nodes,
                               const std::optional<at::Tensor>& num_queries) {
  const int64_t tree =
      check_tree_attention_inputs(q_in, k_in, v_in, tree_mask_in, kv_lens_in, scale, tree_nodes, num_queries);
  const int64_t batch = q_in.size(0), heads_q = q_in.size(1), num_nodes = q_in.size(2), head_dim = q_in.size(3);
  const int64_t heads_kv = k_in.size(1), cache_len = k_in.size(2);
  check_grid_dim(batch, "tree_attention", c10::str("B = ", batch));
  int64_t padded_dim = 0;  // the smallest compiled head dim >= D
  for (const int64_t d : kHeadDims)
    if (padded_dim == 0 && d >= head_dim) padded_dim = d;
  TORCH_CHECK_VALUE(padded_dim > 0, "taps_ops: tree_attention: CUDA supports head dims up to 256 (compiled: 32, 64, ",
                    "80, 96, 128, 256; others zero-padded to the next), got ", head_dim);
  if (padded_dim != head_dim && q_in.numel() > 0) {
    const std::vector<int64_t> pad = {0, padded_dim - head_dim};
    const at::Tensor out = tree_attention_cuda(at::constant_pad_nd(q_in, pad), at::constant_pad_nd(k_in, pad),
                                               at::constant_pad_nd(v_in, pad), tree_mask_in, kv_lens_in, scale,
                                               validate, tree_nodes, num_queries);
    return out.narrow(3, 0, head_dim).contiguous();
  }

  c10::cuda::CUDAGuard guard(q_in.device());
  TreeAttentionCall call = TreeAttentionCall::prepare(q_in, k_in, v_in, tree_mask_in, kv_lens_in, num_queries);
  const bool ragged = call.num_queries->defined();
  if (validate && batch > 0) {  // the one device sync of this op (see the file comment)
    check_validate_allowed("tree_attention");
    const at::Tensor& kv_lens = *call.kv_lens;
    at::Tensor bad = at::logical_or(kv_lens < tree, kv_lens > cache_len).any();
    if (ragged) {
      const at::Tensor& live = *call.num_queries;
      bad = at::stack({bad, at::logical_or(live < 0, live > num_nodes).any()});
    }
    const at::Tensor flags = bad.reshape({-1}).cpu();  // both flags in one copy
    const bool* flag = flags.data_ptr<bool>();
    TORCH_CHECK_VALUE(!flag[0], "taps_ops: tree_attention: every kv_lens[b] must be in [T, S] = [", tree, ", ",
                      cache_len, "] (T: tree nodes), got ", kv_lens.cpu());
    TORCH_CHECK_VALUE(!ragged || !flag[1], "taps_ops: tree_attention: every num_queries[b] must be in [0, N] = [0, ",
                      num_nodes, "], got ", call.num_queries->cpu());
  }
  if (call.out.numel() == 0) return call.out;

  // Kernel choice, rows per block and key splits (attention::plan_tree_attention). The tensor-core kernel
  // loads rows 16 bytes at a time: it needs 16-byte aligned base pointers and row strides.
  const auto* props = at::cuda::getCurrentDeviceProperties();
  auto rows_aligned = [](const at::Tensor& t) {
    const int64_t bytes = t.element_size();
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.stride(0) * bytes) % 16 == 0 &&
           (t.stride(1) * bytes) % 16 == 0 && (t.stride(2) * bytes) % 16 == 0;
  };
  const bool mma_ok = call.q->scalar_type() != at::kFloat && props->major >= 8 && rows_aligned(*call.q) &&
                      rows_aligned(*call.k) && rows_aligned(*call.v);
  attention::AttentionPlan plan = attention::plan_tree_attention(
      batch, heads_kv, (heads_q / heads_kv) * num_nodes, cache_len, head_dim, mma_ok, props->multiProcessorCount,
      static_cast<int64_t>(props->sharedMemPerBlockOptin));
  const at::ScalarType dtype = call.q->scalar_type();
  int per_sm = 0;  // the splits for the kernel's measured residency (attention::plan_gpu_splits)
  with_kernel_kind(dtype, head_dim, [&](auto kind) {
    using K = decltype(kind);
    per_sm = attention::blocks_per_sm<typename K::type, K::dim>(plan);
  });
  attention::plan_gpu_splits(plan, batch, heads_kv, cache_len, int64_t(per_sm) * props->multiProcessorCount);
  if (const char* env = std::getenv("TAPS_ATTN_SPLITS"); env != nullptr && env[0] != '\0') {
    // tuning experiments (bench/probe_cuda.py): this many key splits instead of the plan's
    const int64_t forced = std::atoll(env);
    TORCH_CHECK_VALUE(forced >= 1 && forced <= attention::kMaxSplits, "taps_ops: TAPS_ATTN_SPLITS must be in [1, ",
                      attention::kMaxSplits, "], got '", env, "'");
    attention::set_splits(plan, forced, cache_len);
  }
  check_grid_dim(heads_kv * plan.row_blocks, "tree_attention",
                 c10::str("Hkv x row blocks = ", heads_kv * plan.row_blocks));
  const attention::Params p = call.params(scale, plan.splits, tree);
  // Dead rows (i >= num_queries[b]) are written by no attention block: zeros from here with one split; with
  // several the combine kernel writes them.
  if (ragged && plan.splits == 1) call.out.zero_();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  with_kernel_kind(dtype, head_dim, [&](auto kind) {
    using K = decltype(kind);
    C10_CUDA_CHECK((attention::launch_tree_attention<typename K::type, K::dim>(p, plan, stream)));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return call.out;
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CUDA, m) { m.impl("tree_attention", &taps::tree_attention_cuda); }
