// A decode step's decoder layers in one native call, for the engine's Llama-style model on the CPU
// (engine/model/layer_loop.py is the Python side: it says which models and steps qualify and
// builds the loop from the model's own weights).
//
// Why: at decode sizes a layer's work is ~10 kernel calls of 2-20 us each, and the Python path
// between them (the model's helpers, the attention plan's per-layer checks, pybind and ctypes
// argument conversion, one tensor allocation per op) cost as much again: ~40 % of a batch-1 step
// on a 2-vCPU machine. Here the same kernels run in the same order with the same arguments, from
// C++, into buffers allocated once per step:
//   x = rms_norm(residual (+)= hidden) * input_norm                    (layer_rows.h)
//   qkv = x @ W_qkv^T                          (the tiled bf16 or the int8 kernel, by address)
//   rotary on q and k heads, in place                                   (layer_rows.h)
//   write_kv(k, v), attention(q) -> a          (the cpu backend's own functions, by address)
//   o = a @ W_o^T; x = rms_norm(residual += o) * post_attention_norm
//   hidden = silu_mul(x @ W_gate_up^T) @ W_down^T
// and after the last layer rms_norm(residual += hidden) * final_norm, returned. Every kernel gets
// the rows, strides and thread count the Python path gives it, so each output has the same bits
// (tests/test_layer_loop.py compares them).
//
// Contract (checked by the Python side; the checks here are the cheap ones that keep memory safe):
// bfloat16 activations; every layer's caches with the first layer's sizes, strides and dtype; the
// attention metadata checked by paged_kernels.plan for this step; for an 8-bit cache, each
// layer's final scales (no calibration pending: that needs the step's K/V in Python first).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "../../cpu_impl/csrc/entry_points.h"
#include "layer_rows.h"
#include "rotary_checks.h"

namespace {

using layer_rows::add_rms_norm_rows;
using layer_rows::rotary_rows;
using layer_rows::silu_mul_rows;

// tiled_matmul.cpp's tiled_linear and int8_matmul.cpp's int8_linear (extern "C").
using TiledLinearFn = int (*)(const uint16_t*, const uint8_t*, int, uint16_t*, int64_t, int64_t,
                              int64_t, int);
using Int8LinearFn = int (*)(const void*, int, const uint8_t*, int, void*, int64_t, int64_t,
                             int64_t, int);

struct Linear {
  at::Tensor packed;  // uint8 tiles (kept alive here)
  int qtype;          // 0 Q4_1, 1 Q8_0
  int64_t rows, cols;
};

struct Layer {
  at::Tensor input_norm, post_norm;  // bfloat16 [hidden]
  Linear qkv, o, gate_up, down;
};

// Wall-clock seconds of a step's parts, added to a float64 tensor [4] (matmul, attention,
// write_kv, the rest: norms, rotary, SiLU) when the caller gives one (bench.serve_profile);
// otherwise nothing is read.
class Clock {
 public:
  enum Part { kMatmul, kAttention, kWriteKv, kOther };

  explicit Clock(const c10::optional<at::Tensor>& times)
      : sums_(times.has_value() && times->defined() ? times->data_ptr<double>() : nullptr),
        last_(now()) {}

  // Adds the time since the last lap (or the start) to `part`.
  void lap(Part part) {
    if (sums_ == nullptr) return;
    const double t = now();
    sums_[part] += t - last_;
    last_ = t;
  }

 private:
  static double now() {
    return std::chrono::duration<double>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  double* sums_;
  double last_;
};

class LayerLoop {
 public:
  // `linear` is the address of tiled_linear (int8 false) or int8_linear (int8 true).
  LayerLoop(int64_t linear, bool int8, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_size, int64_t hidden, int64_t intermediate, double eps)
      : tiled_(int8 ? nullptr : reinterpret_cast<TiledLinearFn>(linear)),
        int8_(int8 ? reinterpret_cast<Int8LinearFn>(linear) : nullptr),
        nh_(num_heads), nkv_(num_kv_heads), d_(head_size), h_(hidden), inter_(intermediate),
        eps_(static_cast<float>(eps)) {}

