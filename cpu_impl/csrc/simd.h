// The SIMD building blocks of the cpu backend's attention kernel (kernel.h): element conversion
// to float32, dot products of query rows with key rows, exp, row maxima. Three builds of the same
// functions, chosen by the compile flags (cpu_impl/build.py): AVX-512 (PK_AVX512, with BF16's
// vdpbf16ps), AVX2 + FMA + F16C (PK_SIMD), and portable C++ that the compiler vectorises. The AVX2
// and AVX-512 builds compute the same exp.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// The small SIMD helpers pass vector arrays; out of line they would go through memory (GCC's
// inliner sometimes declines them once ItemKernel grows), so they are always inlined.
#define PK_INLINE inline __attribute__((always_inline))

constexpr int LANES = 8;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// --- element conversion -------------------------------------------------------------------

inline void to_float(const float* src, float* dst, int n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const at::BFloat16* src, float* dst, int n) {
  // bf16 is the top half of a float32: widen by a 16-bit shift (auto-vectorised).
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void to_float(const at::Half* src, float* dst, int n) {
  int i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

inline float scalar_float(float x) { return x; }
inline float scalar_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float scalar_float(at::Half x) { return static_cast<float>(x); }

// --- 8-bit cache elements ------------------------------------------------------------------
// An 8-bit cache (fp8 e4m3fn, fp8 e5m2, int8) holds codes whose float32 value the kernel
// multiplies by the KV head's scale (kernel.h folds that scale into the query and the output).
// The conversions below give the code's exact value, NaN for e4m3fn's S.1111.111 and e5m2's NaNs.
//
// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits, subnormals, no infinities. Its bits
// moved into an f16 (sign to bit 15, exponent and mantissa to bits 7..13) give the value / 2^8 for
// every code, subnormals included (both formats' subnormals sit at their lowest exponent, 8
// apart); one F16C conversion and a multiplication by 2^8 (exact) follow. e5m2 is the top byte of
// an f16. The portable path reads a 256-entry table.
constexpr float kE4m3Unit = 256.f;  // e4m3fn value = f16 reading of its moved bits * 2^8

// The value of an e4m3fn code by its definition (the table's source, and the scalar tails').
inline float e4m3_value(uint8_t b) {
  const int exponent = (b >> 3) & 0xF, mantissa = b & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
  const float magnitude = exponent == 0 ? std::ldexp(mantissa / 8.f, -6)
                                        : std::ldexp(1.f + mantissa / 8.f, exponent - 7);
  return (b & 0x80) ? -magnitude : magnitude;
}

struct Fp8Table {
  float value[256];
  explicit Fp8Table(float (*decode)(uint8_t)) {
    for (int b = 0; b < 256; ++b) value[b] = decode(static_cast<uint8_t>(b));
  }
};

inline float e5m2_value(uint8_t b) {
  return static_cast<float>(c10::Half(static_cast<uint16_t>(b << 8), c10::Half::from_bits()));
}

inline const float* e4m3_table() {
  static const Fp8Table table(e4m3_value);
  return table.value;
}
inline const float* e5m2_table() {
  static const Fp8Table table(e5m2_value);
  return table.value;
}

inline float scalar_float(at::Float8_e4m3fn x) { return e4m3_table()[x.x]; }
inline float scalar_float(at::Float8_e5m2 x) { return e5m2_table()[x.x]; }
inline float scalar_float(int8_t x) { return static_cast<float>(x); }

template <typename C>
constexpr bool is_8bit_cache() {
  return std::is_same_v<C, at::Float8_e4m3fn> || std::is_same_v<C, at::Float8_e5m2> ||
         std::is_same_v<C, int8_t>;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PK_SIMD 1
// Eight consecutive elements widened to float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// 8-bit codes (see "8-bit cache elements" above): widened to 16 bits, then to float32.
inline __m128i load_bytes8(const void* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}
inline __m256 load8(const at::Float8_e5m2* p) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(load_bytes8(p)), 8));
}
inline __m256 load8(const at::Float8_e4m3fn* p) {
  // Sign-extended bytes shifted left by 7: the sign reaches bit 15 (and 14, cleared), exponent
  // and mantissa bits 7..13.
  const __m128i w = _mm_cvtepi8_epi16(load_bytes8(p));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xBFFF)));
  const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(kE4m3Unit));
  const __m128i low7 = _mm_set1_epi16(0x7F);
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(w, low7), low7);
  return _mm256_blendv_ps(v, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                          _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_bytes8(p)));
}
#endif

