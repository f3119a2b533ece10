// Weight-only quantized matmul on the CPU: y[M, N] = x[M, K] @ W[N, K]^T with W kept as a GGUF
// file stores it. A plain shared library (no torch headers: it compiles in seconds), built at
// first use by engine/native_build.py and called through ctypes by engine/model/quant.py.
//
// Formats (ggml's; 32 weights per block; the K/32 blocks of one output row are contiguous):
//   Q4_1 (20 bytes): f16 d, f16 m, 16 bytes qs; weight j = d * q_j + m with q_j = qs[j] & 15 for
//                    j < 16 and qs[j - 16] >> 4 for j >= 16.
//   Q8_0 (34 bytes): f16 d, 32 int8 q; weight j = d * q_j.
// Two paths, both with float32 sums and the file's weights (never a rounded copy):
//  - float32: every weight is dequantised to float32 as one fma (d * q + m with d * q exact, so
//    rounded once: the value the `gguf` package computes) and multiplied with float32 activations
//    (bfloat16 ones widened once per call, exactly). Used for Q8_0, for float32 x, and everywhere
//    in the AVX-512 build without bf16, the AVX2 build (AVX2 + FMA + F16C: a block as four
//    8-wide quarters; up to 4 rows in one pass over a feature's blocks, see feature_avx2; more
//    rows against features dequantised once into a per-thread buffer, see tile_buffered) and the
//    portable build (plain C++).
//  - bf16 dot (Q4_1 with bfloat16 x, AVX512_BF16): d * sum(x q) + m * sum(x), the 32 products
//    x q formed exactly by vdpbf16ps (see q4_1_feature_bf16).
//
// Work split: OpenMP over tiles of ROW_TILE output features (static schedule: every tile costs the
// same). One thread owns its features for every row of x and walks each feature's blocks in memory
// order (one sequential stream); a weight block is read once and used for up to M_TILE activation
// rows held in registers. M > M_TILE re-reads the weights once per group of M_TILE rows (AVX-512
// and portable paths; the caller keeps M small: engine/model/quant.py's crossover). AVX2: up to
// AVX2_ROWS rows, one pass over a feature's blocks; more rows, every row of x meets each pair of
// features from the thread's buffer of their dequantised weights (2 x K floats, in L1), so each
// weight is dequantised once per call. Both AVX2 ways sum a (row, feature) in the same order
// (two accumulators, alternate 8-weight vectors), so a row's bits do not depend on M.
// Bytes moved per call: N * K/32 * block bytes of weights, M * K activations, M * N outputs.
//
// Invariants relied on (checked by the caller, engine/model/quant.py): x is [M, K] contiguous with
// K % 32 == 0, the blocks are [N, K/32 * block bytes] contiguous, y is [M, N] contiguous of x's
// dtype. The result does not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_scalars.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__FMA__) && defined(__F16C__)
#define QM_SIMD 1
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define QM_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QM_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;        // weights per block
constexpr int M_TILE = 8;     // activation rows per weight sweep
constexpr int ROW_TILE = 16;  // output features per OpenMP work item
// AVX2 (16 ymm registers): float32 accumulators per activation row, and rows per pass over a
// feature's blocks: 2 x 4 accumulators + one weight vector + d + m + two byte vectors = 13.
// Measured on Zen 3 against 4 x 2 and 1 x 8: about as fast at one row (two chains hide the fma
// latency, four did not gain) and the fastest from two to eight rows.
constexpr int AVX2_ACC = 2;
constexpr int AVX2_ROWS = 4;
// AVX2 with more than AVX2_ROWS rows: AVX2_TILE_FEATURES features are dequantised once into a
// per-thread float32 buffer (L1-resident: 2 x K floats) and every row meets them from there, in a
// register tile of AVX2_TILE_ROWS rows x AVX2_TILE_FEATURES features x AVX2_ACC accumulators
// (12) + one weight vector per feature + one x vector = 15 ymm; per 8 weights 3 + 2 loads feed
// 6 fmas. Measured on Zen 3 against 2 x 3, 2 x 2 and 4 x 1 tiles, against each accumulator's
// chain in a pass of its own over K with 4 x 3, 3 x 3, 4 x 2 and 3 x 4 tiles (slower where x
// is not in L1: K = 1536), and against groups of up to 16 features per buffer: the fastest at
// 16 and 24 rows, about even with the 4-row passes from 5 to 8 rows.
constexpr int AVX2_TILE_ROWS = 3;
constexpr int AVX2_TILE_FEATURES = 2;
#if defined(QM_BF16)
constexpr bool BF16_DOT = true;  // this build has q4_1_feature_bf16
#else
constexpr bool BF16_DOT = false;
#endif

