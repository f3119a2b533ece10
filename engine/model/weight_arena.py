"""Memory for a model's packed weights: one mapping in transparent huge pages, carved in load order.

A decode step of a few token rows streams every projection's packed weights from memory once, and
at one row the int8 and tiled kernels are close to bound by that stream. Allocated one by one
(`torch.empty`), each weight is its own run of 4 KiB pages: every page is a TLB miss and a page
walk (a costly one in a virtual machine), and the hardware prefetchers stop at each page's end.
A `WeightArena` hands out the weights' buffers back to back, in the order they are packed (the
order a step reads them), from mappings advised `MADV_HUGEPAGE` (`paged_kernels.empty_cache`,
the KV pool's memory): 2 MiB pages, so a 2-vCPU Zen 4 streams the same bytes with ~1/512 as many
walks. Measured: docs/quant.md. Elsewhere (no THP, other systems) the buffers are plain memory.

Only the bytes handed out become resident: the unused tail of a mapping is reserved address space,
never touched.
"""

from __future__ import annotations

import torch

from paged_kernels.cache_memory import empty_cache

__all__ = ["WeightArena", "HUGE_PAGE", "CHUNK_BYTES", "ALIGNMENT"]

#: The transparent huge page size of x86-64 and most arm64 kernels; each mapping's first buffer
#: starts on such a boundary, so that the weights fill whole huge pages from the first byte.
HUGE_PAGE = 2 << 20
#: Address space reserved per mapping (more when one buffer needs more): a 135M-parameter
#: model's packed weights (~100 MB) fit in one.
CHUNK_BYTES = 256 << 20
#: Every buffer starts on a cache line, as the kernels' tile-blocks require.
ALIGNMENT = 64


class WeightArena:
    """A bump allocator of uint8 CPU buffers over huge-page mappings. `take(n)` returns a fresh
    `n`-byte tensor whose first byte is `ALIGNMENT`-aligned, placed right after the previous one
    when it fits in the current mapping. A buffer keeps its mapping alive (tensor views), so the
    arena can be dropped once a model is loaded; a mapping is unmapped when its last buffer dies.
    Not thread-safe: one loader owns an arena."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes < ALIGNMENT:
            raise ValueError(f"chunk_bytes: expected at least {ALIGNMENT}, got {chunk_bytes}")
        self._chunk_bytes = chunk_bytes
        self._chunk = torch.empty(0, dtype=torch.uint8)
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A `nbytes`-byte uint8 tensor, uninitialised, 64-byte aligned, contiguous."""
        if nbytes < 0:
            raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
        start = self._used + (-(self._chunk.data_ptr() + self._used) % ALIGNMENT)
        if start + nbytes > self._chunk.numel():
            self._chunk = _huge_page_chunk(max(self._chunk_bytes, nbytes))
            start = 0
        self._used = start + nbytes
        return self._chunk[start:start + nbytes]


def _huge_page_chunk(nbytes: int) -> torch.Tensor:
    """A uint8 view of `nbytes` bytes that starts on a `HUGE_PAGE` boundary, inside a fresh
    mapping of `nbytes + HUGE_PAGE` bytes (the slack is never touched)."""
    mapping = empty_cache((nbytes + HUGE_PAGE,), torch.uint8)
    shift = -mapping.data_ptr() % HUGE_PAGE
    return mapping[shift:shift + nbytes]
