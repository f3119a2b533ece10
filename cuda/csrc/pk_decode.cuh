// pk_decode.cuh: paged decode attention (one query token per sequence) with split-K partitions:
// the SIMT kernel (launched for float32, and for every query dtype over an 8-bit cache;
// float16/bfloat16 over their own dtype run pk_decode_mma_kernel, which was 24-30 % faster on an
// H200) and the reduce kernel of both decode kernels.
//
// pk_decode_kernel<T, HEAD_SIZE, GROUP_TILE>, T = float, or PkKv8 (pk_kv8.cuh: an 8-bit cache,
//   read 4 bytes per load, the query and output of p.dtype, the scales folded into the query's
//   pre-scale and the output's 1 / sum)
//   Grid: (num_kv_heads * num_head_chunks, num_seqs, num_splits); 128 threads (4 warps).
//   One thread block owns: one sequence, one KV head, up to GROUP_TILE query heads of that KV
//   head's GQA group (chunk `blockIdx.x % num_head_chunks`), and one partition of
//   `partition_size` key positions of the visible context [ctx_start, seq_len).
//   Bytes moved: each K and V row of the partition is read exactly once (16-byte loads, or 4-byte
//   loads of an 8-bit cache; TG threads per row) and serves all GROUP_TILE query heads; the queries (GROUP_TILE rows) once.
//   Writes GROUP_TILE output rows (T) + lse, or, with num_splits > 1, float32 partial rows plus
//   their running max and sum for pk_decode_reduce_kernel.
//   Phases: (1) scores of every key of the partition for every head into shared memory,
//   (2) per-head max and exp-sum (one warp per head), (3) P*V with each thread owning VEC
//   elements of head_size for its tokens, then a shuffle + shared-memory reduction.
//   Invariants: rows of q/k/v/out are 16-byte aligned and HEAD_SIZE % VEC == 0 (launch.py checks);
//   no key at a position >= seq_len is ever loaded (cache slots past it may hold NaN);
//   block-table entries past ceil(seq_len / block_size) are never read; cache offsets are int64.
//   Dynamic shared memory (planned in planner.py `_plan_decode_simt`):
//   max(partition_size * GROUP_TILE, 4 * GROUP_TILE * HEAD_SIZE) floats for scores / the final
//   reduction, then partition_size / block_size + 2 ints for the partition's block ids.
//
// pk_decode_reduce_kernel<T>
//   Grid: (num_heads, num_seqs); 128 threads. One block merges the num_splits partial results of
//   one (token, head) through their log-sum-exp: reads num_splits * (head_size + 2) floats,
//   writes one output row and its lse. Partitions with no visible key (l = 0) are skipped, so
//   their (unwritten) partial rows are never read.
#pragma once
#include "pk_common.cuh"
#include "pk_kv8.cuh"
#include "pk_ops.h"
// The tensor-core decode kernel (f16/bf16); it shares pk_decode_reduce_kernel below, and this
// header is the one the run-time (NVRTC) path compiles for every pk_decode* kernel.
#include "pk_decode_mma.cuh"

// 1: phase 1 reduces the group's dot products with pk_transpose_sum (G - 1 + log2(TG / G)
// shuffles per row) instead of one butterfly per head (G * log2(TG)). Correct under the host
// emulator but not yet timed on a GPU, so the measured variant (0) stays the default; A/B it with
// NVCC_APPEND_FLAGS=-DPK_DECODE_TRANSPOSE_REDUCE=1 python -m cuda.paged_cuda.build --out DIR.
#ifndef PK_DECODE_TRANSPOSE_REDUCE
#define PK_DECODE_TRANSPOSE_REDUCE 0
#endif

constexpr int PK_DECODE_THREADS = 128;
constexpr int PK_DECODE_WARPS = PK_DECODE_THREADS / 32;

// Thread layout of the decode kernel: TG lanes share one K/V row, each loading VPT 16-byte
// vectors of it; a warp covers 32 / TG rows at a time.
template <typename T, int HEAD_SIZE>
struct PkDecodeShape {
  static constexpr int VEC = PkVec<T>::N;
  static constexpr int NVEC = HEAD_SIZE / VEC;
  static constexpr int TG = NVEC >= 32 ? 32 : NVEC >= 16 ? 16 : NVEC >= 8 ? 8 : NVEC >= 4 ? 4
                          : NVEC >= 2 ? 2 : 1;
  static constexpr int VPT = (NVEC + TG - 1) / TG;
  static constexpr int ROWS_PER_WARP = 32 / TG;
  static constexpr int ROWS_PER_STEP = PK_DECODE_WARPS * ROWS_PER_WARP;
  // Rows each thread group loads before using them (memory-level parallelism).
  static constexpr int UNROLL = VPT >= 2 ? 4 : 8;
  static_assert(HEAD_SIZE % VEC == 0, "head_size must be a multiple of 16 bytes");
};

