// head_argmax, CPU: the greedy token of each row of x under a linear head kept as panels (taps_ops.panel_linear's
// weight), exactly the argmax of panel_linear(x, panels) (ties to the lowest id), from an int8 screen of the head.
//
// Why: at temperature 0 verification needs one number per visited row, the argmax of the head's logits, and
// the head is the largest product of a small target's step (the shipped target: 8,192 x 256, 40% of a token's
// multiply-adds; 16 rows of it cost 0.37 ms in bf16, 0.67 ms in fp32 on a Zen 4). The screen holds the head
// in int8 (a scale per output) and x is quantized per row to 7 bits: an integer dot product per output gives
// an approximate logit a_v and a rigorous bound B_v on |exact_v - a_v| (quantization of W and of x, and the
// float32 rounding of the exact sum). Every output whose upper bound a_v + B_v reaches the best lower bound
// max_u (a_u - B_u) (less one bf16 step when the logits are rounded to bf16) is a candidate; only the panels
// holding candidates are multiplied exactly (panel_linear's own kernel: the same bits), and the argmax is taken
// among them. An output left out is below the winner's exact value, strictly, so the result is the argmax of
// the full product bit for bit, ties included. Rows whose screen keeps too many candidates (a flat row), or
// whose x is not finite or all zero, get the full product.
//
// Work: rows x out x in int8 multiply-adds (AVX512-VNNI: 64 a vpdpbusd; AVX2: 32 per vpmaddubsw + vpmaddwd) plus
// the candidates' panels exactly; bytes: out x in of int8 (a quarter of float32 panels', half of bfloat16's).
// The screen's integer sums are exact at every level (7-bit x, so AVX2's 16-bit pair sums cannot saturate):
// the candidates, and so the result, are the same at every instruction-set level.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "checks/checks.h"
#include "cpu/cpu_isa.h"

#if defined(TAPS_CPU_X86)
#include <immintrin.h>
#endif

