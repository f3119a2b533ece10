// Tiled bf16 matmul on GGUF weights: y[M, N] = x[M, K] @ W[N, K]^T for bfloat16 x, with W the
// file's Q4_1 / Q8_0 weights repacked at load time into tiles of 16 output features, the features
// in the 16 float32 lanes of a zmm (AVX512_BF16's vdpbf16ps). A plain shared library (no torch
// headers), built at first use by engine/native_build.py, called through ctypes by
// engine/model/quant_tiled.py.
//
// Arithmetic (exact weights; the file's, never a rounded copy), per row r, feature n, block b:
//   Q4_1: y += d * S + m * sx,  Q8_0: y += d * S,  S = sum_k q_k x_k over the block's 32 k,
//   with q the block's integer values (Q4_1 nibbles 0..15, Q8_0 int8), exact in bf16, d and m
//   the block's f16 scale and min, sx = the float32 sum of the block's 32 x (fixed order below).
//   S: the products q x are exact in float32 and summed in float32 by vdpbf16ps, pair by pair in
//   a fixed order (below), two chains for groups of fewer than CHAIN_ROWS rows (one otherwise);
//   the d and m terms are fmas into a float32 accumulator; the output is rounded to bf16 once.
//   vdpbf16ps treats bf16 subnormal inputs as zero and flushes subnormal sums to zero; the
//   portable path does the same, so both paths give the same bits.
//   Block sum order: v[l] = x[l] + x[l + 16] (l < 16), then v[l] += v[l + h] for h = 8, 4, 2, 1.
//   Pair order within S: pair p holds k = 2p, 2p + 1; Q4_1 adds p = 0, 8, 1, 9, ..., 7, 15 (one
//   chain) or 0..7 and 8..15 (two chains, summed at the end); Q8_0 adds p = 0..15 (one chain) or
//   the even and the odd p (two chains).
//
// Packed layout (`tiled_pack`): the N features in tiles of 16 (zero-padded), each tile's K/32
// blocks contiguous ("tile-blocks"); j = feature in the tile, h = 0, 1:
//   Q4_1: 8 chunks of 32 bytes, byte 2j + h of chunk c = q[j, 2c + h] | q[j, 2c + 16 + h] << 4
//         (widened to words, the low nibbles are pairs p = c and the high ones p = c + 8), then
//         d[16] and m[16] as f16: 320 bytes per 512 weights, the file's 20 per 32.
//   Q8_0: 16 chunks of 32 bytes, byte 2j + h of chunk p = q[j, 2p + h] (int8), then d[16] as f16:
//         544 bytes per 512 weights, the file's 34 per 32.
//
// Work split: each of `threads` OpenMP threads owns a contiguous range of tiles; per tile, the M
// rows go in balanced groups of at most M_TILE held in registers (a group's accumulators and its
// block sums S); each weight vector (16 features x 2 k) meets every row of a group through one
// vdpbf16ps with the row's x pair broadcast ({1to16}). It is unpacked once per call: with several
// groups, the first writes the tile's vectors to a per-thread buffer (K/2 x 64 bytes) that the
// others read. Fewer than CHAIN_ROWS rows go through two tiles at a time, their chains
// interleaved. Every weight byte is read from memory once per call (prefetched 8 tile-blocks
// ahead into L1 by groups of 8 rows or more, 32 ahead into L2 by smaller groups).
// Bytes moved per call: the packed weights, M * K bf16 activations per tile sweep (from cache),
// M * K/32 float32 block sums, M * N bf16 outputs.
//
// AMX (built with -mamx-tile -mamx-bf16 and granted by Linux): 4 rows or more run on tiles, with
// the bits of each row alone (two chains, whatever the group): see "AMX" below.
//
// Invariants relied on (checked by the caller, engine/model/quant_tiled.py): K % 32 == 0, all
// arrays contiguous and of the sizes stated at each entry point. The result does not depend on
// the thread count; a row's bits depend on M only through the size of its row group.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_scalars.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__FMA__) && defined(__F16C__)
#define TM_SIMD 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TM_AMX 1

#include "../../paged_kernels/csrc/amx_tiles.h"
#endif
#endif

