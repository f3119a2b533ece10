// pk_ops.h: the C++ interface of the CUDA backend (no torch, no CUDA headers).
//
// Each operation takes one parameter struct of raw pointers, sizes, int64 element strides and a
// launch plan, plus a stream (a `cudaStream_t` passed as `void*`; 0 = default stream), and returns
// nullptr on success or a static error message. The same structs are the kernels' only argument,
// so the run-time (NVRTC) path packs them in Python and launches the kernels directly.
//
// Layout rule (so Python can pack them without a compiler): every field is 8 bytes: pointers,
// `int64_t` or `double`, in the order of the X-macro lists below. `cuda/paged_cuda/params.py`
// reads these lists; the bindings expose them (`fields()`) and the loader checks they agree.
//
// Planning (which kernel, grid, threads, shared memory, split count, workspace) happens in ONE
// place, `cuda/paged_cuda/planner.py`; the launchers only dispatch on the plan's template
// arguments.
#pragma once
#if !defined(__CUDACC_RTC__)  // NVRTC: pk_platform.cuh declares the integer types
#include <cstddef>
#include <cstdint>
#endif

// Kinds: P = pointer, I = int64_t, F = double.
#define PK_ATTN_FIELDS(P, I, F)                                                            \
  P(q) P(k_cache) P(v_cache) P(block_tables) P(seq_lens) P(cu_seqlens_q) P(alibi_slopes)  \
  P(out) P(lse) P(part_out) P(part_m) P(part_l) P(k_scale) P(v_scale)                    \
  I(q_stride_token) I(q_stride_head)                                                      \
  I(k_stride_block) I(k_stride_head) I(k_stride_slot)                                     \
  I(v_stride_block) I(v_stride_head) I(v_stride_slot)                                     \
  I(o_stride_token) I(o_stride_head) I(bt_stride)                                         \
  I(num_seqs) I(num_tokens) I(num_heads) I(num_kv_heads) I(head_size) I(block_size)       \
  I(group) I(heads_per_cta) I(num_head_chunks) I(num_splits) I(partition_size)            \
  I(sliding_window) I(dtype) I(kv_dtype) I(kernel) I(group_tile) I(q_tile_tokens)         \
  I(stages)                                                                               \
  I(warp_sync) I(l2_prefetch)                                                            \
  I(grid_x) I(grid_y) I(grid_z) I(threads) I(smem_bytes)                                  \
  I(reduce_grid_x) I(reduce_grid_y) I(reduce_threads)                                     \
  F(scale) F(soft_cap)

// One row = `row_bytes` contiguous bytes (a head's `head_size` elements); strides in BYTES; rows
// are copied in units of `unit_bytes` (16, 8, 4 or 2: the alignment of every address involved).
// Tokens whose slot is negative or >= num_slots are skipped. With an 8-bit cache (kv_dtype != 0)
// each element of dtype `dtype` is quantised with its KV head's k_scale / v_scale instead
// (pk_kv8.cuh); rows are then `head_size` elements and the units are unused.
// `k_scale`/`v_scale` (attention too): float32 [num_kv_heads], or null for a float cache.
#define PK_WRITE_KV_FIELDS(P, I, F)                                                        \
  P(key) P(value) P(k_cache) P(v_cache) P(slot_mapping) P(k_scale) P(v_scale)             \
  I(key_stride_token) I(key_stride_head) I(value_stride_token) I(value_stride_head)       \
  I(k_stride_block) I(k_stride_head) I(k_stride_slot)                                     \
  I(v_stride_block) I(v_stride_head) I(v_stride_slot)                                     \
  I(num_tokens) I(num_kv_heads) I(block_size) I(num_slots) I(row_bytes) I(unit_bytes)     \
  I(head_size) I(dtype) I(kv_dtype) I(grid_x) I(grid_y) I(threads)

// Copies block `mapping[i][0]` of cache `src_caches[c]` to block `mapping[i][1]` of
// `dst_caches[c]` for every pair i and cache c. `src_caches`/`dst_caches` are device arrays of
// `num_caches` cache base addresses (int64); strides are in BYTES here and shared by all caches;
// rows are copied in units of `unit_bytes` as for write_kv.
#define PK_COPY_FIELDS(P, I, F)                                                            \
  P(src_caches) P(dst_caches) P(mapping)                                                  \
  I(num_caches) I(num_pairs) I(num_kv_heads) I(block_size) I(row_bytes) I(unit_bytes)     \
  I(src_stride_block) I(src_stride_head) I(src_stride_slot)                               \
  I(dst_stride_block) I(dst_stride_head) I(dst_stride_slot)                               \
  I(grid_x) I(grid_y) I(threads)

#define PK_FIELD_P(name) void* name;
#define PK_FIELD_I(name) int64_t name;
#define PK_FIELD_F(name) double name;

struct PkAttnParams { PK_ATTN_FIELDS(PK_FIELD_P, PK_FIELD_I, PK_FIELD_F) };
struct PkWriteKvParams { PK_WRITE_KV_FIELDS(PK_FIELD_P, PK_FIELD_I, PK_FIELD_F) };
struct PkCopyParams { PK_COPY_FIELDS(PK_FIELD_P, PK_FIELD_I, PK_FIELD_F) };

// Values of PkAttnParams::dtype.
enum PkDtype : int64_t { PK_FLOAT32 = 0, PK_FLOAT16 = 1, PK_BFLOAT16 = 2 };

// Values of the kv_dtype fields: the cache holds the query's dtype, or one 8-bit format.
enum PkKvDtype : int64_t {
  PK_KV_NATIVE = 0, PK_KV_FP8_E4M3 = 1, PK_KV_FP8_E5M2 = 2, PK_KV_INT8 = 3,
};

// Values of PkAttnParams::kernel.
enum PkAttnKernel : int64_t {
  PK_KERNEL_DECODE = 0,       // pk_decode_kernel (+ pk_decode_reduce_kernel when num_splits > 1)
  PK_KERNEL_VARLEN_MMA = 1,   // pk_varlen_mma_async_kernel (f16/bf16 tensor cores)
  PK_KERNEL_VARLEN_SIMT = 2,  // pk_varlen_simt_kernel (float32)
  PK_KERNEL_DECODE_MMA = 3,   // pk_decode_mma_kernel (f16/bf16) (+ the decode reduce kernel)
};

#if !defined(__CUDACC_RTC__)
// Paged attention (decode or varlen, chosen by the plan in `p.kernel`). Writes p.out, p.lse.
const char* pk_paged_attention(const PkAttnParams& p, void* stream);
// Scatters key/value rows to their slots (quantised into an 8-bit cache); negative slots are
// skipped.
const char* pk_write_kv(const PkWriteKvParams& p, void* stream);
// Block copies inside or between caches on the device (copy_blocks, device-side swap_blocks).
const char* pk_copy_blocks(const PkCopyParams& p, void* stream);
#endif  // !__CUDACC_RTC__
