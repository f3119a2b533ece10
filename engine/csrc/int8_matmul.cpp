// Integer matmul on the CPU for GGUF weights: y[M, N] = x[M, K] @ W[N, K]^T, with x quantized to
// int8 per block of 32 (llama.cpp's Q8 scheme for activations) and W repacked from the file's
// Q4_1 / Q8_0 blocks into tiles for AVX-512 VNNI (vpdpbusd: 64 u8 x s8 products per instruction,
// twice the multiply rate of the bf16 dot product on Zen 4). CPUs without it but with AVX2, FMA
// and F16C run an AVX2 path on the same tiles (vpmaddubsw pair products, exact: see there), others
// a portable one; all three give the same bits. A plain shared library (no torch headers), built
// at first use by engine/native_build.py, called through ctypes by engine/model/quant_int8.py.
//
// Arithmetic (every weight is the file's own; only x is approximated):
//   weight (n, k) = d[n, b] * q[n, k] + m[n, b], b = k / 32, q unsigned (u8);
//     Q4_1: q = the nibble (0..15), d, m = the block's f16 scale and min;
//     Q8_0: q = the int8 value + 128 (0..255), d = the block's scale, m = -128 d (exact in f16).
//   x (row r, block b) ~= xd[b, r] * xq[b, r, k % 32], xq = round-half-even(x * (127 / absmax))
//     in int8 (the product and quotient in float32), xd = absmax / 127 (0 for an all-zero block).
//     The quantized activations are stored block-major ([K/32, M, 32], scales [K/32, M]) so that
//     the rows a tile meets in one block are contiguous: one base pointer per block, constant
//     offsets per row (no general-register pressure in the unrolled row loop).
//   y[r, n] = sum_b d xd (sum_k q xq) + m * xs[b, r], xs = xd * sum(xq): the product of the
//     quantized x with the file's weights. (For Q8_0 this makes the +128 offset cancel exactly;
//     for Q4_1 the exact sum of x would be worse: the error would become sum d q (x^ - x) with
//     d q all of one sign, instead of sum w (x^ - x) with the centred weights w = d q + m.)
//   The inner sums are exact int32; the rest is float32.
//
// Packed layout (`int8_pack`): the N features in tiles of 16 (zero-padded), each tile's K/32 blocks
// contiguous ("tile-blocks"). A tile-block holds 8 groups of 4 consecutive k for its 16 features,
// one 64-byte vector per group with byte 4 j + t = q[16 tile + j, 32 b + 4 g + t] (the operand
// order of vpdpbusd: lane j accumulates feature j), then d[16] and m[16] as f16:
//   Q4_1: 4 x 64 bytes, vector h holding group h in its low nibbles and group h + 4 in its high
//         ones, + 64 bytes of scales = 320 bytes per 512 weights (the file's 20 per 32);
//   Q8_0: 8 x 64 bytes + 64 = 576 bytes per 512 weights (the file's 34 per 32).
//
// Work split: each of `threads` OpenMP threads owns a contiguous range of tiles and walks, per
// chunk of M_CHUNK rows (so the chunk's int8 activations stay in L2), its tiles, and per tile
// groups of up to M_TILE rows held in registers: a tile-block is unpacked once per group and
// used for all its rows. Decode-sized M reads every weight byte once per call.
// Bytes moved per call: the packed weights (once per M_CHUNK rows), M * K int8 activations and
// 2 M * K/32 float32 scales and sums per tile sweep (from cache), M * N outputs.
//
// Invariants relied on (checked by the caller, engine/model/quant_int8.py): K % 32 == 0, all
// arrays contiguous and of the sizes stated at each entry point. The result does not depend on
// the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_scalars.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BF16__) && defined(__F16C__)
#define I8_SIMD 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define I8_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;         // weights per GGUF block
constexpr int TILE = 16;       // features per tile (one zmm of int32 / float32 lanes)
constexpr int M_TILE = 16;     // activation rows per unpacked tile-block (8, 12 and 16 measured
                               // alike for prefill; 16 best at 16 decode rows)
