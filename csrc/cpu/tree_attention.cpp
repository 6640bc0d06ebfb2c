// tree_attention, CPU: input checks (tree_attention_checks.h), the kv_lens check, the key splits
// (attention::plan_splits), and the choice of kernel for this CPU.
//
// q [B, Hq, N, D]; k, v [B, Hkv, S, D]; tree_mask [B, N, W] i64; kv_lens [B] i64; tree_nodes T (>= N, default
// N: the last T keys are tree nodes, the queries usually the newest N of them) -> out [B, Hq, N, D].
//
// Work item = (request b, KV head, key split). The G * N query rows of one KV head (row r = g * N + i:
// query head hkv * G + g, tree node i) are processed together, so each K/V row is read once per
// group. Keys stream in tiles: scores of the whole group against the tile, online softmax per row,
// then acc += P * V. Prefix tiles skip the mask; only tiles reaching the tree tail test bits. When
// B * Hkv alone cannot keep the threads busy, the key range is split and the partial results are
// merged by log-sum-exp, planned and laid out as for CUDA (taps/tree_attention.h), except that each
// request's keys are split by its own length. Everything accumulates in fp32.
//
// Kernels:
// - cpu/tree_attention_vec.h, written over a float vector type. The extension is compiled for the
//   baseline ISA, so at::vec::Vectorized would be its generic 8-lane fallback; on x86-64 with GCC it
//   is compiled twice: inside a `#pragma GCC target` AVX-512 region with ATen's AVX-512
//   Vectorized<float> (namespace at::vec::AVX512, so no clash with other translation units), and for
//   the baseline with a plain 16-lane vector struct; the AVX-512 one runs when the CPU has it and
//   ATen's own capability (ATEN_CPU_CAPABILITY) allows it. Elsewhere (aarch64, clang, ...) it is
//   compiled once with the default Vectorized<float>.
// - cpu/tree_attention_avx512.h, on AVX-512 hosts for fp32 and bf16 with D % 16 == 0: the same work
//   items, tiles and online softmax, with both tile products as row-major micro-GEMMs (a hand-written
//   6 x 64 AVX-512 kernel in fp32, bf16 widened as it is read; opt-in, TAPS_ATTN_BF16_AMX=1, bf16 on
//   at::native::cpublas::brgemm where it runs on AMX). fp16 and other head dims take the Vec kernel.
#include <ATen/ATen.h>
#include <ATen/NumericUtils.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/native/Math.h>
#include <ATen/native/cpu/zmath.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/TypeCast.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <bitset>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "taps/tree_attention.h"
#include "tree_attention_checks.h"

// at::native::cpublas::brgemm / could_pack (oneDNN ukernels, AMX for bf16): declared by the torch
// releases that define these macros; older headers build without the bf16 brgemm path.
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F32F32F32)
#define TAPS_ATTN_BRGEMM 1
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TAPS_ATTN_X86_AVX512 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
// GCC's target pragma does not define the ISA macros in C++; sleef.h and the vec headers test them.
#if !defined(__AVX512F__)
#define TAPS_ATTN_DEFINED_ISA_MACROS
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#endif
#include <ATen/cpu/vec/vec.h>
#if defined(TAPS_ATTN_DEFINED_ISA_MACROS)
#undef __AVX__
#undef __AVX2__
#undef __FMA__
#undef __F16C__
#undef __AVX512F__
#undef __AVX512BW__
#undef __AVX512VL__
#undef __AVX512DQ__
#endif
namespace taps::attention::cpu::avx512 {
using Vec = at::vec::Vectorized<float>;
#include "cpu/tree_attention_vec.h"
#include "cpu/tree_attention_avx512.h"
}  // namespace taps::attention::cpu::avx512
#pragma GCC pop_options

namespace taps::attention::cpu::generic {
// Baseline-ISA stand-in for Vectorized<float>: fixed-size loops the compiler vectorizes.
struct Vec {
  static constexpr int kSize = 16;
  float x[kSize];
  Vec() = default;
  explicit Vec(float s) { for (int i = 0; i < kSize; ++i) x[i] = s; }
  static constexpr int size() { return kSize; }
  static Vec loadu(const float* p) { Vec r; std::memcpy(r.x, p, sizeof(r.x)); return r; }
  void store(float* p) const { std::memcpy(p, x, sizeof(x)); }
  Vec exp_u20() const { Vec r; for (int i = 0; i < kSize; ++i) r.x[i] = std::exp(x[i]); return r; }
  Vec operator-(const Vec& o) const { Vec r; for (int i = 0; i < kSize; ++i) r.x[i] = x[i] - o.x[i]; return r; }
  Vec operator+(const Vec& o) const { Vec r; for (int i = 0; i < kSize; ++i) r.x[i] = x[i] + o.x[i]; return r; }
  Vec operator*(const Vec& o) const { Vec r; for (int i = 0; i < kSize; ++i) r.x[i] = x[i] * o.x[i]; return r; }
};
inline Vec fmadd(const Vec& a, const Vec& b, const Vec& c) {
  Vec r;
  for (int i = 0; i < Vec::kSize; ++i) r.x[i] = a.x[i] * b.x[i] + c.x[i];
  return r;
}
inline Vec maximum(const Vec& a, const Vec& b) {
  Vec r;
  for (int i = 0; i < Vec::kSize; ++i) r.x[i] = a.x[i] > b.x[i] ? a.x[i] : b.x[i];
  return r;
}
#include "cpu/tree_attention_vec.h"
}  // namespace taps::attention::cpu::generic

