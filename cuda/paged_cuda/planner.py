"""The one planner of the CUDA kernels (FlashInfer-style plan, then run).

`plan_attention` decides everything about a paged_attention launch (kernel, template arguments,
grid, threads, dynamic shared memory, split-K partitions and so the workspace) from host-side
shapes only, never from tensor contents, so it needs no device synchronisation and is CUDA-graph
safe. The plan travels inside the params struct (launch.py packs it); the C++ launchers and
`jit.JitModule` only dispatch on it. The environment can force some choices (settings.py).

Kernels by batch kind and dtype: decode runs `pk_decode_mma_kernel` for 16-bit types and the
SIMT `pk_decode_kernel` for float32; varlen runs `pk_varlen_mma_async_kernel` for 16-bit types
and the SIMT `pk_varlen_simt_kernel` for float32. An 8-bit cache runs the SIMT kernels (their
`PkKv8` instantiations) whatever the query's dtype.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cuda.paged_cuda import settings
from cuda.paged_cuda.params import (KERNEL_DECODE, KERNEL_DECODE_MMA, KERNEL_VARLEN_MMA,
                                    KERNEL_VARLEN_SIMT)
from paged_kernels.abi import AttentionProblem

THREADS = 128  # 4 warps; plan.threads differs for the 2-warp decode / 8-warp varlen kernels
DECODE_WARPS = 4
#: Rows per block (PK_VARLEN_SIMT_ROWS) and keys per K/V tile (PK_VARLEN_SIMT_BN) of the SIMT
#: varlen kernel.
SIMT_ROWS, SIMT_BN = 16, 32
#: Ring slots of the 16-bit varlen kernel (fixed; the plan's `stages` for that kernel).
VARLEN_STAGES = 2
GROUP_TILES = (1, 2, 4, 8)
#: Partition sizes (keys per split-K block) of the decode kernel.
MIN_PARTITION, MAX_PARTITION, DEFAULT_PARTITION = 64, 2048, 1024  # 1024: best measured on H200
MAX_SPLITS = 64
#: PK_DECODE_MMA_ROWS; the partition granularity of the mma decode kernel (its largest tile).
MMA_DECODE_ROWS, MMA_DECODE_BN = 16, 64
MMA_DECODE_STAGES = (2, 3, 4)  # PK_DECODE_MMA_MAX_STAGES is the last
#: Dynamic shared memory one block may have on every supported GPU (sm_80: 163 KiB).
MAX_SMEM = 163 * 1024
#: Shared memory of one SM of an H100/H200 and what the driver reserves per block: only used to
#: estimate how many mma decode blocks one wave of the device holds.
SMEM_PER_SM, SMEM_PER_BLOCK_RESERVED = 228 * 1024, 1024
#: A decode block's fixed cost (queries, block ids, filling the pipeline, the merge), in keys:
#: fitted to the H200 partition sweep of the mma kernel (52 keys at 32 x 4096, about 110 at
#: 32 x 1024, where blocks are short; bench/results/2026-11-30-h200-decode-tuning).
MMA_BLOCK_OVERHEAD_KEYS = 96


@dataclass(frozen=True)
class AttentionPlan:
    """Everything about one paged_attention launch that is decided on the host."""

    kernel: int
    group_tile: int        # decode: query heads per block (template argument)
    heads_per_cta: int     # varlen: query heads per block
    num_head_chunks: int   # blocks per KV head along the GQA group
    q_tile_tokens: int     # varlen: query tokens per block
    num_splits: int        # decode: split-K partitions (1 = no reduce kernel)
    partition_size: int    # decode: keys per partition
    grid: tuple[int, int, int]
    smem_bytes: int
    reduce_grid: tuple[int, int]
    stages: int = 0        # mma decode: depth of the K/V ring; 16-bit varlen: VARLEN_STAGES
    threads: int = THREADS  # mma decode: 32 per warp, 16 keys of its tile per warp
    warp_sync: int = 0     # mma decode: 1 = each warp copies and waits for its own keys
    l2_prefetch: int = 0   # mma decode: 1 = K/V rows asked into L2 an iteration ahead


def plan_attention(p: AttentionProblem, num_sms: int) -> AttentionPlan:
    """The launch plan for `p` on a device with `num_sms` multiprocessors (memoised on the
    shapes it depends on: planning runs once per step shape, not once per layer)."""
    key = (p.is_decode, p.num_queries_per_kv, p.query.dtype, p.key_cache.dtype, p.head_size,
           p.num_seqs,
           p.num_kv_heads, p.num_heads, p.num_tokens, p.block_tables.shape[1], p.block_size,
           p.sliding_window, num_sms,
           *(os.environ.get(name) for name in settings.PLAN_ENVS))
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) > 4096:
            _plans.clear()
        plan = _plans[key] = _plan(p, num_sms)
    return plan


_plans: dict[tuple, AttentionPlan] = {}


def _plan(p: AttentionProblem, num_sms: int) -> AttentionPlan:
    if not p.is_decode:
        return _plan_varlen(p)
    if _runs_mma(p):  # tensor cores; float32 and 8-bit caches run SIMT
        return _plan_decode_mma(p, num_sms)
    return _plan_decode_simt(p, num_sms)


def _runs_mma(p: AttentionProblem) -> bool:
    """True for the tensor-core kernels: a 16-bit query over a cache of its own dtype."""
    return p.query.dtype != torch.float32 and p.key_cache.dtype == p.query.dtype


# ---------------------------------------------------------------------------------------------
# Decode.

def mma_decode_min_blocks(head_size: int, warps: int = 4) -> int:
    """Blocks per SM the mma decode kernel's registers allow (pk_decode_mma_min_blocks)."""
    base = 4 if head_size <= 64 else 3 if head_size <= 128 else 2 if head_size <= 192 else 1
    return base * 4 // warps


