// pk_varlen.cuh: attention for batches described by cu_seqlens_q (prefill, chunked prefill on a
// cached prefix, decode, several query tokens per sequence), tiled over query tokens.
//
// Every kernel packs the query heads of one GQA group with the query tokens into the rows of a
// tile: row r is token (r / heads_per_cta) and head (r % heads_per_cta) of the chunk, so one
// K/V tile in shared memory serves every head of the group.
//   Grid: (num_tokens / q_tile_tokens + num_seqs, num_kv_heads * num_head_chunks, 1). Tile x of
//   sequence s is x - (cu_seqlens_q[s] / q_tile_tokens + s) (an upper bound on the tiles each
//   sequence needs, found by binary search without a host synchronisation); blocks past the
//   sequence's query tokens exit at once.
//   One thread block owns: q_tile_tokens query tokens of one sequence x heads_per_cta heads of
//   one KV head's group, against keys [kv_lo, last query position] of that sequence (the
//   sliding window trims kv_lo).
//   Bytes moved: the queries once; K and V of the visible range once per block (tiles of BN
//   keys gathered through the block table, 16-byte rows); one output row (+ lse) per row.
//   Invariants: keys past a row's position or before its window start get -inf before the
//   softmax; keys at positions >= the tile's last query position + 1 are never loaded (zeros
//   instead), so NaN in unused cache slots cannot reach the result; block-table entries past
//   those positions are never read; offsets are int64; rows of q/k/v/out are 16-byte aligned
//   (launch.py).
//
// pk_varlen_mma_async_kernel<T = __half | __nv_bfloat16, HEAD_SIZE, WARPS = 4 | 8> (16-bit
//   types; plan stages = 2, threads = 32 * WARPS): WARPS warps x 16 rows (64 rows by default, or
//   128: 8 warps halve the K/V tile loads per query row, PAGED_KERNELS_CUDA_VARLEN_WARPS=8).
//   K/V tiles of BN = 64 keys (32 above head size 128) come through the block table with
//   16-byte cp.async copies into a ring of 2 slots: the next tile is in flight while the current
//   one is used. S = Q K^T and O += P V with mma.m16n8k16, operands through ldmatrix (V
//   row-major with .trans, so no transposing store); online softmax in registers in base 2 (each
//   lane holds rows g and g + 8 of its warp's 16); float32 accumulation. Tiles every row of the
//   block sees whole skip the per-key masks. Tile x of the grid is tile gridDim.x - 1 - x of the
//   list above (longest blocks first).
//   Shared memory (planner.py `_varlen_async_smem`): the ring [2][K, V][BN][DP] (T,
//   DP = HEAD_SIZE + 8; a slot's K and V are adjacent), and Q [16 * WARPS][DP]: up to head size
//   128 in slot 1 (its fragments go to registers before that slot's first copy, which is issued
//   after a barrier), else after the ring (reloaded per tile).
// pk_varlen_simt_kernel<T, HEAD_SIZE> (T = float, or PkKv8 for an 8-bit cache under a query of
//   any dtype (pk_kv8.cuh: k_scale folded into the query's pre-scale, v_scale into the output's
//   1 / sum); plan stages = 0, 128 threads): 4 warps x 4 rows
//   (16 rows), lane j <-> key j of a PK_VARLEN_SIMT_BN-key tile loaded synchronously, float32
//   everywhere. Shared memory: Q [16][HEAD_SIZE], K [BN][HEAD_SIZE + 1], V [BN][HEAD_SIZE]
//   (float).
#pragma once
#include "pk_common.cuh"
#include "pk_cp_async.cuh"
#include "pk_kv8.cuh"
#include "pk_mma.cuh"
#include "pk_ops.h"

// The SIMT kernel (planner.py SIMT_ROWS, SIMT_BN mirror these).
constexpr int PK_VARLEN_THREADS = 128;
constexpr int PK_VARLEN_SIMT_BN = 32;    // keys per K/V tile
constexpr int PK_VARLEN_SIMT_ROWS = 16;  // rows per block
constexpr int PK_VARLEN_SIMT_RPW = PK_VARLEN_SIMT_ROWS / 4;  // rows per warp