namespace {

constexpr int QK = 32;          // weights per GGUF block
constexpr int TILE = 16;        // features per tile (one zmm of float32 lanes)
constexpr int PAIRS = QK / 2;   // weight vectors per tile-block (16 features x 2 k each)
constexpr int M_TILE = 12;      // most rows per group (registers: 2 per row + weights, scales;
                                // 8, 10 and 12 measured, 12 best from 1 to 32 rows)
constexpr int CHAIN_ROWS = 4;   // groups of fewer rows sum S in two chains (vdpbf16ps latency)
constexpr int PREFETCH_BLOCKS = 8;  // tile-blocks ahead that a group reading packed tiles asks
                                    // the cache for (groups of 8 rows or more)
// Groups of fewer rows stream the weights faster than they compute them: each of their tiles
// asks L2 (prefetcht1, whose miss queue is deeper than L1's) for the tile-block this many ahead.
// A decode step's matmuls at 1 row took 0.70-0.76x the time on a 2-vCPU Zen 4; 64 ahead did
// as well, 8, 16 and 128 ahead and prefetcht0 less
// (bench/results/2026-12-04-tiled-stream-prefetch).
constexpr int FEW_ROWS_PREFETCH_BLOCKS = 32;
constexpr int Q4_TB = 320;      // bytes per tile-block, Q4_1
constexpr int Q8_TB = 544;      // bytes per tile-block, Q8_0
constexpr int Q4_SCALES = 64;   // d[16] and m[16], f16
constexpr int Q8_SCALES = 32;   // d[16], f16

using gguf_scalars::bf16_to_f32;
using gguf_scalars::f16_to_f32;
using gguf_scalars::load_u16;

inline int64_t tile_block_bytes(int qtype) { return qtype == 0 ? Q4_TB : Q8_TB; }
inline int64_t num_tiles(int64_t N) { return (N + TILE - 1) / TILE; }

// --- packing -------------------------------------------------------------------------------------

// The integer value q of weight (n, 32 b + k) in the file's block `blk` (Q4_1 unsigned, Q8_0 int8).
inline int file_q(const uint8_t* blk, int qtype, int k) {
  if (qtype == 0) return k < 16 ? (blk[4 + k] & 15) : (blk[4 + k - 16] >> 4);
  return static_cast<int8_t>(blk[2 + k]);
}

void pack_tile_block(const uint8_t* blocks, int qtype, int64_t N, int64_t nb, int64_t t,
                     int64_t b, uint8_t* out) {
  const int block_bytes = qtype == 0 ? 20 : 34;
  const int64_t tb = tile_block_bytes(qtype);
  std::memset(out, 0, tb);
  uint16_t* scales = reinterpret_cast<uint16_t*>(out + (qtype == 0 ? 256 : 512));
  for (int j = 0; j < TILE && t * TILE + j < N; ++j) {  // padding features: q = d = m = 0
    const uint8_t* blk = blocks + ((t * TILE + j) * nb + b) * block_bytes;
    for (int k = 0; k < QK; ++k) {
      const int q = file_q(blk, qtype, k), p = k / 2, h = k % 2;
      if (qtype == 0) out[32 * (p % 8) + 2 * j + h] |= static_cast<uint8_t>(q << (p / 8) * 4);
      else out[32 * p + 2 * j + h] = static_cast<uint8_t>(q);
    }
    scales[j] = load_u16(blk);
    if (qtype == 0) scales[TILE + j] = load_u16(blk + 2);
  }
}

// --- vdpbf16ps, emulated (the portable path) ------------------------------------------------

inline float flush(float v) {
  return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.f, v) : v;
}

// acc += w1 * x1 then += w0 * x0, each rounded to nearest even, subnormal inputs and results
// flushed to zero: vdpbf16ps on one lane (the products of two bf16 are exact in float32).
inline float dp_pair(float acc, float w0, float w1, float x0, float x1) {
  acc = flush(flush(acc) + flush(w1) * flush(x1));
  return flush(acc + flush(w0) * flush(x0));
}

