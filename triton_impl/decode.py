"""Paged decode attention (one query token per sequence) with split-K over the context.

Two kernels (docs/triton.md):

`_decode_kernel`
    grid: (num_seqs, num_kv_heads, num_splits).
    One program owns one sequence, one KV head and one split: the keys
    `[base + split * split_size, base + (split + 1) * split_size)` of that sequence (clipped to its
    length), where `base` is 0, or with a sliding window the window's first position rounded down to
    a multiple of TILE_N. It serves all query heads of the KV head's GQA group at once (rows padded
    to GROUP_PAD >= 16 for tl.dot), so each K/V block is read once per KV head.
    Bytes moved: 2 * split_size * head_size * elem (K and V) + group * head_size * elem (Q) + the
    block-table entries; writes group * (head_size + 1) fp32 partials, or the final out/lse rows
    when there is one split and no forced split size.
    Invariants: split_size is a multiple of TILE_N; a program whose split (other than split 0)
    starts at or after seq_len writes nothing, and the reduce never reads it.

`_reduce_kernel`
    grid: (num_seqs, num_heads). One program merges the ceil((seq_len - base) / split_size)
    partials of one (sequence, head) through their log-sum-exp, in split order (deterministic).
    Bytes moved: num_splits * (head_size + 1) * 4 read, head_size * elem (+ 4 for lse) written.

The number of splits: a fixed split size if one is forced (`set_fixed_split_size` or the
environment variable PAGED_KERNELS_TRITON_SPLIT_SIZE) -- then the splits of a sequence depend only
on its own length and results are bitwise identical however it is batched --, else a heuristic
that takes the longest split of MIN_SPLIT_TOKENS * 2^k keys that still gives the grid at least
PROGRAMS_PER_SM programs per SM (or the shortest split when none does). The heuristic takes the
block table's capacity as the context length, since reading seq_lens would
synchronise with the device: size block tables to the batch's longest sequence.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from paged_kernels.abi import AttentionProblem
from triton_impl import configs, runtime
from triton_impl.attend import LN2, LOG2E, attend_keys, finish, kv_scales

SPLIT_SIZE_ENV = "PAGED_KERNELS_TRITON_SPLIT_SIZE"
#: The fewest programs per SM the split heuristic accepts before it shortens the splits. About 4
#: decode programs are resident per SM (bf16, head size 128, sm_90), so 7 is just under two full
#: waves. Measured on an H200 (bench/results/2026-11-30-h200-decode-tuning): at batch 32 x
#: context 4096, 4 even splits of 1024 keys (7.8 programs per SM) ran 139.9 us against 146.6 us
#: for 8 splits of 512 and 153-160 us for 5 or 3 uneven ones (partial waves).
PROGRAMS_PER_SM = 7
#: The shortest split; splits are this many keys times a power of two (even splits of the
#: power-of-two contexts that are common, and few distinct plans).
MIN_SPLIT_TOKENS = 256

_fixed_split_size: Optional[int] = None


def set_fixed_split_size(split_size: Optional[int]) -> None:
    """Forces `split_size` keys per split (rounded up to the kernel's tile) for every decode call,
    overriding PAGED_KERNELS_TRITON_SPLIT_SIZE; None returns to the environment / heuristic."""
    global _fixed_split_size
    if split_size is not None and (isinstance(split_size, bool) or
                                   not isinstance(split_size, int) or split_size < 1):
        raise ValueError(f"split_size: expected None or an int >= 1, got {split_size!r}")
    _fixed_split_size = split_size


def fixed_split_size() -> Optional[int]:
    """The forced split size (module setting, then environment), or None for the heuristic."""
    if _fixed_split_size is not None:
        return _fixed_split_size
    raw = os.environ.get(SPLIT_SIZE_ENV, "")
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{SPLIT_SIZE_ENV}: expected an int >= 1, got {raw!r}")
    return value


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def plan_splits(p: AttentionProblem, tile_n: int) -> tuple[int, int]:
    """Returns `(split_size, num_splits)` for the grid; split_size is a multiple of tile_n.

    The longest range of keys one sequence reads is bounded by the block table's capacity and, with
    a sliding window, by window + tile_n - 1 (the window start is rounded down to a tile).
    """
    context = p.block_tables.shape[1] * p.block_size
    if p.sliding_window is not None:
        context = min(context, p.sliding_window + tile_n - 1)
    context = max(context, 1)
    forced = fixed_split_size()
    if forced is not None:
        split_size = _round_up(forced, tile_n)
    else:
        split_size = _round_up(_heuristic_split(p, context), tile_n)
    return split_size, -(-context // split_size)


def _heuristic_split(p: AttentionProblem, context: int) -> int:
    """The longest split of MIN_SPLIT_TOKENS * 2^k keys whose grid still has PROGRAMS_PER_SM
    programs per SM; MIN_SPLIT_TOKENS when even that grid has fewer; never longer than needed
    for one split."""
    programs = max(p.num_seqs * p.num_kv_heads, 1)
    wanted = PROGRAMS_PER_SM * runtime.sm_count_for(p.query)
    split = MIN_SPLIT_TOKENS
    while split < context and programs * -(-context // (2 * split)) >= wanted:
        split *= 2
    return split


@triton.jit
def _kv_base(seq_len, window, USE_WINDOW: tl.constexpr, TILE_N: tl.constexpr):
    """First key position of split 0: the window's start rounded down to a tile, or 0."""
    if USE_WINDOW:
        base = (tl.maximum(seq_len - window, 0) // TILE_N) * TILE_N
    else:
        base = seq_len * 0
    return base


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, slopes_ptr, out_ptr, lse_ptr,
    k_scale_ptr, v_scale_ptr, scale, soft_cap, window, split_size,
    stride_qt, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_bt, stride_os, stride_oh, stride_ok, stride_ls, stride_lh, stride_lk,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, USE_ALIBI: tl.constexpr,
    HAS_LSE: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    k_scale, v_scale = kv_scales(k_scale_ptr, v_scale_ptr, kv_head, KV_SCALED)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = _kv_base(seq_len, window, USE_WINDOW, TILE_N) + split * split_size
    # split 0 always writes, so that even an (ABI-invalid) empty sequence gets out 0, lse -inf
    if (split > 0) & (start >= seq_len):
        return
    kv_lo = start
    if USE_WINDOW:
        kv_lo = tl.maximum(start, seq_len - window)
    kv_hi = tl.minimum(start + split_size, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    slope2 = tl.zeros([GROUP_PAD], dtype=tl.float32)
    if USE_ALIBI:
        slope2 = tl.load(slopes_ptr + heads, mask=row_ok, other=0.0) * LOG2E
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (seq_len - 1)

    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    kv_head64 = kv_head.to(tl.int64)
    acc, m_i, l_i = attend_keys(
        acc, m_i, l_i, q, q_pos, slope2, k_ptr + kv_head64 * stride_kh,
        v_ptr + kv_head64 * stride_vh, bt_ptr + seq * stride_bt, stride_kb, stride_kt,
        stride_vb, stride_vt, kv_lo, kv_hi, scale * k_scale, soft_cap, window, HEAD_SIZE,
        HEAD_PAD, BLOCK_SIZE, TILE_N, USE_WINDOW, USE_SOFT_CAP, USE_ALIBI, IEEE, UPCAST)
    out, lse2 = finish(acc, m_i, l_i)
    if KV_SCALED:
        out = out * v_scale

    o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_ok
    tl.store(o_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    if PARTIAL:
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split * stride_lk, lse2,
                 mask=row_ok)
    elif HAS_LSE:
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh, lse2 * LN2, mask=row_ok)


@triton.jit
def _reduce_kernel(
    part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr, lse_ptr, window, split_size, max_splits,
    stride_ps, stride_ph, stride_pk, stride_qs, stride_qh, stride_qk,
    stride_os, stride_oh, stride_ls, stride_lh,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, HAS_LSE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_splits = tl.cdiv(seq_len - _kv_base(seq_len, window, USE_WINDOW, TILE_N), split_size)
    # never past the buffer, even for a seq_len beyond the block table (outside the ABI)
    num_splits = tl.minimum(num_splits, max_splits)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    m = float("-inf")
    total = 0.0  # sum of the merged partials' weights
    acc = tl.zeros([HEAD_PAD], dtype=tl.float32)
    for k in range(0, num_splits):
        lse2 = tl.load(part_lse_ptr + seq * stride_qs + head * stride_qh + k * stride_qk)
        o = tl.load(part_out_ptr + seq * stride_ps + head * stride_ph + k * stride_pk + offs_d,
                    mask=d_ok, other=0.0)
        m_new = tl.maximum(m, lse2)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse2 - m_safe)
        acc = acc * alpha + w * o
        total = total * alpha + w
        m = m_new
    seen = total > 0.0
    l_safe = tl.where(seen, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d,
             (acc / l_safe).to(out_ptr.dtype.element_ty), mask=d_ok)
    if HAS_LSE:
        tl.store(lse_ptr + seq * stride_ls + head * stride_lh,
                 tl.where(seen, m + tl.log2(l_safe), float("-inf")) * LN2)


def paged_decode(p: AttentionProblem) -> None:
    """Decode attention for a checked problem with `cu_seqlens_q is None`; fills p.out (and
    p.lse)."""
    cfg = configs.launch_config("decode", p.head_size, p.block_size, p.query.dtype,
                                p.key_cache.dtype)
    head_pad = configs.padded_head_size(p.head_size)
    split_size, num_splits = plan_splits(p, cfg.tile_n)
    group = p.num_queries_per_kv
    k, v, q = p.key_cache, p.value_cache, p.query
    # A forced split size always goes through the reduce, even with one split, so that a
    # sequence takes the same path (hence the same bits) whatever the batch's table width.
    partial = num_splits > 1 or fixed_split_size() is not None
    if partial:
        target = torch.empty(p.num_seqs, p.num_heads, num_splits, head_pad,
                             dtype=torch.float32, device=q.device)
        target_lse = torch.empty(p.num_seqs, p.num_heads, num_splits, dtype=torch.float32,
                                 device=q.device)
        o_strides = target.stride()[:3]
        l_strides = target_lse.stride()
    else:
        target, target_lse = p.out, p.lse
        o_strides = (p.out.stride(0), p.out.stride(1), 0)
        l_strides = (p.lse.stride(0), p.lse.stride(1), 0) if p.lse is not None else (0, 0, 0)
    flags = runtime.kernel_flags(p)
    _decode_kernel[(p.num_seqs, p.num_kv_heads, num_splits)](
        q, k, v, p.block_tables, p.seq_lens, p.alibi_slopes, target, target_lse,
        p.k_scale, p.v_scale, p.scale, p.soft_cap or 1.0, p.sliding_window or 1, split_size,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), p.block_tables.stride(0), *o_strides, *l_strides,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_SIZE=p.head_size,
        HEAD_PAD=head_pad, BLOCK_SIZE=p.block_size, TILE_N=cfg.tile_n,
        PARTIAL=partial, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **flags)
    if partial:
        _reduce(p, target, target_lse, split_size, cfg.tile_n, head_pad, flags["USE_WINDOW"])


def _reduce(p: AttentionProblem, part: torch.Tensor, part_lse: torch.Tensor, split_size: int,
            tile_n: int, head_pad: int, use_window: bool) -> None:
    lse_strides = (p.lse.stride(0), p.lse.stride(1)) if p.lse is not None else (0, 0)
    _reduce_kernel[(p.num_seqs, p.num_heads)](
        part, part_lse, p.seq_lens, p.out, p.lse, p.sliding_window or 1, split_size,
        part.shape[2], *part.stride()[:3], *part_lse.stride(), p.out.stride(0), p.out.stride(1),
        *lse_strides,
        HEAD_SIZE=p.head_size, HEAD_PAD=head_pad, TILE_N=tile_n, USE_WINDOW=use_window,
        HAS_LSE=p.lse is not None, num_warps=1 if head_pad <= 64 else 2)
