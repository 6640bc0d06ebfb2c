// The CUDA tree_attention kernels (SIMT kernel, tensor-core kernel, split combine) of
// taps/tree_attention_kernel.cuh, run under the host CUDA emulation (tests/cpp/emu/cuda_runtime.h, whose
// m16n8k16 mma and ldmatrix follow the PTX fragment layouts, and whose cp.async copies land only at
// the wait), against plain loops written here in double precision from the same (rounded) inputs,
// within 2e-5 (fp32), 2e-3 (fp16) or 1e-2 (bf16) of the largest |value| (the tensor-core kernel rounds
// P to the input type, as flash attention does; a fragment-layout slip gives errors of order 1). Head
// dims 64, 80 (the partial lane
// of the SIMT kernel, five k-steps of the mma) and 128; odd node counts and cache lengths,
// grouped-query heads (also groups spanning several row blocks and warps holding several m-tiles),
// ragged kv_lens, query strides of a [B, N, H, D] layout, padded K/V head strides, one split and
// several (a split may lie wholly past a request's length), a mask row that sees nothing.
// num_queries (ragged cases): with n_b live queries per request (0 and N among them) the live rows equal
// the same kernel's rows without num_queries bit for bit, the dead rows are exactly zero (one split: the
// binding's zeroed output; several: the combine writes them, over never-written partials filled with 999).
// Also the launch plan (kernel choice, rows per block, splits) for a few shapes.
// Not shown: device numerics (__expf, FMA contraction, the tensor core's summation order),
// performance, memory-model effects.
#include <cuda_runtime.h>  // the emulation header (tests/cpp/emu is first on the include path)

#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "taps/tree_attention_kernel.cuh"

#include "check.h"

namespace {

namespace attention = taps::attention;
using taps_test::check;
using taps_test::rng;
using taps_test::rnd;
float normal() { return std::normal_distribution<float>(0.0f, 1.0f)(rng); }

struct AttnCase {
  int B, Hq, Hkv, N, S, split_keys;  // split_keys 0: the plan's (one split at sms = 1 for these sizes)
  bool empty_row;                    // request 0: kv_len = N and one mask row without bits
  bool mma = true;                   // allow the tensor-core kernel (bf16 / fp16 only)
  int extra = 0;                     // tree nodes before the N queries (T = N + extra: a drafter's level)
  bool ragged = false;               // also with num_queries: request b % 3 == 1 none, 2 all, 0 random
};

constexpr int64_t kH100Smem = 227 * 1024;  // opt-in shared memory per block on sm_90

template <class T> const char* type_name();
template <> const char* type_name<float>() { return "fp32"; }
template <> const char* type_name<__nv_bfloat16>() { return "bf16"; }
template <> const char* type_name<__half>() { return "fp16"; }
float as_float(float x) { return x; }
float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }
float as_float(__half x) { return __half2float(x); }
template <class T> T from_f(float x);
template <> float from_f<float>(float x) { return x; }
template <> __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __half from_f<__half>(float x) { return __float2half_rn(x); }
template <class T> double tolerance() { return std::is_same_v<T, float> ? 2e-5 : (std::is_same_v<T, __half> ? 2e-3 : 1e-2); }