// bf16 bits of f rounded to nearest even as vcvtneps2bf16 does (subnormal input -> zero).
inline uint16_t to_bf16(float f) {
  f = flush(f);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// --- the block sums of x ------------------------------------------------------------------------

float block_sum_scalar(const uint16_t* x) {
  float v[16];
  for (int l = 0; l < 16; ++l) v[l] = bf16_to_f32(x[l]) + bf16_to_f32(x[l + 16]);
  for (int h = 8; h >= 1; h /= 2)
    for (int l = 0; l < h; ++l) v[l] += v[l + h];
  return v[0];
}

#if defined(TM_SIMD)
inline __m512 widen(const uint16_t* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}

float block_sum_simd(const uint16_t* x) {  // block_sum_scalar's order, lane by lane
  const __m512 v = _mm512_add_ps(widen(x), widen(x + 16));
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 e = _mm_add_ps(c, _mm_movehl_ps(c, c));
  return _mm_cvtss_f32(_mm_add_ss(e, _mm_movehdup_ps(e)));
}
#endif

// --- the tile kernel -----------------------------------------------------------------------------

struct Problem {
  const uint8_t* w;     // packed tiles
  const uint16_t* x;    // [M, K] bf16
  const float* sx;      // [nb, M] block sums of x
  uint16_t* y;          // [M, N] bf16
  int64_t M, N, K, nb;
  int qtype;            // 0 Q4_1, 1 Q8_0
};

// The weight vector of pair p of a tile-block, as float pairs: w[j][h] = q[j, 2p + h].
void unpack_scalar(const uint8_t* blk, int qtype, int p, float w[TILE][2]) {
  for (int j = 0; j < TILE; ++j)
    for (int h = 0; h < 2; ++h) {
      const uint8_t v = qtype == 0 ? blk[32 * (p % 8) + 2 * j + h] : blk[32 * p + 2 * j + h];
      w[j][h] = qtype == 0 ? static_cast<float>((v >> (p / 8) * 4) & 15)
                           : static_cast<float>(static_cast<int8_t>(v));
    }
}

// The order in which S adds the pairs p, and the chain each goes to (see the arithmetic above).
inline int pair_at(int qtype, int chains, int i) {
  if (qtype == 0) return chains == 2 ? i : (i % 2) * 8 + i / 2;
  return chains == 2 ? (i % 8) * 2 + i / 8 : i;
}
inline int chain_of(int qtype, int p) { return qtype == 0 ? p / 8 : p % 2; }

// Portable: rows m0..m0+mt of tile t, the same arithmetic and order as tile_simd.
void tile_portable(const Problem& p, int64_t t, int64_t m0, int64_t mt) {
  const int64_t tb = tile_block_bytes(p.qtype);
  const int chains = mt < CHAIN_ROWS ? 2 : 1;
  for (int64_t i = 0; i < mt; ++i) {
    const int64_t r = m0 + i;
    float acc[TILE] = {};
    for (int64_t b = 0; b < p.nb; ++b) {
      const uint8_t* blk = p.w + (t * p.nb + b) * tb;
      const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + (p.qtype == 0 ? 256 : 512));
      const uint16_t* xr = p.x + r * p.K + b * QK;
      float s[2][TILE] = {};
      for (int n = 0; n < PAIRS; ++n) {
        const int pp = pair_at(p.qtype, chains, n), c = chains == 2 ? chain_of(p.qtype, pp) : 0;
        float w[TILE][2];
        unpack_scalar(blk, p.qtype, pp, w);
        const float x0 = bf16_to_f32(xr[2 * pp]), x1 = bf16_to_f32(xr[2 * pp + 1]);
        for (int j = 0; j < TILE; ++j) s[c][j] = dp_pair(s[c][j], w[j][0], w[j][1], x0, x1);
      }
      for (int j = 0; j < TILE; ++j) {
        const float sum = chains == 2 ? s[0][j] + s[1][j] : s[0][j];
        acc[j] = std::fma(sum, f16_to_f32(scales[j]), acc[j]);
        if (p.qtype == 0)
          acc[j] = std::fma(f16_to_f32(scales[TILE + j]), p.sx[b * p.M + r], acc[j]);
      }
    }
    for (int j = 0; j < TILE && t * TILE + j < p.N; ++j)
      p.y[r * p.N + t * TILE + j] = to_bf16(acc[j]);
  }
}

#if defined(TM_SIMD)
// s += w . (the bf16 pair at x broadcast to every lane), the broadcast folded into the
// instruction's memory operand ({1to16}): the intrinsic form costs a separate vpbroadcastd.
inline __m512 dp_bcast(__m512 s, __m512i w, const uint16_t* x) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0"
      : "+v"(s)
      : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return s;
}

// Asks for the `bytes` bytes at `at`, one line at a time, into the cache level `hint` names.
template <int HINT>
inline void prefetch_bytes(const uint8_t* at, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(at + off), static_cast<_mm_hint>(HINT));
}

// The two weight vectors of Q4_1 chunk c (32 bytes at `chunk`): pairs c (low nibbles) and c + 8
// (high), words 2j + h = q[j, 2p + h] as exact bf16.
inline void q4_vectors(const uint8_t* chunk, __m512i table, __m512i& lo, __m512i& hi) {
  const __m512i words =
      _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
  lo = _mm512_permutexvar_epi16(words, table);
  hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
}

// The weight vector of Q8_0 pair p (32 bytes at `chunk`): words 2j + h = q[j, 2p + h] as
// exact bf16 (|q| <= 128).
inline __m512i q8_vector(const uint8_t* chunk) {
  const __m512 e = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk))));
  const __m512 o = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(o, e);  // words 0..15 from e, 16..31 from o
}

