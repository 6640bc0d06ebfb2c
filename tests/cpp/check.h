// The pass/fail counters and random helpers shared by the C++ test programs (one program per file,
// so these header-level definitions have one copy each).
#pragma once

#include <cstdio>
#include <random>
#include <string>

namespace taps_test {

inline std::mt19937 rng;  // each program seeds it in main()
inline int passed = 0, failed = 0;

inline int rnd(int lo, int hi) { return lo + int(rng() % unsigned(hi - lo + 1)); }

inline void check(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAIL: %s\n", what.c_str());
  }
}

// Prints the tally; the program's exit status.
inline int finish() {
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace taps_test
