"""Registers the "cpu" backend: the C++/OpenMP kernels of csrc/paged_attention.cpp on CPU tensors.

Every dtype, head size, block size and feature of the ABI; strided caches and `out`; float caches
and the 8-bit ones (fp8 e4m3fn, fp8 e5m2, int8 with per-KV-head scales), read and written by the
C++ kernels (docs/cpu.md).
`always_check_contents` is False (the Python content checks run on request only), but the kernel
scans the lengths and the block-table entries it will read before any work (microseconds on the
CPU, no device to synchronise with) and, when they break the ABI's rules, this backend raises the
ABI's own ValueError: a bad block id can neither crash nor silently produce numbers.

A decode call (`cu_seqlens_q` None) first reads the K/V blocks each sequence will read into the
CPU's caches, in order (csrc/read_ahead.h), where the last-level cache is small (under
`READ_AHEAD_MAX_LLC`): there the K/V comes from memory, and one sequential sweep is faster than
the kernel's scattered loads (docs/cpu.md). With a larger last-level cache a decode step's K/V
stays cached from step to step and the sweep only costs time. `read_ahead` (this module's) is
the switch.

On the AVX-512 BF16 build, a work item with a bf16 query over a bf16 or 8-bit cache requests its
K/V lines `prefetch_lines` 64-byte lines ahead of its reads, a few at a time as it reads
(csrc/line_cursor.h): the loads of later blocks then overlap the arithmetic. `prefetch_lines`
(this module's, read at every call; 0 turns it off) is the distance. Such a call does not read
ahead: the paced requests overlap the loads with the arithmetic, the sweep runs them first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from paged_kernels.abi import (
    FEATURES,
    FLOAT_DTYPES,
    AttentionProblem,
    Support,
    check_attention_contents,
)
from paged_kernels.backends import (
    GENERIC_BLOCK_OPS,
    Backend,
    BackendUnavailable,
    NativeEntryPoints,
)
from paged_kernels.kv_quant import QUANTIZED_CACHE_DTYPES

SUPPORT = Support(
    dtypes=frozenset(FLOAT_DTYPES),
    device_types=frozenset({"cpu"}),
    features=frozenset(FEATURES),
    kv_cache_dtypes=frozenset(QUANTIZED_CACHE_DTYPES),
)

#: Query rows per work item in prefill/varlen (times the GQA group size = rows sharing each K/V
#: row read); decode always uses 1.
QUERY_TILE = 16
#: The largest last-level cache (bytes) at which decode calls read ahead by default: measured
#: faster with the read-ahead on 2-core Zen 3 and Zen 4 machines with 32 MiB of L3, slower on a
#: 2-core Xeon with 105 MiB (docs/cpu.md).
READ_AHEAD_MAX_LLC = 64 << 20
#: The paced prefetch's default distance in 64-byte lines (8 KiB). With its requests into L2
#: (prefetcht1), 96-384 lines were equally fast on cold decode calls on a Zen 4, and 128 halved
#: the batch-16 decode step's attention against 64 lines into L1 with the read-ahead
#: (bench/results/2026-12-04-prefetch-locality).
PREFETCH_LINES = 128
#: sysfs cache size suffixes.
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_cache_bytes(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")
                           ) -> Optional[int]:
    """The size of CPU 0's highest-level cache from sysfs, None when it cannot be read."""
    best: Optional[tuple[int, int]] = None
    for index in sorted(cache_dir.glob("index*")):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        num = int(size[:-1]) * _SIZE_UNITS[size[-1]] if size[-1:] in _SIZE_UNITS else int(size)
        if best is None or level > best[0]:
            best = (level, num)
    return None if best is None else best[1]


def default_read_ahead(llc: Optional[int]) -> bool:
    """Whether decode calls read ahead on a CPU with `llc` bytes of last-level cache (unknown:
    yes, the measured default of the small-cache machines)."""
    return llc is None or llc <= READ_AHEAD_MAX_LLC


#: Whether a decode call sweeps its K/V blocks into the CPU's caches before the attention (read at
#: every call).
read_ahead = default_read_ahead(last_level_cache_bytes())
#: How far ahead of its reads each work item requests its K/V, in 64-byte lines (0: no prefetch;
#: read at every call).
prefetch_lines = PREFETCH_LINES


class CpuBackend(Backend):
    """C++/OpenMP paged attention for CPU tensors, compiled at first use (docs/cpu.md).

    Runs on torch's thread count (`torch.set_num_threads`); the result does not depend on it."""

    name = "cpu"
    priority = 5
    always_check_contents = False
    block_ops = GENERIC_BLOCK_OPS

    def __init__(self) -> None:
        from cpu_impl import build
        try:
            self._ext = build.load()
        except build.BuildFailed as exc:
            raise BackendUnavailable(str(exc)) from exc

    @property
    def support(self) -> Support:
        return SUPPORT

    def paged_attention(self, problem: AttentionProblem) -> None:
        p = problem
        done = self._ext.paged_attention(
            p.query, p.key_cache, p.value_cache, p.block_tables.contiguous(),
            p.seq_lens.contiguous(),
            None if p.cu_seqlens_q is None else p.cu_seqlens_q.contiguous(),
            p.out, p.lse, p.alibi_slopes, p.scale,
            0 if p.sliding_window is None else p.sliding_window,
            0.0 if p.soft_cap is None else p.soft_cap,
            QUERY_TILE, torch.get_num_threads(), read_ahead, p.k_scale, p.v_scale,
            prefetch_lines)
        if not done:  # the kernel's content scan failed: raise the ABI's own message
            check_attention_contents(p)
            raise AssertionError("cpu kernel rejected contents that check_attention_contents "
                                 "accepts")

    def native_entry_points(self) -> NativeEntryPoints:
        """`paged_attention` and `write_kv` of the extension, typed as in
        csrc/entry_points.h, with the tuning values this module's calls pass now."""
        attention, write = self._ext.entry_points()
        return NativeEntryPoints("cpu_impl/csrc/entry_points.h", attention, write, QUERY_TILE,
                                 torch.get_num_threads(), read_ahead, prefetch_lines)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        # Slots are range-checked by the API on request (docs/abi.md); the kernel skips a slot
        # outside [0, num_blocks * block_size) either way, so an unchecked bad slot is harmless.
        # An 8-bit cache is written by the C++ kernel too: quantised element by element
        # (csrc/paged_attention.cpp's quantize), rows split over torch's threads.
        self._ext.write_kv(key, value, key_cache, value_cache, slot_mapping.contiguous(),
                           k_scale, v_scale, torch.get_num_threads())