// Keys per K/V tile of pk_varlen_mma_async_kernel (planner.py `varlen_async_bn` mirrors it): 64, or
// 32 above head size 128 so the ring and Q stay under sm_80's 163 KiB of shared memory.
__host__ __device__ constexpr int pk_varlen_async_bn(int head_size) {
  return head_size <= 128 ? 64 : 32;
}

// Where one block of a varlen kernel works (see the file comment).
struct PkVarlenTile {
  int seq, kvh, head0, nh, hc, ntok;
  int64_t seq_len, tok0, pos_lo, kv_lo, kv_end;
};

// Finds the sequence and tile of tile index `bx` (blockIdx.x, or its reverse); false when the
// tile has no query token.
__device__ __forceinline__ bool pk_varlen_locate(const PkAttnParams& p, int bx,
                                                 PkVarlenTile& t) {
  const int bq = static_cast<int>(p.q_tile_tokens);
  const int32_t* cu = static_cast<const int32_t*>(p.cu_seqlens_q);
  int lo = 0, hi = static_cast<int>(p.num_seqs) - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(cu + mid) / bq + mid <= bx) lo = mid; else hi = mid - 1;
  }
  t.seq = lo;
  const int64_t q_begin = __ldg(cu + lo), q_len = __ldg(cu + lo + 1) - q_begin;
  const int64_t q_start = static_cast<int64_t>(bx - (q_begin / bq + lo)) * bq;
  if (q_start >= q_len) return false;
  const int chunks = static_cast<int>(p.num_head_chunks);
  const int group = static_cast<int>(p.group);
  t.kvh = blockIdx.y / chunks;
  t.hc = static_cast<int>(p.heads_per_cta);
  t.head0 = t.kvh * group + (blockIdx.y % chunks) * t.hc;
  t.nh = min(t.hc, group - (static_cast<int>(blockIdx.y) % chunks) * t.hc);
  t.ntok = static_cast<int>(q_len - q_start < bq ? q_len - q_start : bq);
  t.seq_len = __ldg(static_cast<const int32_t*>(p.seq_lens) + lo);
  t.tok0 = q_begin + q_start;
  t.pos_lo = t.seq_len - q_len + q_start;
  t.kv_end = t.pos_lo + t.ntok;  // one past the last query position
  const int64_t w = p.sliding_window;
  t.kv_lo = (w > 0 && t.pos_lo - w + 1 > 0) ? t.pos_lo - w + 1 : 0;
  return true;
}

// Whether key position `k` is visible from query position `q`.
// The v-th 16-byte piece of query row r of the tile (row = token * hc + head), zeros for rows
// past the tile's tokens or its heads.
template <typename T, int VEC>
__device__ __forceinline__ uint4 pk_varlen_q_piece(const PkAttnParams& p, const PkVarlenTile& t,
                                                   int r, int v) {
  const int tok = r / t.hc, h = r % t.hc;
  if (tok >= t.ntok || h >= t.nh) return make_uint4(0u, 0u, 0u, 0u);
  return pk_load16(static_cast<const T*>(p.q) + (t.tok0 + tok) * p.q_stride_token +
                   (t.head0 + h) * p.q_stride_head + v * VEC);
}

__device__ __forceinline__ bool pk_visible(int64_t k, int64_t q, int64_t window) {
  return k <= q && (window <= 0 || k > q - window);
}

// Writes one output row's lse (rows outside the tile are filtered by the caller).
__device__ __forceinline__ void pk_write_lse(const PkAttnParams& p, int64_t tok, int head,
                                             float m, float l) {
  if (p.lse != nullptr)
    static_cast<float*>(p.lse)[tok * p.num_heads + head] = l > 0.f ? m + logf(l) : -INFINITY;
}