#if defined(PK_SIMD) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__)
#define PK_AVX512 1
// Sixteen consecutive elements widened to float32 (bf16: a 16-bit shift, exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const at::Float8_e5m2* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
}
inline __m512 load16(const at::Float8_e4m3fn* p) {  // as load8's
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                     _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(kE4m3Unit));
  const __m128i low7 = _mm_set1_epi8(0x7F);
  const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, low7), low7);
  return _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 8-bit codes to bf16, for the vdpbf16ps paths (kernel.h stages a unit of K or V rows this way).
// Every e4m3fn, e5m2 and int8 value is a bf16 (at most 4 significant bits for fp8, 7 for int8;
// exponents well inside bf16's range, no subnormal bf16), so the conversion is exact.
//
// fp8 with M mantissa bits and exponent bias B: a code whose exponent field is neither 0 nor all
// ones is a normal number whose bf16 bits are its 7 magnitude bits moved up by 7 - M plus
// (127 - B) << 7 (three integer instructions). The others (subnormals, and e4m3fn's largest
// binade with its NaN, e5m2's inf and NaN: 2^M codes at each end) come from a 32-word table
// indexed by the code's low 5 bits in one vpermw, for the lanes that hold them; the sign bit is
// then OR'd in: 9 instructions for 32 codes and one single-register table, in place of two
// 64-word vpermi2w lookups of the whole magnitude and a blend (bench/results/
// 2026-12-03-fp8-bf16-conversion: equal outputs, no measurable change of a 2-thread call).
// int8: sign-extend, to float32, pack.
inline uint16_t bf16_bits(float x) {
  if (std::isnan(x)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return static_cast<uint16_t>(u >> 16);  // exact for the values above
}

// The layout of an fp8 format: mantissa bits and exponent bias.
template <typename C>
struct Fp8Layout {
  static constexpr int mantissa = std::is_same_v<C, at::Float8_e4m3fn> ? 3 : 2;
  static constexpr int bias = std::is_same_v<C, at::Float8_e4m3fn> ? 7 : 15;
};

// The bf16 bits of the codes with exponent field 0 or all ones, at index (code & 31): codes
// 0 .. 2^M - 1 at their own index, codes 128 - 2^M .. 127 at index 32 - 2^M .. 31.
struct Bf16EdgeTable {
  alignas(64) uint16_t bits[32];
  explicit Bf16EdgeTable(float (*decode)(uint8_t)) {
    for (int i = 0; i < 32; ++i)
      bits[i] = bf16_bits(decode(static_cast<uint8_t>(i < 16 ? i : 96 | i)));
  }
};

template <typename C>
const uint16_t* bf16_edge_table() {
  static const Bf16EdgeTable table(std::is_same_v<C, at::Float8_e4m3fn> ? e4m3_value
                                                                        : e5m2_value);
  return table.bits;
}

// dst + i * d = the bf16 values of rows[i][0..d), i < n; d % 32 == 0.
template <typename C>
inline void codes_to_bf16(const C* const* rows, int n, int d, uint16_t* dst) {
  if constexpr (std::is_same_v<C, int8_t>) {
    for (int i = 0; i < n; ++i)
      for (int x = 0; x < d; x += 32) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + x));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
        _mm512_storeu_si512(dst + i * d + x, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
  } else {
    constexpr int M = Fp8Layout<C>::mantissa, B = Fp8Layout<C>::bias;
    const __m512i edges = _mm512_load_si512(bf16_edge_table<C>());
    // (w + 2^M) has no bit in [M + 1, 6] exactly when w's exponent field is 0 or all ones.
    const __m512i edge_step = _mm512_set1_epi16(1 << M);
    const __m512i edge_bits = _mm512_set1_epi16(0x7F & ~((2 << M) - 1));
    const __m512i mag_bits = _mm512_set1_epi16(0x7F << (7 - M));
    const __m512i rebias = _mm512_set1_epi16((127 - B) << 7);
    const __m512i sign = _mm512_set1_epi16(static_cast<short>(0x8000));
    for (int i = 0; i < n; ++i)
      for (int x = 0; x < d; x += 32) {
        // Sign-extended codes: bits 0..6 the magnitude, bit 15 the sign.
        const __m512i w =
            _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + x)));
        const __m512i normal = _mm512_add_epi16(
            _mm512_and_si512(_mm512_slli_epi16(w, 7 - M), mag_bits), rebias);
        const __mmask32 edge = _mm512_testn_epi16_mask(_mm512_add_epi16(w, edge_step), edge_bits);
        const __m512i mag = _mm512_mask_permutexvar_epi16(normal, edge, w, edges);
        _mm512_storeu_si512(dst + i * d + x, _mm512_ternarylogic_epi32(mag, w, sign, 0xF8));
      }
  }
}

