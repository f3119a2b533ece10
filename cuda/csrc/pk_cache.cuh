// pk_cache.cuh: the cache operations. Both kernels move bytes, not elements: a row is one KV
// head's `row_bytes` contiguous bytes, copied in units of U (uint4, uint2, uint32_t or uint16_t,
// the widest the alignment of every address allows; launch.py picks it). Strides are in bytes.
//
// pk_write_kv_kernel<U>
//   Grid: (num_tokens); `threads` threads. One block owns one token: its num_kv_heads key rows
//   and value rows go to slot slot_mapping[token] (block = slot / block_size, offset = slot %
//   block_size); a negative slot (padding) or one >= num_slots skips the token. Moves
//   2 * num_kv_heads * row_bytes in and out.
//   Invariant: slots are distinct among the non-negative ones; offsets are int64.
//
// pk_write_kv_quant_kernel<T = float | __half | __nv_bfloat16>
//   The same for an 8-bit cache (p.kv_dtype): each element of a K (V) row of KV head h is stored
//   as pk_float_to_kv8(x / k_scale[h]) (v_scale[h]), one byte. Moves 2 * num_kv_heads *
//   head_size * (sizeof(T) in + 1 out) bytes per token.
//
// pk_copy_blocks_kernel<U>
//   Grid: (num_pairs, num_caches); `threads` threads. One block owns one (src, dst) pair of one
//   cache: num_kv_heads * block_size rows. Moves that many rows in and out.
//   Invariant: no dst is also a src of the same call (blocks run in any order).
#pragma once
#include "pk_platform.cuh"
#include "pk_kv8.cuh"
#include "pk_ops.h"

template <typename U>
__global__ void __launch_bounds__(128) pk_write_kv_kernel(const PkWriteKvParams p) {
  const int64_t tok = blockIdx.x;
  const int64_t slot = __ldg(static_cast<const int64_t*>(p.slot_mapping) + tok);
  if (slot < 0 || slot >= p.num_slots) return;  // padding, or out of range (ABI: skipped)
  const int64_t blk = slot / p.block_size, off = slot % p.block_size;
  const int units = static_cast<int>(p.row_bytes / static_cast<int64_t>(sizeof(U)));
  const int total = static_cast<int>(p.num_kv_heads) * units;
  const char* key = static_cast<const char*>(p.key) + tok * p.key_stride_token;
  const char* value = static_cast<const char*>(p.value) + tok * p.value_stride_token;
  char* kdst = static_cast<char*>(p.k_cache) + blk * p.k_stride_block + off * p.k_stride_slot;
  char* vdst = static_cast<char*>(p.v_cache) + blk * p.v_stride_block + off * p.v_stride_slot;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int64_t h = i / units, u = (i % units) * static_cast<int64_t>(sizeof(U));
    *reinterpret_cast<U*>(kdst + h * p.k_stride_head + u) =
        *reinterpret_cast<const U*>(key + h * p.key_stride_head + u);
    *reinterpret_cast<U*>(vdst + h * p.v_stride_head + u) =
        *reinterpret_cast<const U*>(value + h * p.value_stride_head + u);
  }
}

template <typename T>
__global__ void __launch_bounds__(128) pk_write_kv_quant_kernel(const PkWriteKvParams p) {
  const int64_t tok = blockIdx.x;
  const int64_t slot = __ldg(static_cast<const int64_t*>(p.slot_mapping) + tok);
  if (slot < 0 || slot >= p.num_slots) return;  // padding, or out of range (ABI: skipped)
  const int64_t blk = slot / p.block_size, off = slot % p.block_size;
  const int fmt = static_cast<int>(p.kv_dtype), head_size = static_cast<int>(p.head_size);
  const int total = static_cast<int>(p.num_kv_heads) * head_size;
  const char* key = static_cast<const char*>(p.key) + tok * p.key_stride_token;
  const char* value = static_cast<const char*>(p.value) + tok * p.value_stride_token;
  uint8_t* kdst = static_cast<uint8_t*>(p.k_cache) + blk * p.k_stride_block + off * p.k_stride_slot;
  uint8_t* vdst = static_cast<uint8_t*>(p.v_cache) + blk * p.v_stride_block + off * p.v_stride_slot;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int h = i / head_size, d = i % head_size;
    const float k = pk_to_float(reinterpret_cast<const T*>(key + h * p.key_stride_head)[d]);
    const float v = pk_to_float(reinterpret_cast<const T*>(value + h * p.value_stride_head)[d]);
    kdst[h * p.k_stride_head + d] =
        pk_float_to_kv8(k / __ldg(static_cast<const float*>(p.k_scale) + h), fmt);
    vdst[h * p.v_stride_head + d] =
        pk_float_to_kv8(v / __ldg(static_cast<const float*>(p.v_scale) + h), fmt);
  }
}

template <typename U>
__global__ void __launch_bounds__(128) pk_copy_blocks_kernel(const PkCopyParams p) {
  const int64_t pair = blockIdx.x, cache = blockIdx.y;
  const int64_t* mapping = static_cast<const int64_t*>(p.mapping);
  const int64_t src_blk = __ldg(mapping + 2 * pair), dst_blk = __ldg(mapping + 2 * pair + 1);
  const char* src = reinterpret_cast<const char*>(
      __ldg(static_cast<const int64_t*>(p.src_caches) + cache)) + src_blk * p.src_stride_block;
  char* dst = reinterpret_cast<char*>(
      __ldg(static_cast<const int64_t*>(p.dst_caches) + cache)) + dst_blk * p.dst_stride_block;
  const int units = static_cast<int>(p.row_bytes / static_cast<int64_t>(sizeof(U)));
  const int rows_per_head = static_cast<int>(p.block_size);
  const int total = static_cast<int>(p.num_kv_heads) * rows_per_head * units;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int64_t row = i / units, u = (i % units) * static_cast<int64_t>(sizeof(U));
    const int64_t h = row / rows_per_head, slot = row % rows_per_head;
    *reinterpret_cast<U*>(dst + h * p.dst_stride_head + slot * p.dst_stride_slot + u) =
        *reinterpret_cast<const U*>(src + h * p.src_stride_head + slot * p.src_stride_slot + u);
  }
}
