"""Builds random paged-attention problems and their unpaged truth, for tests of every backend.

A case holds, for each sequence, its K/V as plain float64 tensors (the truth the oracle reads) and
the same values scattered into a paged cache through a random, shuffled block table:
- every cache slot that no sequence owns (unused blocks, the tail of each last block) is NaN;
- block-table entries past `ceil(seq_len / block_size)` hold out-of-range ids or -1, or (with
  `table_pad="nan_block"`) the id of a block nobody owns, so a read of one shows as NaN;
- with `share_prefix`, the second half of the sequences reuse the first sequence's full prefix
  blocks (same block ids, same values), as prefix caching and copy-on-write do;
- with an 8-bit `kv_cache_dtype`, the cache holds the bytes of the test's own quantisation
  (tests/oracle.py) with per-head scales, the truth is their float64 dequantisation, and slots
  nobody owns hold a poison byte (NaN for fp8; int8 has no NaN: 127 by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from oracle import dequantize_oracle, quantize_oracle

EIGHT_BIT = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
#: The default poison byte of an 8-bit cache: NaN in both fp8 formats, the largest int8.
POISON_BYTE = 0x7F


@dataclass
class PagedCase:
    """One problem: paged inputs for the API and the unpaged truth for the oracle."""

    query: torch.Tensor            # [num_tokens, num_heads, head_size], in `dtype`
    key_cache: torch.Tensor        # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor     # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor         # int32 [num_seqs]
    cu_seqlens_q: Optional[torch.Tensor]
    keys: list[torch.Tensor]       # per sequence, float64 [seq_len, num_kv_heads, head_size]
    values: list[torch.Tensor]
    q_lens: list[int]
    k_scale: Optional[list[float]] = None  # per KV head, for an 8-bit cache
    v_scale: Optional[list[float]] = None


def _round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values representable in `dtype`, so the truth and the kernel see the same numbers."""
    return x.to(dtype).to(torch.float64)


def _truth(cell: torch.Tensor, scale: Optional[Sequence[float]],
           quant: Optional[torch.dtype]) -> torch.Tensor:
    """The float64 values the stored rows `cell` stand for (dequantised when 8-bit)."""
    if quant is None:
        return cell.to(torch.float64)
    return dequantize_oracle(cell, scale, quant)  # type: ignore[arg-type]


def _shared_blocks(seq_lens: Sequence[int], block_size: int, share_prefix: bool) -> int:
    """How many full leading blocks the sharing sequences take from sequence 0."""
    return min(seq_lens) // block_size if share_prefix and len(seq_lens) > 1 else 0


def _sharing(s: int, num_seqs: int) -> bool:
    """Sequences in the second half share sequence 0's prefix blocks."""
    return s > 0 and s >= num_seqs - num_seqs // 2


