// token_store_continuation, CPU (host data: a token store lives in host memory whatever device decodes):
// the longest suffix of a context found in a token store's reversed suffix array, and the continuation
// voted over its occurrences (python/taps/drafters/store.py builds the arrays and holds the Python
// reference of the same walk).
//
// tokens [L] i32: the store's sequences, -1 before, between and after them (and padding after the last);
// ends [M] i64: the positions of the store's tokens, sorted by the reversed text ending at each;
// cols [K, M] i32: cols[j][i] the token j places before ends[i] (-1 past its sequence's start), so that each
// column is sorted within the range where the columns before it are equal.
// -> [n, lo, hi, t_1, ..., t_c]: the suffix length matched (0 .. min(K, len(context))), the range of ends
// matching it, then the continuation (n >= min_ngram only): at each level the token most of the first
// `vote` occurrences still agreeing with the continuation so far go on with (ties: the first of them in
// index order), up to `depth` tokens, stopping at a sequence's end.
//
// Every read is bounds-checked (an end outside the tokens raises); ranges come from binary searches, so
// unsorted columns give unspecified matches but never read out of bounds.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <vector>

namespace taps {
namespace {

std::vector<int64_t> token_store_continuation_cpu(const at::Tensor& tokens, const at::Tensor& ends,
                                                  const at::Tensor& cols, at::IntArrayRef context, int64_t depth,
                                                  int64_t min_ngram, int64_t vote) {
  TORCH_CHECK_VALUE(tokens.dim() == 1 && tokens.scalar_type() == at::kInt && tokens.is_contiguous(),
                    "taps_ops: token_store_continuation: tokens must be a contiguous 1-d int32 tensor, got ",
                    tokens.scalar_type(), " of shape ", tokens.sizes());
  TORCH_CHECK_VALUE(cols.dim() == 2 && cols.scalar_type() == at::kInt && cols.is_contiguous(),
                    "taps_ops: token_store_continuation: cols must be a contiguous 2-d int32 tensor [K, M], got ",
                    cols.scalar_type(), " of shape ", cols.sizes());
  TORCH_CHECK_VALUE(ends.dim() == 1 && ends.scalar_type() == at::kLong && ends.is_contiguous() &&
                        ends.size(0) == cols.size(1),
                    "taps_ops: token_store_continuation: ends must be a contiguous 1-d int64 tensor of cols.size(1) = ",
                    cols.size(1), " entries, got ", ends.scalar_type(), " of shape ", ends.sizes());
  TORCH_CHECK_VALUE(depth >= 0 && min_ngram >= 0 && vote >= 1,
                    "taps_ops: token_store_continuation: need depth >= 0, min_ngram >= 0 and vote >= 1, got depth ",
                    depth, ", min_ngram ", min_ngram, ", vote ", vote);
  const int32_t* tk = tokens.data_ptr<int32_t>();
  const int64_t length = tokens.size(0), kmax = cols.size(0), rows = cols.size(1);
  const int64_t* en = ends.data_ptr<int64_t>();
  const int32_t* cl = cols.data_ptr<int32_t>();
  const int64_t clen = static_cast<int64_t>(context.size());

  int64_t lo = 0, hi = rows, matched = 0;
  for (int64_t j = 0; j < std::min(kmax, clen); ++j) {
    const int64_t t = context[clen - 1 - j];
    if (t < 0 || t > INT32_MAX) break;  // no store token is negative or past int32
    const int32_t* col = cl + j * rows;
    const auto range = std::equal_range(col + lo, col + hi, static_cast<int32_t>(t));
    if (range.first == range.second) break;
    lo = range.first - col;
    hi = range.second - col;
    matched = j + 1;
  }
  std::vector<int64_t> out{matched, matched ? lo : 0, matched ? hi : 0};
  if (matched == 0 || matched < min_ngram || depth == 0) return out;

  const int64_t count = std::min(hi - lo, vote);
  std::vector<int64_t> next(count);  // each occurrence's first continuation position
  for (int64_t i = 0; i < count; ++i) {
    const int64_t e = en[lo + i];
    TORCH_CHECK_VALUE(e >= 0 && e < length, "taps_ops: token_store_continuation: ends[", lo + i, "] = ", e,
                      " is outside the ", length, " tokens");
    next[i] = e + 1;
  }
  std::vector<int64_t> active(count);
  for (int64_t i = 0; i < count; ++i) active[i] = i;
  std::vector<int32_t> seen;
  std::vector<int64_t> votes;
  for (int64_t d = 0; d < depth; ++d) {
    seen.clear();
    votes.clear();
    for (const int64_t i : active) {
      const int64_t p = next[i] + d;
      const int32_t t = p < length ? tk[p] : -1;
      const auto it = std::find(seen.begin(), seen.end(), t);
      if (it == seen.end()) {
        seen.push_back(t);
        votes.push_back(1);
      } else {
        ++votes[it - seen.begin()];
      }
    }
    // the most votes, the first seen among equals
    const int64_t best = std::max_element(votes.begin(), votes.end()) - votes.begin();
    const int32_t t = seen[best];
    if (t < 0) break;
    out.push_back(t);
    active.erase(std::remove_if(active.begin(), active.end(),
                                [&](int64_t i) {
                                  const int64_t p = next[i] + d;
                                  return (p < length ? tk[p] : -1) != t;
                                }),
                 active.end());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("token_store_continuation", &token_store_continuation_cpu); }

}  // namespace taps
