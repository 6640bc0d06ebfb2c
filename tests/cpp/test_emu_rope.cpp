// The CUDA rope kernel of taps/rope_kernel.cuh (a thread per rotated pair, grid-stride), run under the host
// CUDA emulation (tests/cpp/emu/cuda_runtime.h), against the CPU kernel's rope::row, bit for bit: float32,
// bfloat16 and float16, a strided x (the q and k heads of a fused qkv row, with v beside them untouched),
// tables shared across rows (stride 0), a last block only partly used.
// Not shown: device memory-model effects, performance.
#include <cuda_runtime.h>  // the emulation header (tests/cpp/emu is first on the include path)

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "taps/rope_kernel.cuh"

#include "check.h"

namespace {

using taps_test::check;
using taps_test::rng;
namespace ew = taps::elementwise;

template <int T>
uint32_t bits_of(float v) {
  if constexpr (T == ew::kF32) {
    return ew::float_to_bits(v);
  } else if constexpr (T == ew::kBF16) {
    return ew::float_to_bf16(v);
  } else {
    return ew::float_to_f16(v);
  }
}

// Elements of type E (float or uint16_t) filled with random values of dtype T.
template <int T, class E>
std::vector<E> random_elems(size_t n) {
  std::vector<E> out(n);
  for (auto& e : out) {
    const float v = -4.f + 8.f * float(rng() % 100000) / 1e5f;
    const uint32_t b = bits_of<T>(v);
    std::memcpy(&e, &b, sizeof(E));  // little-endian: the low bytes
  }
  return out;
}

template <int T>
void rope_case(int64_t rows, int64_t tokens, int64_t heads, int64_t all_heads, int64_t dim, bool shared_table,
               const char* name) {
  using E = std::conditional_t<T == ew::kF32, float, uint16_t>;
  const int64_t sh = dim, st = all_heads * dim, sr = tokens * st;
  std::vector<E> x = random_elems<T, E>(size_t(rows * sr));
  const int64_t cr = shared_table ? 0 : tokens * dim, ct = dim;
  std::vector<E> cos = random_elems<T, E>(size_t((shared_table ? 1 : rows) * tokens * dim));
  std::vector<E> sin = random_elems<T, E>(cos.size());
  std::vector<E> want = x;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        taps::rope::row<T>(want.data() + r * sr + t * st + h * sh, cos.data() + r * cr + t * ct,
                           sin.data() + r * cr + t * ct, dim);
  taps::rope::launch_rope<T>(x.data(), cos.data(), sin.data(), rows, tokens, heads, dim, sr, st, sh, cr, ct, nullptr);
  check(std::memcmp(x.data(), want.data(), x.size() * sizeof(E)) == 0,
        std::string("rope ") + name + " rows=" + std::to_string(rows) + " tokens=" + std::to_string(tokens) +
            " heads=" + std::to_string(heads) + "/" + std::to_string(all_heads) + " dim=" + std::to_string(dim));
}

}  // namespace

int main() {
  rng.seed(99);
  rope_case<ew::kF32>(2, 3, 6, 8, 16, false, "f32 qk of qkv");
  rope_case<ew::kF32>(1, 5, 1, 1, 2, true, "f32 D=2 shared table");
  rope_case<ew::kBF16>(3, 2, 4, 6, 64, false, "bf16");
  rope_case<ew::kF16>(2, 4, 3, 3, 32, true, "f16 shared table");
  rope_case<ew::kBF16>(1, 1, 5, 7, 6, false, "bf16 D=6");
  std::printf("emulated CUDA rope vs the CPU row kernel\n");
  return taps_test::finish();
}
