// The arithmetic ceiling of an int8 matmul whose operands carry a scale per block of 32 inputs
// (GGUF Q4_1 / Q8_0 weights times Q8 activations: engine/csrc/int8_matmul.cpp's arithmetic),
// measured on this CPU (bench/ceilings.py `int8_block_rate`). Per activation row and block, for
// 16 output features: 8 vpdpbusd (4 u8 x s8 products per lane each, the row's 4 bytes broadcast
// from memory) in two chains, then the block's scaling: the chains added, converted to float32,
// d * xd, and two fmas (+= d xd sum, += m xs). Four rows per iteration are independent and the
// operands stay in L1, so the loop is bound by the execution ports that these instructions
// share, not by latency or memory. Where the multiplies and fmas share the vpdpbusd pipes (Zen 4:
// 8 + 3 of them per row and block), the rate is 8/11 of vpdpbusd's alone.
//
// A plain shared library, built at first use by paged_kernels.cpp_build.load_library with the
// int8 kernel's flags and called through ctypes.
#include <omp.h>

#include <chrono>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>

namespace {

constexpr int ROWS = 4;

// acc += w . (the 4 bytes at x broadcast to every lane), the broadcast folded into the
// instruction (the form the int8 kernel issues).
inline __m512i dp(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

float run(int64_t iterations) {
  alignas(64) int32_t x[64 * 8];  // 64 rows of 32 activation bytes
  alignas(64) float scales[64 * 2];
  alignas(64) uint8_t wbytes[8 * 64];
  alignas(64) float dm[32];  // a tile-block's 16 scales d and 16 mins m
  for (int i = 0; i < 64 * 8; ++i) x[i] = 0x01010101 * (i % 7);
  for (int i = 0; i < 64 * 2; ++i) scales[i] = 1.0f / (1 + i);
  for (int i = 0; i < 8 * 64; ++i) wbytes[i] = static_cast<uint8_t>(i * 37);
  for (int i = 0; i < 32; ++i) dm[i] = i < 16 ? 0.5f / (1 + i) : -1000.f / (i - 15);
  __m512i w[8];
  for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(wbytes + 64 * g);
  const __m512 d = _mm512_load_ps(dm), m = _mm512_load_ps(dm + 16);  // lanes differ, as in a tile
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      const int row = static_cast<int>((it * ROWS + r) & 63);
      const int32_t* xr = x + row * 8;
      __m512i s0 = dp(_mm512_setzero_si512(), w[0], xr);
      __m512i s1 = dp(_mm512_setzero_si512(), w[1], xr + 1);
      for (int g = 2; g < 8; g += 2) {
        s0 = dp(s0, w[g], xr + g);
        s1 = dp(s1, w[g + 1], xr + g + 1);
      }
      const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(scales[2 * row]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), dd, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(scales[2 * row + 1]), acc[r]);
    }
  }
  __m512 total = acc[0];
  for (int r = 1; r < ROWS; ++r) total = _mm512_add_ps(total, acc[r]);
  return _mm512_reduce_add_ps(total);
}

}  // namespace
#endif

extern "C" {

// Operations (2 per u8 x s8 product) per iteration of one thread: 4 rows x 16 features x 32.
int64_t int8_block_mix_ops_per_iteration() { return 4 * 16 * 32 * 2; }

// Seconds for `threads` OpenMP threads to run `iterations` iterations each (wall clock, from
// before the parallel region to after it), or -1 where the build has no AVX-512 VNNI. `sink`
// receives the accumulators' sum, so that the compiler keeps the work.
double int8_block_mix(int64_t iterations, int threads, float* sink) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  float total = 0.f;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
  total += run(iterations);
  const auto end = std::chrono::steady_clock::now();
  *sink = total;
  return std::chrono::duration<double>(end - start).count();
#else
  (void)iterations;
  (void)threads;
  *sink = 0.f;
  return -1.0;
#endif
}

}  // extern "C"