// Rows m0..m0+MT of tiles t..t+NT-1: NT x MT float32 accumulators of 16 features (and the block
// sums S, in CH chains) stay in registers across the K blocks. The NT tiles' work is independent
// and interleaved, so that their chains overlap (one tile of one row has two chains of 8
// dependent vdpbf16ps per block); measured at 1 row, 2 threads: the Q8_0 LM head 13 % faster,
// the Q4_1 projections 2 % (bench/results/2026-12-03-decode-roofline). Each tile's arithmetic
// is the same at any NT. `unpacked` (null: unpack in registers only; used at NT = 1 only): the
// tile's weight vectors, K/2 of them, written by the first group (`fresh`) and read by the next
// ones, so that a tile is unpacked once per call.
template <int QTYPE, int MT, int NT = 1>
void tile_simd(const Problem& p, int64_t t, int64_t m0, __m512i* unpacked, bool fresh) {
  static_assert(NT == 1 || MT < CHAIN_ROWS, "several tiles at once: groups of few rows only");
  constexpr int CH = MT < CHAIN_ROWS ? 2 : 1;
  constexpr int64_t TB = QTYPE == 0 ? Q4_TB : Q8_TB;
  const __m512i table = _mm512_loadu_si512(gguf_scalars::kNibbleBf16);  // nibble -> bf16
  const bool shared = NT == 1 && unpacked != nullptr;
  __m512 acc[NT][MT];
  for (int u = 0; u < NT; ++u)
    for (int i = 0; i < MT; ++i) acc[u][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.nb; ++b) {
    const uint8_t* blk[NT];
    for (int u = 0; u < NT; ++u) blk[u] = p.w + ((t + u) * p.nb + b) * TB;
    if (MT >= 8 && (unpacked == nullptr || fresh))  // measured: -15 % at 8-16 rows (gate_up)
      prefetch_bytes<_MM_HINT_T0>(blk[0] + PREFETCH_BLOCKS * TB, TB);
    if (MT < 8)
      for (int u = 0; u < NT; ++u)
        prefetch_bytes<_MM_HINT_T1>(blk[u] + FEW_ROWS_PREFETCH_BLOCKS * TB, TB);
    const uint16_t* xb = p.x + m0 * p.K + b * QK;
    __m512 s[NT][CH][MT];
    for (int u = 0; u < NT; ++u)
      for (int c = 0; c < CH; ++c)
        for (int i = 0; i < MT; ++i) s[u][c][i] = _mm512_setzero_ps();
    if (QTYPE == 0) {
      for (int c = 0; c < 8; ++c) {
#pragma GCC unroll 2
        for (int u = 0; u < NT; ++u) {
          __m512i lo, hi;
          if (shared && !fresh) {
            lo = _mm512_load_si512(unpacked + b * PAIRS + c);
            hi = _mm512_load_si512(unpacked + b * PAIRS + c + 8);
          } else {
            q4_vectors(blk[u] + 32 * c, table, lo, hi);
            if (shared) {
              _mm512_store_si512(unpacked + b * PAIRS + c, lo);
              _mm512_store_si512(unpacked + b * PAIRS + c + 8, hi);
            }
          }
#pragma GCC unroll 16
          for (int i = 0; i < MT; ++i) s[u][0][i] = dp_bcast(s[u][0][i], lo, xb + i * p.K + 2 * c);
#pragma GCC unroll 16
          for (int i = 0; i < MT; ++i)
            s[u][CH - 1][i] = dp_bcast(s[u][CH - 1][i], hi, xb + i * p.K + 2 * (c + 8));
        }
      }
    } else {
      for (int pp = 0; pp < PAIRS; ++pp) {
        const int c = CH == 2 ? pp % 2 : 0;
#pragma GCC unroll 2
        for (int u = 0; u < NT; ++u) {
          __m512i w;
          if (shared && !fresh) {
            w = _mm512_load_si512(unpacked + b * PAIRS + pp);
          } else {
            w = q8_vector(blk[u] + 32 * pp);
            if (shared) _mm512_store_si512(unpacked + b * PAIRS + pp, w);
          }
#pragma GCC unroll 16
          for (int i = 0; i < MT; ++i) s[u][c][i] = dp_bcast(s[u][c][i], w, xb + i * p.K + 2 * pp);
        }
      }
    }
    const float* sx = p.sx + b * p.M + m0;
#pragma GCC unroll 2
    for (int u = 0; u < NT; ++u) {
      const uint8_t* sc = blk[u] + (QTYPE == 0 ? 256 : 512);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
#pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) {
        const __m512 sum = CH == 2 ? _mm512_add_ps(s[u][0][i], s[u][CH - 1][i]) : s[u][0][i];
        acc[u][i] = _mm512_fmadd_ps(sum, d, acc[u][i]);
      }
      if (QTYPE == 0) {
        const __m512 m =
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32)));
#pragma GCC unroll 16
        for (int i = 0; i < MT; ++i)
          acc[u][i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i]), acc[u][i]);
      }
    }
  }
  for (int u = 0; u < NT; ++u) {
    const int64_t n0 = (t + u) * TILE;
    const __mmask16 mask =
        p.N - n0 >= TILE ? 0xFFFF : static_cast<__mmask16>((1u << (p.N - n0)) - 1);
    for (int i = 0; i < MT; ++i)
      _mm256_mask_storeu_epi16(p.y + (m0 + i) * p.N + n0, mask,
                               (__m256i)_mm512_cvtneps_pbh(acc[u][i]));
  }
}