namespace taps {

at::Tensor panel_linear_call(const at::Tensor& x, const at::Tensor& panels);  // cpu/panel_linear.cpp

namespace head_cpu {

constexpr int64_t kPanel = 16;          // outputs per panel
constexpr int64_t kGroup = 4;           // inputs per 32-bit lane of the screen
constexpr int kXLevels = 63;            // x quantized to [-63, 63], stored as u8 x + 64 in [1, 127]
constexpr int kXOffset = 64;
constexpr int64_t kMaxCandidates = 256; // per row; more: that row gets the full product
constexpr int64_t kBlockPanels = 32;    // screen panels per output block (4 KiB each at in = 256): stays in L2

// One row of x quantized: its u8 lanes (groups of 4 inputs), scale t (x ~ t * (u - 64)), |x|_1.
struct QRow {
  std::vector<uint32_t> lanes;
  float t = 0.0f;
  double l1 = 0.0;
  bool ok = false;
};

// Per output block: the integer sums of rows [0, rows) times screen panels [p_lo, p_hi) written to acc
// [rows, out] (int32, the x offset not yet removed).
using ScreenFn = void (*)(const QRow* rows, int64_t nrows, const int8_t* screen, int64_t groups, int64_t p_lo,
                          int64_t p_hi, int32_t* acc, int64_t out);

void screen_scalar(const QRow* rows, int64_t nrows, const int8_t* screen, int64_t groups, int64_t p_lo, int64_t p_hi,
                   int32_t* acc, int64_t out) {
  for (int64_t r = 0; r < nrows; ++r) {
    const uint8_t* x = reinterpret_cast<const uint8_t*>(rows[r].lanes.data());
    for (int64_t p = p_lo; p < p_hi; ++p) {
      const int8_t* w = screen + p * groups * kPanel * kGroup;
      for (int64_t o = 0; o < kPanel; ++o) {
        int32_t sum = 0;
        for (int64_t g = 0; g < groups; ++g)
          for (int64_t k = 0; k < kGroup; ++k)
            sum += static_cast<int32_t>(x[g * kGroup + k]) * static_cast<int32_t>(w[(g * kPanel + o) * kGroup + k]);
        acc[r * out + p * kPanel + o] = sum;
      }
    }
  }
}

#if defined(TAPS_CPU_X86)

// AVX512-VNNI: a panel's 16 outputs are one vector of int32 sums; a group of 4 inputs is one vpdpbusd per row
// and panel (the row's 4 u8 broadcast, the panel's 64 int8). Blocks of up to 4 rows x 4 panels.
template <int RB, int KP>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) inline void vnni_block(
    const QRow* rows, const int8_t* screen, int64_t groups, int64_t p0, int32_t* acc, int64_t out) {
  __m512i sum[RB][KP];
  for (int r = 0; r < RB; ++r)
    for (int k = 0; k < KP; ++k) sum[r][k] = _mm512_setzero_si512();
  const int64_t stride = groups * kPanel * kGroup;
  const int8_t* w = screen + p0 * stride;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i b[KP];
    for (int k = 0; k < KP; ++k) b[k] = _mm512_loadu_si512(w + k * stride + g * kPanel * kGroup);
    for (int r = 0; r < RB; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(rows[r].lanes[g]));
      for (int k = 0; k < KP; ++k) sum[r][k] = _mm512_dpbusd_epi32(sum[r][k], a, b[k]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int k = 0; k < KP; ++k) _mm512_storeu_si512(acc + r * out + (p0 + k) * kPanel, sum[r][k]);
}

template <int RB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void vnni_rows(
    const QRow* rows, const int8_t* screen, int64_t groups, int64_t p_lo, int64_t p_hi, int32_t* acc, int64_t out) {
  int64_t p = p_lo;
  for (; p + 4 <= p_hi; p += 4) vnni_block<RB, 4>(rows, screen, groups, p, acc, out);
  for (; p < p_hi; ++p) vnni_block<RB, 1>(rows, screen, groups, p, acc, out);
}

void screen_vnni(const QRow* rows, int64_t nrows, const int8_t* screen, int64_t groups, int64_t p_lo, int64_t p_hi,
                 int32_t* acc, int64_t out) {
  for (int64_t r = 0; r < nrows;) {
    const int64_t rb = std::min<int64_t>(4, nrows - r);
    int32_t* a = acc + r * out;
    switch (rb) {
      case 1: vnni_rows<1>(rows + r, screen, groups, p_lo, p_hi, a, out); break;
      case 2: vnni_rows<2>(rows + r, screen, groups, p_lo, p_hi, a, out); break;
      case 3: vnni_rows<3>(rows + r, screen, groups, p_lo, p_hi, a, out); break;
      default: vnni_rows<4>(rows + r, screen, groups, p_lo, p_hi, a, out); break;
    }
    r += rb;
  }
}

// AVX2: a panel's 16 outputs are two vectors of 8 int32 sums; vpmaddubsw multiplies the row's u8 (<= 127) by the
// int8 weights and adds pairs into 16 bits (|sum| <= 2 * 127 * 127 < 2^15: no saturation), vpmaddwd by ones adds
// the pairs' pairs into 32 bits. Blocks of up to 2 rows x 2 panels (8 sums).
template <int RB, int KP>
__attribute__((target("avx2,fma"))) inline void avx2_block(const QRow* rows, const int8_t* screen, int64_t groups,
                                                           int64_t p0, int32_t* acc, int64_t out) {
  __m256i sum[RB][KP][2];
  for (int r = 0; r < RB; ++r)
    for (int k = 0; k < KP; ++k) sum[r][k][0] = sum[r][k][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t stride = groups * kPanel * kGroup;
  const int8_t* w = screen + p0 * stride;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i b[KP][2];
    for (int k = 0; k < KP; ++k)
      for (int h = 0; h < 2; ++h)
        b[k][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * stride + g * kPanel * kGroup + h * 32));
    for (int r = 0; r < RB; ++r) {
      const __m256i a = _mm256_set1_epi32(static_cast<int>(rows[r].lanes[g]));
      for (int k = 0; k < KP; ++k)
        for (int h = 0; h < 2; ++h)
          sum[r][k][h] = _mm256_add_epi32(sum[r][k][h], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b[k][h]), ones));
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int k = 0; k < KP; ++k)
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * out + (p0 + k) * kPanel + h * 8), sum[r][k][h]);
}

