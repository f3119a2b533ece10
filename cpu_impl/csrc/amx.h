// AMX (Intel's tile matrix unit) for the attention kernel's Q.K^T: whether this build and this
// process may use it, and the tile configuration of a work item. Built in when the flags enable
// AMX-TILE and AMX-BF16 on top of the AVX-512 BF16 build (cpu_impl/build.py's first tier).
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(PK_AVX512)
#define PK_AMX 1
#include <immintrin.h>

#include "../../paged_kernels/csrc/amx_tiles.h"
#endif

namespace {

// The process-wide switch (use_amx in the bindings): on by default; tests turn it off to run the
// vdpbf16ps path of the same build.
bool amx_enabled = true;

#if defined(PK_AMX)
// The scores' tiles for `cols` query rows (1..16): tile 0 = A, 16 keys x 32 K elements (bf16);
// tile 1 = B, 16 pairs of head-size elements x `cols` query rows; tile 2 = C, 16 keys x `cols`
// float32 scores.
inline void amx_configure_scores(int cols) {
  pk_amx::TileConfig c;
  c.colsb[0] = 64;
  c.colsb[1] = c.colsb[2] = static_cast<uint16_t>(4 * cols);
  c.rows[0] = c.rows[1] = c.rows[2] = 16;
  _tile_loadconfig(&c);
}

// The tiles of a work item with more than 16 query rows per KV head (a prefill tile), 16 rows at a
// time: tiles 0-2 as amx_configure_scores(16) with C = 16 rows x 16 keys; for P.V, tile 3 = A,
// 16 rows x 16 keys' bf16 weights; tile 4 = B, 8 key pairs x 16 head-size elements; tile 5 = C,
// 16 rows x 16 float32 accumulator elements.
inline void amx_configure_rows() {
  pk_amx::TileConfig c;
  for (int i = 0; i < 6; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  c.colsb[3] = 32;
  c.rows[4] = 8;
  _tile_loadconfig(&c);
}
#endif

// Whether this build runs Q.K^T on AMX tiles now (compiled in, switched on, granted).
inline bool amx_active() {
#if defined(PK_AMX)
  return amx_enabled && pk_amx::granted();
#else
  return false;
#endif
}

}  // namespace
