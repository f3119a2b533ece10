// pk_decode_mma.cuh: paged decode attention on tensor cores, fed by a cp.async pipeline (f16/bf16).
//
// pk_decode_mma_kernel<T = __half | __nv_bfloat16, HEAD_SIZE, WARPS = 4 | 2>
//   Grid: (num_kv_heads * num_head_chunks, num_seqs, num_splits); 32 * WARPS threads (p.threads).
//   One thread block owns: one sequence, one KV head, up to 16 query heads of its GQA group (the
//   M = 16 rows of every mma; chunk `blockIdx.x % num_head_chunks`, rows past the group are
//   zeros), and one partition of `partition_size` keys of the visible context [ctx_start,
//   seq_len), walked in tiles of BN = 16 * WARPS keys (64 or 32); warp w owns keys 16w..16w+15
//   of every tile. WARPS is the plan's choice (planner.py, PAGED_KERNELS_CUDA_DECODE_TILE): 2 warps
//   and 32-key tiles halve a block's shared memory, so twice as many blocks fit on an SM (6
//   instead of 3 at head size 128 on an H100/H200) with the same registers per thread.
//   Bytes moved: every K and V row of the partition once (cp.async, 16 bytes per copy, a ring of
//   p.stages (2-4) tiles so p.stages - 1 are in flight while one is used), the 16 query rows once;
//   writes the group's output rows (T) + lse, or float32 partial rows with their max and sum for
//   pk_decode_reduce_kernel (pk_decode.cuh) when num_splits > 1.
//   Per tile and warp: S[16 x 16] = Q K^T and O[16 x HEAD_SIZE] += P V with mma.m16n8k16,
//   operands through ldmatrix (V with .trans); an online softmax in registers in base 2 (each
//   lane holds rows g and g + 8); at the end the warps' (m, l, O) are merged through shared
//   memory.
//   Synchronisation (p.warp_sync, the plan's choice: PAGED_KERNELS_CUDA_DECODE_SYNC): a warp
//   only ever reads its own 16 rows of a tile, and each warp copies its own rows; so either
//   the block waits for the tile at __syncthreads (0, the default), or each warp waits for its
//   rows alone at __syncwarp (1): no block barrier in the key loop, and the warps of a block
//   drift apart as their loads land (the block meets again only for the merge). The copies,
//   the bytes and the shared memory are the same in both.
//   Invariants: rows of q/k/v/out are 16-byte aligned (launch.py checks); no key at a position
//   >= seq_len is ever read: rows past the partition are zero-filled by cp.async without a load
//   (cache slots past seq_len may hold NaN); block-table entries past ceil(seq_len / block_size)
//   are never read; cache offsets are int64. Each row's K/V offsets are computed once, by lane
//   `row % 16` of the warp that owns the row, an iteration before its copies are issued (so
//   issuing a copy is a shared-memory read, not a block-table walk per 16 bytes).
//   Dynamic shared memory (planner.py `_mma_decode_smem`): K and V rings [stages][BN][DP]
//   (T, DP = HEAD_SIZE + 8: ldmatrix rows fall in distinct banks), the rings' row offsets
//   [stages][BN] (PkRowOffsets), and Q [16][DP]: up to head size 128 Q lives in the K ring's
//   last slot (its fragments go to registers before that slot's first copy is issued, in the
//   first iteration, after a barrier); above 128 it is reloaded per tile and has its own region
//   after the row offsets. The merge reuses the K/V rings (they hold at least 2 tiles of K and
//   V, more than the merge needs).
#pragma once
#include "pk_common.cuh"
#include "pk_cp_async.cuh"
#include "pk_mma.cuh"
#include "pk_ops.h"

constexpr int PK_DECODE_MMA_ROWS = 16;  // query heads per block (the mma's M)
constexpr int PK_DECODE_MMA_MAX_STAGES = 4;

