// panel_linear, CPU: y = x W^T + b for a few rows of x (a decoding step's tokens, a draft tree's nodes) over a
// float32 or bfloat16 weight kept as panels (taps_ops.pack_panels), with a fixed summation order (the same bits
// at every instruction-set level, row count and thread count). bfloat16 panels are widened to float32 as they
// are read (exact; no bf16 instructions needed): half the weight bytes, the arithmetic of float32. bfloat16 x
// over them: on a CPU with AVX512-BF16 (at the avx512 level) its dot product, whose two fused multiply-adds run
// in the same order (avx512_bf16 below): twice the multiply-adds per instruction, the same bits.
// At the amx level bfloat16 x over bfloat16 panels (`in` a multiple of 32) multiply on AMX tiles instead (amx
// below): the hardware's own sums, the same bits for any row count but not the other levels'.
//
// Why an op: BLAS libraries tune their float32 GEMMs for many rows. At 2-16 rows and decoding's shapes the
// ones measured on the development CPUs take 1.5-2.5x the time of one row (bench/RESULTS.md, "A few rows
// for the price of one"), while the floor is max(reading the weight once, the rows' multiply-adds): a tree
// of a few nodes should cost a plain step's weight traffic. Here each weight element is loaded once per
// row block (up to 8 rows at AVX-512, 6 at AVX2) and multiplied into every row of the block from registers.
//
// Work: rows x out x in multiply-adds; bytes: out x in x 4 (2: bfloat16) of weight once per row block per L2-sized
// output block (panels stay in L2 across the row blocks), rows x (in + out) x 4 of activations.
// Parallel over output blocks (at::parallel_for); each output's sum is one thread's, in one order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "checks/checks.h"
#include "cpu/cpu_isa.h"

namespace taps {
namespace panel_cpu {

constexpr int64_t kPanelWidth = 16;              // outputs per panel (taps_ops.pack_panels)
constexpr int64_t kBlockBytes = 192 * 1024;      // weight bytes per output block: stays in L2 across row blocks
constexpr int64_t kBlockPanels = 8;              // output blocks are whole multiples of this many panels
constexpr int kPrefetchLocality = 2;             // __builtin_prefetch's: 2 = into L2 (prefetcht1)
constexpr int kDotRows = 12;                      // the most rows a block of the AVX512-BF16 kernel

// The rows of the AVX512-BF16 kernel's block after the first `done` of `rows`: the rows left in as few blocks of
// at most kDotRows as hold them, as even as they go (16 rows: 8 + 8, not 12 + 4, whose 4-row block takes 4
// broadcasts and 4 weight loads a 16 dot products). Problem::xs is laid out by these blocks.
inline int64_t even_block_rows(int64_t rows, int64_t done, int64_t most) {
  const int64_t left = rows - done, blocks = (left + most - 1) / most;
  return (left + blocks - 1) / blocks;
}
inline int64_t dot_block_rows(int64_t rows, int64_t done) { return even_block_rows(rows, done, kDotRows); }

// Rows src[0 .. RB) of `in` floats (row stride `in`) interleaved into dst: input i of row r at dst[i * RB + r]
// (Problem::xi), written in order.
template <int RB>
inline void interleave_rows(const float* src, int64_t in, float* dst) {
  const float* row[RB];
  for (int r = 0; r < RB; ++r) row[r] = src + r * in;
  for (int64_t i = 0; i < in; ++i, dst += RB)
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) dst[r] = row[r][i];
}

inline void interleave_rows(const float* src, int64_t in, int64_t rows, float* dst) {
  switch (rows) {
    case 1: return interleave_rows<1>(src, in, dst);
    case 2: return interleave_rows<2>(src, in, dst);
    case 3: return interleave_rows<3>(src, in, dst);
    case 4: return interleave_rows<4>(src, in, dst);
    case 5: return interleave_rows<5>(src, in, dst);
    case 6: return interleave_rows<6>(src, in, dst);
    default:
      for (int64_t i = 0; i < in; ++i, dst += rows)
        for (int64_t r = 0; r < rows; ++r) dst[r] = src[r * in + i];
  }
}

// This thread's scratch of at least `elements` T (a kept copy of an output block's panels: the AVX512-BF16
// kernel's rotated ones, the avx2 level's widened ones), kept for the next call.
template <typename T>
inline T* thread_scratch(int64_t elements) {
  thread_local std::vector<T> scratch;
  if (scratch.size() < static_cast<size_t>(elements)) scratch.resize(static_cast<size_t>(elements));
  return scratch.data();
}

// The avx2 level's most rows a register block. A bfloat16 product of kKeepWidenedRows rows or more widens each output
// block's panels once, into a float32 copy the row blocks after the first read (S::kKeepWidened,
// panel_linear_kernel.h), over output blocks of half the weight bytes (the copy then takes a float32 block's L2).
// Emulated AVX2 on a Zen 4 (bench_panel_linear --bf16 --isa avx2), against widening in every row block: 64-128
// rows 4-12% faster (the 256 x 256 projection 3% slower), 32 rows -7% to +7%, 8 rows (6 + 2) 18-31% slower.
constexpr int kAvx2Rows = 6;
// The avx512 level's most rows a register block, and the fewest rows whose float32 x it reads interleaved
// (Problem::xi). Its blocks were 8 x 2 vectors with a pointer a row: the 8 row pointers and the weight streams' spilled
// from the 16 general registers (stack reloads in the inner loop). 6 x 4 blocks split evenly (7 rows: 4 + 3) over
// interleaved x, Zen 4 (bench_panel_linear --isa avx512, A/B): 8-128 rows 5-9% faster on the MLP and head, 13-18% on
// a 4096 x 4096 weight at 8-16 rows; 1-4 rows (no copy) unchanged; bf16 panels (x as it is: interleaving measured
// 1-4% slower there) 3-6% faster from the blocks alone.
constexpr int kAvx512Rows = 6;
constexpr int64_t kInterleaveMinRows = 5;
constexpr int64_t kKeepWidenedRows = 48;
// the largest kept copy of an output block (bytes): blocks are ~kBlockBytes but at least kBlockPanels panels (the
// shipped target's 768-input down projection: a 393 KB float32 copy at avx2; a 4096-input weight's 8 panels 1 MB
// of bf16, still 6-8% faster at 64-128 rows with the copy than without it on a Zen 4 with 1 MB of L2)
constexpr int64_t kKeepMostBytes = 2 << 20;

inline float ScalarWiden(uint16_t h) {   // a bfloat16's float32 value (exact)
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Problem {
  const float* x;       // [rows, in] contiguous
  const uint16_t* xh;   // the same rows as bfloat16 (bfloat16 x over bfloat16 panels, dot-product path) or nullptr
  const uint32_t* xs;   // with xh: each row's pairs (x[2j], x[2j + 1]) as 32-bit lanes, halves swapped, by the
                        // kernel's blocks of rb rows (dot_block_rows): a block's pair j of its row r at j * rb + r
  const void* panels;   // [out / 16, in, 16] float32, or bfloat16 (bf16) [out / 16, ceil(in / 2), 16, 2]; panel p at
                        // panels + p * panel_stride elements
  const float* bias;    // [out] or nullptr
  float* y;             // [rows, out] contiguous (nullptr where the kernel writes yh instead)
  uint16_t* yh;         // the AMX and AVX512-BF16 kernels' output: [rows, out] bfloat16, sums plus bias rounded once
                        // (else nullptr)
  int64_t rows, in, out, panel_stride;
  bool bf16;
  int64_t ahead;        // software prefetch distance of the first row block, in cache lines; 0: no prefetches
  const float* xi;      // or nullptr: x interleaved by the register blocks of rows (float32 x over float32 panels at
                        // the avx512 level, kInterleaveMinRows rows or more): a block of rb rows from row r0 at
                        // xi + r0 * in, its row r's input i at i * rb + r (one pointer for every row's broadcasts)
  bool keep_widened;    // bf16 panels at the avx2 level, kKeepWidenedRows rows or more: widened once per output
                        // block (S::kKeepWidened; the op decides it once, as it sizes the output blocks by it)
};

// float32 -> bfloat16, round to nearest even, NaN -> 0x7FC0: c10::BFloat16's conversion (what at::to does), bit for
// bit, as integer operations (the portable loop; round_bf16 below picks explicit AVX-512 / AVX2 vectors of the same
// operations by level: the baseline build's loop took ~0.7 ns an element, ~100 us for a 96-row product's 147,456
// outputs, more than the product on AMX tiles).
inline void round_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    dst[i] = static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  }
}

