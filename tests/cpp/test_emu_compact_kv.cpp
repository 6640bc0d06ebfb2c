// The CUDA compact_kv kernel of taps/compact_kv_kernel.cuh, run under the host CUDA emulation
// (tests/cpp/emu/cuda_runtime.h), against a plain gather written here, exactly: the reference gathers
// from a copy of the original cache, so the kernel's in-place order is checked too. Padded head and
// batch strides, 4- and 16-byte units, rows wider than one block, valid paths (some keeping a node in
// place) and invalid ones (not increasing, not starting at the root, past the cache, a negative prefix,
// all padding), which must be left untouched.
// Not shown: device memory-model effects, performance.
#include <cuda_runtime.h>  // the emulation header (tests/cpp/emu is first on the include path)

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "taps/compact_kv_kernel.cuh"

#include "check.h"

namespace {

using taps_test::check;
using taps_test::rng;
using taps_test::rnd;

// compact_kv on a cache of units U viewed as [B, H, S, row_units] with padded heads.
template <class U>
void compact_case(int B, int H, int S, int row_units, int cols, const char* name) {
  static_assert(sizeof(U) % 4 == 0, "units of 4-byte words here");
  constexpr int kWords = sizeof(U) / 4;
  const int64_t stride_s = row_units, stride_h = int64_t(S) * row_units + 5, stride_b = H * stride_h + 2;
  std::vector<U> cache(size_t(B * stride_b));
  {
    std::vector<uint32_t> words(cache.size() * kWords);
    for (auto& x : words) x = uint32_t(rng());
    std::memcpy(cache.data(), words.data(), words.size() * 4);
  }
  const std::vector<U> original = cache;
  std::vector<int64_t> path(size_t(B * cols), -1), prefix(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) {
    int64_t* pb = path.data() + b * cols;
    prefix[size_t(b)] = rnd(0, S / 2);
    const int span = S - int(prefix[size_t(b)]);  // path entries < span stay in the cache
    const int len = rnd(1, std::min(cols, span));
    pb[0] = 0;
    for (int j = 1; j < len; ++j) {  // strictly increasing; sometimes keeps a node in place
      const int lo = int(pb[j - 1]) + 1, hi = span - (len - j);
      pb[j] = rnd(0, 2) == 0 && j >= lo ? j : rnd(lo, std::max(lo, hi));
    }
    switch (b % 7) {  // invalid paths: must be left untouched
      case 3: if (len >= 3) pb[2] = pb[1]; break;        // not increasing
      case 4: pb[0] = 1; break;                          // does not start at the root
      case 5: pb[len - 1] = span; break;                 // past the cache
      case 6: prefix[size_t(b)] = -1; break;             // negative prefix
      default: break;
    }
    if (b == 1) std::fill(pb, pb + cols, -1);  // all padding: invalid too
  }
  taps::compact::launch_compact_kv<U>(cache.data(), B, H, S, row_units, stride_b, stride_h, stride_s, path.data(),
                                      cols, prefix.data(), nullptr);
  // Reference: new row prefix + j = old row prefix + path[j] for a valid path, everything else kept.
  std::vector<U> want = original;
  for (int b = 0; b < B; ++b) {
    const int64_t n = taps::compact::path_length(path.data() + b * cols, cols, prefix[size_t(b)], S);
    for (int h = 0; h < H; ++h)
      for (int64_t j = 1; j < n; ++j)
        for (int u = 0; u < row_units; ++u)
          want[size_t(b * stride_b + h * stride_h + (prefix[size_t(b)] + j) * stride_s + u)] =
              original[size_t(b * stride_b + h * stride_h + (prefix[size_t(b)] + path[size_t(b * cols + j)]) * stride_s +
                              u)];
  }
  const bool same = std::memcmp(cache.data(), want.data(), cache.size() * sizeof(U)) == 0;
  check(same, std::string("compact_kv ") + name + " B=" + std::to_string(B) + " H=" + std::to_string(H) +
                  " S=" + std::to_string(S) + " row_units=" + std::to_string(row_units) +
                  " cols=" + std::to_string(cols));
}

}  // namespace

int main() {
  rng.seed(777);
  compact_case<uint32_t>(7, 2, 40, 37, 9, "u32");    // 32-thread blocks, two blocks per row
  compact_case<uint32_t>(7, 1, 30, 130, 12, "u32");  // 128-thread blocks
  compact_case<uint4>(7, 3, 25, 3, 6, "uint4");
  std::printf("emulated CUDA compact_kv vs a plain gather\n");
  return taps_test::finish();
}