#endif

// n 8-bit codes widened to their float32 values (the widened-row paths of kernel.h).
template <typename C, std::enable_if_t<is_8bit_cache<C>(), int> = 0>
inline void to_float(const C* src, float* dst, int n) {
  int i = 0;
#if defined(PK_AVX512)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#endif
#if defined(PK_SIMD)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = scalar_float(src[i]);
}

// --- small vector kernels -----------------------------------------------------------------

// scores[i] = dot(q, k[i]) for 8 key rows k[0..8) (float32 or a 16-bit type widened on load).
#if defined(PK_SIMD)
PK_INLINE __m256 reduce8(const __m256* acc) {
  // Transpose-and-add: hadd pairs within 128-bit lanes, then add the two lanes; lane i = sum(acc[i]).
  __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <typename S>
inline void scores8(const float* q, const S* const* k, int d, float* scores) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  int x = 0;
  for (; x + 8 <= d; x += 8) {
    __m256 qv = _mm256_loadu_ps(q + x);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, load8(k[i] + x), acc[i]);
  }
  _mm256_storeu_ps(scores, reduce8(acc));
  for (; x < d; ++x)
    for (int i = 0; i < 8; ++i) scores[i] += q[x] * scalar_float(k[i][x]);
}

// The four sums of acc[0..4) in one vector (lane i = sum(acc[i])), added in reduce8's order.
PK_INLINE __m128 reduce4(const __m256* acc) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// NR <= 3 query rows against 4 key rows: each K load feeds NR FMAs (scores8 is load-bound), and
// the NR x 4 accumulators (12 of the 16 ymm registers at NR = 3) are reduced together.
// s[i * stride + j] = dot(q + i * d, k[j]), i < NR, j < 4. Every score is summed in scores8's
// order (per lane over d, then reduce8's tree, then the scalar tail), whatever NR.
template <int NR, typename S>
PK_INLINE void scores_x4(const float* q, const S* const* k, int d, float* s, int stride) {
  static_assert(NR >= 1 && NR <= 3, "12 accumulators at most");
  __m256 acc[NR][4];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
  int x = 0;
  for (; x + 8 <= d; x += 8)
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = load8(k[j] + x);
      for (int i = 0; i < NR; ++i)
        acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * d + x), kv, acc[i][j]);
    }
  if (NR >= 2) {
    const __m256 pair = reduce8(acc[0]);  // acc[0], acc[1]: 8 consecutive vectors
    _mm_storeu_ps(s, _mm256_castps256_ps128(pair));
    _mm_storeu_ps(s + stride, _mm256_extractf128_ps(pair, 1));
  }
  if (NR != 2) _mm_storeu_ps(s + (NR - 1) * stride, reduce4(acc[NR - 1]));
  for (; x < d; ++x)
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < 4; ++j) s[i * stride + j] += q[i * d + x] * scalar_float(k[j][x]);
}

#if defined(PK_AVX512)
// Raw bf16 dot products of NR <= 4 query rows (q, rows d apart) with 4 key rows, pairs of bf16
// products summed in float32 by vdpbf16ps (each product of two bf16 is exact in float32);
// d % 16 == 0. out[0] lane i * 4 + j = dot(q[i], k[j]) for rows 0 and 1, out[1] the same for rows
// 2 and 3 (NR > 2). 256-bit vectors: two 8-lane reductions cost less than one 16-lane one
// (A/B, hot 16 x 320 decode, 30 layers, 1 thread: 6.00 -> 5.87 ms a step).
template <int NR>
PK_INLINE void dots_bf16(const at::BFloat16* q, const at::BFloat16* const* k, int d,
                         __m256* out) {
  __m256 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm256_setzero_ps();
  for (int x = 0; x < d; x += 16) {
    __m256bh kv[4];
    for (int j = 0; j < 4; ++j)
      kv[j] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[j] + x));
    for (int i = 0; i < NR; ++i) {
      const __m256bh qv =
          (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * d + x));
      for (int j = 0; j < 4; ++j) acc[i * 4 + j] = _mm256_dpbf16_ps(acc[i * 4 + j], qv, kv[j]);
    }
  }
  out[0] = reduce8(acc);
  if (NR > 2) out[1] = reduce8(acc + 8);
}
#endif