// The next output block's panels asked into L2 by the row blocks after the first (NextBlock), from kNextMinRows
// rows on (and after a product's last block, the first block of the panels its caller multiplies next:
// follow_panels): on by default; TAPS_PANEL_NEXT=0 (read at load) or the op _set_panel_next turn it off. Why: at 16 rows
// (a draft tree's nodes) the first row block of each output block read its panels from memory and the next ones
// computed from L2 with memory idle, so reading and computing took their sum; on the shipped target's weights
// (read from memory in decoding) a prompt-lookup step's 16-node forward and verification ran 6% (bf16) and 11%
// (fp32) faster with it (bench/RESULTS.md). Hints only: the same bits.
std::atomic<bool> next_setting{[] {
  const char* env = std::getenv("TAPS_PANEL_NEXT");
  return env == nullptr || std::strcmp(env, "0") != 0;
}()};
inline bool next_enabled() { return next_setting.load(std::memory_order_relaxed); }

// The fewest rows whose later row blocks ask for the next output block: three row blocks at avx512 (6 + 5 + 5;
// two of 8 when it was set, still 4-13% faster at 16 rows with 6-row blocks: --cold, session 44), three at avx2
// (6). Measured with weights read from memory (bench_panel_linear.py --cold and a /tmp
// harness, Zen 4): 16-32 rows 5-22% faster on the shipped target's head and MLP at avx512 (bf16 dot products and
// float32), 4-12% at avx2 (float32); 12 rows at avx2 (two blocks of 6) ~18% slower on the head, 9-12 rows at avx512
// (a row block of 1-4 rows after the first) -8% to +14%: the rows after the first must compute long enough to
// hide the next block's reads.
constexpr int64_t kNextMinRows = 16;

// The next output block's panels asked into L2 a few lines per step of the work of the row blocks after the
// first (start(): the lines from `first` to `last` spread over `steps` calls of step()), so that its first row
// block reads L2 instead of waiting on memory.
struct NextBlock {
  const char* line = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;
  void start(const char* first, const char* last, int64_t steps) {
    line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(first) & ~uintptr_t{63});
    end = last;
    const int64_t lines = (end - line + 63) / 64;
    per_step = steps > 0 ? (lines + steps - 1) / steps : lines;
  }
  __attribute__((always_inline)) inline void step() {
    for (int64_t n = per_step; n > 0 && line < end; --n, line += 64) __builtin_prefetch(line, 0, kPrefetchLocality);
  }
};

// The NextBlock of a call of `rows` rows over `vectors` output vectors whose next output block is the bytes
// [first, last) (none below kNextMinRows rows or without a next block): its lines spread over the block() calls of
// the row blocks after the first (max_rows rows a block; vecs(rows of a block) vectors a call, as the kernels'
// row_block makes them, one vector at a time past the last whole group), `per_call` steps each. `block_rows`: the
// rows of the block after the first `done` (default: max_rows, the last fewer).
inline NextBlock next_block(const char* first, const char* last, int64_t rows, int64_t vectors, int64_t per_call,
                            int max_rows, int (*vecs)(int), int64_t (*block_rows)(int64_t, int64_t) = nullptr) {
  NextBlock nb;
  if (last <= first || rows < kNextMinRows) return nb;
  int64_t steps = 0;
  for (int64_t r = 0, rb = 0; r < rows; r += rb) {
    rb = block_rows != nullptr ? block_rows(rows, r) : std::min<int64_t>(max_rows, rows - r);
    if (r == 0) continue;  // (the first block asks nothing)
    const int64_t kv = vecs(static_cast<int>(rb));
    steps += (vectors / kv + vectors % kv) * per_call;
  }
  nb.start(first, last, steps);
  return nb;
}

// The weight this thread's next panel_linear call's caller multiplies after it (follow_panels): the first output
// block of its panels, which that call's last output block asks into L2 as it asks for its own next block (no
// block of a product asks for its first one). Taken, and cleared, by the next panel_linear call on the thread.
thread_local const char* follow_first = nullptr;
thread_local const char* follow_last = nullptr;

// Output blocks of about kBlockBytes of weight, in whole groups of kBlockPanels panels (every kernel configuration's
// vectors divide such a group: no output of a full group goes through the one-vector tail): panels per block.
inline int64_t block_panels(int64_t panel_bytes) {
  return std::max<int64_t>(1, kBlockBytes / (panel_bytes * kBlockPanels)) * kBlockPanels;
}