template <class T, int D>
void attention_case(const AttnCase& c) {
  const int B = c.B, Hq = c.Hq, Hkv = c.Hkv, N = c.N, S = c.S, G = Hq / Hkv, Tn = N + c.extra;
  const int W = (Tn + 63) / 64;
  const int pad_h = 3 * D;  // K/V head stride padding (a multiple of 8 elements: 16-byte rows)
  // q laid out [B, N, Hq, D] (strided view of [B, Hq, N, D]); k, v [B, Hkv, S, D] with padded heads.
  std::vector<T> q(size_t(B * N * Hq * D)), k(size_t(B * Hkv * (S * D + pad_h))), v(k.size());
  for (auto& x : q) x = from_f<T>(normal());
  for (auto& x : k) x = from_f<T>(normal());
  for (auto& x : v) x = from_f<T>(normal());
  const int64_t qs_b = int64_t(N) * Hq * D, qs_h = D, qs_n = int64_t(Hq) * D;
  const int64_t ks_b = int64_t(Hkv) * (S * D + pad_h), ks_h = S * D + pad_h, ks_s = D;
  // Masks: a random tree of Tn nodes per request; query i is node Tn - N + i and sees its ancestors and
  // itself.
  std::vector<int64_t> mask(size_t(B * N * W), 0), kv_lens(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) {
    std::vector<int> parent(size_t(Tn), -1);
    for (int i = 1; i < Tn; ++i) parent[size_t(i)] = rnd(0, i - 1);
    for (int i = 0; i < N; ++i)
      for (int a = Tn - N + i; a >= 0; a = parent[size_t(a)])
        mask[size_t((b * N + i) * W + a / 64)] |= int64_t(uint64_t(1) << (a % 64));
    kv_lens[size_t(b)] = b == B - 1 ? S : rnd(Tn, S);  // ragged; the last request fills the cache
  }
  if (c.empty_row) {
    kv_lens[0] = Tn;  // no prefix
    for (int w = 0; w < W; ++w) mask[size_t((0 * N + N / 2) * W + w)] = 0;
  }
  const float scale = 1.0f / std::sqrt(float(D));
  // Reference, double precision.
  std::vector<double> ref(size_t(B * Hq * N * D), 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h)
      for (int i = 0; i < N; ++i) {
        const int hk = h / G;
        const int64_t L = kv_lens[size_t(b)], start = L - Tn;
        const T* qi = q.data() + b * qs_b + h * qs_h + i * qs_n;
        std::vector<double> s;
        std::vector<int64_t> pos;
        for (int64_t j = 0; j < L; ++j) {
          const int64_t node = j - start;
          if (node >= 0 && !((uint64_t(mask[size_t((b * N + i) * W + node / 64)]) >> (node % 64)) & 1)) continue;
          const T* kj = k.data() + b * ks_b + hk * ks_h + j * ks_s;
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += double(as_float(qi[d])) * double(as_float(kj[d]));
          s.push_back(dot * scale);
          pos.push_back(j);
        }
        if (s.empty()) continue;  // sees nothing: zeros
        double m = s[0], z = 0;
        for (double x : s) m = std::max(m, x);
        for (double& x : s) z += (x = std::exp(x - m));
        double* o = ref.data() + ((b * Hq + h) * N + i) * D;
        for (size_t t = 0; t < s.size(); ++t) {
          const T* vj = v.data() + b * ks_b + hk * ks_h + pos[t] * ks_s;
          for (int d = 0; d < D; ++d) o[d] += s[t] / z * double(as_float(vj[d]));
        }
      }
  // Kernel.
  const bool half_type = !std::is_same_v<T, float>;
  attention::AttentionPlan plan =
      attention::plan_tree_attention(B, Hkv, int64_t(G) * N, S, D, half_type && c.mma, 1, kH100Smem);
  if (c.split_keys > 0) {
    plan.split_keys = c.split_keys;
    plan.splits = (S + c.split_keys - 1) / c.split_keys;
  }
  const int64_t splits = plan.splits;
  const int64_t rows_all = int64_t(B) * Hq * N;
  // One launch: num_queries `live` (null: none); out filled with `fill` first, the partials with 999.
  auto run = [&](const int64_t* live, T fill) {
    attention::Params p{};
    std::vector<T> out(ref.size(), fill);
    std::vector<float> part_acc(size_t(splits * rows_all * D), 999.0f), part_max(size_t(splits * rows_all), 999.0f),
        part_sum(part_max.size(), 999.0f);
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.tree_mask = mask.data();
    p.kv_lens = kv_lens.data();
    p.num_queries = live;
    p.out = out.data();
    p.part_acc = splits > 1 ? part_acc.data() : nullptr;
    p.part_max = splits > 1 ? part_max.data() : nullptr;
    p.part_sum = splits > 1 ? part_sum.data() : nullptr;
    p.q_stride_b = qs_b, p.q_stride_h = qs_h, p.q_stride_n = qs_n;
    p.k_stride_b = p.v_stride_b = ks_b;
    p.k_stride_h = p.v_stride_h = ks_h;
    p.k_stride_s = p.v_stride_s = ks_s;
    p.batch = B, p.heads_q = Hq, p.heads_kv = Hkv, p.num_nodes = N, p.head_dim = D, p.cache_len = S, p.mask_words = W;
    p.tree_nodes = Tn;
    p.scale = scale;
    attention::launch_tree_attention<T, D>(p, plan, nullptr);
    return out;
  };
  const std::vector<T> out = run(nullptr, from_f<T>(12345.0f));
  double big = 1e-30, err = 0;
  size_t worst = 0;
  for (size_t e = 0; e < ref.size(); ++e) {
    big = std::max(big, std::fabs(ref[e]));
    const double d = std::fabs(double(as_float(out[e])) - ref[e]);
    if (!(d <= err)) err = d, worst = e;  // NaN counts as worst
  }
  char label[260];
  std::snprintf(label, sizeof label,
                "tree_attention %s %s D=%d B=%d Hq=%d Hkv=%d N=%d T=%d S=%d warps=%d row_blocks=%lld splits=%lld "
                "empty_row=%d: max error %.3g (%.2g of max) at %zu (got %g, want %g)",
                type_name<T>(), plan.mma ? "mma" : "simt", D, B, Hq, Hkv, N, Tn, S, plan.warps,
                (long long)plan.row_blocks, (long long)splits, int(c.empty_row), err, err / big, worst,
                double(as_float(out[worst])), ref[worst]);
  check(err <= tolerance<T>() * big, label);
  if (std::getenv("TAPS_EMU_VERBOSE")) std::printf("%s\n", label);
  if (c.empty_row) {  // the row that sees nothing is exactly zero in every head
    bool zero = true;
    for (int h = 0; h < Hq; ++h)
      for (int d = 0; d < D; ++d) zero = zero && as_float(out[size_t(((0 * Hq + h) * N + N / 2) * D + d)]) == 0.0f;
    check(zero, std::string(label) + ": row without visible keys is not zero");
  }
  if (!c.ragged) return;
  // num_queries: the binding zeroes the output when there is one split; with several, fill it with garbage
  // that the combine must overwrite with zeros.
  std::vector<int64_t> live(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) live[size_t(b)] = b % 3 == 1 ? 0 : (b % 3 == 2 ? N : rnd(N > 1 ? 1 : 0, N > 1 ? N - 1 : N));
  const std::vector<T> part = run(live.data(), from_f<T>(splits == 1 ? 0.0f : 12345.0f));
  int64_t same = 0, differ = 0, zero = 0, nonzero = 0;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h)
      for (int i = 0; i < N; ++i)
        for (int d = 0; d < D; ++d) {
          const size_t e = size_t(((b * Hq + h) * N + i) * D + d);
          if (i < live[size_t(b)]) {
            (std::memcmp(&part[e], &out[e], sizeof(T)) == 0 ? same : differ)++;
          } else {
            (as_float(part[e]) == 0.0f && !std::signbit(as_float(part[e])) ? zero : nonzero)++;
          }
        }
  std::string lives;
  for (int64_t n : live) (lives += ' ') += std::to_string(n);  // (not " " + s: GCC 12's -Wrestrict false alarm)
  const std::string what = std::string(label) + ": num_queries" + lives + ": live elements equal to the full call " +
                           std::to_string(same) + " (differ " + std::to_string(differ) + "), dead elements zero " +
                           std::to_string(zero) + " (not " + std::to_string(nonzero) + ")";
  check(differ == 0 && nonzero == 0 && same > 0 && zero > 0, what);
  if (std::getenv("TAPS_EMU_VERBOSE")) std::printf("%s\n", what.c_str());
}