constexpr int M_CHUNK = 128;   // activation rows per sweep over a thread's tiles
constexpr int PREFETCH_BLOCKS = 8;  // tile-blocks ahead that a row group asks the cache for
constexpr int Q4_TB = 320;     // bytes per tile-block, Q4_1
constexpr int Q8_TB = 576;     // bytes per tile-block, Q8_0
constexpr int SCALE_BYTES = 64;

using gguf_scalars::bf16_to_f32;
using gguf_scalars::f16_to_f32;
using gguf_scalars::f32_to_bf16;
using gguf_scalars::load_u16;

// f32 -> f16, for values that are exactly representable (m = -128 d of a Q8_0 block).
inline uint16_t f32_to_f16_exact(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const int exp = static_cast<int>((bits >> 23) & 0xff) - 127;
  const uint32_t mant = bits & 0x7fffffu;
  if ((bits & 0x7fffffffu) == 0) return sign;
  if (exp > 15) return static_cast<uint16_t>(sign | 0x7c00u);  // unreachable for f16 d
  if (exp >= -14) return static_cast<uint16_t>(sign | ((exp + 15) << 10) | (mant >> 13));
  return static_cast<uint16_t>(sign | ((mant | 0x800000u) >> (-exp - 14 + 13)));  // subnormal
}

inline int64_t tile_block_bytes(int qtype) { return qtype == 0 ? Q4_TB : Q8_TB; }

// --- packing -------------------------------------------------------------------------------------

// q (unsigned, as the kernel uses it) of weight (n, 32 b + j) from the file's block bytes.
inline uint8_t file_q(const uint8_t* blk, int qtype, int j) {
  if (qtype == 0) return j < 16 ? (blk[4 + j] & 15) : (blk[4 + j - 16] >> 4);
  return static_cast<uint8_t>(static_cast<int8_t>(blk[2 + j]) + 128);
}

void pack_tile_block(const uint8_t* blocks, int qtype, int64_t N, int64_t nb, int64_t t,
                     int64_t b, uint8_t* out) {
  const int block_bytes = qtype == 0 ? 20 : 34;
  const int64_t tb = tile_block_bytes(qtype);
  std::memset(out, 0, tb);
  uint16_t* scales = reinterpret_cast<uint16_t*>(out + tb - SCALE_BYTES);
  for (int j = 0; j < TILE; ++j) {
    const int64_t n = t * TILE + j;
    if (n >= N) break;  // padding features: q = d = m = 0
    const uint8_t* blk = blocks + (n * nb + b) * block_bytes;
    for (int g = 0; g < 8; ++g) {
      for (int u = 0; u < 4; ++u) {
        const uint8_t q = file_q(blk, qtype, 4 * g + u);
        if (qtype == 0) out[(g & 3) * 64 + 4 * j + u] |= static_cast<uint8_t>(q << (g >> 2) * 4);
        else out[g * 64 + 4 * j + u] = q;
      }
    }
    const uint16_t d = load_u16(blk);
    scales[j] = d;
    scales[TILE + j] = qtype == 0 ? load_u16(blk + 2) : f32_to_f16_exact(-128.f * f16_to_f32(d));
  }
}

// --- activation quantization ----------------------------------------------------------------------

// The 32 values of x at element offset `off` (float32 or bfloat16 bits) -> 32 int8, their scale
// d and the sum of the quantized values, d * sum(q).
inline void quantize_block_scalar(const void* x, bool bf16, int64_t off, int8_t* q, float* d,
                                  float* s) {
  float v[QK];
  for (int j = 0; j < QK; ++j)
    v[j] = bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[off + j])
                : static_cast<const float*>(x)[off + j];
  float amax = 0.f;
  for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int qsum = 0;
  for (int j = 0; j < QK; ++j) {
    const int qi = static_cast<int>(std::nearbyint(v[j] * inv));
    q[j] = static_cast<int8_t>(std::max(-127, std::min(127, qi)));
    qsum += q[j];
  }
  *d = amax / 127.f;
  *s = *d * static_cast<float>(qsum);
}

