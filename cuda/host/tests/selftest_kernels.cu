// selftest_kernels.cu: small kernels that exercise the emulator on its own (barriers, static and
// dynamic shared memory, shuffles, votes, mma fragments, launch errors, deadlock detection).
// Compiled by tests/test_cuda_host_emulator.py: with g++ over the emulator (host_build), and, on a
// GPU machine, with nvcc (PK_SELFTEST_DEVICE=cuda), so the same expectations are checked against
// the hardware. It goes through the kernels' own platform layer (pk_platform.cuh, pk_mma.cuh).
// Launchers return nullptr or the launch error, like CK's launchers.
#include "../../csrc/pk_platform.cuh"
#include "../../csrc/pk_mma.cuh"
#include "../../csrc/pk_cp_async.cuh"

#include <cstdint>
#include <string>

#include "selftest_kernels.h"

namespace {

const char* launch_result(cudaError_t err) {
  (void)err;
  return PK_LAST_LAUNCH_ERROR();
}

// ---- barriers + static shared memory: one block sums one row by a tree reduction ----
template <int N>
__global__ void __launch_bounds__(N) block_sum_kernel(const float* __restrict__ x,
                                                      float* __restrict__ out, int n) {
  __shared__ float buf[N];
  const int t = threadIdx.x;
  const float* row = x + static_cast<int64_t>(blockIdx.x) * n;
  float v = 0.f;
  for (int i = t; i < n; i += N) v += row[i];
  buf[t] = v;
  __syncthreads();
  for (int s = N / 2; s > 0; s /= 2) {
    if (t < s) buf[t] += buf[t + s];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = buf[0];
}

// ---- a neighbour read through shared memory, with or without the barrier it needs ----
__global__ void neighbour_static_kernel(const float* x, float* out, int barrier) {
  __shared__ float buf[1024];
  const int t = threadIdx.x;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x;
  buf[t] = x[base + t];
  if (barrier) __syncthreads();
  out[base + t] = buf[(t + 1) % blockDim.x];
}

}  // namespace

// The kernels with `extern __shared__` arrays have external linkage (a namespace, or the global
// one), as the host build requires (see host_build.py).
namespace selftest {
__global__ void neighbour_dynamic_kernel(const float* x, float* out, int barrier) {
  extern __shared__ __align__(16) float4 dyn_smem[];
  float* buf = reinterpret_cast<float*>(dyn_smem);
  const int t = threadIdx.x;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x;
  buf[t] = x[base + t];
  if (barrier) __syncthreads();
  out[base + t] = buf[(t + 1) % blockDim.x];
}

// ---- ldmatrix: lane l gives the address of row perm[l] of src [32][8] (16-bit), stored in
// shared memory with a pitch of `pitch` elements; out[l][i] = the lane's register i ----
template <bool TRANS>
__global__ void ldmatrix_kernel(const uint16_t* src, const int* perm, uint32_t* out, int pitch) {
  extern __shared__ __align__(16) float4 dyn_smem[];
  uint16_t* tile = reinterpret_cast<uint16_t*>(dyn_smem);
  const int lane = threadIdx.x;
  for (int e = 0; e < 8; ++e) tile[lane * pitch + e] = src[lane * 8 + e];
  __syncthreads();
  uint32_t r[4];
  if (TRANS) pk_ldmatrix_x4_trans(r, tile + perm[lane] * pitch);
  else pk_ldmatrix_x4(r, tile + perm[lane] * pitch);
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

// ---- cp.async ring: `tiles` tiles of blockDim.x 16-byte pieces stream through `stages` ring
// slots (the decode kernel's pattern); piece j of tile t is copied if valid[t * n + j], else
// zero-filled. Every thread writes out the piece of its right neighbour after the barrier, so
// a missing wait or barrier would show. ----
template <int STAGES>
__global__ void cp_async_ring_kernel(const uint4* src, const int* valid, uint4* out, int tiles) {
  extern __shared__ __align__(16) float4 dyn_smem[];
  uint4* ring = reinterpret_cast<uint4*>(dyn_smem);  // [STAGES][blockDim.x]
  const int n = blockDim.x, t = threadIdx.x;
  auto issue = [&](int tile) {
    if (tile < tiles)
      pk_cp_async16(ring + (tile % STAGES) * n + t, src + tile * n + t, valid[tile * n + t] != 0);
    pk_cp_async_commit();
  };
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  for (int tile = 0; tile < tiles; ++tile) {
    pk_cp_async_wait<STAGES - 2>();
    __syncthreads();
    issue(tile + STAGES - 1);
    out[tile * n + t] = ring[(tile % STAGES) * n + (t + 1) % n];
  }
  pk_cp_async_wait<0>();
}

// ---- cp.async.wait_group N: two groups committed; out[0..3] read before any wait, out[4..7]
// after wait_group 1 (the first group landed, the second may not have), out[8..11] after
// wait_group 0. Thread 0 only. ----
__global__ void cp_async_wait_kernel(const float4* src, float4* out) {
  extern __shared__ __align__(16) float4 dyn_smem[];
  pk_cp_async16(dyn_smem, src, true);
  pk_cp_async_commit();
  pk_cp_async16(dyn_smem + 1, src + 1, true);
  pk_cp_async_commit();
  out[0] = dyn_smem[0];
  out[1] = dyn_smem[1];
  pk_cp_async_wait<1>();
  out[2] = dyn_smem[0];
  out[3] = dyn_smem[1];
  pk_cp_async_wait<0>();
  out[4] = dyn_smem[0];
  out[5] = dyn_smem[1];
}

// A thread that returns with a copy it never waited for.
__global__ void cp_async_unwaited_kernel(const float* x) {
  extern __shared__ __align__(16) float4 dyn_smem[];
  pk_cp_async16(dyn_smem, x, true);
  pk_cp_async_commit();
}

}  // namespace selftest

// Reads `n` floats of dynamic shared memory that nothing wrote.
__global__ void read_unwritten_kernel(float* out, int n) {
  extern __shared__ __align__(16) float4 dyn_smem[];
  const float* buf = reinterpret_cast<const float*>(dyn_smem);
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = buf[i];
}

// Thread 0 writes one byte of dynamic shared memory at `offset` (past the launch's size when
// offset >= its smem bytes: the emulator must fail the launch).
__global__ void write_shared_byte_kernel(long long offset) {
  extern __shared__ __align__(16) float4 dyn_smem[];
  if (threadIdx.x == 0) reinterpret_cast<unsigned char*>(dyn_smem)[offset] = 0;
}


namespace {

// ---- shuffles: out[op * threads + tid] for the ops listed in selftest_kernels.h ----
__global__ void shuffle_kernel(const float* in, float* out, double* out_d, int* out_i) {
  const int t = threadIdx.x;
  const int lane = t % warpSize;
  const int n = blockDim.x;
  const float v = in[t];
  int op = 0;
  for (int m = 1; m < 32; m *= 2) out[op++ * n + t] = __shfl_xor_sync(0xffffffffu, v, m);
  out[op++ * n + t] = __shfl_xor_sync(0xffffffffu, v, 4, 8);
  out[op++ * n + t] = __shfl_xor_sync(0xffffffffu, v, 8, 8);
  out[op++ * n + t] = __shfl_sync(0xffffffffu, v, (lane * 7 + 3) % 32);
  out[op++ * n + t] = __shfl_sync(0xffffffffu, v, 5, 16);
  out[op++ * n + t] = __shfl_sync(0xffffffffu, v, 37);
  out[op++ * n + t] = __shfl_down_sync(0xffffffffu, v, 1);
  out[op++ * n + t] = __shfl_down_sync(0xffffffffu, v, 3);
  out[op++ * n + t] = __shfl_down_sync(0xffffffffu, v, 16);
  out[op++ * n + t] = __shfl_down_sync(0xffffffffu, v, 2, 8);
  out[op++ * n + t] = __shfl_up_sync(0xffffffffu, v, 1);
  out[op++ * n + t] = __shfl_up_sync(0xffffffffu, v, 5);
  out[op++ * n + t] = __shfl_up_sync(0xffffffffu, v, 1, 4);
  // 8-byte and integer payloads
  out_d[t] = __shfl_xor_sync(0xffffffffu, static_cast<double>(v) * 1e-300, 3);
  out_i[t] = __shfl_down_sync(0xffffffffu, static_cast<int>(v) * 3 + 1, 4);
  // votes
  unsigned ballot = __ballot_sync(0xffffffffu, static_cast<int>(v) % 3 == 0);
  out_i[n + t] = static_cast<int>(ballot);
  out_i[2 * n + t] = __any_sync(0xffffffffu, static_cast<int>(v) == 7);
  out_i[3 * n + t] = __all_sync(0xffffffffu, v >= 0.f);
}

// ---- warp reduction of a block: each warp sums its lanes by shuffles, warps meet in smem ----
__global__ void warp_block_sum_kernel(const float* x, float* out) {
  __shared__ float partial[32];
  const int t = threadIdx.x;
  const int lane = t % warpSize, warp = t / warpSize;
  float v = x[static_cast<int64_t>(blockIdx.x) * blockDim.x + t];
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int n_warps = blockDim.x / warpSize;
    float w = lane < n_warps ? partial[lane] : 0.f;
    for (int off = 16; off > 0; off /= 2) w += __shfl_down_sync(0xffffffffu, w, off);
    if (lane == 0) out[blockIdx.x] = w;
  }
}

// ---- mma: each warp multiplies its own 16x16 A by 16x8 B and adds C ----
// a: [warps][16][16] 16-bit bits (row-major); bt: [warps][8][16] (B transposed, i.e. B's
// columns are rows); c, d: [warps][16][8] float.
template <bool BF16>
__global__ void mma_kernel(const uint16_t* a, const uint16_t* bt, const float* c, float* d,
                           int accumulate_in_place) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const uint16_t* A = a + warp * 256;
  const uint16_t* Bt = bt + warp * 128;
  auto pair = [](const uint16_t* p) {
    return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 16);
  };
  uint32_t af[4] = {pair(A + g * 16 + 2 * t), pair(A + (g + 8) * 16 + 2 * t),
                    pair(A + g * 16 + 2 * t + 8), pair(A + (g + 8) * 16 + 2 * t + 8)};
  uint32_t bf[2] = {pair(Bt + g * 16 + 2 * t), pair(Bt + g * 16 + 2 * t + 8)};
  const float* C = c + warp * 128;
  float cf[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t],
                 C[(g + 8) * 8 + 2 * t + 1]};
  float df[4];
  if (accumulate_in_place) {
    if (BF16) pk_mma_m16n8k16_bf16(cf, af, bf, cf); else pk_mma_m16n8k16_f16(cf, af, bf, cf);
    for (int i = 0; i < 4; ++i) df[i] = cf[i];
  } else {
    if (BF16) pk_mma_m16n8k16_bf16(df, af, bf, cf); else pk_mma_m16n8k16_f16(df, af, bf, cf);
  }
  float* D = d + warp * 128;
  D[g * 8 + 2 * t] = df[0];
  D[g * 8 + 2 * t + 1] = df[1];
  D[(g + 8) * 8 + 2 * t] = df[2];
  D[(g + 8) * 8 + 2 * t + 1] = df[3];
}

