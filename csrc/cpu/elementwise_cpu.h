// What the CPU kernels of the elementwise ops (rms_norm, rope_, expand_level) share: their row loops compiled
// for AVX2 as well as for the baseline, chosen by the kernels' instruction-set level (cpu/cpu_isa.h), the
// parallel grain, and the bf16 rows of rms_norm and rope_ with explicit vectors.
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

// The bf16 rows of rms_norm and rope_ with explicit vectors (cpu/bf16_rows.cpp): AVX2, AVX-512, AVX-512 with
// AVX512-BF16's rounding; the cores' bits at every level. kNone: the cores' rows as above (run_rows).
namespace bf16_rows {
enum class Kind { kNone, kAvx2, kAvx512, kAvx512Bf16 };
// The rows for this level (read once per op call, on the calling thread): kNone below avx2.
Kind kind(cpu::Isa isa);
// norm::row<kBF16> (x, w, y: `width` bf16 values as raw bits).
void rms_norm_row(Kind k, const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t width, float eps);
// rope::row<kBF16> on the `heads` rows of one token (x in place, rows `head_stride` elements apart; c, s: the
// token's table rows; `dim` bf16 values each).
void rope_token(Kind k, uint16_t* x, int64_t head_stride, int64_t heads, const uint16_t* c, const uint16_t* s,
                int64_t dim);
}  // namespace bf16_rows

}  // namespace taps