#else  // one build with the default Vectorized<float> (NEON on aarch64)
#include <ATen/cpu/vec/vec.h>
namespace taps::attention::cpu::generic {
using Vec = at::vec::Vectorized<float>;
#include "cpu/tree_attention_vec.h"
}  // namespace taps::attention::cpu::generic
#endif

namespace taps::attention::cpu {
namespace {

bool use_avx512() {
#if defined(TAPS_ATTN_X86_AVX512)
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("fma") && at::get_cpu_capability() == "AVX512";
  return ok;
#else
  return false;
#endif
}

// The GEMM-shaped fast path: AVX-512 hosts, D a multiple of 16, fp32 and bf16 (bf16 widened to fp32 as it
// is read, the fp32 micro-GEMMs). Everything else takes the Vec kernel. 0: Vec kernel, 1: fast path,
// 2: fast path with the bf16 products on oneDNN's brgemm ukernel, only when asked for (environment
// TAPS_ATTN_BF16_AMX=1) and where it runs on AMX (could_pack). That path rounds P to bf16 for the P * V
// product (as PyTorch's CPU flash attention does), which moves the output enough to flip near-tie greedy
// tokens: on an AMX host it made one of the demo's two answers of the shipped bf16 target differ from the
// target's own greedy output, while fp32 P gave both.
template <class T>
int fast_mode(const Params& p) {
#if defined(TAPS_ATTN_X86_AVX512)
  if (!use_avx512() || p.head_dim % 16 != 0) return 0;
  if constexpr (std::is_same_v<T, float>) {
    return 1;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(TAPS_ATTN_BRGEMM)
    static const bool amx = [] {
      const char* flag = std::getenv("TAPS_ATTN_BF16_AMX");
      return flag != nullptr && std::strcmp(flag, "1") == 0 && at::native::cpublas::could_pack(at::kBFloat16);
    }();
    if (amx) return 2;
#endif
    return 1;
  }
#endif
  return 0;
}

template <class T>
void run(const Params& p) {
  const int64_t items = p.batch * p.heads_kv * p.splits;
  [[maybe_unused]] const int mode = fast_mode<T>(p);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
#if defined(TAPS_ATTN_X86_AVX512)
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
#if defined(TAPS_ATTN_BRGEMM)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (mode == 2) return avx512::fast::attend_items_fast<T, true>(p, begin, end);
      }
#endif
      if (mode == 1) return avx512::fast::attend_items_fast<T, false>(p, begin, end);
    }
    if (use_avx512()) return avx512::attend_items<T>(p, begin, end);
#endif
    generic::attend_items<T>(p, begin, end);
  });
  if (p.splits == 1) return;
  const int64_t rows = p.batch * p.heads_q * p.num_nodes;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
#if defined(TAPS_ATTN_X86_AVX512)
    if (use_avx512()) return avx512::combine_rows<T>(p, begin, end);
#endif
    generic::combine_rows<T>(p, begin, end);
  });
}


}  // namespace
}  // namespace taps::attention::cpu

namespace taps {
namespace {

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& tree_mask, const at::Tensor& kv_lens, double scale,
                              bool /*validate: the CPU always checks kv_lens (no sync to save)*/,
                              std::optional<int64_t> tree_nodes) {
  const int64_t tree = check_tree_attention_inputs(q, k, v, tree_mask, kv_lens, scale, tree_nodes);
  const int64_t batch = q.size(0), heads_kv = k.size(1), cache_len = k.size(2);
  TreeAttentionCall call = TreeAttentionCall::prepare(q, k, v, tree_mask, kv_lens);
  const int64_t* lens = call.kv_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= tree && lens[b] <= cache_len, "taps_ops: tree_attention: kv_lens[", b, "] = ",
                lens[b], " must be in [T, S] = [", tree, ", ", cache_len, "] (T: tree nodes)");
  }
  if (call.out.numel() == 0) return call.out;
  // Key splits when B * Hkv work items cannot feed the threads (4 items a thread); no cap on their
  // number (the combine has no fixed buffer).
  const int64_t max_len = *std::max_element(lens, lens + batch);
  const int64_t splits = attention::plan_splits(batch * heads_kv, 4 * at::get_num_threads(), max_len,
                                                std::numeric_limits<int64_t>::max());
  const attention::Params p = call.params(scale, splits, tree);
  switch (call.q.scalar_type()) {
    case at::kFloat: attention::cpu::run<float>(p); break;
    case at::kBFloat16: attention::cpu::run<c10::BFloat16>(p); break;
    default: attention::cpu::run<c10::Half>(p); break;
  }
  return call.out;
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("tree_attention", &taps::tree_attention_cpu); }