using gguf_scalars::bf16_to_f32;
using gguf_scalars::f16_to_f32;
using gguf_scalars::f32_to_bf16;
using gguf_scalars::load_u16;

// --- formats: scalar dequantisation (portable path and oracle-free reference of the SIMD one) --

struct Q4_1 {
  static constexpr int BYTES = 20;
  static void dequant(const uint8_t* b, float* w) {
    const float d = f16_to_f32(load_u16(b)), m = f16_to_f32(load_u16(b + 2));
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(b[4 + j] & 15) + m;  // d * q is exact: one rounding, as fma
      w[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
    }
  }
#if defined(QM_SIMD)
  static inline void dequant(const uint8_t* b, __m512& w0, __m512& w1) {
    uint32_t dm;
    std::memcpy(&dm, b, 4);
    const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));  // [d, m, 0, 0]
    const __m512 d = _mm512_broadcastss_ps(dmf);
    const __m512 m = _mm512_broadcastss_ps(_mm_movehdup_ps(dmf));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i low = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(qs, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low);
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, m);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, m);
  }
#endif
#if defined(QM_AVX2)
  // Weights 8q..8q+7 of the block as float32 (q = 0..3): quarters 0 and 1 are the low nibbles of
  // bytes 0-7 and 8-15, quarters 2 and 3 their high nibbles.
  struct Avx2 {
    __m256 d, m;
    __m256i bytes[2];  // qs bytes 0-7 and 8-15, one per 32-bit lane
    explicit Avx2(const uint8_t* b) {
      uint32_t dm;
      std::memcpy(&dm, b, 4);
      const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));  // [d, m, 0, 0]
      d = _mm256_broadcastss_ps(dmf);
      m = _mm256_broadcastss_ps(_mm_movehdup_ps(dmf));
      bytes[0] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 4)));
      bytes[1] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 12)));
    }
    template <int Q>
    __m256 quarter() const {
      const __m256i q = Q < 2 ? _mm256_and_si256(bytes[Q], _mm256_set1_epi32(15))
                              : _mm256_srli_epi32(bytes[Q - 2], 4);
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
    }
  };
#endif
};

struct Q8_0 {
  static constexpr int BYTES = 34;
  static void dequant(const uint8_t* b, float* w) {
    const float d = f16_to_f32(load_u16(b));
    for (int j = 0; j < QK; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
  }
#if defined(QM_SIMD)
  static inline void dequant(const uint8_t* b, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(b)));
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
  }
#endif
#if defined(QM_AVX2)
  // Weights 8q..8q+7 of the block as float32 (q = 0..3).
  struct Avx2 {
    __m256 d;
    const uint8_t* q;
    explicit Avx2(const uint8_t* b) : d(_mm256_set1_ps(_cvtsh_ss(load_u16(b)))), q(b + 2) {}
    template <int Q>
    __m256 quarter() const {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * Q));
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d);
    }
  };
#endif
};

// --- one group of output features against MT activation rows ------------------------------------

struct Problem {
  const float* x;       // [M, K] float32 (x itself, or bf16 x widened)
  const uint16_t* xb;   // [M, K] bfloat16 bits when x is bf16 (the bf16 dot path), else null
  const float* sx;      // [M, K/32] block sums of x, pairs {0, sum} (the bf16 dot path), else null
  const uint8_t* w;     // [N, row_bytes]
  float* y;             // [M, N] float32 output, or null when the output is bf16
  uint16_t* yb;         // [M, N] bfloat16 output (rounded to nearest even, as torch rounds)
  int64_t M, N, K, row_bytes;
};

