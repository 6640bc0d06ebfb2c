// What the CPU kernels of the elementwise ops (rms_norm, rope_) share: the instruction-set clones of their
// row loops and the parallel grain.
#pragma once
#include <algorithm>
#include <cstdint>

// One clone of a function per instruction set (AVX2 where the CPU has it, else the baseline), chosen when
// the library loads: wider vectors for the same arithmetic. AVX2 has no fused multiply-add (that is the
// separate FMA set), so both clones give the bits of the header-only core (taps/elementwise.h).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TAPS_AVX2_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TAPS_AVX2_CLONES
#endif

namespace taps {

// Rows per at::parallel_for task for rows of `width` elements: about 16k elements, so that the small calls
// of decoding stay on the calling thread.
inline int64_t elementwise_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

}  // namespace taps
