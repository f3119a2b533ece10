"""The one Python adapter between the ABI and the CUDA launchers (pk_ops.h), and the one planner.

Both backends ("cuda" on the GPU, "cuda-host" on the CPU through the emulator) and the run-time
NVRTC path call these functions with an extension-like object `ext` that has
`paged_attention(params: bytes, stream: int)`, `write_kv(...)` and `copy_blocks(...)` (the
pybind11 module `_pk_cuda` / `_pk_cuda_host`, or `jit.JitModule`).

Planning (FlashInfer-style plan, then run): `plan_attention` decides everything about a launch
(kernel, template arguments, grid, threads, dynamic shared memory, split-K partitions and the
workspace) from host-side shapes only, never from tensor contents, so it needs no device
synchronisation and is CUDA-graph safe. The plan travels inside the params struct; the C++
launchers and `jit.JitModule` only dispatch on it.

The params structs are packed from the X-macro field lists of `cuda/csrc/pk_ops.h`, read from
that header at import, so the C++ and Python layouts come from one definition (`check_layout`
compares them with a built module).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from paged_kernels.abi import FEATURES, AttentionProblem, Support

CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"

#: Head sizes the kernels are compiled for (PK_HEAD_SIZES in pk_launch.cuh).
HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
#: The reduced set of builds with PK_REDUCED_HEAD_SIZES / PK_HOST_INSTANTIATIONS.
REDUCED_HEAD_SIZES = (64, 128)

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: C++ spelling of each dtype (template arguments of the JIT path).
CTYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}

KERNEL_DECODE, KERNEL_VARLEN_MMA, KERNEL_VARLEN_SIMT, KERNEL_DECODE_MMA = 0, 1, 2, 3
THREADS = 128  # 4 warps; plan.threads differs for the 2-warp decode / 8-warp varlen kernels
DECODE_WARPS = 4
VARLEN_BN = 32  # PK_VARLEN_BN (the synchronous varlen kernel)
MMA_ROWS, SIMT_ROWS = 64, 16  # PK_VARLEN_MMA_ROWS, PK_VARLEN_SIMT_ROWS
GROUP_TILES = (1, 2, 4, 8)
#: Partition sizes (keys per split-K block) of the decode kernel.
MIN_PARTITION, MAX_PARTITION, DEFAULT_PARTITION = 64, 2048, 1024  # 1024: best measured on H200
MAX_SPLITS = 64
#: Forces the decode partition size (a multiple of 16 >= 16), for tests of the split-K path.
PARTITION_ENV = "PAGED_KERNELS_CUDA_PARTITION"
#: PK_DECODE_MMA_ROWS; the partition granularity of the mma decode kernel (its largest tile).
MMA_DECODE_ROWS, MMA_DECODE_BN = 16, 64
#: Dynamic shared memory one block may have on every supported GPU (sm_80: 163 KiB).
MAX_SMEM = 163 * 1024
#: Shared memory of one SM of an H100/H200 and what the driver reserves per block: only used to
#: estimate how many mma decode blocks one wave of the device holds.
SMEM_PER_SM, SMEM_PER_BLOCK_RESERVED = 228 * 1024, 1024
#: A decode block's fixed cost (queries, block ids, filling the pipeline, the merge), in keys:
#: fitted to the H200 partition sweep of the mma kernel (52 keys at 32 x 4096, about 110 at
#: 32 x 1024, where blocks are short; bench/results/2026-11-30-h200-decode-tuning).
MMA_BLOCK_OVERHEAD_KEYS = 96
#: Forces the depth of the mma decode kernel's K/V ring (2 to 4 tiles; fewer where MAX_SMEM
#: would be exceeded), for timing runs. The settings' values and defaults: SETTINGS below.
STAGES_ENV = "PAGED_KERNELS_CUDA_DECODE_STAGES"
MMA_DECODE_STAGES = (2, 3, 4)  # PK_DECODE_MMA_MAX_STAGES is the last
#: Forces the mma decode kernel's tile: 64 keys (4 warps, the default) or 32 (2 warps, half the
#: shared memory, so twice the blocks per SM), for timing runs.
DECODE_TILE_ENV = "PAGED_KERNELS_CUDA_DECODE_TILE"
#: Chooses the 16-bit varlen kernel: 2 = K/V through a cp.async ring of 2 tiles (the default),
#: 1 = the synchronous kernel it replaced (kept to compare on a GPU).
VARLEN_STAGES_ENV = "PAGED_KERNELS_CUDA_VARLEN_STAGES"
#: Warps of the cp.async varlen kernel: 4 (64 query rows per block, the default) or 8 (128 rows:
#: each K/V tile serves twice the rows), for timing runs.
VARLEN_WARPS_ENV = "PAGED_KERNELS_CUDA_VARLEN_WARPS"
#: How the mma decode kernel's warps wait for a K/V tile: "block" (the block copies each tile
#: together and meets at __syncthreads, the default) or "warp" (each warp copies and waits for
#: its own 16 keys alone: no block barrier in the key loop), for timing runs.
DECODE_SYNC_ENV = "PAGED_KERNELS_CUDA_DECODE_SYNC"
#: "1": the mma decode kernel asks each K/V row into L2 an iteration before it copies it (about
#: one more tile in flight per block, no shared memory); "0" (the default): no prefetch.
DECODE_PREFETCH_ENV = "PAGED_KERNELS_CUDA_DECODE_PREFETCH"
#: Every environment variable the planner reads (timing runs set them per variant).
PLAN_ENVS = (PARTITION_ENV, STAGES_ENV, DECODE_TILE_ENV, DECODE_SYNC_ENV, DECODE_PREFETCH_ENV,
             VARLEN_STAGES_ENV, VARLEN_WARPS_ENV)


@dataclass(frozen=True)
class PlanSetting:
    """A choice of the planner that the environment can force: the environment variable, its
    accepted values (as written there) and the default."""

    env: str
    values: tuple[str, ...]
    default: str


#: The planner's settings and their defaults: the one place a default changes when a GPU run's
#: verdict says so (bench/tune_verdict.py names the variant; its settings are these names).
#: Measured so far (docs/cuda.md): 2 stages (3 blocks per SM at head size 128) beat 3 and 4;
#: the 32-key tile, warp synchronisation, the L2 prefetch and 8 varlen warps are not yet timed.
SETTINGS: dict[str, PlanSetting] = {s.env: s for s in (
    PlanSetting(STAGES_ENV, ("2", "3", "4"), "2"),
    PlanSetting(DECODE_TILE_ENV, ("64", "32"), "64"),
    PlanSetting(DECODE_SYNC_ENV, ("block", "warp"), "block"),
    PlanSetting(DECODE_PREFETCH_ENV, ("0", "1"), "0"),
    PlanSetting(VARLEN_STAGES_ENV, ("1", "2"), "2"),
    PlanSetting(VARLEN_WARPS_ENV, ("4", "8"), "4"),
)}


def setting(name: str, env: Mapping[str, str] = os.environ) -> str:
    """Planner setting `name`: the environment's value when set (checked), else its default."""
    s = SETTINGS[name]
    value = env.get(name) or s.default
    if value not in s.values:
        shown = [v if v.isdigit() else repr(v) for v in s.values]
        raise ValueError(f"{name}: expected {', '.join(shown[:-1])} or {shown[-1]}, got "
                         f"{value!r}")
    return value


