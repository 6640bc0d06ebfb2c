// Host emulation (tests only): the __half type and the two conversions the taps kernels use, so that
// the core headers compile under tests/cpp/emu/cuda_runtime.h. Round to nearest even, via GCC's
// _Float16. The emulation tests run the float32 kernels; these are not tested against the device.
#pragma once
#include <cstdint>
#include <cstring>

struct __half {
  uint16_t bits;
};
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return float(f);
}
inline __half __float2half_rn(float x) {
  const _Float16 f = static_cast<_Float16>(x);
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}
