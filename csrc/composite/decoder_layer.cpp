// decoder_layer: one Llama decoder layer of the lean forward path (python/taps/lean.py's
// `_attention_mlp`) as one call, with its attention through taps_ops.tree_attention over a cache.
//
// Why an op: at decoding's sizes a layer is some 25 torch operators, and called one by one from Python
// each costs 2-4 us of interpreter and dispatch before its kernel runs, more than many of the kernels
// themselves. Here the same arithmetic runs in the same order from C++ (taps_ops' own rms_norm / rope_ /
// tree_attention / panel_linear through the dispatcher, ATen's silu; on the CPU the adds, the products and the
// copies between them as plain loops up to kLoopElements, ATen's ops beyond and on other devices), so the
// result equals the Python path's bit for bit, for a fraction of the host time.
//
// One implementation for every device (registered for the CPU and CUDA keys): it only calls other ops,
// which dispatch on the inputs' device. Inference only (no autograd formula); the lean path calls it with
// autograd off. Where it is used: the engine's CPU hot path (fused, pre-packed projections); on CUDA the
// lean path keeps its Python form.
#include <ATen/ATen.h>
#include <ATen/TensorIndexing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <utility>
#include <optional>
#include <string>
#include <vector>

#include "checks/checks.h"
#include "cpu/cpu_isa.h"

namespace taps {
namespace {

// Positions in the `weights` list (python/taps/lean.py: LayerWeights.pack builds it, in op_args).
enum Slot : int64_t {
  kInNorm = 0,    // [H] / [G, H] or None (EAGLE-1/2's first layer has no input norm)
  kHiddenNorm,    // EAGLE-3 only: the norm of the residual stream x beside the embedding's input norm
  kQkvW,          // fused q/k/v projection: [out, in] (F.linear), oneDNN-packed [out, in], [G, in, out], or
                  // panels [out / 16, in, 16] f32 / [out / 16, in / 2, 16, 2] bf16 (taps_ops.pack_panels;
                  // G = 1, out / 16 > 1), or G > 1 groups' panels stacked: [G, out / 16, in, 16] f32 /
                  // [G, out / 16, in / 2, 16, 2] bf16
  kQkvB,
  kOW,
  kOB,
  kPostNorm,
  kGateUpW,       // fused gate/up projection, gate first
  kGateUpB,
  kDownW,
  kDownB,
  kNumSlots
};

using OptTensor = std::optional<at::Tensor>;

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const OptTensor& b) {
  // oneDNN's linear over a pre-packed weight (taps.lean.pack_weight), the call Linear.__call__ makes from
  // Python: mkldnn::_linear_pointwise(x, w, b, "none", [], "")
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, c10::string_view,
                                         c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, w, b, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w, const OptTensor& b) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("taps_ops::panel_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>();
  return op.call(x, w, b);
}

// A 3-D weight is taps' panels [out / 16, in, 16] when x has G = 1 and the weight more than one panel of 16,
// else stacked [G, in, out] (its first size must then be x's G). With G = 1 and one panel the two readings
// are the same product; taps.lean keeps panels only for weights of two panels or more, so this reading is
// the Python body's.
// float32 panels [out / 16, in, 16] or bfloat16 ones [out / 16, in / 2, 16, 2] (taps_ops.pack_panels)
bool is_panels(const at::Tensor& w, int64_t groups) {
  if (w.is_mkldnn() || groups != 1) return false;
  if (w.dim() == 4) return w.scalar_type() == at::kBFloat16 && w.size(0) > 1 && w.size(2) == 16 && w.size(3) == 2;
  return w.dim() == 3 && w.size(0) > 1 && w.size(2) == 16;
}

// G > 1 drafters' panels stacked (taps.lean.Linear.choose_small_layout): [G, out / 16, in, 16] float32 or
// [G, out / 16, in / 2, 16, 2] bfloat16, group g's weight at [g] (each group's product one panel_linear call)
bool is_stacked_panels(const at::Tensor& w, int64_t groups) {
  if (w.is_mkldnn() || groups < 2 || w.dim() < 4 || w.size(0) != groups || w.size(1) < 2 || w.size(3) != 16)
    return false;
  if (w.dim() == 5) return w.scalar_type() == at::kBFloat16 && w.size(4) == 2;
  return w.dim() == 4 && w.scalar_type() == at::kFloat;
}

at::Tensor panels_product(const at::Tensor& x, const at::Tensor& w, const OptTensor& b) {
  if (x.scalar_type() == at::kFloat || (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16))
    return panel_linear(x, w, b);
  return panel_linear(x.to(at::kFloat), w, b).to(x.scalar_type());
}

// taps.lean.Linear.__call__ with autograd off: panels, packed, stacked ([G, in, out]: bmm, or G groups' panels:
// a panel_linear call per group) or plain; a float32 weight with half-precision x is a widened one (Linear.pack
// on a CPU without native bf16 / fp16 products): x widened, the float32 product, the result rounded to x's
// dtype. Panels take half-precision x the same way, bfloat16 panels bfloat16 x as it is (panel_linear widens
// it, or multiplies it with AVX512-BF16's dot products: the same bits, rounded to bfloat16 once).
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const OptTensor& b) {
  if (is_panels(w, x.size(0))) return panels_product(x, w, b);
  if (is_stacked_panels(w, x.size(0))) {
    // each group's rows through its own panels: a drafter group's product is its drafters' own, bit for bit
    std::vector<at::Tensor> ys;
    ys.reserve(static_cast<size_t>(x.size(0)));
    for (int64_t g = 0; g < x.size(0); ++g) {
      const OptTensor bg = b.has_value() ? OptTensor(b->select(0, g).reshape({-1})) : std::nullopt;
      ys.push_back(panels_product(x.select(0, g), w.select(0, g), bg));
    }
    return at::stack(ys);
  }
  if (w.scalar_type() == at::kFloat && x.scalar_type() != at::kFloat)
    return project(x.to(at::kFloat), w, b).to(x.scalar_type());
  if (w.is_mkldnn()) return packed_linear(x, w, b);
  if (w.dim() == 3) return b.has_value() ? at::baddbmm(*b, x, w) : at::bmm(x, w);
  if (x.dim() == 3 && x.is_contiguous()) {
    // what at::linear does for a contiguous 3-D input (addmm / mm over the flattened rows: the same BLAS
    // call, the same bits), without its matmul / t / reshape dispatch layers (3-4 us a call)
    const at::Tensor rows = x.view({-1, x.size(2)});
    const at::Tensor y = b.has_value() ? at::addmm(*b, rows, w.t()) : at::mm(rows, w.t());
    return y.view({x.size(0), x.size(1), w.size(0)});
  }
  return at::linear(x, w, b);
}

