// 8-bit cache codes to bf16 pairs by byte tables, for the vdpbf16ps paths of kernel.h on CPUs
// with AVX-512 VBMI (PK_CODE_LUT): the codes go from the cache straight into the layouts those
// paths multiply, with no bf16 rows staged in between.
//
// Every e4m3fn, e5m2 and int8 value is a bf16 (simd.h's codes_to_bf16 says why), so the
// conversion is exact. A bf16 word is looked up as two bytes: the 128 magnitudes' low bytes and
// high bytes are two 128-entry tables, each held in two registers and indexed by a code's low 7
// bits in one vpermi2b (64 codes at a time); the sign bit is then OR'd into the high byte. fp8
// codes are sign and magnitude already; an int8 code's magnitude comes from vpabsb, with -128
// (magnitude 128, outside the table) given its high byte by one masked move. Interleaving the
// two byte planes (unpacklo/hi_epi8) gives 32 words each, in the lane order of those unpacks,
// which the layouts below are built around: 5 instructions per 64 fp8 codes (8 for int8), where
// simd.h's bit arithmetic takes 9 per 32.
#pragma once

#include "simd.h"

#if defined(PK_AVX512) && defined(__AVX512VBMI__)
#define PK_CODE_LUT 1

namespace {

// The bf16 bits of magnitudes 0..127 of code type C as byte planes: lo[0] holds the low bytes
// of magnitudes 0..63, lo[1] of 64..127; hi the same for the high bytes.
struct CodeLut {
  __m512i lo[2], hi[2];
};

template <typename C>
struct CodeLutTable {
  alignas(64) uint8_t lo[128], hi[128];
  CodeLutTable() {
    for (int i = 0; i < 128; ++i) {
      const uint16_t bits = bf16_bits(std::is_same_v<C, int8_t> ? static_cast<float>(i)
                                                                : scalar_float(code_of(i)));
      lo[i] = static_cast<uint8_t>(bits & 0xFF);
      hi[i] = static_cast<uint8_t>(bits >> 8);
    }
  }
  static C code_of(int i) {
    C c;
    const uint8_t b = static_cast<uint8_t>(i);
    std::memcpy(&c, &b, 1);
    return c;
  }
};

template <typename C>
const CodeLut& code_lut() {
  static const CodeLut lut = [] {
    static const CodeLutTable<C> table;
    CodeLut t;
    for (int h = 0; h < 2; ++h) {
      t.lo[h] = _mm512_load_si512(table.lo + 64 * h);
      t.hi[h] = _mm512_load_si512(table.hi + 64 * h);
    }
    return t;
  }();
  return lut;
}

// The bf16 words of the 64 codes in z: out[0] = the codes at bytes 0..7 of each 128-bit lane L
// (words 8L..8L+7 of out[0] hold bytes 16L..16L+7 of z), out[1] = bytes 8..15 of each lane.
template <typename C>
PK_INLINE void codes_to_bf16_lanes(__m512i z, const CodeLut& t, __m512i* out) {
  __m512i idx = z;
  if constexpr (std::is_same_v<C, int8_t>) idx = _mm512_abs_epi8(z);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo[0], idx, t.lo[1]);
  __m512i hi = _mm512_permutex2var_epi8(t.hi[0], idx, t.hi[1]);
  if constexpr (std::is_same_v<C, int8_t>)  // |-128| = 0x80: bf16 128 = 0x4300
    hi = _mm512_mask_mov_epi8(hi, _mm512_movepi8_mask(idx), _mm512_set1_epi8(0x43));
  hi = _mm512_ternarylogic_epi32(hi, z, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
  out[0] = _mm512_unpacklo_epi8(lo, hi);
  out[1] = _mm512_unpackhi_epi8(lo, hi);
}

// A 4 x 4 transpose of 128-bit lanes: lane g of v[l] <- lane l of v[g].
PK_INLINE void transpose_lanes4(__m512i* v) {
  const __m512i t0 = _mm512_shuffle_i64x2(v[0], v[1], 0x44);  // v0.l0 v0.l1 v1.l0 v1.l1
  const __m512i t1 = _mm512_shuffle_i64x2(v[0], v[1], 0xEE);  // v0.l2 v0.l3 v1.l2 v1.l3
  const __m512i t2 = _mm512_shuffle_i64x2(v[2], v[3], 0x44);
  const __m512i t3 = _mm512_shuffle_i64x2(v[2], v[3], 0xEE);
  v[0] = _mm512_shuffle_i64x2(t0, t2, 0x88);
  v[1] = _mm512_shuffle_i64x2(t0, t2, 0xDD);
  v[2] = _mm512_shuffle_i64x2(t1, t3, 0x88);
  v[3] = _mm512_shuffle_i64x2(t1, t3, 0xDD);
}

// The K codes of 16 keys, elements [x, x + 64) of rows[0..16), as bf16 pairs per key, passed
// to use(c0, kt) four column pairs at a time, for c0 = 0, 2, 4, 6: kt[l][e] lane k =
// (K[k][x + 2c], K[k][x + 2c + 1]) with c = 8l + c0 + e, l < 4, e < 2 (the layout of kernel.h's
// transposed scores).
// The code pairs (16-bit words) are transposed first: words of key pairs (unpack epi16), of key
// quads (unpack epi32: each 128-bit lane then holds two words' columns for 4 keys), then the quads
// gathered by a lane transpose, so that each register holds two columns' 16 keys in the order
// codes_to_bf16_lanes returns them. Half of the words (c0 = 0, 2, then 4, 6) is transposed at a
// time (8 registers of code pairs live, not 16), each step's four lookups come before use()
// multiplies them, and the steps are unrolled so that use()'s accumulators stay in registers:
// faster than using each lookup as it came (bench/results/2026-12-05-kv8-key-steps).
template <typename C, typename F>
PK_INLINE void code_keys_transposed(const C* const* rows, int x, const CodeLut& t, F&& use) {
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // words 4h..4h + 3 of each lane's 8
    __m512i p[8];  // p[k / 2] lane L: words 8L + 4h + i of keys k, k + 1, i < 4
    for (int k = 0; k < 16; k += 2) {
      const __m512i a = _mm512_loadu_si512(rows[k] + x), b = _mm512_loadu_si512(rows[k + 1] + x);
      p[k / 2] = h == 0 ? _mm512_unpacklo_epi16(a, b) : _mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 2
    for (int o = 0; o < 2; ++o) {  // u[g] lane L: words 8L + 4h + 2o, + 1 of keys 4g..4g + 3
      __m512i u[4];
      for (int g = 0; g < 4; ++g)
        u[g] = o == 0 ? _mm512_unpacklo_epi32(p[2 * g], p[2 * g + 1])
                      : _mm512_unpackhi_epi32(p[2 * g], p[2 * g + 1]);
      transpose_lanes4(u);  // u[L] lane g: words 8L + 4h + 2o, + 1 of keys 4g..4g + 3
      __m512i kt[4][2];
      for (int l = 0; l < 4; ++l) codes_to_bf16_lanes<C>(u[l], t, kt[l]);
      use(4 * h + 2 * o, kt);
    }
  }
}

// The V codes of keys v0 and v1, elements [0, 64), as bf16 pairs (v0[e], v1[e]): out[u] lane
// 4L + i holds element 16L + 4u + i.
template <typename C>
PK_INLINE void code_value_pairs(const C* v0, const C* v1, const CodeLut& t, __m512i* out) {
  const __m512i a = _mm512_loadu_si512(v0), b = _mm512_loadu_si512(v1);
  codes_to_bf16_lanes<C>(_mm512_unpacklo_epi8(a, b), t, out);
  codes_to_bf16_lanes<C>(_mm512_unpackhi_epi8(a, b), t, out + 2);
}

}  // namespace

#endif
