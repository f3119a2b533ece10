"""The generic `copy_blocks` and `swap_blocks`, in plain PyTorch (docs/abi.md).

A backend runs these unless it declares its own kernels (`Backend.block_ops`, listed in
docs/support-matrix.md). Arguments arrive checked by `paged_kernels.abi`; the block ids in
`block_mapping` are checked here (`check_block_ids`), since reading them synchronises.
8-bit caches are copied as bytes (`as_bytes`): torch's CPU index operations lack the fp8 types.
"""

from __future__ import annotations

from typing import Sequence

import torch

from paged_kernels.abi import check_block_ids


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A one-byte cache viewed as uint8 (same shape and strides), so index operations work for
    every 8-bit type; any other cache as is. Bytes are bytes: copies through the view are exact."""
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """`cache[dst] = cache[src]` for every (src, dst) row, in every layer's K and V cache."""
    mapping = block_mapping.to(key_caches[0].device)
    check_block_ids("src/dst", mapping, key_caches[0].shape[0])
    src, dst = mapping[:, 0], mapping[:, 1]
    for cache in (*key_caches, *value_caches):
        data = as_bytes(cache)
        data[dst] = data[src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """`dst[d] = src[s]` for every (s, d) row; `src` and `dst` may be on different devices."""
    check_block_ids("source", block_mapping[:, 0], src.shape[0])
    check_block_ids("destination", block_mapping[:, 1], dst.shape[0])
    s_ids = block_mapping[:, 0].to(src.device)
    d_ids = block_mapping[:, 1].to(dst.device)
    as_bytes(dst)[d_ids] = as_bytes(src)[s_ids].to(dst.device, non_blocking=False)