def _assign_blocks(gen: torch.Generator, seq_lens: Sequence[int], block_size: int,
                   shared: int, spare: int) -> tuple[list[list[int]], int]:
    """Random distinct block ids per sequence, shuffled over the whole pool (plus spare blocks
    nobody owns); sharing sequences start with sequence 0's first `shared` ids."""
    needed = [-(-n // block_size) for n in seq_lens]
    reuse = [shared if _sharing(s, len(seq_lens)) else 0 for s in range(len(seq_lens))]
    total = sum(needed) - sum(reuse) + spare
    ids = torch.randperm(total, generator=gen).tolist()
    tables: list[list[int]] = []
    for n, r in zip(needed, reuse):
        own, ids = ids[:n - r], ids[n - r:]
        tables.append((tables[0][:r] if r else []) + own)
    return tables, total


def nan_cache(num_blocks: int, num_kv_heads: int, block_size: int, head_size: int,
              dtype: torch.dtype, *, nhd: bool = False, row_pad: tuple[int, int] = (0, 0),
              device: str = "cpu", poison_byte: int = POISON_BYTE) -> torch.Tensor:
    """A NaN-filled cache viewed as the ABI's `[num_blocks, num_kv_heads, block_size, head_size]`
    (an 8-bit `dtype`: filled with `poison_byte`).

    `nhd=True` stores `[num_blocks, block_size, num_kv_heads, head_size]` and returns the permuted
    view; `row_pad=(before, after)` stores each head_size row inside a wider one, so the last dim
    stays contiguous while the row stride grows (and an odd `before` misaligns the base)."""
    width = row_pad[0] + head_size + row_pad[1]
    shape = (num_blocks, block_size, num_kv_heads, width) if nhd else \
        (num_blocks, num_kv_heads, block_size, width)
    if dtype in EIGHT_BIT:
        cache = torch.full(shape, poison_byte, dtype=torch.uint8, device=device).view(dtype)
    else:
        cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    cache = cache[..., row_pad[0]:row_pad[0] + head_size]
    return cache.permute(0, 2, 1, 3) if nhd else cache


def _block_table(gen: torch.Generator, tables: list[list[int]], num_blocks: int,
                 extra_table: int, nan_block: Optional[int]) -> torch.Tensor:
    """int32 `[num_seqs, max blocks + extra_table]`; entries past a sequence's blocks are
    `nan_block`, or, when that is None, out-of-range ids and -1."""
    max_blocks = max(len(t) for t in tables) + extra_table
    table = torch.full((len(tables), max_blocks), 0, dtype=torch.int32)
    for s, t in enumerate(tables):
        table[s, :len(t)] = torch.tensor(t, dtype=torch.int32)
        if nan_block is not None:
            table[s, len(t):] = nan_block
            continue
        pad = torch.randint(num_blocks, 2**31 - 1, (max_blocks - len(t),), generator=gen)
        pad[::2] = -1
        table[s, len(t):] = pad.to(torch.int32)
    return table


def make_case(
    seq_lens: Sequence[int], q_lens: Optional[Sequence[int]], *, num_heads: int,
    num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
    seed: int = 0, share_prefix: bool = False, nhd: bool = False,
    row_pad: tuple[int, int] = (0, 0), spare_blocks: int = 3, extra_table: int = 2,
    table_pad: str = "garbage", device: str = "cpu", kv_cache_dtype: Optional[torch.dtype] = None,
    k_scale: Optional[Sequence[float]] = None, v_scale: Optional[Sequence[float]] = None,
    poison_byte: int = POISON_BYTE,
) -> PagedCase:
    """A random case. `q_lens=None` means decode (one query per sequence, no cu_seqlens_q).
    `nhd` and `row_pad` choose the cache layout (see `nan_cache`). The block table has
    `extra_table` entries past the longest sequence's blocks; `table_pad` fills every unused entry
    with "garbage" (out-of-range ids and -1) or "nan_block" (a spare, never-written block).
    An 8-bit `kv_cache_dtype` needs `k_scale`/`v_scale` (one float per KV head); the slots nobody
    owns then hold `poison_byte`."""
    if table_pad not in ("garbage", "nan_block"):
        raise ValueError(f"table_pad must be 'garbage' or 'nan_block', got {table_pad!r}")
    if table_pad == "nan_block" and spare_blocks < 1:
        raise ValueError(f"table_pad='nan_block' needs spare_blocks >= 1, got {spare_blocks}")
    gen = torch.Generator().manual_seed(seed)
    shared = _shared_blocks(seq_lens, block_size, share_prefix)
    tables, num_blocks = _assign_blocks(gen, seq_lens, block_size, shared, spare_blocks)
    quant = kv_cache_dtype if kv_cache_dtype in EIGHT_BIT else None
    if quant is not None and (k_scale is None or v_scale is None):
        raise ValueError(f"kv_cache_dtype={quant} needs k_scale and v_scale (per KV head)")
    views = [nan_cache(num_blocks, num_kv_heads, block_size, head_size, quant or dtype, nhd=nhd,
                       row_pad=row_pad, device=device, poison_byte=poison_byte)
             for _ in range(2)]
    stored = [v.view(torch.uint8) if quant else v for v in views]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    first: list[torch.Tensor] = []  # sequence 0's stored rows, which sharing sequences reuse
    for s, n in enumerate(seq_lens):
        raw = [torch.randn(n, num_kv_heads, head_size, generator=gen, dtype=torch.float64)
               for _ in range(2)]
        if quant is None:
            cells = [_round_trip(x, dtype).to(dtype) for x in raw]
        else:
            cells = [quantize_oracle(x, sc, quant) for x, sc in zip(raw, (k_scale, v_scale))]
        if _sharing(s, len(seq_lens)) and shared:
            for mine, theirs in zip(cells, first):
                mine[:shared * block_size] = theirs[:shared * block_size]
        first = first or cells
        for cell, view in zip(cells, stored):
            for j, block in enumerate(tables[s]):
                rows = cell[j * block_size:(j + 1) * block_size]
                view[block, :, :rows.shape[0]] = rows.transpose(0, 1).to(view.device)
        kv = [_truth(c, sc, quant) for c, sc in zip(cells, (k_scale, v_scale))]
        keys.append(kv[0])
        values.append(kv[1])
    nan_block = None
    if table_pad == "nan_block":
        nan_block = min(set(range(num_blocks)) - {b for t in tables for b in t})
    table = _block_table(gen, tables, num_blocks, extra_table, nan_block)
    cu = None
    if q_lens is not None:
        cu = torch.tensor([0, *torch.tensor(list(q_lens)).cumsum(0).tolist()], dtype=torch.int32)
    num_tokens = sum(q_lens) if q_lens is not None else len(seq_lens)
    query = _round_trip(torch.randn(num_tokens, num_heads, head_size, generator=gen,
                                    dtype=torch.float64), dtype).to(dtype)
    to = torch.device(device)
    return PagedCase(query.to(to), views[0], views[1], table.to(to),
                     torch.tensor(list(seq_lens), dtype=torch.int32, device=to),
                     None if cu is None else cu.to(to), keys, values,
                     list(q_lens) if q_lens is not None else [1] * len(seq_lens),
                     None if quant is None else list(k_scale),  # type: ignore[arg-type]
                     None if quant is None else list(v_scale))  # type: ignore[arg-type]
