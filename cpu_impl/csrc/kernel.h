// The attention of one work item (Item, problem.h): one thread computes it from start to end.
//
// An item owns rows R = tile * G (G = query heads per KV head) of one sequence, for one KV head or
// all of them: every K and V row it reads is converted to float32 once and used by all R rows (the
// GQA group and the tile share one read). Keys are streamed through the block table in chunks of
// 256 or 64 positions (no dense copy); each chunk does scores -> soft cap -> ALiBi -> mask, then
// one online-softmax step (running max m, running sum l, accumulator acc rescaled by
// exp(m_old - m_new)), all in float32. Keys at positions >= seq_len and block-table entries past
// ceil(seq_len / block_size) are never touched; their lines are requested ahead of the reads (the
// paced prefetch on the vdpbf16ps path, line_cursor.h; the next chunk's on the others). Each
// OpenMP thread keeps its Scratch from call to call (thread_scratch), so a call allocates nothing
// once its buffers have grown to the call's size.
#pragma once

#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "problem.h"
#include "simd.h"
#include "code_lut.h"
#include "amx.h"
#include "read_ahead.h"
#include "line_cursor.h"

namespace {

// Keys per chunk: KEY_CHUNK on the bf16 vdpbf16ps path (fewer online-softmax steps and longer
// block-major runs: A/B, 1 thread, 16 x 320 decode over 30 layers with the read-ahead 10.5 -> 9.8 ms
// a step, 5 x 256 prefill 5.15 -> 4.84 ms against 64 keys), WIDENED_CHUNK on the paths that widen
// K/V into float32 staging rows (kf/vf hold one chunk). KEY_CHUNK is also the row stride of the
// scores, the bf16 weights and the K/V row pointers.
constexpr int KEY_CHUNK = 256;
constexpr int WIDENED_CHUNK = 64;
constexpr int UNIT_KEYS = 16;  // keys per (keys x KV head) unit of a chunk, a multiple of 4

// 64-byte aligned storage for std::vector (aligned vector loads of the transposed keys).
template <typename U>
struct AlignedAlloc {
  using value_type = U;
  AlignedAlloc() = default;
  template <typename V>
  AlignedAlloc(const AlignedAlloc<V>&) {}
  U* allocate(size_t n) {
    return static_cast<U*>(::operator new(n * sizeof(U), std::align_val_t{64}));
  }
  void deallocate(U* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  bool operator==(const AlignedAlloc&) const { return true; }
  bool operator!=(const AlignedAlloc&) const { return false; }
};

// Per-thread scratch, sized once per call. T: the query's type; C: the caches' (T, or an 8-bit
// code type).
template <typename T, typename C>
struct Scratch {
  std::vector<float> q, acc, scores, m, l, kf, vf;
  std::vector<T> qraw;                 // unscaled queries (the bf16 dot-product path)
  std::vector<uint16_t> wb;            // bf16 weights (the bf16 P.V path), KEY_CHUNK per row
  std::vector<uint32_t, AlignedAlloc<uint32_t>> kt;  // transposed K pairs: [d / 2][16], aligned
  std::vector<int64_t> pos;
  std::vector<int> vis;                // per row: the chunk's visible keys [vis[2r], vis[2r + 1])
  std::vector<const C*> kp, vp;        // K/V row pointers of the chunk: KEY_CHUNK per KV head
  std::vector<const float*> kfp, vfp;  // rows of kf / vf
  std::vector<uint16_t> staged;        // an 8-bit cache's unit of K or V rows as bf16 (UNIT_KEYS),
                                       // then one row of zeros (the pads)
  std::vector<C> zero_row;             // d zero elements: the pad rows of a chunk's K/V pointers
  std::vector<const at::BFloat16*> sp; // rows of staged, by key index in the chunk (KEY_CHUNK)
  std::vector<uint32_t, AlignedAlloc<uint32_t>> qt;  // AMX B tiles of the queries (amx_scores)
  std::vector<float, AlignedAlloc<float>> cbuf;      // one stored AMX C tile: 16 x 16 float32
  std::vector<T> qpad;                 // 16 query rows, zero-padded (amx_row_scores)
  std::vector<uint32_t, AlignedAlloc<uint32_t>> vt;  // a unit's V as B tiles (amx_row_values)
  std::vector<uint16_t> wpad;          // 16 rows x 16 keys of weights, zero-padded (the same)
  std::vector<float> apad;             // 16 accumulator rows, zero-padded (the same)
  LineCursor cursor;                   // the item's K/V reads, for the paced prefetch
  Scratch(int rows, int d, int heads)
      : q(rows * d), acc(rows * d), scores(rows * KEY_CHUNK), m(rows), l(rows),
        kf(WIDENED_CHUNK * d), vf(WIDENED_CHUNK * d), qraw(rows * d), wb(rows * KEY_CHUNK),
        kt(d / 2 * 16), pos(rows), vis(2 * rows),
        kp(KEY_CHUNK * heads), vp(KEY_CHUNK * heads), kfp(WIDENED_CHUNK),
        vfp(WIDENED_CHUNK), staged(is_8bit_cache<C>() ? (UNIT_KEYS + 1) * d : 0), zero_row(d),
        sp(is_8bit_cache<C>() ? KEY_CHUNK : 0), qt(rows * d / 2), cbuf(16 * 16), qpad(16 * d),
        vt(d * 8), wpad(16 * 16), apad(16 * d) {}
};

// This thread's Scratch, reused from call to call (no allocation per call: OpenMP's threads
// persist), rebuilt only when a call needs more rows, a larger head size or more KV heads than it
// holds. Every item initialises what it reads of it, so a larger one serves any smaller call.
template <typename T, typename C>
Scratch<T, C>& thread_scratch(int rows, int d, int heads) {
  thread_local std::unique_ptr<Scratch<T, C>> sc;
  thread_local int max_rows = 0, max_d = 0, max_heads = 0;
  if (!sc || rows > max_rows || d > max_d || heads > max_heads) {
    max_rows = std::max(rows, max_rows);
    max_d = std::max(d, max_d);
    max_heads = std::max(heads, max_heads);
    sc = std::make_unique<Scratch<T, C>>(max_rows, max_d, max_heads);
  }
  return *sc;
}

// T: the query's (and output's) type; C: the caches' element type, T itself or an 8-bit code type
// (simd.h) whose values the per-KV-head scales multiply: the key scale is folded into the query
// rows (q . (s k) = (s q) . k) and the value scale into the output rows, so the inner loops
// convert codes to float32 and nothing more.
template <typename T, typename C>
class ItemKernel {
 public:
  ItemKernel(const Problem& p, const T* q, const C* k, const C* v, T* out, const Item& it,
             Scratch<T, C>& sc)
      : p_(p), q_(q), k_(k), v_(v), out_(out), it_(it), sc_(sc), d_(static_cast<int>(p.head_size)),
        g_(p.group()), rh_(static_cast<int>(it.rows) * g_), nh_(it.kv_heads), rows_(rh_ * nh_),
        pairs_(uses_pairs(p)), amx_(pairs_ && rh_ <= 16 && amx_active()),
        amx_rows_(pairs_ && rh_ > 16 && amx_active()),
        lut_(uses_code_lut(p) && !amx_ && !amx_rows_), paced_(paces(p)) {}

  // Whether the items run the paced prefetch (plan_reads): the vdpbf16ps path with a distance.
  static bool paces(const Problem& p) { return uses_pairs(p) && p.prefetch_lines > 0; }

  // Whether Q.K and P.V run on vdpbf16ps (dot_scores, accumulate_pairs): a bf16 query and a bf16
  // or 8-bit cache (its rows staged as bf16 unit by unit, stage_bf16), d % 32 == 0, on the
  // AVX-512 BF16 build.
  static bool uses_pairs(const Problem& p) {
#if defined(PK_AVX512)
    return std::is_same_v<T, at::BFloat16> &&
           (std::is_same_v<C, at::BFloat16> || is_8bit_cache<C>()) && p.head_size % 32 == 0;
#else
    (void)p;
    return false;
#endif
  }

  // Whether an 8-bit cache's codes go straight into the vdpbf16ps layouts (code_lut.h: K
  // transposed per 16-key unit, V as key pairs) instead of staged bf16 rows: AVX-512 VBMI builds,
  // d % 64 == 0, and not on AMX (whose tiles take the staged rows).
  static bool uses_code_lut(const Problem& p) {
#if defined(PK_CODE_LUT)
    return is_8bit_cache<C>() && uses_pairs(p) && p.head_size % 64 == 0;
#else
    (void)p;
    return false;
#endif
  }