#if defined(I8_SIMD)
inline void quantize_block_simd(const void* x, bool bf16, int64_t off, int8_t* q, float* d,
                                float* s) {
  __m512 v0, v1;
  if (bf16) {
    const uint16_t* xb = static_cast<const uint16_t*>(x) + off;
    v0 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))), 16));
    v1 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))),
        16));
  } else {
    const float* xf = static_cast<const float*>(x) + off;
    v0 = _mm512_loadu_ps(xf);
    v1 = _mm512_loadu_ps(xf + 16);
  }
  // The same operations as the scalar path, lane by lane: max of |x|, 127 / amax, x * inv
  // rounded half to even (the default MXCSR mode), clamped to +-127.
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i lim = _mm512_set1_epi32(127);
  const __m512i q0 = _mm512_max_epi32(_mm512_min_epi32(
      _mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv)), lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
  const __m512i q1 = _mm512_max_epi32(_mm512_min_epi32(
      _mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv)), lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  *d = amax / 127.f;
  *s = *d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
}
#endif

#if defined(I8_AVX2)
// The same operations on 8 lanes at a time (max of |x|, 127 / amax, x * inv rounded half to even,
// clamped to +-127); the int32 -> int8 packs saturate (a no-op after the clamp) and interleave
// 128-bit lanes, which the dword permutation undoes.
inline void quantize_block_simd(const void* x, bool bf16, int64_t off, int8_t* q, float* d,
                                float* s) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) {
    if (bf16) {
      const __m128i h = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + off + 8 * i));
      v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      v[i] = _mm256_loadu_ps(static_cast<const float*>(x) + off + 8 * i);
    }
  }
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 mx = _mm256_max_ps(
      _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
      _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i lim = _mm256_set1_epi32(127), neg = _mm256_set1_epi32(-127);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i)
    qi[i] = _mm256_max_epi32(
        _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv)), lim), neg);
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                           _mm256_packs_epi32(qi[2], qi[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  const __m256i sum8 =
      _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
  sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
  sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
  *d = amax / 127.f;
  *s = *d * static_cast<float>(_mm_cvtsi128_si32(sum4));
}
#endif

// --- the tile kernel ---------------------------------------------------------------------------------

struct Problem {
  const uint8_t* w;     // packed tiles
  const int8_t* xq;     // [nb, M, 32]
  const float* xd;      // [nb, M] activation scales
  const float* xs;      // [nb, M] xd * sum(xq) per block
  float* y;             // [M, N] float32 output, or null
  uint16_t* yb;         // [M, N] bfloat16 output, or null
  int64_t M, N, K, nb;
  int qtype;            // 0 Q4_1, 1 Q8_0
};

// Portable: rows m0..m0+mt of tile t, scalar, same arithmetic (int32 block sums, float32 rest).
void tile_portable(const Problem& p, int64_t t, int64_t m0, int64_t mt) {
  const int64_t tb = tile_block_bytes(p.qtype);
  for (int64_t i = 0; i < mt; ++i) {
    const int64_t r = m0 + i;
    float acc[TILE] = {};
    for (int64_t b = 0; b < p.nb; ++b) {
      const uint8_t* blk = p.w + (t * p.nb + b) * tb;
      const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + tb - SCALE_BYTES);
      const int8_t* xr = p.xq + (b * p.M + r) * QK;
      for (int j = 0; j < TILE; ++j) {
        int32_t s = 0;
        for (int g = 0; g < 8; ++g) {
          for (int u = 0; u < 4; ++u) {
            const uint8_t packed = p.qtype == 0 ? blk[(g & 3) * 64 + 4 * j + u]
                                                : blk[g * 64 + 4 * j + u];
            const int q = p.qtype == 0 ? (packed >> (g >> 2) * 4) & 15 : packed;
            s += q * xr[4 * g + u];
          }
        }
        const float dd = f16_to_f32(scales[j]) * p.xd[b * p.M + r];
        acc[j] = std::fma(static_cast<float>(s), dd, acc[j]);
        acc[j] = std::fma(f16_to_f32(scales[TILE + j]), p.xs[b * p.M + r], acc[j]);
      }
    }
    for (int j = 0; j < TILE && t * TILE + j < p.N; ++j) {
      const int64_t o = r * p.N + t * TILE + j;
      if (p.y != nullptr) p.y[o] = acc[j];
      else p.yb[o] = f32_to_bf16(acc[j]);
    }
  }
}