def mma_decode_stages(head_size: int, env: Mapping[str, str] = os.environ) -> int:
    """Depth of the mma decode kernel's K/V ring (`$PAGED_KERNELS_CUDA_DECODE_STAGES`): 2 by
    default (measured on an H200 at head size 128: 2 stages, 3 blocks per SM, gave 83 % of copy
    bandwidth; 3 stages, 2 blocks, 66 %; 4 stages, 1 block, 39 %)."""
    return int(setting(STAGES_ENV, env))


def mma_decode_tile(env: Mapping[str, str] = os.environ) -> int:
    """Keys per tile of the mma decode kernel, 16 per warp (`$PAGED_KERNELS_CUDA_DECODE_TILE`)."""
    return int(setting(DECODE_TILE_ENV, env))


def mma_decode_warp_sync(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the mma decode kernel's warps wait for their own keys alone (pk_decode_mma.cuh,
    "Synchronisation"; `$PAGED_KERNELS_CUDA_DECODE_SYNC`)."""
    return setting(DECODE_SYNC_ENV, env) == "warp"


def mma_decode_l2_prefetch(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the mma decode kernel prefetches each K/V row into L2 an iteration ahead
    (`$PAGED_KERNELS_CUDA_DECODE_PREFETCH`)."""
    return setting(DECODE_PREFETCH_ENV, env) == "1"


