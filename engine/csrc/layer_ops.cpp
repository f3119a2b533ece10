// The element-wise ops of the engine's Llama decoder layer, fused, for CPU tensors
// (engine/model/layer_ops.py is the Python side and states the contracts).
//
// Why: at decode sizes ([1..16, 576] per op) torch's CPU ops cost 5-40 us each in dispatch,
// allocation and (for bfloat16) per-op conversions, about ten ops per layer; these do the same
// work in one pass over the rows, in float32 arithmetic, rounding each output once to the
// tensor's dtype (bfloat16: to nearest even, NaN stays NaN).
//
// The row kernels (and how they split work over threads) are in layer_rows.h, shared with
// layer_loop.cpp.

// Narrow includes (not torch/extension.h): the first-use build takes half the time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "layer_rows.h"
#include "rotary_checks.h"

namespace {

using namespace layer_rows;

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
  check_rotary_tables(positions, cos, sin, x.size(0), d);
  const int64_t* pos = positions.data_ptr<int64_t>();
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