// ---- coordinates: every thread of a 3-D grid of 3-D blocks writes its global id ----
__global__ void coords_kernel(int* out) {
  const int64_t block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int64_t in_block = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int64_t threads = blockDim.x * blockDim.y * blockDim.z;
  const int64_t id = block * threads + in_block;
  out[id] = static_cast<int>(id);
}

// ---- 16-byte vector loads reinterpreted as 16-bit lanes (what the kernels do) ----
__global__ void vector_kernel(const __half* x, float* out) {
  const int t = threadIdx.x;
  uint4 raw = __ldg(reinterpret_cast<const uint4*>(x) + t);
  const __half2* h2 = reinterpret_cast<const __half2*>(&raw);
  for (int i = 0; i < 4; ++i) {
    out[t * 8 + 2 * i] = __low2float(h2[i]);
    out[t * 8 + 2 * i + 1] = __high2float(h2[i]);
  }
}

// ---- kernels that are wrong on purpose: the emulator must report, not hang ----
__global__ void lane_exit_kernel(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x == 3) return;
  v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

__global__ void split_barrier_kernel(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x % 32 < 16) __syncthreads();
  else v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

__global__ void partial_mask_kernel(float* out) {
  out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, static_cast<float>(threadIdx.x), 1);
}

__global__ void divergent_kinds_kernel(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  else __syncwarp();
  out[threadIdx.x] = v;
}

