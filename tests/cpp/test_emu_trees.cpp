// The CUDA build_tree and merge_trees kernels (taps/build_tree_kernel.cuh, taps/merge_trees_kernel.cuh,
// the block-level select_and_emit of taps/tree_kernel.cuh) run under the host CUDA emulation
// (tests/cpp/emu/cuda_runtime.h), against the CPU path of the same core (build_tree_request_host /
// merge_trees_request_host, which end in select_and_emit_host): every output column bit for bit, and
// the error codes of invalid inputs. Random cases with score ties (also -0.0 vs +0.0), padding
// candidates, scores that rise along a path, output trees of more than 64 nodes (several mask words),
// more candidates than threads, duplicate sibling tokens, up to 63 merged trees. The kernels use
// blockDim, so they run here with 32 to 128 threads per block (the real launch uses 512; one case runs
// with 512).
// What this shows: the block logic (pointer jumping, level-by-level trie union with shared atomics,
// bitonic sorts, warp scans, breadth-first placement) computes the CPU result for these cases. Not
// shown: anything about real hardware (memory model, timing, shared-memory limits of the device).
#include <cuda_runtime.h>  // the emulation header (tests/cpp/emu is first on the include path)

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "taps/build_tree_kernel.cuh"
#include "taps/merge_trees_kernel.cuh"

using namespace taps;
using namespace taps::tree;

#include "check.h"

