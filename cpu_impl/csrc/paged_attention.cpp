// Paged attention on the CPU (docs/abi.md): the entry points and their Python bindings, one
// translation unit compiled at first use (cpu_impl/build.py) with the headers next to it:
// simd.h (the vector building blocks), problem.h (the call's problem, its content check and its
// work items), kernel.h (one work item's attention), line_cursor.h (its paced K/V prefetch),
// read_ahead.h (a decode call's K/V read-ahead).
//
// Work split: one work item = (sequence s, KV head h or all of them, tile of up to `tile` query
// rows of s). Items run in parallel with OpenMP (dynamic schedule: causal prefill tiles differ in
// cost); each item is computed by one thread from start to end, so the result does not depend on
// the thread count.
//
// Invariants relied on: shapes and strides were checked on the host by paged_kernels.abi (the last
// dimension of query, caches and out is contiguous). Contents are validated here before any work
// (contents_valid: a scan of the lengths and of the block-table entries that are read, microseconds
// on the CPU): an invalid problem computes nothing and the caller raises the ABI's error.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "entry_points.h"
#include "kernel.h"
#include "line_cursor.h"
#include "problem.h"
#include "read_ahead.h"

namespace {

// The scales of an 8-bit cache as the kernel reads them: float32 [num_kv_heads], contiguous (the
// ABI's normalized form); nullptr for a float cache.
const float* kv_scales(const c10::optional<at::Tensor>& scale, const at::Tensor& cache,
                       const char* name) {
  const bool quantized = cache.element_size() == 1;
  TORCH_CHECK(scale.has_value() == quantized, name, ": expected ",
              quantized ? "a float32 [num_kv_heads] tensor with an 8-bit cache"
                        : "None with a float cache");
  if (!quantized) return nullptr;
  TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->dim() == 1 &&
              scale->size(0) == cache.size(1), name, ": expected a contiguous float32 [",
              cache.size(1), "] tensor, got ", scale->scalar_type(), " ", scale->sizes());
  return scale->data_ptr<float>();
}

// The attention with query type T over caches of the cache's dtype (T itself or an 8-bit type).
template <typename T>
void run_for_cache(const Problem& p, const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, at::Tensor& out, int64_t tile, int64_t threads,
                   bool read_ahead_kv) {
  switch (key_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return run_items<T, at::Float8_e4m3fn>(p, query, key_cache, value_cache, out, tile, threads,
                                             read_ahead_kv);
    case at::kFloat8_e5m2:
      return run_items<T, at::Float8_e5m2>(p, query, key_cache, value_cache, out, tile, threads,
                                           read_ahead_kv);
    case at::kChar:
      return run_items<T, int8_t>(p, query, key_cache, value_cache, out, tile, threads,
                                  read_ahead_kv);
    default:
      TORCH_CHECK(key_cache.scalar_type() == query.scalar_type(),
                  "key_cache: expected the query's dtype or an 8-bit type, got ",
                  key_cache.scalar_type());
      return run_items<T, T>(p, query, key_cache, value_cache, out, tile, threads, read_ahead_kv);
  }
}

}  // namespace