// tile_visibility against key_visible, key by key: random masks of 1-3 words (garbage bits past N
// too), every tile start from far in the prefix to past the end, valid and short (len < N) requests.
void visibility_cases() {
  int bad = 0, total = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t N = rnd(1, 190), W = (N + 63) / 64 + rnd(0, 1), S = N + rnd(0, 300);
    const int64_t len = trial % 10 == 0 ? rnd(0, int(N)) : rnd(int(N), int(S));
    std::vector<int64_t> row(static_cast<size_t>(W));
    for (auto& x : row) x = int64_t((uint64_t(rng()) << 32) ^ uint64_t(rng()));
    const attention::TreeSpan span = attention::tree_span(len, N, S);  // T = N
    for (int64_t tile0 = -70; tile0 < span.len + 70; tile0 += rnd(1, 40)) {
      if (tile0 < 0) continue;
      const uint64_t vis = attention::tile_visibility(span, row.data(), W, tile0);
      for (int j = 0; j < 64 && tile0 + j < span.len; ++j) {
        ++total;
        bad += ((vis >> j) & 1u) != uint64_t(attention::key_visible(span, row.data(), tile0 + j));
      }
    }
  }
  check(bad == 0 && total > 10000, "tile_visibility equals key_visible (" + std::to_string(total) + " keys, " +
                                       std::to_string(bad) + " wrong)");
}