namespace {

using taps_test::check;
using taps_test::rng;
using taps_test::rnd;
float unif(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }

// Outputs of B requests, pre-filled with a marker so that an unwritten entry shows.
struct Out {
  int64_t nn, words;
  std::vector<int64_t> tokens, parents, depth, mask, extra;
  std::vector<float> scores;
  Out(int64_t B, int64_t nn_) : nn(nn_), words((nn_ + 63) / 64) {
    tokens.assign(size_t(B * nn), 777);
    parents = depth = extra = tokens;
    mask.assign(size_t(B * nn * words), 777);
    scores.assign(size_t(B * nn), 777.0f);
  }
  TreeBatch batch() {
    return TreeBatch{tokens.data(), parents.data(), depth.data(), mask.data(), scores.data(), extra.data(), nn, words};
  }
};

// "" when request b of a and b2 agree bit for bit, else the first differing column.
std::string diff(const Out& a, const Out& c, int64_t b) {
  const size_t r0 = size_t(b * a.nn), r1 = r0 + size_t(a.nn);
  auto same = [&](const std::vector<int64_t>& x, const std::vector<int64_t>& y, size_t lo, size_t hi) {
    return std::equal(x.begin() + long(lo), x.begin() + long(hi), y.begin() + long(lo));
  };
  if (!same(a.tokens, c.tokens, r0, r1)) return "tokens";
  if (!same(a.parents, c.parents, r0, r1)) return "parents";
  if (!same(a.depth, c.depth, r0, r1)) return "depth";
  if (!same(a.extra, c.extra, r0, r1)) return "extra";
  if (std::memcmp(a.scores.data() + r0, c.scores.data() + r0, size_t(a.nn) * 4) != 0) return "scores";
  if (!same(a.mask, c.mask, r0 * size_t(a.words), r1 * size_t(a.words))) return "tree_mask";
  return "";
}

// A score: from few values when `ties` (exact ties, and -0.0 / +0.0), else continuous.
float draw_score(bool ties) {
  if (ties) {
    const int k = rnd(0, 6);
    return k == 0 ? 0.0f : k == 1 ? -0.0f : -0.5f * float(k - 1);
  }
  return unif(-3.0f, 0.0f);
}

// build_tree candidates of B requests, M each: real candidates point to an earlier real candidate
// or the root; padding candidates (token < 0) carry arbitrary parents and scores (NaN too).
// monotone: a child's score is below its parent's; otherwise scores rise or fall along a path.
void gen_candidates(int B, int M, int vocab, bool monotone, bool ties, double pad, std::vector<float>& sc,
                    std::vector<int64_t>& tok, std::vector<int64_t>& par) {
  sc.assign(size_t(B * M), 0.0f);
  tok.assign(size_t(B * M), 0);
  par.assign(size_t(B * M), -1);
  for (int b = 0; b < B; ++b) {
    std::vector<int> real;
    for (int m = 0; m < M; ++m) {
      const size_t i = size_t(b * M + m);
      if (unif(0, 1) < pad) {
        tok[i] = -rnd(1, 3);
        par[i] = rnd(-5, m + 5);
        sc[i] = rnd(0, 1) ? NAN : unif(-1, 1);
        continue;
      }
      const int p = real.empty() || rnd(0, 3) == 0 ? -1 : real[size_t(rnd(0, int(real.size()) - 1))];
      par[i] = p;
      tok[i] = rnd(0, vocab - 1);
      float s = draw_score(ties);
      if (monotone && p >= 0) s = sc[size_t(b * M + p)] - std::fabs(s) - (ties ? 0.0f : 0.01f);
      if (!monotone && p >= 0 && rnd(0, 2) == 0) s = sc[size_t(b * M + p)] + unif(0.0f, 1.0f);  // rises
      sc[i] = s;
      real.push_back(m);
    }
  }
}

// One build_tree case: kernel (emulated, `threads` per block) vs the CPU path; returns a label.
void build_case(int B, int M, int nn, int threads, bool roots, bool monotone, bool ties, double pad, int vocab) {
  std::vector<float> sc;
  std::vector<int64_t> tok, par;
  gen_candidates(B, M, vocab, monotone, ties, pad, sc, tok, par);
  std::vector<int64_t> root_tokens(static_cast<size_t>(B));
  for (auto& r : root_tokens) r = rnd(0, 9);
  Out cpu(B, nn), emu(B, nn);
  BuildTreeHostWorkspace ws;
  bool cpu_ok = true;
  for (int b = 0; b < B; ++b)
    cpu_ok = cpu_ok && build_tree_request_host(sc.data() + b * M, tok.data() + b * M, par.data() + b * M, M,
                                                roots ? root_tokens[size_t(b)] : -1, cpu.batch().request(b),
                                                ws) == kNoError;
  std::vector<int32_t> errors(static_cast<size_t>(B), kNoError);
  {
    taps_emu::BlockSize bs(static_cast<unsigned>(threads));
    launch_build_tree(sc.data(), tok.data(), par.data(), roots ? root_tokens.data() : nullptr, B, M, emu.batch(),
                      errors.data(), nullptr);
  }
  char label[160];
  std::snprintf(label, sizeof label, "build_tree B=%d M=%d num_nodes=%d threads=%d monotone=%d ties=%d pad=%.1f", B,
                M, nn, threads, int(monotone), int(ties), pad);
  if (!cpu_ok) {
    check(false, std::string(label) + ": CPU path reports an error on valid input");
    return;
  }
  for (int b = 0; b < B; ++b) {
    std::string d = errors[size_t(b)] != kNoError ? "error " + std::to_string(errors[size_t(b)]) : diff(cpu, emu, b);
    check(d.empty(), std::string(label) + " request " + std::to_string(b) + ": " + d);
  }
}

// Breaks a valid build_tree batch in one or two places; the kernel must report the CPU path's code.
void build_error_case(int threads) {
  const int B = 3, M = rnd(4, 90);
  std::vector<float> sc;
  std::vector<int64_t> tok, par;
  gen_candidates(B, M, 5, true, false, 0.15, sc, tok, par);
  for (int k = rnd(1, 2); k > 0; --k) {
    const int b = rnd(0, B - 1), m = rnd(1, M - 1);
    const size_t i = size_t(b * M + m);
    tok[i] = 3;
    switch (rnd(0, 3)) {
      case 0: par[i] = rnd(m, m + 5); break;   // parent not earlier
      case 1: par[i] = -rnd(2, 9); break;      // parent below -1
      case 2: sc[i] = NAN; break;              // NaN score
      default: {                               // parent is a padding candidate
        const int p = rnd(0, m - 1);
        tok[size_t(b * M + p)] = -1;
        par[i] = p;
      }
    }
  }
  Out cpu(B, 17), emu(B, 17);
  BuildTreeHostWorkspace ws;
  std::vector<int32_t> errors(static_cast<size_t>(B), kNoError);
  {
    taps_emu::BlockSize bs(static_cast<unsigned>(threads));
    launch_build_tree(sc.data(), tok.data(), par.data(), nullptr, B, M, emu.batch(), errors.data(), nullptr);
  }
  for (int b = 0; b < B; ++b) {
    const int32_t want = build_tree_request_host(sc.data() + b * M, tok.data() + b * M, par.data() + b * M, M, -1,
                                                 cpu.batch().request(b), ws);
    std::string d = want != errors[size_t(b)] ? "error " + std::to_string(errors[size_t(b)]) + " vs CPU " +
                                                    std::to_string(want)
                                              : (want == kNoError ? diff(cpu, emu, b) : "");
    check(d.empty(), "build_tree invalid input M=" + std::to_string(M) + " request " + std::to_string(b) + ": " + d);
  }
}

// One merge_trees input tree of N nodes (root token `root`): a random topological tree (parents
// in [0, i), not necessarily breadth first), tokens from a small vocabulary (so duplicate paths
// within and across trees are common), `real` real nodes then padding.
void gen_tree(int N, int64_t root, int vocab, bool ties, int64_t* tok, int64_t* par, float* sc) {
  const int real = rnd(1, N);
  tok[0] = root;
  par[0] = -1;
  sc[0] = 0.0f;
  for (int i = 1; i < N; ++i) {
    if (i < real) {
      par[i] = rnd(0, 2) == 0 ? 0 : rnd(0, i - 1);
      tok[i] = rnd(0, vocab - 1);
      sc[i] = draw_score(ties);
    } else {
      tok[i] = -1;
      par[i] = -1;
      sc[i] = rnd(0, 1) ? NAN : unif(-1, 1);  // padding scores are never read
    }
  }
}

void merge_case(int B, int T, int N, int nn, int threads, bool weighted, bool ties, int vocab) {
  const size_t O = size_t(T * N);
  std::vector<int64_t> tok(size_t(B) * O), par(size_t(B) * O);
  std::vector<float> sc(size_t(B) * O), w(size_t(B * T));
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const size_t o = size_t(b) * O + size_t(t * N);
      gen_tree(N, 100 + b, vocab, ties, tok.data() + o, par.data() + o, sc.data() + o);
    }
  for (auto& x : w) x = ties ? 0.5f * float(rnd(-1, 1)) : unif(-1, 1);
  Out cpu(B, nn), emu(B, nn);
  MergeTreesHostWorkspace ws;
  bool cpu_ok = true;
  for (int b = 0; b < B; ++b)
    cpu_ok = cpu_ok && merge_trees_request_host(tok.data() + size_t(b) * O, par.data() + size_t(b) * O,
                                                sc.data() + size_t(b) * O, weighted ? w.data() + b * T : nullptr, T,
                                                N, cpu.batch().request(b), ws) == kNoError;
  std::vector<int32_t> errors(static_cast<size_t>(B), kNoError);
  {
    taps_emu::BlockSize bs(static_cast<unsigned>(threads));
    launch_merge_trees(tok.data(), par.data(), sc.data(), weighted ? w.data() : nullptr, B, T, N, emu.batch(),
                       errors.data(), nullptr);
  }
  char label[160];
  std::snprintf(label, sizeof label, "merge_trees B=%d T=%d N=%d num_nodes=%d threads=%d weighted=%d ties=%d", B, T,
                N, nn, threads, int(weighted), int(ties));
  if (!cpu_ok) {
    check(false, std::string(label) + ": CPU path reports an error on valid input");
    return;
  }
  for (int b = 0; b < B; ++b) {
    std::string d = errors[size_t(b)] != kNoError ? "error " + std::to_string(errors[size_t(b)]) : diff(cpu, emu, b);
    check(d.empty(), std::string(label) + " request " + std::to_string(b) + ": " + d);
  }
}