#if defined(I8_SIMD)
// acc += w . (the 4 int8 at x broadcast to every lane), with the broadcast folded into the
// instruction's memory operand ({1to16}): GCC emits a separate vpbroadcastd for the intrinsic
// form, which doubles the vector instructions of the inner loop.
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

template <int QTYPE>
inline void unpack(const uint8_t* blk, __m512i w[8]) {
  if (QTYPE == 0) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int h = 0; h < 4; ++h) {
      const __m512i v = _mm512_loadu_si512(blk + 64 * h);
      w[h] = _mm512_and_si512(v, low);
      w[h + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
  } else {
    for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(blk + 64 * g);
  }
}

// Rows m0..m0+MT of tile t: MT float32 accumulators of 16 features stay in registers across the
// K blocks; each tile-block is unpacked once and meets every row (8 vpdpbusd with the row's
// 4-byte groups broadcast, then the block's scales).
template <int QTYPE, int MT>
void tile_simd(const Problem& p, int64_t t, int64_t m0) {
  constexpr int64_t TB = QTYPE == 0 ? Q4_TB : Q8_TB;
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  const uint8_t* base = p.w + t * p.nb * TB;
  for (int64_t b = 0; b < p.nb; ++b) {
    const uint8_t* blk = base + b * TB;
    if (MT >= 8) {  // enough work per tile-block to hide the hint (measured: -7 % at 16 rows;
                    // at 1 row it costs more than it saves)
      for (int64_t off = 0; off < TB; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BLOCKS * TB + off), _MM_HINT_T0);
    }
    __m512i w[8];
    unpack<QTYPE>(blk, w);
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + TB - SCALE_BYTES)));
    const __m512 m = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + TB - SCALE_BYTES / 2)));
    const int32_t* xb = reinterpret_cast<const int32_t*>(p.xq + (b * p.M + m0) * QK);
    const float* xd = p.xd + b * p.M + m0;
    const float* xs = p.xs + b * p.M + m0;
#pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) {
      const int32_t* xr = xb + i * (QK / 4);
      // Two chains of four so consecutive vpdpbusd do not wait on each other's latency.
      __m512i s0 = dpbusd_bcast(_mm512_setzero_si512(), w[0], xr);
      __m512i s1 = dpbusd_bcast(_mm512_setzero_si512(), w[1], xr + 1);
      s0 = dpbusd_bcast(s0, w[2], xr + 2);
      s1 = dpbusd_bcast(s1, w[3], xr + 3);
      s0 = dpbusd_bcast(s0, w[4], xr + 4);
      s1 = dpbusd_bcast(s1, w[5], xr + 5);
      s0 = dpbusd_bcast(s0, w[6], xr + 6);
      s1 = dpbusd_bcast(s1, w[7], xr + 7);
      const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(xd[i]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), dd, acc[i]);
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[i]), acc[i]);
    }
  }
  const int64_t n0 = t * TILE;
  const __mmask16 mask = p.N - n0 >= TILE ? 0xFFFF : static_cast<__mmask16>((1u << (p.N - n0)) - 1);
  for (int i = 0; i < MT; ++i) {
    const int64_t o = (m0 + i) * p.N + n0;
    if (p.y != nullptr) _mm512_mask_storeu_ps(p.y + o, mask, acc[i]);
    else _mm256_mask_storeu_epi16(p.yb + o, mask, (__m256i)_mm512_cvtneps_pbh(acc[i]));
  }
}
#endif