def mma_decode_min_blocks(head_size: int, warps: int = 4) -> int:
    """Blocks per SM the mma decode kernel's registers allow (pk_decode_mma_min_blocks)."""
    base = 4 if head_size <= 64 else 3 if head_size <= 128 else 2 if head_size <= 192 else 1
    return base * 4 // warps


def varlen_stages(env: Mapping[str, str] = os.environ) -> int:
    """The 16-bit varlen kernel (`$PAGED_KERNELS_CUDA_VARLEN_STAGES`): 2, the cp.async ring, or
    1, the synchronous kernel it replaced."""
    return int(setting(VARLEN_STAGES_ENV, env))


def varlen_warps(env: Mapping[str, str] = os.environ) -> int:
    """Warps of the cp.async varlen kernel (`$PAGED_KERNELS_CUDA_VARLEN_WARPS`; the synchronous
    kernel always runs 4)."""
    return int(setting(VARLEN_WARPS_ENV, env))


def varlen_async_bn(head_size: int) -> int:
    """Keys per K/V tile of the cp.async varlen kernel (pk_varlen_async_bn)."""
    return 64 if head_size <= 128 else 32


def check_plan_env(settings: Mapping[str, str]) -> None:
    """Raises ValueError if `settings` has a PAGED_KERNELS_CUDA_* name the planner does not read
    or a value it would refuse (so a timing run fails before it times a misspelt variant)."""
    for name in settings:
        if name.startswith("PAGED_KERNELS_CUDA_") and name not in PLAN_ENVS:
            raise ValueError(f"{name}: not a setting of the CUDA planner; expected one of "
                             f"{PLAN_ENVS}")
    for name in SETTINGS:
        setting(name, settings)
    _forced_partition(settings)



def support(device_types: Sequence[str], head_sizes: Sequence[int] = HEAD_SIZES) -> Support:
    """What the CUDA kernels support, on the given device types."""
    return Support(
        dtypes=frozenset(DTYPE_CODES),
        device_types=frozenset(device_types),
        features=frozenset(FEATURES),
        head_sizes=frozenset(head_sizes),
        reasons=(("head_sizes", ("kernels are instantiated per head size (a multiple of 16 "
                                 "for the tensor-core path); see PK_HEAD_SIZES in "
                                 "cuda/csrc/pk_launch.cuh")),),
    )


# ---------------------------------------------------------------------------------------------
# Params structs, packed from pk_ops.h's field lists.

_KIND_FORMAT = {"p": "Q", "i": "q", "f": "d"}
_STRUCT_MACROS = {"attn": "PK_ATTN_FIELDS", "write_kv": "PK_WRITE_KV_FIELDS",
                  "copy": "PK_COPY_FIELDS"}


def _read_fields(macro: str) -> tuple[tuple[str, str], ...]:
    text = (CSRC_DIR / "pk_ops.h").read_text()
    m = re.search(rf"#define {macro}\(P, I, F\)(.*?)(?:\n\n|\n#define|\nstruct)", text, re.DOTALL)
    if m is None:
        raise RuntimeError(f"cannot find {macro} in {CSRC_DIR / 'pk_ops.h'}")
    return tuple((name, kind.lower()) for kind, name in re.findall(r"\b([PIF])\((\w+)\)",
                                                                      m.group(1)))


