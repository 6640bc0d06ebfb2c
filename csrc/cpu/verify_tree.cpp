// verify_tree, CPU: input checks, then one walk per request (at::parallel_for over requests).
// The walk and every decision are the header-only core's (taps/verify_tree.h); this file supplies the
// sequential row backend, whose two hot passes (max, sum of exp) run at the kernels' instruction-set level
// (AVX-512, AVX2 + FMA or scalar: cpu/verify_tree_rows.h, cpu/cpu_isa.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "checks/checks.h"
#include "cpu/verify_tree_rows.h"
#include "checks/verify_tree_checks.h"
#include "taps/verify_tree.h"

namespace taps {
namespace {

using verify::FindResult;
using verify::RowScan;
using verify::Target;

// Sequential row backend (one participant). Children come from per-request linked lists built once.
struct CpuOps {
  static constexpr bool kLeader = true;
  const int32_t* first_child;   // [N]
  const int32_t* next_sibling;  // [N]
  cpu::Isa isa;                 // the row passes' instruction-set level (read once per call)

  void sync() const {}

  int32_t collect_children(const int64_t*, int64_t, int64_t cur, int32_t* out) const {
    int32_t count = 0;
    for (int32_t c = first_child[cur]; c >= 0; c = next_sibling[c]) out[count++] = c;
    return count;
  }

  template <typename scalar_t>
  static constexpr rows::Dtype dtype_of() {
    if constexpr (std::is_same_v<scalar_t, float>) return rows::Dtype::kF32;
    else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) return rows::Dtype::kBF16;
    else return rows::Dtype::kF16;
  }

  template <typename scalar_t>
  RowScan max_scan(const scalar_t* row, int64_t vocab) const {
    const rows::MaxResult r = rows::row_max(row, vocab, dtype_of<scalar_t>(), isa);
    const int64_t arg = r.max > -INFINITY ? rows::row_first_equal(row, vocab, dtype_of<scalar_t>(), r.max, isa) : 0;
    return RowScan{r.max, arg < 0 ? 0 : arg,
                   (r.nan ? int32_t(verify::kRowNaN) : 0) | (r.max == INFINITY ? int32_t(verify::kRowPosInf) : 0)};
  }

  template <typename scalar_t>
  float sum_target(const scalar_t* row, int64_t vocab, const Target& t) const {
    return rows::row_sum_exp(row, vocab, dtype_of<scalar_t>(), t.max, t.inv_temperature, t.threshold, isa);
  }

  // The first v whose running weight g(0) + ... + g(v) exceeds x (weights >= 0): whole blocks of kBlock tokens
  // skipped by block_sum(start, end), the vectorised sum of the same weights, then the block where the running sum
  // crosses x scanned token by token; the rounding fallback: the last token of positive weight.
  template <class BlockSum, class G>
  static FindResult block_find(int64_t vocab, BlockSum&& block_sum, const G& g, float x) {
    constexpr int64_t kBlock = 2048;
    float acc = 0.0f;
    int64_t start = 0;
    for (; start < vocab; start += kBlock) {
      const float block = block_sum(start, start + kBlock < vocab ? start + kBlock : vocab);
      if (acc + block > x) break;
      acc += block;
    }
    for (int64_t v = start; v < vocab; ++v) {
      const float w = g(v);
      acc += w;
      if (w > 0.0f && x < acc) return FindResult{v, v};
    }
    for (int64_t v = vocab - 1; v >= 0; --v)
      if (g(v) > 0.0f) return FindResult{-1, v};
    return FindResult{-1, -1};
  }