#if defined(I8_AVX2)
// AVX2 has no u8 x s8 dot product into int32. vpmaddubsw multiplies u8 by s8 and adds the products
// in pairs into int16, saturating; vpmaddwd by ones adds int16 pairs into int32. Exact while no
// int16 sum leaves [-32768, 32767]: nibbles (0..15) times |xq| <= 127 make pairs of at most
// 2 * 15 * 127 = 3810 in magnitude, and the pairs of a tile-block's 8 groups at most 30480, so
// the 8 groups add up in int16 and reach int32 with one vpmaddwd. Q8_0's codes (0..255) would
// saturate (2 * 255 * 127), so they are split into nibbles, q = 16 hi + lo: two such sums, the
// high one weighted by 16 in its vpmaddwd. Either way the int32 sums are vpdpbusd's, exactly.
// One 64-byte group vector is two 32-byte halves: features 0-7 and 8-15 (8 lanes of a ymm).

// The nibble vectors of half h of a tile-block: Q4_1 w[g] for group g; Q8_0 w[g] the low
// nibbles of group g and w[8 + g] its high ones.
template <int QTYPE>
inline void unpack_half(const uint8_t* blk, int h, __m256i* w) {
  const __m256i low = _mm256_set1_epi8(15);
  for (int v = 0; v < (QTYPE == 0 ? 4 : 8); ++v) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * v + 32 * h));
    w[v] = _mm256_and_si256(p, low);
    w[v + (QTYPE == 0 ? 4 : 8)] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
  }
}

// Per int16 lane, the sum over the 8 groups of (w[g] . the row's group g) for the two k of the
// lane's pair: |sum| <= 30480 (above), so the int16 adds are exact.
inline __m256i nibble_pair_sums(const __m256i* w, const int32_t* xr) {
  __m256i s = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xr[0]));
  for (int g = 1; g < 8; ++g)
    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(xr[g])));
  return s;
}

// The int32 block sums sum_k q xq of 8 features for one row.
template <int QTYPE>
inline __m256i block_sums(const __m256i* w, const int32_t* xr) {
  const __m256i s = _mm256_madd_epi16(nibble_pair_sums(w, xr), _mm256_set1_epi16(1));
  if (QTYPE == 0) return s;
  const __m256i high = _mm256_madd_epi16(nibble_pair_sums(w + 8, xr), _mm256_set1_epi16(16));
  return _mm256_add_epi32(s, high);
}

// f32_to_bf16 on 8 lanes: round to nearest even, NaN -> 0x7FC0.
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(_mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16),
                                       _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // <= 0xFFFF
}

// Rows m0..m0+MT of tile t, one half (8 features) of each tile-block at a time: the half's nibble
// vectors are unpacked once and meet every row; then y += d xd sum + m xs as on the other paths.
// The 2 MT accumulators outgrow the 16 ymm registers and partly live in L1; groups of 16 rows
// still measured faster at 16 decode rows than groups of 2, 4 or 8 (unpacking shared by more rows).
template <int QTYPE, int MT>
void tile_simd(const Problem& p, int64_t t, int64_t m0) {
  constexpr int64_t TB = QTYPE == 0 ? Q4_TB : Q8_TB;
  __m256 acc[MT][2];
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const uint8_t* base = p.w + t * p.nb * TB;
  for (int64_t b = 0; b < p.nb; ++b) {
    const uint8_t* blk = base + b * TB;
    const int32_t* xb = reinterpret_cast<const int32_t*>(p.xq + (b * p.M + m0) * QK);
    const float* xd = p.xd + b * p.M + m0;
    const float* xs = p.xs + b * p.M + m0;
    for (int h = 0; h < 2; ++h) {
      __m256i w[QTYPE == 0 ? 8 : 16];
      unpack_half<QTYPE>(blk, h, w);
      const __m256 d = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + TB - SCALE_BYTES + 16 * h)));
      const __m256 m = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + TB - SCALE_BYTES / 2 + 16 * h)));
      for (int i = 0; i < MT; ++i) {
        const __m256i s = block_sums<QTYPE>(w, xb + i * (QK / 4));
        const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(xd[i]));
        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dd, acc[i][h]);
        acc[i][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[i]), acc[i][h]);
      }
    }
  }
  const int64_t n0 = t * TILE, valid = std::min<int64_t>(TILE, p.N - n0);
  for (int i = 0; i < MT; ++i) {
    const int64_t o = (m0 + i) * p.N + n0;
    if (p.y != nullptr) {
      alignas(32) float out[TILE];
      _mm256_store_ps(out, acc[i][0]);
      _mm256_store_ps(out + 8, acc[i][1]);
      std::memcpy(p.y + o, out, valid * sizeof(float));
    } else {
      alignas(32) uint16_t out[TILE];
      _mm_store_si128(reinterpret_cast<__m128i*>(out), to_bf16(acc[i][0]));
      _mm_store_si128(reinterpret_cast<__m128i*>(out + 8), to_bf16(acc[i][1]));
      std::memcpy(p.yb + o, out, valid * sizeof(uint16_t));
    }
  }
}
#endif