void merge_error_case(int threads) {
  const int B = 3, T = rnd(1, 4), N = rnd(3, 20);
  const size_t O = size_t(T * N);
  std::vector<int64_t> tok(size_t(B) * O), par(size_t(B) * O);
  std::vector<float> sc(size_t(B) * O), w(size_t(B * T), 0.25f);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const size_t o = size_t(b) * O + size_t(t * N);
      gen_tree(N, 7, 4, false, tok.data() + o, par.data() + o, sc.data() + o);
    }
  for (int k = rnd(1, 3); k > 0; --k) {
    const int b = rnd(0, B - 1), t = rnd(0, T - 1), i = rnd(1, N - 1);
    int64_t* tk = tok.data() + size_t(b) * O + size_t(t * N);
    int64_t* pr = par.data() + size_t(b) * O + size_t(t * N);
    switch (rnd(0, 7)) {
      case 0: tk[0] = 9; break;                                    // root token differs
      case 1: pr[0] = rnd(0, 3); break;                            // root with a parent
      case 2: tk[i] = 1, pr[i] = rnd(i, i + 3); break;             // not topological
      case 3: tk[i] = 1, pr[i] = -rnd(1, 3); break;                // negative parent of a real node
      case 4: if (tk[i] < 0) tk[i] = -2; else tk[i] = -1; break;   // bad padding (or real after padding)
      case 5: if (tk[i] >= 0) sc[size_t(b) * O + size_t(t * N + i)] = NAN; break;
      case 6: w[size_t(b * T + t)] = NAN; break;
      default: if (i >= 2) tk[i - 1] = -1, pr[i - 1] = -1, tk[i] = 2, pr[i] = 0; break;  // real after padding
    }
  }
  Out cpu(B, 10), emu(B, 10);
  MergeTreesHostWorkspace ws;
  std::vector<int32_t> errors(static_cast<size_t>(B), kNoError);
  {
    taps_emu::BlockSize bs(static_cast<unsigned>(threads));
    launch_merge_trees(tok.data(), par.data(), sc.data(), w.data(), B, T, N, emu.batch(), errors.data(), nullptr);
  }
  for (int b = 0; b < B; ++b) {
    const int32_t want = merge_trees_request_host(tok.data() + size_t(b) * O, par.data() + size_t(b) * O,
                                                  sc.data() + size_t(b) * O, w.data() + b * T, T, N,
                                                  cpu.batch().request(b), ws);
    std::string d = want != errors[size_t(b)] ? "error " + std::to_string(errors[size_t(b)]) + " vs CPU " +
                                                    std::to_string(want)
                                              : (want == kNoError ? diff(cpu, emu, b) : "");
    check(d.empty(), "merge_trees invalid input T=" + std::to_string(T) + " N=" + std::to_string(N) + " request " +
                         std::to_string(b) + ": " + d);
  }
}

}  // namespace

