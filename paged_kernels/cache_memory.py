"""Memory for KV caches: `empty_cache` (uninitialised) and `zeros_cache`, cache tensors that, on a
Linux CPU, live in transparent huge pages; `prefault`, which makes a CPU tensor's pages resident.

A decode call reads each sequence's K/V one block and one KV head at a time: runs of
`block_size * head_size` elements (2 KiB at 16 x 64 in bfloat16, 1 KiB in 8 bits) scattered over
a pool larger than the TLB covers. In 4 KiB pages nearly every run is a TLB miss and a page walk
(a costly one in a virtual machine), the same count of them whatever the element width. In 2 MiB
pages the walks all but vanish. Where THP is `madvise` (the default of many kernels),
`torch.empty` never gets huge pages; `empty_cache` asks for them with `madvise(MADV_HUGEPAGE)`.
Measured on the cpu backend: docs/cpu.md.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from typing import Optional, Sequence, Union

import torch

#: Linux's `madvise` advice that faults a range in writable without writing it (5.14 and later).
MADV_POPULATE_WRITE = 23


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


def prefault(t: torch.Tensor) -> None:
    """Makes every page of the CPU tensor `t`'s storage resident and writable now, leaving its
    contents as they are, so that no later write pays a page's first-touch fault (on a virtual
    machine that is also the host's: 2-3 ms a MiB on the 2-vCPU development machines, where a
    `write_kv` into fresh pages took 14-24x as long as into resident ones,
    bench/results/2026-12-04-kv-prefault). Linux 5.14 and later: `madvise(MADV_POPULATE_WRITE)`,
    which writes nothing; elsewhere one byte of every page is read and written back. Nothing on
    other devices. Call it while no other thread writes the memory."""
    if t.device.type != "cpu":
        return
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        return
    page = mmap.PAGESIZE
    start = storage.data_ptr() // page * page
    length = storage.data_ptr() + nbytes - start
    if _madvise(start, length, MADV_POPULATE_WRITE):
        return
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    first = (page - storage.data_ptr() % page) % page  # the first byte at a page's start
    with torch.no_grad():
        raw[first::page].add_(0)
        raw[:1].add_(0)


def _madvise(start: int, length: int, advice: int) -> bool:
    """`madvise(start, length, advice) == 0` through the process's own libc (False where the
    process has no `madvise` symbol)."""
    madvise = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None)
    if madvise is None:
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) == 0
