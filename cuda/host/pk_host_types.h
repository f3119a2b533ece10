// pk_host_types.h: CUDA's built-in vector types, dim3/uint3 and the 16-bit float types
// (__half, __nv_bfloat16 and their pairs) for host C++, with the layouts the GPU uses.
//
// Layout contract (what kernels rely on when they reinterpret 16-byte loads):
// - __half / __nv_bfloat16 are 2 bytes holding the IEEE binary16 / bfloat16 bits;
// - __half2 / __nv_bfloat162 are 4 bytes, .x in the low half (bytes 0-1), .y in bytes 2-3;
// - uint4/int4/float4 are 16-byte aligned, uint2/float2 8-byte aligned, as on the GPU.
// Conversions from float round to nearest, ties to even, like the _rn intrinsics; NaN stays NaN,
// overflow gives infinity, and float16 subnormals are produced and read exactly.
#pragma once

#include <cstdint>
#include <cstring>

#include "pk_host_hooks.h"

// ---- vector types ----
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct uint3 { unsigned int x, y, z; };

inline uint2 make_uint2(unsigned int x, unsigned int y) { return {x, y}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return {x, y, z, w};
}
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return {x, y, z}; }

// dim3: unspecified components default to 1, as in CUDA.
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

namespace pk_host {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Shifts `m` right by `s` (1..31) rounding to nearest, ties to even.
inline uint32_t shift_right_rne(uint32_t m, int s) {
  uint32_t q = m >> s;
  uint32_t rem = m & ((1u << s) - 1u);
  uint32_t half = 1u << (s - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return q;
}

// float -> IEEE binary16 bits, round to nearest even (overflow -> inf, NaN -> quiet NaN).
inline uint16_t float_to_half_bits(float f) {
  uint32_t x = float_bits(f);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 -> inf
  uint32_t e = a >> 23;
  uint32_t m = (a & 0x7fffffu) | 0x800000u;
  if (e >= 113) {  // normal half: drop 13 mantissa bits (a carry may bump the exponent)
    uint32_t h = ((e - 112u) << 10) | ((a & 0x7fffffu) >> 13);
    uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  if (a <= 0x33000000u) return sign;  // <= 2^-25 rounds to (signed) zero
  // subnormal half: value = k * 2^-24 with k = m * 2^(e - 126)
  return static_cast<uint16_t>(sign | shift_right_rne(m, static_cast<int>(126 - e)));
}

// IEEE binary16 bits -> float (exact).
inline float half_bits_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu;
  uint32_t m = h & 0x3ffu;
  if (e == 0x1f) return bits_float(sign | 0x7f800000u | (m << 13));
  if (e != 0) return bits_float(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0) return bits_float(sign);
  // subnormal: m * 2^-24, normalise the mantissa
  int shift = 0;
  while (!(m & 0x400u)) {
    m <<= 1;
    ++shift;
  }
  return bits_float(sign | ((113u - shift) << 23) | ((m & 0x3ffu) << 13));
}

// float -> bfloat16 bits, round to nearest even (NaN -> quiet NaN with the sign kept).
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

}  // namespace pk_host

// ---- 16-bit float types ----
struct __half_raw { unsigned short x; };
struct __nv_bfloat16_raw { unsigned short x; };

struct __half {
  unsigned short __x;
  __half() = default;
  constexpr __half(__half_raw r) : __x(r.x) {}
  __half(float f) : __x(pk_host::float_to_half_bits(f)) {}
  __half(double d) : __x(pk_host::float_to_half_bits(static_cast<float>(d))) {}
  operator float() const { return pk_host::half_bits_to_float(__x); }
  operator __half_raw() const { return __half_raw{__x}; }
};

struct __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  constexpr __nv_bfloat16(__nv_bfloat16_raw r) : __x(r.x) {}
  __nv_bfloat16(float f) : __x(pk_host::float_to_bf16_bits(f)) {}
  __nv_bfloat16(double d) : __x(pk_host::float_to_bf16_bits(static_cast<float>(d))) {}
  operator float() const { return pk_host::bf16_bits_to_float(__x); }
  operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
};

struct alignas(4) __half2 {
  __half x, y;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

typedef __half half;
typedef __half2 half2;
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

static_assert(sizeof(__half) == 2 && sizeof(__nv_bfloat16) == 2, "16-bit float types");
static_assert(sizeof(__half2) == 4 && sizeof(__nv_bfloat162) == 4, "16-bit float pairs");
static_assert(sizeof(uint4) == 16 && alignof(uint4) == 16, "uint4 layout");

// ---- conversions (cuda_fp16.h / cuda_bf16.h names); each is a preemption point ----
inline float __half2float(__half h) {
  pk_host::preemption_point();
  return pk_host::half_bits_to_float(h.__x);
}
inline __half __float2half(float f) {
  pk_host::preemption_point();
  return __half(__half_raw{pk_host::float_to_half_bits(f)});
}
inline __half __float2half_rn(float f) { return __float2half(f); }
inline float __bfloat162float(__nv_bfloat16 b) {
  pk_host::preemption_point();
  return pk_host::bf16_bits_to_float(b.__x);
}
inline __nv_bfloat16 __float2bfloat16(float f) {
  pk_host::preemption_point();
  return __nv_bfloat16(__nv_bfloat16_raw{pk_host::float_to_bf16_bits(f)});
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }

inline __half2 __floats2half2_rn(float lo, float hi) {
  return __half2{__float2half_rn(lo), __float2half_rn(hi)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return __nv_bfloat162{__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
inline __half2 __float22half2_rn(float2 f) { return __floats2half2_rn(f.x, f.y); }
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __floats2bfloat162_rn(f.x, f.y); }
inline __half2 __halves2half2(__half lo, __half hi) { return __half2{lo, hi}; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return __nv_bfloat162{lo, hi};
}
inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 b) {
  return float2{__bfloat162float(b.x), __bfloat162float(b.y)};
}
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline float __low2float(__nv_bfloat162 b) { return __bfloat162float(b.x); }
inline float __high2float(__nv_bfloat162 b) { return __bfloat162float(b.y); }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 b) { return b.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 b) { return b.y; }

inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { return __half(__half_raw{u}); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
  return __nv_bfloat16(__nv_bfloat16_raw{u});
}