  // `tile_cols`: the tile configuration this thread holds (0: none; n > 0: the scores' B/C width
  // of amx_configure_scores(n); -1: amx_configure_rows); an item on AMX loads its own when it
  // differs and leaves it for the next item (run_items releases the tiles after the thread's
  // last item).
  void run(int& tile_cols) {
    load_queries();
#if defined(PK_AMX)
    if (amx_ || amx_rows_) {  // amx_rows_: 16 query rows per C tile (tile_cols -1)
      const int cols = amx_ ? rh_ : -1;
      if (tile_cols != cols) {
        if (amx_) amx_configure_scores(cols);
        else amx_configure_rows();
      }
      tile_cols = cols;
      if (amx_) stage_query_tiles();
    }
#else
    (void)tile_cols;
#endif
    int64_t lo, hi;  // keys [lo, hi) visible to at least one row
    key_range(lo, hi);
    // On the vdpbf16ps path (pairs_) the paced prefetch requests the item's K/V as it reads
    // (plan_reads). The other paths request the first chunk up front and each next chunk while
    // computing the one before: the paced prefetch made their cold and hot calls slower
    // (bench/results/2026-12-03-paced-prefetch).
    const int64_t keys = chunk_keys();
    if (paced_) plan_reads(lo, hi);
    else if (!pairs_) prefetch(lo, std::min<int64_t>(hi, lo + keys));
    for (int64_t c = lo; c < hi; c += keys) {
      const int64_t c1 = std::min<int64_t>(hi, c + keys);
      if (!pairs_) prefetch(c1, std::min<int64_t>(hi, c1 + keys));
      chunk(c, c1);
    }
    store();
  }

 private:
  // Row r = (KV head hh of the item, tile row t, group member g) at r = hh * RH + t * G + g, with
  // RH = tile * G rows per KV head; query head = (kv_head + hh) * G + g.
  int64_t token(int r) const { return it_.q0 + it_.row0 + (r % rh_) / g_; }
  int64_t head(int r) const { return (static_cast<int64_t>(it_.kv_head) + r / rh_) * g_ + r % g_; }

  void load_queries() {
    for (int r = 0; r < rows_; ++r) {
      const T* src = q_ + token(r) * p_.q_s0 + head(r) * p_.q_s1;
      float* dst = &sc_.q[r * d_];
      to_float(src, dst, d_);
      const float scale = p_.scale * kv_scale(p_.k_scale, r);
      for (int i = 0; i < d_; ++i) dst[i] *= scale;
      std::copy_n(src, d_, &sc_.qraw[r * d_]);
      std::fill_n(&sc_.acc[r * d_], d_, 0.f);
      sc_.m[r] = NEG_INF;
      sc_.l[r] = 0.f;
      sc_.pos[r] = it_.seq_len - it_.q_len + it_.row0 + (r % rh_) / g_;
    }
  }

  // The scale of row r's KV head in `scales` (Problem::k_scale or v_scale), 1 for a float cache.
  float kv_scale(const float* scales, int r) const {
    return scales == nullptr ? 1.f : scales[it_.kv_head + r / rh_];
  }

  void key_range(int64_t& lo, int64_t& hi) const {
    int64_t first = it_.seq_len - it_.q_len + it_.row0;  // position of the tile's first row
    int64_t last = first + it_.rows - 1;
    hi = std::min(last + 1, it_.seq_len);
    lo = p_.window > 0 ? std::max<int64_t>(0, first - p_.window + 1) : 0;
    if (hi < lo) hi = lo;
  }

  // Row pointers of K and V for positions [c0, c0 + n), walking the block table one block's run
  // of keys at a time (no division per key): kp[hh * KEY_CHUNK + jj] for KV head kv_head + hh.
  // Block ids were validated by contents_valid.
  void locate(int64_t c0, int n) {
    const C** kp = sc_.kp.data();
    const C** vp = sc_.vp.data();
    for_block_runs(c0, c0 + n, [&](int jj, int run, const C* k, const C* v) {
      for (int hh = 0; hh < nh_; ++hh) {
        const C* kh = k + hh * p_.k_s1;
        const C* vh = v + hh * p_.v_s1;
        const C** kd = kp + hh * KEY_CHUNK + jj;
        const C** vd = vp + hh * KEY_CHUNK + jj;
        for (int t = 0; t < run; ++t) {
          kd[t] = kh + t * p_.k_s2;
          vd[t] = vh + t * p_.v_s2;
        }
      }
    });
    // Padding for the 8-key score kernels and the key pairs of P.V: rows of zeros (a pad key's
    // weight is 0, and 0 x a zero row adds 0 where 0 x an inf in a real row would add NaN).
    const C* zero = sc_.zero_row.data();
    for (int hh = 0; hh < nh_; ++hh)
      for (int jj = n; jj < (n + 7) / 8 * 8; ++jj)
        kp[hh * KEY_CHUNK + jj] = vp[hh * KEY_CHUNK + jj] = zero;
  }

  // Calls f(jj, run, k, v) for each block's run of positions [c0 + jj, c0 + jj + run) within
  // [c0, c1): k and v point to the first position's K and V rows of the item's first KV head.
  template <typename F>
  void for_block_runs(int64_t c0, int64_t c1, F&& f) const {
    const int32_t* table = p_.block_tables + it_.seq * p_.max_blocks;
    int64_t b = c0 / p_.block_size, off = c0 % p_.block_size;
    for (int64_t c = c0; c < c1; ++b, off = 0) {
      const int run = static_cast<int>(std::min<int64_t>(c1 - c, p_.block_size - off));
      const int64_t id = table[b];
      f(static_cast<int>(c - c0), run, k_ + id * p_.k_s0 + it_.kv_head * p_.k_s1 + off * p_.k_s2,
        v_ + id * p_.v_s0 + it_.kv_head * p_.v_s1 + off * p_.v_s2);
      c += run;
    }
  }

  // Asks the memory system for the K and V rows of positions [c0, c1) of the item's KV heads
  // (every cache line of each row), so that the DRAM reads of the next chunk overlap the
  // arithmetic of this one instead of stalling on each line in turn. Rows that are contiguous
  // within a block (the HND layout) are requested as one range per block and head.
  void prefetch(int64_t c0, int64_t c1) const {
    if (c0 >= c1) return;
    const int64_t row_bytes = d_ * static_cast<int64_t>(sizeof(C));
    const bool k_dense = p_.k_s2 == d_, v_dense = p_.v_s2 == d_;
    for_block_runs(c0, c1, [&](int, int run, const C* k, const C* v) {
      for (int hh = 0; hh < nh_; ++hh) {
        prefetch_rows(k + hh * p_.k_s1, run, p_.k_s2, k_dense, row_bytes);
        prefetch_rows(v + hh * p_.v_s1, run, p_.v_s2, v_dense, row_bytes);
      }
    });
  }

  // Every 64-byte line of `run` rows `stride` elements apart (one range when dense).
  static void prefetch_rows(const C* rows, int run, int64_t stride, bool dense, int64_t row_bytes) {
    constexpr int64_t LINE = 64;
    const char* base = reinterpret_cast<const char*>(rows);
    if (dense) {
      for (int64_t x = 0; x < run * row_bytes; x += LINE) __builtin_prefetch(base + x);
      return;
    }
    for (int t = 0; t < run; ++t)
      for (int64_t x = 0; x < row_bytes; x += LINE)
        __builtin_prefetch(base + t * stride * static_cast<int64_t>(sizeof(C)) + x);
  }

  // The paced prefetch (line_cursor.h): every K and V row the item reads, in chunk()'s order
  // (per chunk its K units, then its V units), listed in the cursor, whose first
  // Problem::prefetch_lines lines are requested now; chunk() requests the rest as it reads.
  void plan_reads(int64_t lo, int64_t hi) {
    LineCursor& cursor = sc_.cursor;
    cursor.clear();
    for (int64_t c0 = lo; c0 < hi; c0 += chunk_keys()) {
      const int n = static_cast<int>(std::min<int64_t>(hi - c0, chunk_keys())), step = unit_keys(n);
      const auto list_unit = [&](bool values, int j0, int hh) {
        for_block_runs(c0 + j0, c0 + std::min(n, j0 + step),
                       [&](int, int run, const C* k, const C* v) {
                         if (values) list_rows(v + hh * p_.v_s1, run, p_.v_s2);
                         else list_rows(k + hh * p_.k_s1, run, p_.k_s2);
                       });
      };
      for (int j0 = 0; j0 < n; j0 += step)
        for (int hh = 0; hh < nh_; ++hh) list_unit(false, j0, hh);
      if (values_by_head()) {
        for (int hh = 0; hh < nh_; ++hh)
          for (int j0 = 0; j0 < n; j0 += step) list_unit(true, j0, hh);
      } else {
        for (int j0 = 0; j0 < n; j0 += step)
          for (int hh = 0; hh < nh_; ++hh) list_unit(true, j0, hh);
      }
    }
    cursor.advance(p_.prefetch_lines);
  }

