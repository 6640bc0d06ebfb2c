// What the CPU kernels of the elementwise ops (rms_norm, rope_, expand_level) share: their row loops compiled
// for AVX2 as well as for the baseline, chosen by the kernels' instruction-set level (cpu/cpu_isa.h), and the
// parallel grain.
#pragma once
#include <algorithm>
#include <cstdint>

#include "cpu/cpu_isa.h"

namespace taps {

// Runs rows() (a lambda over a row loop of the header-only core) compiled for AVX2 when `avx2`, else for the
// baseline: wider vectors for the same arithmetic. TAPS_TARGET_AVX2 enables no FMA, so both give the core's
// bits (taps/elementwise.h); it flattens, so the whole loop is compiled for AVX2. `avx2` is read once per op
// call, on the calling thread (elementwise_avx2()).
#if defined(TAPS_CPU_X86)
template <class Rows>
TAPS_TARGET_AVX2 void rows_avx2(const Rows& rows) { rows(); }
#endif

inline bool elementwise_avx2() { return cpu::at_least(cpu::Isa::kAvx2); }

template <class Rows>
inline void run_rows(bool avx2, const Rows& rows) {
#if defined(TAPS_CPU_X86)
  if (avx2) return rows_avx2(rows);
#endif
  (void)avx2;
  rows();
}

// Rows per at::parallel_for task for rows of `width` elements: about 16k elements, so that the small calls
// of decoding stay on the calling thread.
inline int64_t elementwise_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

}  // namespace taps
