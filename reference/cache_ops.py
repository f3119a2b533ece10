"""The reference backend's `write_kv`, in plain PyTorch (docs/abi.md). Its `copy_blocks` and
`swap_blocks` are the generic ones of `paged_kernels.cache_ops`."""

from __future__ import annotations

import torch


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`cache[slot // block_size, :, slot % block_size] = row` for every non-negative slot
    (slots were checked to be in range by `paged_kernels.attention.write_kv`)."""
    block_size = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, :, offsets] = key[keep]
    value_cache[blocks, :, offsets] = value[keep]