FIELDS: dict[str, tuple[tuple[str, str], ...]] = {k: _read_fields(v)
                                                  for k, v in _STRUCT_MACROS.items()}


_STRUCTS = {name: struct.Struct("<" + "".join(_KIND_FORMAT[k] for _, k in fields))
            for name, fields in FIELDS.items()}
_NAMES = {name: tuple(n for n, _ in fields) for name, fields in FIELDS.items()}


def pack(struct_name: str, values: dict[str, Any]) -> bytes:
    """Packs `values` (every field of the struct, by name; pointers as ints, 0 for none) in
    field order. A missing field raises KeyError."""
    return _STRUCTS[struct_name].pack(*[values[n] for n in _NAMES[struct_name]])


def unpack(struct_name: str, packed: bytes) -> dict[str, Any]:
    """The inverse of `pack` (used by the JIT launcher)."""
    return dict(zip(_NAMES[struct_name], _STRUCTS[struct_name].unpack(packed)))


def check_layout(ext: Any) -> None:
    """Raises RuntimeError if a built module's structs differ from pk_ops.h as read here."""
    for name, fields in FIELDS.items():
        built = tuple((n, k) for n, k in ext.fields(name))
        if built != fields or ext.struct_size(name) != 8 * len(fields):
            raise RuntimeError(f"params struct {name!r}: the built module's layout differs from "
                               f"{CSRC_DIR / 'pk_ops.h'} (rebuild the extension)")


class Extension(Protocol):
    """What ops needs from a module of launchers (pybind11 module or jit.JitModule)."""

    def paged_attention(self, params: bytes, stream: int) -> None: ...
    def write_kv(self, params: bytes, stream: int) -> None: ...
    def copy_blocks(self, params: bytes, stream: int) -> None: ...


# ---------------------------------------------------------------------------------------------
# Attention plan.

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
    stages: int = 0        # mma decode: depth of the K/V ring; 16-bit varlen: 2 ring, 1 sync
    threads: int = THREADS  # mma decode: 32 per warp, 16 keys of its tile per warp
    warp_sync: int = 0     # mma decode: 1 = each warp copies and waits for its own keys
    l2_prefetch: int = 0   # mma decode: 1 = K/V rows asked into L2 an iteration ahead


def _decode_capacity(p: AttentionProblem) -> int:
    """An upper bound on every sequence's visible range, known without reading seq_lens."""
    capacity = p.block_tables.shape[1] * p.block_size
    return capacity if p.sliding_window is None else min(capacity, p.sliding_window)


def _forced_partition(env: Mapping[str, str] = os.environ) -> int | None:
    forced = env.get(PARTITION_ENV)
    if not forced:
        return None
    if not forced.isdigit() or int(forced) < 16 or int(forced) % 16:
        raise ValueError(f"{PARTITION_ENV}: expected a multiple of 16 >= 16, got {forced!r}")
    return int(forced)


def _decode_partition(p: AttentionProblem, ctas: int, num_sms: int) -> tuple[int, int]:
    """(partition_size, num_splits) of the SIMT decode kernel from the table capacity: enough
    blocks to fill the device, bounded workspace."""
    capacity = _decode_capacity(p)
    size = _forced_partition()
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
    forced = _forced_partition()
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


def plan_attention(p: AttentionProblem, num_sms: int) -> AttentionPlan:
    """The launch plan for `p` on a device with `num_sms` multiprocessors (memoised on the
    shapes it depends on: planning runs once per step shape, not once per layer)."""
    key = (p.is_decode, p.num_queries_per_kv, p.query.dtype, p.head_size, p.num_seqs,
           p.num_kv_heads, p.num_heads, p.num_tokens, p.block_tables.shape[1], p.block_size,
           p.sliding_window, num_sms,
           *(os.environ.get(name) for name in PLAN_ENVS))
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) > 4096:
            _plans.clear()
        plan = _plans[key] = _plan(p, num_sms)
    return plan


