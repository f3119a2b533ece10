"""Benchmark problems and what they must move: paged inputs, a contiguous copy of the same K/V for
torch's scaled_dot_product_attention, and the minimum bytes each kernel has to touch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class BenchProblem:
    """Paged inputs plus the same K/V stored contiguously (`[num_seqs, kv_heads, len, head]`)."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor]
    dense_k: torch.Tensor
    dense_v: torch.Tensor
    q_len: int

    def bytes_moved(self) -> int:
        """The fewest bytes attention must move: each K/V row of every sequence read once, the
        query read once, the output written once (block tables and lengths are negligible)."""
        elem = self.query.element_size()
        kv_row = self.key_cache.shape[1] * self.key_cache.shape[3] * elem
        kv = 2 * int(self.seq_lens.sum()) * kv_row
        return kv + 2 * self.query.numel() * elem

    def flops(self) -> int:
        """Multiply-adds of QK^T and PV counted as 2 flops each, causal positions only."""
        num_heads, head_size = self.query.shape[1], self.query.shape[2]
        total = 0
        for n in self.seq_lens.tolist():
            for i in range(self.q_len):
                total += n - self.q_len + i + 1
        return 4 * total * num_heads * head_size


def make_problem(batch: int, context: int, q_len: int, *, num_heads: int = 32,
                 num_kv_heads: int = 8, head_size: int = 128, block_size: int = 16,
                 dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 seed: int = 0) -> BenchProblem:
    """`batch` sequences of `context` tokens each, the last `q_len` of them queries (q_len 1 is
    decode: no cu_seqlens_q). Blocks are assigned in a random permutation of the pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = perm.view(batch, blocks_per_seq).to(device)
    dense_k = torch.randn(batch, num_kv_heads, context, head_size, generator=gen).to(dtype)
    dense_v = torch.randn(batch, num_kv_heads, context, head_size, generator=gen).to(dtype)
    caches = []
    for dense in (dense_k, dense_v):
        padded = torch.zeros(batch, num_kv_heads, blocks_per_seq * block_size, head_size,
                             dtype=dtype)
        padded[:, :, :context] = dense
        blocks = padded.view(batch, num_kv_heads, blocks_per_seq, block_size, head_size)
        cache = torch.empty(num_blocks, num_kv_heads, block_size, head_size, dtype=dtype)
        cache[perm.long()] = blocks.permute(0, 2, 1, 3, 4).reshape(-1, num_kv_heads, block_size,
                                                                    head_size)
        caches.append(cache.to(device))
    query = torch.randn(batch * q_len, num_heads, head_size, generator=gen).to(dtype).to(device)
    cu = None
    if q_len > 1:
        cu = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return BenchProblem(query, caches[0], caches[1], block_tables, seq_lens, cu,
                        dense_k.to(device), dense_v.to(device), q_len)


def sdpa_dense(p: BenchProblem) -> torch.Tensor:
    """The same attention on contiguous K/V through torch's scaled_dot_product_attention
    (bottom-right-aligned causal mask, GQA by expanding the KV heads as a view)."""
    batch, num_kv_heads, context, head_size = p.dense_k.shape
    num_heads = p.query.shape[1]
    q = p.query.view(batch, p.q_len, num_heads, head_size).transpose(1, 2)
    group = num_heads // num_kv_heads
    k = p.dense_k[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, num_heads, context,
                                                                    head_size)
    v = p.dense_v[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, num_heads, context,
                                                                    head_size)
    mask = None
    if p.q_len > 1:
        rows = torch.arange(context - p.q_len, context, device=q.device)[:, None]
        mask = torch.arange(context, device=q.device)[None, :] <= rows
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