inline void store(const Problem& p, int64_t m, int64_t n, float v) {
  if (p.y != nullptr) p.y[m * p.N + n] = v;
  else p.yb[m * p.N + n] = f32_to_bf16(v);
}

#if defined(QM_SIMD)
// Feature n x MT rows m0..: two accumulators per row (the w0 and w1 halves of a block). Unrolling
// over blocks was measured slower: out-of-order execution already overlaps consecutive blocks,
// whose fma latency (4 cycles) is below their issue cost.
template <class F, int MT>
inline void feature_simd(const Problem& p, int64_t n, int64_t m0) {
  __m512 acc[MT][2];
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const int64_t nb = p.K / QK;
  const float* x = p.x + m0 * p.K;
  const uint8_t* row = p.w + n * p.row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    __m512 w0, w1;
    F::dequant(row + b * F::BYTES, w0, w1);
    for (int i = 0; i < MT; ++i) {
      const float* xi = x + i * p.K + b * QK;
      acc[i][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xi), acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xi + 16), acc[i][1]);
    }
  }
  for (int i = 0; i < MT; ++i)
    store(p, m0 + i, n, _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1])));
}
#endif

#if defined(QM_AVX2)
// acc[i][q % AVX2_ACC] += w * x[i][8q .. 8q + 7] for the MT rows of x (row stride K).
template <int MT>
inline void add_quarter(__m256 (&acc)[MT][AVX2_ACC], __m256 w, const float* x, int64_t K, int q) {
  for (int i = 0; i < MT; ++i)
    acc[i][q % AVX2_ACC] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + i * K + 8 * q),
                                           acc[i][q % AVX2_ACC]);
}

// The sum of a row's two accumulators: lane-wise, then the 8 lanes pairwise.
inline float reduce_add(const __m256 (&acc)[AVX2_ACC]) {
  static_assert(AVX2_ACC == 2, "reduce_add adds two accumulators");
  const __m256 v = _mm256_add_ps(acc[0], acc[1]);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Feature n x MT rows m0.. (MT <= AVX2_ROWS): each quarter of a block is dequantised once and
// meets every row. A row's quarter q is summed in its accumulator q % AVX2_ACC, and the
// accumulators are added in a fixed order at the end, so a row's bits do not depend on MT.
template <class F, int MT>
inline void feature_avx2(const Problem& p, int64_t n, int64_t m0) {
  __m256 acc[MT][AVX2_ACC];
  for (int i = 0; i < MT; ++i)
    for (int a = 0; a < AVX2_ACC; ++a) acc[i][a] = _mm256_setzero_ps();
  const int64_t nb = p.K / QK;
  const float* x = p.x + m0 * p.K;
  const uint8_t* row = p.w + n * p.row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    const typename F::Avx2 block(row + b * F::BYTES);
    const float* xb = x + b * QK;
    add_quarter<MT>(acc, block.template quarter<0>(), xb, p.K, 0);
    add_quarter<MT>(acc, block.template quarter<1>(), xb, p.K, 1);
    add_quarter<MT>(acc, block.template quarter<2>(), xb, p.K, 2);
    add_quarter<MT>(acc, block.template quarter<3>(), xb, p.K, 3);
  }
  for (int i = 0; i < MT; ++i) store(p, m0 + i, n, reduce_add(acc[i]));
}

// Features n.. (FT of them) dequantised into w, feature f's K weights at w + f * K in block
// order: the values feature_avx2 computes (F::Avx2 quarters).
template <class F, int FT>
inline void dequant_features(const Problem& p, int64_t n, float* w) {
  for (int f = 0; f < FT; ++f) {
    const uint8_t* row = p.w + (n + f) * p.row_bytes;
    float* out = w + f * p.K;
    for (int64_t b = 0; b < p.K / QK; ++b, out += QK) {
      const typename F::Avx2 block(row + b * F::BYTES);
      _mm256_store_ps(out, block.template quarter<0>());
      _mm256_store_ps(out + 8, block.template quarter<1>());
      _mm256_store_ps(out + 16, block.template quarter<2>());
      _mm256_store_ps(out + 24, block.template quarter<3>());
    }
  }
}