template <int QTYPE>
void tile_rows(const Problem& p, int64_t t, int64_t m0, int64_t mt, __m512i* unpacked,
               bool fresh) {
  switch (mt) {
#define TM_CASE(n) \
  case n: tile_simd<QTYPE, (n < M_TILE ? n : M_TILE)>(p, t, m0, unpacked, fresh); break;
    TM_CASE(1) TM_CASE(2) TM_CASE(3) TM_CASE(4) TM_CASE(5) TM_CASE(6) TM_CASE(7) TM_CASE(8)
    TM_CASE(9) TM_CASE(10) TM_CASE(11) TM_CASE(12) TM_CASE(13) TM_CASE(14) TM_CASE(15)
#undef TM_CASE
    default: tile_simd<QTYPE, M_TILE>(p, t, m0, unpacked, fresh); break;
  }
}

// Tiles t and t + 1 for all of a call's rows, when there are fewer than CHAIN_ROWS (one group).
template <int QTYPE>
void tile_pair_rows(const Problem& p, int64_t t, int64_t mt) {
  switch (mt) {
    case 1: tile_simd<QTYPE, 1, 2>(p, t, 0, nullptr, true); break;
    case 2: tile_simd<QTYPE, 2, 2>(p, t, 0, nullptr, true); break;
    default: tile_simd<QTYPE, 3, 2>(p, t, 0, nullptr, true); break;
  }
}

// This thread's buffer for one tile's unpacked weight vectors (64-byte aligned), or null when one
// group covers every row.
struct alignas(64) Vector { uint8_t bytes[64]; };

__m512i* unpacked_buffer(const Problem& p, int64_t groups) {
  thread_local std::vector<Vector> buffer;
  if (groups < 2) return nullptr;
  if (static_cast<int64_t>(buffer.size()) < p.nb * PAIRS) buffer.resize(p.nb * PAIRS);
  return reinterpret_cast<__m512i*>(buffer.data());
}
#endif

#if defined(TM_AMX)
// --- AMX: the two-chain arithmetic on tiles ---------------------------------------------------
// Rows in groups of at most AMX_ROWS (balanced). Measured on this kernel's AMX CPUs (Sapphire
// Rapids class): one TDPBF16PS sums the products of its pairs' element 0 in one float32 chain and
// those of element 1 in another, each from zero in pair order, and adds both to C (Intel's
// pseudocode states one chain continued from C). So a tile-block's S is one TDPBF16PS from a
// zeroed C with tile_simd's two chains in the two elements: slot j of A and B holds product j of
// chain 0 in element 0 and product j of chain 1 in element 1, in the two-chain order (pair_at(
// qtype, 2, i), k = 2p + 1 then 2p): S = chain 0 + chain 1, then tile_simd's d and m fmas. A
// row's bits are those of the row alone (one row: two chains), at any M
// (tests/test_quant_tiled.py). x is staged per call into A's layout (`xa`, zero rows past a
// group's end); a tile's blocks are unpacked once per call into a per-thread buffer of
// K/32 x 1 KiB that every group's B loads read.
constexpr int AMX_ROWS = 16;              // rows of an A / C tile
constexpr int AMX_MIN_ROWS = CHAIN_ROWS;  // fewer rows: tile_simd (the same bits)
constexpr int64_t AMX_TILE = AMX_ROWS * QK;  // uint16 of one A (or B) tile: 16 x 32

// Tiles 0-5, each 16 rows of 64 bytes: C0, C1, A0, B0, A1, B1 (two blocks in flight).
void amx_configure() {
  pk_amx::TileConfig c;
  for (int i = 0; i < 6; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = AMX_ROWS;
  }
  _tile_loadconfig(&c);
}

inline int64_t amx_groups(int64_t M) { return (M + AMX_ROWS - 1) / AMX_ROWS; }
inline int64_t group_rows(int64_t M, int64_t groups, int64_t g) {
  return M / groups + (g < M % groups ? 1 : 0);
}
// The first row of group g (the sizes of groups 0..g-1 summed).
inline int64_t group_start(int64_t M, int64_t groups, int64_t g) {
  return g * (M / groups) + std::min(g, M % groups);
}
// k of product j (0..15) of chain c of a block, in the two-chain order.
inline int chain_k(int qtype, int c, int j) {
  return 2 * pair_at(qtype, 2, 8 * c + j / 2) + 1 - j % 2;
}

// xa for group g, block b: an A tile [16 rows][16 slots][2], slot j of row r holding
// x[m0 + r, 32 b + chain_k(c, j)] in element c.
// Word 2j + c of a slot row holds x word chain_k(qtype, c, j): the vpermw index of amx_stage.
const uint16_t* amx_order(int qtype) {
  struct alignas(64) Order { uint16_t words[QK]; };
  static const std::array<Order, 2> orders = [] {
    std::array<Order, 2> o{};
    for (int q = 0; q < 2; ++q)
      for (int j = 0; j < PAIRS; ++j)
        for (int c = 0; c < 2; ++c) o[q].words[2 * j + c] = static_cast<uint16_t>(chain_k(q, c, j));
    return o;
  }();
  return orders[qtype].words;
}

