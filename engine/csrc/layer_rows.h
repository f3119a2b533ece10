// The row kernels of the engine's fused layer ops (RMSNorm with the residual add, rotary, SiLU *
// up), on raw pointers: float32 or bfloat16 bits (uint16_t) in, float32 arithmetic, each output
// rounded once to the tensor's dtype (bfloat16: to nearest even, NaN stays NaN). Shared by
// layer_ops.cpp (one op per call, on tensors) and layer_loop.cpp (a whole decode step's layers in
// one call), so that both give the same bits. No torch headers.
//
// Work split: rows (tokens) over OpenMP threads when an op has at least kParallelElems elements
// (a batch of 16 rows of 576 and up; rows are independent, so the bits do not depend on it);
// smaller ops run on the calling thread (a fork costs more than the op). In the layer loop the
// other threads are still spinning from the matmul before, so a fork is cheap, and splitting
// 16-row ops shortens the step (measured: bench/results/2026-12-04-layer-loop). Inner loops are
// written so that the compiler vectorises them (`omp simd`, no calls but the inline helpers
// below).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace layer_rows {

#ifndef LAYER_ROWS_PARALLEL_ELEMS  // (a build flag for A/B runs)
#define LAYER_ROWS_PARALLEL_ELEMS (1 << 12)
#endif
constexpr int64_t kParallelElems = LAYER_ROWS_PARALLEL_ELEMS;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  p[i] = static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

// e^x for x in [-87, 80] (clamped outside; NaN stays NaN): 2^n * e^r with |r| <= ln2/2 and a
// degree-6 Taylor polynomial (relative error ~2e-7). Branch-free and call-free, so that loops over
// it vectorise into plain arithmetic: the clamp as two selects, n = round(x / ln2) by the
// 1.5 * 2^23 shifter (adding it leaves the integer part in the mantissa). The upper bound is 80,
// not 88, because gcc specialises a caller's clamped lanes into constants: with 88,
// silu_mul's a / (1 + e^88) became a * 6e-39, a subnormal operand in every vector, whose
// microcode assist made the call 5x slower (bench/results/2026-12-03-layer-ops-amx-scores).
// 1 / (1 + e^80) is a normal float.
inline float exp_approx(float x) {
  constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23
  x = x < -87.0f ? -87.0f : x;
  x = x > 80.0f ? 80.0f : x;
  const float n = (x * 1.44269504088896341f + kShifter) - kShifter;
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f +
                  r * (8.3333338e-3f + r * 1.3888889e-3f)))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// out[t] = rms_norm(residual[t] (+)= x[t]) * weight, row by row. With `x` null, residual is only
// read (plain rms_norm of `residual`).
template <typename T>
void add_rms_norm_rows(T* residual, int64_t residual_stride, const T* x, int64_t x_stride,
                       const T* weight, T* out, int64_t out_stride, int64_t rows, int64_t h,
                       float eps) {
#pragma omp parallel for schedule(static) if (rows * h >= kParallelElems)
  for (int64_t t = 0; t < rows; ++t) {
    T* res = residual + t * residual_stride;
    if (x != nullptr) {
      const T* xr = x + t * x_stride;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) store(res, i, load(res, i) + load(xr, i));
    }
    float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < h; ++i) {
      const float v = load(res, i);
      sum_sq += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(h) + eps);
    T* o = out + t * out_stride;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) store(o, i, load(res, i) * inv * load(weight, i));
  }
}

// In place on heads [0, heads) of each token: x = x * cos[p] + swap_halves(x) * sin[p], where
// `sin` has rotate-half's sign folded in (negative in the first half).
template <typename T>
void rotary_rows(T* base, int64_t token_stride, int64_t head_stride, int64_t tokens,
                 int64_t heads, int64_t d, const int64_t* positions, const float* cos,
                 const float* sin) {
  const int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * d >= kParallelElems)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + positions[t] * d;
    const float* s = sin + positions[t] * d;
    for (int64_t hd = 0; hd < heads; ++hd) {
      T* x = base + t * token_stride + hd * head_stride;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = load(x, i), b = load(x, i + half);
        store(x, i, a * c[i] + b * s[i]);
        store(x, i + half, b * c[i + half] + a * s[i + half]);
      }
    }
  }
}

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, n + i].
template <typename T>
void silu_mul_rows(const T* gate_up, int64_t in_stride, T* out, int64_t out_stride,
                   int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= kParallelElems)
  for (int64_t t = 0; t < rows; ++t) {
    const T* g = gate_up + t * in_stride;
    T* o = out + t * out_stride;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float a = load(g, i);
      store(o, i, a / (1.0f + exp_approx(-a)) * load(g, n + i));
    }
  }
}

}  // namespace layer_rows