// Entry point (called by cpu_impl/backend.py with a checked AttentionProblem's fields; sliding_window
// <= 0 and soft_cap <= 0 mean none; read_ahead_kv: a decode call first runs read_ahead.h; k_scale
// and v_scale: float32 [num_kv_heads] with an 8-bit cache, None otherwise; prefetch_lines: how
// many 64-byte lines ahead of its reads each work item requests its K/V, 0 for none).
// Returns false, having written nothing, when the contents break the ABI's rules.
bool paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const c10::optional<at::Tensor>& cu_seqlens_q,
                     at::Tensor out, const c10::optional<at::Tensor>& lse,
                     const c10::optional<at::Tensor>& alibi_slopes, double scale,
                     int64_t sliding_window, double soft_cap, int64_t tile, int64_t threads,
                     bool read_ahead_kv, const c10::optional<at::Tensor>& k_scale,
                     const c10::optional<at::Tensor>& v_scale, int64_t prefetch_lines) {
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(),
              "value_cache: expected key_cache's dtype ", key_cache.scalar_type(), ", got ",
              value_cache.scalar_type());
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "index tensors must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 &&
              value_cache.stride(3) == 1, "last dimensions must be contiguous");
  Problem p;
  p.num_tokens = query.size(0);
  p.num_heads = query.size(1);
  p.head_size = query.size(2);
  p.num_blocks = key_cache.size(0);
  p.num_kv_heads = key_cache.size(1);
  p.block_size = key_cache.size(2);
  p.num_seqs = seq_lens.size(0);
  p.max_blocks = block_tables.size(1);
  p.q_s0 = query.stride(0); p.q_s1 = query.stride(1);
  p.o_s0 = out.stride(0); p.o_s1 = out.stride(1);
  p.k_s0 = key_cache.stride(0); p.k_s1 = key_cache.stride(1); p.k_s2 = key_cache.stride(2);
  p.v_s0 = value_cache.stride(0); p.v_s1 = value_cache.stride(1); p.v_s2 = value_cache.stride(2);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.cu_seqlens_q = nullptr;
  if (cu_seqlens_q.has_value()) {
    TORCH_CHECK(cu_seqlens_q->is_contiguous(), "cu_seqlens_q must be contiguous");
    p.cu_seqlens_q = cu_seqlens_q->data_ptr<int32_t>();
  }
  at::Tensor slopes;  // keeps a contiguous copy alive for the call
  if (alibi_slopes.has_value()) slopes = alibi_slopes->contiguous();
  p.alibi = slopes.defined() ? slopes.data_ptr<float>() : nullptr;
  p.lse = nullptr;
  if (lse.has_value()) {
    TORCH_CHECK(lse->is_contiguous(), "lse must be contiguous");
    p.lse = lse->data_ptr<float>();
  }
  p.scale = static_cast<float>(scale);
  p.soft_cap = static_cast<float>(soft_cap);
  p.window = sliding_window;
  p.prefetch_lines = std::max<int64_t>(0, prefetch_lines);
  p.k_scale = kv_scales(k_scale, key_cache, "k_scale");
  p.v_scale = kv_scales(v_scale, value_cache, "v_scale");
  if (!contents_valid(p)) return false;
  if (p.cu_seqlens_q == nullptr) tile = 1;
  tile = std::max<int64_t>(1, tile);
  if (query.scalar_type() == at::kFloat)
    run_for_cache<float>(p, query, key_cache, value_cache, out, tile, threads, read_ahead_kv);
  else if (query.scalar_type() == at::kHalf)
    run_for_cache<at::Half>(p, query, key_cache, value_cache, out, tile, threads, read_ahead_kv);
  else if (query.scalar_type() == at::kBFloat16)
    run_for_cache<at::BFloat16>(p, query, key_cache, value_cache, out, tile, threads,
                                read_ahead_kv);
  else
    TORCH_CHECK(false, "query: expected float32, float16 or bfloat16, got ", query.scalar_type());
  return true;
}

namespace {

// The code of x (a row element already divided by its scale) in an 8-bit cache: fp8 saturates to
// the format's largest finite value, then rounds to nearest even (c10's conversion, which would
// turn an overflow into NaN), NaN stays NaN (std::max/min return their first argument for NaN);
// int8 rounds half to even (nearbyint in the default rounding mode), clamps to [-128, 127], and
// stores NaN as 0.
template <typename C>
C quantize(float x);
template <>
at::Float8_e4m3fn quantize(float x) {
  return at::Float8_e4m3fn(std::min(std::max(x, -448.f), 448.f));
}
template <>
at::Float8_e5m2 quantize(float x) {
  return at::Float8_e5m2(std::min(std::max(x, -57344.f), 57344.f));
}
template <>
int8_t quantize(float x) {
  if (std::isnan(x)) return 0;
  return static_cast<int8_t>(std::clamp(std::nearbyint(x), -128.f, 127.f));
}

// Writes row t of src ([tokens, heads, d], source type S) into cache slot `slot`: a copy when the
// cache has S's type (scales nullptr), else element / scales[head] quantised to C.
template <typename S, typename C>
void write_row(const at::Tensor& src, at::Tensor& cache, const float* scales, int64_t t,
               int64_t slot) {
  const int64_t heads = src.size(1), d = src.size(2), bs = cache.size(2);
  const S* s = static_cast<const S*>(src.data_ptr());
  C* c = static_cast<C*>(cache.data_ptr());
  for (int64_t h = 0; h < heads; ++h) {
    const S* row = s + t * src.stride(0) + h * src.stride(1);
    C* dst = c + (slot / bs) * cache.stride(0) + h * cache.stride(1) + (slot % bs) * cache.stride(2);
    if constexpr (std::is_same_v<S, C>) {
      std::memcpy(dst, row, d * sizeof(S));
    } else {
      const float scale = scales[h];
      for (int64_t x = 0; x < d; ++x) dst[x] = quantize<C>(scalar_float(row[x]) / scale);
    }
  }
}

// write_kv for source type S and cache type C, tokens split over `threads` when there are many.
template <typename S, typename C>
void write_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                at::Tensor& value_cache, const int64_t* slots, const float* k_scale,
                const float* v_scale, int64_t threads) {
  const int64_t n = key.size(0), capacity = key_cache.size(0) * key_cache.size(2);
  const bool parallel = !std::is_same_v<S, C> && n * key.size(1) * key.size(2) >= (1 << 16);
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= capacity) continue;
    write_row<S, C>(key, key_cache, k_scale, t, slot);
    write_row<S, C>(value, value_cache, v_scale, t, slot);
  }
}

