// C++ tests of the header-only verify core (taps/verify_tree.h, taps/common.h), without torch:
// the walk driven by a minimal sequential row backend on literal trees, the radix threshold search,
// the request checks and the order-preserving float key.
#include <cmath>
#include <cstdio>
#include <vector>

#include "seq_ops.h"
#include "taps/verify_tree.h"

using namespace taps;

static int failures = 0, checks = 0;
#define EXPECT(cond)                                                   \
  do {                                                                 \
    ++checks;                                                          \
    if (!(cond)) {                                                     \
      ++failures;                                                      \
      std::printf("%s:%d: EXPECT(%s) failed\n", __FILE__, __LINE__, #cond); \
    }                                                                  \
  } while (0)

struct Result {
  std::vector<int64_t> tokens, path;
  int64_t accepted;
  int32_t error;
};

static Result walk(const std::vector<float>& logits, int64_t vocab, const std::vector<int64_t>& tokens,
                   const std::vector<int64_t>& parents, const std::vector<float>& uniforms, float temperature,
                   int64_t top_k = 0, float top_p = 1.0f, const std::vector<float>* q = nullptr) {
  const int64_t n = int64_t(tokens.size());
  std::vector<int32_t> ints(2 * n);
  std::vector<uint8_t> flags(n);
  std::vector<float> floats(n + 256);
  verify::Scratch s{ints.data(), ints.data() + n, flags.data(), floats.data(), floats.data() + n};
  Result r{std::vector<int64_t>(n, -1), std::vector<int64_t>(n, -1), 0, kNoError};
  verify::Request<float, float> rq{logits.data(), q ? q->data() : nullptr, tokens.data(), parents.data(),
                                   uniforms.data(), n, vocab, temperature, top_p, top_k};
  verify::WalkState st{};
  verify::Outputs out{r.tokens.data(), r.path.data(), &r.accepted, &r.error};
  SeqOps ops;
  verify::verify_walk(ops, rq, s, st, out, true);
  return r;
}

int main() {
  // Order-preserving key.
  const float xs[] = {-INFINITY, -3.5f, -1e-30f, -0.0f, 0.0f, 1e-30f, 2.0f, INFINITY};
  for (int i = 0; i + 1 < 8; ++i) EXPECT(float_to_ordered(xs[i]) < float_to_ordered(xs[i + 1]));
  for (float x : xs) EXPECT(ordered_to_float(float_to_ordered(x)) == x);

  // Greedy: root 0 -> children 1 (tok 3), 2 (tok 1); node 2 -> child 3 (tok 0). V = 4.
  // argmax(row0) = 1 -> accept node 2; argmax(row2) = 0 -> accept node 3; argmax(row3) = 2 -> bonus.
  {
    const std::vector<float> lg = {0, 5, 1, 2, /*1*/ 9, 0, 0, 0, /*2*/ 7, 1, 1, 1, /*3*/ 0, 0, 4, 4};
    const Result r = walk(lg, 4, {9, 3, 1, 0}, {-1, 0, 0, 2}, {0.5f, 0.5f, 0.5f, 0.5f}, 0.0f);
    EXPECT(r.error == kNoError);
    EXPECT(r.accepted == 2);
    EXPECT(r.path[0] == 0 && r.path[1] == 2 && r.path[2] == 3 && r.path[3] == -1);
    EXPECT(r.tokens[0] == 1 && r.tokens[1] == 0 && r.tokens[2] == 2 && r.tokens[3] == -1);  // tie 2/3 -> 2
  }
  // Sampling, children first: p(root) = [.5, .25, .125, .125], children tokens 2 then 0.
  // order: 2 (.125), 0 (.5), 1 (.25), 3 (.125); coin .1 -> token 2 (node 1); .3 -> token 0 (node 2);
  // .7 -> token 1 (bonus); .95 -> token 3 (bonus).
  {
    const std::vector<float> row = {std::log(.5f), std::log(.25f), std::log(.125f), std::log(.125f)};
    std::vector<float> lg;
    for (int i = 0; i < 3; ++i) lg.insert(lg.end(), row.begin(), row.end());
    const float coins[] = {0.1f, 0.3f, 0.7f, 0.95f};
    const int64_t first[] = {2, 0, 1, 3};
    const int64_t accepted[] = {1, 1, 0, 0};
    for (int c = 0; c < 4; ++c) {
      const Result r = walk(lg, 4, {5, 2, 0}, {-1, 0, 0}, {coins[c], 0.99f, 0.99f}, 1.0f);
      EXPECT(r.error == kNoError);
      EXPECT(r.tokens[0] == first[c]);
      EXPECT(r.accepted == accepted[c]);
    }
    // top-k 2 keeps tokens 0, 1 (p = 2/3, 1/3); child token 2 has no mass: order 0, 1; coin .7 -> 1.
    const Result k2 = walk(lg, 4, {5, 2, 0}, {-1, 0, 0}, {0.7f, 0.5f, 0.5f}, 1.0f, 2);
    EXPECT(k2.accepted == 0 && k2.tokens[0] == 1);
  }
  // Draft mode: q = [0, 0, 1, 0] for the root's child token 2 with p(2) = .125: accept iff u < .125.
  {
    const std::vector<float> row = {std::log(.5f), std::log(.25f), std::log(.125f), std::log(.125f)};
    std::vector<float> lg, q;
    for (int i = 0; i < 2; ++i) {
      lg.insert(lg.end(), row.begin(), row.end());
      q.insert(q.end(), {0.f, 0.f, 1.f, 0.f});
    }
    const Result acc = walk(lg, 4, {5, 2}, {-1, 0}, {0.5f, 0.1f}, 1.0f, 0, 1.0f, &q);
    EXPECT(acc.accepted == 1 && acc.tokens[0] == 2);
    // rejected: residual = norm(max(p - q, 0)) = [.5, .25, 0, .125] / .875; root coin .5 -> token 0
    const Result rej = walk(lg, 4, {5, 2}, {-1, 0}, {0.5f, 0.2f}, 1.0f, 0, 1.0f, &q);
    EXPECT(rej.accepted == 0 && rej.tokens[0] == 0);
    const Result rej2 = walk(lg, 4, {5, 2}, {-1, 0}, {0.9f, 0.2f}, 1.0f, 0, 1.0f, &q);
    EXPECT(rej2.accepted == 0 && rej2.tokens[0] == 3);
  }
  // Radix threshold: the k-th largest value.
  {
    const std::vector<float> row = {0.5f, -2.0f, 7.0f, 7.0f, 3.0f, -0.0f, 1.0f};
    SeqOps ops;
    float bins[256];
    auto key = [&](int64_t v) { return float_to_ordered(row[v]); };
    auto one = [](int64_t) { return 1.0f; };
    const float expect[] = {7.0f, 7.0f, 3.0f, 1.0f, 0.5f, -0.0f, -2.0f};
    for (int k = 1; k <= 7; ++k) EXPECT(ordered_to_float(verify::radix_threshold(ops, 7, key, one, float(k), bins)) == expect[k - 1]);
  }
  // Request checks.
  {
    const std::vector<float> u = {0.1f, 0.2f, 0.3f};
    EXPECT(verify::check_request(std::vector<int64_t>{1, 2, 3}.data(), std::vector<int64_t>{-1, 0, 1}.data(), u.data(), 3, 4, 1, 0, 1) == kNoError);
    EXPECT(error_code(verify::check_request(std::vector<int64_t>{1, 2, 3}.data(), std::vector<int64_t>{-1, 0, 2}.data(), u.data(), 3, 4, 1, 0, 1)) == verify::kErrParentRange);
    EXPECT(error_code(verify::check_request(std::vector<int64_t>{1, 4, 3}.data(), std::vector<int64_t>{-1, 0, 1}.data(), u.data(), 3, 4, 1, 0, 1)) == verify::kErrTokenRange);
    EXPECT(error_code(verify::check_request(std::vector<int64_t>{1, -1, 3}.data(), std::vector<int64_t>{-1, -1, 0}.data(), u.data(), 3, 4, 1, 0, 1)) == verify::kErrPadding);
    EXPECT(verify::check_request(std::vector<int64_t>{1, 2, 3}.data(), std::vector<int64_t>{-1, 0, 1}.data(), u.data(), 3, 4, -1, 0, 1) == verify::kErrTemperature);
    EXPECT(verify::check_request(std::vector<int64_t>{1, 2, 3}.data(), std::vector<int64_t>{-1, 0, 1}.data(), u.data(), 3, 4, 1, 0, 0) == verify::kErrTopP);
  }
  std::printf("%d passed, %d failed\n", checks - failures, failures);
  return failures == 0 ? 0 : 1;
}