__global__ void early_exit_barrier_kernel(const float* x, float* out) {
  // Threads that returned count as arrived at later __syncthreads (as on the GPU).
  __shared__ float total;
  if (threadIdx.x == 0) total = 0.f;
  __syncthreads();
  if (threadIdx.x >= 8) return;
  atomicAdd(&total, x[threadIdx.x]);
  __syncthreads();
  if (threadIdx.x == 0) out[0] = total;
}

__global__ void big_stack_kernel(float* out) {
  float local[2048];
  for (int i = 0; i < 2048; ++i) local[i] = static_cast<float>(i * threadIdx.x);
  float s = 0.f;
  for (int i = 0; i < 2048; i += 7) s += local[i];
  out[threadIdx.x] = s;
}

}  // namespace

const char* st_block_sum(const float* x, float* out, int rows, int n, int threads) {
  if (threads == 64) PK_LAUNCH(block_sum_kernel<64>, rows, 64, 0, 0, x, out, n);
  else if (threads == 256) PK_LAUNCH(block_sum_kernel<256>, rows, 256, 0, 0, x, out, n);
  else return "st_block_sum: threads must be 64 or 256";
  return launch_result(cudaSuccess);
}

const char* st_neighbour(const float* x, float* out, int blocks, int threads, int barrier,
                         int dynamic) {
  if (dynamic) {
    PK_LAUNCH(selftest::neighbour_dynamic_kernel, blocks, threads, threads * sizeof(float), 0, x, out,
              barrier);
  } else {
    PK_LAUNCH(neighbour_static_kernel, blocks, threads, 0, 0, x, out, barrier);
  }
  return launch_result(cudaSuccess);
}

