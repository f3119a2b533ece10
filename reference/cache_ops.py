"""Cache operations in plain PyTorch: write_kv, copy_blocks, swap_blocks (docs/abi.md)."""

from __future__ import annotations

from typing import Sequence

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


def _check_block_ids(arg: str, ids: torch.Tensor, num_blocks: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_mapping: expected {arg} block ids in [0, {num_blocks}), got "
                         f"min {int(ids.min())}, max {int(ids.max())}")


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """`cache[dst] = cache[src]` for every (src, dst) row, in every layer's K and V cache."""
    mapping = block_mapping.to(key_caches[0].device)
    _check_block_ids("src/dst", mapping, key_caches[0].shape[0])
    src, dst = mapping[:, 0], mapping[:, 1]
    for cache in (*key_caches, *value_caches):
        cache[dst] = cache[src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """`dst[d] = src[s]` for every (s, d) row; `src` and `dst` may be on different devices."""
    _check_block_ids("source", block_mapping[:, 0], src.shape[0])
    _check_block_ids("destination", block_mapping[:, 1], dst.shape[0])
    s_ids = block_mapping[:, 0].to(src.device)
    d_ids = block_mapping[:, 1].to(dst.device)
    dst[d_ids] = src[s_ids].to(dst.device, non_blocking=False)