// Rows m0.. (MT of them) x the FT dequantised features in w (32-byte aligned, as
// dequant_features leaves them), stored as features n... Weights 8j..8j+7 go to accumulator
// j % AVX2_ACC, in order of j, and the accumulators are added by reduce_add: feature_avx2's
// order, so a row's bits are the same on both paths and do not depend on the tile shape.
template <int MT, int FT>
inline void tile_avx2(const Problem& p, const float* w, int64_t n, int64_t m0) {
  static_assert(AVX2_ACC == 2, "the k loop steps over one vector per accumulator");
  __m256 acc[MT][FT][AVX2_ACC];
  for (int i = 0; i < MT; ++i)
    for (int f = 0; f < FT; ++f)
      for (int a = 0; a < AVX2_ACC; ++a) acc[i][f][a] = _mm256_setzero_ps();
  const float* x = p.x + m0 * p.K;
  for (int64_t k = 0; k < p.K; k += 8 * AVX2_ACC) {
    for (int a = 0; a < AVX2_ACC; ++a) {
      __m256 wv[FT];
      for (int f = 0; f < FT; ++f) wv[f] = _mm256_load_ps(w + f * p.K + k + 8 * a);
      for (int i = 0; i < MT; ++i) {
        // The empty asm pins xv to a register: GCC would otherwise fold the load into each of
        // the FT fmas (8 loads per 6 fmas instead of 5; measured slower).
        __m256 xv = _mm256_loadu_ps(x + i * p.K + k + 8 * a);
        asm("" : "+x"(xv));
        for (int f = 0; f < FT; ++f) acc[i][f][a] = _mm256_fmadd_ps(wv[f], xv, acc[i][f][a]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int f = 0; f < FT; ++f) store(p, m0 + i, n + f, reduce_add(acc[i][f]));
}

// Every row of x (M > AVX2_ROWS) x the FT features n.. (dequantised into w), in tiles of 3
// rows; a remainder of one row goes with the last full tile as two tiles of 2 (a 1-row tile has
// a third of the fmas per load).
template <class F, int FT>
void features_avx2(const Problem& p, int64_t n, float* w) {
  static_assert(AVX2_TILE_ROWS == 3, "the remainders below are those of 3-row tiles");
  dequant_features<F, FT>(p, n, w);
  const int64_t rest = p.M % 3, full = p.M / 3 - (rest == 1);
  int64_t m0 = 0;
  for (int64_t t = 0; t < full; ++t, m0 += 3) tile_avx2<3, FT>(p, w, n, m0);
  for (; m0 < p.M; m0 += 2) tile_avx2<2, FT>(p, w, n, m0);
}

// Features [n0, n1) x every row of x, the weights dequantised once into w (the thread's
// AVX2_TILE_FEATURES x K buffer).
template <class F>
void tile_buffered(const Problem& p, int64_t n0, int64_t n1, float* w) {
  constexpr int FT = AVX2_TILE_FEATURES;
  static_assert(FT <= 4, "the remainder switch covers up to 3 features");
  int64_t n = n0;
  for (; n + FT <= n1; n += FT) features_avx2<F, FT>(p, n, w);
  switch (n1 - n) {
    case 1: features_avx2<F, 1>(p, n, w); break;
    case 2: features_avx2<F, (FT > 2 ? 2 : 1)>(p, n, w); break;
    case 3: features_avx2<F, (FT > 3 ? 3 : 1)>(p, n, w); break;
    default: break;
  }
}
#endif

#if defined(QM_BF16)
// Q4_1 with bfloat16 activations: sum_j x_j (d q_j + m) = d * sum_j x_j q_j + m * sum_j x_j.
// q_j (0..15) is exact in bf16 and x_j is bf16, so one vdpbf16ps forms the 32 products exactly
// and sums them in float32; the block's d scales that partial sum (fma) and m meets the block sum
// of x (precomputed once per row in float32) in a separate 128-bit accumulator. About 5 cycles
// per block on Zen 4 (vs about 6.5 for the float32 path), so two cores keep up with memory.
template <int MT>
inline void q4_1_feature_bf16(const Problem& p, int64_t n, int64_t m0) {
  const __m512i table = _mm512_loadu_si512(gguf_scalars::kNibbleBf16);  // nibble -> bf16
  __m512 acc[MT];
  __m128 accm[MT];
  for (int i = 0; i < MT; ++i) { acc[i] = _mm512_setzero_ps(); accm[i] = _mm_setzero_ps(); }
  const int64_t nb = p.K / QK;
  const uint16_t* x = p.xb + m0 * p.K;
  const float* sx = p.sx + m0 * nb * 2;
  const uint8_t* row = p.w + n * p.row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * Q4_1::BYTES;
    uint32_t dm;
    std::memcpy(&dm, blk, 4);
    const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));  // [d, m, 0, 0]
    const __m512 d = _mm512_broadcastss_ps(dmf);
    // 16 bytes twice -> 32 words; the upper 16 shifted right by 4 (high nibbles); the table
    // lookup reads each word's low 5 bits.
    const __m512i words = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4))));
    const __m512i idx = _mm512_mask_srli_epi16(words, 0xFFFF0000u, words, 4);
    const __m512bh q = (__m512bh)_mm512_permutexvar_epi16(idx, table);
    for (int i = 0; i < MT; ++i) {
      const __m512bh xi = (__m512bh)_mm512_loadu_si512(x + i * p.K + b * QK);
      acc[i] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q, xi), d, acc[i]);
      const __m128 s =
          _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sx + (i * nb + b) * 2)));
      accm[i] = _mm_fmadd_ps(dmf, s, accm[i]);  // lane 1: m * sum(x)
    }
  }
  for (int i = 0; i < MT; ++i)
    store(p, m0 + i, n, _mm512_reduce_add_ps(acc[i]) + _mm_cvtss_f32(_mm_movehdup_ps(accm[i])));
}
#endif