// The launch plan: which kernel, how many warps and row blocks, and the split arithmetic.
void plan_cases() {
  auto plan_tree_attention = [](int64_t batch, int64_t heads_kv, int64_t rows, int64_t s, int64_t d, bool mma,
                                int64_t sms) {
    return attention::plan_tree_attention(batch, heads_kv, rows, s, d, mma, sms, kH100Smem);
  };
  // bf16, G * N = 4 * 64 = 256 rows, D = 128: 8 warps x 2 m-tiles hold the whole group in one block.
  attention::AttentionPlan p = plan_tree_attention(4, 8, 256, 2048, 128, true, 132);
  check(p.mma && p.warps == 8 && p.block_rows == 256 && p.row_blocks == 1, "plan: whole group per block (D=128)");
  // 4 * 8 = 32 blocks on 132 SMs: ceil(264 / 32) = 9 splits for two waves, capped at 2048 / 256 = 8,
  // of 256 keys (a multiple of the 64-key tile).
  check(p.splits == 8 && p.split_keys == 256, "plan: splits for two waves, whole tiles");
  // D = 256 holds 128 rows per block: two row blocks.
  p = plan_tree_attention(1, 8, 256, 8192, 256, true, 132);
  check(p.mma && p.block_rows == 128 && p.row_blocks == 2, "plan: D=256 row blocks");
  // 16 blocks: ceil(264 / 16) = 17 splits of ceil(8192 / 17) = 482 -> 512 keys: 16 splits.
  check(p.splits == 16 && p.split_keys == 512, "plan: D=256 splits");
  // 28 rows: two warps of one m-tile each; fewer than 16 rows or fp32: the SIMT kernel.
  p = plan_tree_attention(3, 2, 28, 257, 64, true, 132);
  check(p.mma && p.warps == 2 && p.block_rows == 32 && p.row_blocks == 1 && p.splits == 1, "plan: small group");
  // 8 m-tiles (128 rows) at D = 128: 8 warps of one m-tile, 128 rows of shared memory (not 256).
  p = plan_tree_attention(1, 8, 128, 4096, 128, true, 132);
  check(p.mma && p.warps == 8 && p.block_rows == 128 && p.row_blocks == 1, "plan: rows sized to the group");
  p = plan_tree_attention(3, 2, 8, 257, 64, true, 132);
  check(!p.mma && p.block_rows == attention::kAttnRows && p.row_blocks == 1, "plan: under 16 rows -> SIMT");
  p = plan_tree_attention(3, 2, 256, 257, 64, false, 132);
  check(!p.mma && p.row_blocks == 16 && p.split_keys % attention::kTileKeys == 0, "plan: fp32 -> SIMT");
  // Short caches never split; long ones at most kMaxSplits.
  check(plan_tree_attention(1, 1, 16, 255, 64, true, 132).splits == 1, "plan: short cache, one split");
  check(plan_tree_attention(1, 1, 16, 1 << 20, 64, true, 132).splits <= attention::kMaxSplits, "plan: split cap");
  // sm_80 (A100) opts in to 163 KB: D = 256 takes 3 warps (157 KB) instead of 8 (203 KB); D = 128 keeps 8
  // (136 KB).
  constexpr int64_t kA100Smem = 163 * 1024;
  p = attention::plan_tree_attention(1, 8, 256, 8192, 256, true, 108, kA100Smem);
  check(p.mma && p.warps == 3 && p.block_rows == 48 && p.row_blocks == 6, "plan: D=256 on sm_80 smem");
  check(attention::mma_smem_bytes(256, 48) <= kA100Smem && attention::mma_smem_bytes(256, 64) > kA100Smem, "smem sizes");
  p = attention::plan_tree_attention(1, 8, 256, 8192, 128, true, 108, kA100Smem);
  check(p.mma && p.warps == 8 && p.block_rows == 256, "plan: D=128 on sm_80 smem");
  // A device with too little shared memory for even one warp's rows: the SIMT kernel.
  p = attention::plan_tree_attention(1, 8, 256, 8192, 128, true, 108, 48 * 1024);
  check(!p.mma && p.block_rows == attention::kAttnRows && p.split_keys % attention::kTileKeys == 0, "plan: no smem -> SIMT");

  // The CUDA splits for a measured residency (plan_gpu_splits). The tensor-core kernel (132 SMs x 1
  // resident block, as measured for D = 128 on an H200): the most splits whose blocks fit one wave, at
  // least 128 keys each.
  auto waved = [&](int64_t batch, int64_t rows, int64_t s, bool mma, int64_t resident) {
    attention::AttentionPlan q = plan_tree_attention(batch, 8, rows, s, 128, mma, 132);
    attention::plan_gpu_splits(q, batch, 8, s, resident);
    return q;
  };
  p = waved(4, 256, 2048, true, 132);  // 32 blocks a split: 4 splits fill 128 of 132 (two waves planned 8)
  check(p.splits == 4 && p.split_keys == 512, "wave splits: B 4 S 2048 -> 4");
  p = waved(8, 256, 4096, true, 132);  // 64 blocks a split: 2
  check(p.splits == 2 && p.split_keys == 2048, "wave splits: B 8 S 4096 -> 2");
  p = waved(1, 256, 1024, true, 132);  // 8 blocks: 16 would fit, 1024 / 128 = 8 keep 128 keys each
  check(p.splits == 8 && p.split_keys == 128, "wave splits: capped by keys per split");
  p = waved(1, 32, 216, true, 132);   // a short cache: one split
  check(p.splits == 1, "wave splits: short cache");
  p = waved(64, 256, 4096, true, 132);  // 512 blocks fill waves alone
  check(p.splits == 1 && p.split_keys >= 4096, "wave splits: a full wave without splits");
  p = waved(2, 256, 8192, true, 264);  // two resident blocks a SM: 264 / 16 = 16 splits of 512
  check(p.splits == 16 && p.split_keys == 512, "wave splits: two blocks a SM");
  // The SIMT kernel (5 resident blocks a SM): up to 8 waves of blocks.
  p = waved(4, 256, 2048, false, 660);  // 512 items: ceil(8 x 660 / 512) = 11 splits of 192 keys
  check(!p.mma && p.splits == 11 && p.split_keys == 192, "gpu splits: SIMT, 8 waves");
  p = waved(1, 12, 4096, true, 660);  // 12 rows (SIMT), 8 items: capped at 4096 / 128 = 32 splits
  check(!p.mma && p.splits == 32 && p.split_keys == 128, "gpu splits: SIMT, capped by keys per split");
  p = waved(1, 28, 257, false, 660);  // a short cache: one split
  check(p.splits == 1, "gpu splits: SIMT, short cache");
  p = waved(4, 256, 2048, true, 0);  // residency unknown: the two-wave plan
  check(p.splits == 8, "wave splits: unknown residency");
}

}  // namespace

