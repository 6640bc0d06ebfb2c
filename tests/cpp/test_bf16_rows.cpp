// The bf16 rows of rms_norm and rope_ with explicit vectors (csrc/cpu/bf16_rows.cpp, compiled here without
// torch) against the cores' rows (norm::row, rope::row), bit for bit, at every variant this CPU runs:
// AVX2, AVX-512, AVX-512 with AVX512-BF16 rounding. Every width and head dim up to past two vectors (tails
// of every length), random values with NaNs of several payloads, infinities, signed zeros, subnormals and
// values whose products fall below 2^-126 mixed in; rows of tiny values; rope over several heads sharing
// the tables. The op's own dispatch (which variant a level takes) is covered by the pytest suites.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/bf16_rows.cpp"

#include "check.h"

namespace {

using taps_test::check;
using taps_test::rng;
namespace ew = taps::elementwise;
namespace br = taps::bf16_rows;

const uint16_t kSpecials[] = {0x7FC0, 0x7FFF, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x0000,
                              0x8000, 0x0001, 0x807F, 0x0080, 0x00FF};

// bf16 values: mostly normal (scale about `scale`), some specials and some in the subnormal range.
std::vector<uint16_t> values(size_t n, float scale) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) {
    const unsigned pick = rng() % 100;
    if (pick < 5) x = kSpecials[rng() % (sizeof(kSpecials) / sizeof(kSpecials[0]))];
    else if (pick < 15) x = ew::float_to_bf16(normal(rng) * 2e-38f);
    else x = ew::float_to_bf16(normal(rng) * scale);
  }
  return v;
}

std::vector<br::Kind> variants() {
  __builtin_cpu_init();
  std::vector<br::Kind> out;
  if (__builtin_cpu_supports("avx2")) out.push_back(br::Kind::kAvx2);
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    out.push_back(br::Kind::kAvx512);
    if (__builtin_cpu_supports("avx512bf16")) out.push_back(br::Kind::kAvx512Bf16);
  }
  return out;
}

void rms_norm_variant(br::Kind kind, const char* name) {
  for (int64_t width = 1; width <= 100; ++width)
    for (int row = 0; row < 4; ++row) {
      std::vector<uint16_t> x = values(width, row == 0 ? 1e-36f : 3.0f), w = values(width, 1.0f);
      if (row == 1) x[0] = ew::float_to_bf16(1e30f);  // the rest of the row's products fall below 2^-126
      std::vector<uint16_t> want(width), got(width, 0x1234);
      taps::norm::row<ew::kBF16>(x.data(), w.data(), want.data(), width, 1e-6f);
      br::rms_norm_row(kind, x.data(), w.data(), got.data(), width, 1e-6f);
      check(got == want,
            std::string(name) + " rms_norm width " + std::to_string(width) + " row " + std::to_string(row));
    }
}

void rope_variant(br::Kind kind, const char* name) {
  for (int64_t dim = 2; dim <= 80; dim += 2)
    for (int64_t heads : {1, 3}) {
      const int64_t stride = dim + 6;  // rows further apart than D; the gap stays untouched
      std::vector<uint16_t> x = values(heads * stride, 4.0f), c = values(dim, 1.0f), s = values(dim, 1.0f);
      std::vector<uint16_t> want = x, got = x;
      for (int64_t h = 0; h < heads; ++h) taps::rope::row<ew::kBF16>(want.data() + h * stride, c.data(), s.data(), dim);
      br::rope_token(kind, got.data(), stride, heads, c.data(), s.data(), dim);
      check(got == want, std::string(name) + " rope dim " + std::to_string(dim) + " heads " + std::to_string(heads));
    }
}

}  // namespace

int main() {
  rng.seed(13);
  std::printf("explicit-vector bf16 rows (rms_norm, rope_) vs the cores' rows\n");
  const char* names[] = {"none", "avx2", "avx512", "avx512_bf16"};
  for (br::Kind kind : variants()) {
    const char* name = names[static_cast<int>(kind)];
    std::printf("  variant %s\n", name);
    rms_norm_variant(kind, name);
    rope_variant(kind, name);
  }
  return taps_test::finish();
}
