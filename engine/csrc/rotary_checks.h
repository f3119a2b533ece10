// The checks of a rotary step's tables, shared by layer_ops.cpp (`rotary`) and layer_loop.cpp (a
// step's layers): float32 contiguous `cos`/`sin` [P, head_size], int64 contiguous `positions`
// [tokens], each position in [0, P). The rotary row kernel (layer_rows.h) reads the tables at
// those rows unchecked.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace layer_rows {

inline void check_rotary_tables(const at::Tensor& positions, const at::Tensor& cos,
                                const at::Tensor& sin, int64_t tokens, int64_t head_size) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.dim() == 2 &&
              cos.size(1) == head_size && sin.sizes() == cos.sizes() && sin.is_contiguous() &&
              sin.scalar_type() == at::kFloat, "cos/sin: expected float32 [positions, ",
              head_size, "]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
              positions.numel() == tokens, "positions: expected int64 [", tokens, "]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "positions: expected values in [0, ",
                cos.size(0), "), got ", pos[t]);
}

}  // namespace layer_rows