int main() {
  rng.seed(777);
  plan_cases();
  visibility_cases();
  // {B, Hq, Hkv, N, S, split_keys, empty_row}
  attention_case<float, 64>({2, 4, 2, 5, 47, 0, false});     // one split, GQA 2, odd N and S
  attention_case<float, 64>({3, 2, 2, 13, 100, 32, false});  // four splits, ragged lengths
  attention_case<float, 80>({2, 3, 1, 7, 61, 0, false});     // D = 80, GQA 3 (21 rows: two row blocks)
  attention_case<float, 80>({2, 2, 1, 37, 90, 64, true});    // two splits, a row that sees nothing
  attention_case<float, 64>({1, 1, 1, 1, 33, 32, false});    // single node, second split holds one key
  attention_case<float, 64>({2, 2, 1, 70, 140, 32, false});  // N > 64: two mask words, five splits
  // Tensor-core kernel (G * N >= 16).
  attention_case<__half, 64>({2, 4, 2, 5, 47, 0, false});          // 10 rows: under 16 -> SIMT, fp16
  attention_case<__half, 64>({2, 8, 2, 7, 93, 0, false});          // 28 rows: 2 warps, a partial m-tile
  attention_case<__nv_bfloat16, 64>({2, 8, 2, 7, 93, 0, false});   // the same in bf16
  attention_case<__half, 80>({2, 2, 1, 37, 150, 64, true});        // D = 80, 3 splits, an empty row
  attention_case<__half, 64>({1, 6, 1, 23, 200, 0, false});        // 138 rows: 8 warps, warp 0 holds a second m-tile
  attention_case<__half, 128>({1, 4, 1, 70, 190, 128, false});     // 280 rows: 2 row blocks, N > 64
  attention_case<__half, 128>({1, 2, 1, 16, 16, 0, false});        // no prefix at all: tail tile only
  attention_case<__nv_bfloat16, 96>({1, 8, 2, 11, 300, 128, false});     // D = 96, 3 splits of 2 tiles
  attention_case<__half, 256>({1, 12, 1, 15, 100, 0, false});            // D = 256: 180 rows, 2 row blocks
  attention_case<__nv_bfloat16, 256>({1, 2, 1, 20, 150, 64, true});     // D = 256, 3 splits, an empty row
  attention_case<__half, 128>({1, 4, 2, 9, 700, 0, false});              // 11 tiles in one split
  attention_case<__nv_bfloat16, 80>({2, 4, 2, 9, 70, 0, false, false});  // bf16 on the SIMT kernel
  // Queries for only the newest N of T tree nodes (a drafter's expansion level).
  attention_case<float, 64>({2, 4, 2, 8, 90, 0, false, true, 24});          // T = 32, SIMT
  attention_case<float, 64>({1, 2, 1, 8, 150, 32, true, true, 72});         // T = 80: two words, splits, empty row
  attention_case<__half, 64>({2, 8, 2, 8, 120, 0, false, true, 40});        // tensor cores, T = 48
  attention_case<__nv_bfloat16, 128>({1, 4, 1, 16, 200, 64, false, true, 64});  // T = 80, 4 splits
  // num_queries (ragged batches, B >= 3: requests with none, all and some of their N queries live).
  // {B, Hq, Hkv, N, S, split_keys, empty_row, mma, extra, ragged}
  attention_case<float, 64>({4, 4, 2, 5, 47, 0, false, true, 0, true});         // SIMT, one split
  attention_case<float, 80>({5, 6, 2, 13, 100, 32, false, true, 0, true});      // SIMT, 3 row blocks, 4 splits
  attention_case<float, 64>({3, 1, 1, 1, 33, 32, false, true, 0, true});        // N = 1: n_b 0 or 1, 2 splits
  attention_case<float, 64>({3, 2, 1, 70, 140, 0, true, true, 8, true});        // two mask words, T > N, empty row
  attention_case<__half, 64>({4, 8, 2, 7, 93, 0, false, true, 0, true});        // mma, 28 rows, one split
  attention_case<__nv_bfloat16, 64>({4, 8, 2, 7, 93, 32, false, true, 0, true});  // mma, 3 splits
  attention_case<__half, 128>({3, 4, 1, 70, 190, 128, false, true, 0, true});   // mma, 2 row blocks, 2 splits
  attention_case<__half, 64>({3, 6, 1, 23, 200, 0, true, true, 0, true});       // mma, warp 0 holds 2 m-tiles
  attention_case<__nv_bfloat16, 128>({3, 4, 1, 16, 200, 64, false, true, 64, true});  // mma, T = 80, 4 splits
  std::printf("emulated CUDA tree_attention vs plain loops\n");
  return taps_test::finish();
}
