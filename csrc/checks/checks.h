// Input checks shared by the CPU and CUDA bindings (torch-side; the header-only core has none).
#pragma once
#include <ATen/ATen.h>

#include <string>

#include "taps/common.h"
#include "taps/elementwise.h"

namespace taps {

inline void check_tensor(const at::Tensor& t, const char* name, int64_t dim,
                         std::initializer_list<at::ScalarType> dtypes) {
  TORCH_CHECK_VALUE(t.defined(), "taps_ops: ", name, " is undefined");
  TORCH_CHECK_VALUE(t.dim() == dim, "taps_ops: ", name, " must have ", dim, " dimensions, got shape ", t.sizes());
  bool ok = false;
  for (auto d : dtypes) ok = ok || (t.scalar_type() == d);
  if (!ok) {
    std::string allowed;
    for (auto d : dtypes) allowed += std::string(allowed.empty() ? "" : ", ") + c10::toString(d);
    TORCH_CHECK_VALUE(false, "taps_ops: ", name, " must have dtype ", allowed, ", got ", t.scalar_type());
  }
}

inline void check_same_device(const at::Tensor& ref, const at::Tensor& t, const char* ref_name, const char* name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "taps_ops: ", name, " is on ", t.device(), " but ", ref_name,
                    " is on ", ref.device(), "; all inputs must be on one device");
}

inline void check_size(const at::Tensor& t, int64_t d, int64_t expected, const char* name, const char* what) {
  TORCH_CHECK_VALUE(t.size(d) == expected, "taps_ops: ", name, " dimension ", d, " must be ", what, " = ", expected,
                    ", got shape ", t.sizes());
}

// The elementwise cores' dtype of `x` (float32, bfloat16 or float16), or a clear error naming `op` and the
// argument (`name`).
inline elementwise::Dtype elementwise_dtype(const at::Tensor& x, const char* op, const char* name = "x") {
  const at::ScalarType st = x.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "taps_ops: ", op, ": ", name,
                    " must have dtype float32, bfloat16 or float16, got ", st);
  return st == at::kFloat ? elementwise::kF32 : (st == at::kBFloat16 ? elementwise::kBF16 : elementwise::kF16);
}

// errors: one encoded error per request (taps/common.h). Calls raise(b, encoded) for the first request
// with an error; `raise` does not return.
template <class Raise>
void raise_first_error(const int32_t* errors, int64_t count, Raise&& raise) {
  for (int64_t b = 0; b < count; ++b)
    if (errors[b] != kNoError) raise(b, errors[b]);
}

// errors: [B] int32 on any device. Copies them to the host (on CUDA, one device sync) and raises as above.
template <class Raise>
void raise_first_error(const at::Tensor& errors, Raise&& raise) {
  const at::Tensor host = errors.to(at::kCPU);
  raise_first_error(host.data_ptr<int32_t>(), host.numel(), raise);
}

}  // namespace taps
