"""The reference backend's `write_kv`, in plain PyTorch (docs/abi.md). Its `copy_blocks` and
`swap_blocks` are the generic ones of `paged_kernels.cache_ops`."""

from __future__ import annotations

from typing import Optional

import torch

from paged_kernels.cache_ops import as_bytes
from paged_kernels.kv_quant import quantize


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None
             ) -> None:
    """`cache[slot // block_size, :, slot % block_size] = row` for every non-negative slot
    (slots were checked to be in range by `paged_kernels.attention.write_kv`); with scales
    (an 8-bit cache) the row is `quantize(row, scale, cache.dtype)`."""
    block_size = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    for rows, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        rows = rows[keep]
        if scale is not None:
            rows = quantize(rows, scale, cache.dtype)
        as_bytes(cache)[blocks, :, offsets] = as_bytes(rows)