// Before a projection by panels `w`: the panels `then` of the projection after it are the ones its last output
// block asks into L2 (taps::follow_panels; from 16 rows, a draft tree's, whose products overlap reading the
// weights with computing). Only between two single-weight panel products (one panel_linear call each).
void follow(const at::Tensor& w, const at::Tensor& then, int64_t groups) {
  if (is_panels(w, groups) && is_panels(then, groups)) taps::follow_panels(then);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("taps_ops::rms_norm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x, w, eps);
}

void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("taps_ops::rope_", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  op.call(x, cos, sin);
}

at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          const at::Tensor& kv_lens, double scale, std::optional<int64_t> tree_nodes,
                          const std::optional<at::Tensor>& num_queries = std::nullopt) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("taps_ops::tree_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, double, bool, std::optional<int64_t>,
                                         const std::optional<at::Tensor>&)>();
  return op.call(q, k, v, mask, kv_lens, scale, /*validate=*/false, tree_nodes, num_queries);
}

at::Tensor required(const c10::List<OptTensor>& weights, Slot slot, const char* name) {
  const OptTensor t = weights.get(slot);
  TORCH_CHECK_VALUE(t.has_value() && t->defined(), "taps_ops: decoder_layer: weights[", static_cast<int64_t>(slot), "] (",
              name, ") is required, got None");
  return *t;
}

int64_t linear_out(const at::Tensor& w, int64_t groups) {
  if (is_panels(w, groups)) return w.size(0) * w.size(2);
  if (is_stacked_panels(w, groups)) return w.size(1) * w.size(3);
  return w.dim() == 3 ? w.size(2) : w.size(0);
}
// [out, in], [G, in, out] and float32 panels alike; bfloat16 panels hold inputs in pairs (the lean path packs
// them for an even in only)
int64_t linear_in(const at::Tensor& w, int64_t groups) {
  if (is_stacked_panels(w, groups)) return w.dim() == 5 ? 2 * w.size(2) : w.size(2);
  return w.dim() == 4 ? 2 * w.size(1) : w.size(1);
}

