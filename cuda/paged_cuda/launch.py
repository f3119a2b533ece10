"""The one Python adapter between the ABI and the CUDA launchers (cuda/csrc/pk_ops.h).

Both backends ("cuda" on the GPU, "cuda-host" on the CPU through the emulator) call these
functions with an extension-like object `ext` (`Extension`: the pybind11 module `_pk_cuda` /
`_pk_cuda_host`, or `jit.JitModule`). Each function takes a checked problem or tensors, plans
the launch (planner.py), packs the params struct (params.py) and hands it to `ext` with a
stream. `attention_launches` says which template instantiations a packed plan launches; the C++
launchers (pk_launch.cuh) and the JIT path dispatch exactly that way.

Every row the kernels load with 16-byte vectors must start 16-byte aligned: a misaligned query,
output or cache is replaced by a contiguous copy here (a cache with a one-time warning).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from cuda.paged_cuda.params import (CTYPES, DTYPE_CODES, HEAD_SIZES, KERNEL_DECODE,
                                    KERNEL_DECODE_MMA, KERNEL_VARLEN_MMA, KV8_CTYPE,
                                    KV_DTYPE_CODES, pack)
from cuda.paged_cuda.planner import THREADS, AttentionPlan, plan_attention
from paged_kernels.abi import FEATURES, AttentionProblem, Support, check_block_ids


class Extension(Protocol):
    """What the launch functions need from a module of launchers (pybind11 module or
    jit.JitModule): each takes a packed params struct and a stream (0 on the host), and raises
    RuntimeError with the launcher's message on failure."""

    def paged_attention(self, params: bytes, stream: int) -> None: ...
    def write_kv(self, params: bytes, stream: int) -> None: ...
    def copy_blocks(self, params: bytes, stream: int) -> None: ...


def support(device_types: Sequence[str], head_sizes: Sequence[int] = HEAD_SIZES) -> Support:
    """What the CUDA kernels support, on the given device types."""
    return Support(
        dtypes=frozenset(DTYPE_CODES),
        device_types=frozenset(device_types),
        features=frozenset(FEATURES),
        head_sizes=frozenset(head_sizes),
        kv_cache_dtypes=frozenset(KV_DTYPE_CODES),
        reasons=(("head_sizes", ("kernels are instantiated per head size (a multiple of 16 "
                                 "for the tensor-core path); see PK_HEAD_SIZES in "
                                 "cuda/csrc/pk_launch.cuh")),),
    )


# ---------------------------------------------------------------------------------------------
# Attention.

_CTYPE_OF_CODE = {code: CTYPES[dtype] for dtype, code in DTYPE_CODES.items()}


def attention_launches(v: dict[str, Any]) -> list[tuple[str, tuple[int, int, int], int, int]]:
    """The launches the plan inside unpacked attention params `v` makes, in order: (template
    instantiation, grid, threads, dynamic shared memory). This is what pk_launch.cuh dispatches
    to; the JIT path launches exactly these. An 8-bit cache's kernels are the `PkKv8`
    instantiations; their reduce kernel is the query dtype's."""
    out_t, d = _CTYPE_OF_CODE[v["dtype"]], v["head_size"]
    t = KV8_CTYPE if v["kv_dtype"] else out_t
    grid = (v["grid_x"], v["grid_y"], v["grid_z"])
    if v["kernel"] in (KERNEL_DECODE, KERNEL_DECODE_MMA):
        name = (f"pk_decode_kernel<{t}, {d}, {v['group_tile']}>" if v["kernel"] == KERNEL_DECODE
                else f"pk_decode_mma_kernel<{t}, {d}, {v['threads'] // 32}>")
        launches = [(name, grid, v["threads"], v["smem_bytes"])]
        if v["num_splits"] > 1:
            launches.append((f"pk_decode_reduce_kernel<{out_t}>",
                             (v["reduce_grid_x"], v["reduce_grid_y"], 1), v["reduce_threads"], 0))
        return launches
    if v["kernel"] == KERNEL_VARLEN_MMA:
        name = f"pk_varlen_mma_async_kernel<{t}, {d}, {v['threads'] // 32}>"
    else:
        name = f"pk_varlen_simt_kernel<{t}, {d}>"
    return [(name, grid, v["threads"], v["smem_bytes"])]