def _decode_capacity(p: AttentionProblem) -> int:
    """An upper bound on every sequence's visible range, known without reading seq_lens."""
    capacity = p.block_tables.shape[1] * p.block_size
    return capacity if p.sliding_window is None else min(capacity, p.sliding_window)


def _decode_partition(p: AttentionProblem, ctas: int, num_sms: int) -> tuple[int, int]:
    """(partition_size, num_splits) of the SIMT decode kernel from the table capacity: enough
    blocks to fill the device, bounded workspace."""
    capacity = _decode_capacity(p)
    size = settings.forced_partition()
    if size is None:
        size = DEFAULT_PARTITION
        while size > MIN_PARTITION and ctas * math.ceil(capacity / size) < 4 * num_sms:
            size //= 2
        size = max(size, min(MAX_PARTITION, 64 * math.ceil(capacity / (64 * MAX_SPLITS))))
    return size, max(1, math.ceil(capacity / size))


def _waves_partition(p: AttentionProblem, ctas: int, slots: int) -> tuple[int, int]:
    """(partition_size, num_splits) of the mma decode kernel: the split of the table capacity
    into whole 64-key tiles (64 to MAX_PARTITION keys, at most MAX_SPLITS) that minimises
    waves x (keys per block + a block's fixed cost), where a wave is `slots` blocks running at
    once. So the last wave is not left mostly empty (at 32 x 4096 on 132 SMs with 3 blocks each:
    3 splits of 1408 keys in 2 full waves, not 4 of 1024 in 2.6)."""
    capacity = _decode_capacity(p)
    forced = settings.forced_partition()
    if forced is not None:
        return forced, max(1, math.ceil(capacity / forced))
    best: tuple[int, int, int] | None = None
    for want in range(1, MAX_SPLITS + 1):
        size = MMA_DECODE_BN * math.ceil(capacity / (MMA_DECODE_BN * want))
        if size > MAX_PARTITION:
            continue
        if size < MIN_PARTITION and best is not None:
            break
        splits = math.ceil(capacity / size)
        cost = math.ceil(ctas * splits / slots) * (size + MMA_BLOCK_OVERHEAD_KEYS)
        if best is None or cost < best[0]:
            best = (cost, size, splits)
    if best is None:  # only with a capacity above MAX_SPLITS * MAX_PARTITION keys
        return MAX_PARTITION, math.ceil(capacity / MAX_PARTITION)
    return best[1], best[2]


def _pow2_at_least(n: int, choices: Sequence[int]) -> int:
    return next(c for c in choices if c >= n)