// Prefetches (see panel_linear_kernel.h's rows_times_block): kPrefetchLines lines ahead for weights of at
// least kPrefetchMinBytes (no L2 holds them between calls) whose panels are at least kPrefetchMinPanel bytes
// long (streams long enough to run ahead in). Measured on an Intel Xeon (bench/RESULTS.md): 10-25% faster at
// 4-16 rows (AVX-512 and AVX2, float32 and bfloat16) on a 0.5B model's layers (1280 x 1792 .. 3584 x 1280)
// read from memory; 3-14% slower at 1-4 rows on an 8192 x 256 head (16 KiB panels) and on weights that stay
// in L2, which the rule leaves out. The setting: -1 by that rule (default), 0 never, N > 0 always N lines;
// TAPS_PANEL_PREFETCH sets it at load, the op _set_panel_prefetch later.
constexpr int64_t kPrefetchLines = 24;
constexpr int64_t kPrefetchMinBytes = int64_t{4} << 20;
constexpr int64_t kPrefetchMinPanel = 32 * 1024;
std::atomic<int64_t> prefetch_setting{[] {
  const char* env = std::getenv("TAPS_PANEL_PREFETCH");
  return env != nullptr && *env != '\0' ? std::max<int64_t>(-1, std::atoll(env)) : int64_t{-1};
}()};

// bfloat16 x's dot-product kernel (avx512_bf16 below) on hosts that have it: TAPS_PANEL_DOT=0 (read at load)
// leaves it out, to compare against the float32 kernel over x widened (the same bits).
inline bool dot_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("TAPS_PANEL_DOT");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return on;
}

// bfloat16 x's AMX tile kernel (amx below) at the amx level: TAPS_PANEL_AMX=0 (read at load) leaves it out, to
// compare against the dot-product kernel.
inline bool amx_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("TAPS_PANEL_AMX");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return on;
}

}  // namespace panel_cpu

#if defined(TAPS_CPU_X86)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace panel_cpu::avx512 {
struct S {
  using F = __m512;
  static constexpr int L = 16;
  // rows x vectors of sums: 1-2 x 8, 3-6 x 4 (at most 24 of the 32 registers; see kAvx512Rows)
  static constexpr int kMaxRows = kAvx512Rows;
  static constexpr bool kEvenRows = true;  // rows in blocks as even as they go (7 rows: 4 + 3, not 6 + 1)
  static constexpr bool kInterleaveX = true;  // float32 x over float32 panels: Problem::xi (kInterleaveMinRows)
  static constexpr int vecs(int rows) { return rows <= 2 ? 8 : rows <= 6 ? 4 : 2; }
  static constexpr bool kPairsAtOnce = true;  // bf16 panels: a pair's two halves at once (measured faster here)
  static constexpr int kPairRows = 0;
  static constexpr bool kKeepWidened = false;  // (one load and two widenings a pair: about float32 panels' speed)
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  // 16 lanes of two bfloat16 each; a bfloat16 is the high half of a float's bits
  static F load_low(const uint16_t* p) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16)); }
  static F load_high(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F zero() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};
#include "cpu/panel_linear_kernel.h"
}  // namespace panel_cpu::avx512
#pragma GCC pop_options

// round_to_bf16 in 16 / 8 lanes: the same integer operations, so the same bits.
namespace panel_cpu {
// 16 floats rounded to bfloat16 into dst (round_to_bf16's operations)
TAPS_TARGET_AVX512 __attribute__((always_inline)) inline void round16_avx512(__m512 value, uint16_t* dst) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
}

TAPS_TARGET_AVX512 void round_to_bf16_avx512(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) round16_avx512(_mm512_loadu_ps(src + i), dst + i);
  round_to_bf16(src + i, dst + i, n - i);
}

TAPS_TARGET_AVX2_FMA void round_to_bf16_avx2(const float* src, uint16_t* dst, int64_t n) {
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF);
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
  const __m256i qnan = _mm256_set1_epi32(0x7FC0);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, half), lsb), 16);
    // |bits| as a signed 32-bit value is >= 0: a signed compare is the unsigned one here
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, abs_mask), inf);
    r = _mm256_blendv_epi8(r, qnan, nan);
    // 8 values <= 0xFFFF: pack to 16 bits in each 128-bit lane, then the lanes' low halves together
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
  }
  round_to_bf16(src + i, dst + i, n - i);
}
}  // namespace panel_cpu

// bfloat16 x over bfloat16 panels with AVX512-BF16's dot product. vdpbf16ps(acc, a, b) computes, per 32-bit lane,
// fma(a.lo, b.lo, fma(a.hi, b.hi, acc)) with denormals flushed (inputs and results below 2^-126 read and
// written as zero): measured bit for bit on an AMD EPYC Zen 4, the order Intel's manual gives. A panel lane
// holds (w[2j] low, w[2j + 1] high), so each weight vector has its halves swapped (vprold 16) and each row's
// pair (x[2j], x[2j + 1]) is broadcast swapped too (Problem::xs): then acc = fma(x[2j + 1], w[2j + 1],
// fma(x[2j], w[2j], acc)), the other levels' order on x widened, so the same bits wherever no input or sum is
// a float32 denormal, from twice the multiply-adds per instruction of the float32 kernels. Blocks of rows and
// vectors as the avx512 level's (S::vecs); an odd `in`'s last input by one fused multiply-add, last, as there.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace panel_cpu::avx512_bf16 {
struct S : avx512::S {
  static constexpr int kMaxRows = kDotRows;
  static constexpr int vecs(int rows) { return rows <= 2 ? 8 : rows <= 6 ? 4 : 2; }
};

// How a block reads its weight vectors. A panel lane holds (w[2j], w[2j + 1]) and the dot product wants them
// swapped: a rotation per vector loaded, an instruction on the ports of the dot products (Zen 4, 12 x 2 blocks: 2
// rotations a 24 dot products cost ~10%). A call of one row block rotates as it loads (kRotate); in a call of
// several, the first row block also stores the rotated vectors into a scratch copy of the output block's panels
// (kRotateKeep; the lines past the pairs, an odd `in`'s last, copied as they are) and the others read that copy
// (kKept): one rotation per weight vector instead of one per row block, the first block's loads still overlapped
// with its products (a separate copy pass waited on memory: the head 5-15% slower).
enum Read { kRotate, kRotateKeep, kKept };