template <typename T, int HEAD_SIZE, int GROUP_TILE>
__global__ void __launch_bounds__(PK_DECODE_THREADS, 1)
pk_decode_kernel(const PkAttnParams p) {
  using S = PkDecodeShape<T, HEAD_SIZE>;
  using Io = PkKvIo<T>;
  using C = typename Io::Cache;
  constexpr int VEC = S::VEC, VPT = S::VPT, TG = S::TG;
  extern __shared__ float4 pk_smem4[];
  float* smem = reinterpret_cast<float*>(pk_smem4);
  __shared__ float s_max[GROUP_TILE];
  __shared__ float s_sum[GROUP_TILE];

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row_in_step = warp * S::ROWS_PER_WARP + lane / TG, li = lane % TG;
  const int num_chunks = static_cast<int>(p.num_head_chunks);
  const int kvh = blockIdx.x / num_chunks, chunk = blockIdx.x % num_chunks;
  const int seq = blockIdx.y, split = blockIdx.z;
  const int group = static_cast<int>(p.group);
  const int head0 = kvh * group + chunk * GROUP_TILE;
  const int nh = min(GROUP_TILE, group - chunk * GROUP_TILE);
  const int num_heads = static_cast<int>(p.num_heads);
  const int num_splits = static_cast<int>(p.num_splits);
  const int block_size = static_cast<int>(p.block_size);

  const int64_t seq_len = __ldg(static_cast<const int32_t*>(p.seq_lens) + seq);
  const int64_t q_pos = seq_len - 1;
  const int64_t ctx_start =
      (p.sliding_window > 0 && seq_len > p.sliding_window) ? seq_len - p.sliding_window : 0;
  const int64_t part_start = ctx_start + static_cast<int64_t>(split) * p.partition_size;
  const int64_t part_end_raw = part_start + p.partition_size;
  const int64_t part_end = part_end_raw < seq_len ? part_end_raw : seq_len;
  const int n = part_end > part_start ? static_cast<int>(part_end - part_start) : 0;

  if (n == 0) {  // empty partition (or an empty sequence): nothing visible here
    if (threadIdx.x < nh) {
      const int64_t row = static_cast<int64_t>(seq) * num_heads + head0 + threadIdx.x;
      if (num_splits > 1) {
        static_cast<float*>(p.part_m)[row * num_splits + split] = -INFINITY;
        static_cast<float*>(p.part_l)[row * num_splits + split] = 0.f;
      } else if (p.lse != nullptr) {
        static_cast<float*>(p.lse)[row] = -INFINITY;
      }
    }
    if (num_splits == 1) {
      for (int i = threadIdx.x; i < nh * HEAD_SIZE; i += PK_DECODE_THREADS)
        Io::store_out1(p, seq * p.o_stride_token + (head0 + i / HEAD_SIZE) * p.o_stride_head +
                              i % HEAD_SIZE, 0.f);
    }
    return;
  }

  // ---- the queries of the group, pre-scaled (by k_scale too), in registers ----
  const float2 kv_scale = pk_kv_scales(p, kvh);
  const int kv_fmt = static_cast<int>(p.kv_dtype);
  const float scale = static_cast<float>(p.scale) * kv_scale.x;
  const float soft_cap = static_cast<float>(p.soft_cap);
  float q[GROUP_TILE][VPT][VEC];
  float slope[GROUP_TILE];
  {
    const int64_t qrow = seq * p.q_stride_token;
#pragma unroll
    for (int g = 0; g < GROUP_TILE; ++g) {
      slope[g] = (p.alibi_slopes != nullptr && g < nh)
                     ? __ldg(static_cast<const float*>(p.alibi_slopes) + head0 + g) : 0.f;
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int v = li + j * TG;
        Io::load_q(p, qrow + (head0 + g) * p.q_stride_head + v * VEC, g < nh && v < S::NVEC,
                   q[g][j]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) q[g][j][e] *= scale;
      }
    }
  }

  // The partition's block ids -> shared memory, so no K/V load waits on a block-table load.
  const PkBlockMap bmap(static_cast<const int32_t*>(p.block_tables) + seq * p.bt_stride,
                        block_size);
  const int partition = static_cast<int>(p.partition_size);
  int* s_blocks = reinterpret_cast<int*>(
      smem + max(partition * GROUP_TILE, PK_DECODE_WARPS * GROUP_TILE * HEAD_SIZE));
  int slot_unused;
  const int first_idx = bmap.index(static_cast<int>(part_start), slot_unused);
  const int num_idx = bmap.index(static_cast<int>(part_end - 1), slot_unused) - first_idx + 1;
  for (int i = threadIdx.x; i < num_idx; i += PK_DECODE_THREADS)
    s_blocks[i] = __ldg(bmap.table + first_idx + i);
  __syncthreads();
  // Offset of the row at partition index i (0 <= i < n) in a cache with these strides.
  auto row_offset = [&](int i, int64_t stride_block, int64_t stride_slot) -> int64_t {
    int slot;
    const int idx = bmap.index(static_cast<int>(part_start) + i, slot);
    return static_cast<int64_t>(s_blocks[idx - first_idx]) * stride_block +
           static_cast<int64_t>(slot) * stride_slot;
  };
  // This thread's 16-byte pieces of the rows base + u * ROWS_PER_STEP + row_in_step of one cache
  // (K or V), all issued before any is used; zeros past the partition's n rows.
  auto load_rows = [&](uint4 (&raw)[S::UNROLL][VPT], const C* cache, int base,
                       int64_t stride_block, int64_t stride_slot) {
#pragma unroll
    for (int u = 0; u < S::UNROLL; ++u) {
      const int i = base + u * S::ROWS_PER_STEP + row_in_step;
      const C* row = i < n ? cache + row_offset(i, stride_block, stride_slot) : nullptr;
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int v = li + j * TG;
        raw[u][j] = (row != nullptr && v < S::NVEC) ? Io::load_kv(row + v * VEC)
                                                    : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  float* logits = smem;  // [n][GROUP_TILE]

  // ---- phase 1: scores ----
  // After the transposing reduction, lane li holds head my_head's score; one lane per head
  // (the lowest of the lanes holding it) writes it.
#if PK_DECODE_TRANSPOSE_REDUCE
  const int my_head = pk_transpose_sum_index<GROUP_TILE, TG>(li);
  const bool my_writer = (li & (TG / GROUP_TILE - 1)) == 0;
  const float my_slope = (p.alibi_slopes != nullptr && my_head < nh)
                             ? __ldg(static_cast<const float*>(p.alibi_slopes) + head0 + my_head)
                             : 0.f;
#endif
  {
    const C* kbase = static_cast<const C*>(p.k_cache) + kvh * p.k_stride_head;
    for (int base = 0; base < n; base += S::ROWS_PER_STEP * S::UNROLL) {
      uint4 raw[S::UNROLL][VPT];
      load_rows(raw, kbase, base, p.k_stride_block, p.k_stride_slot);
#pragma unroll
      for (int u = 0; u < S::UNROLL; ++u) {
        float acc[GROUP_TILE];
#pragma unroll
        for (int g = 0; g < GROUP_TILE; ++g) acc[g] = 0.f;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
          float k[VEC];
          Io::unpack_kv(raw[u][j], kv_fmt, k);
#pragma unroll
          for (int g = 0; g < GROUP_TILE; ++g)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g] = fmaf(q[g][j][e], k[e], acc[g]);
        }
        const int i = base + u * S::ROWS_PER_STEP + row_in_step;
#if PK_DECODE_TRANSPOSE_REDUCE
        const float dot = pk_transpose_sum<GROUP_TILE, TG>(acc, li);
        if (i < n && my_writer)
          logits[i * GROUP_TILE + my_head] =
              pk_transform_score(dot, soft_cap, my_slope, part_start + i, q_pos);
#else
#pragma unroll
        for (int g = 0; g < GROUP_TILE; ++g) acc[g] = pk_group_sum<TG>(acc[g]);
        if (i < n && li == 0) {
#pragma unroll
          for (int g = 0; g < GROUP_TILE; ++g)
            logits[i * GROUP_TILE + g] =
                pk_transform_score(acc[g], soft_cap, slope[g], part_start + i, q_pos);
        }
#endif
      }
    }
  }
  __syncthreads();

  // ---- phase 2: per-head max and sum; logits become unnormalised probabilities ----
  for (int g = warp; g < nh; g += PK_DECODE_WARPS) {
    float m = -INFINITY;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, logits[i * GROUP_TILE + g]);
    m = pk_group_max<32>(m);
    float sum = 0.f;
    for (int i = lane; i < n; i += 32) {
      const float e = pk_exp_shifted(logits[i * GROUP_TILE + g], m);
      logits[i * GROUP_TILE + g] = e;
      sum += e;
    }
    sum = pk_group_sum<32>(sum);
    if (lane == 0) {
      s_max[g] = m;
      s_sum[g] = sum;
    }
  }
  __syncthreads();

  // ---- phase 3: P * V ----
  float acc[GROUP_TILE][VPT][VEC];