  // The draw past the children: block_find over the target weights, the child tokens' weights taken out of their
  // blocks' sums.
  template <typename scalar_t>
  FindResult scan_find_target(const scalar_t* row, int64_t vocab, const Target& t, const verify::Scratch& s,
                              int32_t distinct, float x) const {
    auto g = [&](int64_t v) {
      return verify::is_child_token(s, distinct, v) ? 0.0f : verify::target_weight(t, float(row[v]));
    };
    int32_t next_child = 0;
    auto block_sum = [&](int64_t start, int64_t end) {
      float block = rows::row_sum_exp(row + start, end - start, dtype_of<scalar_t>(), t.max, t.inv_temperature,
                                      t.threshold, isa);
      for (; next_child < distinct && s.sorted_tokens[next_child] < end; ++next_child)
        block -= verify::target_weight(t, float(row[s.sorted_tokens[next_child]]));
      return block;
    };
    return block_find(vocab, block_sum, g, x);
  }

  // The residual passes of a drawn node (verify::residual_passes): vectorised over the row where the draft's
  // probabilities are float32 (the decoder's drafts), the core's generic passes otherwise.
  static constexpr bool kResidualPasses = true;

  template <typename scalar_t, typename prob_t>
  float residual_sum(const scalar_t* row, const prob_t* q, int64_t vocab, const Target& t, const float* rz,
                     int32_t level) const {
    if constexpr (std::is_same_v<prob_t, float>) {
      return rows::row_residual_sum(row, q, vocab, dtype_of<scalar_t>(),
                                    rows::Residual{t.max, t.inv_temperature, t.threshold, t.z, rz, level, true}, isa);
    } else {
      return sum(vocab, [&](int64_t v) { return verify::residual_excess(t, float(row[v]), float(q[v]), rz, level); });
    }
  }

  // The draw from a drawn node's residual (level 0: the target weights): block_find over its weights, the blocks
  // summed by the vectorised passes.
  template <typename scalar_t, typename prob_t>
  FindResult residual_find(const scalar_t* row, const prob_t* q, int64_t vocab, const Target& t, const float* rz,
                           int32_t level, float x) const {
    auto g = [&](int64_t v) { return verify::residual_weight(t, float(row[v]), float(q[v]), rz, level); };
    if constexpr (!std::is_same_v<prob_t, float>) {
      return scan_find(vocab, g, x);
    } else {
      const rows::Residual r{t.max, t.inv_temperature, t.threshold, t.z, rz, level, false};
      auto block_sum = [&](int64_t start, int64_t end) {
        return level == 0 ? rows::row_sum_exp(row + start, end - start, dtype_of<scalar_t>(), t.max,
                                              t.inv_temperature, t.threshold, isa)
                          : rows::row_residual_sum(row + start, q + start, end - start, dtype_of<scalar_t>(), r, isa);
      };
      return block_find(vocab, block_sum, g, x);
    }
  }

  template <class G>
  float sum(int64_t vocab, const G& g) const {
    float total = 0.0f;
    for (int64_t v = 0; v < vocab; ++v) total += g(v);
    return total;
  }

  template <class KeyFn, class G>
  void histogram(int64_t vocab, const KeyFn& key, const G& g, int shift, uint32_t prefix, float* bins) const {
    for (int d = 0; d < 256; ++d) bins[d] = 0.0f;
    const uint64_t high_mask = shift >= 24 ? 0 : (~uint64_t(0) << (shift + 8)) & 0xffffffffu;
    for (int64_t v = 0; v < vocab; ++v) {
      const uint32_t k = key(v);
      if ((k & high_mask) != (prefix & high_mask)) continue;
      bins[(k >> shift) & 255u] += g(v);
    }
  }