template <class F>
void feature_portable(const Problem& p, int64_t n, int64_t m0, int64_t mt) {
  float acc[M_TILE][QK] = {};
  float w[QK];
  for (int64_t b = 0; b < p.K / QK; ++b) {
    F::dequant(p.w + n * p.row_bytes + b * F::BYTES, w);
    for (int64_t i = 0; i < mt; ++i) {
      const float* xi = p.x + (m0 + i) * p.K + b * QK;
      for (int j = 0; j < QK; ++j) acc[i][j] += w[j] * xi[j];
    }
  }
  for (int64_t i = 0; i < mt; ++i) {
    float s = 0.f;
    for (int j = 0; j < QK; ++j) s += acc[i][j];
    store(p, m0 + i, n, s);
  }
}

// Features [n0, n1) for activation rows [m0, m0 + mt), mt <= M_TILE.
template <class F, int MT>
void tile_rows(const Problem& p, int64_t n0, int64_t n1, int64_t m0) {
  int64_t n = n0;
#if defined(QM_SIMD)
#if defined(QM_BF16)
  if (std::is_same<F, Q4_1>::value && p.xb != nullptr) {
    for (; n < n1; ++n) q4_1_feature_bf16<MT>(p, n, m0);
    return;
  }
#endif
  for (; n < n1; ++n) feature_simd<F, MT>(p, n, m0);
#elif defined(QM_AVX2)
  // Passes of AVX2_ROWS rows over one feature: its blocks stay in L1 between passes.
  constexpr int FULL = MT / AVX2_ROWS, REST = MT % AVX2_ROWS;
  for (; n < n1; ++n) {
    for (int pass = 0; pass < FULL; ++pass)
      feature_avx2<F, (FULL > 0 ? AVX2_ROWS : 1)>(p, n, m0 + pass * AVX2_ROWS);
    if (REST > 0) feature_avx2<F, (REST > 0 ? REST : 1)>(p, n, m0 + FULL * AVX2_ROWS);
  }
#else
  for (; n < n1; ++n) feature_portable<F>(p, n, m0, MT);
#endif
}