template <typename S>
void write_rows_to(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                   at::Tensor& value_cache, const int64_t* slots, const float* k_scale,
                   const float* v_scale, int64_t threads) {
  switch (key_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return write_rows<S, at::Float8_e4m3fn>(key, value, key_cache, value_cache, slots, k_scale,
                                              v_scale, threads);
    case at::kFloat8_e5m2:
      return write_rows<S, at::Float8_e5m2>(key, value, key_cache, value_cache, slots, k_scale,
                                            v_scale, threads);
    case at::kChar:
      return write_rows<S, int8_t>(key, value, key_cache, value_cache, slots, k_scale, v_scale,
                                   threads);
    default:
      TORCH_CHECK(key_cache.scalar_type() == key.scalar_type(),
                  "key_cache: expected key's dtype or an 8-bit type, got ",
                  key_cache.scalar_type());
      return write_rows<S, S>(key, value, key_cache, value_cache, slots, k_scale, v_scale,
                              threads);
  }
}

}  // namespace

// write_kv: cache[slot / block_size, :, slot % block_size] = row for every slot in [0, capacity);
// other slots (negative: padding) are skipped. An 8-bit cache stores quantize(row / scale[head])
// (k_scale, v_scale: float32 [num_kv_heads]; None with a float cache).
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
              at::Tensor value_cache, const at::Tensor& slot_mapping,
              const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
              int64_t threads) {
  TORCH_CHECK(slot_mapping.is_contiguous(), "slot_mapping must be contiguous");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() &&
              key_cache.scalar_type() == value_cache.scalar_type(),
              "key/value and key_cache/value_cache: expected equal dtypes");
  const float* ks = kv_scales(k_scale, key_cache, "k_scale");
  const float* vs = kv_scales(v_scale, value_cache, "v_scale");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  threads = std::max<int64_t>(1, threads);
  if (key.scalar_type() == at::kFloat)
    write_rows_to<float>(key, value, key_cache, value_cache, slots, ks, vs, threads);
  else if (key.scalar_type() == at::kHalf)
    write_rows_to<at::Half>(key, value, key_cache, value_cache, slots, ks, vs, threads);
  else if (key.scalar_type() == at::kBFloat16)
    write_rows_to<at::BFloat16>(key, value, key_cache, value_cache, slots, ks, vs, threads);
  else
    TORCH_CHECK(false, "key: expected float32, float16 or bfloat16, got ", key.scalar_type());
}

// The read-ahead alone (tests): the sum of the bytes read_ahead.h reads for a decode call over these
// tables, which must be valid (contents_valid).
int64_t read_ahead_sum(const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens,
                       int64_t threads) {
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "index tensors must be contiguous");
  Problem p{};
  p.num_blocks = key_cache.size(0);
  p.block_size = key_cache.size(2);
  p.num_seqs = seq_lens.size(0);
  p.max_blocks = block_tables.size(1);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(contents_valid(p), "block_tables/seq_lens: expected valid decode contents");
  return read_ahead(p, key_cache, value_cache, threads);
}

static_assert(std::is_same_v<decltype(&paged_attention), pk_cpu::PagedAttentionFn> &&
                  std::is_same_v<decltype(&write_kv), pk_cpu::WriteKvFn>,
              "entry_points.h must declare the bound functions' types");

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released: the kernels touch no Python object, and a server's other threads (HTTP,
  // tokenizer) keep running during a layer's attention.
  m.def("paged_attention", &paged_attention, "paged attention (see cpu_impl/backend.py)",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("cu_seqlens_q"), py::arg("out"), py::arg("lse"),
        py::arg("alibi_slopes"), py::arg("scale"), py::arg("sliding_window"),
        py::arg("soft_cap"), py::arg("tile"), py::arg("threads"), py::arg("read_ahead_kv"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("prefetch_lines") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "scatter K/V rows into the caches (see cpu_impl/backend.py)",
        py::call_guard<py::gil_scoped_release>());
  m.def("entry_points", [] {
          return std::vector<int64_t>{reinterpret_cast<int64_t>(&paged_attention),
                                      reinterpret_cast<int64_t>(&write_kv)};
        },
        "the addresses of paged_attention and write_kv, typed as in entry_points.h");
  m.def("read_ahead", &read_ahead_sum, "a decode call's K/V read-ahead alone (read_ahead.h)",
        py::call_guard<py::gil_scoped_release>());
  m.def("prefetch_log", [](bool on) {
          std::lock_guard<std::mutex> lock(prefetch_log_mutex);
          std::vector<int64_t> lines(prefetch_log.begin(), prefetch_log.end());
          prefetch_log.clear();
          prefetch_log_on = on;
          return lines;
        },
        "the addresses of the lines the paced prefetch requested since the last call, and whether "
        "to record them from now on (tests)");
  m.def("use_amx", [](bool on) { amx_enabled = on; return amx_active(); },
        "switches Q.K^T on AMX tiles on or off for the process; returns whether it now runs");
}
