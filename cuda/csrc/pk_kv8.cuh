// pk_kv8.cuh: 8-bit KV caches (float8_e4m3fn, float8_e5m2, int8; docs/abi.md): conversions of
// the stored bytes to float and back, and PkKvIo, the loads and stores through which the SIMT
// attention kernels read a cache of their own dtype or an 8-bit one.
//
// Reading: `float(q) * scale[kv_head]`; the kernels fold the scales out of the inner loops
// (k_scale into the query's pre-scale, v_scale into the output's 1 / sum), so the inner loops
// only convert bytes to float. Every 8-bit value is exact in float (and in half), so the
// conversion itself never rounds. On sm_89 and later fp8 pairs go through the hardware
// conversion (cvt.rn.f16x2.e{4m3,5m2}x2, then half -> float); elsewhere (sm_80, the host
// emulator) through bit operations: the byte's exponent and mantissa moved into a float's and
// the bias difference multiplied in, which is exact for subnormals too.
//
// Writing (pk_write_kv_quant_kernel, pk_cache.cuh): `q = convert(x / scale[kv_head])` with the
// division in IEEE float; fp8 saturates to the format's largest finite value and rounds to
// nearest even (NaN stays NaN, keeping its sign), int8 rounds half to even and clamps to
// [-128, 127] (NaN -> 0). sm_89+: cvt.rn.satfinite.e{4m3,5m2}x2.f32; elsewhere the value is
// rounded onto the format's grid in float (adding and subtracting 1.5 * 2^23 * ulp rounds to a
// multiple of ulp, to nearest even) and then encoded, which is exact.
#pragma once
#include "pk_common.cuh"
#include "pk_ops.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(PK_HOST_EMULATION)
#define PK_FP8_HARDWARE 1
#else
#define PK_FP8_HARDWARE 0
#endif

// ---- bytes -> float ----

__device__ __forceinline__ float pk_e4m3_to_float(uint32_t b) {
  const uint32_t mag = b & 0x7fu;
  float f = __uint_as_float(mag << 20) * 0x1p120f;  // exponent bias 7 -> 127
  if (mag == 0x7fu) f = __uint_as_float(0x7fc00000u);  // the only NaN (no infinities)
  return (b & 0x80u) ? -f : f;
}

__device__ __forceinline__ float pk_e5m2_to_float(uint32_t b) {
  const uint32_t mag = b & 0x7fu;
  float f = __uint_as_float(mag << 21) * 0x1p112f;  // exponent bias 15 -> 127
  if (mag >= 0x7cu) f = mag == 0x7cu ? INFINITY : __uint_as_float(0x7fc00000u);
  return (b & 0x80u) ? -f : f;
}

#if PK_FP8_HARDWARE
// Two fp8 values (low byte first) -> two floats through the hardware's fp8x2 -> f16x2.
template <int FMT>
__device__ __forceinline__ float2 pk_fp8x2_to_float2(uint32_t two) {
  uint32_t h;
  const unsigned short in = static_cast<unsigned short>(two & 0xffffu);
  if constexpr (FMT == PK_KV_FP8_E4M3) {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(in));
  } else {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h) : "h"(in));
  }
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}
#endif

// Four stored bytes (the low byte is the first element) of format `fmt` -> four floats.
__device__ __forceinline__ void pk_kv8_to_float4(uint32_t four, int fmt, float (&out)[4]) {
  if (fmt == PK_KV_INT8) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      out[e] = static_cast<float>(static_cast<int8_t>((four >> (8 * e)) & 0xffu));
    return;
  }
#if PK_FP8_HARDWARE
  float2 lo, hi;
  if (fmt == PK_KV_FP8_E4M3) {
    lo = pk_fp8x2_to_float2<PK_KV_FP8_E4M3>(four);
    hi = pk_fp8x2_to_float2<PK_KV_FP8_E4M3>(four >> 16);
  } else {
    lo = pk_fp8x2_to_float2<PK_KV_FP8_E5M2>(four);
    hi = pk_fp8x2_to_float2<PK_KV_FP8_E5M2>(four >> 16);
  }
  out[0] = lo.x;
  out[1] = lo.y;
  out[2] = hi.x;
  out[3] = hi.y;
