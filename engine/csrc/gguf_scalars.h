// What the engine's GGUF kernels (quant_matmul.cpp, int8_matmul.cpp, tiled_matmul.cpp) share:
// conversions of float16 (the blocks' scales) and bfloat16 (activations) to and from float32,
// exactly as torch rounds, and the nibble -> bf16 table of the bf16 paths. Plain C++; the build
// key of each library covers this header (paged_kernels/cpp_build.py: local_headers).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace gguf_scalars {

// Exact for every float16 value (subnormals, infinities and NaN included).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do { mant <<= 1; ++e; } while (!(mant & 0x400u));
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// bf16 bits of i & 15 for a 5-bit index i: the vpermw table that turns Q4_1 nibbles into exact
// bf16 values (a word holding a nibble and bits above it needs no mask for the fifth index bit).
alignas(64) inline constexpr uint16_t kNibbleBf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

inline float bf16_to_f32(uint16_t h) {  // exact: bf16 is the top half of a float32
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN -> 0x7FC0 (torch's rule)
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace gguf_scalars