template <int RB>
__attribute__((target("avx2,fma"))) void avx2_rows(const QRow* rows, const int8_t* screen, int64_t groups,
                                                   int64_t p_lo, int64_t p_hi, int32_t* acc, int64_t out) {
  int64_t p = p_lo;
  for (; p + 2 <= p_hi; p += 2) avx2_block<RB, 2>(rows, screen, groups, p, acc, out);
  for (; p < p_hi; ++p) avx2_block<RB, 1>(rows, screen, groups, p, acc, out);
}

void screen_avx2(const QRow* rows, int64_t nrows, const int8_t* screen, int64_t groups, int64_t p_lo, int64_t p_hi,
                 int32_t* acc, int64_t out) {
  for (int64_t r = 0; r < nrows;) {
    const int64_t rb = std::min<int64_t>(2, nrows - r);
    if (rb == 2) avx2_rows<2>(rows + r, screen, groups, p_lo, p_hi, acc + r * out, out);
    else avx2_rows<1>(rows + r, screen, groups, p_lo, p_hi, acc + r * out, out);
    r += rb;
  }
}
#endif  // TAPS_CPU_X86

// One row's bounds: hi[v] = a_v + B_v and the row's best lower bound max_v (a_v - B_v), with a_v = s_v t dot_v,
// dot_v = acc_v - 64 * sum(q_v) (exact in int32), B_v = s_v (c1 + c2 |q_v|_1) + 1e-6 |a_v| (c1, c2: the row's
// terms, see the caller; 1e-6 |a_v| covers a_v's float32 roundings). Also the largest |a_v| + B_v (the caller's
// margins scale with it).
struct RowBounds {
  float lower;
  float magnitude;
};

RowBounds bounds_scalar(const int32_t* acc, const int32_t* offset, const float* scale, const float* qabs, int64_t out,
                        float t, float c1, float c2, float* hi) {
  float lower = -std::numeric_limits<float>::infinity(), mag = 0.0f;
  for (int64_t v = 0; v < out; ++v) {
    const float a = scale[v] * t * static_cast<float>(acc[v] - offset[v]);
    const float b = scale[v] * (c1 + c2 * qabs[v]) + std::fabs(a) * 1e-6f;
    hi[v] = a + b;
    lower = std::max(lower, a - b);
    mag = std::max(mag, std::fabs(a) + b);
  }
  return {lower, mag};
}

#if defined(TAPS_CPU_X86)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) RowBounds bounds_avx512(
    const int32_t* acc, const int32_t* offset, const float* scale, const float* qabs, int64_t out, float t, float c1,
    float c2, float* hi) {
  const __m512 vt = _mm512_set1_ps(t), vc1 = _mm512_set1_ps(c1), vc2 = _mm512_set1_ps(c2), rel = _mm512_set1_ps(1e-6f);
  __m512 lower = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), mag = _mm512_setzero_ps();
  int64_t v = 0;
  for (; v + 16 <= out; v += 16) {
    const __m512i dot = _mm512_sub_epi32(_mm512_loadu_si512(acc + v), _mm512_loadu_si512(offset + v));
    const __m512 s = _mm512_loadu_ps(scale + v);
    const __m512 a = _mm512_mul_ps(_mm512_mul_ps(s, vt), _mm512_cvtepi32_ps(dot));
    const __m512 abs_a = _mm512_abs_ps(a);
    const __m512 b = _mm512_fmadd_ps(abs_a, rel, _mm512_mul_ps(s, _mm512_fmadd_ps(vc2, _mm512_loadu_ps(qabs + v), vc1)));
    _mm512_storeu_ps(hi + v, _mm512_add_ps(a, b));
    lower = _mm512_max_ps(lower, _mm512_sub_ps(a, b));
    mag = _mm512_max_ps(mag, _mm512_add_ps(abs_a, b));
  }
  RowBounds r{_mm512_reduce_max_ps(lower), _mm512_reduce_max_ps(mag)};
  const RowBounds tail = bounds_scalar(acc + v, offset + v, scale + v, qabs + v, out - v, t, c1, c2, hi + v);
  return {std::max(r.lower, tail.lower), std::max(r.magnitude, tail.magnitude)};
}