_plans: dict[tuple, AttentionPlan] = {}


def _mma_decode_smem(p: AttentionProblem, stages: int, tile: int = MMA_DECODE_BN) -> int:
    """The K and V rings, the rings' row offsets (two int64 per row) and, above head size 128,
    the Q tile (up to 128 it lives in the K ring's last slot)."""
    pitch = p.head_size + 8
    q_rows = MMA_DECODE_ROWS if p.head_size > 128 else 0
    return p.query.element_size() * (q_rows + 2 * stages * tile) * pitch + 16 * stages * tile


def _plan_decode_mma(p: AttentionProblem, num_sms: int) -> AttentionPlan:
    rows = min(p.num_queries_per_kv, MMA_DECODE_ROWS)
    chunks = math.ceil(p.num_queries_per_kv / MMA_DECODE_ROWS)
    tile = mma_decode_tile()
    stages = mma_decode_stages(p.head_size)
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
                         warp_sync=int(mma_decode_warp_sync()),
                         l2_prefetch=int(mma_decode_l2_prefetch()))


def _varlen_async_smem(p: AttentionProblem, warps: int) -> int:
    """The K/V ring of the cp.async varlen kernel and, above head size 128, its Q tile (16 rows
    per warp; up to 128 Q lives in the ring's slot 1)."""
    d, bn = p.head_size, varlen_async_bn(p.head_size)
    q_rows = 16 * warps if d > 128 else 0
    return p.query.element_size() * (4 * bn + q_rows) * (d + 8)


