// pk_ops.cu: the entry points declared in pk_ops.h.
#include "pk_launch.cuh"
#include "pk_cache.cuh"

const char* pk_paged_attention(const PkAttnParams& p, void* stream) {
  if (p.kv_dtype != PK_KV_NATIVE) {
    if (p.kv_dtype < PK_KV_FP8_E4M3 || p.kv_dtype > PK_KV_INT8)
      return "kv_dtype must be 0 (the query's dtype), 1 (e4m3), 2 (e5m2) or 3 (int8)";
    return pk_attention_kv8(p, stream);
  }
  switch (p.dtype) {
    case PK_FLOAT32: return pk_attention_f32(p, stream);
    case PK_FLOAT16: return pk_attention_f16(p, stream);
    case PK_BFLOAT16: return pk_attention_bf16(p, stream);
    default: return "dtype must be float32, float16 or bfloat16";
  }
}

template <typename U>
static const char* pk_launch_write_kv(const PkWriteKvParams& p, void* stream) {
  auto kernel = &pk_write_kv_kernel<U>;
  PK_LAUNCH(kernel, dim3(p.grid_x, p.grid_y, 1), dim3(p.threads), 0, PK_STREAM(stream), p);
  return PK_LAST_LAUNCH_ERROR();
}

template <typename T>
static const char* pk_launch_write_kv_quant(const PkWriteKvParams& p, void* stream) {
  auto kernel = &pk_write_kv_quant_kernel<T>;
  PK_LAUNCH(kernel, dim3(p.grid_x, p.grid_y, 1), dim3(p.threads), 0, PK_STREAM(stream), p);
  return PK_LAST_LAUNCH_ERROR();
}

const char* pk_write_kv(const PkWriteKvParams& p, void* stream) {
  if (p.kv_dtype != PK_KV_NATIVE) {
    if (p.kv_dtype < PK_KV_FP8_E4M3 || p.kv_dtype > PK_KV_INT8)
      return "write_kv: kv_dtype must be 0 (the rows' dtype), 1 (e4m3), 2 (e5m2) or 3 (int8)";
    switch (p.dtype) {
      case PK_FLOAT32: return pk_launch_write_kv_quant<float>(p, stream);
      case PK_FLOAT16: return pk_launch_write_kv_quant<__half>(p, stream);
      case PK_BFLOAT16: return pk_launch_write_kv_quant<__nv_bfloat16>(p, stream);
      default: return "write_kv: dtype must be float32, float16 or bfloat16";
    }
  }
  switch (p.unit_bytes) {
    case 16: return pk_launch_write_kv<uint4>(p, stream);
    case 8: return pk_launch_write_kv<uint2>(p, stream);
    case 4: return pk_launch_write_kv<uint32_t>(p, stream);
    case 2: return pk_launch_write_kv<uint16_t>(p, stream);
    default: return "write_kv: unit_bytes must be 16, 8, 4 or 2";
  }
}

template <typename U>
static const char* pk_launch_copy(const PkCopyParams& p, void* stream) {
  auto kernel = &pk_copy_blocks_kernel<U>;
  PK_LAUNCH(kernel, dim3(p.grid_x, p.grid_y, 1), dim3(p.threads), 0, PK_STREAM(stream), p);
  return PK_LAST_LAUNCH_ERROR();
}

const char* pk_copy_blocks(const PkCopyParams& p, void* stream) {
  switch (p.unit_bytes) {
    case 16: return pk_launch_copy<uint4>(p, stream);
    case 8: return pk_launch_copy<uint2>(p, stream);
    case 4: return pk_launch_copy<uint32_t>(p, stream);
    case 2: return pk_launch_copy<uint16_t>(p, stream);
    default: return "copy_blocks: unit_bytes must be 16, 8, 4 or 2";
  }
}