void check_linear(const at::Tensor& w, const OptTensor& b, const at::Tensor& x, int64_t groups, int64_t in,
                  int64_t out, const char* name) {
  const bool stacked_panels = is_stacked_panels(w, groups);
  TORCH_CHECK_VALUE(w.dim() == 2 || (w.dim() == 3 && !w.is_mkldnn()) || is_panels(w, groups) || stacked_panels,
              "taps_ops: decoder_layer: ", name, " weight must be [out, in] (plain or oneDNN-packed), stacked [G, in, out], "
              "panels [out / 16, in, 16] or G groups' panels [G, out / 16, in, 16], got shape ", w.sizes(), " for x of G = ",
              groups);
  if (stacked_panels) {
    TORCH_CHECK_VALUE(w.device().is_cpu(), "taps_ops: decoder_layer: ", name, " panels are a CPU layout, got them on ",
                w.device());
    TORCH_CHECK_VALUE(!b.has_value() || !b->defined() || (b->dim() == 3 && b->size(0) == groups && b->size(1) == 1),
                "taps_ops: decoder_layer: ", name, " bias of stacked panels must be [G, 1, out], got shape ", b->sizes());
  } else if (is_panels(w, groups)) {
    TORCH_CHECK_VALUE(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "taps_ops: decoder_layer: ",
                name, " of shape ", w.sizes(), " for x of G = 1 reads as panels [out / 16, in, 16] (taps_ops.pack_panels), "
                "which must be float32 or bfloat16, got ", w.scalar_type());
    TORCH_CHECK_VALUE(!b.has_value() || !b->defined() || b->dim() == 1, "taps_ops: decoder_layer: ", name,
                " bias of a panel weight must be [out], got shape ", b->sizes());
    TORCH_CHECK_VALUE(w.device().is_cpu(), "taps_ops: decoder_layer: ", name, " panels are a CPU layout, got them on ",
                w.device());
  } else if (w.dim() == 3) {
    TORCH_CHECK_VALUE(w.size(0) == groups, "taps_ops: decoder_layer: ", name, " is stacked for ", w.size(0),
                " groups but x [G, R * T, H] has G = ", groups);
  } else {
    TORCH_CHECK_VALUE(groups == 1, "taps_ops: decoder_layer: x has G = ", groups, " weight groups but ", name,
                " is a single [out, in] weight; stack it [G, in, out]");
  }
  TORCH_CHECK_VALUE(linear_in(w, groups) == in && linear_out(w, groups) == out, "taps_ops: decoder_layer: ", name,
              " weight must map ", in, " to ", out, " features, got shape ", w.sizes());
  const bool panels = is_panels(w, groups) || stacked_panels;
  TORCH_CHECK_VALUE(panels || w.scalar_type() == x.scalar_type() || w.scalar_type() == at::kFloat,
              "taps_ops: decoder_layer: ", name, " weight has dtype ", w.scalar_type(), " but x has ", x.scalar_type(),
              "; they must match (or the weight be a widened float32 one)");
  if (!w.is_mkldnn()) check_same_device(x, w, "x", name);
  if (b.has_value() && b->defined()) {
    TORCH_CHECK_VALUE(b->numel() == groups * out && b->size(-1) == out, "taps_ops: decoder_layer: ", name,
                " bias must hold ", out, " features per group, got shape ", b->sizes());
    const at::ScalarType bias_type = panels ? at::kFloat : w.scalar_type();  // panel_linear adds a float32 bias
    TORCH_CHECK_VALUE(b->scalar_type() == bias_type, "taps_ops: decoder_layer: ", name, " bias has dtype ",
                b->scalar_type(), " but its weight (", panels ? "panels" : "plain", ", ", w.scalar_type(), ") needs ",
                bias_type);
    if (w.dim() == 3 && !panels) {
      TORCH_CHECK_VALUE(b->dim() == 3 && b->size(0) == groups && b->size(1) == 1, "taps_ops: decoder_layer: ", name,
                  " bias of a stacked weight must be [G, 1, out], got shape ", b->sizes());
    }
    check_same_device(x, *b, "x", name);
  }
}

void check_norm(const OptTensor& w, const at::Tensor& x, int64_t groups, int64_t width, const char* name) {
  if (!w.has_value() || !w->defined()) return;
  TORCH_CHECK_VALUE((w->dim() == 1 && groups == 1) || (w->dim() == 2 && w->size(0) == groups), "taps_ops: decoder_layer: ",
              name, " weight must be [H] or [G, H] with G = ", groups, ", got shape ", w->sizes());
  TORCH_CHECK_VALUE(w->size(-1) == width, "taps_ops: decoder_layer: ", name, " weight must have ", width,
              " features, got shape ", w->sizes());
  TORCH_CHECK_VALUE(w->scalar_type() == x.scalar_type(), "taps_ops: decoder_layer: ", name, " weight has dtype ",
              w->scalar_type(), " but x has ", x.scalar_type(), "; they must match");
  check_same_device(x, *w, "x", name);
}

OptTensor opt(const c10::List<OptTensor>& weights, Slot slot) {
  OptTensor t = weights.get(slot);
  if (t.has_value() && !t->defined()) return std::nullopt;
  return t;
}

