// pk_mma.cuh: the tensor-core product the varlen and decode kernels use, one warp-collective
// function per operand type, and `ldmatrix`, which loads its operands from shared memory. On the
// GPU they are inline PTX `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32`
// (sm_80+) and `ldmatrix` (sm_75+); under PK_HOST_EMULATION this header defines only PkMma and
// the emulator provides functions with the same names, signatures and fragment layouts.
//
//   D[16x8] (f32) = A[16x16] (row-major) * B[16x8] (column-major) + C[16x8] (f32)
//
// All 32 lanes of the warp call it together. With g = lane / 4 and t = lane % 4, each lane holds
// (a register "pair" holds two 16-bit values, the lower column/k index in the low 16 bits):
//   a[0] = A[g    ][2t, 2t+1]      a[1] = A[g + 8][2t, 2t+1]
//   a[2] = A[g    ][2t+8, 2t+9]    a[3] = A[g + 8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1  ][g]        b[1] = B[2t+8, 2t+9][g]
//   c[0], c[1] = C[g    ][2t, 2t+1]        (same for d)
//   c[2], c[3] = C[g + 8][2t, 2t+1]
// So for B = K^T with K stored row-major [n][k], b[0] is the 32-bit word K[g][2t..2t+1], and a
// row-major A gives a[i] as one 32-bit word; a D fragment of two adjacent n-tiles is exactly the
// A fragment of the next product (P*V) once converted to 16-bit pairs.
//
// pk_ldmatrix_x4(r, row) / pk_ldmatrix_x4_trans(r, row) (PTX `ldmatrix.sync.aligned.m8n8.x4
// [.trans].shared.b16`, sm_75+): loads four 8x8 matrices of 16-bit elements from shared memory.
// Lane l gives the address of row (l % 8) of matrix (l / 8) (16 contiguous, 16-byte aligned
// bytes). Then lane l (g = l / 4, t = l % 4) holds in r[i], low half first:
//   plain:  M_i[g][2t], M_i[g][2t+1]      (the layout of an a[] or b[] register above)
//   .trans: M_i[2t][g], M_i[2t+1][g]      (so a row-major V tile gives P*V's b[] registers)
#pragma once
#include "pk_common.cuh"
#include "pk_platform.cuh"

#if !defined(PK_HOST_EMULATION)

__device__ __forceinline__ void pk_mma_m16n8k16_f16(float d[4], const uint32_t a[4],
                                                    const uint32_t b[2], const float c[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ void pk_mma_m16n8k16_bf16(float d[4], const uint32_t a[4],
                                                     const uint32_t b[2], const float c[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ void pk_ldmatrix_x4(uint32_t r[4], const void* row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

__device__ __forceinline__ void pk_ldmatrix_x4_trans(uint32_t r[4], const void* row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

#endif  // !PK_HOST_EMULATION

// The m16n8k16 product for operand type T (d and c may be the same array).
template <typename T> struct PkMma;
template <> struct PkMma<__half> {
  static __device__ __forceinline__ void run(float d[4], const uint32_t a[4], const uint32_t b[2],
                                             const float c[4]) {
    pk_mma_m16n8k16_f16(d, a, b, c);
  }
};
template <> struct PkMma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float d[4], const uint32_t a[4], const uint32_t b[2],
                                             const float c[4]) {
    pk_mma_m16n8k16_bf16(d, a, b, c);
  }
};

// ldmatrix.x4 loads of mma.m16n8k16 operands from a row-major shared-memory tile with leading
// dimension `ld` elements: each lane gives the address of one 16-byte row, and the four 8 x 8
// matrices come back in the register order the operands need (lane = the thread's lane).
// A: rows 0-15, columns k0..k0+15 of `tile` (Q).
template <typename T>
__device__ __forceinline__ void pk_ldmatrix_a(uint32_t r[4], const T* tile, int ld, int k0,
                                              int lane) {
  const int i = lane / 8, rr = lane % 8;
  pk_ldmatrix_x4(r, tile + (rr + 8 * (i & 1)) * ld + k0 + 8 * (i >> 1));
}

// B of two n8 tiles from a [n][k] tile (K rows): columns k0..k0+15 of rows 0-7 in r[0..1] and
// of rows 8-15 in r[2..3].
template <typename T>
__device__ __forceinline__ void pk_ldmatrix_b(uint32_t r[4], const T* tile, int ld, int k0,
                                              int lane) {
  const int i = lane / 8, rr = lane % 8;
  pk_ldmatrix_x4(r, tile + (rr + 8 * (i >> 1)) * ld + k0 + 8 * (i & 1));
}

// B of two n8 tiles from a [k][n] tile (V rows, transposed by the load): rows 0-15, columns
// n0..n0+7 in r[0..1] and n0+8..n0+15 in r[2..3].
template <typename T>
__device__ __forceinline__ void pk_ldmatrix_b_trans(uint32_t r[4], const T* tile, int ld, int n0,
                                                    int lane) {
  const int i = lane / 8, rr = lane % 8;
  pk_ldmatrix_x4_trans(r, tile + (rr + 8 * (i & 1)) * ld + n0 + 8 * (i >> 1));
}

// One step of the online softmax, in base 2, on a warp's m16n8 accumulator fragments: a lane
// holds entries of rows g and g + 8 (index c / 2) of NT score tiles s, already scaled, capped and
// masked (-inf); tile_max[hr] is the lane's largest entry of row hr in this tile. The four lanes
// of a quad share a row, so the running max m and sum l are reduced over the quad. s becomes
// exp2(s - m) (0 while a row has seen only masked keys) and l gains its sum; the accumulators o
// (DT fragments) are rescaled by exp2(m_old - m_new), skipped by the whole warp when no row's
// max moved (after the first tiles it rarely does; multiplying by exactly 1 changes nothing).
template <int NT, int DT>
__device__ __forceinline__ void pk_online_softmax_step(float (&s)[NT][4], const float tile_max[2],
                                                       float m[2], float l[2],
                                                       float (&o)[DT][4]) {
  float alpha[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const float m_new = fmaxf(m[hr], pk_group_max<4>(tile_max[hr]));
    alpha[hr] = m_new == -INFINITY ? 1.f : exp2f(m[hr] - m_new);
    m[hr] = m_new;
    l[hr] *= alpha[hr];
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float mm = m[c / 2];
      const float e = mm == -INFINITY ? 0.f : exp2f(s[nt][c] - mm);
      s[nt][c] = e;
      l[c / 2] += e;
    }
  if (!__all_sync(PK_FULL_MASK, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][0] *= alpha[0]; o[dt][1] *= alpha[0];
      o[dt][2] *= alpha[1]; o[dt][3] *= alpha[1];
    }
  }
}