// Blocks per SM the register budget must allow (__launch_bounds__): as many 4-warp blocks as the
// shared memory of a 2-stage ring lets an H100/H200 SM hold, since the kernel's speed grows with
// the blocks in flight (measured on an H200: 1, 2, 3 blocks per SM gave 39, 66, 83 % of copy
// bandwidth). 2-warp blocks get twice the count: the same registers per thread.
__host__ __device__ constexpr int pk_decode_mma_min_blocks(int head_size, int warps) {
  return (head_size <= 64 ? 4 : head_size <= 128 ? 3 : head_size <= 192 ? 2 : 1) * 4 / warps;
}

// K and V offsets (elements) of one cache row; -1 for a row past the partition.
struct alignas(16) PkRowOffsets {
  int64_t k, v;
};

// Where one block of the decode kernels works: its heads and its key range.
struct PkDecodeRange {
  int kvh, head0, nh, seq, split;
  int64_t q_pos, part_start, n;  // n: keys in this partition (0: nothing visible)
};

__device__ __forceinline__ PkDecodeRange pk_decode_range(const PkAttnParams& p, int rows) {
  PkDecodeRange r;
  const int chunks = static_cast<int>(p.num_head_chunks), group = static_cast<int>(p.group);
  const int chunk = blockIdx.x % chunks;
  r.kvh = blockIdx.x / chunks;
  r.head0 = r.kvh * group + chunk * rows;
  r.nh = min(rows, group - chunk * rows);
  r.seq = blockIdx.y;
  r.split = blockIdx.z;
  const int64_t seq_len = __ldg(static_cast<const int32_t*>(p.seq_lens) + r.seq);
  r.q_pos = seq_len - 1;
  const int64_t ctx_start =
      (p.sliding_window > 0 && seq_len > p.sliding_window) ? seq_len - p.sliding_window : 0;
  r.part_start = ctx_start + static_cast<int64_t>(r.split) * p.partition_size;
  const int64_t end_raw = r.part_start + p.partition_size;
  const int64_t end = end_raw < seq_len ? end_raw : seq_len;
  r.n = end > r.part_start ? end - r.part_start : 0;
  return r;
}

// Results of a block whose partition holds no key: an empty split (m = -inf, l = 0) or, without
// splits, zero rows and lse = -inf.
template <typename T>
__device__ void pk_decode_write_empty(const PkAttnParams& p, const PkDecodeRange& r,
                                      int head_size) {
  const int num_splits = static_cast<int>(p.num_splits);
  if (static_cast<int>(threadIdx.x) < r.nh) {
    const int64_t row = static_cast<int64_t>(r.seq) * p.num_heads + r.head0 + threadIdx.x;
    if (num_splits > 1) {
      static_cast<float*>(p.part_m)[row * num_splits + r.split] = -INFINITY;
      static_cast<float*>(p.part_l)[row * num_splits + r.split] = 0.f;
    } else if (p.lse != nullptr) {
      static_cast<float*>(p.lse)[row] = -INFINITY;
    }
  }
  if (num_splits == 1) {
    T* out = static_cast<T*>(p.out) + r.seq * p.o_stride_token;
    for (int i = threadIdx.x; i < r.nh * head_size; i += blockDim.x)
      out[(r.head0 + i / head_size) * p.o_stride_head + i % head_size] = pk_from_float<T>(0.f);
  }
}