#pragma unroll
  for (int g = 0; g < GROUP_TILE; ++g)
#pragma unroll
    for (int j = 0; j < VPT; ++j)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[g][j][e] = 0.f;
  {
    const C* vbase = static_cast<const C*>(p.v_cache) + kvh * p.v_stride_head;
    for (int base = 0; base < n; base += S::ROWS_PER_STEP * S::UNROLL) {
      uint4 raw[S::UNROLL][VPT];
      load_rows(raw, vbase, base, p.v_stride_block, p.v_stride_slot);
#pragma unroll
      for (int u = 0; u < S::UNROLL; ++u) {
        const int i = base + u * S::ROWS_PER_STEP + row_in_step;
        if (i >= n) continue;
        float pr[GROUP_TILE];
#pragma unroll
        for (int g = 0; g < GROUP_TILE; ++g) pr[g] = logits[i * GROUP_TILE + g];
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
          float v[VEC];
          Io::unpack_kv(raw[u][j], kv_fmt, v);
#pragma unroll
          for (int g = 0; g < GROUP_TILE; ++g)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][j][e] = fmaf(pr[g], v[e], acc[g][j][e]);
        }
      }
    }
  }
  // Rows of one warp -> lanes of its first thread group.
#pragma unroll
  for (int off = TG; off < 32; off *= 2)