  // `run` rows `stride` elements apart into the cursor (one range when they are contiguous).
  void list_rows(const C* rows, int run, int64_t stride) {
    const int64_t row_bytes = d_ * static_cast<int64_t>(sizeof(C));
    if (stride == d_) {
      sc_.cursor.add(rows, run * row_bytes);
      return;
    }
    for (int t = 0; t < run; ++t) sc_.cursor.add(rows + t * stride, row_bytes);
  }

  // read(): chunk()'s read of `keys` K or V rows of one KV head, between two halves of the
  // cursor's advance by the lines those rows hold.
  template <typename F>
  void paced(int keys, F&& read) {
    const int64_t half = pace_lines(keys);
    if (half > 0) sc_.cursor.advance(half);
    read();
    if (half > 0) sc_.cursor.advance(half);
  }

  // Half the lines of `keys` rows of one KV head (at least 1), or 0 without the paced prefetch:
  // what paced() requests before and after reading them.
  int64_t pace_lines(int keys) const {
    return paced_ ? std::max<int64_t>(1, keys * d_ * static_cast<int64_t>(sizeof(C)) / 128) : 0;
  }

  // All KV heads of the item go through each chunk together, in units of UNIT_KEYS keys (a
  // block at block size 16) x one KV head, block-major where unit_keys allows: the K (then V)
  // rows of a block's heads, one contiguous [num_kv_heads, block_size, head_size] run, are then
  // read in address order. The V rows go head by head instead where values_by_head().
  void chunk(int64_t c0, int64_t c1) {
    const int n = static_cast<int>(c1 - c0), step = unit_keys(n);
    locate(c0, n);
    for (int j0 = 0; j0 < n; j0 += step)
      for (int hh = 0; hh < nh_; ++hh) {
        const int j1 = std::min(n, j0 + step);
        paced(j1 - j0, [&] { head_scores(hh, j0, j1, &sc_.kp[hh * KEY_CHUNK]); });
      }
    for (int r = 0; r < rows_; ++r) finish_scores(r, c0, n);
    softmax_step(n);
#if defined(PK_CODE_LUT)
    if constexpr (is_8bit_cache<C>() && std::is_same_v<T, at::BFloat16>) {
      if (values_by_head()) {
        for (int hh = 0; hh < nh_; ++hh) code_values_chunk(hh, n, &sc_.vp[hh * KEY_CHUNK]);
        return;
      }
    }
#endif
    for (int j0 = 0; j0 < n; j0 += step)
      for (int hh = 0; hh < nh_; ++hh) {
        const int j1 = std::min(n, j0 + step);
        paced(j1 - j0, [&] { accumulate_values(hh, j0, j1, &sc_.vp[hh * KEY_CHUNK]); });
      }
  }

  // Whether chunk() reads the V rows head by head (all units of KV head 0, then of head 1, ..;
  // code_values_chunk), not block-major: an 8-bit cache through code_lut.h with at most 4 rows
  // per KV head, whose accumulators then stay in registers across the chunk's units.
  bool values_by_head() const { return lut_ && rh_ <= 4; }

  // Keys per chunk: KEY_CHUNK on the vdpbf16ps paths, WIDENED_CHUNK on the others.
  int64_t chunk_keys() const { return pairs_ ? KEY_CHUNK : WIDENED_CHUNK; }

  // Keys per unit of chunk(): UNIT_KEYS on the bf16 vdpbf16ps paths (scores and P.V both take a
  // key range), the whole chunk otherwise.
  int unit_keys(int n) const { return pairs_ ? UNIT_KEYS : n; }

  // Raw scores of the rows of KV head hh: bf16 on AVX-512 BF16 goes to dot_scores (K straight
  // from the cache, any row count); otherwise, with at most 4 rows per head (decode) K is read
  // straight from the cache, and with more each K row is widened once into kf and reused by every
  // row pair.
  // Keys [j0, j1) of the chunk; the paths other than dot_scores take the whole chunk (j0 == 0).
  void head_scores(int hh, int j0, int j1, const C* const* krows) {
#if defined(PK_CODE_LUT)
    if constexpr (is_8bit_cache<C>() && std::is_same_v<T, at::BFloat16>) {
      if (lut_) {
        code_scores(hh * rh_, krows, j0, j1);
        return;
      }
    }
#endif
    if (pairs_ && dot_scores(hh, bf16_rows(krows, j0, j1), j0, j1)) return;
    assert(j0 == 0);
    const int n = j1;
    if (rh_ <= 4 && !is_8bit_cache<C>()) {  // an 8-bit K row is converted once, below
      compute_scores(hh * rh_, krows, n);
      return;
    }
    float* kf = sc_.kf.data();
    for (int jj = 0; jj < n; ++jj) {
      to_float(krows[jj], kf + jj * d_, d_);
      sc_.kfp[jj] = kf + jj * d_;
    }
    for (int jj = n; jj < (n + 7) / 8 * 8; ++jj) sc_.kfp[jj] = kf;
    compute_scores(hh * rh_, sc_.kfp.data(), n);
  }

  // The rows [j0, j1) of krows (or vrows) for the vdpbf16ps paths (called only when pairs_):
  // themselves for a bf16 cache; for an 8-bit cache, converted to bf16 into sc_.staged (at most
  // UNIT_KEYS rows, one unit of chunk()) and returned as sc_.sp, padded with the row of zeros
  // after them to a multiple of 4 keys (the 4-key and 2-key steps of dots_bf16 and
  // accumulate_pairs). The conversion reads each K or V row once for every row of the GQA group
  // and the tile.
  template <typename S>
  auto bf16_rows(const S* const* rows, int j0, int j1) {
#if defined(PK_AVX512)
    if constexpr (is_8bit_cache<S>()) {
      assert(pairs_ && j1 - j0 <= UNIT_KEYS);
      uint16_t* staged = sc_.staged.data();
      codes_to_bf16(rows + j0, j1 - j0, d_, staged);
      const at::BFloat16* base = reinterpret_cast<const at::BFloat16*>(staged);
      for (int jj = j0; jj < j1; ++jj) sc_.sp[jj] = base + (jj - j0) * d_;
      const at::BFloat16* zero = base + UNIT_KEYS * d_;
      for (int jj = j1; jj < std::min(KEY_CHUNK, (j1 + 3) / 4 * 4); ++jj) sc_.sp[jj] = zero;
      return static_cast<const at::BFloat16* const*>(sc_.sp.data());
    } else
#endif
    {
      (void)j0, (void)j1;
      return rows;
    }
  }

  // The bf16 path of head_scores on CPUs with avx512_bf16: the unscaled bf16 query against the
  // bf16 keys with vdpbf16ps (exact products, float32 sums), then the scale. Returns false, having
  // done nothing, where it does not apply (other dtypes, d % 32 != 0, no AVX-512 build).
  template <typename S>
  bool dot_scores(int hh, const S* const* krows, int j0, int j1) {
#if defined(PK_AVX512)
    if constexpr (std::is_same_v<S, at::BFloat16> && std::is_same_v<T, at::BFloat16>) {
      if (d_ % 32 != 0) return false;
#if defined(PK_AMX)
      if (amx_ && amx_scores(hh, krows, j0, j1)) return true;
#endif
      const int first = hh * rh_;
      if (rh_ > 4 && j1 - j0 <= UNIT_KEYS) {  // many rows (prefill): transpose K once, reuse it
        transposed_scores(first, krows, j0, j1);
        return true;
      }
      for (int r0 = first; r0 < first + rh_; r0 += 4)  // each K row load feeds up to 4 rows
        switch (std::min(4, first + rh_ - r0)) {
          case 4: dot_rows_bf16<4>(r0, krows, j0, j1); break;
          case 3: dot_rows_bf16<3>(r0, krows, j0, j1); break;
          case 2: dot_rows_bf16<2>(r0, krows, j0, j1); break;
          default: dot_rows_bf16<1>(r0, krows, j0, j1); break;
        }
      return true;
    }
#endif
    (void)hh, (void)krows, (void)j0, (void)j1;
    return false;
  }

#if defined(PK_AVX512)
  // Scores of rows [first, first + rh_) for keys [j0, j1) (at most 16; the 16 slots from j0 are
  // written, j0 + 16 <= KEY_CHUNK): the keys' rows are transposed into bf16 pairs per key
  // (kt[x / 2] = lane k holds K[j0 + k][x, x + 1]), so that one vdpbf16ps adds a query pair's
  // products for 16 keys at once and no horizontal sum is needed. The transpose costs about as
  // much as 3 rows' dot products; with the dozens of rows of a prefill tile it is repaid many
  // times over (dots_bf16 sums every 4 keys' products horizontally, in shuffles).
  void transposed_scores(int first, const at::BFloat16* const* krows, int j0, int j1) {
    const at::BFloat16* rows[16];
    for (int k = 0; k < 16; ++k) rows[k] = krows[j0 + k < j1 ? j0 + k : j0];  // pads: a valid row
    __m512i* kt = reinterpret_cast<__m512i*>(sc_.kt.data());
    for (int x = 0; x < d_; x += 32) transpose16(rows, x, kt + x / 2);
#if defined(PK_AMX)
    if (amx_rows_) {
      amx_row_scores(first, j0);
      return;
    }
#endif
    scores_from_kt(first, j0);
  }

