"""Paged attention in plain PyTorch: the readable definition of docs/abi.md.

Each sequence's blocks are gathered through its block table into a padded, contiguous
`[num_seqs, num_kv_heads, max_seq_len, head_size]` view; its query tokens are padded to
`[num_seqs, max_q_len]`; scores, masks and the softmax are computed in float32 with batched
matrix products (no Python loop over tokens or blocks). Entries of the block table past
`ceil(seq_len / block_size)` are replaced by block 0 before the gather and every key past a
sequence's length is masked out of the scores and zeroed in V, so their contents (NaN included)
never reach the result. An 8-bit cache is read as `float32(q) * scale[kv_head]`
(`paged_kernels.kv_quant.dequantize`), then computed exactly as a float cache.
"""

from __future__ import annotations

from typing import Optional

import torch

from paged_kernels.abi import AttentionProblem
from paged_kernels.cache_ops import as_bytes
from paged_kernels.kv_quant import dequantize


def _gather_kv(p: AttentionProblem, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns K and V as float32 `[num_seqs, num_kv_heads, max_blocks * block_size, head_size]`,
    dequantised when the cache is 8-bit."""
    num_blocks_used = -(-max_len // p.block_size)
    table = p.block_tables[:, :num_blocks_used].long()
    needed = -(-p.seq_lens.long() // p.block_size)
    read = torch.arange(num_blocks_used, device=table.device)[None, :] < needed[:, None]
    table = torch.where(read, table, torch.zeros_like(table))

    def gather(cache: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
        # [num_seqs, n, num_kv_heads, block_size, head_size]; 8-bit caches gathered as bytes
        blocks = as_bytes(cache)[table].view(cache.dtype).permute(0, 2, 1, 3, 4)
        dense = torch.empty(p.num_seqs, p.num_kv_heads, num_blocks_used, p.block_size,
                            p.head_size, dtype=torch.float32, device=cache.device)
        # one pass: reorder and widen to float32 (an 8-bit cache: float32(q) * scale[kv_head])
        dense.copy_(blocks if scale is None else dequantize(blocks, scale))
        return dense.view(p.num_seqs, p.num_kv_heads, -1, p.head_size)

    return gather(p.key_cache, p.k_scale), gather(p.value_cache, p.v_scale)


def _token_layout(p: AttentionProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """For each query token: its sequence, its index among that sequence's queries and its
    position; plus the longest query length."""
    device = p.query.device
    cu = p.query_start_loc().long()
    q_lens = cu[1:] - cu[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(p.num_seqs, device=device), q_lens,
                                           output_size=p.num_tokens)
    index_in_seq = torch.arange(p.num_tokens, device=device) - cu[seq_of_token]
    position = p.seq_lens.long()[seq_of_token] - q_lens[seq_of_token] + index_in_seq
    max_q_len = int(q_lens.max()) if p.num_seqs else 0
    return seq_of_token, index_in_seq, position, max_q_len


def _scores(p: AttentionProblem, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
            q_valid: torch.Tensor, max_q_len: int) -> torch.Tensor:
    """Masked float32 scores `[num_seqs, num_kv_heads, group, max_q_len, max_len]`.

    `q` is `[num_seqs, num_kv_heads, group * max_q_len, head_size]`: the query rows of a GQA
    group share one product with their KV head's keys (no copy of K per query head)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * p.scale
    s = s.view(p.num_seqs, p.num_kv_heads, p.num_queries_per_kv, max_q_len, -1)
    if p.soft_cap is not None:
        s = p.soft_cap * torch.tanh(s / p.soft_cap)
    k_pos = torch.arange(k.shape[2], device=q.device)
    rel = (k_pos[None, None, :] - q_pos[:, :, None]).float()  # [num_seqs, max_q_len, max_len]
    if p.alibi_slopes is not None:
        slopes = p.alibi_slopes.view(p.num_kv_heads, p.num_queries_per_kv)
        s = s + slopes[None, :, :, None, None] * rel[:, None, None]
    visible = (rel <= 0) & q_valid[:, :, None]
    if p.sliding_window is not None:
        visible &= rel > -p.sliding_window
    return s.masked_fill_(~visible[:, None, None], float("-inf"))


def paged_attention(p: AttentionProblem) -> None:
    """Writes attention for `p` into `p.out` (and `p.lse`); see the module docstring."""
    seq_of_token, index_in_seq, position, max_q_len = _token_layout(p)
    max_len = int(p.seq_lens.max())
    k, v = _gather_kv(p, max_len)
    k_valid = torch.arange(k.shape[2], device=k.device)[None, :] < p.seq_lens.long()[:, None]
    v.masked_fill_(~k_valid[:, None, :, None], 0.0)

    group, rows = p.num_queries_per_kv, p.num_queries_per_kv * max_q_len
    q = torch.zeros(p.num_seqs, max_q_len, p.num_heads, p.head_size, device=k.device)
    q[seq_of_token, index_in_seq] = p.query.float()
    q = q.view(p.num_seqs, max_q_len, p.num_kv_heads, group, p.head_size).permute(0, 2, 3, 1, 4)
    q = q.reshape(p.num_seqs, p.num_kv_heads, rows, p.head_size)
    q_pos = torch.zeros(p.num_seqs, max_q_len, dtype=torch.long, device=k.device)
    q_pos[seq_of_token, index_in_seq] = position
    q_valid = torch.zeros(p.num_seqs, max_q_len, dtype=torch.bool, device=k.device)
    q_valid[seq_of_token, index_in_seq] = True

    s = _scores(p, q, k, q_pos, q_valid, max_q_len)
    lse = torch.logsumexp(s, dim=-1)  # [num_seqs, num_kv_heads, group, max_q_len]
    probs = torch.exp(s - lse[..., None]).nan_to_num_(0.0)  # padded query rows are all -inf
    o = torch.matmul(probs.view(p.num_seqs, p.num_kv_heads, rows, -1), v)
    o = o.view(p.num_seqs, p.num_kv_heads, group, max_q_len, p.head_size)

    o = o.permute(0, 3, 1, 2, 4).reshape(p.num_seqs, max_q_len, p.num_heads, p.head_size)
    p.out.copy_(o[seq_of_token, index_in_seq])
    if p.lse is not None:
        lse = lse.permute(0, 3, 1, 2).reshape(p.num_seqs, max_q_len, p.num_heads)
        p.lse.copy_(lse[seq_of_token, index_in_seq])