#if defined(I8_SIMD) || defined(I8_AVX2)
template <int QTYPE>
void tile_rows(const Problem& p, int64_t t, int64_t m0, int64_t mt) {
  switch (mt) {
#define I8_CASE(n) case n: tile_simd<QTYPE, n>(p, t, m0); break;
    I8_CASE(1) I8_CASE(2) I8_CASE(3) I8_CASE(4) I8_CASE(5) I8_CASE(6) I8_CASE(7) I8_CASE(8)
    I8_CASE(9) I8_CASE(10) I8_CASE(11) I8_CASE(12) I8_CASE(13) I8_CASE(14) I8_CASE(15)
#undef I8_CASE
    default: tile_simd<QTYPE, M_TILE>(p, t, m0); break;
  }
}
#endif

void tile_group(const Problem& p, int64_t t, int64_t m0, int64_t mt) {
#if defined(I8_SIMD) || defined(I8_AVX2)
  if (p.qtype == 0) tile_rows<0>(p, t, m0, mt);
  else tile_rows<1>(p, t, m0, mt);
#else
  tile_portable(p, t, m0, mt);
#endif
}

int64_t num_tiles(int64_t N) { return (N + TILE - 1) / TILE; }

// Block i of the quantization loop (M * nb blocks): for M > M_TILE block b = i % nb of row
// r = i / nb, each thread taking a range of whole rows; for decode-sized M (at most one row
// group) row r = i % M of block b = i / M, each thread taking a range of whole blocks, so that
// the threads do not all write every 64-byte line of xd and xs ([nb, M]). Faster at 8 and 16
// rows, slower from 48 rows by block (bench/results/2026-12-05-int8-pipe-bound). Written
// block-major either way.
void quantize_one(const void* x, bool bf16, int64_t M, int64_t nb, int64_t i, int8_t* xq,
                  float* xd, float* xs) {
  const bool by_block = M <= M_TILE;
  const int64_t r = by_block ? i % M : i / nb, b = by_block ? i / M : i % nb;
  const int64_t in = (r * nb + b) * QK, o = b * M + r;  // x row-major, outputs block-major
#if defined(I8_SIMD) || defined(I8_AVX2)
  quantize_block_simd(x, bf16, in, xq + o * QK, xd + o, xs + o);
#else
  quantize_block_scalar(x, bf16, in, xq + o * QK, xd + o, xs + o);
#endif
}

// One thread's share of the product: its contiguous range of tiles, M_CHUNK rows at a time.
void matmul_share(const Problem& p, int64_t id, int64_t n) {
  const int64_t tiles = num_tiles(p.N);
  const int64_t t0 = tiles * id / n, t1 = tiles * (id + 1) / n;
  for (int64_t c0 = 0; c0 < p.M; c0 += M_CHUNK) {
    const int64_t c1 = std::min<int64_t>(p.M, c0 + M_CHUNK);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = c0; m0 < c1; m0 += M_TILE)
        tile_group(p, t, m0, std::min<int64_t>(M_TILE, c1 - m0));
  }
}