void amx_stage(const Problem& p, int64_t groups, int64_t i, uint16_t* xa) {
  const int64_t g = i / p.nb, b = i % p.nb;
  const int64_t m0 = group_start(p.M, groups, g), mt = group_rows(p.M, groups, g);
  uint16_t* out = xa + i * AMX_TILE;
  const __m512i idx = _mm512_load_si512(amx_order(p.qtype));
  for (int64_t r = 0; r < AMX_ROWS; ++r) {
    const __m512i v = r < mt ? _mm512_permutexvar_epi16(
                                   idx, _mm512_loadu_si512(p.x + (m0 + r) * p.K + b * QK))
                             : _mm512_setzero_si512();
    _mm512_store_si512(out + r * QK, v);
  }
}

// The slots 2i and 2i + 1 from the weight vectors of chain 0's and chain 1's pair at position
// i (words 2n + h = q[n, 2p + h]): k = 2p + 1 of both, then k = 2p of both.
inline void amx_slots(__m512i chain0, __m512i chain1, __m512i* out) {
  constexpr __mmask32 kOdd = 0xAAAAAAAAu;  // element 1 of every slot
  out[0] = _mm512_mask_blend_epi16(kOdd, _mm512_srli_epi32(chain0, 16), chain1);
  out[1] = _mm512_mask_blend_epi16(kOdd, chain0, _mm512_slli_epi32(chain1, 16));
}

// Tile t's weights as B tiles: wb[b * 16 + j] = slot j of block b.
template <int QTYPE>
void amx_unpack(const Problem& p, int64_t t, __m512i* wb) {
  constexpr int64_t TB = QTYPE == 0 ? Q4_TB : Q8_TB;
  const __m512i table = _mm512_loadu_si512(gguf_scalars::kNibbleBf16);
  const uint8_t* base = p.w + t * p.nb * TB;
  for (int64_t b = 0; b < p.nb; ++b) {
    const uint8_t* blk = base + b * TB;
    prefetch_bytes<_MM_HINT_T0>(blk + PREFETCH_BLOCKS * TB, TB);
    __m512i* out = wb + b * PAIRS;
    if (QTYPE == 0) {
      for (int c = 0; c < 8; ++c) {  // chain 0: p = c (low nibbles), chain 1: c + 8 (high)
        __m512i lo, hi;
        q4_vectors(blk + 32 * c, table, lo, hi);
        amx_slots(lo, hi, out + 2 * c);
      }
    } else {
      for (int i = 0; i < 8; ++i)  // chain 0: p = 2i, chain 1: p = 2i + 1
        amx_slots(q8_vector(blk + 64 * i), q8_vector(blk + 64 * i + 32), out + 2 * i);
    }
  }
}

// acc[i] += d * S[i] (+ m * sx[i]) for the MT rows of a stored C: tile_simd's fmas.
template <int QTYPE, int MT>
inline void amx_apply(const Problem& p, int64_t t, int64_t b, int64_t m0, const float* c,
                      __m512* acc) {
  constexpr int64_t TB = QTYPE == 0 ? Q4_TB : Q8_TB;
  const uint8_t* sc = p.w + (t * p.nb + b) * TB + (QTYPE == 0 ? 256 : 512);
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
#pragma GCC unroll 16
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_fmadd_ps(_mm512_load_ps(c + i * TILE), d, acc[i]);
  if (QTYPE == 0) {
    const __m512 m =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32)));
    const float* sx = p.sx + b * p.M + m0;
#pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i]), acc[i]);
  }
}

// S of block b into C tile `c` from A tile `a` and B tile `w` (compile-time tile numbers).
#define TM_AMX_BLOCK(c, a, w, b)                     \
  do {                                               \
    _tile_zero(c);                                   \
    _tile_loadd(a, xa + (b) * AMX_TILE, 64);         \
    _tile_loadd(w, wb + (b) * PAIRS, 64);            \
    _tile_dpbf16ps(c, a, w);                         \
  } while (0)

