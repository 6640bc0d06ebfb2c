// compact_kv, CUDA binding: input checks (checks/compact_kv_checks.h), with validate the path checks, and one
// launch per cache tensor (taps/compact_kv_kernel.cuh) on the current stream.
//
// caches: list of [B, H, S, D] tensors (any floating dtype, one per tensor), updated in place;
// path [B, P] i64 (-1 padded, path[:, 0] == 0, strictly increasing); prefix_lens [B] i64.
// The path checks read device data: one small reduction and one device-to-host sync per call
// (validate=False skips them). The kernel re-validates each request's path and leaves a request with
// an invalid path untouched, so it never reads or writes out of bounds. One launch per cache tensor,
// each moving whole rows in the widest word (1..16 bytes) that the tensor's alignment allows.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "checks/checks.h"
#include "checks/compact_kv_checks.h"
#include "cuda/cuda_checks.h"
#include "taps/compact_kv_kernel.cuh"

namespace taps {
namespace {

template <class U>
void launch_unit(const at::Tensor& c, int64_t unit_elems, int64_t cache_len, const int64_t* path, int64_t cols,
                 const int64_t* prefix, cudaStream_t stream) {
  C10_CUDA_CHECK(compact::launch_compact_kv<U>(static_cast<U*>(c.data_ptr()), c.size(0), c.size(1), cache_len,
                                            c.size(3) / unit_elems, c.stride(0) / unit_elems,
                                            c.stride(1) / unit_elems, c.stride(2) / unit_elems, path, cols, prefix,
                                            stream));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void compact_kv_cuda(at::TensorList caches, const at::Tensor& path_in, const at::Tensor& prefix_lens_in,
                     bool validate) {
  check_compact_kv_path(path_in, prefix_lens_in);
  const int64_t batch = path_in.size(0), cols = path_in.size(1);
  check_grid_dim(batch, "compact_kv", c10::str("B = ", batch));
  const int64_t cache_len = check_compact_kv_caches(caches, path_in, batch);
  for (size_t t = 0; t < caches.size(); ++t)
    check_grid_dim(caches[t].size(1), "compact_kv", c10::str("caches[", t, "] H"));
  c10::cuda::CUDAGuard guard(path_in.device());
  const at::Tensor path = path_in.contiguous(), prefix_lens = prefix_lens_in.contiguous();
  if (batch == 0 || cols == 0) return;
  if (validate) {  // the one device sync of this op: all checks in one reduction
    check_validate_allowed("compact_kv");
    const at::Tensor valid = path >= 0;
    const at::Tensor live = valid.cumprod(1).to(at::kBool);  // entries before the first -1
    const at::Tensor prev = at::cat({at::full({batch, 1}, -1, path.options()), path.narrow(1, 0, cols - 1)}, 1);
    const at::Tensor bad_order = at::logical_and(live, path <= prev);
    const at::Tensor bad_root = path.select(1, 0) != 0;
    const at::Tensor bad_prefix = prefix_lens < 0;
    at::Tensor bad_bound = at::zeros({batch}, path.options().dtype(at::kBool));
    if (cache_len >= 0)
      bad_bound = at::logical_and(live, (path + prefix_lens.unsqueeze(1)) >= cache_len).any(1);
    const at::Tensor flags = at::stack({bad_root.any(), bad_order.any(), bad_bound.any(), bad_prefix.any()}).cpu();
    const bool* f = flags.data_ptr<bool>();
    // a bad input (the rare path): the CPU binding's per-request checks on host copies name the first bad
    // request exactly as the CPU op does
    if (f[0] || f[1] || f[2] || f[3]) {
      check_compact_kv_rows(path.cpu().contiguous(), prefix_lens.cpu().contiguous(), cache_len);
      TORCH_CHECK(false, "taps_ops: compact_kv: internal error: the device check flagged a path the host check "
                  "accepts (flags ", int(f[0]), int(f[1]), int(f[2]), int(f[3]), ")");
    }
  }
  if (cols <= 1) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (const at::Tensor& c : caches) {
    if (c.numel() == 0) continue;
    const int64_t elem = c.element_size();
    // Widest word w (bytes) dividing the data pointer, the row size and the b/h/s strides.
    const auto addr = reinterpret_cast<uintptr_t>(c.data_ptr());
    int64_t w = 16;
    while (w > elem && (addr % w || (c.size(3) * elem) % w || (c.stride(0) * elem) % w ||
                        (c.stride(1) * elem) % w || (c.stride(2) * elem) % w))
      w /= 2;
    const int64_t unit = w / elem;  // elements per word
    const int64_t* pp = path.data_ptr<int64_t>();
    const int64_t* pl = prefix_lens.data_ptr<int64_t>();
    switch (w) {
      case 16: launch_unit<uint4>(c, unit, cache_len, pp, cols, pl, stream); break;
      case 8: launch_unit<uint2>(c, unit, cache_len, pp, cols, pl, stream); break;
      case 4: launch_unit<uint32_t>(c, unit, cache_len, pp, cols, pl, stream); break;
      case 2: launch_unit<uint16_t>(c, unit, cache_len, pp, cols, pl, stream); break;
      default: launch_unit<uint8_t>(c, unit, cache_len, pp, cols, pl, stream); break;
    }
  }
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CUDA, m) { m.impl("compact_kv", &taps::compact_kv_cuda); }