// ------------------------------------------------------------------------------------------
template <typename T, int HEAD_SIZE, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, 8 / WARPS)
pk_varlen_mma_async_kernel(const PkAttnParams p) {
  constexpr int D = HEAD_SIZE, DP = D + 8, BN = pk_varlen_async_bn(D), ROWS = 16 * WARPS;
  constexpr int THREADS = 32 * WARPS, VEC = PkVec<T>::N, NVEC = D / VEC;
  constexpr int KS = D / 16;   // k-slices of Q K^T
  constexpr int NT = BN / 8;   // n-tiles of S
  constexpr int DT = D / 8;    // n-tiles of O
  constexpr bool Q_IN_REGS = D <= 128;
  constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
  static_assert(D % 16 == 0, "mma path needs head_size % 16 == 0");
  static_assert(WARPS == 4 || WARPS == 8, "4 or 8 warps (planner.py plans one of them)");
  static_assert(!Q_IN_REGS || ROWS <= 2 * BN, "Q fits in one ring slot");
  extern __shared__ float4 pk_smem4[];
  T* ring = reinterpret_cast<T*>(pk_smem4);                   // [2][K, V][BN][DP]
  T* qs = ring + (Q_IN_REGS ? 2 : 4) * BN * DP;               // [ROWS][DP]: slot 1, or after

  // Tiles in reverse order: a sequence's last query tiles see the most keys (causal), so the
  // longest blocks start first and the short ones fill the last wave.
  PkVarlenTile t;
  if (!pk_varlen_locate(p, static_cast<int>(gridDim.x - 1 - blockIdx.x), t)) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, tq = lane % 4;
  const int n = static_cast<int>(t.kv_end - t.kv_lo);  // keys of this block (>= 1)
  const int num_tiles = (n + BN - 1) / BN;

  // Starts the copies of tile `tile` into ring slot `slot`, then commits (an empty group past
  // the last tile keeps every thread's group count uniform). Rows past the block's keys are
  // zero-filled without a load, so no key at a position >= kv_end is read.
  const PkBlockMap bmap(static_cast<const int32_t*>(p.block_tables) + t.seq * p.bt_stride,
                        static_cast<int>(p.block_size));
  const T* kbase = static_cast<const T*>(p.k_cache) + t.kvh * p.k_stride_head;
  const T* vbase = static_cast<const T*>(p.v_cache) + t.kvh * p.v_stride_head;
  auto issue_tile = [&](int tile, int slot) {
    if (tile < num_tiles) {
      constexpr int PASSES = (BN * NVEC + THREADS - 1) / THREADS;
#pragma unroll 2
      for (int it = 0; it < PASSES; ++it) {
        const int idx = it * THREADS + threadIdx.x;
        if (BN * NVEC % THREADS != 0 && idx >= BN * NVEC) break;
        const int row = idx / NVEC, v = idx % NVEC;
        const int i = tile * BN + row;
        const bool valid = i < n;
        int64_t koff = 0, voff = 0;
        if (valid) {
          int bslot;
          const int64_t block =
              __ldg(bmap.table + bmap.index(static_cast<int>(t.kv_lo) + i, bslot));
          koff = block * p.k_stride_block + static_cast<int64_t>(bslot) * p.k_stride_slot;
          voff = block * p.v_stride_block + static_cast<int64_t>(bslot) * p.v_stride_slot;
        }
        T* dst = ring + (2 * slot * BN + row) * DP + v * VEC;  // K; V is BN rows further
        pk_cp_async16(dst, kbase + koff + v * VEC, valid);
        pk_cp_async16(dst + BN * DP, vbase + voff + v * VEC, valid);
      }
    }
    pk_cp_async_commit();
  };
  issue_tile(0, 0);  // slot 0; Q goes to slot 1 (or its own region), so they overlap

  // Q tile -> shared memory (rows past the tile or the group are zeros).
  for (int idx = threadIdx.x; idx < ROWS * NVEC; idx += THREADS) {
    const int r = idx / NVEC, v = idx % NVEC;
    const uint4 raw = pk_varlen_q_piece<T, VEC>(p, t, r, v);
    *reinterpret_cast<uint4*>(qs + r * DP + v * VEC) = raw;
  }

  // This lane's two rows (g and g + 8 of the warp's 16).
  int64_t row_pos[2];
  bool row_ok[2];
  float slope2[2];  // ALiBi slope * log2(e)
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = warp * 16 + g + hr * 8;
    const int tok = r / t.hc, h = r % t.hc;
    row_ok[hr] = tok < t.ntok && h < t.nh;
    row_pos[hr] = t.pos_lo + tok;
    slope2[hr] = (row_ok[hr] && p.alibi_slopes != nullptr)
                     ? LOG2E * __ldg(static_cast<const float*>(p.alibi_slopes) + t.head0 + h)
                     : 0.f;
  }
  __syncthreads();  // Q is stored

  auto load_q = [&](int kk, uint32_t (&frag)[4]) {
    pk_ldmatrix_a(frag, qs + warp * 16 * DP, DP, kk * 16, lane);
  };
  uint32_t qa[Q_IN_REGS ? KS : 1][4];
  if constexpr (Q_IN_REGS) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) load_q(kk, qa[kk]);
  }

  // Scores go straight to base 2 (as in pk_decode_mma_kernel): logit * log2(e).
  const float soft_cap = static_cast<float>(p.soft_cap);
  const float qk_scale = static_cast<float>(p.scale) * (soft_cap > 0.f ? 1.f : LOG2E);
  // A multiply per score instead of a division (whose IEEE slow path the compiler inlines
  // at every score: 13 % of the decode key loop's code at head size 128, sm_90).
  const float inv_cap = soft_cap > 0.f ? 1.f / soft_cap : 0.f;
  const bool has_alibi = p.alibi_slopes != nullptr;
  const int64_t window = p.sliding_window;
  // The block's last row position; a tile is seen whole by every row when its last key is at
  // or before the first row's position and (with a window) its first key is inside the last
  // row's window.
  const int64_t pos_hi = t.pos_lo + t.ntok - 1;

  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // m in base-2 units

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int slot = tile & 1;
    pk_cp_async_wait<0>();  // this thread's copies of `tile` have landed
    // Everyone's have; slot ^ 1 (tile - 1, or Q in the first iteration) is no longer read.
    __syncthreads();
    issue_tile(tile + 1, slot ^ 1);
    const T* kt = ring + 2 * slot * BN * DP;
    const T* vt = kt + BN * DP;
    const int64_t kv0 = t.kv_lo + static_cast<int64_t>(tile) * BN;

    // S = Q K^T for this warp's 16 rows: NT n-tiles of 8 keys, two per ldmatrix.
    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    {
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        if constexpr (!Q_IN_REGS) load_q(kk, qa[0]);
        const uint32_t* a = qa[Q_IN_REGS ? kk : 0];
#pragma unroll
        for (int kg = 0; kg < NT / 2; ++kg) {
          uint32_t b[4];  // b[0..1]: keys 16kg..16kg+7, b[2..3]: 16kg+8..16kg+15
          pk_ldmatrix_b(b, kt + kg * 16 * DP, DP, kk * 16, lane);
          PkMma<T>::run(s[2 * kg], a, b, s[2 * kg]);
          PkMma<T>::run(s[2 * kg + 1], a, b + 2, s[2 * kg + 1]);
        }
      }
    }

    // Scores -> base-2 logits; masks only where some row of the block does not see the whole
    // tile (the diagonal, the window's edge, the last tile).
    const bool whole = kv0 + BN - 1 <= t.pos_lo && (window <= 0 || kv0 > pos_hi - window);
    float tile_max[2] = {-INFINITY, -INFINITY};
    // ALiBi's key position - query position, as floats (exact below 2^24): this lane's first
    // column of the tile relative to each of its rows, plus the score's compile-time column.
    float rel0[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) rel0[hr] = static_cast<float>(kv0 + 2 * tq - row_pos[hr]);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int hr = c / 2;
        float x = s[nt][c] * qk_scale;
        if (soft_cap > 0.f) x = LOG2E * soft_cap * tanhf(x * inv_cap);
        if (has_alibi) x = fmaf(slope2[hr], rel0[hr] + static_cast<float>(nt * 8 + c % 2), x);
        if (!whole) {
          const int64_t kv = kv0 + nt * 8 + 2 * tq + (c % 2);
          if (!(row_ok[hr] && kv < t.kv_end && pk_visible(kv, row_pos[hr], window)))
            x = -INFINITY;
        }
        s[nt][c] = x;
        tile_max[hr] = fmaxf(tile_max[hr], x);
      }
    pk_online_softmax_step(s, tile_max, m, l, o);

    // O += P V: P's accumulator fragments are the A operand; V's through ldmatrix.trans.
    {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[4];
        a[0] = pk_pack2<T>(s[2 * kk][0], s[2 * kk][1]);
        a[1] = pk_pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        a[2] = pk_pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = pk_pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
          uint32_t b[4];  // b[0..1]: n-tile 2dp, b[2..3]: n-tile 2dp + 1
          pk_ldmatrix_b_trans(b, vt + kk * 16 * DP, DP, dp * 16, lane);
          PkMma<T>::run(o[2 * dp], a, b, o[2 * dp]);
          PkMma<T>::run(o[2 * dp + 1], a, b + 2, o[2 * dp + 1]);
        }
      }
    }
  }
  pk_cp_async_wait<0>();  // only an empty group remains; nothing may be in flight at exit

  // Normalise and write this lane's elements of rows g and g + 8 (two per 32-bit store).
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const float lsum = pk_group_sum<4>(l[hr]);
    if (!row_ok[hr]) continue;
    const int r = warp * 16 + g + hr * 8;
    const int64_t tok = t.tok0 + r / t.hc;
    const int head = t.head0 + r % t.hc;
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    T* out = static_cast<T*>(p.out) + tok * p.o_stride_token + head * p.o_stride_head;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      *reinterpret_cast<uint32_t*>(out + dt * 8 + 2 * tq) =
          pk_pack2<T>(o[dt][2 * hr] * inv, o[dt][2 * hr + 1] * inv);
    if (tq == 0) pk_write_lse(p, tok, head, m[hr] * LN2, lsum);
  }
}