// `panels`: the source (p.panels) or the kept copy; `v0` counts panels from it, and output vectors from `y0` (the
// output vector of panels[0]). `keep`: kRotateKeep's copy, laid out as `panels`.
template <int RB, int KV, bool PF, Read R>
inline void block(const uint32_t* xs, const uint16_t* x, int64_t ldx, const uint16_t* panels, uint16_t* keep,
                  int64_t stride, int64_t in, float* y, uint16_t* yh, int64_t ldy, const float* bias, int64_t v0,
                  int64_t y0, int64_t shift, NextBlock& nb) {
  const int64_t pairs = in / 2;
  const uint16_t* w[KV];
#pragma GCC unroll 16
  for (int v = 0; v < KV; ++v) w[v] = panels + (v0 + v) * stride;   // one 16-lane vector = one panel
  __m512 acc[RB][KV];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < KV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    nb.step();
    __m512i b[KV];
#pragma GCC unroll 16
    for (int v = 0; v < KV; ++v) {
      if constexpr (PF) __builtin_prefetch(w[v] + j * 2 * kPanelWidth + shift, 0, kPrefetchLocality);
      const __m512i line = _mm512_loadu_si512(w[v] + j * 2 * kPanelWidth);
      b[v] = R == kKept ? line : _mm512_rol_epi32(line, 16);
      if constexpr (R == kRotateKeep) _mm512_storeu_si512(keep + (v0 + v) * stride + j * 2 * kPanelWidth, b[v]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xs[j * RB + r]));
#pragma GCC unroll 16
      for (int v = 0; v < KV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, (__m512bh)b[v]);
    }
  }
  if constexpr (R == kRotateKeep) {
    const int64_t tail = stride - pairs * 2 * kPanelWidth;
    if (tail > 0)
      for (int v = 0; v < KV; ++v)
        std::memcpy(keep + (v0 + v) * stride + pairs * 2 * kPanelWidth, w[v] + pairs * 2 * kPanelWidth,
                    static_cast<size_t>(tail) * sizeof(uint16_t));
  }
  if (in % 2 != 0) {
    __m512 lo[KV];
#pragma GCC unroll 16
    for (int v = 0; v < KV; ++v) lo[v] = S::load_low(w[v] + pairs * 2 * kPanelWidth);
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      const __m512 a = _mm512_set1_ps(ScalarWiden(x[r * ldx + in - 1]));
#pragma GCC unroll 16
      for (int v = 0; v < KV; ++v) acc[r][v] = _mm512_fmadd_ps(a, lo[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < KV; ++v) {
      __m512 out = acc[r][v];
      const int64_t o = (y0 + v0 + v) * kPanelWidth;
      if (bias != nullptr) out = _mm512_add_ps(out, _mm512_loadu_ps(bias + o));
      if (yh != nullptr)  // (the bfloat16 result rounded here: round_to_bf16's operations, no float32 pass after)
        round16_avx512(out, yh + r * ldy + o);
      else
        _mm512_storeu_ps(y + r * ldy + o, out);
    }
}

// Rows [r, r + RB) times the panels [v_lo, v_hi) (counted from `panels`, whose first is output vector y0).
template <int RB, bool PF, Read R>
inline void row_block(const Problem& p, const uint16_t* panels, uint16_t* keep, int64_t y0, int64_t r, int64_t v_lo,
                      int64_t v_hi, int64_t shift, NextBlock& nb) {
  constexpr int KV = S::vecs(RB);
  const uint32_t* xs = p.xs + r * (p.in / 2);
  const uint16_t* x = p.xh + r * p.in;
  float* y = p.y == nullptr ? nullptr : p.y + r * p.out;
  uint16_t* yh = p.yh == nullptr ? nullptr : p.yh + r * p.out;
  const int64_t st = p.panel_stride;
  int64_t v = v_lo;
  for (; v + KV <= v_hi; v += KV)
    block<RB, KV, PF, R>(xs, x, p.in, panels, keep, st, p.in, y, yh, p.out, p.bias, v, y0, shift, nb);
  for (; v < v_hi; ++v)
    block<RB, 1, PF, R>(xs, x, p.in, panels, keep, st, p.in, y, yh, p.out, p.bias, v, y0, shift, nb);
}

// Rows [r, r + RB) times the panels [panel_lo, panel_hi): from the source (`kept` null: one row block, or the
// first of several, which fills `keep`), or from the kept copy `kept` of those panels.
template <int RB>
inline void rows_block(const Problem& p, uint16_t* keep, const uint16_t* kept, int64_t panel_lo, int64_t panel_hi,
                       int64_t r, int64_t shift, NextBlock& nb) {
  const auto* source = static_cast<const uint16_t*>(p.panels) + panel_lo * p.panel_stride;
  const int64_t n = panel_hi - panel_lo;
  if (kept != nullptr) return row_block<RB, false, kKept>(p, kept, nullptr, panel_lo, r, 0, n, 0, nb);
  if (keep != nullptr) {
    if (shift > 0) return row_block<RB, true, kRotateKeep>(p, source, keep, panel_lo, r, 0, n, shift, nb);
    return row_block<RB, false, kRotateKeep>(p, source, keep, panel_lo, r, 0, n, 0, nb);
  }
  if (shift > 0) return row_block<RB, true, kRotate>(p, source, nullptr, panel_lo, r, 0, n, shift, nb);
  row_block<RB, false, kRotate>(p, source, nullptr, panel_lo, r, 0, n, 0, nb);
}

// Every row of x times the panels [panel_lo, panel_hi), as the other levels' rows_times_block (the row blocks
// after the first ask the bytes [next_first, next_last), the next output block's, into L2).
inline void run(const Problem& p, int64_t panel_lo, int64_t panel_hi, const char* next_first, const char* next_last) {
  constexpr int64_t kLine = 32;  // bfloat16 elements of a cache line
  NextBlock none, nb = next_block(next_first, next_last, p.rows, panel_hi - panel_lo, p.in / 2, S::kMaxRows,
                                  &S::vecs, &dot_block_rows);  // (a vector is a panel here)
  // more than one row block: the first keeps the rotated panels, the others read them (Read); not for an output
  // block of more than kKeepMostBytes (a long `in`: 8 panels of 11008 inputs are 2.8 MB, in every thread)
  const int64_t kept_elements = (panel_hi - panel_lo) * p.panel_stride;
  uint16_t* keep = p.rows > S::kMaxRows && kept_elements * 2 <= kKeepMostBytes
                       ? thread_scratch<uint16_t>(kept_elements) : nullptr;
  for (int64_t r = 0; r < p.rows;) {
    const int64_t rb = dot_block_rows(p.rows, r);
    const int64_t shift = r == 0 ? p.ahead * kLine : 0;
    NextBlock& f = r == 0 ? none : nb;
    uint16_t* fill = r == 0 ? keep : nullptr;
    const uint16_t* kept = r == 0 ? nullptr : keep;
    switch (rb) {
      case 1: rows_block<1>(p, fill, kept, panel_lo, panel_hi, r, shift, f); break;
      case 2: rows_block<2>(p, fill, kept, panel_lo, panel_hi, r, shift, f); break;
      case 3: rows_block<3>(p, fill, kept, panel_lo, panel_hi, r, shift, f); break;
      case 4: rows_block<4>(p, fill, kept, panel_lo, panel_hi, r, shift, f); break;
      case 5: rows_block<5>(p, fill, kept, panel_lo, panel_hi, r, shift, f); break;
      case 6: rows_block<6>(p, fill, kept, panel_lo, panel_hi, r, shift, f); break;
      case 7: rows_block<7>(p, fill, kept, panel_lo, panel_hi, r, shift, f); break;
      case 8: rows_block<8>(p, fill, kept, panel_lo, panel_hi, r, shift, f); break;
      case 9: rows_block<9>(p, fill, kept, panel_lo, panel_hi, r, shift, f); break;
      case 10: rows_block<10>(p, fill, kept, panel_lo, panel_hi, r, shift, f); break;
      case 11: rows_block<11>(p, fill, kept, panel_lo, panel_hi, r, shift, f); break;
      default: rows_block<12>(p, fill, kept, panel_lo, panel_hi, r, shift, f); break;
    }
    r += rb;
  }
}
}  // namespace panel_cpu::avx512_bf16
#pragma GCC pop_options