// The layer's elementwise steps and layout copies as plain loops on the CPU (the residual adds, silu(gate) * up's
// product, the new K/V to the cache, the attention's heads to rows): in a decoding step each ATen operator costs
// 3-5 us of dispatch, allocation and iterator setup, its code and metadata cold after the weights streamed through
// the caches (bench/RESULTS.md), for a few hundred elements of work. The same values bit for bit: an add or a
// product of two float32 numbers, or of two bfloat16 ones in float32 rounded once to nearest even (c10::BFloat16,
// as ATen's kernels compute them); a copy is a copy. Up to kLoopElements elements (decoding steps and draft trees);
// longer inputs (prefill) keep ATen's vectorised kernels.
constexpr int64_t kLoopElements = 64 * 1024;

bool cpu_loop_ok(const at::Tensor& t) {
  return t.is_cpu() && t.is_contiguous() && t.numel() <= kLoopElements &&
         (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16);
}

// y += x elementwise (y a fresh product result of x's shape and dtype: at::add(x, y)'s values)
void add_into(const at::Tensor& x, at::Tensor& y) {
  if (!(cpu_loop_ok(x) && cpu_loop_ok(y) && x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type())) {
    y = x + y;
    return;
  }
  const int64_t n = y.numel();
  if (y.scalar_type() == at::kFloat) {
    const float* a = x.data_ptr<float>();
    float* b = y.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) b[i] = a[i] + b[i];
  } else {
    const c10::BFloat16* a = x.data_ptr<c10::BFloat16>();
    c10::BFloat16* b = y.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) b[i] = c10::BFloat16(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  }
}

// silu(gate) * up of gate_up [..., 2 * inter] (gate first): at::silu(gate) (ATen's own, its exponentials), then the
// product in place of silu's result
at::Tensor silu_times_up(const at::Tensor& gate_up, int64_t inter) {
  const at::Tensor gate = gate_up.slice(-1, 0, inter), up = gate_up.slice(-1, inter);
  at::Tensor s = at::silu(gate);
  if (!(cpu_loop_ok(gate_up) && cpu_loop_ok(s) && s.scalar_type() == gate_up.scalar_type())) return s * up;
  const int64_t rows = gate_up.numel() / (2 * inter);
  if (s.scalar_type() == at::kFloat) {
    const float* u = gate_up.data_ptr<float>() + inter;
    float* o = s.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r, u += 2 * inter, o += inter)
      for (int64_t i = 0; i < inter; ++i) o[i] = o[i] * u[i];
  } else {
    const c10::BFloat16* u = gate_up.data_ptr<c10::BFloat16>() + inter;
    c10::BFloat16* o = s.data_ptr<c10::BFloat16>();
    for (int64_t r = 0; r < rows; ++r, u += 2 * inter, o += inter)
      for (int64_t i = 0; i < inter; ++i) o[i] = c10::BFloat16(static_cast<float>(o[i]) * static_cast<float>(u[i]));
  }
  return s;
}

// Whether src [A, B, C, D] and dst (any 4-d shape) are CPU tensors of one float32 / bfloat16 dtype whose last
// dimension is contiguous: copy_rows_transposed below can move their D-element rows with memcpy.
bool rows_copyable(const at::Tensor& src, const at::Tensor& dst) {
  return src.is_cpu() && dst.is_cpu() && src.dim() == 4 && dst.dim() == 4 && src.scalar_type() == dst.scalar_type() &&
         (src.scalar_type() == at::kFloat || src.scalar_type() == at::kBFloat16) && src.stride(3) == 1 &&
         dst.stride(3) == 1 && src.size(3) == dst.size(3);
}

// dst[a, c, b, :] = src[a, b, c, :] for src [A, B, C, D] (dst [A, C, B, D]: a transposed view's copy_)
void copy_rows_transposed(const at::Tensor& src, const at::Tensor& dst) {
  const int64_t bytes = src.size(3) * src.element_size();
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  const int64_t es = src.element_size();
  for (int64_t a = 0; a < src.size(0); ++a)
    for (int64_t b = 0; b < src.size(1); ++b)
      for (int64_t c = 0; c < src.size(2); ++c)
        std::memcpy(d + (a * dst.stride(0) + c * dst.stride(1) + b * dst.stride(2)) * es,
                    s + (a * src.stride(0) + b * src.stride(1) + c * src.stride(2)) * es, static_cast<size_t>(bytes));
}