  // Scores of rows [first, first + rh_) (one KV head) against the 16 keys transposed into sc_.kt,
  // into slots [j0, j0 + 16): 8 rows at a time, then the rest.
  void scores_from_kt(int first, int j0) {
    int r0 = first;
    for (; r0 + 8 <= first + rh_; r0 += 8) scores_t<8>(r0, j0);
    switch (first + rh_ - r0) {
      case 7: scores_t<7>(r0, j0); break;
      case 6: scores_t<6>(r0, j0); break;
      case 5: scores_t<5>(r0, j0); break;
      case 4: scores_t<4>(r0, j0); break;
      case 3: scores_t<3>(r0, j0); break;
      case 2: scores_t<2>(r0, j0); break;
      case 1: scores_t<1>(r0, j0); break;
      default: break;
    }
  }

#if defined(PK_CODE_LUT)
  // An 8-bit cache's scores of rows [first, first + rh_) for keys [j0, j1) of a unit (at most
  // 16; the pads read the row of zeros): the codes transposed into sc_.kt as bf16 pairs per key
  // (code_lut.h), then scores_from_kt as for transposed bf16 keys.
  void code_scores(int first, const C* const* krows, int j0, int j1) {
    const C* rows[16];
    for (int k = 0; k < 16; ++k) rows[k] = j0 + k < j1 ? krows[j0 + k] : sc_.zero_row.data();
    switch (rh_) {  // up to 8 rows: the pairs used as they are converted, nothing staged
      case 1: code_scores_direct<1>(first, rows, j0); return;
      case 2: code_scores_direct<2>(first, rows, j0); return;
      case 3: code_scores_direct<3>(first, rows, j0); return;
      case 4: code_scores_direct<4>(first, rows, j0); return;
      case 5: code_scores_direct<5>(first, rows, j0); return;
      case 6: code_scores_direct<6>(first, rows, j0); return;
      case 7: code_scores_direct<7>(first, rows, j0); return;
      case 8: code_scores_direct<8>(first, rows, j0); return;
      default: break;
    }
    __m512i* kt = reinterpret_cast<__m512i*>(sc_.kt.data());
    const CodeLut& lut = code_lut<C>();
    for (int x = 0; x < d_; x += 64)
      code_keys_transposed(rows, x, lut, [&](int c0, const __m512i (&pairs)[4][2]) {
        for (int l = 0; l < 4; ++l)
          for (int e = 0; e < 2; ++e) _mm512_store_si512(kt + x / 2 + 8 * l + c0 + e, pairs[l][e]);
      });
    scores_from_kt(first, j0);
  }

  // code_scores for R <= 8 rows from `first` (all of the KV head's): the scores_t arithmetic
  // (two accumulators per row, even and odd key pairs), fed by the conversion directly.
  template <int R>
  void code_scores_direct(int first, const C* const* rows, int j0) {
    const at::BFloat16* q = &sc_.qraw[first * d_];
    const CodeLut& lut = code_lut<C>();
    __m512 acc[2][R];
    for (int i = 0; i < R; ++i) acc[0][i] = acc[1][i] = _mm512_setzero_ps();
    for (int x = 0; x < d_; x += 64)
      code_keys_transposed(rows, x, lut, [&](int c0, const __m512i (&pairs)[4][2]) {
        for (int l = 0; l < 4; ++l)
          for (int e = 0; e < 2; ++e)
            for (int i = 0; i < R; ++i) {
              uint32_t qp;
              std::memcpy(&qp, q + i * d_ + x + 2 * (8 * l + c0 + e), sizeof qp);
              const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp));
              acc[e][i] = _mm512_dpbf16_ps(acc[e][i], qb, (__m512bh)pairs[l][e]);
            }
      });
    store_unit_scores<R>(first, j0, acc);
  }

  // An 8-bit cache's P.V for keys [j0, j1) of a unit (at most 16), more than 4 rows per KV head
  // (at most 4: code_values_chunk): the V codes as bf16 key pairs into sc_.vt once
  // (code_value_pairs; a pad key reads the row of zeros, its weight is 0), then
  // acc[r] += w[r][j] V[j] for every row of KV head hh, up to 4 rows at a time.
  void code_values(int hh, int j0, int j1, const C* const* vrows) {
    const int first = hh * rh_;
    __m512i* vt = reinterpret_cast<__m512i*>(sc_.vt.data());
    const CodeLut& lut = code_lut<C>();
    const int pairs = (j1 - j0 + 1) / 2;
    for (int kp = 0; kp < pairs; ++kp) {
      const int j = j0 + 2 * kp;
      const C* v1 = j + 1 < j1 ? vrows[j + 1] : sc_.zero_row.data();
      for (int x = 0; x < d_; x += 64)
        code_value_pairs(vrows[j] + x, v1 + x, lut, vt + ((x / 64) * 8 + kp) * 4);
    }
    for (int r0 = first; r0 < first + rh_; r0 += 4)
      switch (std::min(4, first + rh_ - r0)) {
        case 4: code_pairs_rows<4>(r0, j0, pairs); break;
        case 3: code_pairs_rows<3>(r0, j0, pairs); break;
        case 2: code_pairs_rows<2>(r0, j0, pairs); break;
        default: code_pairs_rows<1>(r0, j0, pairs); break;
      }
  }

  // acc[r] += the unit's weighted V pairs staged in sc_.vt, for NR rows from r0.
  template <int NR>
  void code_pairs_rows(int r0, int j0, int pairs) {
    const __m512i* vt = reinterpret_cast<const __m512i*>(sc_.vt.data());
    for (int x = 0; x < d_; x += 64) {
      const __m512i* v = vt + (x / 64) * 8 * 4;
      code_pairs_slice<NR>(r0, j0, x, pairs, [v](int kp) { return v + kp * 4; });
    }
  }

  // An 8-bit cache's P.V for the chunk's n keys of KV head hh, at most 4 rows per KV head
  // (values_by_head): acc[r] += w[r][j] V[j], each key pair's V codes converted in registers and
  // used at once.
  void code_values_chunk(int hh, int n, const C* const* vrows) {
    switch (rh_) {
      case 4: code_chunk_direct<4>(hh * rh_, n, vrows); break;
      case 3: code_chunk_direct<3>(hh * rh_, n, vrows); break;
      case 2: code_chunk_direct<2>(hh * rh_, n, vrows); break;
      default: code_chunk_direct<1>(hh * rh_, n, vrows); break;
    }
  }

  // code_values_chunk for NR rows from r0, 64 columns at a time: the rows' accumulators stay in
  // registers over all of the chunk's key pairs (a pad key reads the row of zeros, its weight is
  // 0). The first 64 columns' pass requests each unit's lines as chunk() would (plan_reads
  // lists the V rows head by head), which covers the other passes' lines too.
  template <int NR>
  void code_chunk_direct(int r0, int n, const C* const* vrows) {
    const CodeLut& lut = code_lut<C>();
    const C* zero = sc_.zero_row.data();
    for (int x = 0; x < d_; x += 64) {
      __m512i v[4];
      code_pairs_slice<NR>(r0, 0, x, (n + 1) / 2, [&](int kp) {
        const int j = 2 * kp;
        if (x == 0 && j % UNIT_KEYS == 0) {
          const int64_t half = pace_lines(std::min(UNIT_KEYS, n - j));
          if (half > 0) sc_.cursor.advance(2 * half);
        }
        code_value_pairs(vrows[j] + x, (j + 1 < n ? vrows[j + 1] : zero) + x, lut, v);
        return static_cast<const __m512i*>(v);
      });
    }
  }