def attn_values(p: AttentionProblem, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, out: torch.Tensor, part: tuple[torch.Tensor, ...] | None
                ) -> dict[str, Any]:
    """Every field of the "attn" params struct for `p` run by `plan` on these tensors (`q`, `k`,
    `v`, `out` may be aligned copies of p's; `part` the split-K workspace or None)."""
    def ptr(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    part_out, part_m, part_l = part if part is not None else (None, None, None)
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    return {
        "q": q.data_ptr(), "k_cache": k.data_ptr(), "v_cache": v.data_ptr(),
        "block_tables": p.block_tables.data_ptr(), "seq_lens": p.seq_lens.data_ptr(),
        "cu_seqlens_q": ptr(p.cu_seqlens_q), "alibi_slopes": ptr(p.alibi_slopes),
        "out": out.data_ptr(), "lse": ptr(p.lse), "part_out": ptr(part_out), "part_m": ptr(part_m),
        "part_l": ptr(part_l), "k_scale": ptr(p.k_scale), "v_scale": ptr(p.v_scale),
        "q_stride_token": qs[0], "q_stride_head": qs[1],
        "k_stride_block": ks[0], "k_stride_head": ks[1], "k_stride_slot": ks[2],
        "v_stride_block": vs[0], "v_stride_head": vs[1], "v_stride_slot": vs[2],
        "o_stride_token": os_[0], "o_stride_head": os_[1], "bt_stride": p.block_tables.stride(0),
        "num_seqs": p.num_seqs, "num_tokens": p.num_tokens, "num_heads": p.num_heads,
        "num_kv_heads": p.num_kv_heads, "head_size": p.head_size, "block_size": p.block_size,
        "group": p.num_queries_per_kv, "heads_per_cta": plan.heads_per_cta,
        "num_head_chunks": plan.num_head_chunks, "num_splits": plan.num_splits,
        "partition_size": plan.partition_size, "sliding_window": p.sliding_window or 0,
        "dtype": DTYPE_CODES[p.query.dtype], "kv_dtype": KV_DTYPE_CODES.get(k.dtype, 0),
        "kernel": plan.kernel, "group_tile": plan.group_tile,
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
    values = attn_values(p, plan, q, k, v, out, part)
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
        warnings.warn("paged_kernels cuda: a KV cache's strides are not multiples of 16 bytes; "
                      "copying it to a contiguous tensor for each call (slow)", stacklevel=3)
        _warned_copy = True
    return cache.contiguous()


# ---------------------------------------------------------------------------------------------
# Cache operations (byte-level; the unit is the widest alignment every address allows).

def _unit_bytes(addresses: Sequence[int]) -> int:
    return next(u for u in (16, 8, 4, 2, 1) if all(a % u == 0 for a in addresses))


def _byte_strides(t: torch.Tensor) -> list[int]:
    return [s * t.element_size() for s in t.stride()]


def write_kv(ext: Extension, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor, stream: int,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Scatters key/value rows to their slots, quantised with the per-KV-head `k_scale` /
    `v_scale` (float32 `[num_kv_heads]`) into an 8-bit cache; negative or out-of-range slots are
    skipped."""
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
        "k_scale": 0 if k_scale is None else k_scale.data_ptr(),
        "v_scale": 0 if v_scale is None else v_scale.data_ptr(),
        "head_size": key.shape[2], "dtype": DTYPE_CODES[key.dtype],
        "kv_dtype": KV_DTYPE_CODES.get(key_cache.dtype, 0),
        "key_stride_token": ks[0], "key_stride_head": ks[1], "value_stride_token": vs[0],
        "value_stride_head": vs[1], "k_stride_block": kc[0], "k_stride_head": kc[1],
        "k_stride_slot": kc[2], "v_stride_block": vc[0], "v_stride_head": vc[1],
        "v_stride_slot": vc[2], "num_tokens": key.shape[0], "num_kv_heads": key.shape[1],
        "block_size": key_cache.shape[2], "num_slots": key_cache.shape[0] * key_cache.shape[2],
        "row_bytes": row, "unit_bytes": unit, "grid_x": key.shape[0], "grid_y": 1,
        "threads": THREADS}
    ext.write_kv(pack("write_kv", values), stream)


def _copy_values(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, mapping: torch.Tensor,
                 src: torch.Tensor, dst: torch.Tensor, addresses: Sequence[int]) -> dict[str, Any]:
    ss, ds = _byte_strides(src), _byte_strides(dst)
    row = src.shape[3] * src.element_size()
    unit = _unit_bytes([row, *addresses, *ss[:3], *ds[:3]])
    return {
        "src_caches": src_ptrs.data_ptr(), "dst_caches": dst_ptrs.data_ptr(),
        "mapping": mapping.data_ptr(), "num_caches": src_ptrs.numel(),
        "num_pairs": mapping.shape[0], "num_kv_heads": src.shape[1], "block_size": src.shape[2],
        "row_bytes": row, "unit_bytes": unit,
        "src_stride_block": ss[0], "src_stride_head": ss[1], "src_stride_slot": ss[2],
        "dst_stride_block": ds[0], "dst_stride_head": ds[1], "dst_stride_slot": ds[2],
        "grid_x": mapping.shape[0], "grid_y": src_ptrs.numel(), "threads": THREADS}


def copy_blocks(ext: Extension, key_caches: Sequence[torch.Tensor],
                value_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor,
                stream: int) -> None:
    """`cache[dst] = cache[src]` for every (src, dst) row in every cache. Caches with the same
    strides go in one launch; the mapping's ids are checked on the host (it is small)."""
    caches = [*key_caches, *value_caches]
    check_block_ids("src/dst", block_mapping, caches[0].shape[0])
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
    check_block_ids("source", block_mapping[:, 0], src.shape[0])
    check_block_ids("destination", block_mapping[:, 1], dst.shape[0])


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
