// rope input checks shared by the CPU and CUDA bindings (torch-side; no data access).
#pragma once
#include <ATen/ATen.h>

#include "checks/checks.h"
#include "taps/elementwise.h"

namespace taps {

struct RopeArgs {
  at::Tensor cos, sin;  // [R, T, D] views (any strides, the last one 1)
  int64_t rows, tokens, heads, dim;
  elementwise::Dtype dtype;
};

// x [R, T, H, D] (updated in place: any strides, last dimension contiguous), D even; cos, sin [R, T, D]
// or [R, T, 1, D] of x's dtype and device, last dimension contiguous (expanded views are fine).
inline RopeArgs prepare_rope(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK_VALUE(x.defined() && cos_in.defined() && sin_in.defined(),
                    "taps_ops: rope_: x, cos and sin must be defined");
  TORCH_CHECK_VALUE(x.dim() == 4, "taps_ops: rope_: x [R, T, H, D] must have 4 dimensions, got shape ", x.sizes());
  RopeArgs a;
  a.dtype = elementwise_dtype(x, "rope_");
  const at::ScalarType st = x.scalar_type();
  a.rows = x.size(0);
  a.tokens = x.size(1);
  a.heads = x.size(2);
  a.dim = x.size(3);
  TORCH_CHECK_VALUE(a.dim % 2 == 0, "taps_ops: rope_: the head dimension D must be even, got shape ", x.sizes());
  TORCH_CHECK_VALUE(a.dim <= 1 || x.stride(3) == 1, "taps_ops: rope_: x must have a contiguous last dimension (it is "
                    "updated in place), got strides ", x.strides());
  const at::Tensor* tables[2] = {&cos_in, &sin_in};
  const char* names[2] = {"cos", "sin"};
  at::Tensor out[2];
  for (int j = 0; j < 2; ++j) {
    at::Tensor t = *tables[j];
    const std::string name = std::string("rope_: ") + names[j];
    TORCH_CHECK_VALUE(t.scalar_type() == st, "taps_ops: ", name, " has dtype ", t.scalar_type(), " but x has ", st,
                      "; they must match");
    check_same_device(x, t, "x", name.c_str());
    if (t.dim() == 4) {
      TORCH_CHECK_VALUE(t.size(2) == 1, "taps_ops: ", name, " [R, T, 1, D] must have size 1 in dimension 2, got shape ",
                        t.sizes());
      t = t.select(2, 0);
    }
    TORCH_CHECK_VALUE(t.dim() == 3 && t.size(0) == a.rows && t.size(1) == a.tokens && t.size(2) == a.dim, "taps_ops: ",
                      name, " must be [R, T, D] or [R, T, 1, D] = [", a.rows, ", ", a.tokens, ", (1,) ", a.dim,
                      "] (x's R, T and D), got shape ", tables[j]->sizes());
    TORCH_CHECK_VALUE(a.dim <= 1 || t.stride(2) == 1, "taps_ops: ", name, " must have a contiguous last dimension, got "
                      "strides ", tables[j]->strides());
    out[j] = t;
  }
  TORCH_CHECK_VALUE(out[0].stride(0) == out[1].stride(0) && out[0].stride(1) == out[1].stride(1),
                    "taps_ops: rope_: cos and sin must have the same strides, got ", cos_in.strides(), " and ",
                    sin_in.strides());
  a.cos = out[0];
  a.sin = out[1];
  return a;
}

}  // namespace taps