  // Columns [x, x + 64) of the accumulators of NR rows from r0 += the sum over key pairs
  // kp < pairs of each row's weight pair (keys j0 + 2kp, + 1) times the V pairs pairs_of(kp)[u],
  // u < 4 (code_value_pairs' layout): NR x 4 accumulators in registers over the key pairs.
  template <int NR, typename F>
  PK_INLINE void code_pairs_slice(int r0, int j0, int x, int pairs, F&& pairs_of) {
    const uint16_t* w = &sc_.wb[r0 * KEY_CHUNK + j0];
    float* acc = &sc_.acc[r0 * d_ + x];
    __m512 a[NR][4];
    for (int i = 0; i < NR; ++i)
      for (int u = 0; u < 4; ++u) a[i][u] = _mm512_loadu_ps(acc + i * d_ + 16 * u);
    for (int kp = 0; kp < pairs; ++kp) {
      const __m512i* v = pairs_of(kp);
      for (int i = 0; i < NR; ++i) {
        uint32_t pair;
        std::memcpy(&pair, w + i * KEY_CHUNK + 2 * kp, sizeof pair);
        const __m512bh wi = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int u = 0; u < 4; ++u) a[i][u] = _mm512_dpbf16_ps(a[i][u], wi, (__m512bh)v[u]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int u = 0; u < 4; ++u) _mm512_storeu_ps(acc + i * d_ + 16 * u, a[i][u]);
  }

  // Row r's accumulator from code_value_pairs' order (lane 4L + i of the u-th 16 floats of each
  // 64 holds column 16L + 4u + i) back into column order, in place: a lane transpose per 64.
  void code_columns_in_order(float* a) const {
    for (int x = 0; x < d_; x += 64) {
      __m512i v[4];
      for (int u = 0; u < 4; ++u) v[u] = _mm512_castps_si512(_mm512_loadu_ps(a + x + 16 * u));
      transpose_lanes4(v);
      for (int u = 0; u < 4; ++u) _mm512_storeu_ps(a + x + 16 * u, _mm512_castsi512_ps(v[u]));
    }
  }
#endif

  // out[c] = the 32-bit column c (bf16 elements x + 2c, x + 2c + 1) of rows[0..16), c < 16: a
  // 16 x 16 transpose of 32-bit elements (pairs within 128-bit lanes, then 64-bit pairs, then
  // two rounds of 128-bit chunk shuffles).
  static PK_INLINE void transpose16(const at::BFloat16* const* rows, int x, __m512i* out) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
      const __m512i a = _mm512_loadu_si512(rows[i] + x), b = _mm512_loadu_si512(rows[i + 1] + x);
      t[i] = _mm512_unpacklo_epi32(a, b);      // lane L: a[4L], b[4L], a[4L+1], b[4L+1]
      t[i + 1] = _mm512_unpackhi_epi32(a, b);  // lane L: a[4L+2], b[4L+2], a[4L+3], b[4L+3]
    }
    for (int g = 0; g < 4; ++g) {  // u[4g + c], lane L: column 4L + c of rows 4g..4g+3
      u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
      u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
      u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
      u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int c = 0; c < 4; ++c) {  // column 4L + c gathers lane L of u[c], u[4 + c], ...
      const __m512i p0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
      const __m512i p1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
      const __m512i p2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
      const __m512i p3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
      out[c] = _mm512_shuffle_i32x4(p0, p2, 0x88);
      out[4 + c] = _mm512_shuffle_i32x4(p1, p3, 0x88);
      out[8 + c] = _mm512_shuffle_i32x4(p0, p2, 0xDD);
      out[12 + c] = _mm512_shuffle_i32x4(p1, p3, 0xDD);
    }
  }

  // Scaled scores of the R rows from r0 against the 16 transposed keys of sc_.kt, into slots
  // [j0, j0 + 16): two accumulators per row (even and odd query pairs) for independent chains.
  template <int R>
  void scores_t(int r0, int j0) {
    const __m512i* kt = reinterpret_cast<const __m512i*>(sc_.kt.data());
    const at::BFloat16* q = &sc_.qraw[r0 * d_];
    __m512 acc[2][R];
    for (int i = 0; i < R; ++i) acc[0][i] = acc[1][i] = _mm512_setzero_ps();
    for (int x = 0; x < d_ / 2; x += 2)
      for (int e = 0; e < 2; ++e) {
        const __m512bh k = (__m512bh)_mm512_load_si512(kt + x + e);
        for (int i = 0; i < R; ++i) {
          uint32_t pair;
          std::memcpy(&pair, q + i * d_ + 2 * (x + e), sizeof pair);
          const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
          acc[e][i] = _mm512_dpbf16_ps(acc[e][i], qp, k);
        }
      }
    store_unit_scores<R>(r0, j0, acc);
  }

  // The scores of R rows from r0 (one KV head) for the 16 keys from j0: the even and odd pair
  // accumulators added, times the score scale and the head's key scale, into slots [j0, j0 + 16).
  template <int R>
  PK_INLINE void store_unit_scores(int r0, int j0, const __m512 (&acc)[2][R]) {
    const __m512 scale = _mm512_set1_ps(p_.scale * kv_scale(p_.k_scale, r0));  // one KV head
    for (int i = 0; i < R; ++i)
      _mm512_storeu_ps(&sc_.scores[(r0 + i) * KEY_CHUNK + j0],
                       _mm512_mul_ps(_mm512_add_ps(acc[0][i], acc[1][i]), scale));
  }

