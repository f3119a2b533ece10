// pk_launch.cuh: the launchers' template dispatch (host code; not read by NVRTC).
//
// The plan (kernel, template arguments, grid, threads, shared memory, splits) arrives in the
// params struct from cuda/paged_cuda/planner.py; these functions only map its runtime values to
// the compiled template instantiations and launch. Each dtype's attention kernels are
// instantiated in their own translation unit (pk_attention_<dtype>.cu) so nvcc compiles them in
// parallel; the kernels over an 8-bit cache, for every query dtype, in pk_attention_kv8.cu
// (T = PkKv8: the SIMT decode and varlen kernels).
//
// PK_HEAD_SIZES(X) lists the compiled head sizes. Defining PK_REDUCED_HEAD_SIZES (the compile
// check's fast mode) or PK_HOST_INSTANTIATIONS (the host build's reduced set) compiles only 64 and
// 128; a launch for another size then returns an error saying so.
#pragma once
#include "pk_platform.cuh"
#include "pk_ops.h"
#include "pk_decode.cuh"
#include "pk_varlen.cuh"

#if defined(PK_REDUCED_HEAD_SIZES) || defined(PK_HOST_INSTANTIATIONS)
#define PK_HEAD_SIZES(X) X(64) X(128)
#else
#define PK_HEAD_SIZES(X) X(64) X(80) X(96) X(112) X(128) X(192) X(256)
#endif

#define PK_STREAM(s) static_cast<cudaStream_t>(s)

template <typename Kernel>
const char* pk_launch_one(Kernel kernel, const PkAttnParams& p, void* stream) {
  if (p.smem_bytes > 48 * 1024) PK_SET_MAX_DYNAMIC_SMEM(kernel, p.smem_bytes);
  PK_LAUNCH(kernel, dim3(p.grid_x, p.grid_y, p.grid_z), dim3(p.threads), p.smem_bytes,
            PK_STREAM(stream), p);
  return PK_LAST_LAUNCH_ERROR();
}

// PkKv8 (an 8-bit cache, the query's dtype at run time), and the element types the SIMT kernels
// are instantiated for: float and PkKv8.
template <typename T> constexpr bool pk_is_kv8 = false;
template <> constexpr bool pk_is_kv8<PkKv8> = true;
template <typename T> constexpr bool pk_simt_type = pk_is_kv8<T>;
template <> constexpr bool pk_simt_type<float> = true;

template <typename T>
const char* pk_launch_reduce(const PkAttnParams& p, void* stream) {
  auto reduce = &pk_decode_reduce_kernel<T>;
  PK_LAUNCH(reduce, dim3(p.reduce_grid_x, p.reduce_grid_y, 1), dim3(p.reduce_threads), 0,
            PK_STREAM(stream), p);
  return PK_LAST_LAUNCH_ERROR();
}

// A decode kernel, then (with split-K partitions) the reduce kernel of the output's dtype.
template <typename T, typename Kernel>
const char* pk_launch_decode_and_reduce(Kernel kernel, const PkAttnParams& p, void* stream) {
  if (const char* err = pk_launch_one(kernel, p, stream)) return err;
  if (p.num_splits <= 1) return nullptr;
  if constexpr (pk_is_kv8<T>) {
    switch (p.dtype) {
      case PK_FLOAT32: return pk_launch_reduce<float>(p, stream);
      case PK_FLOAT16: return pk_launch_reduce<__half>(p, stream);
      case PK_BFLOAT16: return pk_launch_reduce<__nv_bfloat16>(p, stream);
      default: return "decode: dtype must be float32, float16 or bfloat16";
    }
  } else {
    return pk_launch_reduce<T>(p, stream);
  }
}

template <typename T, int D, int GT>
const char* pk_launch_decode(const PkAttnParams& p, void* stream) {
  return pk_launch_decode_and_reduce<T>(&pk_decode_kernel<T, D, GT>, p, stream);
}