// ------------------------------------------------------------------------------------------
template <typename T, int HEAD_SIZE>
__global__ void __launch_bounds__(PK_VARLEN_THREADS, 1)
pk_varlen_simt_kernel(const PkAttnParams p) {
  constexpr int BN = PK_VARLEN_SIMT_BN, D = HEAD_SIZE, KP = D + 1, RPW = PK_VARLEN_SIMT_RPW;
  using Io = PkKvIo<T>;
  using C = typename Io::Cache;
  constexpr int VEC = Io::VEC, NVEC = D / VEC;
  constexpr int DPL = (D + 31) / 32;  // output elements per lane and row
  static_assert(BN == 32, "lane j holds key j of the tile");
  extern __shared__ float4 pk_smem4[];
  float* qs = reinterpret_cast<float*>(pk_smem4);  // [16][D]
  float* ks = qs + PK_VARLEN_SIMT_ROWS * D;         // [BN][KP]
  float* vs = ks + BN * KP;                         // [BN][D]

  PkVarlenTile t;
  if (!pk_varlen_locate(p, blockIdx.x, t)) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int block_size = static_cast<int>(p.block_size);
  const float2 kv_scale = pk_kv_scales(p, t.kvh);
  const int kv_fmt = static_cast<int>(p.kv_dtype);
  const float scale = static_cast<float>(p.scale) * kv_scale.x;
  const float soft_cap = static_cast<float>(p.soft_cap);

  for (int idx = threadIdx.x; idx < PK_VARLEN_SIMT_ROWS * NVEC; idx += PK_VARLEN_THREADS) {
    const int r = idx / NVEC, v = idx % NVEC;
    const int tok = r / t.hc, h = r % t.hc;
    float f[VEC];
    Io::load_q(p, (t.tok0 + tok) * p.q_stride_token + (t.head0 + h) * p.q_stride_head + v * VEC,
               tok < t.ntok && h < t.nh, f);
#pragma unroll
    for (int e = 0; e < VEC; ++e) qs[r * D + v * VEC + e] = f[e] * scale;
  }

  int64_t row_pos[RPW];
  bool row_ok[RPW];
  float slope[RPW], m[RPW], l[RPW], o[RPW][DPL];
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const int r = warp * RPW + i;
    const int tok = r / t.hc, h = r % t.hc;
    row_ok[i] = tok < t.ntok && h < t.nh;
    row_pos[i] = t.pos_lo + tok;
    slope[i] = (row_ok[i] && p.alibi_slopes != nullptr)
                   ? __ldg(static_cast<const float*>(p.alibi_slopes) + t.head0 + h) : 0.f;
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < DPL; ++c) o[i][c] = 0.f;
  }

  const PkBlockMap bmap(static_cast<const int32_t*>(p.block_tables) + t.seq * p.bt_stride,
                        block_size);
  const C* kbase = static_cast<const C*>(p.k_cache) + t.kvh * p.k_stride_head;
  const C* vbase = static_cast<const C*>(p.v_cache) + t.kvh * p.v_stride_head;

  for (int64_t kv0 = t.kv_lo; kv0 < t.kv_end; kv0 += BN) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < BN * NVEC; idx += PK_VARLEN_THREADS) {
      const int j = idx / NVEC, v = idx % NVEC;
      const int64_t kv = kv0 + j;
      uint4 kraw = make_uint4(0u, 0u, 0u, 0u), vraw = kraw;
      if (kv < t.kv_end) {
        const int pos = static_cast<int>(kv);
        kraw = Io::load_kv(kbase + bmap.offset(pos, p.k_stride_block, p.k_stride_slot) + v * VEC);
        vraw = Io::load_kv(vbase + bmap.offset(pos, p.v_stride_block, p.v_stride_slot) + v * VEC);
      }
      float kf[VEC], vf[VEC];
      Io::unpack_kv(kraw, kv_fmt, kf);
      Io::unpack_kv(vraw, kv_fmt, vf);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        ks[j * KP + v * VEC + e] = kf[e];
        vs[j * D + v * VEC + e] = vf[e];
      }
    }
    __syncthreads();

    const int64_t kv = kv0 + lane;
    float s[RPW];
