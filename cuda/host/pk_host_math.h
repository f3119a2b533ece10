// pk_host_math.h: the CUDA device math and utility functions the kernels use, for host C++.
//
// The fast intrinsics (__expf, __logf, __fdividef) are computed with the accurate libm functions:
// the emulator checks the algorithm, not the last bits of the GPU's approximations.
// Atomics are plain read-modify-writes: the threads of a block run one at a time on one host
// thread (see pk_host_sched.h), and blocks never run at the same time.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>

#include "pk_host_hooks.h"
#include "pk_host_types.h"

#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif

inline float __expf(float x) {
  pk_host::preemption_point();
  return expf(x);
}
inline float __logf(float x) {
  pk_host::preemption_point();
  return logf(x);
}
inline float __exp10f(float x) { return exp10f(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }

// min/max overloads as in CUDA's math headers (same-type and mixed-signedness integer pairs).
#define PK_HOST_MINMAX(T)                               \
  inline T min(T a, T b) { return b < a ? b : a; }      \
  inline T max(T a, T b) { return a < b ? b : a; }
PK_HOST_MINMAX(int)
PK_HOST_MINMAX(unsigned int)
PK_HOST_MINMAX(long)
PK_HOST_MINMAX(unsigned long)
PK_HOST_MINMAX(long long)
PK_HOST_MINMAX(unsigned long long)
#undef PK_HOST_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline unsigned int min(int a, unsigned int b) { return min(static_cast<unsigned int>(a), b); }
inline unsigned int min(unsigned int a, int b) { return min(a, static_cast<unsigned int>(b)); }
inline unsigned int max(int a, unsigned int b) { return max(static_cast<unsigned int>(a), b); }
inline unsigned int max(unsigned int a, int b) { return max(a, static_cast<unsigned int>(b)); }

// Read-only cache load: an ordinary load on the host (and a preemption point).
template <typename T>
inline T __ldg(const T* p) {
  pk_host::preemption_point();
  return *p;
}

// Atomics (see the file comment for why plain read-modify-writes are exact here).
template <typename T>
inline T atomicAdd(T* address, T val) {
  T old = *address;
  *address = old + val;
  return old;
}
template <typename T>
inline T atomicMax(T* address, T val) {
  T old = *address;
  *address = old < val ? val : old;
  return old;
}
template <typename T>
inline T atomicMin(T* address, T val) {
  T old = *address;
  *address = val < old ? val : old;
  return old;
}
template <typename T>
inline T atomicExch(T* address, T val) {
  T old = *address;
  *address = val;
  return old;
}
template <typename T>
inline T atomicCAS(T* address, T compare, T val) {
  T old = *address;
  if (old == compare) *address = val;
  return old;
}

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
