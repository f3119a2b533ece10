// pk_cp_async.cuh: asynchronous global -> shared copies (PTX `cp.async`, sm_80+), the memory
// pipeline of the mma decode kernel. Under PK_HOST_EMULATION this header defines nothing and
// the emulator (cuda/host/pk_host_async.h) provides the same functions with the same semantics.
//
// Semantics the kernels rely on (PTX ISA, "cp.async"):
//   pk_cp_async16(dst, src, valid): starts copying 16 bytes from global `src` to shared `dst`
//     (both 16-byte aligned); with valid == false nothing is read and `dst` gets 16 zero bytes
//     (`src` must still be a valid address expression; it is not dereferenced).
//   pk_cp_async_commit(): closes this thread's uncommitted copies into one group (possibly empty).
//   pk_prefetch_l2(src, bytes): a hint to start bringing `bytes` (a multiple of 16) of global
//     memory at `src` (16-byte aligned, all of it valid memory) into L2; no effect on results.
//   pk_cp_async_wait<N>(): waits until at most N of this thread's most recent committed groups
//     are pending; all older groups have landed. A copy's data is visible to the issuing thread
//     after its wait, and to other threads of the block only after a __syncthreads() that
//     follows that wait. Until then the destination must not be read (nor written).
#pragma once
#include "pk_platform.cuh"

#if !defined(PK_HOST_EMULATION)

__device__ __forceinline__ void pk_cp_async16(void* dst, const void* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(d), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void pk_prefetch_l2(const void* src, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // One bulk prefetch of exactly `bytes` (sm_90's copy engine).
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(src), "r"(bytes) : "memory");
#else
  for (int at = 0; at < bytes; at += 128)  // one L2 line (128 bytes) at a time
    asm volatile("prefetch.global.L2 [%0];\n" :: "l"(static_cast<const char*>(src) + at));
#endif
}

__device__ __forceinline__ void pk_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void pk_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

#endif  // !PK_HOST_EMULATION

// pk_cp_async_wait<n>() for a run-time n in [0, 2] (wait_group takes an immediate); larger n
// waits as for 2, which is stricter and so always safe.
__device__ __forceinline__ void pk_cp_async_wait_upto2(int n) {
  if (n <= 0) pk_cp_async_wait<0>();
  else if (n == 1) pk_cp_async_wait<1>();
  else pk_cp_async_wait<2>();
}
