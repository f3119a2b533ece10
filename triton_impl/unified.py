"""Paged attention for varlen batches (`cu_seqlens_q` given): prefill, chunked prefill over a cached
prefix, decode and several query tokens per sequence, mixed in one launch.

`_varlen_kernel`
    grid: (num_tokens // BLOCK_Q + num_seqs, num_kv_heads).
    One program owns one query tile -- up to BLOCK_Q consecutive query tokens of one sequence times
    the GROUP query heads of one KV head, flattened into BLOCK_M = BLOCK_Q * GROUP (+ padding) rows
    (row r: token r // GROUP, head r % GROUP) -- and loops over that sequence's keys through its
    block table with an online softmax, TILE_N keys at a time (`attend.attend_keys`).
    Sequence s owns the tiles [cu[s] // BLOCK_Q + s, cu[s + 1] // BLOCK_Q + s + 1), at least
    ceil(q_len / BLOCK_Q) of them; a program finds its sequence by binary search over cu_seqlens_q
    (no host synchronisation) and exits when its tile is past the sequence's queries.
    Keys read: [max(0, first query position - window + 1), last query position + 1): causally
    invisible tiles and tiles wholly outside the sliding window are skipped.
    Bytes moved: per program 2 * keys_read * head_size * elem (K and V) + BLOCK_Q * GROUP *
    head_size * elem (Q in, out) (+ 4 per row for lse).
    Invariants: query positions are seq_len - q_len + i (docs/abi.md); q_len <= seq_len.
"""

from __future__ import annotations

import triton
import triton.language as tl

from paged_kernels.abi import AttentionProblem
from triton_impl import configs, runtime
from triton_impl.attend import LN2, LOG2E, attend_keys, finish, kv_scales


@triton.jit
def _find_seq(cu_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence whose tiles contain `tile`: the largest s with cu[s] // BLOCK_Q + s <= tile."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _varlen_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, cu_ptr, slopes_ptr, out_ptr, lse_ptr,
    k_scale_ptr, v_scale_ptr, scale, soft_cap, window, num_seqs,
    stride_qt, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_bt, stride_ot, stride_oh, stride_lt, stride_lh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    USE_ALIBI: tl.constexpr, HAS_LSE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(cu_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    first_q = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    k_scale, v_scale = kv_scales(k_scale_ptr, v_scale_ptr, kv_head, KV_SCALED)

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    heads = kv_head * GROUP + rows % GROUP
    tokens = (q_start + q_idx).to(tl.int64)
    q_pos = seq_len - q_len + q_idx
    offs_d = tl.arange(0, HEAD_PAD)
    mask_qd = row_ok[:, None] & (offs_d < HEAD_SIZE)[None, :]
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=mask_qd, other=0.0)
    slope2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope2 = tl.load(slopes_ptr + heads, mask=row_ok, other=0.0) * LOG2E

    last_pos = seq_len - q_len + tl.minimum(first_q + BLOCK_Q, q_len) - 1
    kv_lo = seq_len * 0
    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - q_len + first_q - window + 1, 0)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kv_head64 = kv_head.to(tl.int64)
    acc, m_i, l_i = attend_keys(
        acc, m_i, l_i, q, q_pos, slope2, k_ptr + kv_head64 * stride_kh,
        v_ptr + kv_head64 * stride_vh, bt_ptr + seq.to(tl.int64) * stride_bt, stride_kb,
        stride_kt, stride_vb, stride_vt, kv_lo, last_pos + 1, scale * k_scale, soft_cap,
        window, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, USE_WINDOW, USE_SOFT_CAP, USE_ALIBI,
        IEEE, UPCAST)
    out, lse2 = finish(acc, m_i, l_i)
    if KV_SCALED:
        out = out * v_scale

    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_qd)
    if HAS_LSE:
        tl.store(lse_ptr + tokens * stride_lt + heads * stride_lh, lse2 * LN2, mask=row_ok)


def paged_varlen(p: AttentionProblem) -> None:
    """Attention for a checked problem with `cu_seqlens_q`; fills p.out (and p.lse)."""
    cfg = configs.launch_config("varlen", p.head_size, p.block_size, p.query.dtype,
                                p.key_cache.dtype)
    group = p.num_queries_per_kv
    block_m = max(cfg.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    q, k, v = p.query, p.key_cache, p.value_cache
    lse_strides = (p.lse.stride(0), p.lse.stride(1)) if p.lse is not None else (0, 0)
    grid = (p.num_tokens // block_q + p.num_seqs, p.num_kv_heads)
    _varlen_kernel[grid](
        q, k, v, p.block_tables, p.seq_lens, p.cu_seqlens_q, p.alibi_slopes, p.out, p.lse,
        p.k_scale, p.v_scale, p.scale, p.soft_cap or 1.0, p.sliding_window or 1, p.num_seqs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), p.block_tables.stride(0),
        p.out.stride(0), p.out.stride(1), *lse_strides,
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_SIZE=p.head_size,
        HEAD_PAD=configs.padded_head_size(p.head_size), BLOCK_SIZE=p.block_size,
        TILE_N=cfg.tile_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **runtime.kernel_flags(p))
