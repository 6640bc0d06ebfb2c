// rms_norm input checks and output allocation shared by the CPU and CUDA bindings (torch-side; no data
// access).
#pragma once
#include <ATen/ATen.h>

#include "checks/checks.h"
#include "taps/elementwise.h"

namespace taps {

struct RmsNormArgs {
  at::Tensor x;       // [rows, H], last dimension contiguous
  at::Tensor weight;  // [G, H] contiguous
  at::Tensor out;     // x's shape, contiguous
  int64_t rows, width, rows_per_group;
  elementwise::Dtype dtype;
};

// x [..., H] f32/bf16/f16; weight [H] or [G, H] of x's dtype and device, G dividing the rows of x (the
// product of its leading dimensions): row r uses weight row r / (rows / G); eps >= 0 and finite.
inline RmsNormArgs prepare_rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  TORCH_CHECK_VALUE(x_in.defined() && weight_in.defined(), "taps_ops: rms_norm: x and weight must be defined");
  TORCH_CHECK_VALUE(x_in.dim() >= 1, "taps_ops: rms_norm: x [..., H] must have at least 1 dimension, got a scalar");
  const elementwise::Dtype dtype = elementwise_dtype(x_in, "rms_norm");
  const at::ScalarType st = x_in.scalar_type();
  TORCH_CHECK_VALUE(weight_in.scalar_type() == st, "taps_ops: rms_norm: weight has dtype ", weight_in.scalar_type(),
                    " but x has ", st, "; they must match");
  check_same_device(x_in, weight_in, "x", "rms_norm: weight");
  TORCH_CHECK_VALUE(weight_in.dim() == 1 || weight_in.dim() == 2, "taps_ops: rms_norm: weight must be [H] or [G, H], "
                    "got shape ", weight_in.sizes());
  const int64_t width = x_in.size(-1);
  TORCH_CHECK_VALUE(weight_in.size(-1) == width, "taps_ops: rms_norm: weight's last dimension must be H = ", width,
                    " (x's last dimension), got shape ", weight_in.sizes());
  TORCH_CHECK_VALUE(eps >= 0.0 && eps < 1e30, "taps_ops: rms_norm: eps must be finite and >= 0, got ", eps);
  RmsNormArgs a;
  a.width = width;
  a.rows = 1;
  for (int64_t d = 0; d + 1 < x_in.dim(); ++d) a.rows *= x_in.size(d);
  const int64_t groups = weight_in.dim() == 2 ? weight_in.size(0) : 1;
  TORCH_CHECK_VALUE(groups >= 1 && a.rows % groups == 0 && (a.rows > 0 || groups == 1),
                    "taps_ops: rms_norm: weight has G = ", groups,
                    " rows, which must divide x's ", a.rows, " rows (x shape ", x_in.sizes(), ")");
  a.rows_per_group = a.rows / groups;
  a.x = x_in.reshape({a.rows, width});
  if (width > 1 && a.x.stride(1) != 1) a.x = a.x.contiguous();
  a.weight = weight_in.reshape({groups, width}).contiguous();
  a.out = at::empty(x_in.sizes(), x_in.options().memory_format(at::MemoryFormat::Contiguous));
  a.dtype = dtype;
  return a;
}

}  // namespace taps
