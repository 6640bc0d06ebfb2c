// taps::cpu::isa(): the CPU kernels' instruction-set level (see cpu/cpu_isa.h), and the ops that report
// and set it (schemas in csrc/ops.cpp: _cpu_isa, _cpu_host_isa, _set_cpu_isa, _cpu_features).
#include "cpu/cpu_isa.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>

#if defined(TAPS_CPU_X86)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace taps::cpu {
namespace {

constexpr const char* kNames[] = {"scalar", "avx2", "avx512", "amx"};

Isa detect() {
#if defined(TAPS_CPU_X86)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile")) return Isa::kAmx;
  if (avx512) return Isa::kAvx512;
  if (avx2) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

Isa checked_cap(Isa level, const char* what) {
  TORCH_CHECK_VALUE(static_cast<int>(level) <= static_cast<int>(host_isa()), "taps_ops: ", what, " = ",
                    isa_name(level), ", but this CPU runs at most ", isa_name(host_isa()),
                    " (levels: scalar < avx2 < avx512 < amx)");
  return level;
}

std::atomic<int> g_level{-1};  // -1: not read yet
std::mutex g_init;

}  // namespace

const char* isa_name(Isa level) { return kNames[static_cast<int>(level)]; }

Isa parse_isa(const std::string& name, const char* what) {
  for (int i = 0; i < 4; ++i)
    if (name == kNames[i]) return static_cast<Isa>(i);
  TORCH_CHECK_VALUE(false, "taps_ops: ", what, " = '", name, "' is not an instruction-set level: use one of "
                    "scalar, avx2, avx512, amx");
}

Isa host_isa() {
  static const Isa level = detect();
  return level;
}

Isa isa() {
  const int level = g_level.load(std::memory_order_relaxed);
  if (level >= 0) return static_cast<Isa>(level);
  std::lock_guard<std::mutex> lock(g_init);
  if (g_level.load() < 0) {
    Isa chosen = host_isa();
    if (const char* env = std::getenv("TAPS_CPU_ISA"); env != nullptr && env[0] != '\0')
      chosen = checked_cap(parse_isa(env, "TAPS_CPU_ISA"), "TAPS_CPU_ISA");
    g_level.store(static_cast<int>(chosen));
  }
  return static_cast<Isa>(g_level.load());
}

Isa set_isa(Isa level) {
  g_level.store(static_cast<int>(checked_cap(level, "set_cpu_isa")));
  return level;
}

std::vector<std::string> host_features() {
  std::vector<std::string> out;
#if defined(TAPS_CPU_X86)
  __builtin_cpu_init();
#define TAPS_FEATURE(gcc, name) \
  if (__builtin_cpu_supports(gcc)) out.emplace_back(name);
  TAPS_FEATURE("sse4.2", "sse4_2")
  TAPS_FEATURE("avx", "avx")
  TAPS_FEATURE("avx2", "avx2")
  TAPS_FEATURE("fma", "fma")
  TAPS_FEATURE("f16c", "f16c")
  TAPS_FEATURE("avx512f", "avx512f")
  TAPS_FEATURE("avx512bw", "avx512bw")
  TAPS_FEATURE("avx512vl", "avx512vl")
  TAPS_FEATURE("avx512dq", "avx512dq")
  TAPS_FEATURE("avx512vnni", "avx512_vnni")
  TAPS_FEATURE("avx512bf16", "avx512_bf16")
  TAPS_FEATURE("avx512fp16", "avx512_fp16")
  TAPS_FEATURE("amx-tile", "amx_tile")
  TAPS_FEATURE("amx-bf16", "amx_bf16")
  TAPS_FEATURE("amx-int8", "amx_int8")
#undef TAPS_FEATURE
#endif
  return out;
}

bool host_avx512_bf16() {
  static const bool has = [] {
    const std::vector<std::string> features = host_features();
    return std::find(features.begin(), features.end(), "avx512_bf16") != features.end();
  }();
  return has;
}

bool amx_tiles_ready() {
  static const bool ready = [] {
    if (host_isa() != Isa::kAmx) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr int kReqXcompPerm = 0x1023;   // ARCH_REQ_XCOMP_PERM
    constexpr int kXtiledata = 18;          // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ready;
}

namespace {

// kIters rounds of A independent chains a = step(a), summed by add: A chains cover the latency of two pipes.
constexpr int64_t kIters = 100000;
constexpr int kChains = 12;
template <class F, class Step, class Add>
__attribute__((always_inline)) inline F chains(F start, Step step, Add add) {
  F a[kChains];
  for (int i = 0; i < kChains; ++i) a[i] = start;
  for (int64_t it = 0; it < kIters; ++it)
    for (int i = 0; i < kChains; ++i) a[i] = step(a[i]);
  for (int i = 1; i < kChains; ++i) a[0] = add(a[0], a[i]);
  return a[0];
}
// Each level's loop: a = a * m + c the way its kernels multiply and add (fused at avx2 and above, a
// multiply then an add at the baseline). Returns the FLOPs done (2 per lane and step); *sink keeps the
// result alive. Target regions (not attributes), chains inlined: the lambdas take the region's instruction set.
#if defined(TAPS_CPU_X86)
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
double fma_loop_avx512(float* sink) {
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  *sink = _mm512_reduce_add_ps(chains(_mm512_set1_ps(1.0f), [&](__m512 a) { return _mm512_fmadd_ps(a, m, c); },
                                      [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
  return 2.0 * 16 * kChains * kIters;
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
double fma_loop_avx2(float* sink) {
  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  *sink = _mm256_cvtss_f32(chains(_mm256_set1_ps(1.0f), [&](__m256 a) { return _mm256_fmadd_ps(a, m, c); },
                                  [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); }));
  return 2.0 * 8 * kChains * kIters;
}
#pragma GCC pop_options
double mul_add_loop_sse2(float* sink) {
  const __m128 m = _mm_set1_ps(0.999999f), c = _mm_set1_ps(1e-7f);
  *sink = _mm_cvtss_f32(chains(_mm_set1_ps(1.0f), [&](__m128 a) { return _mm_add_ps(_mm_mul_ps(a, m), c); },
                               [](__m128 a, __m128 b) { return _mm_add_ps(a, b); }));
  return 2.0 * 4 * kChains * kIters;
}
#endif

}  // namespace

double peak_flops(Isa level) {
  checked_cap(level, "cpu_peak_flops");
  float sink = 0.0f;
  double best = 0.0;
  for (int round = 0; round < 20; ++round) {  // the first rounds wake the vector units up; the best counts
    const auto start = std::chrono::steady_clock::now();
    double flops = 0.0;
#if defined(TAPS_CPU_X86)
    if (static_cast<int>(level) >= static_cast<int>(Isa::kAvx512)) flops = fma_loop_avx512(&sink);
    else if (level == Isa::kAvx2) flops = fma_loop_avx2(&sink);
    else flops = mul_add_loop_sse2(&sink);
#else
    volatile float a = 1.0f;  // no vector code to measure: one scalar multiply-add chain
    for (int64_t it = 0; it < kIters; ++it) a = a * 0.999999f + 1e-7f;
    sink = a;
    flops = 2.0 * kIters;
#endif
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, flops / std::max(seconds, 1e-9));
  }
  static volatile float kept;
  kept = sink;  // the loops' results are used
  return best;
}

// The ops behind taps_ops.cpu_info / set_cpu_isa (no tensors: registered as catch-all kernels in ops.cpp).
std::string cpu_isa_op() { return isa_name(isa()); }
std::string cpu_host_isa_op() { return isa_name(host_isa()); }
std::string set_cpu_isa_op(std::string level) { return isa_name(set_isa(parse_isa(level, "set_cpu_isa"))); }
std::vector<std::string> cpu_features_op() { return host_features(); }
double cpu_peak_flops_op(std::string level) { return peak_flops(parse_isa(level, "cpu_peak_flops")); }

}  // namespace taps::cpu