// bfloat16 x over bfloat16 panels on AMX tiles (the amx level, `in` a multiple of 32). A bfloat16 panel is already
// AMX's B-tile layout: each 64-byte line holds one input pair for its 16 outputs, so 16 consecutive lines (1 KiB,
// inputs 32s .. 32s + 31) are one B tile, loaded with a 64-byte stride; x's rows (up to 16) at those inputs are the A
// tile, and C holds the rows' 16 float32 sums of one panel. Two panels a step share the A tile, each with its own B
// tile (tiles: C 0-1, A 2, B 3-4): measured on an AMX Xeon with the weights read from L3, four panels a step over
// three B tiles (one reloaded within the step, after the product that reads it) took 5-15% longer at one row, two
// as long as the AVX512-BF16 dot products (bench/RESULTS.md). tdpbf16ps has its own order and rounding within each
// 32-input step (measured on a Sapphire Rapids-class Xeon: not one fused multiply-add per term), so these sums
// differ from the other levels' in the last bits; each row's still depends on that row alone (not on the row count,
// the row's position or the threads), so a draft tree's products at this level give a plain step's bits. Work per B
// tile: 16 x 32 x rows multiply-adds for 1 KiB of weight: bound by reading the weight at any row count up to 16.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,amx-tile,amx-bf16")
namespace panel_cpu::amx {

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void configure(int rows) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 3; ++t) c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = 64;   // C 0-1, A 2
  for (int t = 3; t < 5; ++t) c.rows[t] = 16, c.colsb[t] = 64;                           // B 3-4
  _tile_loadconfig(&c);
}

// NP (1-2) panels from w (panel stride `stride` elements) times the A rows of x (stride ldx bytes), `steps` steps of
// 32 inputs; the sums stored into y (stride ldy bytes), panel j at y + 16 j.
template <int NP>
inline void panels(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t stride, int64_t steps, float* y,
                   int64_t ldy) {
  constexpr int64_t kStep = 16 * 2 * kPanelWidth;   // elements of a B tile: 16 pairs of 16 outputs
  _tile_zero(0);
  if constexpr (NP > 1) _tile_zero(1);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(2, x + s * 32, ldx);
    _tile_loadd(3, w + s * kStep, 64);
    if constexpr (NP > 1) _tile_loadd(4, w + stride + s * kStep, 64);
    _tile_dpbf16ps(0, 2, 3);
    if constexpr (NP > 1) _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, y, ldy);
  if constexpr (NP > 1) _tile_stored(1, y + kPanelWidth, ldy);
}

// The C tiles' sums (`rows` rows of NP panels in scratch, row stride kScratch floats) plus the bias, rounded to
// bfloat16 into the output rows (stride `out`) at column `col`: the bits of the float32 output's y += bias and the
// rounding pass after it (round16_avx512), with no float32 [rows, out] between (at 32 rows of the shipped head a 1 MiB
// buffer had been written, then read back and rounded: the product took 350 us with it, ~300 without, bench/RESULTS.md).
constexpr int64_t kScratch = 2 * kPanelWidth;
template <int NP>
inline void round_out(const float* scratch, int rows, const float* bias, int64_t col, uint16_t* yh, int64_t out) {
  __m512 b[NP];
  for (int j = 0; j < NP; ++j) b[j] = bias != nullptr ? _mm512_loadu_ps(bias + col + j * kPanelWidth) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < NP; ++j) {
      const __m512 sum = _mm512_load_ps(scratch + r * kScratch + j * kPanelWidth);
      // (no bias: the sums as they are; adding zeros would turn a -0 sum into +0)
      round16_avx512(bias != nullptr ? _mm512_add_ps(sum, b[j]) : sum, yh + r * out + col + j * kPanelWidth);
    }
}