#if defined(PK_AMX)
  // Lane i holds i * k: the 32-bit element offsets of a column of a row-major k-wide matrix.
  static __m512i lane_multiples(int k) {
    return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                              _mm512_set1_epi32(k));
  }

  // The queries as AMX B tiles, per KV head hh and 32-element slice x of the head size: tile row i
  // holds, for each of the head's rh_ rows, the bf16 pair (q[2i], q[2i + 1]) of the slice.
  void stage_query_tiles() {
    const int slices = d_ / 32;
    uint32_t* qt = sc_.qt.data();
    const __m512i stride = lane_multiples(rh_);
    for (int hh = 0; hh < nh_; ++hh)
      for (int x = 0; x < slices; ++x)
        for (int r = 0; r < rh_; ++r)  // row r's 16 pairs of the slice to qt[... + i * rh_ + r]
          _mm512_i32scatter_epi32(qt + (hh * slices + x) * 16 * rh_ + r, stride,
                                  _mm512_loadu_si512(&sc_.qraw[(hh * rh_ + r) * d_ + 32 * x]), 4);
  }

  // Scores of KV head hh's rows for a whole unit of 16 keys whose rows are equally spaced (a
  // block's run, or the staged rows of an 8-bit cache), on AMX: C[key][row] = K rows (A, loaded
  // straight from the cache) times the staged query pairs (B), one TDPBF16PS per 32 elements of the
  // head size (exact bf16 products, float32 sums, as vdpbf16ps); then each row's 16 scores are
  // gathered from the stored C and scaled. Returns false, having done nothing, for a partial unit
  // or rows that are not equally spaced (dot_rows_bf16 takes those).
  bool amx_scores(int hh, const at::BFloat16* const* krows, int j0, int j1) {
    if (j1 - j0 != 16) return false;
    const at::BFloat16* k0 = krows[j0];
    const int64_t stride = krows[j0 + 1] - k0;
    for (int j = 2; j < 16; ++j)
      if (krows[j0 + j] != k0 + j * stride) return false;
    const int slices = d_ / 32;
    const uint32_t* qt = sc_.qt.data() + hh * slices * 16 * rh_;
    _tile_zero(2);
    for (int x = 0; x < slices; ++x) {
      _tile_loadd(0, k0 + 32 * x, stride * static_cast<int64_t>(sizeof(at::BFloat16)));
      _tile_loadd(1, qt + x * 16 * rh_, 4 * rh_);
      _tile_dpbf16ps(2, 0, 1);
    }
    float* c = sc_.cbuf.data();
    _tile_stored(2, c, 64);
    const __m512 scale = _mm512_set1_ps(p_.scale * kv_scale(p_.k_scale, hh * rh_));
    const __m512i column = lane_multiples(16);
    for (int r = 0; r < rh_; ++r) {
      const __m512 s = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(r)), c, 4);
      _mm512_storeu_ps(&sc_.scores[(hh * rh_ + r) * KEY_CHUNK + j0], _mm512_mul_ps(s, scale));
    }
    return true;
  }

  // Scores of rows [first, first + rh_) (one KV head, more than 16 rows: a prefill tile) against
  // the 16 keys transposed into sc_.kt (bf16 pairs per key: an AMX B tile per 32 elements of the
  // head size), 16 rows per C tile: C[row][key] = the unscaled bf16 query rows (A, from qraw)
  // times the keys, one TDPBF16PS per 32 elements (exact products, float32 sums), stored straight
  // into the rows' score slots [j0, j0 + 16), then scaled. A last group of fewer than 16 rows goes
  // through a zero-padded copy of its query rows and the C buffer, so nothing outside the head's
  // rows is read or written.
  void amx_row_scores(int first, int j0) {
    const int slices = d_ / 32;
    const uint32_t* kt = sc_.kt.data();
    const __m512 scale = _mm512_set1_ps(p_.scale * kv_scale(p_.k_scale, first));
    const int64_t q_stride = d_ * static_cast<int64_t>(sizeof(T));
    for (int r0 = first; r0 < first + rh_; r0 += 16) {
      const int n = std::min(16, first + rh_ - r0);
      const T* q = &sc_.qraw[r0 * d_];
      if (n < 16) {  // the padded copy: n rows, then zeros
        T* pad = sc_.qpad.data();
        std::copy_n(q, n * d_, pad);
        std::fill(pad + n * d_, pad + 16 * d_, T(0.f));
        q = pad;
      }
      _tile_zero(2);
      for (int x = 0; x < slices; ++x) {
        _tile_loadd(0, q + 32 * x, q_stride);
        _tile_loadd(1, kt + x * 16 * 16, 64);
        _tile_dpbf16ps(2, 0, 1);
      }
      float* out = &sc_.scores[r0 * KEY_CHUNK + j0];
      const float* c = out;  // where C was stored: the score rows, or the C buffer
      int64_t c_stride = KEY_CHUNK;
      if (n == 16) {
        _tile_stored(2, out, KEY_CHUNK * static_cast<int64_t>(sizeof(float)));
      } else {
        _tile_stored(2, sc_.cbuf.data(), 64);
        c = sc_.cbuf.data();
        c_stride = 16;
      }
      for (int i = 0; i < n; ++i) {  // scaled into the score rows in one pass
        const __m512 s = _mm512_loadu_ps(c + i * c_stride);
        _mm512_storeu_ps(out + i * KEY_CHUNK, _mm512_mul_ps(s, scale));
      }
    }
  }

  // acc[r] += sum_j w[r][j] V[j] for rows [first, first + rh_) (one KV head, more than 16 rows)
  // and the keys [j0, j1) of a unit (at most 16), on AMX: the V rows interleaved by key pairs
  // into B tiles (8 pairs x 16 head-size elements, zeros for keys past j1), the rows' bf16
  // weights as A tiles, each 16 x 16 block of the float32 accumulator loaded as C, one
  // TDPBF16PS, stored back. acc stays in column order (store: no pair_column). A last group of
  // fewer than 16 rows goes through zero-padded copies of its weights and accumulator rows.
  void amx_row_values(int first, int j0, int j1, const at::BFloat16* const* vrows) {
    const int keys = j1 - j0;
    __m512i* vt = reinterpret_cast<__m512i*>(sc_.vt.data());  // [d / 16][8 key pairs]
    struct alignas(64) Order { uint16_t word[32]; };
    static const std::array<Order, 2> interleave = [] {  // word 2i + e <- row e's element i
      std::array<Order, 2> o{};
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 16; ++i)
          for (int e = 0; e < 2; ++e) o[h].word[2 * i + e] = static_cast<uint16_t>(32 * e + 16 * h + i);
      return o;
    }();
    const __m512i lo_idx = _mm512_load_si512(interleave[0].word);
    const __m512i hi_idx = _mm512_load_si512(interleave[1].word);
    for (int kp = 0; kp < 8; ++kp) {
      const at::BFloat16* v0 = 2 * kp < keys ? vrows[j0 + 2 * kp] : nullptr;
      const at::BFloat16* v1 = 2 * kp + 1 < keys ? vrows[j0 + 2 * kp + 1] : nullptr;
      for (int x = 0; x < d_; x += 32) {
        const __m512i a = v0 != nullptr ? _mm512_loadu_si512(v0 + x) : _mm512_setzero_si512();
        const __m512i b = v1 != nullptr ? _mm512_loadu_si512(v1 + x) : _mm512_setzero_si512();
        _mm512_store_si512(vt + (x / 16) * 8 + kp, _mm512_permutex2var_epi16(a, lo_idx, b));
        _mm512_store_si512(vt + (x / 16 + 1) * 8 + kp, _mm512_permutex2var_epi16(a, hi_idx, b));
      }
    }
    for (int r0 = first; r0 < first + rh_; r0 += 16) {
      const int n = std::min(16, first + rh_ - r0);
      const uint16_t* w = &sc_.wb[r0 * KEY_CHUNK + j0];
      int64_t w_stride = KEY_CHUNK * static_cast<int64_t>(sizeof(uint16_t));
      float* acc = &sc_.acc[r0 * d_];
      if (n < 16) {  // padded copies: n rows, then zeros
        uint16_t* wp = sc_.wpad.data();
        float* ap = sc_.apad.data();
        std::fill_n(wp, 16 * 16, uint16_t{0});
        std::fill_n(ap, 16 * d_, 0.f);
        for (int i = 0; i < n; ++i) {
          std::copy_n(w + i * KEY_CHUNK, 16, wp + 16 * i);
          std::copy_n(acc + i * d_, d_, ap + i * d_);
        }
        w = wp;
        w_stride = 16 * sizeof(uint16_t);
        acc = ap;
      }
      const int64_t a_stride = d_ * static_cast<int64_t>(sizeof(float));
      _tile_loadd(3, w, w_stride);
      for (int x = 0; x < d_; x += 16) {
        _tile_loadd(5, acc + x, a_stride);
        _tile_loadd(4, vt + (x / 16) * 8, 64);
        _tile_dpbf16ps(5, 3, 4);
        _tile_stored(5, acc + x, a_stride);
      }
      if (n < 16)
        for (int i = 0; i < n; ++i) std::copy_n(acc + i * d_, d_, &sc_.acc[(r0 + i) * d_]);
    }
  }
#endif

  // Scaled scores of the NR rows from r0 for keys [j0, j1) (padded to a multiple of 4): each
  // 128-bit half of dots_bf16's results is one row's four keys, one store each.
  template <int NR>
  void dot_rows_bf16(int r0, const at::BFloat16* const* krows, int j0, int j1) {
    const at::BFloat16* q = &sc_.qraw[r0 * d_];
    const __m256 scale = _mm256_set1_ps(p_.scale * kv_scale(p_.k_scale, r0));  // one KV head
    float* out = &sc_.scores[r0 * KEY_CHUNK];
    for (int jj = j0; jj < j1; jj += 4) {
      __m256 s[2];
      dots_bf16<NR>(q, krows + jj, d_, s);
      const __m256 a = _mm256_mul_ps(s[0], scale);
      _mm_storeu_ps(out + jj, _mm256_castps256_ps128(a));
      if (NR > 1) _mm_storeu_ps(out + KEY_CHUNK + jj, _mm256_extractf128_ps(a, 1));
      if (NR > 2) {
        const __m256 b = _mm256_mul_ps(s[1], scale);
        _mm_storeu_ps(out + 2 * KEY_CHUNK + jj, _mm256_castps256_ps128(b));
        if (NR > 3) _mm_storeu_ps(out + 3 * KEY_CHUNK + jj, _mm256_extractf128_ps(b, 1));
      }
    }
  }