#else
  if (fmt == PK_KV_FP8_E4M3) {
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = pk_e4m3_to_float((four >> (8 * e)) & 0xffu);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = pk_e5m2_to_float((four >> (8 * e)) & 0xffu);
  }
#endif
}

// ---- float -> byte ----

// `y` (already divided by the scale) stored in fp8 format `fmt` by bit operations.
__device__ __forceinline__ uint32_t pk_float_to_fp8_bits(float y, int fmt) {
  const bool e4 = fmt == PK_KV_FP8_E4M3;
  const int mant = e4 ? 3 : 2, min_exp = e4 ? -6 : -14, bias = e4 ? 7 : 15;
  const float max_finite = e4 ? 448.f : 57344.f;
  const uint32_t sign = (__float_as_uint(y) >> 24) & 0x80u;
  if (y != y) return sign | 0x7fu;
  const float a = fminf(fabsf(y), max_finite);
  const int e = max(static_cast<int>(__float_as_uint(a) >> 23), 127 + min_exp);
  // 1.5 * 2^23 * ulp, where ulp = 2^(e - 127 - mant) is the grid step at |y|
  const float shift = __uint_as_float((static_cast<uint32_t>(e - mant + 23) << 23) | (1u << 22));
  const float r = __fadd_rn(__fadd_rn(a, shift), -shift);
  const uint32_t rb = __float_as_uint(r);
  const int re = static_cast<int>(rb >> 23);
  uint32_t code;
  if (re >= 127 + min_exp) {
    code = (static_cast<uint32_t>(re - 127 + bias) << mant) | ((rb >> (23 - mant)) & ((1u << mant) - 1u));
  } else {  // subnormal (or zero): r is a whole multiple of 2^(min_exp - mant)
    code = static_cast<uint32_t>(__fmul_rn(r, e4 ? 512.f : 65536.f));
  }
  return sign | code;
}

// `y` (already divided by the scale) as the stored byte of format `fmt`.
__device__ __forceinline__ uint8_t pk_float_to_kv8(float y, int fmt) {
  if (fmt == PK_KV_INT8) {
    if (y != y) return 0;
    const float r = rintf(fminf(fmaxf(y, -128.f), 127.f));
    return static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(r)));
  }
#if PK_FP8_HARDWARE
  unsigned short two;
  if (fmt == PK_KV_FP8_E4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(two) : "f"(0.f), "f"(y));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(two) : "f"(0.f), "f"(y));
  }
  return static_cast<uint8_t>(two & 0xffu);  // the second source lands in the low byte
#else
  return static_cast<uint8_t>(pk_float_to_fp8_bits(y, fmt));
#endif
}

// ---- the kernels' loads and stores ----

// The element type of the SIMT attention kernels over an 8-bit cache: K/V are bytes of format
// p.kv_dtype, the query and output are of p.dtype (read at run time: one instantiation serves
// float32, float16 and bfloat16 queries).
struct PkKv8 {};
template <> struct PkVec<PkKv8> {
  static constexpr int N = 4;  // four cache bytes (one 32-bit load), four query floats
};

// Loads and stores of a kernel over T: T = float/__half/__nv_bfloat16 for a cache of the query's
// dtype (16-byte vectors, as before), PkKv8 for an 8-bit cache. Offsets are in elements.
template <typename T>
struct PkKvIo {
  using Cache = T;
  static constexpr int VEC = PkVec<T>::N;

