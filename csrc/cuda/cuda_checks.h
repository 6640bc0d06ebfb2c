// Checks shared by the CUDA bindings (torch-side): the current device's limits, and whether validate's
// device sync is possible.
#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace taps {

// Raises unless `bytes` of shared memory per block fit the current device's opt-in limit. `what` names
// the sizes that need them and `advice` what to do instead, e.g. check_shared_memory(bytes, "build_tree",
// "M = 9000 candidates and num_nodes = 64", "use fewer candidates or nodes, or run build_tree on the CPU").
inline void check_shared_memory(size_t bytes, const char* op, const std::string& what, const char* advice) {
  const size_t limit = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  TORCH_CHECK_VALUE(bytes <= limit, "taps_ops: ", op, ": ", what, " need ", bytes,
                    " bytes of shared memory per request, more than this device's ", limit, "; ", advice);
}

// validate=True reads the results of the data checks back to the host: a device sync, which a stream
// being captured into a CUDA graph does not allow. Raises a clear error instead of a failed capture.
inline void check_validate_allowed(const char* op) {
  TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None, "taps_ops: ", op,
              ": validate=True needs a device sync, which CUDA graph capture does not allow; pass validate=False");
}

// Raises unless `value` (named by `what`) fits the grid's y or z dimension.
inline void check_grid_dim(int64_t value, const char* op, const std::string& what) {
  TORCH_CHECK_VALUE(value <= 65535, "taps_ops: ", op, ": ", what, " exceeds the CUDA grid limit 65535");
}

}  // namespace taps
