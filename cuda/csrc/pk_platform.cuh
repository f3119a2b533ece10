// pk_platform.cuh: the one header every kernel source includes first.
//
// Three compilers read the kernel sources:
//   - nvcc (ahead-of-time extension `_pk_cuda`, and the compile check): CUDA runtime + fp16/bf16;
//   - NVRTC through CuPy (run-time path, `__CUDACC_RTC__`): kernels only, no runtime API, no
//     host launchers; fixed-width integer types are declared here because NVRTC has no libc;
//   - g++ as host C++ with -DPK_HOST_EMULATION (backend "cuda-host"): the emulator in
//     ../host/pk_host_emul.h provides the CUDA subset listed in docs/cuda.md and the contract.
//
// The kernels use only the agreed subset of CUDA (see /work/prompts/cuda_contract.md, item 1):
// no implicit warp synchronicity (every cross-lane exchange is a __shfl_*_sync, every
// cross-warp exchange goes through shared memory between two __syncthreads()).
//
// ===================================== EMULATION REQUESTS ======================================
// (read by CH; things outside the agreed subset that the kernels or launchers rely on)
//  R1. `PK_LAST_LAUNCH_ERROR()`: a `const char*` expression, nullptr when the last launch worked.
//      pk_platform.cuh defines it as nullptr under PK_HOST_EMULATION unless the emulator defines
//      it first (define it if the emulator can detect launch errors, e.g. too many threads).
//  R2. Aliasing: kernels read 16-byte `uint4` vectors and reinterpret them as `__half`,
//      `__nv_bfloat16` or `float` lanes (and `uint32_t` as `__half2`/`__nv_bfloat162`), as CUDA
//      code does. Please compile the host build with -fno-strict-aliasing.
//  R3. `__half2`/`__nv_bfloat162` must be 4 bytes with .x the low half (bytes 0-1), as on the GPU,
//      and `__half`/`__nv_bfloat16` 2 bytes holding the IEEE/bfloat16 bits (kernels copy raw bits
//      between them and uint16_t/uint32_t).
//  R4. `extern __shared__ float4 name[];` is the only dynamic shared memory declaration used (one
//      per kernel, 16-byte aligned); its size is the launch's smem_bytes.
//  R5. Kernels take one parameter struct by value (`const PkAttnParams p`), nothing else.
//  R6. `__launch_bounds__(N)` and `__launch_bounds__(N, M)` are used on kernels.
//  R7. (Done: host_build.py passes -fno-extern-tls-init.) Was blocking: `extern __shared__ float4 pk_smem4[];` is declared inside function
//      templates in several translation units; g++ then calls the weak TLS init function
//      `_ZTH8pk_smem4` unconditionally (a call to address 0, SIGSEGV in pk_decode_kernel). Compiling
//      with `-fno-extern-tls-init` fixes it (checked: decode and varlen then match the reference).
//  R8. `fmaf` (float fused multiply-add) is used; `__ldg` is called on `const uint4*`,
//      `const int32_t*`, `const int64_t*` and `const float*`.
//  R9. `pk_mma_m16n8k16_*(d, a, b, c)` is called with `d` and `c` the same array (accumulate in
//      place), as the PTX instruction allows.
//  R10. `uint2`, `uint16_t` and `uint32_t` are used as copy units (pk_cache.cuh).
// ================================================================================================
#pragma once

#if defined(PK_HOST_EMULATION)
#include "../host/pk_host_emul.h"
#include <cstdint>
#include <cstring>
#ifndef PK_LAST_LAUNCH_ERROR
#define PK_LAST_LAUNCH_ERROR() (static_cast<const char*>(nullptr))
#endif
#define PK_DEVICE_CODE 1

#elif defined(__CUDACC_RTC__)
// NVRTC: no C library. These are the LP64 widths of the types the sources use.
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#ifndef INFINITY  // from <math.h> elsewhere
#define INFINITY __int_as_float(0x7f800000)
#endif
#define PK_DEVICE_CODE 1

#else  // nvcc (or a host compiler reading only the launcher declarations)
#include <cstdint>
#include <cstring>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Launches `kernel` on `grid` x `block` with `smem` bytes of dynamic shared memory on `stream`.
#define PK_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)

// Dynamic shared memory above 48 KiB must be opted into per kernel.
#define PK_SET_MAX_DYNAMIC_SMEM(kernel, bytes) \
  cudaFuncSetAttribute((kernel), cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(bytes))

#define PK_LAST_LAUNCH_ERROR() pk_cuda_error_string(cudaGetLastError())

static inline const char* pk_cuda_error_string(cudaError_t err) {
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}
#define PK_DEVICE_CODE 1
#endif

#define PK_FULL_MASK 0xffffffffu