__attribute__((target("avx2,fma"))) RowBounds bounds_avx2(const int32_t* acc, const int32_t* offset, const float* scale,
                                                         const float* qabs, int64_t out, float t, float c1, float c2,
                                                         float* hi) {
  const __m256 vt = _mm256_set1_ps(t), vc1 = _mm256_set1_ps(c1), vc2 = _mm256_set1_ps(c2), rel = _mm256_set1_ps(1e-6f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 lower = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), mag = _mm256_setzero_ps();
  int64_t v = 0;
  for (; v + 8 <= out; v += 8) {
    const __m256i dot = _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + v)),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset + v)));
    const __m256 s = _mm256_loadu_ps(scale + v);
    const __m256 a = _mm256_mul_ps(_mm256_mul_ps(s, vt), _mm256_cvtepi32_ps(dot));
    const __m256 abs_a = _mm256_andnot_ps(sign, a);
    const __m256 b = _mm256_fmadd_ps(abs_a, rel, _mm256_mul_ps(s, _mm256_fmadd_ps(vc2, _mm256_loadu_ps(qabs + v), vc1)));
    _mm256_storeu_ps(hi + v, _mm256_add_ps(a, b));
    lower = _mm256_max_ps(lower, _mm256_sub_ps(a, b));
    mag = _mm256_max_ps(mag, _mm256_add_ps(abs_a, b));
  }
  float lo8[8], mag8[8];
  _mm256_storeu_ps(lo8, lower);
  _mm256_storeu_ps(mag8, mag);
  RowBounds r = bounds_scalar(acc + v, offset + v, scale + v, qabs + v, out - v, t, c1, c2, hi + v);
  for (int i = 0; i < 8; ++i) r.lower = std::max(r.lower, lo8[i]), r.magnitude = std::max(r.magnitude, mag8[i]);
  return r;
}
#endif

// The outputs v in [from, out) with hi[v] >= threshold, ascending, appended to c; false once c holds more than
// `most`.
bool scan_from(const float* hi, int64_t from, int64_t out, float threshold, std::vector<int64_t>& c, int64_t most) {
  for (int64_t v = from; v < out; ++v)
    if (hi[v] >= threshold) {
      c.push_back(v);
      if (static_cast<int64_t>(c.size()) > most) return false;
    }
  return true;
}

bool scan_scalar(const float* hi, int64_t out, float threshold, std::vector<int64_t>& c, int64_t most) {
  return scan_from(hi, 0, out, threshold, c, most);
}

#if defined(TAPS_CPU_X86)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) bool scan_avx512(const float* hi, int64_t out,
                                                                              float threshold, std::vector<int64_t>& c,
                                                                              int64_t most) {
  const __m512 th = _mm512_set1_ps(threshold);
  int64_t v = 0;
  for (; v + 16 <= out; v += 16) {
    uint32_t mask = _mm512_cmp_ps_mask(_mm512_loadu_ps(hi + v), th, _CMP_GE_OQ);
    while (mask != 0) {
      c.push_back(v + __builtin_ctz(mask));
      if (static_cast<int64_t>(c.size()) > most) return false;
      mask &= mask - 1;
    }
  }
  return scan_from(hi, v, out, threshold, c, most);
}

__attribute__((target("avx2,fma"))) bool scan_avx2(const float* hi, int64_t out, float threshold,
                                                   std::vector<int64_t>& c, int64_t most) {
  const __m256 th = _mm256_set1_ps(threshold);
  int64_t v = 0;
  for (; v + 8 <= out; v += 8) {
    uint32_t mask = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(hi + v), th, _CMP_GE_OQ)));
    while (mask != 0) {
      c.push_back(v + __builtin_ctz(mask));
      if (static_cast<int64_t>(c.size()) > most) return false;
      mask &= mask - 1;
    }
  }
  return scan_from(hi, v, out, threshold, c, most);
}
#endif