def _mma_decode_smem(p: AttentionProblem, stages: int, tile: int = MMA_DECODE_BN) -> int:
    """The K and V rings, the rings' row offsets (two int64 per row) and, above head size 128,
    the Q tile (up to 128 it lives in the K ring's last slot)."""
    pitch = p.head_size + 8
    q_rows = MMA_DECODE_ROWS if p.head_size > 128 else 0
    return p.query.element_size() * (q_rows + 2 * stages * tile) * pitch + 16 * stages * tile


def _plan_decode_mma(p: AttentionProblem, num_sms: int) -> AttentionPlan:
    rows = min(p.num_queries_per_kv, MMA_DECODE_ROWS)
    chunks = math.ceil(p.num_queries_per_kv / MMA_DECODE_ROWS)
    tile = settings.mma_decode_tile()
    stages = settings.mma_decode_stages()
    while stages > MMA_DECODE_STAGES[0] and _mma_decode_smem(p, stages, tile) > MAX_SMEM:
        stages -= 1  # a forced depth that does not fit
    smem = _mma_decode_smem(p, stages, tile)
    per_sm = SMEM_PER_SM // (smem + SMEM_PER_BLOCK_RESERVED)
    blocks = max(1, min(mma_decode_min_blocks(p.head_size, tile // 16), per_sm))
    ctas = p.num_seqs * p.num_kv_heads * chunks
    size, splits = _waves_partition(p, ctas, blocks * num_sms)
    return AttentionPlan(KERNEL_DECODE_MMA, MMA_DECODE_ROWS, rows, chunks, 1, splits, size,
                         (p.num_kv_heads * chunks, p.num_seqs, splits), smem,
                         (p.num_heads, p.num_seqs), stages, threads=2 * tile,
                         warp_sync=int(settings.mma_decode_warp_sync()),
                         l2_prefetch=int(settings.mma_decode_l2_prefetch()))


def _plan_decode_simt(p: AttentionProblem, num_sms: int) -> AttentionPlan:
    group = p.num_queries_per_kv
    tile = _pow2_at_least(min(group, GROUP_TILES[-1]), GROUP_TILES)
    chunks = math.ceil(group / tile)
    size, splits = _decode_partition(p, p.num_seqs * p.num_kv_heads * chunks, num_sms)
    smem = 4 * (max(size * tile, DECODE_WARPS * tile * p.head_size) + size // p.block_size + 2)
    return AttentionPlan(KERNEL_DECODE, tile, tile, chunks, 1, splits, size,
                         (p.num_kv_heads * chunks, p.num_seqs, splits), smem,
                         (p.num_heads, p.num_seqs))


# ---------------------------------------------------------------------------------------------
# Varlen.

def varlen_async_bn(head_size: int) -> int:
    """Keys per K/V tile of the 16-bit varlen kernel (pk_varlen_async_bn)."""
    return 64 if head_size <= 128 else 32


def _varlen_async_smem(p: AttentionProblem, warps: int) -> int:
    """The K/V ring of the 16-bit varlen kernel and, above head size 128, its Q tile (16 rows
    per warp; up to 128 Q lives in the ring's slot 1)."""
    d, bn = p.head_size, varlen_async_bn(p.head_size)
    q_rows = 16 * warps if d > 128 else 0
    return p.query.element_size() * (4 * bn + q_rows) * (d + 8)


def _plan_varlen(p: AttentionProblem) -> AttentionPlan:
    group, d = p.num_queries_per_kv, p.head_size
    mma = _runs_mma(p)
    warps = settings.varlen_warps() if mma else THREADS // 32
    rows = 16 * warps if mma else SIMT_ROWS
    hc = min(group, rows)
    chunks = math.ceil(group / hc)
    bq = rows // hc
    if mma:
        smem = _varlen_async_smem(p, warps)
    else:
        smem = 4 * (SIMT_ROWS * d + SIMT_BN * (d + 1) + SIMT_BN * d)
    return AttentionPlan(KERNEL_VARLEN_MMA if mma else KERNEL_VARLEN_SIMT, 1, hc, chunks, bq, 1,
                         0, (p.num_tokens // bq + p.num_seqs, p.num_kv_heads * chunks, 1), smem,
                         (0, 0), VARLEN_STAGES if mma else 0, threads=32 * warps)
