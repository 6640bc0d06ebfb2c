// Host emulation (tests only): the __nv_bfloat16 type and the two conversions the taps kernels use,
// so that the core headers compile under tests/cpp/emu/cuda_runtime.h. Round to nearest even (NaN
// stays NaN). The emulation tests run the float32 kernels; these are not tested against the device.
#pragma once
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = uint32_t(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  __nv_bfloat16 h;
  if ((u & 0x7fffffffu) > 0x7f800000u)
    h.bits = uint16_t((u >> 16) | 0x40u);  // quiet NaN
  else
    h.bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return h;
}
