// Paged attention on the CPU (docs/abi.md): the entry points and their Python bindings, one
// translation unit compiled at first use (cpu_impl/build.py) with the headers next to it:
// simd.h (the vector building blocks), problem.h (the call's problem, its content check and its
// work items), kernel.h (one work item's attention), read_ahead.h (a decode call's K/V read-ahead).
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
#include <cstdint>
#include <cstring>

#include "kernel.h"
#include "problem.h"
#include "read_ahead.h"

// Entry point (called by cpu_impl/backend.py with a checked AttentionProblem's fields; sliding_window
// <= 0 and soft_cap <= 0 mean none; read_ahead_kv: a decode call first runs read_ahead.h).
// Returns false, having written nothing, when the contents break the ABI's rules.
bool paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const c10::optional<at::Tensor>& cu_seqlens_q,
                     at::Tensor out, const c10::optional<at::Tensor>& lse,
                     const c10::optional<at::Tensor>& alibi_slopes, double scale,
                     int64_t sliding_window, double soft_cap, int64_t tile, int64_t threads,
                     bool read_ahead_kv) {
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
  if (!contents_valid(p)) return false;
  if (p.cu_seqlens_q == nullptr && read_ahead_kv) {
    volatile int64_t read = read_ahead(p, key_cache, value_cache, threads);  // keeps the loads
    (void)read;
  }
  if (p.cu_seqlens_q == nullptr) tile = 1;
  tile = std::max<int64_t>(1, tile);
  if (query.scalar_type() == at::kFloat)
    run_items<float>(p, query, key_cache, value_cache, out, tile, threads);
  else if (query.scalar_type() == at::kHalf)
    run_items<at::Half>(p, query, key_cache, value_cache, out, tile, threads);
  else if (query.scalar_type() == at::kBFloat16)
    run_items<at::BFloat16>(p, query, key_cache, value_cache, out, tile, threads);
  else
    TORCH_CHECK(false, "query: expected float32, float16 or bfloat16, got ", query.scalar_type());
  return true;
}

// write_kv: cache[slot / block_size, :, slot % block_size] = row for every slot in [0, capacity);
// other slots (negative: padding) are skipped.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
              at::Tensor value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(slot_mapping.is_contiguous(), "slot_mapping must be contiguous");
  const int64_t n = key.size(0), heads = key.size(1), d = key.size(2), bs = key_cache.size(2);
  const int64_t capacity = key_cache.size(0) * bs;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t esize = key.element_size();
  auto copy = [&](const at::Tensor& src, at::Tensor& cache, int64_t t, int64_t slot) {
    const char* s = static_cast<const char*>(src.data_ptr());
    char* c = static_cast<char*>(cache.data_ptr());
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(c + ((slot / bs) * cache.stride(0) + h * cache.stride(1) +
                       (slot % bs) * cache.stride(2)) * esize,
                  s + (t * src.stride(0) + h * src.stride(1)) * esize, d * esize);
  };
  for (int64_t t = 0; t < n; ++t) {
    int64_t slot = slots[t];
    if (slot < 0 || slot >= capacity) continue;
    copy(key, key_cache, t, slot);
    copy(value, value_cache, t, slot);
  }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released: the kernels touch no Python object, and a server's other threads (HTTP,
  // tokenizer) keep running during a layer's attention.
  m.def("paged_attention", &paged_attention, "paged attention (see cpu_impl/backend.py)",
        py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "scatter K/V rows into the caches (see cpu_impl/backend.py)",
        py::call_guard<py::gil_scoped_release>());
  m.def("read_ahead", &read_ahead_sum, "a decode call's K/V read-ahead alone (read_ahead.h)",
        py::call_guard<py::gil_scoped_release>());
}