  template <class G>
  FindResult scan_find(int64_t vocab, const G& g, float t) const {
    float acc = 0.0f;
    int64_t last = -1;
    for (int64_t v = 0; v < vocab; ++v) {
      const float w = g(v);
      if (w > 0.0f) {
        last = v;
        acc += w;
        if (t < acc) return FindResult{v, v};
      }
    }
    return FindResult{-1, last};
  }
};

template <typename scalar_t, typename prob_t>
void verify_cpu_impl(const VerifyCall& c) {
  const int64_t batch = c.logits.size(0), n = c.logits.size(1), vocab = c.logits.size(2);
  const bool validate = c.validate;
  const scalar_t* lg = c.logits.data_ptr<scalar_t>();
  const prob_t* dp = c.draft_probs.defined() ? c.draft_probs.data_ptr<prob_t>() : nullptr;
  const int64_t* tk = c.tokens.data_ptr<int64_t>();
  const int64_t* pr = c.parents.data_ptr<int64_t>();
  const float* temp = c.temperature.data_ptr<float>();
  const int64_t* topk = c.top_k.data_ptr<int64_t>();
  const float* topp = c.top_p.data_ptr<float>();
  const float* uni = c.uniforms.data_ptr<float>();
  int64_t* o_tok = c.out_tokens.data_ptr<int64_t>();
  int64_t* o_acc = c.num_accepted.data_ptr<int64_t>();
  int64_t* o_path = c.path.data_ptr<int64_t>();
  int32_t* o_err = c.errors.data_ptr<int32_t>();

  const cpu::Isa isa = cpu::isa();  // the row passes' level, read once per call
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> ints(static_cast<size_t>(4 * n));
    std::vector<uint8_t> flags(static_cast<size_t>(n));
    std::vector<float> floats(static_cast<size_t>(n) + 256);
    verify::Scratch scratch{ints.data(), ints.data() + n, flags.data(), floats.data(), floats.data() + n};
    int32_t* first_child = ints.data() + 2 * n;
    int32_t* next_sibling = ints.data() + 3 * n;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* tb = tk + b * n;
      const int64_t* pb = pr + b * n;
      const float* ub = uni + b * n;
      if (validate) {
        o_err[b] = verify::check_request(tb, pb, ub, n, vocab, temp[b], topk[b], topp[b]);
        if (o_err[b] != kNoError) continue;
      }
      // Children lists: nodes with a parent in [0, i) (anything else has no parent), sibling order.
      for (int64_t i = 0; i < n; ++i) first_child[i] = next_sibling[i] = -1;
      for (int64_t i = n - 1; i >= 1; --i) {
        const int64_t p = pb[i];
        if (p >= 0 && p < i) {
          next_sibling[i] = first_child[p];
          first_child[p] = int32_t(i);
        }
      }
      CpuOps ops{first_child, next_sibling, isa};
      verify::Request<scalar_t, prob_t> rq{lg + b * n * vocab, dp ? dp + b * n * vocab : nullptr, tb, pb, ub,
                                           n, vocab, temp[b], topp[b], topk[b]};
      verify::WalkState st{};
      verify::Outputs out{o_tok + b * n, o_path + b * n, o_acc + b, o_err + b};
      verify::verify_walk(ops, rq, scratch, st, out, validate);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_cpu(
    const at::Tensor& logits_in, const at::Tensor& tokens_in, const at::Tensor& parents_in,
    const at::Tensor& temperature_in, const at::Tensor& top_k_in, const at::Tensor& top_p_in,
    const std::optional<at::Tensor>& draft_probs_in, const at::Tensor& uniforms_in, bool validate) {
  check_verify_inputs(logits_in, tokens_in, parents_in, temperature_in, top_k_in, top_p_in, draft_probs_in,
                      uniforms_in);
  const VerifyCall call = VerifyCall::prepare(logits_in, tokens_in, parents_in, temperature_in, top_k_in, top_p_in,
                                              draft_probs_in, uniforms_in, validate);
  if (logits_in.size(0) == 0 || logits_in.size(1) == 0) return call.outputs();
  call.dispatch([&]<typename logit_t, typename prob_t>() { verify_cpu_impl<logit_t, prob_t>(call); });
  if (validate) raise_verify_error(call.errors);
  return call.outputs();
}

}  // namespace
}  // namespace taps

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("verify_tree", &taps::verify_tree_cpu); }