// Whether the new K and V [..., Hkv, D] (last dimension contiguous) can be scattered into the caches keys / values
// [R, Hkv, S, D] by scatter_kv below (CPU tensors of one float32 / bfloat16 dtype, int64 CPU positions).
bool scatter_ok(const at::Tensor& k, const at::Tensor& v, const at::Tensor& keys, const at::Tensor& values,
                const at::Tensor& positions) {
  const auto fits = [](const at::Tensor& src, const at::Tensor& dst) {
    return src.is_cpu() && dst.is_cpu() && dst.dim() == 4 && src.scalar_type() == dst.scalar_type() &&
           (src.scalar_type() == at::kFloat || src.scalar_type() == at::kBFloat16) && src.stride(-1) == 1 &&
           dst.stride(3) == 1 && src.size(-1) == dst.size(3) && src.size(-2) == dst.size(1);
  };
  return positions.is_cpu() && positions.scalar_type() == at::kLong && fits(k, keys) && fits(v, values);
}

// keys[row(n), h, positions[n], :] = k[n, h, :] and the same for values, for the N new tokens n (`offset(src, n)`:
// token n's element offset in k or v, viewed [N, Hkv, D]), one memcpy of D elements each: what
// index_put_({rows, Slice(), positions}, k) and its twin for v do (the ragged rows' and the packed tokens' K/V to
// their cache columns), without advanced indexing's setup (13-22 us a call at a batch of 8, two a layer:
// bench/RESULTS.md). Every column is checked, once for both caches, before anything is written: one outside [0, S)
// raises (index_put_ would wrap a negative one; no cache column is negative).
template <typename RowOf, typename Offset>
void scatter_kv(int64_t count, RowOf row_of, Offset offset, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& keys, const at::Tensor& values, const at::Tensor& positions) {
  const at::Tensor pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t columns = keys.size(2);
  for (int64_t n = 0; n < count; ++n)
    TORCH_CHECK_INDEX(p[n] >= 0 && p[n] < columns, "taps_ops: decoder_layer: write position ", p[n],
                      " is out of bounds for the cache's ", columns, " columns");
  const int64_t es = k.element_size(), heads = keys.size(1);
  const size_t bytes = static_cast<size_t>(keys.size(3) * es);
  for (const auto& [src, dst] : {std::pair<const at::Tensor&, const at::Tensor&>{k, keys}, {v, values}}) {
    const char* s = static_cast<const char*>(src.data_ptr());
    char* d = static_cast<char*>(dst.data_ptr());
    for (int64_t n = 0; n < count; ++n) {
      const char* from = s + offset(src, n) * es;
      char* to = d + (row_of(n) * dst.stride(0) + p[n] * dst.stride(2)) * es;
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(to + h * dst.stride(1) * es, from + h * src.stride(-2) * es, bytes);
    }
  }
}