#endif

  // Raw scores q . k for rows [r0, r0 + rh_) and every key of the chunk; key rows are padded to a
  // multiple of 8 with valid rows (their scores are never used). Rows go 3 at a time through
  // scores_x4 (each K load feeds a whole GQA group of 3), a last pair through scores_x4<2>, a last
  // single row through scores8.
  template <typename S>
  void compute_scores(int r0, const S* const* krows, int n) {
    float* S_ = sc_.scores.data();
    const int r1 = r0 + rh_;
    int r = r0;
    for (; r + 3 <= r1; r += 3)
      for (int jj = 0; jj < n; jj += 4)
        scores_x4<3>(&sc_.q[r * d_], krows + jj, d_, S_ + r * KEY_CHUNK + jj, KEY_CHUNK);
    if (r1 - r == 2)
      for (int jj = 0; jj < n; jj += 4)
        scores_x4<2>(&sc_.q[r * d_], krows + jj, d_, S_ + r * KEY_CHUNK + jj, KEY_CHUNK);
    else if (r1 - r == 1)
      for (int jj = 0; jj < n; jj += 8)
        scores8(&sc_.q[r * d_], krows + jj, d_, S_ + r * KEY_CHUNK + jj);
  }

  // Soft cap, ALiBi, then the mask: row r sees positions [pos - window + 1, pos], the chunk's
  // keys [vis[2r], vis[2r + 1]); softmax_step computes only those (the rest get weight 0).
  void finish_scores(int r, int64_t c0, int n) {
    float* s = &sc_.scores[r * KEY_CHUNK];
    const int64_t pos = sc_.pos[r];
    if (p_.soft_cap > 0.f)
      for (int jj = 0; jj < n; ++jj) s[jj] = p_.soft_cap * std::tanh(s[jj] / p_.soft_cap);
    if (p_.alibi != nullptr) {
      const float slope = p_.alibi[head(r)];
      for (int jj = 0; jj < n; ++jj) s[jj] += slope * static_cast<float>(c0 + jj - pos);
    }
    const int64_t first = p_.window > 0 ? pos - p_.window + 1 : c0;
    const int a = static_cast<int>(std::clamp<int64_t>(first - c0, 0, n));
    sc_.vis[2 * r] = a;
    sc_.vis[2 * r + 1] = static_cast<int>(std::clamp<int64_t>(pos + 1 - c0, a, n));
  }

  // Online softmax over each row's visible keys: scores become weights exp(s - m_new) (0 for the
  // keys outside), acc and l are rescaled to m_new.
  void softmax_step(int n) {
    for (int r = 0; r < rows_; ++r) {
      float* s = &sc_.scores[r * KEY_CHUNK];
      const int a = sc_.vis[2 * r], b = sc_.vis[2 * r + 1];
      const float m_new = std::max(sc_.m[r], row_max(s + a, b - a));
      if (m_new == NEG_INF) {  // nothing visible yet for this row
        weights(r, 0, 0, n, 0.f);
        continue;
      }
      const float alpha = std::exp(sc_.m[r] - m_new);  // 0 when m was -inf
      const float sum = weights(r, a, b, n, m_new);
      if (alpha != 1.f) {
        float* acc = &sc_.acc[r * d_];
        for (int i = 0; i < d_; ++i) acc[i] *= alpha;
      }
      sc_.l[r] = sc_.l[r] * alpha + sum;
      sc_.m[r] = m_new;
    }
  }

  // Row r's weights for the chunk's n keys: exp(s - shift) on [a, b), 0 elsewhere; returns their
  // (float32) sum. In place as float32, or, on the vdpbf16ps P.V path (pairs_), rounded to bf16
  // into wb (as GPU flash attention rounds P for its P.V matrix product: relative error 2^-9 per
  // weight; l and the accumulators stay float32), the whole KEY_CHUNK row cleared first, so the
  // pad key of an odd n adds 0 x a row of zeros.
  float weights(int r, int a, int b, int n, float shift) {
    float* s = &sc_.scores[r * KEY_CHUNK];
#if defined(PK_AVX512)
    if (pairs_) {
      uint16_t* w = &sc_.wb[r * KEY_CHUNK];
      std::fill_n(w, KEY_CHUNK, uint16_t{0});
      return exp_shifted_bf16(s, w, a, b, shift);
    }
#endif
    std::fill(s, s + a, 0.f);
    std::fill(s + b, s + n, 0.f);
    return exp_shifted(s + a, b - a, shift);
  }

  // acc[r] += sum_j w[r][j] * V[j] over the chunk, rows in groups of up to 4 whose 8-float slices
  // of acc stay in registers across the chunk's keys. With at most 4 rows (decode) V is widened
  // straight from the cache; otherwise each V row is widened once into vf and reused per group.
  // Keys [j0, j1) of the chunk; the paths other than accumulate_pairs take the whole chunk.
  void accumulate_values(int hh, int j0, int j1, const C* const* vrows) {
    const int first = hh * rh_;
#if defined(PK_AVX512)
    if constexpr (std::is_same_v<T, at::BFloat16> &&
                  (std::is_same_v<C, at::BFloat16> || is_8bit_cache<C>())) {
#if defined(PK_CODE_LUT)
      if constexpr (is_8bit_cache<C>()) {
        if (lut_) {
          code_values(hh, j0, j1, vrows);
          return;
        }
      }
#endif
      if (pairs_) {
        const at::BFloat16* const* rows = bf16_rows(vrows, j0, j1);
#if defined(PK_AMX)
        if (amx_rows_ && j1 - j0 <= UNIT_KEYS) {
          amx_row_values(first, j0, j1, rows);
          return;
        }
#endif
        for (int r0 = first; r0 < first + rh_; r0 += 4)
          switch (std::min(4, first + rh_ - r0)) {
            case 4: accumulate_pairs<4>(r0, j0, j1, rows); break;
            case 3: accumulate_pairs<3>(r0, j0, j1, rows); break;
            case 2: accumulate_pairs<2>(r0, j0, j1, rows); break;
            default: accumulate_pairs<1>(r0, j0, j1, rows); break;
          }
        return;
      }
    }
#endif
    assert(j0 == 0);
    const int n = j1;
    if (rh_ <= 4) {
      accumulate_group(first, rh_, n, vrows);
      return;
    }
    float* vf = sc_.vf.data();
    for (int jj = 0; jj < n; ++jj) {
      to_float(vrows[jj], vf + jj * d_, d_);
      sc_.vfp[jj] = vf + jj * d_;
    }
    for (int r0 = first; r0 < first + rh_; r0 += 4)
      accumulate_group(r0, std::min(4, first + rh_ - r0), n, sc_.vfp.data());
  }

#if defined(PK_AVX512)
  // acc[r] += sum_j w[r][j] V[j] for NR rows from r0, two keys per vdpbf16ps: the V rows of keys
  // j and j + 1 are interleaved into bf16 pairs (unpacklo/hi_epi16), the weights (w_j, w_j+1)
  // broadcast as one pair. The unpack leaves the columns in the order pair_column describes,
  // which acc keeps for the whole item (store() puts them back). Keys padded to a multiple of 2.
  template <int NR>
  void accumulate_pairs(int r0, int j0, int j1, const at::BFloat16* const* vrows) {
    const uint16_t* w = &sc_.wb[r0 * KEY_CHUNK];
    float* acc = &sc_.acc[r0 * d_];
    int x = 0;
    for (; x + 64 <= d_; x += 64) pairs_pass<NR, 2>(x, j0, j1, w, acc, vrows);
    for (; x < d_; x += 32) pairs_pass<NR, 1>(x, j0, j1, w, acc, vrows);
  }

  // Columns [x, x + 32 * Z) of accumulate_pairs: NR x 2Z accumulators in registers over the keys.
  template <int NR, int Z>
  PK_INLINE void pairs_pass(int x, int j0, int j1, const uint16_t* w, float* acc,
                            const at::BFloat16* const* vrows) {
    __m512 a[NR][2 * Z];
    for (int i = 0; i < NR; ++i)
      for (int u = 0; u < 2 * Z; ++u) a[i][u] = _mm512_loadu_ps(acc + i * d_ + x + 16 * u);
    for (int jj = j0; jj < j1; jj += 2) {
      __m512i v[2 * Z];
      for (int z = 0; z < Z; ++z) {
        const __m512i v0 = _mm512_loadu_si512(vrows[jj] + x + 32 * z);
        const __m512i v1 = _mm512_loadu_si512(vrows[jj + 1] + x + 32 * z);
        v[2 * z] = _mm512_unpacklo_epi16(v0, v1);
        v[2 * z + 1] = _mm512_unpackhi_epi16(v0, v1);
      }
      for (int i = 0; i < NR; ++i) {
        uint32_t pair;
        std::memcpy(&pair, w + i * KEY_CHUNK + jj, sizeof pair);
        const __m512bh wi = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int u = 0; u < 2 * Z; ++u) a[i][u] = _mm512_dpbf16_ps(a[i][u], wi, (__m512bh)v[u]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int u = 0; u < 2 * Z; ++u) _mm512_storeu_ps(acc + i * d_ + x + 16 * u, a[i][u]);
  }
#endif

  template <typename S>
  void accumulate_group(int r0, int nr, int n, const S* const* vrows) {
    switch (nr) {
      case 4: accumulate_rows<4>(r0, n, vrows); break;
      case 3: accumulate_rows<3>(r0, n, vrows); break;
      case 2: accumulate_rows<2>(r0, n, vrows); break;
      default: accumulate_rows<1>(r0, n, vrows); break;
    }
  }

  template <int NR, typename S>  // a compile-time row count keeps the accumulators in registers
  void accumulate_rows(int r0, int n, const S* const* vrows) {
    const float* w = &sc_.scores[r0 * KEY_CHUNK];
    float* acc = &sc_.acc[r0 * d_];
    int x = 0;
#if defined(PK_AVX512)
    // 64 columns at a time: NR x 4 independent accumulators, so consecutive keys' FMAs do not
    // wait on each other's latency (one accumulator per row would chain all n FMAs).
    for (; x + 64 <= d_; x += 64) {
      __m512 a[NR][4];
      for (int i = 0; i < NR; ++i)
        for (int u = 0; u < 4; ++u) a[i][u] = _mm512_loadu_ps(acc + i * d_ + x + 16 * u);
      for (int jj = 0; jj < n; ++jj) {
        __m512 v[4];
        for (int u = 0; u < 4; ++u) v[u] = load16(vrows[jj] + x + 16 * u);
        for (int i = 0; i < NR; ++i) {
          const __m512 wi = _mm512_set1_ps(w[i * KEY_CHUNK + jj]);
          for (int u = 0; u < 4; ++u) a[i][u] = _mm512_fmadd_ps(wi, v[u], a[i][u]);
        }
      }
      for (int i = 0; i < NR; ++i)
        for (int u = 0; u < 4; ++u) _mm512_storeu_ps(acc + i * d_ + x + 16 * u, a[i][u]);
    }
    for (; x + 16 <= d_; x += 16) {
      __m512 a[NR];
      for (int i = 0; i < NR; ++i) a[i] = _mm512_loadu_ps(acc + i * d_ + x);
      for (int jj = 0; jj < n; ++jj) {
        __m512 v = load16(vrows[jj] + x);
        for (int i = 0; i < NR; ++i)
          a[i] = _mm512_fmadd_ps(_mm512_set1_ps(w[i * KEY_CHUNK + jj]), v, a[i]);
      }
      for (int i = 0; i < NR; ++i) _mm512_storeu_ps(acc + i * d_ + x, a[i]);
    }
#endif
#if defined(PK_SIMD)
    // 8 U columns at a time: NR x U independent accumulators (12 or 8 of the 16 ymm registers,
    // with the NR broadcast weights and one V slice), so consecutive keys' FMAs do not wait on
    // each other's latency (one accumulator per row chains all n FMAs of a slice: 4 cycles a
    // key). Each column's sum still runs over the keys in order: the same bits as one slice.
    constexpr int U = NR <= 3 ? 4 : 2;
    for (; x + 8 * U <= d_; x += 8 * U) {
      __m256 a[NR][U];
      for (int i = 0; i < NR; ++i)
        for (int u = 0; u < U; ++u) a[i][u] = _mm256_loadu_ps(acc + i * d_ + x + 8 * u);
      for (int jj = 0; jj < n; ++jj) {
        __m256 wi[NR];
        for (int i = 0; i < NR; ++i) wi[i] = _mm256_broadcast_ss(w + i * KEY_CHUNK + jj);
        for (int u = 0; u < U; ++u) {
          const __m256 v = load8(vrows[jj] + x + 8 * u);
          for (int i = 0; i < NR; ++i) a[i][u] = _mm256_fmadd_ps(wi[i], v, a[i][u]);
        }
      }
      for (int i = 0; i < NR; ++i)
        for (int u = 0; u < U; ++u) _mm256_storeu_ps(acc + i * d_ + x + 8 * u, a[i][u]);
    }
    for (; x + 8 <= d_; x += 8) {
      __m256 a[NR];
      for (int i = 0; i < NR; ++i) a[i] = _mm256_loadu_ps(acc + i * d_ + x);
      for (int jj = 0; jj < n; ++jj) {
        __m256 v = load8(vrows[jj] + x);
        for (int i = 0; i < NR; ++i)
          a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + i * KEY_CHUNK + jj), v, a[i]);
      }
      for (int i = 0; i < NR; ++i) _mm256_storeu_ps(acc + i * d_ + x, a[i]);
    }
