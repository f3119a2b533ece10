"""FlexAttention over the same paged K/V, as a baseline from torch itself.

The physical cache is viewed as one long KV sequence `[1, kv_heads, num_blocks * block_size, d]`
(a one-off re-layout outside the timed region); a mask maps each (sequence, physical slot) back to
its logical position through an inverse block table, and a BlockMask built at the page size lets the
kernel skip every page the sequence does not own. Decode only (one query per sequence)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from bench.shapes import BenchProblem


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_decode(p: BenchProblem, kernel_options: Optional[dict] = None
                ) -> Callable[[], torch.Tensor]:
    """A closure computing decode attention for `p` with flex_attention and a paged block mask;
    returns `[num_seqs, num_heads, head_size]`-shaped output (as `[B, 1, H, D]` reshaped)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    num_blocks, kv_heads, block_size, head_size = p.key_cache.shape
    batch, num_heads = p.query.shape[0], p.query.shape[1]
    k = p.key_cache.permute(1, 0, 2, 3).reshape(1, kv_heads, num_blocks * block_size, head_size)
    v = p.value_cache.permute(1, 0, 2, 3).reshape(1, kv_heads, num_blocks * block_size,
                                                  head_size)
    k = k.expand(batch, -1, -1, -1)
    v = v.expand(batch, -1, -1, -1)
    inverse = torch.full((batch, num_blocks), -1, dtype=torch.int32, device=k.device)
    used = -(-p.seq_lens.long() // block_size)
    for s in range(batch):
        n = int(used[s])
        inverse[s, p.block_tables[s, :n].long()] = torch.arange(n, dtype=torch.int32,
                                                                 device=k.device)
    last = p.seq_lens - 1

    def mask_mod(b, h, q_idx, kv_idx):
        logical_block = inverse[b, kv_idx // block_size]
        position = logical_block * block_size + kv_idx % block_size
        return (logical_block >= 0) & (position <= last[b])

    block_mask = create_block_mask(mask_mod, batch, None, 1, num_blocks * block_size,
                                   device=k.device, BLOCK_SIZE=(128, block_size))
    q = p.query.view(batch, num_heads, 1, head_size)
    compiled = torch.compile(flex_attention, dynamic=False)
    gqa = num_heads != kv_heads
    return lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa,
                            kernel_options=kernel_options)
