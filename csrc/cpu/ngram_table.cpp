// ngram_table_logits, CPU (host data: an n-gram table lives in host memory whatever device decodes): for each
// context row, the logits of the longest context an n-gram table holds (python/taps/drafters/table.py builds
// the table and holds the Python reference of the same lookup, NgramTable.logits).
//
// keys [K] i64 (read as uint64, sorted as uint64, distinct): a context of n tokens t_1 .. t_n (oldest first)
// has the key n * b^n + (t_1 + 1) * b^(n-1) + ... + (t_n + 1), b = vocab + 1, in uint64 arithmetic (wrapping);
// key 0 is the order-0 context (the corpus average), which must be present.
// counts [K] i64: corpus positions each context averaged; starts [K + 1] i64: each context's entries;
// ids [E] i64, logp [E] f32: the entries' token ids and log-probabilities.
// contexts [R, W] i64: each row's last W tokens (oldest first), -1 where the context is shorter.
// -> [R, vocab] f32: `floor` everywhere, the entries' logp at their ids, for the longest order n <= min(W,
// max_order) whose key is present with counts >= min_count (order 0 when none).
//
// Every read is bounds-checked: a start outside the entries or an id outside the vocabulary raises; unsorted
// keys give unspecified matches but never an out-of-bounds read.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace taps {
namespace {

// The table's arrays, checked once a call, and the lookup of one context row.
struct Table {
  const uint64_t* keys;
  const int64_t* counts;
  const int64_t* starts;
  const int64_t* ids;
  const float* logp;
  int64_t num_keys, num_entries, vocab, max_order, min_count, zero;