#pragma unroll
    for (int g = 0; g < GROUP_TILE; ++g)
#pragma unroll
      for (int j = 0; j < VPT; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          acc[g][j][e] += __shfl_xor_sync(PK_FULL_MASK, acc[g][j][e], off);
  __syncthreads();  // every warp is done reading logits; reuse the buffer
  float* red = smem;  // [warp][GROUP_TILE][HEAD_SIZE]
  if (lane < TG) {
#pragma unroll
    for (int g = 0; g < GROUP_TILE; ++g)
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int v = li + j * TG;
        if (g < nh && v < S::NVEC) {
#pragma unroll
          for (int e = 0; e < VEC; ++e)
            red[(warp * GROUP_TILE + g) * HEAD_SIZE + v * VEC + e] = acc[g][j][e];
        }
      }
  }
  __syncthreads();

  // ---- write: one 16-byte vector of one head per thread and step ----
  for (int idx = threadIdx.x; idx < nh * S::NVEC; idx += PK_DECODE_THREADS) {
    const int g = idx / S::NVEC, v = idx % S::NVEC;
    const int64_t row = static_cast<int64_t>(seq) * num_heads + head0 + g;
    const float inv = 1.f / s_sum[g] * kv_scale.y;
    float o[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < PK_DECODE_WARPS; ++w) sum += red[(w * GROUP_TILE + g) * HEAD_SIZE + v * VEC + e];
      o[e] = sum * inv;
    }
    if (num_splits == 1) {
      Io::store_out(p, seq * p.o_stride_token + (head0 + g) * p.o_stride_head + v * VEC, o);
      if (v == 0 && p.lse != nullptr)
        static_cast<float*>(p.lse)[row] = s_max[g] + logf(s_sum[g]);
    } else {
      float* part = static_cast<float*>(p.part_out) +
                    (row * num_splits + split) * HEAD_SIZE + v * VEC;
#pragma unroll
      for (int e = 0; e < VEC; e += 4)
        *reinterpret_cast<float4*>(part + e) = make_float4(o[e], o[e + 1], o[e + 2], o[e + 3]);
      if (v == 0) {
        static_cast<float*>(p.part_m)[row * num_splits + split] = s_max[g];
        static_cast<float*>(p.part_l)[row * num_splits + split] = s_sum[g];
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(128)
pk_decode_reduce_kernel(const PkAttnParams p) {
  const int head = blockIdx.x, tok = blockIdx.y;
  const int num_splits = static_cast<int>(p.num_splits);
  const int head_size = static_cast<int>(p.head_size);
  const int64_t row = static_cast<int64_t>(tok) * p.num_heads + head;
  const float* m = static_cast<const float*>(p.part_m) + row * num_splits;
  const float* l = static_cast<const float*>(p.part_l) + row * num_splits;
  const float* part = static_cast<const float*>(p.part_out) + row * num_splits * head_size;

  float m_all = -INFINITY;
  for (int s = 0; s < num_splits; ++s) m_all = fmaxf(m_all, __ldg(m + s));
  float l_all = 0.f;
  for (int s = 0; s < num_splits; ++s) l_all += __ldg(l + s) * pk_exp_shifted(__ldg(m + s), m_all);
  const float inv = l_all > 0.f ? 1.f / l_all : 0.f;

  T* out = static_cast<T*>(p.out) + tok * p.o_stride_token +
           head * p.o_stride_head;
  for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < num_splits; ++s) {
      const float w = __ldg(l + s) * pk_exp_shifted(__ldg(m + s), m_all);
      if (w > 0.f) acc += w * __ldg(part + static_cast<int64_t>(s) * head_size + d);
    }
    out[d] = pk_from_float<T>(acc * inv);
  }
  if (threadIdx.x == 0 && p.lse != nullptr)
    static_cast<float*>(p.lse)[row] = l_all > 0.f ? m_all + logf(l_all)
                                                                     : -INFINITY;
}