// A thread's scratch: the AVX2 path's dequantised features when it runs buffered (M >
// AVX2_ROWS), else nothing.
struct Scratch {
#if defined(QM_AVX2)
  struct alignas(32) Vector { float v[8]; };  // C++17 new honours the alignment
  std::vector<Vector> w;
  explicit Scratch(const Problem& p) {
    if (p.M > AVX2_ROWS) w.resize(AVX2_TILE_FEATURES * p.K / 8);
  }
  float* buffer() { return w.empty() ? nullptr : w.data()->v; }
#else
  explicit Scratch(const Problem&) {}
  float* buffer() { return nullptr; }
#endif
};

template <class F>
void tile(const Problem& p, int64_t n0, int64_t n1, Scratch& scratch) {
#if defined(QM_AVX2)
  if (p.M > AVX2_ROWS) {
    tile_buffered<F>(p, n0, n1, scratch.buffer());
    return;
  }
#endif
  (void)scratch;
  for (int64_t m0 = 0; m0 < p.M; m0 += M_TILE) {
    switch (std::min<int64_t>(M_TILE, p.M - m0)) {
      case 1: tile_rows<F, 1>(p, n0, n1, m0); break;
      case 2: tile_rows<F, 2>(p, n0, n1, m0); break;
      case 3: tile_rows<F, 3>(p, n0, n1, m0); break;
      case 4: tile_rows<F, 4>(p, n0, n1, m0); break;
      case 5: tile_rows<F, 5>(p, n0, n1, m0); break;
      case 6: tile_rows<F, 6>(p, n0, n1, m0); break;
      case 7: tile_rows<F, 7>(p, n0, n1, m0); break;
      default: tile_rows<F, 8>(p, n0, n1, m0); break;
    }
  }
}

template <class F>
void run(const Problem& p, int64_t threads) {
  const int64_t tiles = (p.N + ROW_TILE - 1) / ROW_TILE;
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min(threads, tiles)));
#pragma omp parallel num_threads(nthreads)
  {
    Scratch scratch(p);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t)
      tile<F>(p, t * ROW_TILE, std::min(p.N, (t + 1) * ROW_TILE), scratch);
  }
}

}  // namespace

// Entry point (engine/model/quant.py): y = x @ W^T for W given as GGUF blocks, qtype 0 = Q4_1,
// 1 = Q8_0, with N output features. x: [M, K] float32 (x_bf16 = 0) or bfloat16 (x_bf16 = 1);
// y: [M, N] of the same dtype. Returns 0, or -1 (nothing done) for an unknown qtype or a K that is
// not a positive multiple of 32.
extern "C" int quant_matmul(const void* x, int x_bf16, const uint8_t* blocks, int qtype, void* y,
                            int64_t M, int64_t N, int64_t K, int threads) {
  if ((qtype != 0 && qtype != 1) || K <= 0 || K % QK != 0) return -1;
  const bool q4 = qtype == 0;
  const int64_t nb = K / QK;
  std::vector<float> xf, sx;  // bf16 x widened (float32 path) or its block sums (bf16 dot path)
  Problem p{nullptr, nullptr, nullptr, blocks, x_bf16 ? nullptr : static_cast<float*>(y),
            x_bf16 ? static_cast<uint16_t*>(y) : nullptr, M, N, K,
            nb * (q4 ? Q4_1::BYTES : Q8_0::BYTES)};
  const uint16_t* xb = static_cast<const uint16_t*>(x);
  if (!x_bf16) {
    p.x = static_cast<const float*>(x);
  } else if (q4 && BF16_DOT) {
    sx.assign(M * nb * 2, 0.f);
    for (int64_t i = 0; i < M * nb; ++i) {
      float sum = 0.f;
      for (int j = 0; j < QK; ++j) sum += bf16_to_f32(xb[i * QK + j]);
      sx[2 * i + 1] = sum;
    }
    p.xb = xb;
    p.sx = sx.data();
  } else {
    xf.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_f32(xb[i]);
    p.x = xf.data();
  }
  if (M > 0 && N > 0) {
    if (q4) run<Q4_1>(p, threads);
    else run<Q8_0>(p, threads);
  }
  return 0;
}

// The code paths this build has: "avx512,bf16-dot", "avx512", "avx2" or "portable".
extern "C" const char* quant_simd_paths() {
#if defined(QM_BF16)
  return "avx512,bf16-dot";
#elif defined(QM_SIMD)
  return "avx512";
#elif defined(QM_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}
