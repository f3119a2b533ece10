"""Memory for KV caches: `empty_cache` (uninitialised) and `zeros_cache`, cache tensors that, on a
Linux CPU, live in transparent huge pages.

A decode call reads each sequence's K/V one block and one KV head at a time: runs of
`block_size * head_size` elements (2 KiB at 16 x 64 in bfloat16, 1 KiB in 8 bits) scattered over
a pool larger than the TLB covers. In 4 KiB pages nearly every run is a TLB miss and a page walk
(a costly one in a virtual machine), the same count of them whatever the element width. In 2 MiB
pages the walks all but vanish. Where THP is `madvise` (the default of many kernels),
`torch.empty` never gets huge pages; `empty_cache` asks for them with `madvise(MADV_HUGEPAGE)`.
Measured on the cpu backend: docs/cpu.md.
"""

from __future__ import annotations

import math
import mmap
from typing import Optional, Sequence, Union

import torch


def empty_cache(shape: Sequence[int], dtype: torch.dtype,
                device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """An uninitialised contiguous tensor of `shape` and `dtype` for a KV cache (or a pool of
    them). On a CPU where the kernel offers `madvise(MADV_HUGEPAGE)`, its memory is an anonymous
    mapping advised to use transparent huge pages, zero-filled on first touch; elsewhere (other
    devices, THP disabled) it is `torch.empty`. The tensor keeps the mapping alive."""
    mapped = _huge_page_tensor(shape, dtype, torch.device(device))
    return torch.empty(tuple(shape), dtype=dtype, device=device) if mapped is None else mapped


def zeros_cache(shape: Sequence[int], dtype: torch.dtype,
                device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """`empty_cache` filled with zeros. The CPU mapping is zero already, so nothing is written:
    its pages become resident as blocks are written, not at allocation. Elsewhere `torch.zeros`."""
    mapped = _huge_page_tensor(shape, dtype, torch.device(device))
    return torch.zeros(tuple(shape), dtype=dtype, device=device) if mapped is None else mapped


def _huge_page_tensor(shape: Sequence[int], dtype: torch.dtype,
                      device: torch.device) -> Optional[torch.Tensor]:
    """A tensor over a fresh anonymous mapping advised `MADV_HUGEPAGE` (zero until written), or
    None where there is none to make: another device, no `MADV_HUGEPAGE`, zero bytes."""
    shape = tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE") or nbytes == 0:
        return None
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP disabled in this kernel: plain pages, same memory
        pass
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