// Two row blocks at once (17-32 rows): each B tile multiplied into both, half the weight loads a product. Tiles: C
// 0-1 (first block's rows, `first`), C 2-3 (the second's, `second`), A 4 / 5, B 6-7.
inline void configure_two(int first, int second) {
  TileConfig c{};
  c.palette = 1;
  for (int t : {0, 1, 4}) c.rows[t] = static_cast<uint8_t>(first), c.colsb[t] = 64;
  for (int t : {2, 3, 5}) c.rows[t] = static_cast<uint8_t>(second), c.colsb[t] = 64;
  for (int t = 6; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

template <int NP>
inline void panels_two(const uint16_t* x, const uint16_t* x2, int64_t ldx, const uint16_t* w, int64_t stride,
                       int64_t steps, float* y, float* y2, int64_t ldy) {
  constexpr int64_t kStep = 16 * 2 * kPanelWidth;
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (NP > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, x + s * 32, ldx);
    _tile_loadd(5, x2 + s * 32, ldx);
    _tile_loadd(6, w + s * kStep, 64);
    if constexpr (NP > 1) _tile_loadd(7, w + stride + s * kStep, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (NP > 1) {
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, y, ldy);
  _tile_stored(2, y2, ldy);
  if constexpr (NP > 1) {
    _tile_stored(1, y + kPanelWidth, ldy);
    _tile_stored(3, y2 + kPanelWidth, ldy);
  }
}

// Every row of x times the panels [panel_lo, panel_hi): rows in pairs of blocks of 16 while more than 16 remain, then
// a block of up to 16 (a tile configuration per shape of block), two panels at a time; then the bias.
inline void run(const Problem& p, int64_t panel_lo, int64_t panel_hi) {
  const auto* w = static_cast<const uint16_t*>(p.panels);
  const int64_t steps = p.in / 32;
  const int64_t ldx = p.in * 2, lds = kScratch * 4;
  alignas(64) float scratch[32 * kScratch];   // the C tiles of up to 32 rows x 2 panels (4 KiB)
  float* const s2 = scratch + 16 * kScratch;
  int configured = 0;   // rows of the configured blocks: first + 32 * second (0: none yet)
  for (int64_t r = 0; r < p.rows;) {
    const int rb = static_cast<int>(std::min<int64_t>(16, p.rows - r));
    const int rb2 = static_cast<int>(std::min<int64_t>(16, p.rows - r - rb));
    const uint16_t* x = p.xh + r * p.in;
    uint16_t* yh = p.yh + r * p.out;
    int64_t v = panel_lo;
    if (rb2 > 0) {
      if (configured != rb + 32 * rb2) configure_two(rb, rb2), configured = rb + 32 * rb2;
      const uint16_t* x2 = x + 16 * p.in;
      uint16_t* yh2 = yh + 16 * p.out;
      for (; v + 2 <= panel_hi; v += 2) {
        panels_two<2>(x, x2, ldx, w + v * p.panel_stride, p.panel_stride, steps, scratch, s2, lds);
        round_out<2>(scratch, rb, p.bias, v * kPanelWidth, yh, p.out);
        round_out<2>(s2, rb2, p.bias, v * kPanelWidth, yh2, p.out);
      }
      if (v < panel_hi) {
        panels_two<1>(x, x2, ldx, w + v * p.panel_stride, p.panel_stride, steps, scratch, s2, lds);
        round_out<1>(scratch, rb, p.bias, v * kPanelWidth, yh, p.out);
        round_out<1>(s2, rb2, p.bias, v * kPanelWidth, yh2, p.out);
      }
    } else {
      if (configured != rb) configure(rb), configured = rb;
      for (; v + 2 <= panel_hi; v += 2) {
        panels<2>(x, ldx, w + v * p.panel_stride, p.panel_stride, steps, scratch, lds);
        round_out<2>(scratch, rb, p.bias, v * kPanelWidth, yh, p.out);
      }
      if (v < panel_hi) {
        panels<1>(x, ldx, w + v * p.panel_stride, p.panel_stride, steps, scratch, lds);
        round_out<1>(scratch, rb, p.bias, v * kPanelWidth, yh, p.out);
      }
    }
    r += rb + rb2;
  }
  _tile_release();
}
}  // namespace panel_cpu::amx
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace panel_cpu::avx2 {
struct S {
  using F = __m256;
  static constexpr int L = 8;
  // rows x vectors of sums: 1 x 8, 2-3 x 4, 4-6 x 2 (at most 12 of the 16 registers)
  static constexpr int kMaxRows = kAvx2Rows;
  static constexpr bool kEvenRows = false;
  static constexpr bool kInterleaveX = false;
  static constexpr int vecs(int rows) { return rows == 1 ? 8 : rows <= 3 ? 4 : 2; }
  static constexpr bool kPairsAtOnce = false;  // 16 registers: one half at a time keeps float32's register count
  // bf16 panels, blocks of 1-3 rows: a pair's lanes loaded once, both halves multiplied in at once (1 row: 8 sums,
  // 2 broadcasts, 3 temporaries; 2 rows: 8 + 4 + 3; 3 rows: 12 + 6 + 3, a few spilled). Measured (emulated AVX2
  // on a Zen 4, bench_panel_linear --bf16-x), against the loop that loads each half on its own: the shipped
  // target's products 28-36% faster at one row, 20-30% at two, 20-30% at three; at 4-6 rows (2 vectors of sums)
  // 1.5-1.9x slower (the rows' 8-12 broadcasts spill), so those blocks keep that loop
  static constexpr int kPairRows = 3;
  // bf16 panels, more than kMaxRows rows: the first row block keeps the widened panels, the others read them as
  // float32 panels (their blocks of 4-6 rows load each line twice and widen it twice: 5-15% slower than float32
  // panels at 64-128 rows, emulated AVX2 on a Zen 4)
  static constexpr bool kKeepWidened = true;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  // 8 lanes of two bfloat16 each
  static F load_low(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 16));
  }
  static F load_high(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                                _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F zero() { return _mm256_setzero_ps(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
};
#include "cpu/panel_linear_kernel.h"
}  // namespace panel_cpu::avx2
#pragma GCC pop_options
#endif  // TAPS_CPU_X86

// The portable level: one float per "vector", fmaf (a single rounding, as the vector levels' fused
// multiply-adds), so its bits are theirs. Compiled twice: for the x86-64 baseline (`generic`: fmaf is a
// call into libm, 0.4 GFLOP/s measured, software on a CPU without FMA) and, on x86, with FMA enabled
// (`generic_fma`: the same code with fmaf one instruction), which the level `scalar` runs on a host whose
// level is avx2 or above (AVX2 + FMA; forced scalar there: 7-14x faster measured on an AMD EPYC Zen 3, the
// same bits).
namespace panel_cpu {
struct ScalarS {
  using F = float;
  static constexpr int L = 1;
  static constexpr int kMaxRows = 4;
  static constexpr bool kEvenRows = false;
  static constexpr bool kInterleaveX = false;
  static constexpr int vecs(int rows) { return rows <= 2 ? 8 : 4; }
  static constexpr bool kPairsAtOnce = false;
  static constexpr int kPairRows = 0;
  static constexpr bool kKeepWidened = false;
  static F load(const float* p) { return *p; }
  static F load_low(const uint16_t* p) { return widen(p[0]); }   // the lane's low half: the first bfloat16
  static F load_high(const uint16_t* p) { return widen(p[1]); }
  static F widen(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  static void store(float* p, F x) { *p = x; }
  static F set1(float x) { return x; }
  static F zero() { return 0.0f; }
  static F add(F a, F b) { return a + b; }
  // inlined into the caller's target region: one instruction in generic_fma
  __attribute__((always_inline)) static F fmadd(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
};
}  // namespace panel_cpu

namespace panel_cpu::generic {
using S = ScalarS;
#include "cpu/panel_linear_kernel.h"
}  // namespace panel_cpu::generic

#if defined(TAPS_CPU_X86)
#pragma GCC push_options
#pragma GCC target("fma")
namespace panel_cpu::generic_fma {
using S = ScalarS;
#include "cpu/panel_linear_kernel.h"
}  // namespace panel_cpu::generic_fma
#pragma GCC pop_options
#endif

namespace panel_cpu {
// round_to_bf16 at the level in force (the same bits at every level)
inline void round_bf16(const float* src, uint16_t* dst, int64_t n) {
#if defined(TAPS_CPU_X86)
  if (cpu::at_least(cpu::Isa::kAvx512)) return round_to_bf16_avx512(src, dst, n);
  if (cpu::at_least(cpu::Isa::kAvx2)) return round_to_bf16_avx2(src, dst, n);
#endif
  round_to_bf16(src, dst, n);
}
}  // namespace panel_cpu

namespace {

at::Tensor panel_linear_cpu(const at::Tensor& x_in, const at::Tensor& panels, const std::optional<at::Tensor>& bias) {
  // this call's follow hint (follow_panels), taken whatever happens below
  const char* const follow_first = panel_cpu::follow_first;
  const char* const follow_last = panel_cpu::follow_last;
  panel_cpu::follow_first = panel_cpu::follow_last = nullptr;
  TORCH_CHECK_VALUE(x_in.defined() && panels.defined(), "taps_ops: panel_linear: x and panels must be defined");
  const bool bf16 = panels.scalar_type() == at::kBFloat16;
  const bool half_x = x_in.defined() && x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE((panels.scalar_type() == at::kFloat || bf16) &&
                        (x_in.scalar_type() == at::kFloat || (half_x && bf16)),
                    "taps_ops: panel_linear: x must be float32 (or bfloat16 over bfloat16 panels) and panels float32 "
                    "or bfloat16, got x ", x_in.scalar_type(), " and panels ", panels.scalar_type());
  TORCH_CHECK_VALUE(panels.device().is_cpu() && !panels.is_mkldnn(),
                    "taps_ops: panel_linear: panels must be a dense CPU tensor, got ", panels.device());
  check_same_device(panels, x_in, "panels", "panel_linear: x");
  TORCH_CHECK_VALUE(x_in.dim() >= 1, "taps_ops: panel_linear: x [..., in] must have at least 1 dimension, got a scalar");
  int64_t in = 0;
  if (!bf16) {
    TORCH_CHECK_VALUE(panels.dim() == 3 && panels.size(2) == panel_cpu::kPanelWidth,
                      "taps_ops: panel_linear: float32 panels must be [out / 16, in, 16] (taps_ops.pack_panels), got "
                      "shape ", panels.sizes());
    TORCH_CHECK_VALUE(panels.stride(2) == 1 && panels.stride(1) == panel_cpu::kPanelWidth &&
                          panels.stride(0) >= panels.size(1) * panel_cpu::kPanelWidth,
                      "taps_ops: panel_linear: panels must have strides (>= in * 16, 16, 1) (taps_ops.pack_panels), "
                      "got ", panels.strides());
    in = panels.size(1);
    TORCH_CHECK_VALUE(x_in.size(-1) == in, "taps_ops: panel_linear: x's last dimension must be in = ", in,
                      " (panels [out / 16, in, 16] of shape ", panels.sizes(), "), got x of shape ", x_in.sizes());
  } else {
    TORCH_CHECK_VALUE(panels.dim() == 4 && panels.size(2) == panel_cpu::kPanelWidth && panels.size(3) == 2,
                      "taps_ops: panel_linear: bfloat16 panels must be [out / 16, ceil(in / 2), 16, 2] "
                      "(taps_ops.pack_panels), got shape ", panels.sizes());
    TORCH_CHECK_VALUE(panels.stride(3) == 1 && panels.stride(2) == 2 && panels.stride(1) == 2 * panel_cpu::kPanelWidth &&
                          panels.stride(0) >= panels.size(1) * 2 * panel_cpu::kPanelWidth,
                      "taps_ops: panel_linear: bfloat16 panels must have strides (>= ceil(in / 2) * 32, 32, 2, 1) "
                      "(taps_ops.pack_panels), got ", panels.strides());
    in = x_in.size(-1);
    TORCH_CHECK_VALUE((in + 1) / 2 == panels.size(1), "taps_ops: panel_linear: x's last dimension must be in with "
                      "ceil(in / 2) = ", panels.size(1), " (bfloat16 panels of shape ", panels.sizes(),
                      "), got x of shape ", x_in.sizes());
  }
  const int64_t out = panels.size(0) * panel_cpu::kPanelWidth;
  const float* bias_ptr = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat, "taps_ops: panel_linear: bias must be float32, got ",
                      bias->scalar_type());
    check_same_device(panels, *bias, "panels", "panel_linear: bias");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == out, "taps_ops: panel_linear: bias must be [out] = [", out,
                      "], got shape ", bias->sizes());
    b = bias->contiguous();
    bias_ptr = b.data_ptr<float>();
  }
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = out;
  // float32 sums; bfloat16 x gets them rounded to bfloat16 once, at the end, by round_to_bf16 (at::to's rounding,
  // bit for bit, without its dispatch: ~1 us a small product), from this thread's scratch buffer where they fit in
  // kScratchKeep floats (a decoding step's products; a larger one, a long prefill's, gets a temporary: a buffer
  // kept at its size would hold that memory for good)
  constexpr int64_t kScratchKeep = int64_t{1} << 20;
  int64_t total = 1;
  for (const int64_t d : shape) total *= d;
  thread_local std::vector<float> scratch;
  const cpu::Isa level = cpu::isa();
  // bfloat16 x: AVX512-BF16's dot products where the level and the host allow, else x widened (the same bits)
  // (at the amx level, `in` a multiple of 32: AMX tiles, the same x, which write the bfloat16 result themselves,
  // panel_cpu::amx::round_out: no float32 sums to hold)
  const bool tiles = half_x && in > 0 && in % 32 == 0 && level == cpu::Isa::kAmx && panel_cpu::amx_enabled() &&
                     cpu::amx_tiles_ready();
  // (the dot products round each sum into the bfloat16 result as they store it, avx512_bf16::block: no float32 sums
  // to hold either)
  const bool dot = !tiles && half_x && in > 0 && panel_cpu::dot_enabled() &&
                   static_cast<int>(level) >= static_cast<int>(cpu::Isa::kAvx512) && cpu::host_avx512_bf16();
  const bool direct = tiles || dot;  // the kernel writes the bfloat16 result itself (Problem::yh)
  at::Tensor y, h;
  if (direct) {
    h = at::empty(shape, x_in.options().dtype(at::kBFloat16).memory_format(at::MemoryFormat::Contiguous));
  } else if (half_x && total <= kScratchKeep) {
    if (static_cast<int64_t>(scratch.size()) < std::max<int64_t>(total, 1)) scratch.resize(static_cast<size_t>(std::max<int64_t>(total, 1)));
    y = at::from_blob(scratch.data(), shape, at::TensorOptions().dtype(at::kFloat));
  } else {
    y = at::empty(shape, x_in.options().dtype(at::kFloat).memory_format(at::MemoryFormat::Contiguous));
  }
  const auto result = [&] {
    if (direct) return h;
    if (!half_x) return y;
    at::Tensor rounded = at::empty(shape, x_in.options().dtype(at::kBFloat16).memory_format(at::MemoryFormat::Contiguous));
    panel_cpu::round_bf16(y.data_ptr<float>(), reinterpret_cast<uint16_t*>(rounded.data_ptr<at::BFloat16>()), y.numel());
    return rounded;
  };
  const int64_t rows = in > 0 ? x_in.numel() / in : y.numel() / std::max<int64_t>(out, 1);  // (in == 0: no tiles)
  if (rows == 0 || out == 0) return result();
  if (in == 0) {  // empty sums
    if (bias_ptr != nullptr) y.copy_(b.expand_as(y)); else y.zero_();
    return result();
  }
  const bool keep_half = dot || tiles;  // x read as bfloat16 (else widened to float32 here)
  const at::Tensor x = half_x && !keep_half ? x_in.to(at::kFloat, /*non_blocking=*/false, /*copy=*/false,
                                                      at::MemoryFormat::Contiguous)
                                            : x_in.contiguous();
  const int64_t num_panels = panels.size(0);
  const int64_t element = bf16 ? 2 : 4;
  const int64_t setting = panel_cpu::prefetch_setting.load(std::memory_order_relaxed);
  const bool streams = num_panels * panels.stride(0) * element >= panel_cpu::kPrefetchMinBytes &&
                       in * panel_cpu::kPanelWidth * element >= panel_cpu::kPrefetchMinPanel;
  const int64_t ahead = setting >= 0 ? setting : streams ? panel_cpu::kPrefetchLines : 0;
  // the dot-product kernel's x: each row's pairs as 32-bit lanes with the halves swapped (see avx512_bf16 above)
  std::vector<uint32_t> swapped;
  const uint16_t* xh = keep_half ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  if (dot) {
    const int64_t pairs = in / 2;
    swapped.resize(static_cast<size_t>(rows * pairs));
    for (int64_t r0 = 0, rb = 0; r0 < rows; r0 += rb) {
      rb = panel_cpu::dot_block_rows(rows, r0);
      for (int64_t r = r0; r < r0 + rb; ++r)
        for (int64_t j = 0; j < pairs; ++j)
          swapped[r0 * pairs + j * rb + (r - r0)] =
              static_cast<uint32_t>(xh[r * in + 2 * j + 1]) | (static_cast<uint32_t>(xh[r * in + 2 * j]) << 16);
    }
  }
  // float32 x over float32 panels at the avx512 level: x interleaved by its register blocks (Problem::xi), in this
  // thread's scratch up to kScratchKeep floats (a larger x, a long prefill's, in a temporary)
  thread_local std::vector<float> interleaved_scratch;
  std::vector<float> interleaved_large;
  float* interleaved = nullptr;
#if defined(TAPS_CPU_X86)
  if (!bf16 && !half_x && static_cast<int>(level) >= static_cast<int>(cpu::Isa::kAvx512) &&
      rows >= panel_cpu::kInterleaveMinRows) {
    std::vector<float>& buffer = rows * in <= kScratchKeep ? interleaved_scratch : interleaved_large;
    if (static_cast<int64_t>(buffer.size()) < rows * in) buffer.resize(static_cast<size_t>(rows * in));
    interleaved = buffer.data();
    panel_cpu::avx512::panel::interleave_x(x.data_ptr<float>(), rows, in, interleaved);
  }
#endif
  // (the avx2 level's bfloat16 products of kKeepWidenedRows rows or more keep a float32 copy of each output block's
  // panels: blocks of half the bytes, so that the copy takes a float32 block's L2)
  const bool keeps_widened = bf16 && !dot && !tiles && level == cpu::Isa::kAvx2 && rows >= panel_cpu::kKeepWidenedRows;
  const panel_cpu::Problem p{keep_half ? nullptr : x.data_ptr<float>(), xh, dot ? swapped.data() : nullptr,
                            panels.data_ptr(), bias_ptr, direct ? nullptr : y.data_ptr<float>(),
                            direct ? reinterpret_cast<uint16_t*>(h.data_ptr<at::BFloat16>()) : nullptr, rows, in, out,
                            panels.stride(0), bf16, ahead, interleaved, keeps_widened};
  const int64_t panel_bytes = panels.stride(0) * element;
  const int64_t block = panel_cpu::block_panels(keeps_widened ? 2 * panel_bytes : panel_bytes);
  const int64_t blocks = (num_panels + block - 1) / block;
  const char* const base = static_cast<const char*>(panels.data_ptr());
  const bool ask_next = panel_cpu::next_enabled();  // (one setting for the whole call)
  [[maybe_unused]] const bool host_fma = static_cast<int>(cpu::host_isa()) >= static_cast<int>(cpu::Isa::kAvx2);
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t blk = lo; blk < hi; ++blk) {
      const int64_t p_lo = blk * block, p_hi = std::min(num_panels, p_lo + block);
      // the bytes its row blocks after the first ask into L2: the next output block of this thread's, or after
      // the product's last block the first of the weight the caller multiplies next (follow_panels); none off
      const char* next_first = nullptr;
      const char* next_last = nullptr;
      if (ask_next && blk + 1 < hi) {
        next_first = base + p_hi * panel_bytes;
        next_last = base + std::min(num_panels, p_hi + block) * panel_bytes;
      } else if (ask_next && blk + 1 == blocks) {
        next_first = follow_first, next_last = follow_last;
      }
#if defined(TAPS_CPU_X86)
      if (tiles) {
        panel_cpu::amx::run(p, p_lo, p_hi);
        continue;
      }
      if (dot) {
        panel_cpu::avx512_bf16::run(p, p_lo, p_hi, next_first, next_last);
        continue;
      }
      if (static_cast<int>(level) >= static_cast<int>(cpu::Isa::kAvx512)) {
        panel_cpu::avx512::panel::run(p, p_lo, p_hi, next_first, next_last);
        continue;
      }
      if (level == cpu::Isa::kAvx2) {
        panel_cpu::avx2::panel::run(p, p_lo, p_hi, next_first, next_last);
        continue;
      }
      if (host_fma) {
        panel_cpu::generic_fma::panel::run(p, p_lo, p_hi, next_first, next_last);
        continue;
      }
#endif
      panel_cpu::generic::panel::run(p, p_lo, p_hi, next_first, next_last);
    }
  });
  return result();
}

}  // namespace