at::Tensor decoder_layer(const at::Tensor& x, const OptTensor& emb_in, const c10::List<OptTensor>& weights,
                         at::ArrayRef<double> eps, at::IntArrayRef dims, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& keys, const at::Tensor& values, int64_t write_start,
                         const at::Tensor& tree_mask, const at::Tensor& kv_lens, std::optional<int64_t> tree_nodes,
                         double scale, const OptTensor& write_positions, const OptTensor& rows_in) {
  TORCH_CHECK_VALUE(weights.size() == kNumSlots, "taps_ops: decoder_layer: weights must list ", kNumSlots,
              " entries (in_norm, hidden_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, gate_up_bias, down, "
              "down_bias), got ", weights.size());
  TORCH_CHECK_VALUE(eps.size() == 3, "taps_ops: decoder_layer: eps must be [in_norm, hidden_norm, post_norm], got ",
              eps.size(), " values");
  TORCH_CHECK_VALUE(dims.size() == 4, "taps_ops: decoder_layer: dims must be [heads, kv_heads, head_dim, fused_rope], got ",
              dims.size(), " values");
  const int64_t heads = dims[0], kv_heads = dims[1], head_dim = dims[2];
  const bool fused_rope = dims[3] != 0;
  TORCH_CHECK_VALUE(heads > 0 && kv_heads > 0 && head_dim > 0 && head_dim % 2 == 0 && heads % kv_heads == 0,
              "taps_ops: decoder_layer: need heads, kv_heads > 0 with heads a multiple of kv_heads and an even "
              "head_dim > 0, got dims ", dims);
  TORCH_CHECK_VALUE(x.defined() && x.dim() == 3, "taps_ops: decoder_layer: x must be [G, R * T, H], got ",
              x.defined() ? x.sizes() : at::IntArrayRef{});
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "taps_ops: decoder_layer: x must "
              "have dtype float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(cos.defined() && cos.dim() == 4 && cos.size(2) == 1 && cos.size(3) == head_dim,
              "taps_ops: decoder_layer: cos must be [G * R, T, 1, head_dim = ", head_dim, "], got ",
              cos.defined() ? cos.sizes() : at::IntArrayRef{});
  TORCH_CHECK_VALUE(keys.defined() && values.defined() && keys.dim() == 4 && keys.sizes() == values.sizes(),
              "taps_ops: decoder_layer: keys and values must be [G * R, Hkv, S, D] of one shape");
  const int64_t groups = x.size(0), hidden = x.size(2);
  const int64_t gb = keys.size(0);
  TORCH_CHECK_VALUE(keys.size(1) == kv_heads && keys.size(3) == head_dim, "taps_ops: decoder_layer: keys must have ",
              kv_heads, " heads of dimension ", head_dim, ", got shape ", keys.sizes());
  const bool packed = rows_in.has_value() && rows_in->defined();
  // packed: each grid row's query count (its last packed slot's column + 1): tree_attention skips the rest
  std::optional<at::Tensor> live_queries;
  const bool ragged = write_positions.has_value() && write_positions->defined();
  // packed: x holds M of the R x T token slots (the others, padding, are not computed); T is the tree's
  // query count (tree_mask [R, T, W]); `tokens` below is then M, the rows the projections see
  const int64_t slots_per_row = packed ? (tree_mask.dim() == 3 ? tree_mask.size(1) : 0) : cos.size(1);
  const int64_t tokens = cos.size(1);
  if (packed) {
    const at::Tensor& rows = *rows_in;
    TORCH_CHECK_VALUE(groups == 1, "taps_ops: decoder_layer: packed rows need a single weight set (G = 1), got G = ",
                groups);
    TORCH_CHECK_VALUE(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == x.size(1) && rows.size(0) > 0,
                "taps_ops: decoder_layer: rows must be int64 [M] with M = x.size(1) = ", x.size(1), " > 0, got ",
                rows.scalar_type(), " ", rows.sizes());
    check_same_device(x, rows, "x", "rows");
    TORCH_CHECK_VALUE(tree_mask.dim() == 3 && tree_mask.size(0) == gb && slots_per_row > 0, "taps_ops: decoder_layer: "
                "with rows, tree_mask must be [R, T, W] over keys' R = ", gb, " rows, got ", tree_mask.sizes());
    TORCH_CHECK_VALUE(cos.size(0) == 1 && cos.size(1) == x.size(1) && sin.sizes() == cos.sizes(), "taps_ops: decoder_layer: "
                "with rows, cos and sin must be [1, M = ", x.size(1), ", 1, ", head_dim, "], got ", cos.sizes(), " and ",
                sin.sizes());
    TORCH_CHECK_VALUE(ragged && write_positions->dim() == 1 && write_positions->size(0) == rows.size(0) &&
                    write_positions->scalar_type() == at::kLong,
                "taps_ops: decoder_layer: with rows, write_positions must be int64 [M = ", rows.size(0),
                "] (each packed token's cache column)");
    check_same_device(x, *write_positions, "x", "write_positions");
    // the slots must be distinct and in range: strictly increasing, first >= 0, last < R * T (one host read)
    const int64_t slots = gb * slots_per_row;
    bool ok = true;
    if (rows.is_cpu()) {  // a loop over M host ints (the tensor ops below cost ~20 us a layer on the CPU)
      const at::Tensor r = rows.contiguous();
      const int64_t* p = r.data_ptr<int64_t>();
      ok = p[0] >= 0 && p[r.size(0) - 1] < slots;
      for (int64_t i = 1; ok && i < r.size(0); ++i) ok = p[i] > p[i - 1];
      if (ok) {  // each grid row's queries up to its last packed slot (the slots increase: the last one wins)
        live_queries = at::zeros({gb}, r.options());
        int64_t* live = live_queries->data_ptr<int64_t>();
        for (int64_t i = 0; i < r.size(0); ++i) live[p[i] / slots_per_row] = p[i] % slots_per_row + 1;
      }
    } else {
      ok = rows.size(0) == 1
               ? (rows.ge(0) & rows.lt(slots)).all().item<bool>()
               : (rows.slice(0, 1).gt(rows.slice(0, 0, -1)).all() & rows[0].ge(0) & rows[-1].lt(slots)).item<bool>();
      if (ok)
        live_queries = at::zeros({gb}, rows.options())
                           .scatter_reduce_(0, rows.div(slots_per_row, "floor"), rows.remainder(slots_per_row) + 1, "amax");
    }
    TORCH_CHECK_VALUE(ok, "taps_ops: decoder_layer: rows must be strictly increasing slots in [0, R * T = ", slots, ")");
  } else {
    TORCH_CHECK_VALUE(cos.size(0) == gb && sin.sizes() == cos.sizes(), "taps_ops: decoder_layer: cos and sin must be [",
                gb, ", T, 1, ", head_dim, "] (keys' G * R rows), got ", cos.sizes(), " and ", sin.sizes());
    TORCH_CHECK_VALUE(gb % groups == 0 && x.size(1) * groups == gb * tokens, "taps_ops: decoder_layer: x [G, R * T, H] = ",
                x.sizes(), " does not hold G * R = ", gb, " rows (keys) of T = ", tokens, " tokens (cos)");
  }
  if (ragged && !packed) {
    TORCH_CHECK_VALUE(write_positions->dim() == 2 && write_positions->size(0) == gb && write_positions->size(1) == tokens &&
                    write_positions->scalar_type() == at::kLong,
                "taps_ops: decoder_layer: write_positions must be int64 [G * R, T] = [", gb, ", ", tokens, "], got ",
                write_positions->scalar_type(), " ", write_positions->sizes());
    check_same_device(x, *write_positions, "x", "write_positions");
  } else if (!packed) {
    TORCH_CHECK_VALUE(write_start >= 0 && write_start + tokens <= keys.size(2), "taps_ops: decoder_layer: the new entries ",
                "go to cache columns ", write_start, " .. ", write_start + tokens - 1, " but the cache holds ",
                keys.size(2));
  }
  check_same_device(x, keys, "x", "keys");
  check_same_device(x, values, "x", "values");

  const bool eagle3 = emb_in.has_value() && emb_in->defined();
  const OptTensor in_norm = opt(weights, kInNorm), hidden_norm = opt(weights, kHiddenNorm);
  const int64_t in_width = eagle3 ? 2 * hidden : hidden;
  if (eagle3) {
    TORCH_CHECK_VALUE(emb_in->sizes() == x.sizes() && emb_in->scalar_type() == x.scalar_type(), "taps_ops: decoder_layer: "
                "emb must have x's shape ", x.sizes(), " and dtype, got ", emb_in->sizes(), " ", emb_in->scalar_type());
    check_same_device(x, *emb_in, "x", "emb");
    TORCH_CHECK_VALUE(in_norm.has_value() && hidden_norm.has_value(), "taps_ops: decoder_layer: with emb (EAGLE-3) both "
                "in_norm and hidden_norm are required");
  }
  const int64_t qkv_out = (heads + 2 * kv_heads) * head_dim;
  const at::Tensor qkv_w = required(weights, kQkvW, "qkv");
  const at::Tensor o_w = required(weights, kOW, "o");
  const at::Tensor post_norm = required(weights, kPostNorm, "post_norm");
  const at::Tensor gate_up_w = required(weights, kGateUpW, "gate_up");
  const at::Tensor down_w = required(weights, kDownW, "down");
  const OptTensor qkv_b = opt(weights, kQkvB), o_b = opt(weights, kOB), gate_up_b = opt(weights, kGateUpB),
                  down_b = opt(weights, kDownB);
  const int64_t inter2 = linear_out(gate_up_w, groups);
  TORCH_CHECK_VALUE(inter2 % 2 == 0, "taps_ops: decoder_layer: gate_up must have an even number of outputs (gate, up), "
              "got ", inter2);
  check_linear(qkv_w, qkv_b, x, groups, in_width, qkv_out, "qkv");
  check_linear(o_w, o_b, x, groups, heads * head_dim, hidden, "o");
  check_linear(gate_up_w, gate_up_b, x, groups, hidden, inter2, "gate_up");
  check_linear(down_w, down_b, x, groups, inter2 / 2, hidden, "down");
  check_norm(in_norm, x, groups, hidden, "in_norm");
  check_norm(hidden_norm, x, groups, hidden, "hidden_norm");
  check_norm(post_norm, x, groups, hidden, "post_norm");

  // attention input: (EAGLE-3) cat(in_norm(emb), hidden_norm(x)); else in_norm(x) or x itself
  at::Tensor h;
  if (eagle3)
    h = at::cat({rms_norm(*emb_in, *in_norm, eps[0]), rms_norm(x, *hidden_norm, eps[1])}, -1);
  else
    h = in_norm.has_value() ? rms_norm(x, *in_norm, eps[0]) : x;

  const int64_t qkv_rows = packed ? 1 : gb;  // packed: one row of M tokens
  follow(qkv_w, o_w, groups);
  at::Tensor qkv = project(h, qkv_w, qkv_b).view({qkv_rows, tokens, heads + 2 * kv_heads, head_dim});
  at::Tensor q, k, v;
  if (fused_rope) {
    rope_(qkv.slice(2, 0, heads + kv_heads), cos, sin);
    q = qkv.slice(2, 0, heads);
    k = qkv.slice(2, heads, heads + kv_heads);
    v = qkv.slice(2, heads + kv_heads);
  } else {
    const at::Tensor qk_in = qkv.slice(2, 0, heads + kv_heads);
    v = qkv.slice(2, heads + kv_heads);
    const at::Tensor qk = qk_in * cos + qk_in.roll({head_dim / 2}, {-1}) * sin;
    q = qk.slice(2, 0, heads);
    k = qk.slice(2, heads);
  }
  using at::indexing::Slice;
  at::Tensor attn;
  if (packed) {
    // the packed tokens' K/V to their cache rows (slot / T) and columns; their queries into the [R, T] grid
    // (zeros at the padding slots, whose outputs are dropped); the attention over the grid, each row's queries up
    // to its last packed slot only (live_queries); the packed rows of its output (taps.kv.TreeAttend's packed
    // path, the reference, does the same operators)
    const at::Tensor& rows = *rows_in;
    if (scatter_ok(k, v, keys, values, *write_positions) && rows.is_cpu()) {
      const at::Tensor r = rows.contiguous();
      const int64_t* slot = r.data_ptr<int64_t>();  // (checked above: strictly increasing, in [0, R * T))
      scatter_kv(r.size(0), [&](int64_t n) { return slot[n] / slots_per_row; },
                 [](const at::Tensor& src, int64_t n) { return n * src.stride(1); }, k, v, keys, values,
                 *write_positions);
    } else {
      const at::Tensor cache_rows = rows.div(slots_per_row, "floor");
      at::Tensor(keys).index_put_({cache_rows, Slice(), *write_positions}, k[0]);
      at::Tensor(values).index_put_({cache_rows, Slice(), *write_positions}, v[0]);
    }
    at::Tensor grid = at::zeros({gb * slots_per_row, heads, head_dim}, q.options());
    grid.index_copy_(0, rows, q[0]);
    const at::Tensor out = tree_attention(grid.view({gb, slots_per_row, heads, head_dim}).transpose(1, 2), keys, values,
                                          tree_mask, kv_lens, scale, tree_nodes, live_queries);
    attn = out.transpose(1, 2).reshape({gb * slots_per_row, heads * head_dim}).index_select(0, rows)
               .view({1, x.size(1), heads * head_dim});
  } else {
    if (ragged && scatter_ok(k, v, keys, values, *write_positions)) {
      // keys[rows, :, positions] = k, as taps.lean.kv_writer scatters (row r's token t is n = r * T + t)
      scatter_kv(gb * tokens, [&](int64_t n) { return n / tokens; },
                 [&](const at::Tensor& src, int64_t n) { return (n / tokens) * src.stride(0) + (n % tokens) * src.stride(1); },
                 k, v, keys, values, *write_positions);
    } else if (ragged) {  // (other devices: index_put_ checks the range)
      const at::Tensor rows = at::arange(gb, write_positions->options()).unsqueeze(1);
      at::Tensor(keys).index_put_({rows, Slice(), *write_positions}, k);  // (a handle: the op's in-place arguments)
      at::Tensor(values).index_put_({rows, Slice(), *write_positions}, v);
    } else {
      const at::Tensor key_cols = keys.slice(2, write_start, write_start + tokens);
      const at::Tensor value_cols = values.slice(2, write_start, write_start + tokens);
      if (rows_copyable(k, key_cols) && rows_copyable(v, value_cols)) {
        copy_rows_transposed(k, key_cols);
        copy_rows_transposed(v, value_cols);
      } else {
        at::Tensor(key_cols).copy_(k.transpose(1, 2));
        at::Tensor(value_cols).copy_(v.transpose(1, 2));
      }
    }
    const at::Tensor out = tree_attention(q.transpose(1, 2), keys, values, tree_mask, kv_lens, scale, tree_nodes);
    if (cpu_loop_ok(out) && out.dim() == 4) {
      attn = at::empty({groups, x.size(1), heads * head_dim}, out.options());
      copy_rows_transposed(out, attn.view({gb, tokens, heads, head_dim}));
    } else {
      attn = out.transpose(1, 2).reshape({groups, x.size(1), heads * head_dim});
    }
  }

  follow(o_w, gate_up_w, groups);
  at::Tensor y = project(attn, o_w, o_b);
  add_into(x, y);  // y = x + attn @ o
  follow(gate_up_w, down_w, groups);
  const at::Tensor gate_up = project(rms_norm(y, post_norm, eps[2]), gate_up_w, gate_up_b);
  at::Tensor out = project(silu_times_up(gate_up, inter2 / 2), down_w, down_b);
  add_into(y, out);
  return out;
}

}  // namespace

// The same function for both devices: it only calls other ops, which dispatch on the inputs' device.
TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
TORCH_LIBRARY_IMPL(taps_ops, CUDA, m) { m.impl("decoder_layer", &decoder_layer); }
// oneDNN-packed weights among the arguments make the dispatcher pick this key (x is a plain CPU tensor).
TORCH_LIBRARY_IMPL(taps_ops, MkldnnCPU, m) { m.impl("decoder_layer", &decoder_layer); }

}  // namespace taps