  Table(const at::Tensor& k, const at::Tensor& c, const at::Tensor& st, const at::Tensor& id, const at::Tensor& lp,
        int64_t vocab_, int64_t max_order_, int64_t min_count_, const char* op)
      : vocab(vocab_), max_order(max_order_), min_count(min_count_) {
    const auto vec = [op](const at::Tensor& t, at::ScalarType type, const char* name) {
      TORCH_CHECK_VALUE(t.dim() == 1 && t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu(),
                        "taps_ops: ", op, ": ", name, " must be a contiguous 1-d ", type, " CPU tensor, got ",
                        t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
    };
    vec(k, at::kLong, "keys");
    vec(c, at::kLong, "counts");
    vec(st, at::kLong, "starts");
    vec(id, at::kLong, "ids");
    vec(lp, at::kFloat, "logp");
    num_keys = k.size(0);
    num_entries = id.size(0);
    TORCH_CHECK_VALUE(c.size(0) == num_keys && st.size(0) == num_keys + 1 && lp.size(0) == num_entries, "taps_ops: ",
                      op, ": counts must have keys' length (", num_keys, "), starts one more, logp ids' length (",
                      num_entries, "); got ", c.size(0), ", ", st.size(0), ", ", lp.size(0));
    TORCH_CHECK_VALUE(vocab >= 1 && max_order >= 0 && min_count >= 0, "taps_ops: ", op,
                      ": need vocab >= 1, max_order >= 0 and min_count >= 0, got ", vocab, ", ", max_order, ", ",
                      min_count);
    keys = reinterpret_cast<const uint64_t*>(k.data_ptr<int64_t>());
    counts = c.data_ptr<int64_t>();
    starts = st.data_ptr<int64_t>();
    ids = id.data_ptr<int64_t>();
    logp = lp.data_ptr<float>();
    const uint64_t* z = std::lower_bound(keys, keys + num_keys, uint64_t{0});
    TORCH_CHECK_VALUE(z != keys + num_keys && *z == 0, "taps_ops: ", op,
                      ": the table lacks the order-0 context (key 0)");
    zero = z - keys;
  }

  // The context held for the tokens ctx[0 .. n) (oldest first; ctx[n - 1] the newest, -1 = none): the index of
  // its longest suffix the table holds with counts >= min_count (order 0 when none).
  int64_t find(const int64_t* ctx, int64_t n) const {
    const uint64_t base = static_cast<uint64_t>(vocab) + 1;
    int64_t best = zero;
    uint64_t key = 0, power = 1;
    for (int64_t o = 1; o <= std::min(n, max_order); ++o) {
      const int64_t t = ctx[n - o];
      if (t < 0) break;  // a shorter context
      key += (static_cast<uint64_t>(t) + 1) * power;
      power *= base;
      const uint64_t full = key + static_cast<uint64_t>(o) * power;
      const uint64_t* hit = std::lower_bound(keys, keys + num_keys, full);
      if (hit != keys + num_keys && *hit == full && counts[hit - keys] >= min_count) best = hit - keys;
    }
    return best;
  }

  // context i's entries [lo, hi), bounds-checked (ids too)
  std::pair<int64_t, int64_t> entries(int64_t i, const char* op) const {
    const int64_t lo = starts[i], hi = starts[i + 1];
    TORCH_CHECK_VALUE(0 <= lo && lo < hi && hi <= num_entries, "taps_ops: ", op, ": starts[", i, "..", i + 1,
                      "] = ", lo, "..", hi, " is not a non-empty range of the ", num_entries, " entries");
    for (int64_t e = lo; e < hi; ++e) {
      TORCH_CHECK_VALUE(ids[e] >= 0 && ids[e] < vocab, "taps_ops: ", op, ": ids[", e, "] = ", ids[e],
                        " is outside [0, ", vocab, ")");
    }
    return {lo, hi};
  }
};

at::Tensor checked_contexts(const at::Tensor& contexts, int64_t vocab, const char* op) {
  TORCH_CHECK_VALUE(contexts.dim() == 2 && contexts.scalar_type() == at::kLong && contexts.device().is_cpu(),
                    "taps_ops: ", op, ": contexts must be a 2-d int64 CPU tensor [R, W], got ",
                    contexts.scalar_type(), " of shape ", contexts.sizes(), " on ", contexts.device());
  const at::Tensor ctx = contexts.contiguous();
  const int64_t* c = ctx.data_ptr<int64_t>();
  for (int64_t i = 0; i < ctx.numel(); ++i) {
    TORCH_CHECK_VALUE(c[i] >= -1 && c[i] < vocab, "taps_ops: ", op, ": contexts holds ", c[i], ", outside [-1, ",
                      vocab, ")");
  }
  return ctx;
}

at::Tensor ngram_table_logits_cpu(const at::Tensor& keys, const at::Tensor& counts, const at::Tensor& starts,
                                  const at::Tensor& ids, const at::Tensor& logp, const at::Tensor& contexts,
                                  int64_t vocab, int64_t max_order, int64_t min_count, double floor) {
  const char* op = "ngram_table_logits";
  const Table table(keys, counts, starts, ids, logp, vocab, max_order, min_count, op);
  const at::Tensor ctx = checked_contexts(contexts, vocab, op);
  const int64_t rows = ctx.size(0), width = ctx.size(1);
  at::Tensor out = at::full({rows, vocab}, floor, at::dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const auto [lo, hi] = table.entries(table.find(ctx.data_ptr<int64_t>() + r * width, width), op);
    for (int64_t e = lo; e < hi; ++e) o[r * vocab + table.ids[e]] = table.logp[e];
  }
  return out;
}

// Sampled chains from the table: per request b, `width` draws from q at the root (the context row b), then
// under each one draw per level from q at that node, to `depth` levels; q at a node = softmax(logp / T_b) over
// its context's entries (zero elsewhere). Candidates level by level (M = width * depth): level l's chain c is
// candidate (l - 1) * width + c, its parent the chain's previous candidate (-1 at level 1). Draw i of request b
// takes uniforms[b, i] (inverse CDF over the entries in their order). Returns tokens [B, M] i64, parents
// [B, M] i64, scores [B, M] f32 (cumulative log q) and probs [B, 1 + M, vocab] f32 (row 0 the root's q, row
// 1 + m the q candidate m's child was drawn from; zeros for the last level). `out`: a buffer of probs' shape,
// dtype and layout (CPU, contiguous) to write them into (cleared first) and return, in place of a new one (a
// caller that keeps one saves a fresh 128 KiB's page faults a draft: ~20 us in decoding at vocab 8192).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ngram_table_draw_cpu(
    const at::Tensor& keys, const at::Tensor& counts, const at::Tensor& starts, const at::Tensor& ids,
    const at::Tensor& logp, const at::Tensor& contexts, const at::Tensor& uniforms, const at::Tensor& temperature,
    int64_t width, int64_t depth, int64_t vocab, int64_t max_order, int64_t min_count,
    const std::optional<at::Tensor>& out) {
  const char* op = "ngram_table_draw";
  const Table table(keys, counts, starts, ids, logp, vocab, max_order, min_count, op);
  const at::Tensor ctx = checked_contexts(contexts, vocab, op);
  const int64_t batch = ctx.size(0), w = ctx.size(1);
  TORCH_CHECK_VALUE(width >= 1 && depth >= 1, "taps_ops: ", op, ": need width >= 1 and depth >= 1, got ", width,
                    ", ", depth);
  const int64_t m = width * depth;
  TORCH_CHECK_VALUE(uniforms.dim() == 2 && uniforms.scalar_type() == at::kFloat && uniforms.device().is_cpu() &&
                        uniforms.size(0) == batch && uniforms.size(1) == m,
                    "taps_ops: ", op, ": uniforms must be a float32 CPU tensor [B, width * depth] = [", batch, ", ", m,
                    "], got ", uniforms.scalar_type(), " of shape ", uniforms.sizes());
  TORCH_CHECK_VALUE(temperature.dim() == 1 && temperature.scalar_type() == at::kFloat &&
                        temperature.device().is_cpu() && temperature.size(0) == batch,
                    "taps_ops: ", op, ": temperature must be a float32 CPU tensor [B] = [", batch, "], got ",
                    temperature.scalar_type(), " of shape ", temperature.sizes());
  const at::Tensor un = uniforms.contiguous(), temp = temperature.contiguous();
  const float* u = un.data_ptr<float>();
  const float* tp = temp.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(tp[b] >= 0 && std::isfinite(tp[b]), "taps_ops: ", op, ": temperature[", b, "] = ", tp[b],
                      " must be finite and >= 0");
  }
  const auto i64 = at::dtype(at::kLong);
  at::Tensor tokens = at::empty({batch, m}, i64), parents = at::empty({batch, m}, i64);
  at::Tensor scores = at::empty({batch, m}, at::dtype(at::kFloat));
  at::Tensor probs;
  if (out.has_value()) {
    probs = *out;
    TORCH_CHECK_VALUE(probs.dim() == 3 && probs.scalar_type() == at::kFloat && probs.device().is_cpu() &&
                          probs.is_contiguous() && probs.size(0) == batch && probs.size(1) == 1 + m &&
                          probs.size(2) == vocab,
                      "taps_ops: ", op, ": out must be a contiguous float32 CPU tensor [B, 1 + width * depth, vocab] = [",
                      batch, ", ", 1 + m, ", ", vocab, "], got ", probs.scalar_type(), " of shape ", probs.sizes(),
                      " on ", probs.device());
    std::fill_n(probs.data_ptr<float>(), probs.numel(), 0.f);
  } else {
    probs = at::zeros({batch, 1 + m, vocab}, at::dtype(at::kFloat));
  }
  int64_t* tk = tokens.data_ptr<int64_t>();
  int64_t* pa = parents.data_ptr<int64_t>();
  float* sc = scores.data_ptr<float>();
  float* pr = probs.data_ptr<float>();
  std::vector<int64_t> chain(w + depth);  // a chain's context: the row, then its drawn tokens
  std::vector<float> q;
  // q of the context chain[0 .. n) into row `out` of probs; returns the entries' range. Temperature 0: all of q
  // on the entry of the largest logp (ties to the lowest id), the greedy limit: the chain of the table's modes.
  const auto dist = [&](int64_t n, float t, float* out) {
    const auto [lo, hi] = table.entries(table.find(chain.data(), n), op);
    q.resize(hi - lo);
    if (t == 0.f) {
      int64_t best = lo;
      for (int64_t e = lo + 1; e < hi; ++e) {
        if (table.logp[e] > table.logp[best] || (table.logp[e] == table.logp[best] && table.ids[e] < table.ids[best]))
          best = e;
      }
      std::fill(q.begin(), q.end(), 0.f);
      q[best - lo] = 1.f;
      out[table.ids[best]] += 1.f;
      return std::make_pair(lo, hi);
    }
    float top = -INFINITY, sum = 0.f;
    for (int64_t e = lo; e < hi; ++e) top = std::max(top, table.logp[e] / t);
    for (int64_t e = lo; e < hi; ++e) sum += (q[e - lo] = std::exp(table.logp[e] / t - top));
    for (auto& x : q) x /= sum;
    for (int64_t e = lo; e < hi; ++e) out[table.ids[e]] += q[e - lo];  // (+=: duplicate ids stay a distribution)
    return std::make_pair(lo, hi);
  };
  // the entry the uniform picks (inverse CDF; never one of zero mass)
  const auto pick = [&](float uniform) {
    float acc = 0.f;
    int64_t last = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(q.size()); ++i) {
      if (q[i] <= 0.f) continue;
      last = i;
      acc += q[i];
      if (uniform < acc) return i;
    }
    return last;
  };
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* row = ctx.data_ptr<int64_t>() + b * w;
    float* pb = pr + b * (1 + m) * vocab;
    std::copy(row, row + w, chain.begin());
    const auto [rlo, rhi] = dist(w, tp[b], pb);
    const std::vector<float> root_q(q);
    for (int64_t c = 0; c < width; ++c) {
      q = root_q;
      int64_t e = rlo + pick(u[b * m + c]);
      float score = std::log(q[e - rlo]);
      for (int64_t l = 0; l < depth; ++l) {
        const int64_t cand = l * width + c;
        tk[b * m + cand] = table.ids[e];
        pa[b * m + cand] = l == 0 ? -1 : (l - 1) * width + c;
        sc[b * m + cand] = score;
        chain[w + l] = table.ids[e];
        if (l + 1 == depth) break;
        const auto [lo, hi] = dist(w + l + 1, tp[b], pb + (1 + cand) * vocab);
        const int64_t next = lo + pick(u[b * m + (l + 1) * width + c]);
        score += std::log(q[next - lo]);
        e = next;
      }
    }
    (void)rhi;
  }
  return {tokens, parents, scores, probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) {
  m.impl("ngram_table_logits", &ngram_table_logits_cpu);
  m.impl("ngram_table_draw", &ngram_table_draw_cpu);
}

}  // namespace taps