#endif
    for (int i = 0; i < NR; ++i)
      for (int jj = 0; jj < n; ++jj) {
        const float wi = w[i * KEY_CHUNK + jj];
        for (int y = x; y < d_; ++y) acc[i * d_ + y] += wi * scalar_float(vrows[jj][y]);
      }
  }

  // The column that accumulate_pairs keeps at acc index i: per 32 columns, unpacklo_epi16 holds
  // columns 8L + t (t < 4) of each 128-bit lane L in lanes 4L + t, unpackhi columns 8L + 4 + t.
  static int pair_column(int i) {
    const int z = i / 32, e = i % 32, hi = e / 16, lane = (e % 16) / 4, t = e % 4;
    return 32 * z + 8 * lane + 4 * hi + t;
  }

  // dst[pair_column(i)] = from_float<T>(a[i] * inv) for i < d (T = bf16, d % 32 == 0: the
  // vdpbf16ps path), 32 columns at a time: the rounded words permuted back into column order.
  // With `permuted` false (amx_row_values keeps acc in column order) the words are not permuted.
  void store_pairs_row(T* dst, const float* a, float inv, bool permuted) const {
#if defined(PK_AVX512)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      struct alignas(64) Order { uint16_t word[32]; };
      static const Order order = [] {  // word c of the output takes accumulator word order[c]
        Order o{};
        for (int e = 0; e < 32; ++e) o.word[pair_column(e)] = static_cast<uint16_t>(e);
        return o;
      }();
      const __m512i idx = _mm512_load_si512(order.word);
      const __m512 scale = _mm512_set1_ps(inv);
      for (int x = 0; x < d_; x += 32) {
        const __m256i lo = bf16_bits(_mm512_mul_ps(_mm512_loadu_ps(a + x), scale));
        const __m256i hi = bf16_bits(_mm512_mul_ps(_mm512_loadu_ps(a + x + 16), scale));
        const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        _mm512_storeu_si512(dst + x, permuted ? _mm512_permutexvar_epi16(idx, words) : words);
      }
      return;
    }
#endif
    for (int i = 0; i < d_; ++i) dst[permuted ? pair_column(i) : i] = from_float<T>(a[i] * inv);
  }

  void store() {
    for (int r = 0; r < rows_; ++r) {
      T* dst = out_ + token(r) * p_.o_s0 + head(r) * p_.o_s1;
      // No visible key (invalid input): 0. The value scale multiplies the weighted sum.
      const float inv = sc_.l[r] > 0.f ? kv_scale(p_.v_scale, r) / sc_.l[r] : 0.f;
      float* a = &sc_.acc[r * d_];
#if defined(PK_CODE_LUT)
      if (lut_) code_columns_in_order(a);
#endif
      if (pairs_)
        store_pairs_row(dst, a, inv, !amx_rows_ && !lut_);
      else
        for (int i = 0; i < d_; ++i) dst[i] = from_float<T>(a[i] * inv);
      if (p_.lse != nullptr)
        p_.lse[token(r) * p_.num_heads + head(r)] =
            sc_.l[r] > 0.f ? sc_.m[r] + std::log(sc_.l[r]) : NEG_INF;
    }
  }

  const Problem& p_;
  const T* q_;
  const C* k_;
  const C* v_;
  T* out_;
  const Item& it_;
  Scratch<T, C>& sc_;
  const int d_, g_, rh_, nh_, rows_;  // rows per KV head, KV heads, rows of the item
  const bool pairs_;  // P.V by accumulate_pairs (acc in pair_column order) unless amx_rows_
  const bool amx_;    // Q.K^T of whole 16-key units on AMX tiles (amx_scores)
  const bool amx_rows_;  // more than 16 rows per KV head: Q.K^T and P.V on AMX, 16 rows per tile
                         // (amx_row_scores, amx_row_values; acc in column order)
  const bool lut_;  // an 8-bit cache read through code_lut.h (uses_code_lut); acc in
                    // code_value_pairs' column order
  const bool paced_;     // the paced prefetch (plan_reads) requests the K/V
};

// The call's work items on `threads` threads. A decode call with `read_ahead_kv` first sweeps its
// K/V into the caches (read_ahead.h), unless its items request their own lines (the paced
// prefetch), which overlaps the loads with the arithmetic instead of running them first.
template <typename T, typename C>
void run_items(const Problem& p, const at::Tensor& query, const at::Tensor& key_cache,
               const at::Tensor& value_cache, at::Tensor& out, int64_t tile, int64_t threads,
               bool read_ahead_kv) {
  if (p.cu_seqlens_q == nullptr && read_ahead_kv && !ItemKernel<T, C>::paces(p)) {
    volatile int64_t read = read_ahead(p, key_cache, value_cache, threads);  // keeps the loads
    (void)read;
  }
  std::vector<Item> items = plan(p, tile);
  const T* q = query.data_ptr<T>();
  const C* k = static_cast<const C*>(key_cache.data_ptr());
  const C* v = static_cast<const C*>(value_cache.data_ptr());
  T* o = out.data_ptr<T>();
  const int heads = static_cast<int>(heads_per_item(p));
  const int rows = static_cast<int>(tile * p.group()) * heads;
  const int64_t n = static_cast<int64_t>(items.size());
  int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
#pragma omp parallel num_threads(nthreads)
  {
    Scratch<T, C>& sc = thread_scratch<T, C>(rows, static_cast<int>(p.head_size), heads);
    int tile_cols = 0;  // the AMX tile configuration the thread's items left (ItemKernel::run)
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < n; ++i) ItemKernel<T, C>(p, q, k, v, o, items[i], sc).run(tile_cols);
#if defined(PK_AMX)
    if (tile_cols != 0) _tile_release();
#endif
  }
}

}  // namespace
