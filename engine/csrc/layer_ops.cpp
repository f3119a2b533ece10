// The element-wise ops of the engine's Llama decoder layer, fused, for CPU tensors
// (engine/model/layer_ops.py is the Python side and states the contracts).
//
// Why: at decode sizes ([1..16, 576] per op) torch's CPU ops cost 5-40 us each in dispatch,
// allocation and (for bfloat16) per-op conversions, about ten ops per layer; these do the same
// work in one pass over the rows, in float32 arithmetic, rounding each output once to the
// tensor's dtype (bfloat16: to nearest even, NaN stays NaN).
//
// Work split: rows (tokens) over OpenMP threads, only when an op has at least kParallelElems
// elements (prefill); decode-sized ops run on the calling thread (a fork costs more than the op).
// Inner loops are written so that the compiler vectorises them (`omp simd`, no calls but the
// inline helpers below).

// Narrow includes (not torch/extension.h): the first-use build takes half the time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

constexpr int64_t kParallelElems = 1 << 15;

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

// Row r of float32 x [rows, n]: idx[r] = the first index of the row's maximum, lse[r] =
// log(sum_i exp(x[r, i])), in one read of the row: each chunk of kLseChunk (in L1) gets a max pass,
// then an exp-sum pass against the running max m (the sum rescaled by exp(m_old - m) when a chunk
// raises it). A row that holds a NaN gets lse NaN (the caller takes torch's answer for it); a row
// of -inf only gets lse -inf and index 0.
constexpr int64_t kLseChunk = 1024;

void argmax_lse_row(const float* x, int64_t n, int64_t* idx, float* lse) {
  float m = -INFINITY, sum = 0.0f;
  int64_t best = 0;
  int nan = 0;
  for (int64_t c = 0; c < n; c += kLseChunk) {
    const int64_t e = std::min(n, c + kLseChunk);
    float cm = -INFINITY;
#pragma omp simd reduction(max : cm) reduction(| : nan)
    for (int64_t i = c; i < e; ++i) {
      cm = x[i] > cm ? x[i] : cm;
      nan |= x[i] != x[i];
    }
    if (cm > m) {
      int64_t i = c;
      while (x[i] != cm) ++i;
      best = i;
      sum *= exp_approx(m - cm);  // 0 when m was -inf (clamped to e^-87, times a sum of 0)
      m = cm;
    }
    if (m == -INFINITY) continue;  // nothing finite yet
    float cs = 0.0f;
#pragma omp simd reduction(+ : cs)
    for (int64_t i = c; i < e; ++i) cs += exp_approx(x[i] - m);
    sum += cs;
  }
  *idx = best;
  *lse = nan ? NAN : (m == -INFINITY ? -INFINITY : m + std::log(sum));
}

void check_rows(const at::Tensor& t, const char* name, int64_t cols) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(1) == cols && t.stride(1) == 1,
              name, ": expected a CPU [rows, ", cols, "] tensor with a contiguous last dim, got ",
              t.sizes(), " strides ", t.strides());
}

#define PK_DISPATCH(dtype, ...)                                                   \
  if ((dtype) == at::kFloat) {                                                    \
    using scalar = float;                                                         \
    __VA_ARGS__;                                                                  \
  } else if ((dtype) == at::kBFloat16) {                                          \
    using scalar = uint16_t;                                                      \
    __VA_ARGS__;                                                                  \
  } else {                                                                        \
    TORCH_CHECK(false, "expected float32 or bfloat16 tensors, got ", (dtype));    \
  }

template <typename S>
S* ptr(const at::Tensor& t) {
  return static_cast<S*>(t.data_ptr());
}

// Returns rms_norm(residual (+)= x) * weight in a new tensor; `x` undefined: no add.
at::Tensor add_rms_norm(at::Tensor residual, const c10::optional<at::Tensor>& x,
                        const at::Tensor& weight, double eps) {
  const int64_t h = residual.size(-1);
  check_rows(residual, "residual", h);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h &&
              weight.scalar_type() == residual.scalar_type(),
              "weight: expected a contiguous [", h, "] tensor of the residual's dtype");
  const bool add = x.has_value() && x->defined();
  if (add) {
    check_rows(*x, "x", h);
    TORCH_CHECK(x->size(0) == residual.size(0) && x->scalar_type() == residual.scalar_type(),
                "x: expected the residual's rows and dtype");
  }
  at::Tensor out = at::empty({residual.size(0), h}, residual.options());
  PK_DISPATCH(residual.scalar_type(),
              add_rms_norm_rows<scalar>(ptr<scalar>(residual), residual.stride(0),
                                        add ? ptr<scalar>(*x) : nullptr,
                                        add ? x->stride(0) : 0, ptr<scalar>(weight),
                                        ptr<scalar>(out), h, residual.size(0), h,
                                        static_cast<float>(eps)));
  return out;
}

void rotary(at::Tensor x, int64_t heads, const at::Tensor& positions, const at::Tensor& cos,
            const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0 &&
              heads <= x.size(1), "x: expected a CPU [tokens, heads, even head_size] tensor "
              "with a contiguous last dim, got ", x.sizes());
  const int64_t d = x.size(2);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.dim() == 2 &&
              cos.size(1) == d && sin.sizes() == cos.sizes() && sin.is_contiguous() &&
              sin.scalar_type() == at::kFloat, "cos/sin: expected float32 [positions, ", d, "]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
              positions.numel() == x.size(0), "positions: expected int64 [", x.size(0), "]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "positions: expected values in [0, ",
                cos.size(0), "), got ", pos[t]);
  PK_DISPATCH(x.scalar_type(),
              rotary_rows<scalar>(ptr<scalar>(x), x.stride(0), x.stride(1), x.size(0), heads, d,
                                  pos, cos.data_ptr<float>(), sin.data_ptr<float>()));
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "gate_up: expected an even last dimension");
  const int64_t n = gate_up.size(-1) / 2;
  check_rows(gate_up, "gate_up", 2 * n);
  at::Tensor out = at::empty({gate_up.size(0), n}, gate_up.options());
  PK_DISPATCH(gate_up.scalar_type(),
              silu_mul_rows<scalar>(ptr<scalar>(gate_up), gate_up.stride(0), ptr<scalar>(out),
                                    n, gate_up.size(0), n));
  return out;
}

// (first index of each row's maximum, log-sum-exp of each row) of float32 x [rows, n].
std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x: expected float32, got ", x.scalar_type());
  check_rows(x, "x", x.size(-1));
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0, "x: expected at least one column");
  at::Tensor idx = at::empty({rows}, x.options().dtype(at::kLong));
  at::Tensor lse = at::empty({rows}, x.options());
  const float* px = ptr<float>(x);
  int64_t* pi = ptr<int64_t>(idx);
  float* pl = ptr<float>(lse);
  const int64_t stride = x.stride(0);
#pragma omp parallel for schedule(static) if (rows * n >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) argmax_lse_row(px + r * stride, n, pi + r, pl + r);
  return {idx, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released: a prefill's ops take milliseconds, and a server's threads keep going.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("add_rms_norm", &add_rms_norm, "rms_norm(residual (+)= x) * weight", nogil);
  m.def("rotary", &rotary, "rotary embedding in place on the first heads", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up", nogil);
  m.def("argmax_logsumexp", &argmax_logsumexp, "per row: first argmax, log-sum-exp", nogil);
}
