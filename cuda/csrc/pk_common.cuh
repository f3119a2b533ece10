// pk_common.cuh: element conversions, 16-byte vector loads/stores and warp reductions shared by
// the kernels. Everything here is device code in the agreed CUDA subset.
#pragma once
#include "pk_platform.cuh"

// ---- element <-> float ----
__device__ __forceinline__ float pk_to_float(float x) { return x; }
__device__ __forceinline__ float pk_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float pk_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T pk_from_float(float x);
template <> __device__ __forceinline__ float pk_from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half pk_from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 pk_from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two floats -> one 32-bit register of two 16-bit values (low = `lo`), the mma operand format.
template <typename T> __device__ __forceinline__ uint32_t pk_pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pk_pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pk_pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// ---- 16-byte vectors: VEC elements of T ----
template <typename T> struct PkVec {
  static constexpr int N = 16 / static_cast<int>(sizeof(T));
};

// Raw 16-byte load; `ptr` must be 16-byte aligned (launch.py guarantees it for every tensor row).
template <typename T>
__device__ __forceinline__ uint4 pk_load16(const T* ptr) {
  return __ldg(reinterpret_cast<const uint4*>(ptr));
}

template <typename T>
__device__ __forceinline__ void pk_unpack16(const uint4& raw, float (&out)[PkVec<T>::N]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < PkVec<T>::N; ++i) out[i] = pk_to_float(e[i]);
}

template <typename T>
__device__ __forceinline__ void pk_store16(T* ptr, const float (&in)[PkVec<T>::N]) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < PkVec<T>::N; ++i) e[i] = pk_from_float<T>(in[i]);
  *reinterpret_cast<uint4*>(ptr) = raw;
}

// ---- reductions over aligned groups of WIDTH lanes (WIDTH a power of two <= 32) ----
// Every lane of the warp must call these (full-mask shuffles).
template <int WIDTH>
__device__ __forceinline__ float pk_group_sum(float v) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) v += __shfl_xor_sync(PK_FULL_MASK, v, off);
  return v;
}

template <int WIDTH>
__device__ __forceinline__ float pk_group_max(float v) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(PK_FULL_MASK, v, off));
  return v;
}

__host__ __device__ constexpr int pk_log2(int x) { return x <= 1 ? 0 : 1 + pk_log2(x / 2); }

// Sums each of the G values of `v` over an aligned group of TG lanes (G <= TG, both powers of
// two) with G - 1 + log2(TG / G) shuffles instead of G * log2(TG): each exchange step hands half
// of the remaining values to the partner lane. Afterwards lane `li` holds the full sum for value
// pk_transpose_sum_index<G, TG>(li) in v[0] (the rest of `v` is clobbered).
template <int G, int TG>
__device__ __forceinline__ float pk_transpose_sum(float (&v)[G], int li) {
  static_assert(G <= TG && (G & (G - 1)) == 0 && (TG & (TG - 1)) == 0, "powers of two, G <= TG");
#pragma unroll
  for (int step = 0; step < pk_log2(G); ++step) {
    const int half = (G >> step) / 2, off = TG >> (step + 1);
    const bool upper = (li & off) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? v[i] : v[i + half];
      const float keep = upper ? v[i + half] : v[i];
      v[i] = keep + __shfl_xor_sync(PK_FULL_MASK, send, off);
    }
  }
#pragma unroll
  for (int off = TG / G / 2; off > 0; off /= 2) v[0] += __shfl_xor_sync(PK_FULL_MASK, v[0], off);
  return v[0];
}

// Which value lane `li` holds after pk_transpose_sum<G, TG>.
template <int G, int TG>
__device__ __forceinline__ int pk_transpose_sum_index(int li) {
  int index = 0;
#pragma unroll
  for (int step = 0; step < pk_log2(G); ++step)
    if (li & (TG >> (step + 1))) index += (G >> step) / 2;
  return index;
}

// ---- score transforms shared by all attention kernels (docs/abi.md order) ----
// `s` is already scaled; soft cap then ALiBi (slope * (key position - query position)).
__device__ __forceinline__ float pk_transform_score(float s, float soft_cap, float slope,
                                                    int64_t k_pos, int64_t q_pos) {
  if (soft_cap > 0.f) s = soft_cap * tanhf(s / soft_cap);
  return s + slope * static_cast<float>(k_pos - q_pos);
}

// exp(x - m) that is 0 (not NaN) when both are -inf.
__device__ __forceinline__ float pk_exp_shifted(float x, float m) {
  return m == -INFINITY ? 0.f : __expf(x - m);
}

// Position -> cache offset through one sequence's block table. Positions are int32 (seq_lens is
// int32); the offset is int64 before any multiplication by a stride (block_id * stride_block can
// pass 2^31). Shifts replace the division when block_size is a power of two.
struct PkBlockMap {
  const int32_t* table;
  int block_size;
  int shift;  // log2(block_size), or -1

  __device__ __forceinline__ PkBlockMap(const int32_t* t, int bs) : table(t), block_size(bs) {
    int s = 0;
    while ((1 << s) < bs) ++s;
    shift = (1 << s) == bs ? s : -1;
  }

  // Index into the block table of position `pos`, and its slot in that block.
  __device__ __forceinline__ int index(int pos, int& slot) const {
    const int idx = shift >= 0 ? pos >> shift : pos / block_size;
    slot = pos - idx * block_size;
    return idx;
  }

  __device__ __forceinline__ int64_t offset(int pos, int64_t stride_block,
                                            int64_t stride_slot) const {
    int slot;
    const int idx = index(pos, slot);
    return static_cast<int64_t>(__ldg(table + idx)) * stride_block +
           static_cast<int64_t>(slot) * stride_slot;
  }
};