template <typename T, int HEAD_SIZE, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, pk_decode_mma_min_blocks(HEAD_SIZE, WARPS))
pk_decode_mma_kernel(const PkAttnParams p) {
  constexpr int THREADS = 32 * WARPS, BN = 16 * WARPS;  // keys per tile: 16 per warp
  constexpr int D = HEAD_SIZE, DP = D + 8, M = PK_DECODE_MMA_ROWS;
  constexpr int VEC = PkVec<T>::N, NVEC = D / VEC;
  constexpr int KS = D / 16;  // k-slices of Q K^T
  constexpr int DT = D / 8;   // n-tiles of O
  constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
  static_assert(D % 16 == 0, "the mma path needs head_size % 16 == 0");
  static_assert(WARPS == 2 || WARPS == 4, "2 or 4 warps (planner.py plans one of them)");
  static_assert(M <= BN, "Q fits in one ring slot");
  // The Q fragments (A operand of S = Q K^T). Up to head size 128 every k-slice stays in
  // registers; above it they are reloaded per tile (keeping them would cost 48-64 more registers
  // per thread, about 250 in all at head size 256).
  constexpr bool Q_IN_REGS = D <= 128;
  extern __shared__ float4 pk_smem4[];
  const int stages = static_cast<int>(p.stages);  // 2..PK_DECODE_MMA_MAX_STAGES (planner.py)
  T* ks = reinterpret_cast<T*>(pk_smem4);  // [stages][BN][DP]
  T* vs = ks + stages * BN * DP;           // [stages][BN][DP]
  auto* s_off = reinterpret_cast<PkRowOffsets*>(vs + stages * BN * DP);  // [stages][BN]
  // Q [M][DP]: in the K ring's last slot while only its fragments are needed (see the top).
  T* qs = Q_IN_REGS ? ks + (stages - 1) * BN * DP : reinterpret_cast<T*>(s_off + stages * BN);

  const PkDecodeRange r = pk_decode_range(p, M);
  if (r.n == 0) {
    pk_decode_write_empty<T>(p, r, D);
    return;
  }
  const int n = static_cast<int>(r.n);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, tq = lane % 4;
  const int num_tiles = (n + BN - 1) / BN;

  // Where row `row` of tile `tile` lives: its block id (read from the block table, only for rows
  // inside the partition; -1 past it) and slot, and from those its K and V offsets.
  const PkBlockMap bmap(static_cast<const int32_t*>(p.block_tables) + r.seq * p.bt_stride,
                        static_cast<int>(p.block_size));
  auto locate_row = [&](int tile, int row, int64_t& block, int& slot) {
    const int i = tile * BN + row;
    block = -1;
    slot = 0;
    if (tile < num_tiles && i < n)
      block = __ldg(bmap.table + bmap.index(static_cast<int>(r.part_start) + i, slot));
  };
  auto row_offsets = [&](int64_t block, int slot) -> PkRowOffsets {
    if (block < 0) return PkRowOffsets{-1, -1};
    return PkRowOffsets{block * p.k_stride_block + static_cast<int64_t>(slot) * p.k_stride_slot,
                        block * p.v_stride_block + static_cast<int64_t>(slot) * p.v_stride_slot};
  };

  // This thread's row of every tile for the offsets (lanes 0-15 of each warp: the warp's rows).
  const int own_row = warp * 16 + lane;
  const bool row_owner = lane < 16;
  const bool warp_sync = p.warp_sync != 0;
  // p.l2_prefetch (PAGED_KERNELS_CUDA_DECODE_PREFETCH): when a row's offsets are computed, an
  // iteration before its copies are issued, its K and V bytes are also asked into L2, so about
  // one more tile per block is in flight without shared memory or registers of its own.
  const bool l2_prefetch = p.l2_prefetch != 0;
  const T* kbase = static_cast<const T*>(p.k_cache) + r.kvh * p.k_stride_head;
  const T* vbase = static_cast<const T*>(p.v_cache) + r.kvh * p.v_stride_head;
  // Records the offsets of this thread's row of ring slot `stage` (and prefetches the row).
  auto set_row = [&](int stage, int64_t block, int slot) {
    const PkRowOffsets off = row_offsets(block, slot);
    s_off[stage * BN + own_row] = off;
    if (l2_prefetch && off.k >= 0) {
      pk_prefetch_l2(kbase + off.k, D * static_cast<int>(sizeof(T)));
      pk_prefetch_l2(vbase + off.v, D * static_cast<int>(sizeof(T)));
    }
  };
  // Q rows (zeros past the group's heads), and the row offsets of tiles 0..stages-1 (one thread
  // per row), -> shared memory.
  for (int idx = threadIdx.x; idx < M * NVEC; idx += THREADS) {
    const int row = idx / NVEC, v = idx % NVEC;
    uint4 raw = make_uint4(0u, 0u, 0u, 0u);
    if (row < r.nh)
      raw = pk_load16(static_cast<const T*>(p.q) + r.seq * p.q_stride_token +
                      (r.head0 + row) * p.q_stride_head + v * VEC);
    *reinterpret_cast<uint4*>(qs + row * DP + v * VEC) = raw;
  }
  if (row_owner) {
    for (int t = 0; t < stages; ++t) {
      int64_t block;
      int slot;
      locate_row(t, own_row, block, slot);
      set_row(t, block, slot);
    }
  }
  __syncthreads();

  // Starts the copies of tile `tile` into ring slot `stage` (its row offsets are s_off[stage]),
  // then commits (an empty group past the last tile keeps the group count uniform). Each warp
  // copies its own 16 rows (lane l takes 16-byte column (32 it + l) % NVEC of row (32 it + l) /
  // NVEC, so a warp instruction covers whole consecutive rows), in both synchronisation modes:
  // with a block barrier the assignment does not matter, with warp_sync it must be this one.
  constexpr int PASSES = 16 * NVEC / 32;
  static_assert(16 * NVEC % 32 == 0, "whole passes over a warp's rows (D % 16 == 0)");
  auto issue_pass = [&](int it, int stage) {
    const unsigned lin = static_cast<unsigned>(it * 32) + static_cast<unsigned>(lane);
    const int row = warp * 16 + static_cast<int>(lin / NVEC);
    const int v = static_cast<int>(lin % NVEC);
    const PkRowOffsets off = s_off[stage * BN + row];
    const bool valid = off.k >= 0;
    const int at = (stage * BN + row) * DP + v * VEC;
    pk_cp_async16(ks + at, kbase + v * VEC + (valid ? off.k : 0), valid);
    pk_cp_async16(vs + at, vbase + v * VEC + (valid ? off.v : 0), valid);
  };
  auto issue_tile = [&](int tile, int stage) {
    if (tile < num_tiles) {
      // Fully unrolled where a row's 16-byte columns are a power of two (a lane's column is
      // then the same in every pass); otherwise by two, which keeps head sizes 96, 112 and 192
      // within the register budget (fully unrolled they spill 4-52 bytes).
      if constexpr ((NVEC & (NVEC - 1)) == 0) {
#pragma unroll
        for (int it = 0; it < PASSES; ++it) issue_pass(it, stage);
      } else {
#pragma unroll 2
        for (int it = 0; it < PASSES; ++it) issue_pass(it, stage);
      }
    }
    pk_cp_async_commit();
  };
  // Slots 0..stages-2 only: with Q_IN_REGS, Q is in slot stages - 1 until the first iteration.
  for (int s = 0; s < stages - 1; ++s) issue_tile(s, s);

  // The Q fragments of k-slice kk.
  auto load_q = [&](int kk, uint32_t (&frag)[4]) { pk_ldmatrix_a(frag, qs, DP, kk * 16, lane); };
  uint32_t qa[Q_IN_REGS ? KS : 1][4];
  if constexpr (Q_IN_REGS) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) load_q(kk, qa[kk]);
    // Q's slot is next written by the first iteration's copies: with a block barrier there
    // (below) every warp has its fragments by then; with warp_sync warp 0 would overwrite Q
    // (its rows) before the others have read it, so the block meets once here.
    if (warp_sync) __syncthreads();
  }
  // Scores go straight to base 2: logit * log2(e) = s * scale * log2(e) (soft cap: log2(e) *
  // cap * tanh(s * scale / cap)) + slope * log2(e) * (key position - query position).
  const float soft_cap = static_cast<float>(p.soft_cap);
  const float qk_scale = static_cast<float>(p.scale) * (soft_cap > 0.f ? 1.f : LOG2E);
  // A multiply per score instead of a division (whose IEEE slow path the compiler inlines
  // at every score: 13 % of the decode key loop's code at head size 128, sm_90).
  const float inv_cap = soft_cap > 0.f ? 1.f / soft_cap : 0.f;
  const int rel0 = static_cast<int>(r.part_start - r.q_pos);  // key i's position - query's
  float slope2[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = g + 8 * hr;
    slope2[hr] = (p.alibi_slopes != nullptr && row < r.nh)
                     ? LOG2E * __ldg(static_cast<const float*>(p.alibi_slopes) + r.head0 + row)
                     : 0.f;
  }

  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // m in base-2 units

  for (int tile = 0, stage = 0; tile < num_tiles; ++tile, stage = (stage + 1) % stages) {
    pk_cp_async_wait_upto2(stages - 2);  // this thread's copies of `tile` have landed
    // Everyone's (the block's, or with warp_sync the warp's: all a warp reads) have; tile - 1's
    // slot is no longer read by anyone who will write it (in the first iteration: every warp
    // has its Q fragments, so slot stages - 1 may be overwritten).
    if (warp_sync) {
      __syncwarp();
    } else {
      __syncthreads();
    }
    // One thread per row starts reading the block id of tile + stages (used at the end).
    int64_t next_block = -1;
    int next_slot = 0;
    if (row_owner) locate_row(tile + stages, own_row, next_block, next_slot);
    const T* kt = ks + (stage * BN + warp * 16) * DP;
    const T* vt = vs + (stage * BN + warp * 16) * DP;

    // S = Q K^T over this warp's 16 keys: two n-tiles of 8 keys. From head size 128 on, each is
    // summed over the k-slices in two accumulators (even and odd slices), so two mma chains of
    // half the length overlap (below it the chains are short, and registers are tighter).
    constexpr int PARITIES = KS >= 8 ? 2 : 1;
    float s[2][4], s_odd[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[nt][c] = s_odd[nt][c] = 0.f;
    {
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        if constexpr (!Q_IN_REGS) load_q(kk, qa[0]);
        const uint32_t* a = qa[Q_IN_REGS ? kk : 0];
        uint32_t b[4];  // b[0..1]: keys 0-7, b[2..3]: keys 8-15
        pk_ldmatrix_b(b, kt, DP, kk * 16, lane);
        float (&acc)[2][4] = kk % PARITIES == 0 ? s : s_odd;
        PkMma<T>::run(acc[0], a, b, acc[0]);
        PkMma<T>::run(acc[1], a, b + 2, acc[1]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[nt][c] += s_odd[nt][c];
    // The next copies go out here, while the tensor cores finish S (slot `stage - 1` was freed
    // by the barrier above).
    issue_tile(tile + stages - 1, stage == 0 ? stages - 1 : stage - 1);

    // Scores -> base-2 logits with masking; online softmax for rows g and g + 8.
    const int key0 = tile * BN + warp * 16;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int hr = c / 2, i = key0 + nt * 8 + 2 * tq + (c % 2);
        float x = s[nt][c] * qk_scale;
        if (soft_cap > 0.f) x = LOG2E * soft_cap * tanhf(x * inv_cap);
        x = i < n ? fmaf(slope2[hr], static_cast<float>(rel0 + i), x) : -INFINITY;
        s[nt][c] = x;
        tile_max[hr] = fmaxf(tile_max[hr], x);
      }
    pk_online_softmax_step(s, tile_max, m, l, o);

    // O += P V: P's accumulator fragments are the A operand; V's through ldmatrix.trans.
    uint32_t a[4];
    a[0] = pk_pack2<T>(s[0][0], s[0][1]);
    a[1] = pk_pack2<T>(s[0][2], s[0][3]);
    a[2] = pk_pack2<T>(s[1][0], s[1][1]);
    a[3] = pk_pack2<T>(s[1][2], s[1][3]);
    {
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t b[4];  // b[0..1]: n-tile 2dp, b[2..3]: n-tile 2dp + 1
        pk_ldmatrix_b_trans(b, vt, DP, dp * 16, lane);
        PkMma<T>::run(o[2 * dp], a, b, o[2 * dp]);
        PkMma<T>::run(o[2 * dp + 1], a, b + 2, o[2 * dp + 1]);
      }
    }
    // Row offsets of tile + stages into this slot's entry: it was last read when tile's copies
    // were issued (before the barrier above) and is next read after the next barrier (with
    // warp_sync only by this row's warp, after its next __syncwarp).
    if (row_owner) set_row(stage, next_block, next_slot);
  }
  pk_cp_async_wait<0>();  // only empty groups remain; nothing may be in flight at exit
  __syncthreads();        // every warp is done with the rings: reuse them for the merge

  // ---- merge the warps' (m, l, O) ----
  constexpr int RP = D + 4;  // float row pitch of the merge buffer
  float* red_o = reinterpret_cast<float*>(ks);     // [WARPS][M][RP]
  float* red_ml = red_o + WARPS * M * RP;          // [WARPS][M][2]
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = g + 8 * hr;
    const float lsum = pk_group_sum<4>(l[hr]);
    if (tq == 0) {
      red_ml[(warp * M + row) * 2] = m[hr];
      red_ml[(warp * M + row) * 2 + 1] = lsum;
    }
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      *reinterpret_cast<float2*>(red_o + (warp * M + row) * RP + dt * 8 + 2 * tq) =
          make_float2(o[dt][2 * hr], o[dt][2 * hr + 1]);
  }
  __syncthreads();

  const int num_splits = static_cast<int>(p.num_splits);
  for (int idx = threadIdx.x; idx < r.nh * NVEC; idx += THREADS) {
    const int row = idx / NVEC, v = idx % NVEC;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m_all = fmaxf(m_all, red_ml[(w * M + row) * 2]);
    float weight[WARPS], l_all = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float mw = red_ml[(w * M + row) * 2];
      weight[w] = mw == -INFINITY ? 0.f : exp2f(mw - m_all);
      l_all += weight[w] * red_ml[(w * M + row) * 2 + 1];
    }
    const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
    float out[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      float acc = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) acc += weight[w] * red_o[(w * M + row) * RP + v * VEC + e];
      out[e] = acc * inv;
    }
    const int64_t orow = static_cast<int64_t>(r.seq) * p.num_heads + r.head0 + row;
    const float m_nat = m_all * LN2;  // the reduce kernel and lse use natural units
    if (num_splits == 1) {
      pk_store16<T>(static_cast<T*>(p.out) + r.seq * p.o_stride_token +
                        (r.head0 + row) * p.o_stride_head + v * VEC, out);
      if (v == 0 && p.lse != nullptr)
        static_cast<float*>(p.lse)[orow] = l_all > 0.f ? m_nat + logf(l_all) : -INFINITY;
    } else {
      float* part = static_cast<float*>(p.part_out) +
                    (orow * num_splits + r.split) * D + v * VEC;
#pragma unroll
      for (int e = 0; e < VEC; e += 4)
        *reinterpret_cast<float4*>(part + e) = make_float4(out[e], out[e + 1], out[e + 2],
                                                           out[e + 3]);
      if (v == 0) {
        static_cast<float*>(p.part_m)[orow * num_splits + r.split] = m_nat;
        static_cast<float*>(p.part_l)[orow * num_splits + r.split] = l_all;
      }
    }
  }
}