bool host_vnni() {
#if defined(TAPS_CPU_X86)
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

// The kernels of the level in force: avx512 (its screen AVX512-VNNI's where the host has it, else AVX2's), avx2, or
// scalar.
struct Kernels {
  ScreenFn screen;
  RowBounds (*bounds)(const int32_t*, const int32_t*, const float*, const float*, int64_t, float, float, float, float*);
  bool (*scan)(const float*, int64_t, float, std::vector<int64_t>&, int64_t);
};

Kernels kernels() {
#if defined(TAPS_CPU_X86)
  if (cpu::at_least(cpu::Isa::kAvx512)) return {host_vnni() ? &screen_vnni : &screen_avx2, &bounds_avx512, &scan_avx512};
  if (cpu::at_least(cpu::Isa::kAvx2)) return {&screen_avx2, &bounds_avx2, &scan_avx2};
#endif
  return {&screen_scalar, &bounds_scalar, &scan_scalar};
}

// x's row (float32 values) quantized; ok = false for a row that is not finite or all zero (it gets the full product).
QRow quantize(const float* x, int64_t in, int64_t groups) {
  QRow q;
  float top = 0.0f;
  double l1 = 0.0;
  for (int64_t i = 0; i < in; ++i) {
    const float v = x[i];
    if (!std::isfinite(v)) return q;
    top = std::max(top, std::fabs(v));
    l1 += std::fabs(static_cast<double>(v));
  }
  if (top == 0.0f) return q;
  q.t = top / kXLevels;
  q.l1 = l1;
  // inputs past `in` hold x = 0 (u8 64): the screen may have weights there (bf16 panels take any in with the same
  // ceil(in / 2)), which the offset 64 * sum(q_v) then cancels exactly
  q.lanes.assign(static_cast<size_t>(groups), 0x40404040u);
  uint8_t* u = reinterpret_cast<uint8_t*>(q.lanes.data());
  for (int64_t i = 0; i < in; ++i) {
    const long level = std::lround(static_cast<double>(x[i]) / q.t);
    u[i] = static_cast<uint8_t>(std::clamp<long>(level, -kXLevels, kXLevels) + kXOffset);
  }
  q.ok = true;
  return q;
}

}  // namespace head_cpu

