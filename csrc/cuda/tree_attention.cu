// CUDA binding of taps_ops::tree_attention (kernels in taps/attention.h).
//
// q [B, Hq, N, D]; k, v [B, Hkv, S, D]; tree_mask [B, N, W] i64; kv_lens [B] i64 -> out [B, Hq, N, D].
// Head dims 64, 80, 96, 128, 256 (compile-time dispatch); fp32 / bf16 / fp16. bf16 / fp16 with at
// least 16 query rows per KV head (G * N >= 16) run the tensor-core kernel, the rest the SIMT kernel.
//
// The kv_lens range check (N <= kv_lens[b] <= S) reads device data: it costs one small reduction and
// one device-to-host sync per call (a single .item()). The kernel clamps kv_lens to [0, S] anyway, so
// even an unchecked bad length never reads out of bounds.
// NOTE: compiled (sm_80, sm_90a) but never run on a GPU by its author; the tests cover it on a GPU.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "attention_checks.h"
#include "checks.h"
#include "taps/attention.h"

namespace {

template <class T>
void dispatch_head_dim(const taps::TreeAttentionParams& p, const taps::AttentionPlan& plan, int64_t head_dim,
                       cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  switch (head_dim) {
    case 64: err = taps::launch_tree_attention<T, 64>(p, plan, stream); break;
    case 80: err = taps::launch_tree_attention<T, 80>(p, plan, stream); break;
    case 96: err = taps::launch_tree_attention<T, 96>(p, plan, stream); break;
    case 128: err = taps::launch_tree_attention<T, 128>(p, plan, stream); break;
    case 256: err = taps::launch_tree_attention<T, 256>(p, plan, stream); break;
    default: TORCH_CHECK(false, "taps_ops: tree_attention: CUDA supports head dims 64, 80, 96, 128, 256, got ", head_dim);
  }
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor tree_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                               const at::Tensor& tree_mask_in, const at::Tensor& kv_lens_in, double scale,
                               bool validate) {
  taps::check_tree_attention_inputs(q_in, k_in, v_in, tree_mask_in, kv_lens_in, scale);
  const int64_t batch = q_in.size(0), heads_q = q_in.size(1), num_nodes = q_in.size(2), head_dim = q_in.size(3);
  const int64_t heads_kv = k_in.size(1), cache_len = k_in.size(2);
  TORCH_CHECK(batch <= 65535, "taps_ops: tree_attention: B = ", batch, " exceeds the CUDA grid limit 65535");

  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor kv_lens = kv_lens_in.contiguous();
  if (validate && batch > 0) {  // the one device sync of this op (see the file comment)
    const bool bad = at::logical_or(kv_lens < num_nodes, kv_lens > cache_len).any().item<bool>();
    TORCH_CHECK(!bad, "taps_ops: tree_attention: every kv_lens[b] must be in [N, S] = [", num_nodes, ", ",
                cache_len, "], got ", kv_lens.cpu());
  }
  auto feature_contiguous = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const at::Tensor q = feature_contiguous(q_in), k = feature_contiguous(k_in), v = feature_contiguous(v_in);
  const at::Tensor tree_mask = tree_mask_in.contiguous();
  at::Tensor out = at::empty({batch, heads_q, num_nodes, head_dim}, q.options());
  if (out.numel() == 0) return out;

  // Kernel choice, rows per block and key splits (taps::plan_tree_attention). The tensor-core kernel
  // loads rows 16 bytes at a time: it needs 16-byte aligned base pointers and row strides.
  const auto* props = at::cuda::getCurrentDeviceProperties();
  auto rows_aligned = [](const at::Tensor& t) {
    const int64_t bytes = t.element_size();
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.stride(0) * bytes) % 16 == 0 &&
           (t.stride(1) * bytes) % 16 == 0 && (t.stride(2) * bytes) % 16 == 0;
  };
  const bool mma_ok = q.scalar_type() != at::kFloat && props->major >= 8 && rows_aligned(q) && rows_aligned(k) &&
                      rows_aligned(v);
  const taps::AttentionPlan plan =
      taps::plan_tree_attention(batch, heads_kv, (heads_q / heads_kv) * num_nodes, cache_len, head_dim, mma_ok,
                                props->multiProcessorCount, static_cast<int64_t>(props->sharedMemPerBlockOptin));
  TORCH_CHECK(heads_kv * plan.row_blocks <= 65535, "taps_ops: tree_attention: Hkv x row blocks = ",
              heads_kv * plan.row_blocks, " exceeds the CUDA grid limit 65535");
  const int64_t splits = plan.splits;
  at::Tensor part_acc, part_max, part_sum;
  if (splits > 1) {
    auto f32 = q.options().dtype(at::kFloat);
    part_acc = at::empty({splits, batch, heads_q, num_nodes, head_dim}, f32);
    part_max = at::empty({splits, batch, heads_q, num_nodes}, f32);
    part_sum = at::empty({splits, batch, heads_q, num_nodes}, f32);
  }

  taps::TreeAttentionParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.tree_mask = tree_mask.data_ptr<int64_t>();
  p.kv_lens = kv_lens.data_ptr<int64_t>();
  p.out = out.data_ptr();
  p.part_acc = splits > 1 ? part_acc.data_ptr<float>() : nullptr;
  p.part_max = splits > 1 ? part_max.data_ptr<float>() : nullptr;
  p.part_sum = splits > 1 ? part_sum.data_ptr<float>() : nullptr;
  p.q_stride_b = q.stride(0), p.q_stride_h = q.stride(1), p.q_stride_n = q.stride(2);
  p.k_stride_b = k.stride(0), p.k_stride_h = k.stride(1), p.k_stride_s = k.stride(2);
  p.v_stride_b = v.stride(0), p.v_stride_h = v.stride(1), p.v_stride_s = v.stride(2);
  p.batch = batch, p.heads_q = heads_q, p.heads_kv = heads_kv, p.num_nodes = num_nodes;
  p.cache_len = cache_len, p.mask_words = tree_mask.size(2);
  p.scale = static_cast<float>(scale);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_head_dim<float>(p, plan, head_dim, stream); break;
    case at::kBFloat16: dispatch_head_dim<__nv_bfloat16>(p, plan, head_dim, stream); break;
    default: dispatch_head_dim<__half>(p, plan, head_dim, stream); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CUDA, m) { m.impl("tree_attention", &tree_attention_cuda); }
