// pk_host_emul.h: the CUDA subset of the kernels (cuda/csrc), for g++ compiling them as host C++
// with -DPK_HOST_EMULATION (backend "cuda-host"). cuda/csrc/pk_platform.cuh includes it first.
//
//   pk_host_types.h  dim3, uint4/float4/..., __half/__nv_bfloat16 (+ pairs) and conversions
//   pk_host_math.h   __expf/rsqrtf/min/max/__ldg/atomics and friends
//   pk_host_sched.h  threadIdx & co, __syncthreads, warp shuffles/votes, PK_LAUNCH, CUDA runtime
//   pk_host_mma.h    pk_mma_m16n8k16_f16/_bf16 and pk_ldmatrix_x4(_trans) as warp collectives
//                    with the PTX fragment layouts
//   pk_host_async.h  pk_cp_async16/_commit/_wait: copies land at the latest moment PTX allows
//   pk_host_hooks.h  preemption points of the random schedule
//   pk_host_runtime.cpp  the fiber scheduler (compiled into every host build)
//
// What running kernels this way proves, and what it cannot, is in docs/cuda-host.md.
#pragma once

#ifndef PK_HOST_EMULATION
#define PK_HOST_EMULATION 1
#endif

#include "pk_host_types.h"
#include "pk_host_math.h"
#include "pk_host_sched.h"
#include "pk_host_mma.h"
#include "pk_host_async.h"

// Function and variable qualifiers. `__shared__` is thread_local: one host thread runs all the
// threads (fibers) of one block, so they share the object (see pk_host_sched.h). It also keeps
// `extern __shared__ T name[];` a valid declaration; host_build.py defines those arrays.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ thread_local
#define __constant__
#define __align__(n) __attribute__((aligned(n)))