namespace {

using namespace head_cpu;

at::Tensor head_argmax_cpu(const at::Tensor& x_in, const at::Tensor& screen, const at::Tensor& meta,
                           const at::Tensor& panels) {
  TORCH_CHECK_VALUE(x_in.defined() && screen.defined() && meta.defined() && panels.defined(),
                    "taps_ops: head_argmax: x, screen, meta and panels must be defined");
  for (const at::Tensor* t : {&x_in, &screen, &meta, &panels})
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->layout() == at::kStrided,
                      "taps_ops: head_argmax: every tensor must be a dense CPU tensor, got one on ", t->device());
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
                    "taps_ops: head_argmax: x must be float32 or bfloat16, got ", x_in.scalar_type());
  TORCH_CHECK_VALUE(x_in.dim() >= 1, "taps_ops: head_argmax: x [..., in] must have at least 1 dimension");
  TORCH_CHECK_VALUE(screen.scalar_type() == at::kChar && screen.dim() == 4 && screen.size(2) == kPanel &&
                        screen.size(3) == kGroup && screen.is_contiguous(),
                    "taps_ops: head_argmax: screen must be a contiguous int8 [out / 16, ceil(in / 4), 16, 4] "
                    "(taps_ops.pack_head_screen), got ", screen.scalar_type(), " of shape ", screen.sizes());
  const int64_t in = x_in.size(-1);
  const int64_t groups = screen.size(1);
  TORCH_CHECK_VALUE(groups == (in + kGroup - 1) / kGroup, "taps_ops: head_argmax: x's last dimension ", in,
                    " does not match the screen's ceil(in / 4) = ", groups);
  TORCH_CHECK_VALUE(in <= 32768, "taps_ops: head_argmax: at most 32768 inputs (int32 sums), got ", in);
  const int64_t num_panels = screen.size(0);
  const int64_t out = num_panels * kPanel;
  TORCH_CHECK_VALUE(meta.scalar_type() == at::kFloat && meta.dim() == 2 && meta.size(0) == 3 && meta.size(1) == out,
                    "taps_ops: head_argmax: meta must be float32 [3, out] = [3, ", out, "] (scales, integer row sums, "
                    "|row|_1 of the screen: taps_ops.pack_head_screen), got ", meta.scalar_type(), " of shape ",
                    meta.sizes());
  TORCH_CHECK_VALUE(panels.dim() >= 3 && panels.size(0) == num_panels, "taps_ops: head_argmax: panels must hold the "
                    "screen's ", num_panels, " panels (", out, " outputs), got shape ", panels.sizes());
  if (panels.scalar_type() == at::kFloat) {
    TORCH_CHECK_VALUE(panels.dim() == 3 && panels.size(1) == in && panels.size(2) == kPanel && x_in.scalar_type() == at::kFloat,
                      "taps_ops: head_argmax: float32 panels must be [out / 16, in, 16] with in = x's last dimension ",
                      in, ", over float32 x; got panels of shape ", panels.sizes(), " and x ", x_in.scalar_type());
  } else {
    TORCH_CHECK_VALUE(panels.scalar_type() == at::kBFloat16 && panels.dim() == 4 && panels.size(1) == (in + 1) / 2 &&
                          panels.size(2) == kPanel && panels.size(3) == 2,
                      "taps_ops: head_argmax: panels must be float32 [out / 16, in, 16] or bfloat16 [out / 16, "
                      "ceil(in / 2), 16, 2] with in = x's last dimension ", in, ", got ", panels.scalar_type(),
                      " of shape ", panels.sizes());
  }
  // bfloat16 x: its logits are rounded to bfloat16 (panel_linear's result), which the candidates allow for
  const bool half = x_in.scalar_type() == at::kBFloat16;
  const at::Tensor x = x_in.reshape({-1, in});
  const int64_t rows = x.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end() - 1);
  at::Tensor result = at::empty(shape, x_in.options().dtype(at::kLong));
  if (rows == 0) return result;
  const at::Tensor xf = x.to(at::kFloat, /*non_blocking=*/false, /*copy=*/false, at::MemoryFormat::Contiguous);
  const float* xp = xf.data_ptr<float>();
  const at::Tensor m = meta.contiguous();
  const float* scale = m.data_ptr<float>();
  const float* qsum = scale + out;   // integers
  const float* qabs = scale + 2 * out;
  int64_t* best = result.data_ptr<int64_t>();

  // rows that are finite and not all zero are screened; the others (and rows whose screen keeps too many
  // candidates) get the full product
  std::vector<QRow> q;
  std::vector<int64_t> screened, plain;
  for (int64_t r = 0; r < rows; ++r) {
    QRow row = in > 0 ? quantize(xp + r * in, in, groups) : QRow{};
    if (row.ok) {
      q.push_back(std::move(row));
      screened.push_back(r);
    } else {
      plain.push_back(r);
    }
  }
  const int64_t n = static_cast<int64_t>(screened.size());
  const auto long_index = [](const std::vector<int64_t>& v) {
    return at::tensor(v, at::TensorOptions().dtype(at::kLong));
  };
  // x's rows `which` (x itself when they are all of them)
  const auto rows_of = [&](const std::vector<int64_t>& which) {
    return static_cast<int64_t>(which.size()) == rows ? x : x.index_select(0, long_index(which));
  };

  // integer sums [n, out], block by block (a block of screen panels stays in L2 while the rows pass)
  std::vector<int32_t> acc(static_cast<size_t>(n * out));
  const Kernels k = kernels();
  if (n > 0) {
    const int8_t* s = screen.data_ptr<int8_t>();
    for (int64_t p = 0; p < num_panels; p += kBlockPanels)
      k.screen(q.data(), n, s, groups, p, std::min(num_panels, p + kBlockPanels), acc.data(), out);
  }

  // bounds and candidates per row
  // |x.W_v - a_v| <= s_v / 2 * (|x|_1 + t |q_v|_1) (W's and x's quantization); the float32 sum panel_linear computes
  // adds at most (in + 2) 2^-24 |x|_1 max|W_v| <= (in + 2) 2^-24 |x|_1 128 s_v: c1 and c2 hold these with a
  // relative 1e-5 to spare (the bounds' own float32 roundings)
  std::vector<int32_t> offset(static_cast<size_t>(out));
  for (int64_t v = 0; v < out; ++v) offset[v] = kXOffset * static_cast<int32_t>(qsum[v]);
  std::vector<float> hi(static_cast<size_t>(out));
  std::vector<std::vector<int64_t>> cands(static_cast<size_t>(n));
  std::vector<int64_t> kept_rows;  // screened rows whose candidates are few enough
  for (int64_t i = 0; i < n; ++i) {
    const QRow& row = q[i];
    const double l1 = row.l1;
    const float c1 = static_cast<float>((0.5 * l1 + 2.0 * (in + 2) * std::ldexp(1.0, -24) * l1 * 128.0) * (1.0 + 1e-5));
    const float c2 = static_cast<float>(0.5 * row.t * (1.0 + 1e-5));
    const int32_t* a = acc.data() + i * out;
    const RowBounds rb = k.bounds(a, offset.data(), scale, qabs, out, row.t, c1, c2, hi.data());
    // the comparisons' own roundings (1e-5 of the magnitudes), and for bf16 logits one bf16 step (2^-7 of a
    // value's magnitude, 2^-6 to spare): a value that close to the winner's may round to a tie with it
    const float margin = rb.magnitude * (half ? 0.015625f + 1e-5f : 1e-5f) + 1e-30f;
    const float threshold = rb.lower - margin;
    if (k.scan(hi.data(), out, threshold, cands[i], kMaxCandidates)) {
      kept_rows.push_back(i);
    } else {
      plain.push_back(screened[i]);
      cands[i].clear();
    }
  }

  // the candidates' panels, once each, multiplied exactly (panel_linear: the bits of the full product)
  if (!kept_rows.empty()) {
    std::vector<int64_t> panel_of(static_cast<size_t>(num_panels), -1);
    std::vector<int64_t> chosen, originals;
    for (int64_t i : kept_rows) {
      originals.push_back(screened[i]);
      for (int64_t v : cands[i])
        if (panel_of[v / kPanel] < 0) {
          panel_of[v / kPanel] = static_cast<int64_t>(chosen.size());
          chosen.push_back(v / kPanel);
        }
    }
    const at::Tensor exact =
        panel_linear_call(rows_of(originals), panels.index_select(0, long_index(chosen))).to(at::kFloat);
    const float* e = exact.data_ptr<float>();
    const int64_t width = exact.size(1);
    for (size_t j = 0; j < kept_rows.size(); ++j) {
      int64_t arg = -1;
      float top = 0.0f;
      for (int64_t v : cands[kept_rows[j]]) {  // ascending ids: a tie keeps the lowest
        const float val = e[static_cast<int64_t>(j) * width + panel_of[v / kPanel] * kPanel + v % kPanel];
        if (arg < 0 || val > top) arg = v, top = val;
      }
      best[originals[j]] = arg;
    }
  }
  // the full product's argmax (ties to the lowest id, as at::argmax) for the other rows
  if (!plain.empty()) {
    std::sort(plain.begin(), plain.end());
    const at::Tensor full = panel_linear_call(rows_of(plain), panels).argmax(-1);
    const int64_t* f = full.data_ptr<int64_t>();
    for (size_t j = 0; j < plain.size(); ++j) best[plain[j]] = f[j];
  }
  return result;
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("head_argmax", &head_argmax_cpu); }

}  // namespace taps
