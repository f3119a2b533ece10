"""A first look at paged_kernels: write K/V into a paged cache through a slot mapping, then run
a mixed batch (a prefill and two decodes) and compare with dense attention on the same tokens.

    python examples/quickstart.py
"""

from __future__ import annotations

import torch

import paged_kernels as pk
from paged_kernels.attention import paged_attention, write_kv

NUM_BLOCKS, BLOCK_SIZE, HEADS, KV_HEADS, HEAD_SIZE = 64, 16, 8, 2, 64


def main() -> None:
    torch.manual_seed(0)
    print("backends available here:", pk.available_backends())
    key_cache = torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
    value_cache = torch.zeros_like(key_cache)
    seq_lens = [40, 17, 33]
    free = torch.randperm(NUM_BLOCKS).tolist()  # blocks anywhere in the pool
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in seq_lens]
    keys = [torch.randn(n, KV_HEADS, HEAD_SIZE) for n in seq_lens]
    values = [torch.randn(n, KV_HEADS, HEAD_SIZE) for n in seq_lens]
    for table, k, v in zip(tables, keys, values):
        pos = torch.arange(k.shape[0])
        slots = torch.tensor(table)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        write_kv(k, v, key_cache, value_cache, slots)

    q_lens = [40, 1, 1]  # sequence 0 is a prefill, 1 and 2 decode their last token
    query = torch.randn(sum(q_lens), HEADS, HEAD_SIZE)
    block_tables = torch.zeros(3, max(map(len, tables)), dtype=torch.int32)
    for s, table in enumerate(tables):
        block_tables[s, :len(table)] = torch.tensor(table, dtype=torch.int32)
    cu_seqlens_q = torch.tensor([0, 40, 41, 42], dtype=torch.int32)
    out = paged_attention(query, key_cache, value_cache, block_tables,
                          torch.tensor(seq_lens, dtype=torch.int32), cu_seqlens_q=cu_seqlens_q)

    start = 0
    for s, (n, q_len) in enumerate(zip(seq_lens, q_lens)):
        q = query[start:start + q_len].transpose(0, 1)[None]
        k = keys[s].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)[None]
        v = values[s].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)[None]
        mask = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        err = (out[start:start + q_len] - dense[0].transpose(0, 1)).abs().max().item()
        print(f"sequence {s}: {n} tokens in blocks {tables[s]}, {q_len} queries, "
              f"max |paged - dense| = {err:.2e}")
        start += q_len


if __name__ == "__main__":
    main()
