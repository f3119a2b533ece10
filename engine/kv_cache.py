"""The paged KV cache tensors: one key and one value cache per layer, plus a host pool for swap.

Each cache is `[num_blocks, num_kv_heads, block_size, head_dim]` in the cache's dtype: the
model's, or an 8-bit one (float8 e4m3fn / e5m2, int8) with per-layer scales
(engine/kv_scales.py), the layout of docs/abi.md. The pool size is a block count, or derived from
a memory budget in bytes (an 8-bit cache fits twice the blocks of a 16-bit one). Block moves
(copy-on-write copies, swap out, swap in) go through `paged_kernels.attention`; they move bytes,
so the host pool has the device cache's dtype and the scales stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from engine.block_pool import BlockCopy
from engine.kv_scales import LayerKVScales, is_quantized, make_kv_scales
from paged_kernels.attention import copy_blocks, swap_blocks
from paged_kernels.cache_memory import empty_cache, prefault as prefault_memory, zeros_cache

#: Budget used when neither a block count nor a byte budget is given.
DEFAULT_KV_CACHE_BYTES = 1 << 30


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, keys and values."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * block_size * head_dim * element


def num_blocks_for_budget(budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                          block_size: int, dtype: torch.dtype) -> int:
    """The most blocks that fit in `budget_bytes`; ValueError if not even one does."""
    per_block = bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
    count = budget_bytes // per_block
    if count < 1:
        raise ValueError(f"kv_cache_memory_bytes: expected at least one block ({per_block} bytes "
                         f"for block_size={block_size}, {dtype}), got {budget_bytes}")
    return count


def _check_scales(scales: Optional[list[LayerKVScales]], dtype: torch.dtype,
                  num_layers: int) -> None:
    if is_quantized(dtype) and (scales is None or len(scales) != num_layers):
        got = None if scales is None else f"{len(scales)} layers"
        raise ValueError(f"scales: expected one LayerKVScales per layer ({num_layers}) for a "
                         f"{dtype} cache, got {got}")
    if not is_quantized(dtype) and scales is not None:
        raise ValueError(f"scales: expected None for a {dtype} cache, got {len(scales)} layers")


def _check_fill(fill: Optional[float], dtype: torch.dtype) -> None:
    if fill is not None and dtype == torch.int8 and not -128 <= fill <= 127:
        raise ValueError(f"kv_fill: expected a value in [-128, 127] for an int8 cache (int8 has "
                         f"no NaN), got {fill!r}")


def _mapping(pairs: Sequence[BlockCopy]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)


class KVCache:
    """Device caches (`kv_caches[i] = (key, value)` of layer `i`) and the host swap pool.

    `fill` (tests) writes that value (e.g. NaN) into every slot so that reading a slot never
    written shows up in the results (an int8 cache has no NaN: give a value in [-128, 127]).
    Without it a CPU pool is `paged_kernels.zeros_cache` memory: zero, in huge pages, and
    resident only as blocks are first written, each page's first write paying its first-touch
    fault in a step. `prefault` makes every page of the CPU pools resident here instead
    (`paged_kernels.prefault`: a write_kv into fresh pages took 14-24x as long as into
    resident ones, bench/results/2026-12-04-kv-prefault); other devices' pools are left
    uninitialised. `dtype` is the caches' storage type; `scales` (`scales[i]` for layer `i`,
    engine/kv_scales.py) is required with an 8-bit `dtype` and None otherwise.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 num_host_blocks: int = 0, backend: str = "auto",
                 fill: Optional[float] = None,
                 scales: Optional[list[LayerKVScales]] = None, prefault: bool = False) -> None:
        _check_scales(scales, dtype, num_layers)
        _check_fill(fill, dtype)
        self.dtype = dtype
        self.scales = scales
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.backend = backend
        self.device_caches = self._allocate(num_layers, num_blocks, num_kv_heads, block_size,
                                            head_dim, dtype, torch.device(device), fill)
        self.host_caches = self._allocate(num_layers, num_host_blocks, num_kv_heads, block_size,
                                          head_dim, dtype, torch.device("cpu"), fill)
        if prefault:
            for caches in (self.device_caches, self.host_caches):
                if caches:
                    prefault_memory(caches[0][0])  # the one allocation under every view

    @staticmethod
    def _allocate(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                  head_dim: int, dtype: torch.dtype, device: torch.device,
                  fill: Optional[float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if num_blocks == 0:
            return []
        # One allocation for everything; each layer's key and value caches are contiguous views.
        shape = (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)
        if fill is None and device.type == "cpu":  # huge pages, resident as blocks are written
            storage = zeros_cache(shape, dtype, device)
        else:
            storage = empty_cache(shape, dtype, device)
            if fill is not None:
                storage.fill_(fill)
        return [(storage[i, 0], storage[i, 1]) for i in range(num_layers)]

    @property
    def key_caches(self) -> list[torch.Tensor]:
        return [k for k, _ in self.device_caches]

    @property
    def value_caches(self) -> list[torch.Tensor]:
        return [v for _, v in self.device_caches]

    def move_blocks(self, swap_out: Sequence[BlockCopy], swap_in: Sequence[BlockCopy],
                    copies: Sequence[BlockCopy]) -> None:
        """A step's block moves in the only safe order: swap out (the step may reuse those
        device blocks), swap in, then copy-on-write copies."""
        self.swap_out(swap_out)
        self.swap_in(swap_in)
        self.copy(copies)

    def copy(self, pairs: Sequence[BlockCopy]) -> None:
        """Copy-on-write: device block `src` to device block `dst` for each pair, every layer."""
        if pairs:
            device = self.device_caches[0][0].device  # the mapping lives with the caches
            copy_blocks(self.key_caches, self.value_caches, _mapping(pairs).to(device),
                        backend=self.backend)

    def swap_out(self, pairs: Sequence[BlockCopy]) -> None:
        """Device block -> host block for each `(device, host)` pair, every layer."""
        self._swap(self.device_caches, self.host_caches, pairs)

    def swap_in(self, pairs: Sequence[BlockCopy]) -> None:
        """Host block -> device block for each `(host, device)` pair, every layer."""
        self._swap(self.host_caches, self.device_caches, pairs)

    def _swap(self, src: list, dst: list, pairs: Sequence[BlockCopy]) -> None:
        if not pairs:
            return
        mapping = _mapping(pairs)  # on the CPU, as swap_blocks requires
        for (sk, sv), (dk, dv) in zip(src, dst):
            swap_blocks(sk, dk, mapping, backend=self.backend)
            swap_blocks(sv, dv, mapping, backend=self.backend)


@dataclass(frozen=True)
class KVCacheSpec:
    """What every rank's cache shares, decided once on the driver: the same block ids (so the
    same `num_blocks` and `block_size`), the host pool, the storage `dtype`, the block-move
    `backend`, the test `fill`, whether 8-bit scales are calibrated and whether the CPU pools
    are made resident at allocation (`KVCache`'s `prefault`)."""

    num_blocks: int
    block_size: int
    num_host_blocks: int
    dtype: torch.dtype
    backend: str = "auto"
    fill: Optional[float] = None
    calculate_kv_scales: bool = True
    prefault: bool = False


def kv_cache_for(model: Any, spec: KVCacheSpec, device: torch.device | str) -> KVCache:
    """The cache of the KV heads `model` holds (`model.num_local_kv_heads`: this rank's, all of
    them in one process), with 8-bit scales (engine/kv_scales.py) over those heads: the model
    file's (`model.kv_scales_from_file`, already cut to the rank's heads) or calibrated."""
    config, heads = model.config, model.num_local_kv_heads
    scales = make_kv_scales(spec.dtype, config.num_hidden_layers, heads, device,
                            model.kv_scales_from_file, spec.calculate_kv_scales)
    return KVCache(config.num_hidden_layers, heads, config.head_dim, spec.num_blocks,
                   spec.block_size, spec.dtype, device, spec.num_host_blocks, spec.backend,
                   spec.fill, scales, spec.prefault)