def _plan(p: AttentionProblem, num_sms: int) -> AttentionPlan:
    group = p.num_queries_per_kv
    if p.is_decode and p.query.dtype != torch.float32:  # tensor cores; float32 runs SIMT
        return _plan_decode_mma(p, num_sms)
    if p.is_decode:
        tile = _pow2_at_least(min(group, GROUP_TILES[-1]), GROUP_TILES)
        chunks = math.ceil(group / tile)
        size, splits = _decode_partition(p, p.num_seqs * p.num_kv_heads * chunks, num_sms)
        smem = 4 * (max(size * tile, DECODE_WARPS * tile * p.head_size)
                    + size // p.block_size + 2)
        return AttentionPlan(KERNEL_DECODE, tile, tile, chunks, 1, splits, size,
                             (p.num_kv_heads * chunks, p.num_seqs, splits), smem,
                             (p.num_heads, p.num_seqs))
    mma = p.query.dtype != torch.float32
    stages = varlen_stages() if mma else 0
    warps = varlen_warps() if stages == 2 else THREADS // 32
    rows = 16 * warps if mma else SIMT_ROWS
    hc = min(group, rows)
    chunks = math.ceil(group / hc)
    bq = rows // hc
    d = p.head_size
    if stages == 2:
        smem = _varlen_async_smem(p, warps)
    elif mma:
        smem = p.query.element_size() * ((MMA_ROWS + VARLEN_BN) * (d + 8) + d * (VARLEN_BN + 8))
    else:
        smem = 4 * (SIMT_ROWS * d + VARLEN_BN * (d + 1) + VARLEN_BN * d)
    return AttentionPlan(KERNEL_VARLEN_MMA if mma else KERNEL_VARLEN_SIMT, 1, hc, chunks, bq, 1,
                         0, (p.num_tokens // bq + p.num_seqs, p.num_kv_heads * chunks, 1), smem,
                         (0, 0), stages, threads=32 * warps)


_CTYPE_OF_CODE = {code: CTYPES[dtype] for dtype, code in DTYPE_CODES.items()}


def attention_launches(v: dict[str, Any]) -> list[tuple[str, tuple[int, int, int], int, int]]:
    """The launches the plan inside unpacked attention params `v` makes, in order: (template
    instantiation, grid, threads, dynamic shared memory). This is what pk_launch.cuh dispatches
    to; the JIT path launches exactly these."""
    t, d = _CTYPE_OF_CODE[v["dtype"]], v["head_size"]
    grid = (v["grid_x"], v["grid_y"], v["grid_z"])
    if v["kernel"] in (KERNEL_DECODE, KERNEL_DECODE_MMA):
        name = (f"pk_decode_kernel<{t}, {d}, {v['group_tile']}>" if v["kernel"] == KERNEL_DECODE
                else f"pk_decode_mma_kernel<{t}, {d}, {v['threads'] // 32}>")
        launches = [(name, grid, v["threads"], v["smem_bytes"])]
        if v["num_splits"] > 1:
            launches.append((f"pk_decode_reduce_kernel<{t}>",
                             (v["reduce_grid_x"], v["reduce_grid_y"], 1), v["reduce_threads"], 0))
        return launches
    if v["kernel"] == KERNEL_VARLEN_MMA and v["stages"] == 2:
        name = f"pk_varlen_mma_async_kernel<{t}, {d}, {v['threads'] // 32}>"
    else:
        name = f"pk_varlen_{'mma' if v['kernel'] == KERNEL_VARLEN_MMA else 'simt'}_kernel<{t}, {d}>"
    return [(name, grid, v["threads"], v["smem_bytes"])]


# ---------------------------------------------------------------------------------------------
# Alignment: every row the kernels load with 16-byte vectors must start 16-byte aligned.

def _rows_aligned(t: torch.Tensor, row_dims: Sequence[int]) -> bool:
    if t.data_ptr() % 16:
        return False
    es, strides, shape = t.element_size(), t.stride(), t.shape
    for d in row_dims:
        if shape[d] > 1 and (strides[d] * es) % 16:
            return False
    return True


_warned_copy = False


def _aligned_cache(cache: torch.Tensor) -> torch.Tensor:
    """`cache` itself when its rows are 16-byte aligned, else a contiguous copy (slow; warned)."""
    global _warned_copy
    if _rows_aligned(cache, (0, 1, 2)):
        return cache
    if not _warned_copy:
        import warnings
        warnings.warn("paged_kernels cuda: a KV cache's strides are not multiples of 16 bytes; "
                      "copying it to a contiguous tensor for each call (slow)", stacklevel=3)
        _warned_copy = True
    return cache.contiguous()


def _attn_values(p: AttentionProblem, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, part: tuple[torch.Tensor, ...] | None
                 ) -> dict[str, Any]:
    def ptr(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    part_out, part_m, part_l = part if part is not None else (None, None, None)
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    return {
        "q": q.data_ptr(), "k_cache": k.data_ptr(), "v_cache": v.data_ptr(),
        "block_tables": p.block_tables.data_ptr(), "seq_lens": p.seq_lens.data_ptr(),
        "cu_seqlens_q": ptr(p.cu_seqlens_q), "alibi_slopes": ptr(p.alibi_slopes),
        "out": out.data_ptr(), "lse": ptr(p.lse), "part_out": ptr(part_out), "part_m": ptr(part_m),
        "part_l": ptr(part_l),
        "q_stride_token": qs[0], "q_stride_head": qs[1],
        "k_stride_block": ks[0], "k_stride_head": ks[1], "k_stride_slot": ks[2],
        "v_stride_block": vs[0], "v_stride_head": vs[1], "v_stride_slot": vs[2],
        "o_stride_token": os_[0], "o_stride_head": os_[1], "bt_stride": p.block_tables.stride(0),
        "num_seqs": p.num_seqs, "num_tokens": p.num_tokens, "num_heads": p.num_heads,
        "num_kv_heads": p.num_kv_heads, "head_size": p.head_size, "block_size": p.block_size,
        "group": p.num_queries_per_kv, "heads_per_cta": plan.heads_per_cta,
        "num_head_chunks": plan.num_head_chunks, "num_splits": plan.num_splits,
        "partition_size": plan.partition_size, "sliding_window": p.sliding_window or 0,
        "dtype": DTYPE_CODES[p.query.dtype], "kernel": plan.kernel, "group_tile": plan.group_tile,
        "q_tile_tokens": plan.q_tile_tokens, "stages": plan.stages, "warp_sync": plan.warp_sync,
        "l2_prefetch": plan.l2_prefetch,
        "grid_x": plan.grid[0], "grid_y": plan.grid[1],
        "grid_z": plan.grid[2], "threads": plan.threads, "smem_bytes": plan.smem_bytes,
        "reduce_grid_x": plan.reduce_grid[0], "reduce_grid_y": plan.reduce_grid[1],
        "reduce_threads": THREADS, "scale": p.scale, "soft_cap": float(p.soft_cap or 0.0),
    }


def paged_attention(ext: Extension, p: AttentionProblem, stream: int, num_sms: int) -> None:
    """Runs `p` through `ext`: writes p.out (and p.lse). Raises RuntimeError on a launch error."""
    p = _contiguous_small_tensors(p)
    plan = plan_attention(p, num_sms)
    q = p.query if _rows_aligned(p.query, (0, 1)) else p.query.contiguous()
    k, v = _aligned_cache(p.key_cache), _aligned_cache(p.value_cache)
    out = p.out if _rows_aligned(p.out, (0, 1)) else torch.empty_like(q)
    part = None
    if plan.num_splits > 1:
        shape = (p.num_tokens, p.num_heads, plan.num_splits)
        dev = q.device
        part = (torch.empty(*shape, p.head_size, dtype=torch.float32, device=dev),
                torch.empty(shape, dtype=torch.float32, device=dev),
                torch.empty(shape, dtype=torch.float32, device=dev))
    values = _attn_values(p, plan, q, k, v, out, part)
    ext.paged_attention(pack("attn", values), stream)
    if out is not p.out:
        p.out.copy_(out)


def _contiguous_small_tensors(p: AttentionProblem) -> AttentionProblem:
    """`p` with block_tables rows, seq_lens, cu_seqlens_q and alibi_slopes contiguous (the
    kernels index them densely; they are small, so a copy when needed is cheap)."""
    changes = {}
    if p.block_tables.stride(1) != 1:
        changes["block_tables"] = p.block_tables.contiguous()
    for name in ("seq_lens", "cu_seqlens_q", "alibi_slopes"):
        t = getattr(p, name)
        if t is not None and not t.is_contiguous():
            changes[name] = t.contiguous()
    return dataclasses.replace(p, **changes) if changes else p


# ---------------------------------------------------------------------------------------------
# Cache operations (byte-level; the unit is the widest alignment every address allows).

def _unit_bytes(addresses: Sequence[int]) -> int:
    return next(u for u in (16, 8, 4, 2, 1) if all(a % u == 0 for a in addresses))


def _byte_strides(t: torch.Tensor) -> list[int]:
    return [s * t.element_size() for s in t.stride()]


def write_kv(ext: Extension, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor, stream: int) -> None:
    """Scatters key/value rows to their slots; negative or out-of-range slots are skipped."""
    slots = slot_mapping.contiguous()
    ks, vs = _byte_strides(key), _byte_strides(value)
    kc, vc = _byte_strides(key_cache), _byte_strides(value_cache)
    row = key.shape[2] * key.element_size()
    unit = _unit_bytes([row, key.data_ptr(), value.data_ptr(), key_cache.data_ptr(),
                        value_cache.data_ptr(), *ks[:2], *vs[:2], *kc[:3], *vc[:3]])
    if unit < 2:
        raise AssertionError("element rows are at least 2-byte aligned")
    values = {
        "key": key.data_ptr(), "value": value.data_ptr(), "k_cache": key_cache.data_ptr(),
        "v_cache": value_cache.data_ptr(), "slot_mapping": slots.data_ptr(),
        "key_stride_token": ks[0], "key_stride_head": ks[1], "value_stride_token": vs[0],
        "value_stride_head": vs[1], "k_stride_block": kc[0], "k_stride_head": kc[1], "k_stride_slot": kc[2],
        "v_stride_block": vc[0], "v_stride_head": vc[1], "v_stride_slot": vc[2],
        "num_tokens": key.shape[0], "num_kv_heads": key.shape[1], "block_size": key_cache.shape[2],
        "num_slots": key_cache.shape[0] * key_cache.shape[2], "row_bytes": row, "unit_bytes": unit,
        "grid_x": key.shape[0], "grid_y": 1, "threads": THREADS}
    ext.write_kv(pack("write_kv", values), stream)


def _copy_values(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, mapping: torch.Tensor,
                 src: torch.Tensor, dst: torch.Tensor, addresses: Sequence[int]) -> dict[str, Any]:
    ss, ds = _byte_strides(src), _byte_strides(dst)
    row = src.shape[3] * src.element_size()
    unit = _unit_bytes([row, *addresses, *ss[:3], *ds[:3]])
    return {
        "src_caches": src_ptrs.data_ptr(), "dst_caches": dst_ptrs.data_ptr(),
        "mapping": mapping.data_ptr(), "num_caches": src_ptrs.numel(), "num_pairs": mapping.shape[0],
        "num_kv_heads": src.shape[1], "block_size": src.shape[2], "row_bytes": row, "unit_bytes": unit,
        "src_stride_block": ss[0], "src_stride_head": ss[1], "src_stride_slot": ss[2],
        "dst_stride_block": ds[0], "dst_stride_head": ds[1], "dst_stride_slot": ds[2],
        "grid_x": mapping.shape[0], "grid_y": src_ptrs.numel(), "threads": THREADS}


def _check_block_ids(arg: str, ids: torch.Tensor, num_blocks: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_mapping: expected {arg} block ids in [0, {num_blocks}), got "
                         f"min {int(ids.min())}, max {int(ids.max())}")


def copy_blocks(ext: Extension, key_caches: Sequence[torch.Tensor],
                value_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor,
                stream: int) -> None:
    """`cache[dst] = cache[src]` for every (src, dst) row in every cache. Caches with the same
    strides go in one launch; the mapping's ids are checked on the host (it is small)."""
    caches = [*key_caches, *value_caches]
    _check_block_ids("src/dst", block_mapping, caches[0].shape[0])
    device = caches[0].device
    mapping = block_mapping.to(device=device, dtype=torch.int64).contiguous()
    groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for c in caches:
        groups.setdefault(tuple(c.stride()), []).append(c)
    for same in groups.values():
        ptrs = torch.tensor([c.data_ptr() for c in same], dtype=torch.int64).to(device)
        values = _copy_values(ptrs, ptrs, mapping, same[0], same[0],
                              [c.data_ptr() for c in same])
        ext.copy_blocks(pack("copy", values), stream)


def check_swap_ids(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Raises ValueError if a swap's source or destination id is out of range."""
    _check_block_ids("source", block_mapping[:, 0], src.shape[0])
    _check_block_ids("destination", block_mapping[:, 1], dst.shape[0])


def swap_blocks_on_device(ext: Extension, src: torch.Tensor, dst: torch.Tensor,
                          block_mapping: torch.Tensor, stream: int) -> None:
    """`dst[d] = src[s]` for every (s, d) row, both caches on the same device."""
    check_swap_ids(src, dst, block_mapping)
    device = dst.device
    mapping = block_mapping.to(device=device, dtype=torch.int64).contiguous()
    src_ptr = torch.tensor([src.data_ptr()], dtype=torch.int64).to(device)
    dst_ptr = torch.tensor([dst.data_ptr()], dtype=torch.int64).to(device)
    values = _copy_values(src_ptr, dst_ptr, mapping, src, dst, [src.data_ptr(), dst.data_ptr()])
    ext.copy_blocks(pack("copy", values), stream)
