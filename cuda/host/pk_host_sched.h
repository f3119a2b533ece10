// pk_host_sched.h: the execution model of the emulator: grids, blocks, threads, barriers, warp
// collectives and launches. The scheduler itself is in pk_host_runtime.cpp.
//
// Model (docs/cuda-host.md says what it proves and what it does not):
// - The blocks of a grid run one after another on the launching host thread.
// - Each CUDA thread of a block is a fiber: its own stack and registers, switched cooperatively
//   on that one host thread. A fiber runs until it reaches a barrier (`__syncthreads`, a warp
//   collective) or returns; then the scheduler runs the next ready fiber. So every thread of a
//   block really stops at `__syncthreads()` until all of them got there (threads that returned
//   count as arrived), and a warp collective completes only when all existing lanes of the warp
//   entered one; a lane that returned, or waits at a different barrier, is reported as a deadlock.
// - Between barriers threads run one at a time, in an order set by PK_HOST_SCHEDULE:
//   "forward" (thread 0 first, the default), "reverse", or "random" (seeded by PK_HOST_SEED: a new
//   order at each step, and the running thread is also preempted at random preemption points,
//   see pk_host_hooks.h), or "warps" (warp-serial: warps in a random priority order, seeded by
//   PK_HOST_SEED; one warp runs as far as it can, up to a __syncthreads, before the next moves).
//   A missing barrier shows up as a result that depends on the schedule.
// - Static `__shared__` variables are `thread_local` (one host thread runs one block at a time, so
//   all threads of a block see the same object). Dynamic `extern __shared__` arrays are defined
//   by the host build (host_build.py) as one buffer per name. At the start of every block they,
//   and the static arrays of template/inline kernels that the build found, are filled with 0xFF
//   bytes (NaN for every float type), so reading before writing shows; other static arrays keep
//   the previous block's contents, as uninitialised shared memory may on a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "pk_host_types.h"

// ---- CUDA runtime subset ----
struct CUstream_st;
typedef CUstream_st* cudaStream_t;

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
typedef cudaError_t cudaError;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};

namespace pk_host {

constexpr int kWarpSize = 32;
constexpr unsigned kMaxThreadsPerBlock = 1024;
// Dynamic shared memory one block may use (sm_90: 227 KiB), and the default without opt-in.
constexpr size_t kMaxDynamicSmem = 227 * 1024;
constexpr size_t kDefaultDynamicSmem = 48 * 1024;
// Bytes one lane may contribute to one warp collective (an mma fragment set fits).
constexpr size_t kExchangeBytes = 64;

// One cp.async of 16 bytes that has been issued and has not landed (pk_host_async.h).
struct AsyncCopy {
  void* dst;
  const void* src;  // nullptr: zero-fill
};

// What one emulated CUDA thread knows about itself.
struct ThreadState {
  uint3 idx;
  unsigned linear;
  unsigned warp;
  unsigned lane;
  unsigned collective_seq;  // warp collectives entered so far (selects the exchange buffer)
  std::vector<AsyncCopy> async_uncommitted;           // cp.async since the last commit
  std::deque<std::vector<AsyncCopy>> async_groups;    // committed groups, oldest first
};

// Kinds of warp collectives; all lanes of one collective must agree on the kind.
enum CollectiveKind : int { kShuffle = 1, kSyncWarp = 2, kVote = 3, kMma = 4, kLdmatrix = 5 };

inline thread_local ThreadState* tls_thread = nullptr;
inline thread_local uint3 tls_block_idx = {0, 0, 0};
inline thread_local dim3 tls_block_dim = dim3(1, 1, 1);
inline thread_local dim3 tls_grid_dim = dim3(1, 1, 1);

// Block barrier (`__syncthreads`).
void syncthreads();
// Enters a warp collective: stores `n` bytes of `mine` in this lane's slot, waits until every
// existing lane of the warp entered a collective of the same kind, and returns the 32 slots
// (`kExchangeBytes` apart) of that collective; they stay valid until this lane enters the next
// collective but one. `mask` must name every existing lane of the warp.
const unsigned char* warp_exchange(const void* mine, size_t n, unsigned mask, int kind);
// Bit i set for every lane i that exists in the calling thread's warp.
unsigned warp_existing_lanes();
// Records a fatal error of the running launch (the launch stops; PK_LAST_LAUNCH_ERROR reports).
[[noreturn]] void fail(const char* message);

// A non-owning reference to the code one thread of the launched grid runs.
struct KernelBody {
  void (*call)(void* ctx);
  void* ctx;
};

// Runs the grid (see the file comment); returns cudaSuccess or records an error.
cudaError_t launch_grid(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes,
                        KernelBody body);
cudaError_t set_max_dynamic_smem(const void* kernel, long long bytes);

// Error of the last failed launch on this host thread since the last query (then cleared), or
// nullptr.
const char* take_last_error();
const char* peek_last_error();
cudaError_t take_last_error_code();
cudaError_t peek_last_error_code();

template <typename... P, typename S, typename... A>
cudaError_t launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem_bytes,
                          S /*stream*/, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong argument count");
  // Arguments are converted to the parameter types once, at the launch, as CUDA does.
  std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
  using Params = decltype(params);
  struct Ctx {
    void (*kernel)(P...);
    Params* params;
  } ctx{kernel, &params};
  KernelBody body{[](void* c) {
                    Ctx* k = static_cast<Ctx*>(c);
                    Params copy = *k->params;  // each thread gets its own copy of the arguments
                    std::apply(k->kernel, copy);
                  },
                  &ctx};
  return launch_grid(reinterpret_cast<const void*>(kernel), grid, block, smem_bytes, body);
}