TORCH_LIBRARY_IMPL(taps_ops, CPU, m) { m.impl("panel_linear", &panel_linear_cpu); }

// panel_linear without a bias, for the CPU ops built on it (head_argmax's exact rows)
at::Tensor panel_linear_call(const at::Tensor& x, const at::Tensor& panels) {
  return panel_linear_cpu(x, panels, std::nullopt);
}

bool set_panel_next_op(bool on) { return panel_cpu::next_setting.exchange(on); }

void follow_panels(const at::Tensor& panels) {
  if (!panels.defined() || panels.device().type() != c10::DeviceType::CPU || panels.dim() < 3 || panels.size(0) < 1) {
    panel_cpu::follow_first = panel_cpu::follow_last = nullptr;
    return;
  }
  const int64_t panel_bytes = panels.stride(0) * static_cast<int64_t>(panels.element_size());
  const char* first = static_cast<const char*>(panels.data_ptr());
  panel_cpu::follow_first = first;
  panel_cpu::follow_last = first + std::min(panels.size(0), panel_cpu::block_panels(panel_bytes)) * panel_bytes;
}

int64_t set_panel_prefetch_op(int64_t lines) {
  TORCH_CHECK_VALUE(lines >= -1, "taps_ops: _set_panel_prefetch: lines must be -1 (by the weight's size), 0 (never) "
                    "or a distance in cache lines > 0, got ", lines);
  return panel_cpu::prefetch_setting.exchange(lines);
}

}  // namespace taps