// The tensor-core decode kernel exists for the 16-bit types only; the plan's thread count picks
// its warps (and so its tile of 16 keys per warp).
template <typename T, int D>
const char* pk_launch_decode_mma(const PkAttnParams& p, void* stream) {
  if constexpr (sizeof(T) == 2) {
    switch (p.threads) {
      case 64: return pk_launch_decode_and_reduce<T>(&pk_decode_mma_kernel<T, D, 2>, p, stream);
      case 128: return pk_launch_decode_and_reduce<T>(&pk_decode_mma_kernel<T, D, 4>, p, stream);
      default: return "decode: the mma kernel runs 64 or 128 threads (2 or 4 warps)";
    }
  } else {
    return "decode: the mma kernel takes float16 or bfloat16 only";
  }
}

// The SIMT decode kernel is float32's and the 8-bit caches'; 16-bit types run
// pk_decode_mma_kernel.
template <typename T, int D>
const char* pk_launch_decode_group(const PkAttnParams& p, void* stream) {
  if constexpr (pk_simt_type<T>) {
    switch (p.group_tile) {
      case 1: return pk_launch_decode<T, D, 1>(p, stream);
      case 2: return pk_launch_decode<T, D, 2>(p, stream);
      case 4: return pk_launch_decode<T, D, 4>(p, stream);
      case 8: return pk_launch_decode<T, D, 8>(p, stream);
      default: return "decode: group_tile must be 1, 2, 4 or 8";
    }
  } else {
    return "decode: the SIMT kernel takes float32 or an 8-bit cache (16-bit types run the mma "
           "kernel)";
  }
}

// The varlen kernels: the cp.async-ring mma kernel for 16-bit types (the plan's thread count
// picks its warps), the SIMT kernel for float32 and 8-bit caches.
template <typename T, int D>
const char* pk_launch_varlen(const PkAttnParams& p, void* stream) {
  if constexpr (sizeof(T) == 2) {
    if (p.kernel != PK_KERNEL_VARLEN_MMA) return "varlen: 16-bit types run the mma kernel only";
    switch (p.threads) {
      case 128: return pk_launch_one(&pk_varlen_mma_async_kernel<T, D, 4>, p, stream);
      case 256: return pk_launch_one(&pk_varlen_mma_async_kernel<T, D, 8>, p, stream);
      default: return "varlen: the mma kernel runs 128 or 256 threads (4 or 8 warps)";
    }
  } else {
    if (p.kernel != PK_KERNEL_VARLEN_SIMT)
      return "varlen: float32 and 8-bit caches run the SIMT kernel only";
    return pk_launch_one(&pk_varlen_simt_kernel<T, D>, p, stream);
  }
}

template <typename T, int D>
const char* pk_launch_attention_d(const PkAttnParams& p, void* stream) {
  if (p.kernel == PK_KERNEL_DECODE) return pk_launch_decode_group<T, D>(p, stream);
  if (p.kernel == PK_KERNEL_DECODE_MMA) return pk_launch_decode_mma<T, D>(p, stream);
  return pk_launch_varlen<T, D>(p, stream);
}

// Entry point per dtype: dispatch on head size.
template <typename T>
const char* pk_launch_attention(const PkAttnParams& p, void* stream) {
#define PK_HEAD_CASE(D) \
  case D: return pk_launch_attention_d<T, D>(p, stream);
  switch (p.head_size) {
    PK_HEAD_SIZES(PK_HEAD_CASE)
    default: return "head_size is not compiled into this build (see PK_HEAD_SIZES)";
  }
#undef PK_HEAD_CASE
}

const char* pk_attention_f32(const PkAttnParams& p, void* stream);
const char* pk_attention_f16(const PkAttnParams& p, void* stream);
const char* pk_attention_bf16(const PkAttnParams& p, void* stream);
const char* pk_attention_kv8(const PkAttnParams& p, void* stream);