const char* st_read_unwritten(float* out, int n, long long smem_bytes, int opt_in) {
  if (opt_in) {
    cudaError_t err = PK_SET_MAX_DYNAMIC_SMEM(read_unwritten_kernel, smem_bytes);
    if (err != cudaSuccess) return PK_LAST_LAUNCH_ERROR();
  }
  PK_LAUNCH(read_unwritten_kernel, 1, 64, smem_bytes, 0, out, n);
  return launch_result(cudaSuccess);
}

const char* st_write_shared_byte(long long smem_bytes, long long offset) {
  PK_LAUNCH(write_shared_byte_kernel, 1, 32, smem_bytes, 0, offset);
  return launch_result(cudaSuccess);
}

const char* st_shuffles(const float* in, float* out, double* out_d, int* out_i, int threads) {
  PK_LAUNCH(shuffle_kernel, 1, threads, 0, 0, in, out, out_d, out_i);
  return launch_result(cudaSuccess);
}

const char* st_warp_block_sum(const float* x, float* out, int blocks, int threads) {
  PK_LAUNCH(warp_block_sum_kernel, blocks, threads, 0, 0, x, out);
  return launch_result(cudaSuccess);
}

const char* st_mma(const uint16_t* a, const uint16_t* bt, const float* c, float* d, int warps,
                   int bf16, int in_place) {
  if (bf16) PK_LAUNCH(mma_kernel<true>, 1, 32 * warps, 0, 0, a, bt, c, d, in_place);
  else PK_LAUNCH(mma_kernel<false>, 1, 32 * warps, 0, 0, a, bt, c, d, in_place);
  return launch_result(cudaSuccess);
}