// Rows m0..m0+MT of tile t from the group's staged x and the tile's unpacked B tiles, two
// blocks in flight (C0 and C1); the blocks still meet acc in order.
template <int QTYPE, int MT>
void tile_amx(const Problem& p, int64_t t, int64_t m0, const uint16_t* xa, const __m512i* wb,
              const uint8_t* next) {
  alignas(64) float c0[AMX_ROWS * TILE], c1[AMX_ROWS * TILE];
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  // Software-pipelined: blocks b + 2 and b + 3 run on the tile unit while the vector units
  // apply blocks b and b + 1.
  TM_AMX_BLOCK(0, 2, 3, 0);
  if (p.nb > 1) TM_AMX_BLOCK(1, 4, 5, 1);
  for (int64_t b = 0; b < p.nb; b += 2) {
    const bool second = b + 1 < p.nb;
    _tile_stored(0, c0, 64);
    if (second) _tile_stored(1, c1, 64);
    if (b + 2 < p.nb) TM_AMX_BLOCK(0, 2, 3, b + 2);
    if (b + 3 < p.nb) TM_AMX_BLOCK(1, 4, 5, b + 3);
    if (next != nullptr) {  // the next tile's blocks b, b + 1 into L2 while this one computes
      constexpr int64_t TB = QTYPE == 0 ? Q4_TB : Q8_TB;
      prefetch_bytes<_MM_HINT_T1>(next + b * TB, (second ? 2 : 1) * TB);
    }
    amx_apply<QTYPE, MT>(p, t, b, m0, c0, acc);
    if (second) amx_apply<QTYPE, MT>(p, t, b + 1, m0, c1, acc);
  }
  const int64_t n0 = t * TILE;
  const __mmask16 mask = p.N - n0 >= TILE ? 0xFFFF : static_cast<__mmask16>((1u << (p.N - n0)) - 1);
  for (int i = 0; i < MT; ++i)
    _mm256_mask_storeu_epi16(p.y + (m0 + i) * p.N + n0, mask, (__m256i)_mm512_cvtneps_pbh(acc[i]));
}
#undef TM_AMX_BLOCK

template <int QTYPE>
void amx_rows(const Problem& p, int64_t t, int64_t m0, int64_t mt, const uint16_t* xa,
              const __m512i* wb, const uint8_t* next) {
  switch (mt) {
#define TM_CASE(n) \
  case n: tile_amx<QTYPE, n>(p, t, m0, xa, wb, next); break;
    TM_CASE(4) TM_CASE(5) TM_CASE(6) TM_CASE(7) TM_CASE(8) TM_CASE(9) TM_CASE(10) TM_CASE(11)
    TM_CASE(12) TM_CASE(13) TM_CASE(14) TM_CASE(15)
#undef TM_CASE
    default: tile_amx<QTYPE, AMX_ROWS>(p, t, m0, xa, wb, next); break;
  }
}

// One thread's share on AMX: its contiguous range of tiles, each unpacked once, then every
// group. `xa`: the staged x of every group (amx_stage).
void amx_share(const Problem& p, int64_t id, int64_t n, const uint16_t* xa) {
  thread_local std::vector<Vector> buffer;
  if (static_cast<int64_t>(buffer.size()) < p.nb * PAIRS) buffer.resize(p.nb * PAIRS);
  __m512i* wb = reinterpret_cast<__m512i*>(buffer.data());
  const int64_t tiles = num_tiles(p.N);
  const int64_t t0 = tiles * id / n, t1 = tiles * (id + 1) / n;
  const int64_t groups = amx_groups(p.M);
  amx_configure();
  for (int64_t t = t0; t < t1; ++t) {
    if (p.qtype == 0) amx_unpack<0>(p, t, wb);
    else amx_unpack<1>(p, t, wb);
    for (int64_t g = 0, m0 = 0; g < groups; ++g) {
      const int64_t mt = group_rows(p.M, groups, g);
      const uint16_t* xg = xa + g * p.nb * AMX_TILE;
      const uint8_t* next = g == 0 && t + 1 < t1 ? p.w + (t + 1) * p.nb * tile_block_bytes(p.qtype)
                                                 : nullptr;
      if (p.qtype == 0) amx_rows<0>(p, t, m0, mt, xg, wb, next);
      else amx_rows<1>(p, t, m0, mt, xg, wb, next);
      m0 += mt;
    }
  }
  _tile_release();
}
#endif

// One thread's share: its contiguous range of tiles, each for every row group.
void matmul_share(const Problem& p, int64_t id, int64_t n) {
  const int64_t tiles = num_tiles(p.N);
  const int64_t t0 = tiles * id / n, t1 = tiles * (id + 1) / n;
  const int64_t groups = (p.M + M_TILE - 1) / M_TILE;
#if defined(TM_SIMD)
  if (p.M < CHAIN_ROWS) {  // one group of few rows: two tiles at a time (tile_simd)
    int64_t t = t0;
    for (; t + 1 < t1; t += 2) {
      if (p.qtype == 0) tile_pair_rows<0>(p, t, p.M);
      else tile_pair_rows<1>(p, t, p.M);
    }
    if (t < t1) {
      if (p.qtype == 0) tile_rows<0>(p, t, 0, p.M, nullptr, true);
      else tile_rows<1>(p, t, 0, p.M, nullptr, true);
    }
    return;
  }
  __m512i* unpacked = unpacked_buffer(p, groups);
#endif
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0, m0 = 0; g < groups; ++g) {  // balanced: sizes differ by at most one
      const int64_t mt = p.M / groups + (g < p.M % groups ? 1 : 0);
#if defined(TM_SIMD)
      if (p.qtype == 0) tile_rows<0>(p, t, m0, mt, unpacked, g == 0);
      else tile_rows<1>(p, t, m0, mt, unpacked, g == 0);
#else
      tile_portable(p, t, m0, mt);
#endif
      m0 += mt;
    }
}