#pragma unroll
    for (int i = 0; i < RPW; ++i) s[i] = 0.f;
    for (int d = 0; d < D; ++d) {
      const float k = ks[lane * KP + d];
#pragma unroll
      for (int i = 0; i < RPW; ++i) s[i] = fmaf(qs[(warp * RPW + i) * D + d], k, s[i]);
    }
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      float x = -INFINITY;
      if (row_ok[i] && kv < t.kv_end && pk_visible(kv, row_pos[i], p.sliding_window))
        x = pk_transform_score(s[i], soft_cap, slope[i], kv, row_pos[i]);
      const float m_new = fmaxf(m[i], pk_group_max<32>(x));
      const float alpha = m_new == -INFINITY ? 1.f : pk_exp_shifted(m[i], m_new);
      const float e = pk_exp_shifted(x, m_new);
      m[i] = m_new;
      l[i] = l[i] * alpha + pk_group_sum<32>(e);
#pragma unroll
      for (int c = 0; c < DPL; ++c) o[i][c] *= alpha;
      for (int j = 0; j < BN; ++j) {
        const float pj = __shfl_sync(PK_FULL_MASK, e, j);
#pragma unroll
        for (int c = 0; c < DPL; ++c) {
          const int d = lane + 32 * c;
          if (d < D) o[i][c] = fmaf(pj, vs[j * D + d], o[i][c]);
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    if (!row_ok[i]) continue;
    const int r = warp * RPW + i;
    const int64_t tok = t.tok0 + r / t.hc;
    const int head = t.head0 + r % t.hc;
    const float inv = l[i] > 0.f ? 1.f / l[i] * kv_scale.y : 0.f;
    const int64_t out = tok * p.o_stride_token + head * p.o_stride_head;
#pragma unroll
    for (int c = 0; c < DPL; ++c) {
      const int d = lane + 32 * c;
      if (d < D) Io::store_out1(p, out + d, o[i][c] * inv);
    }
    if (lane == 0) pk_write_lse(p, tok, head, m[i], l[i]);
  }
}