template <typename F>
cudaError_t set_max_dynamic_smem_of(F* kernel, long long bytes) {
  return set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
}

// The value lane `src` deposited, or the caller's own `var` when `src` is -1 or no lane.
template <typename T>
inline T shuffle_from(const T& var, const unsigned char* slots, int src) {
  if (src < 0 || !((warp_existing_lanes() >> src) & 1u)) return var;
  T out;
  std::memcpy(&out, slots + static_cast<size_t>(src) * kExchangeBytes, sizeof(T));
  return out;
}

template <typename T>
inline const unsigned char* shuffle_exchange(unsigned mask, const T& var) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= kExchangeBytes,
                "__shfl_*_sync: the value must be trivially copyable and at most 64 bytes");
  return warp_exchange(&var, sizeof(T), mask, kShuffle);
}

inline void check_width(int width) {
  if (width < 1 || width > kWarpSize || (width & (width - 1)) != 0)
    fail("__shfl_*_sync: width must be a power of two in [1, 32]");
}

}  // namespace pk_host

// ---- thread/block coordinates ----
#define threadIdx (static_cast<const uint3&>(::pk_host::tls_thread->idx))
#define blockIdx (static_cast<const uint3&>(::pk_host::tls_block_idx))
#define blockDim (static_cast<const dim3&>(::pk_host::tls_block_dim))
#define gridDim (static_cast<const dim3&>(::pk_host::tls_grid_dim))
constexpr int warpSize = ::pk_host::kWarpSize;

inline void __syncthreads() { ::pk_host::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::pk_host::warp_exchange(nullptr, 0, mask, ::pk_host::kSyncWarp);
}
inline void __threadfence() {}
inline void __threadfence_block() {}

// ---- warp shuffles (CUDA semantics for the source lane and `width` segments) ----
template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  ::pk_host::check_width(width);
  const unsigned char* slots = ::pk_host::shuffle_exchange(mask, var);
  int lane = static_cast<int>(::pk_host::tls_thread->lane);
  int src = (lane & ~(width - 1)) + (src_lane & (width - 1));
  return ::pk_host::shuffle_from(var, slots, src);
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  ::pk_host::check_width(width);
  const unsigned char* slots = ::pk_host::shuffle_exchange(mask, var);
  int lane = static_cast<int>(::pk_host::tls_thread->lane);
  int src = lane ^ lane_mask;
  // Lanes of a later width-segment (or outside the warp) give back the caller's own value.
  if (src >= ((lane / width) + 1) * width || src >= warpSize) src = -1;
  return ::pk_host::shuffle_from(var, slots, src);
}

template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  ::pk_host::check_width(width);
  const unsigned char* slots = ::pk_host::shuffle_exchange(mask, var);
  int lane = static_cast<int>(::pk_host::tls_thread->lane);
  int in_seg = (lane & (width - 1)) + static_cast<int>(delta);
  int src = in_seg >= width ? -1 : lane + static_cast<int>(delta);
  return ::pk_host::shuffle_from(var, slots, src);
}

template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  ::pk_host::check_width(width);
  const unsigned char* slots = ::pk_host::shuffle_exchange(mask, var);
  int lane = static_cast<int>(::pk_host::tls_thread->lane);
  int src = (lane & (width - 1)) < static_cast<int>(delta) ? -1 : lane - static_cast<int>(delta);
  return ::pk_host::shuffle_from(var, slots, src);
}

// ---- warp votes ----
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  int p = predicate != 0;
  const unsigned char* slots = ::pk_host::warp_exchange(&p, sizeof(p), mask, ::pk_host::kVote);
  unsigned existing = ::pk_host::warp_existing_lanes();
  unsigned bits = 0;
  for (int l = 0; l < warpSize; ++l) {
    int v = 0;
    if ((existing >> l) & 1u) std::memcpy(&v, slots + l * ::pk_host::kExchangeBytes, sizeof(v));
    if (v) bits |= 1u << l;
  }
  return bits & mask;
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) {
  return __ballot_sync(mask, predicate) == (mask & ::pk_host::warp_existing_lanes());
}
inline unsigned __activemask() { return ::pk_host::warp_existing_lanes(); }

// ---- launches ----
#define PK_LAUNCH(kernel, grid, block, smem, stream, ...)                                  \
  ::pk_host::launch_kernel((kernel), dim3(grid), dim3(block), static_cast<size_t>(smem),  \
                           (stream), ##__VA_ARGS__)
#define PK_SET_MAX_DYNAMIC_SMEM(kernel, bytes) \
  ::pk_host::set_max_dynamic_smem_of((kernel), static_cast<long long>(bytes))
#define PK_LAST_LAUNCH_ERROR() (::pk_host::take_last_error())

inline cudaError_t cudaGetLastError() { return ::pk_host::take_last_error_code(); }
inline cudaError_t cudaPeekAtLastError() { return ::pk_host::peek_last_error_code(); }
const char* cudaGetErrorString(cudaError_t err);
template <typename F>
inline cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize)
    return ::pk_host::set_max_dynamic_smem_of(kernel, value);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind,
                                   cudaStream_t = nullptr) {
  if (n) std::memmove(dst, src, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  return cudaMemcpyAsync(dst, src, n, kind);
}
inline cudaError_t cudaMemsetAsync(void* dst, int value, size_t n, cudaStream_t = nullptr) {
  if (n) std::memset(dst, value, n);
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