int clamp_threads(int threads, int64_t tiles) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tiles)));
}

bool bad_sizes(int qtype, int64_t M, int64_t N, int64_t K) {
  return (qtype != 0 && qtype != 1) || K <= 0 || K % QK != 0 || M < 0 || N < 0;
}

}  // namespace

extern "C" {

// Bytes of the packed form of an [N, K] matrix (K % 32 == 0) in format qtype (0 Q4_1, 1 Q8_0).
int64_t int8_packed_bytes(int qtype, int64_t N, int64_t K) {
  return num_tiles(N) * (K / QK) * tile_block_bytes(qtype);
}

// Repacks GGUF blocks [N, K/32 * block bytes] (ggml's layout) into `out` (int8_packed_bytes).
// Returns 0, or -1 for an unknown qtype or a bad K.
int int8_pack(const uint8_t* blocks, int qtype, int64_t N, int64_t K, uint8_t* out, int threads) {
  if ((qtype != 0 && qtype != 1) || K <= 0 || K % QK != 0) return -1;
  const int64_t nb = K / QK, tiles = num_tiles(N), tb = tile_block_bytes(qtype);
#pragma omp parallel for schedule(static) num_threads(std::max(1, threads))
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < nb; ++b) pack_tile_block(blocks, qtype, N, nb, t, b, out + (t * nb + b) * tb);
  return 0;
}

// x [M, K] (float32, or bfloat16 when x_bf16) -> xq [K/32, M, 32] int8 and xd, xs [K/32, M]
// float32 (block-major; see the arithmetic above). Identical on both paths. Returns 0, or -1 for
// a bad K.
int int8_quantize(const void* x, int x_bf16, int64_t M, int64_t K, int8_t* xq, float* xd,
                  float* xs, int threads) {
  if (K <= 0 || K % QK != 0) return -1;
  const int64_t nb = K / QK, total = M * nb;
#pragma omp parallel for schedule(static) num_threads(std::max(1, threads)) if (total >= 4096)
  for (int64_t i = 0; i < total; ++i) quantize_one(x, x_bf16 != 0, M, nb, i, xq, xd, xs);
  return 0;
}

// y [M, N] (x's dtype) = x quantized as int8_quantize does, times the packed W, in one call and
// one parallel region (the quantized x lives in a buffer of the calling thread, reused across
// calls): the model calls this ~120 times a decode step, so the fixed cost of a call matters.
// Returns 0, or -1 for bad sizes.
int int8_linear(const void* x, int x_bf16, const uint8_t* packed, int qtype, void* y, int64_t M,
                int64_t N, int64_t K, int threads) {
  if (bad_sizes(qtype, M, N, K)) return -1;
  if (M == 0 || N == 0) return 0;
  const int64_t nb = K / QK;
  thread_local std::vector<float> scratch;  // [xd | xs | xq] of this call
  const int64_t floats = 2 * M * nb + (M * K + 3) / 4;
  if (static_cast<int64_t>(scratch.size()) < floats) scratch.resize(floats);
  float* xd = scratch.data();
  float* xs = xd + M * nb;
  int8_t* xq = reinterpret_cast<int8_t*>(xs + M * nb);
  Problem p{packed, xq, xd, xs, x_bf16 ? nullptr : static_cast<float*>(y),
            x_bf16 ? static_cast<uint16_t*>(y) : nullptr, M, N, K, nb, qtype};
#pragma omp parallel num_threads(clamp_threads(threads, num_tiles(N)))
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M * nb; ++i) quantize_one(x, x_bf16 != 0, M, nb, i, xq, xd, xs);
    matmul_share(p, omp_get_thread_num(), omp_get_num_threads());  // after the for's barrier
  }
  return 0;
}

// "avx512-vnni", "avx2" or "portable".
const char* int8_simd_paths() {
#if defined(I8_SIMD)
  return "avx512-vnni";
#elif defined(I8_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

}  // extern "C"