const char* st_ldmatrix(const uint16_t* src, const int* perm, uint32_t* out, int pitch,
                        int trans) {
  const size_t smem = 32 * pitch * sizeof(uint16_t);
  if (trans) PK_LAUNCH(selftest::ldmatrix_kernel<true>, 1, 32, smem, 0, src, perm, out, pitch);
  else PK_LAUNCH(selftest::ldmatrix_kernel<false>, 1, 32, smem, 0, src, perm, out, pitch);
  return launch_result(cudaSuccess);
}

const char* st_cp_async_ring(const void* src, const int* valid, void* out, int tiles,
                             int threads, int stages) {
  const uint4* s = static_cast<const uint4*>(src);
  uint4* o = static_cast<uint4*>(out);
  const size_t smem = static_cast<size_t>(stages) * threads * 16;
  if (stages == 2)
    PK_LAUNCH(selftest::cp_async_ring_kernel<2>, 1, threads, smem, 0, s, valid, o, tiles);
  else if (stages == 3)
    PK_LAUNCH(selftest::cp_async_ring_kernel<3>, 1, threads, smem, 0, s, valid, o, tiles);
  else return "st_cp_async_ring: stages must be 2 or 3";
  return launch_result(cudaSuccess);
}

const char* st_cp_async_wait(const void* src, void* out) {
  PK_LAUNCH(selftest::cp_async_wait_kernel, 1, 1, 32, 0, static_cast<const float4*>(src),
            static_cast<float4*>(out));
  return launch_result(cudaSuccess);
}

const char* st_coords(int* out, int gx, int gy, int gz, int bx, int by, int bz) {
  PK_LAUNCH(coords_kernel, dim3(gx, gy, gz), dim3(bx, by, bz), 0, 0, out);
  return launch_result(cudaSuccess);
}

const char* st_vector(const void* x, float* out, int threads) {
  PK_LAUNCH(vector_kernel, 1, threads, 0, 0, static_cast<const __half*>(x), out);
  return launch_result(cudaSuccess);
}

const char* st_faulty(const char* which, float* out, const float* x) {
  std::string w = which;
  if (w == "lane_exit") PK_LAUNCH(lane_exit_kernel, 1, 32, 0, 0, out);
  else if (w == "split_barrier") PK_LAUNCH(split_barrier_kernel, 1, 64, 0, 0, out);
  else if (w == "partial_mask") PK_LAUNCH(partial_mask_kernel, 1, 32, 0, 0, out);
  else if (w == "divergent_kinds") PK_LAUNCH(divergent_kinds_kernel, 1, 32, 0, 0, out);
  else if (w == "early_exit") PK_LAUNCH(early_exit_barrier_kernel, 1, 64, 0, 0, x, out);
  else if (w == "big_stack") PK_LAUNCH(big_stack_kernel, 2, 64, 0, 0, out);
  else if (w == "cp_async_unwaited")
    PK_LAUNCH(selftest::cp_async_unwaited_kernel, 1, 32, 16, 0, x);
  else if (w == "too_many_threads") PK_LAUNCH(big_stack_kernel, 1, 2048, 0, 0, out);
  else return "st_faulty: unknown kernel";
  return launch_result(cudaSuccess);
}

// Static shared memory of a template kernel with external linkage is poisoned at block start.
namespace selftest {
template <int N>
__global__ void read_unwritten_static_kernel(float* out) {
  __shared__ float never_written[N];
  for (int i = threadIdx.x; i < N; i += blockDim.x) out[i] = never_written[i];
}
}  // namespace selftest

const char* st_read_unwritten_static(float* out) {
  PK_LAUNCH(selftest::read_unwritten_static_kernel<40>, 1, 32, 0, 0, out);
  return PK_LAST_LAUNCH_ERROR();
}
