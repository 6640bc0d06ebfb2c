// The one instruction-set dispatch of the CPU kernels.
//
// Every CPU kernel with a vectorised fast path compiles it once per instruction set it supports (functions
// or regions with a GCC `target` attribute; the extension itself is built for the x86-64 baseline) and
// picks one per call from taps::cpu::isa(): the best level this CPU can run (cpuid, read once), capped by
// the environment variable TAPS_CPU_ISA=amx|avx512|avx2|scalar when the library loads, or later by
// set_isa() (taps_ops.set_cpu_isa, for tests and benchmarks). Asking for a level the CPU cannot run is an
// error, never a silent fallback. Levels (each includes the ones below it):
//   scalar  the portable code (the baseline: SSE2 on x86-64, whatever the compiler vectorises elsewhere;
//           panel_linear's, whose sums need a fused multiply-add, has a copy compiled with FMA that hosts of
//           level avx2 and above run, so that the level forced on such a host is not a libm call per term)
//   avx2    AVX2 + FMA + F16C (every x86-64 CPU since 2013-2015: Haswell, Zen)
//   avx512  AVX-512 F/BW/VL/DQ (Skylake-SP and later, Zen 4)
//   amx     AVX-512 plus AMX-BF16 tiles (Sapphire Rapids and later): panel_linear's bfloat16 x over bfloat16
//           panels (tile products, cpu/panel_linear.cpp) and tree_attention's bf16 brgemm path
// Kernels whose results the op contract pins bit for bit (rms_norm, rope_, expand_level) use their AVX2
// code without FMA contraction, so every level gives the same bits.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace at {
class Tensor;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TAPS_CPU_X86 1
// Function attributes for code compiled for one level. AVX2 without fma: GCC contracts a * b + c into
// fused multiply-adds wherever FMA is enabled (-ffp-contract=fast), which would change the bits of the
// elementwise ops; kernels with explicit FMA intrinsics take TAPS_TARGET_AVX2_FMA.
#define TAPS_TARGET_AVX2 __attribute__((target("avx2"), flatten))
#define TAPS_TARGET_AVX2_FMA __attribute__((target("avx2,fma,f16c")))
#define TAPS_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#endif

namespace taps::cpu {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

// The best level this CPU can run (cpuid, read once).
Isa host_isa();
// The level the kernels use now: host_isa() capped by TAPS_CPU_ISA at load time or by set_isa().
// Throws c10::ValueError (on first use) when TAPS_CPU_ISA names an unknown level or one above host_isa().
Isa isa();
// Caps the kernels at `level` (<= host_isa(), else c10::ValueError); returns the level now in force.
Isa set_isa(Isa level);
const char* isa_name(Isa level);
Isa parse_isa(const std::string& name, const char* what);  // c10::ValueError for unknown names
// FLOP/s of one core's fp32 multiply-adds at `level` (<= host_isa(), else c10::ValueError), measured (a few
// ms): vectors of the level's width, fused at avx2 and above, a multiply and an add at the baseline.
double peak_flops(Isa level);
// The CPU features the kernels look at, by name ("avx2", "fma", ..., "avx512_bf16", "amx_bf16").
std::vector<std::string> host_features();
// Whether this CPU has AVX512-BF16's dot product (vdpbf16ps; cpuid, read once). Kernels that use it do so at
// the avx512 level and above; its results are pinned to a fused multiply-add sequence the other levels run.
bool host_avx512_bf16();
// Whether this process may use AMX tiles: the host has AMX-BF16 and (Linux) the kernel granted the tile data
// state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once). False elsewhere; kernels then keep their AVX-512 code.
bool amx_tiles_ready();

// The ops behind taps_ops.cpu_info(), taps_ops.set_cpu_isa() and the benchmarks' measured peak (schemas in
// csrc/ops.cpp).
std::string cpu_isa_op();
std::string cpu_host_isa_op();
std::string set_cpu_isa_op(std::string level);
std::vector<std::string> cpu_features_op();
double cpu_peak_flops_op(std::string level);

inline bool at_least(Isa level) { return static_cast<int>(isa()) >= static_cast<int>(level); }

}  // namespace taps::cpu

namespace taps {
// panel_linear's software prefetch settings (cpu/panel_linear.cpp; the ops _set_panel_prefetch, _set_panel_next):
// each returns the old one
int64_t set_panel_prefetch_op(int64_t lines);
bool set_panel_next_op(bool on);
// The panels (taps_ops.pack_panels, on the CPU) of the weight the caller multiplies after its next panel_linear
// call on this thread: that call's last output block asks their first output block into L2 (a hint; the
// composite decoder_layer sets it between its projections).
void follow_panels(const at::Tensor& panels);
}  // namespace taps