// exp(x) with a degree-6 polynomial after range reduction (relative error ~2e-7); inputs below
// kExpLo (the masks' -inf included) give exactly 0. exp8 and exp16 share these constants, so the
// AVX2 and AVX-512 builds compute the same function.
constexpr float kExpLo = -87.0f, kExpHi = 88.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = kLn2Hi + kLn2Lo
constexpr float kExpPoly[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

PK_INLINE __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(kExpLo);
  __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kExpHi)), lo);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 poly = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(kExpPoly[i]));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(poly, _mm256_castsi256_ps(e)), keep);
}

#if defined(PK_AVX512)
// exp8, 16 lanes wide.
PK_INLINE __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(kExpLo);
  __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kExpHi)), lo);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 poly = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kExpPoly[i]));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(keep, poly, _mm512_castsi512_ps(e));
}
#endif

// x[i] = exp(x[i] - shift) for i < n; returns the sum of the results.
inline float exp_shifted(float* x, int n, float shift) {
  __m256 sh = _mm256_set1_ps(shift), total = _mm256_setzero_ps();
  int i = 0;
#if defined(PK_AVX512)
  const __m512 sh16 = _mm512_set1_ps(shift);
  __m512 total16 = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), sh16));
    _mm512_storeu_ps(x + i, e);
    total16 = _mm512_add_ps(total16, e);
  }
  total = _mm256_add_ps(_mm512_castps512_ps256(total16), _mm512_extractf32x8_ps(total16, 1));
#endif
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh));
    _mm256_storeu_ps(x + i, e);
    total = _mm256_add_ps(total, e);
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, total);
  float sum = 0.f;
  for (float v : part) sum += v;
  for (; i < n; ++i) sum += (x[i] = std::exp(x[i] - shift));
  return sum;
}
#if defined(PK_AVX512)
// The bf16 bits of 16 floats as c10::BFloat16(float) gives them (from_float): round to nearest
// even on the bits, subnormals kept, NaN -> 0x7FC0. (vcvtneps2bf16 flushes subnormals.)
PK_INLINE __m256i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
#endif

#if defined(PK_AVX512)
// out[i] = bf16(exp(x[i] - shift)) for i in [a, b) (other entries untouched); returns the sum of
// the float32 values.
inline float exp_shifted_bf16(const float* x, uint16_t* out, int a, int b, float shift) {
  const __m512 sh = _mm512_set1_ps(shift);
  __m512 total = _mm512_setzero_ps();
  for (int i = a; i < b; i += 16) {
    const __mmask16 live = b - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (b - i)) - 1);
    const __m512 e =
        _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, x + i), sh)));
    total = _mm512_add_ps(total, e);
    const __m256bh h = _mm512_cvtneps_pbh(e);
    _mm256_mask_storeu_epi16(out + i, live, reinterpret_cast<const __m256i&>(h));
  }
  return _mm512_reduce_add_ps(total);
}
#endif
#else
// Portable: LANES partial sums so that the compiler vectorises without -ffast-math (which would
// break the masks' -inf handling).
template <typename S>
inline float dot_rows(const float* q, const S* k, int d) {
  float part[LANES] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int x = 0;
  for (; x + LANES <= d; x += LANES)
    for (int l = 0; l < LANES; ++l) part[l] += q[x + l] * scalar_float(k[x + l]);
  float s = 0.f;
  for (; x < d; ++x) s += q[x] * scalar_float(k[x]);
  for (int l = 0; l < LANES; ++l) s += part[l];
  return s;
}

template <typename S>
inline void scores8(const float* q, const S* const* k, int d, float* scores) {
  for (int i = 0; i < 8; ++i) scores[i] = dot_rows(q, k[i], d);
}

template <int NR, typename S>
inline void scores_x4(const float* q, const S* const* k, int d, float* s, int stride) {
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < 4; ++j) s[i * stride + j] = dot_rows(q + i * d, k[j], d);
}

inline float exp_shifted(float* x, int n, float shift) {
  float sum = 0.f;
  for (int i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - shift));
  return sum;
}
#endif

// max(x[0..n)), -inf for n == 0; vector lanes of partial maxima instead of one serial chain.
inline float row_max(const float* x, int n) {
  int i = 0;
  float m = NEG_INF;
#if defined(PK_SIMD)
  __m256 lanes = _mm256_set1_ps(NEG_INF);
  for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(x + i));
  alignas(32) float part[8];
  _mm256_store_ps(part, lanes);
  for (float v : part) m = std::max(m, v);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

}  // namespace