  // Appends a layer: its two norms and its four projections as (packed tiles, qtype, rows).
  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm,
                 const std::vector<at::Tensor>& packed, const std::vector<int64_t>& qtypes,
                 const std::vector<int64_t>& rows) {
    TORCH_CHECK(packed.size() == 4 && qtypes.size() == 4 && rows.size() == 4,
                "add_layer: expected the qkv, o, gate_up and down projections");
    for (const at::Tensor* norm : {&input_norm, &post_norm})
      TORCH_CHECK(norm->scalar_type() == at::kBFloat16 && norm->is_contiguous() &&
                  norm->numel() == h_, "add_layer: expected bfloat16 norms of ", h_);
    const int64_t qkv_rows = (nh_ + 2 * nkv_) * d_;
    const int64_t want_rows[4] = {qkv_rows, h_, 2 * inter_, h_};
    const int64_t cols[4] = {h_, nh_ * d_, h_, inter_};
    Layer layer{input_norm, post_norm, {}, {}, {}, {}};
    Linear* slots[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(rows[i] == want_rows[i] && packed[i].scalar_type() == at::kByte &&
                  packed[i].is_contiguous() && (qtypes[i] == 0 || qtypes[i] == 1),
                  "add_layer: projection ", i, " does not have the model's shape");
      *slots[i] = Linear{packed[i], static_cast<int>(qtypes[i]), rows[i], cols[i]};
    }
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The step: `hidden` bfloat16 [T, hidden] (the embeddings; used as the residual stream and
  // updated in place), rotary `positions` int64 [T] into float32 `cos`/`sin` [P, head_size],
  // `caches` the layers' (key, value) caches in order, the attention metadata as the cpu backend
  // takes it, with its `paged_attention` and `write_kv` by address (`attention_fn`,
  // `write_kv_fn`: entry_points.h's types); `scales` the layers' (k_scale, v_scale) in order
  // for an 8-bit cache (empty for a float one; the cpu backend checks each); `times`, when
  // given, gets each part's seconds added (Clock). Returns rms_norm(residual + last hidden) *
  // final_norm, [T, hidden].
  at::Tensor run(at::Tensor hidden, const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin, const std::vector<at::Tensor>& caches,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                 const c10::optional<at::Tensor>& cu_seqlens_q, const at::Tensor& slot_mapping,
                 double scale, int64_t sliding_window, double soft_cap, int64_t attention_fn,
                 int64_t write_kv_fn, int64_t tile, int64_t threads, bool read_ahead,
                 int64_t prefetch_lines,
                 const at::Tensor& final_norm, const std::vector<at::Tensor>& scales,
                 const c10::optional<at::Tensor>& times) {
    const int64_t T = hidden.size(0);
    check_step(hidden, positions, cos, sin, caches, final_norm, scales, times);
    const auto attention = reinterpret_cast<pk_cpu::PagedAttentionFn>(attention_fn);
    const auto write_kv = reinterpret_cast<pk_cpu::WriteKvFn>(write_kv_fn);
    Clock clock(times);
    const auto opts = hidden.options();
    const int64_t heads = nh_ + 2 * nkv_;
    at::Tensor x = at::empty({T, h_}, opts), qkv = at::empty({T, heads, d_}, opts);
    at::Tensor attn = at::empty({T, nh_, d_}, opts), proj = at::empty({T, h_}, opts);
    at::Tensor gate_up = at::empty({T, 2 * inter_}, opts), act = at::empty({T, inter_}, opts);
    at::Tensor out = at::empty({T, h_}, opts);
    const at::Tensor q = qkv.narrow(1, 0, nh_), k = qkv.narrow(1, nh_, nkv_);
    const at::Tensor v = qkv.narrow(1, nh_ + nkv_, nkv_);
    uint16_t* res = ptr(hidden);
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int thr = static_cast<int>(threads);
    const c10::optional<at::Tensor> none;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      const c10::optional<at::Tensor> ks = scales.empty() ? none : scales[2 * l];
      const c10::optional<at::Tensor> vs = scales.empty() ? none : scales[2 * l + 1];
      // the first layer's residual is the embeddings as they are; later ones add the MLP output
      add_rms_norm_rows(res, h_, l == 0 ? nullptr : ptr(proj), h_, ptr(L.input_norm), ptr(x),
                        h_, T, h_, eps_);
      clock.lap(Clock::kOther);
      linear(L.qkv, x, qkv, T, thr);
      clock.lap(Clock::kMatmul);
      rotary_rows(ptr(qkv), heads * d_, d_, T, nh_ + nkv_, d_, pos, cos.data_ptr<float>(),
                  sin.data_ptr<float>());
      clock.lap(Clock::kOther);
      const at::Tensor& kc = caches[2 * l];
      const at::Tensor& vc = caches[2 * l + 1];
      write_kv(k, v, kc, vc, slot_mapping, ks, vs, threads);
      clock.lap(Clock::kWriteKv);
      TORCH_CHECK(attention(q, kc, vc, block_tables, seq_lens, cu_seqlens_q, attn, none, none,
                             scale, sliding_window, soft_cap, tile, threads, read_ahead, ks, vs,
                             prefetch_lines),
                  "layer_loop: the cpu kernel rejected the attention metadata's contents");
      clock.lap(Clock::kAttention);
      linear(L.o, attn, proj, T, thr);
      clock.lap(Clock::kMatmul);
      add_rms_norm_rows(res, h_, ptr(proj), h_, ptr(L.post_norm), ptr(x), h_, T, h_, eps_);
      clock.lap(Clock::kOther);
      linear(L.gate_up, x, gate_up, T, thr);
      clock.lap(Clock::kMatmul);
      silu_mul_rows(ptr(gate_up), 2 * inter_, ptr(act), inter_, T, inter_);
      clock.lap(Clock::kOther);
      linear(L.down, act, proj, T, thr);
      clock.lap(Clock::kMatmul);
    }
    add_rms_norm_rows(res, h_, ptr(proj), h_, ptr(final_norm), ptr(out), h_, T, h_, eps_);
    clock.lap(Clock::kOther);
    return out;
  }

 private:
  static uint16_t* ptr(const at::Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); }