// This thread's share of the call: on AMX when x was staged for it (`xa`), else matmul_share.
void thread_share(const Problem& p, const uint16_t* xa) {
#if defined(TM_AMX)
  if (xa != nullptr) {
    amx_share(p, omp_get_thread_num(), omp_get_num_threads(), xa);
    return;
  }
#else
  (void)xa;
#endif
  matmul_share(p, omp_get_thread_num(), omp_get_num_threads());
}

void block_sums(const Problem& p, int64_t i, float* sx) {
  const int64_t r = i / p.nb, b = i % p.nb;  // read row-major, write block-major
#if defined(TM_SIMD)
  sx[b * p.M + r] = block_sum_simd(p.x + i * QK);
#else
  sx[b * p.M + r] = block_sum_scalar(p.x + i * QK);
#endif
}

}  // namespace

extern "C" {

// Bytes of the packed form of an [N, K] matrix (K % 32 == 0) in format qtype (0 Q4_1, 1 Q8_0).
int64_t tiled_packed_bytes(int qtype, int64_t N, int64_t K) {
  return num_tiles(N) * (K / QK) * tile_block_bytes(qtype);
}

// Repacks GGUF blocks [N, K/32 * block bytes] (ggml's layout) into `out` (tiled_packed_bytes).
// Returns 0, or -1 for an unknown qtype or a bad K.
int tiled_pack(const uint8_t* blocks, int qtype, int64_t N, int64_t K, uint8_t* out,
               int threads) {
  if ((qtype != 0 && qtype != 1) || K <= 0 || K % QK != 0 || N < 0) return -1;
  const int64_t nb = K / QK, tiles = num_tiles(N), tb = tile_block_bytes(qtype);
#pragma omp parallel for schedule(static) num_threads(std::max(1, threads))
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < nb; ++b)
      pack_tile_block(blocks, qtype, N, nb, t, b, out + (t * nb + b) * tb);
  return 0;
}

// y [M, N] bf16 = x [M, K] bf16 times the packed W (qtype 0 Q4_1, 1 Q8_0), in one parallel
// region (the block sums of x first, in a buffer of the calling thread reused across calls).
// Returns 0, or -1 for bad sizes.
int tiled_linear(const uint16_t* x, const uint8_t* packed, int qtype, uint16_t* y, int64_t M,
                 int64_t N, int64_t K, int threads) {
  if ((qtype != 0 && qtype != 1) || K <= 0 || K % QK != 0 || M < 0 || N < 0) return -1;
  if (M == 0 || N == 0) return 0;
  const int64_t nb = K / QK;
  thread_local std::vector<float> sx;
  if (static_cast<int64_t>(sx.size()) < M * nb) sx.resize(M * nb);
  const Problem p{packed, x, sx.data(), y, M, N, K, nb, qtype};
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, num_tiles(N))));
  float* sums = sx.data();
  uint16_t* xa = nullptr;  // the staged x of every group: the call runs on AMX
  [[maybe_unused]] int64_t groups = 0;
#if defined(TM_AMX)
  if (M >= AMX_MIN_ROWS && pk_amx::granted()) {
    groups = amx_groups(M);
    thread_local std::vector<Vector> staged;  // 64 bytes = one A-tile row
    if (static_cast<int64_t>(staged.size()) < groups * nb * AMX_ROWS)
      staged.resize(groups * nb * AMX_ROWS);
    xa = reinterpret_cast<uint16_t*>(staged.data());
  }
#endif
#pragma omp parallel num_threads(n)
  {
    if (qtype == 0) {
#pragma omp for schedule(static) nowait
      for (int64_t i = 0; i < M * nb; ++i) block_sums(p, i, sums);
    }
#if defined(TM_AMX)
#pragma omp for schedule(static)  // its barrier also ends the block sums
    for (int64_t i = 0; i < groups * nb; ++i) amx_stage(p, groups, i, xa);
#else
#pragma omp barrier  // the block sums first
#endif
    thread_share(p, xa);
  }
  return 0;
}

// "amx-bf16" (AMX built and granted to this process: 4 rows or more run on tiles),
// "avx512-bf16" or "portable".
const char* tiled_simd_paths() {
#if defined(TM_AMX)
  if (pk_amx::granted()) return "amx-bf16";
#endif
#if defined(TM_SIMD)
  return "avx512-bf16";
#else
  return "portable";
#endif
}

}  // extern "C"
