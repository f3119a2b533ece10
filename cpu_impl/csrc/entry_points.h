// The cpu backend's kernels as C++ function pointers, for native callers built against the same
// torch (engine/csrc/layer_loop.cpp runs a decode step's layers in one call): the extension's
// `entry_points()` returns their addresses as integers, in the order of this header. The types are
// the bound functions' own (paged_attention.cpp checks that they match), so a caller passes
// exactly what cpu_impl/backend.py passes from Python, and gets the same bits.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace pk_cpu {

// paged_attention(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out, lse,
// alibi_slopes, scale, sliding_window, soft_cap, tile, threads, read_ahead_kv, k_scale, v_scale,
// prefetch_lines): false when the kernel's content scan failed (see cpu_impl/backend.py).
using PagedAttentionFn = bool (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&,
                                  const c10::optional<at::Tensor>&, at::Tensor,
                                  const c10::optional<at::Tensor>&,
                                  const c10::optional<at::Tensor>&, double, int64_t, double,
                                  int64_t, int64_t, bool, const c10::optional<at::Tensor>&,
                                  const c10::optional<at::Tensor>&, int64_t);

// write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, threads).
using WriteKvFn = void (*)(const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor,
                           const at::Tensor&, const c10::optional<at::Tensor>&,
                           const c10::optional<at::Tensor>&, int64_t);

}  // namespace pk_cpu
