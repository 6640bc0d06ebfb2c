// Inline-PTX wrappers of the tensor-core tree_attention kernel (sm_80+): the m16n8k16 mma, ldmatrix
// and cp.async, and the element conversions of the half types (torch builds define
// __CUDA_NO_*_CONVERSIONS__, so they are explicit). Under the host CUDA emulation (tests/cpp/emu) each
// wrapper calls the emulation's model of the instruction; compiled for an older architecture, a wrapper
// that has no instruction there traps.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "taps/common.h"

namespace taps {

// Element conversions.
TAPS_DEVICE float to_float(float x) { return x; }
TAPS_DEVICE float to_float(__half x) { return __half2float(x); }
TAPS_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> TAPS_DEVICE T from_float(float x);
template <> TAPS_DEVICE float from_float<float>(float x) { return x; }
template <> TAPS_DEVICE __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> TAPS_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <class T> TAPS_DEVICE uint16_t bits16(T x) {
  uint16_t u;
  memcpy(&u, &x, 2);
  return u;
}
template <class T> TAPS_DEVICE T from_bits16(uint16_t u) {
  T x;
  memcpy(&x, &u, 2);
  return x;
}
// Two floats rounded to T, packed low half first (the fragment element order).
template <class T> TAPS_DEVICE uint32_t pack2(float lo, float hi) {
  return uint32_t(bits16(from_float<T>(lo))) | (uint32_t(bits16(from_float<T>(hi))) << 16);
}

// d += a b for one m16n8k16 tile (fragment layout: see the emulation's mma_m16n8k16).
template <class T>
TAPS_DEVICE void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(TAPS_CUDA_EMULATION)
  taps_emu::mma_m16n8k16(d, a, b, [](uint16_t u) { return to_float(from_bits16<T>(u)); });
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // the plan never picks this kernel below sm_80
#endif
}

// ldmatrix.x4[.trans]: four 8x8 b16 matrices from shared memory; lane l gives the address of row l % 8
// of matrix l / 8 (16-byte aligned) and gets in r[m] the pair at row l / 4, columns 2 (l % 4) and
// 2 (l % 4) + 1 of matrix m, or with Trans the pair at rows 2 (l % 4), 2 (l % 4) + 1 of column l / 4.
// Plain: mma's A fragments from row-major Q and B fragments from K rows; Trans: B fragments from a
// row-major V tile.
template <bool Trans>
TAPS_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(TAPS_CUDA_EMULATION)
  taps_emu::ldmatrix_x4(r, row, Trans);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// 16-byte asynchronous global -> shared copy (cp.async.cg, bypassing L1), and its group fences.
TAPS_DEVICE void cp_async_16(void* smem, const void* gmem) {
#if defined(TAPS_CUDA_EMULATION)
  taps_emu::cp_async16(smem, gmem);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem) : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}
TAPS_DEVICE void cp_async_commit() {
#if defined(TAPS_CUDA_EMULATION)
  taps_emu::cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Wait until at most `Pending` of this thread's committed groups are still in flight.
template <int Pending>
TAPS_DEVICE void cp_async_wait() {
#if defined(TAPS_CUDA_EMULATION)
  taps_emu::cp_async_wait(Pending);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}

}  // namespace taps
