// pk_host_mma.h: the warp-collective tensor-core product of cuda/csrc/pk_mma.cuh, on the host.
//
// `pk_mma_m16n8k16_f16/_bf16(d, a, b, c)` compute D[16x8] = A[16x16] * B[16x8] + C[16x8] for the
// whole warp, exactly as PTX `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32`
// distributes the operands over the lanes (g = lane / 4, t = lane % 4; in a 32-bit register the
// lower k/column index is the low 16 bits):
//   a[0] = A[g][2t..2t+1]    a[1] = A[g+8][2t..2t+1]   a[2] = A[g][2t+8..2t+9]
//   a[3] = A[g+8][2t+8..2t+9]
//   b[0] = B[2t..2t+1][g]    b[1] = B[2t+8..2t+9][g]
//   c[0..1] = C[g][2t..2t+1] c[2..3] = C[g+8][2t..2t+1]   (d likewise)
// Every lane deposits its a/b registers in a warp exchange, then computes its own four outputs
// from the A rows and B columns it gathers. The 16 products are exact (they are in float64 here;
// products of 16-bit floats are exact in float32 too); they are summed in float64 and added to
// C, with one rounding to float32: no worse than the tensor core, which rounds more often.
//
// `pk_ldmatrix_x4(r, row)` / `pk_ldmatrix_x4_trans(r, row)` are warp collectives too: each lane
// reads the 16 bytes at its own row address (which must be 16-byte aligned) and deposits them;
// then lane l takes element pairs of the four 8x8 matrices (matrix i = the rows of lanes
// 8i..8i+7) in the layout pk_mma.cuh states: M_i[g][2t..2t+1] plain, M_i[2t..2t+1][g] .trans.
#pragma once

#include <cstdint>
#include <cstring>

#include "pk_host_sched.h"
#include "pk_host_types.h"

namespace pk_host {

struct MmaOperands {
  uint32_t a[4];
  uint32_t b[2];
};

inline uint16_t mma_half_of(uint32_t word, int k) {
  return static_cast<uint16_t>((k & 1) ? (word >> 16) : (word & 0xffffu));
}

template <float (*ToFloat)(uint16_t)>
inline void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
  if (warp_existing_lanes() != 0xffffffffu) fail("pk_mma_m16n8k16 needs all 32 lanes of a warp");
  MmaOperands mine;
  std::memcpy(mine.a, a, sizeof mine.a);
  std::memcpy(mine.b, b, sizeof mine.b);
  float acc_in[4] = {c[0], c[1], c[2], c[3]};  // d may alias c
  const unsigned char* slots = warp_exchange(&mine, sizeof mine, 0xffffffffu, kMma);
  auto lane_ops = [slots](int lane) {
    MmaOperands ops;
    std::memcpy(&ops, slots + static_cast<size_t>(lane) * kExchangeBytes, sizeof ops);
    return ops;
  };
  const int lane = static_cast<int>(tls_thread->lane);
  const int g = lane >> 2, t = lane & 3;
  float a_rows[2][16];  // A[g][:], A[g+8][:]
  float b_cols[2][16];  // B[:][2t], B[:][2t+1]
  for (int k = 0; k < 16; ++k) {
    for (int half = 0; half < 2; ++half) {
      int row = g + 8 * half;
      MmaOperands owner = lane_ops((row & 7) * 4 + ((k & 7) >> 1));
      a_rows[half][k] = ToFloat(mma_half_of(owner.a[(row >> 3) + ((k >> 3) << 1)], k));
      int col = 2 * t + half;
      MmaOperands bown = lane_ops(col * 4 + ((k & 7) >> 1));
      b_cols[half][k] = ToFloat(mma_half_of(bown.b[k >> 3], k));
    }
  }
  for (int i = 0; i < 4; ++i) {
    const float* arow = a_rows[i >> 1];
    const float* bcol = b_cols[i & 1];
    double sum = 0.0;
    for (int k = 0; k < 16; ++k) sum += static_cast<double>(arow[k]) * bcol[k];
    d[i] = static_cast<float>(sum + static_cast<double>(acc_in[i]));
  }
}

// The four 8x8 matrices of an ldmatrix.x4: every lane's row, then this lane's registers.
inline void ldmatrix_x4(uint32_t r[4], const void* row, bool trans) {
  if (warp_existing_lanes() != 0xffffffffu) fail("pk_ldmatrix_x4 needs all 32 lanes of a warp");
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0)
    fail("pk_ldmatrix_x4: a row address is not 16-byte aligned");
  uint16_t mine[8];
  std::memcpy(mine, row, sizeof mine);
  const unsigned char* slots = warp_exchange(mine, sizeof mine, 0xffffffffu, kLdmatrix);
  // Element (row k, column c) of matrix i: lane 8i + k deposited row k.
  auto elem = [slots](int i, int k, int c) {
    uint16_t e;
    std::memcpy(&e, slots + static_cast<size_t>(8 * i + k) * kExchangeBytes + 2 * c, 2);
    return static_cast<uint32_t>(e);
  };
  const int lane = static_cast<int>(tls_thread->lane);
  const int g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = trans ? elem(i, 2 * t, g) : elem(i, g, 2 * t);
    const uint32_t hi = trans ? elem(i, 2 * t + 1, g) : elem(i, g, 2 * t + 1);
    r[i] = lo | (hi << 16);
  }
}

}  // namespace pk_host

inline void pk_ldmatrix_x4(uint32_t r[4], const void* row) { pk_host::ldmatrix_x4(r, row, false); }

inline void pk_ldmatrix_x4_trans(uint32_t r[4], const void* row) {
  pk_host::ldmatrix_x4(r, row, true);
}

inline void pk_mma_m16n8k16_f16(float d[4], const uint32_t a[4], const uint32_t b[2],
                                const float c[4]) {
  pk_host::mma_m16n8k16<&pk_host::half_bits_to_float>(d, a, b, c);
}

inline void pk_mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2],
                                 const float c[4]) {
  pk_host::mma_m16n8k16<&pk_host::bf16_bits_to_float>(d, a, b, c);
}
