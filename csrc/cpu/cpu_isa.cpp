// taps::cpu::isa(): the CPU kernels' instruction-set level (see cpu/cpu_isa.h), and the ops that report
// and set it (schemas in csrc/ops.cpp: _cpu_isa, _cpu_host_isa, _set_cpu_isa, _cpu_features).
#include "cpu/cpu_isa.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <mutex>

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

// The ops behind taps_ops.cpu_info / set_cpu_isa (no tensors: registered as catch-all kernels in ops.cpp).
std::string cpu_isa_op() { return isa_name(isa()); }
std::string cpu_host_isa_op() { return isa_name(host_isa()); }
std::string set_cpu_isa_op(std::string level) { return isa_name(set_isa(parse_isa(level, "set_cpu_isa"))); }
std::vector<std::string> cpu_features_op() { return host_features(); }

}  // namespace taps::cpu