  __device__ static __forceinline__ void load_q(const PkAttnParams& p, int64_t off, bool valid,
                                                float (&out)[VEC]) {
    const uint4 raw = valid ? pk_load16(static_cast<const T*>(p.q) + off)
                            : make_uint4(0u, 0u, 0u, 0u);
    pk_unpack16<T>(raw, out);
  }
  __device__ static __forceinline__ uint4 load_kv(const Cache* ptr) { return pk_load16(ptr); }
  __device__ static __forceinline__ void unpack_kv(const uint4& raw, int, float (&out)[VEC]) {
    pk_unpack16<T>(raw, out);
  }
  __device__ static __forceinline__ void store_out(const PkAttnParams& p, int64_t off,
                                                   const float (&in)[VEC]) {
    pk_store16<T>(static_cast<T*>(p.out) + off, in);
  }
  __device__ static __forceinline__ void store_out1(const PkAttnParams& p, int64_t off, float x) {
    static_cast<T*>(p.out)[off] = pk_from_float<T>(x);
  }
};

template <>
struct PkKvIo<PkKv8> {
  using Cache = uint8_t;
  static constexpr int VEC = 4;

  __device__ static __forceinline__ void load_q(const PkAttnParams& p, int64_t off, bool valid,
                                                float (&out)[VEC]) {
    if (!valid) {
      out[0] = out[1] = out[2] = out[3] = 0.f;
    } else if (p.dtype == PK_FLOAT32) {
      const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(p.q) + off);
      out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
    } else if (p.dtype == PK_FLOAT16) {
      const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __half*>(p.q) + off);
      const __half* h = reinterpret_cast<const __half*>(&raw);
#pragma unroll
      for (int e = 0; e < 4; ++e) out[e] = pk_to_float(h[e]);
    } else {
      const uint2 raw =
          *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.q) + off);
      const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
      for (int e = 0; e < 4; ++e) out[e] = pk_to_float(h[e]);
    }
  }
  __device__ static __forceinline__ uint4 load_kv(const Cache* ptr) {
    return make_uint4(__ldg(reinterpret_cast<const uint32_t*>(ptr)), 0u, 0u, 0u);
  }
  __device__ static __forceinline__ void unpack_kv(const uint4& raw, int fmt,
                                                   float (&out)[VEC]) {
    pk_kv8_to_float4(raw.x, fmt, out);
  }
  __device__ static __forceinline__ void store_out(const PkAttnParams& p, int64_t off,
                                                   const float (&in)[VEC]) {
    if (p.dtype == PK_FLOAT32) {
      *reinterpret_cast<float4*>(static_cast<float*>(p.out) + off) =
          make_float4(in[0], in[1], in[2], in[3]);
    } else if (p.dtype == PK_FLOAT16) {
      *reinterpret_cast<uint2*>(static_cast<__half*>(p.out) + off) =
          make_uint2(pk_pack2<__half>(in[0], in[1]), pk_pack2<__half>(in[2], in[3]));
    } else {
      *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.out) + off) = make_uint2(
          pk_pack2<__nv_bfloat16>(in[0], in[1]), pk_pack2<__nv_bfloat16>(in[2], in[3]));
    }
  }
  __device__ static __forceinline__ void store_out1(const PkAttnParams& p, int64_t off, float x) {
    if (p.dtype == PK_FLOAT32) {
      static_cast<float*>(p.out)[off] = x;
    } else if (p.dtype == PK_FLOAT16) {
      static_cast<__half*>(p.out)[off] = pk_from_float<__half>(x);
    } else {
      static_cast<__nv_bfloat16*>(p.out)[off] = pk_from_float<__nv_bfloat16>(x);
    }
  }
};

// A KV head's (k_scale, v_scale): the entries of p.k_scale / p.v_scale for an 8-bit cache, 1 for
// a float cache (multiplying by 1 changes no bits).
__device__ __forceinline__ float2 pk_kv_scales(const PkAttnParams& p, int kvh) {
  if (p.k_scale == nullptr) return make_float2(1.f, 1.f);
  return make_float2(__ldg(static_cast<const float*>(p.k_scale) + kvh),
                     __ldg(static_cast<const float*>(p.v_scale) + kvh));
}
