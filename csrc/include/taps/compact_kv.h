// compact_kv, the host+device core (no torch headers): the validity of one request's accepted path,
// shared by the CPU kernel (csrc/cpu/compact_kv.cpp) and the CUDA kernel (taps/compact_kv_kernel.cuh).
//
// caches [B, H, S, D]; path [B, P] (-1 padded, path[:, 0] == 0, strictly increasing); prefix_lens [B].
// Entry j of path[b] moves from position prefix_lens[b] + path[b, j] to prefix_lens[b] + j. Walking a
// request's path in increasing j is safe although sources and destinations overlap: the destination
// prefix + j is below every later source prefix + path[k] (k > j, path[k] >= k > j), and an entry that
// does not move (path[j] == j) is skipped.
#pragma once
#include <cstdint>

#include "taps/common.h"

namespace taps {
namespace compact {

// One request's path (P entries, -1 padded): returns the number of path entries to move (up to the
// first -1), or -1 when the path is invalid (path[0] != 0, not strictly increasing, or
// prefix_len + path[j] >= cache_len, or prefix_len < 0).
TAPS_HD int64_t path_length(const int64_t* path, int64_t path_cols, int64_t prefix_len, int64_t cache_len) {
  if (prefix_len < 0) return -1;
  int64_t n = 0;
  for (; n < path_cols && path[n] >= 0; ++n) {
    if (n == 0 ? path[0] != 0 : path[n] <= path[n - 1]) return -1;
    if (prefix_len + path[n] >= cache_len) return -1;
  }
  if (n == 0 && path_cols > 0) return -1;  // path[0] must be 0 (the root), not -1
  return n;
}

}  // namespace compact
}  // namespace taps