int main() {
  rng.seed(20240611);
  const int thread_choices[] = {32, 64, 96, 128};
  // build_tree: edge sizes first (no candidates, one output node, one candidate, all padding).
  build_case(2, 0, 5, 32, true, true, false, 0.0, 5);
  build_case(2, 7, 1, 32, true, true, false, 0.0, 5);
  build_case(1, 1, 4, 64, false, false, true, 0.0, 5);
  build_case(2, 9, 6, 64, true, false, false, 1.0, 5);
  build_case(1, 300, 64, 512, true, false, true, 0.1, 8);  // the real block size once
  for (int trial = 0; trial < 48; ++trial) {
    const int threads = thread_choices[trial % 4];
    const int M = trial % 8 == 7 ? rnd(300, 700) : rnd(2, 150);  // several keys per thread
    const int nn = trial % 5 == 0 ? rnd(65, 200) : rnd(2, 70);   // > 64: several mask words
    build_case(rnd(1, 3), M, nn, threads, rnd(0, 1), rnd(0, 1), rnd(0, 1), rnd(0, 1) ? 0.0 : 0.2, rnd(2, 40));
  }
  for (int trial = 0; trial < 16; ++trial) build_error_case(thread_choices[trial % 4]);
  // merge_trees
  merge_case(2, 1, 1, 3, 32, false, false, 3);  // root only
  merge_case(1, 2, 5, 1, 32, true, false, 3);   // one output node
  merge_case(1, 63, 3, 127, 64, true, true, 3);  // the most trees: source bit 62, root source 2^63 - 1
  for (int trial = 0; trial < 40; ++trial) {
    const int threads = thread_choices[trial % 4];
    const bool many = trial % 8 == 0;
    const int T = many ? rnd(40, 63) : rnd(1, 5), N = many ? rnd(2, 8) : rnd(2, 40);
    const int nn = rnd(0, 1) ? T * (N - 1) + 1 : rnd(2, trial % 3 == 0 ? 150 : 40);
    merge_case(rnd(1, 3), T, N, nn, threads, rnd(0, 1), rnd(0, 1), rnd(2, 6));
  }
  for (int trial = 0; trial < 24; ++trial) merge_error_case(thread_choices[trial % 4]);
  std::printf("emulated CUDA build_tree / merge_trees vs CPU path (largest dynamic shared memory %zu bytes)\n",
              taps_emu::state.max_dynamic_bytes_seen);
  return taps_test::finish();
}