  void linear(const Linear& w, const at::Tensor& in, const at::Tensor& y, int64_t T,
              int threads) const {
    const uint8_t* packed = w.packed.data_ptr<uint8_t>();
    const int failed = int8_ != nullptr
        ? int8_(in.data_ptr(), 1, packed, w.qtype, y.data_ptr(), T, w.rows, w.cols, threads)
        : tiled_(ptr(in), packed, w.qtype, ptr(y), T, w.rows, w.cols, threads);
    TORCH_CHECK(failed == 0, "layer_loop: the matmul kernel refused its sizes");
  }

  void check_step(const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& cos,
                  const at::Tensor& sin, const std::vector<at::Tensor>& caches,
                  const at::Tensor& final_norm, const std::vector<at::Tensor>& scales,
                  const c10::optional<at::Tensor>& times) const {
    const int64_t T = hidden.size(0);
    TORCH_CHECK(!layers_.empty(), "layer_loop: no layers were added");
    TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 && hidden.is_contiguous() &&
                hidden.dim() == 2 && hidden.size(1) == h_,
                "hidden: expected a contiguous bfloat16 [tokens, ", h_, "] tensor");
    layer_rows::check_rotary_tables(positions, cos, sin, T, d_);
    TORCH_CHECK(final_norm.scalar_type() == at::kBFloat16 && final_norm.is_contiguous() &&
                final_norm.numel() == h_, "final_norm: expected bfloat16 [", h_, "]");
    TORCH_CHECK(!times.has_value() || !times->defined() ||
                (times->scalar_type() == at::kDouble && times->is_contiguous() &&
                 times->numel() == 4), "times: expected a float64 tensor [4]");
    TORCH_CHECK(caches.size() == 2 * layers_.size(), "caches: expected ",
                2 * layers_.size(), " tensors (key and value per layer), got ", caches.size());
    TORCH_CHECK(scales.empty() || scales.size() == caches.size(), "scales: expected none (a "
                "float cache) or ", caches.size(), " tensors (k_scale and v_scale per layer), got ",
                scales.size());
    const at::Tensor& first = caches[0];
    for (const at::Tensor& c : caches)
      TORCH_CHECK(c.scalar_type() == first.scalar_type() && c.sizes() == first.sizes() &&
                  c.strides() == first.strides() && c.device() == first.device(),
                  "caches: expected every layer's caches to match the first layer's key cache "
                  "(checked by the attention plan)");
  }

  std::vector<Layer> layers_;
  TiledLinearFn tiled_;
  Int8LinearFn int8_;
  int64_t nh_, nkv_, d_, h_, inter_;
  float eps_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released during a step: a server's HTTP and tokenizer threads keep running.
  py::class_<LayerLoop>(m, "LayerLoop")
      .def(py::init<int64_t, bool, int64_t, int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &LayerLoop::add_layer)
      .def_property_readonly("num_layers", &LayerLoop::num_layers)
      .def("run", &LayerLoop::run, py::call_guard<py::gil_scoped_release>());
}
