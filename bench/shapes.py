"""Benchmark problems and what they must move: paged inputs, a contiguous copy of the same K/V for
torch's scaled_dot_product_attention, and the minimum bytes each kernel has to touch.

Everything is generated on the target device (random normal values, never zeros: zeros hide
unwritten outputs and can run faster than real data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


@dataclass
class BenchProblem:
    """Paged inputs plus, when every sequence has the same length and query count, the same K/V
    stored contiguously (`dense_k`/`dense_v`: `[num_seqs, num_kv_heads, context, head_size]`)."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor]
    q_lens: list[int]
    dense_k: Optional[torch.Tensor] = None
    dense_v: Optional[torch.Tensor] = None

    def bytes_moved(self) -> int:
        """The fewest bytes attention must move: each K/V row of every sequence read once, the
        query read once, the output written once (block tables and lengths are negligible)."""
        elem = self.query.element_size()
        kv_row = self.key_cache.shape[1] * self.key_cache.shape[3] * elem
        return 2 * int(self.seq_lens.sum()) * kv_row + 2 * self.query.numel() * elem

    def flops(self) -> int:
        """QK^T and PV multiply-adds (2 flops each) over the causally visible positions only."""
        num_heads, head_size = self.query.shape[1], self.query.shape[2]
        visible = 0
        for n, q in zip(self.seq_lens.tolist(), self.q_lens):
            visible += q * (n - q) + q * (q + 1) // 2
        return 4 * visible * num_heads * head_size


def make_mixed(contexts: Sequence[int], q_lens: Sequence[int], *, num_heads: int = 32,
               num_kv_heads: int = 8, head_size: int = 128, block_size: int = 16,
               dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0,
               keep_dense: bool = False) -> BenchProblem:
    """Sequence `s` has `contexts[s]` tokens, the last `q_lens[s]` of them queries. Blocks are a
    random permutation of the pool. All q_lens 1 is decode (no cu_seqlens_q). `keep_dense` keeps
    the contiguous K/V (only when all contexts are equal)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    per_seq = [-(-n // block_size) for n in contexts]
    num_blocks = sum(per_seq)
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    table = torch.zeros(len(contexts), max(per_seq), dtype=torch.int32, device=device)
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    caches = [torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
              for _ in range(2)]
    start = 0
    for s, n in enumerate(per_seq):
        table[s, :n] = perm[start:start + n].to(torch.int32)
        start += n
    decode = all(q == 1 for q in q_lens)
    cu = None
    if not decode:
        cu = torch.tensor([0, *torch.tensor(list(q_lens)).cumsum(0).tolist()],
                          dtype=torch.int32, device=device)
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen, device=device,
                        dtype=torch.float32).to(dtype)
    seq_lens = torch.tensor(list(contexts), dtype=torch.int32, device=device)
    p = BenchProblem(query, caches[0], caches[1], table, seq_lens, cu, list(q_lens))
    if keep_dense:
        assert len(set(contexts)) == 1, "dense K/V needs equal contexts"
        p.dense_k, p.dense_v = (gather_dense(c, table, contexts[0]) for c in caches)
    return p


def gather_dense(cache: torch.Tensor, table: torch.Tensor, context: int) -> torch.Tensor:
    """The paged K or V of equal-length sequences as contiguous `[num_seqs, kv_heads, ctx, d]`."""
    blocks = cache[table.long()]  # [num_seqs, n, kv_heads, block_size, d]
    dense = blocks.permute(0, 2, 1, 3, 4).reshape(table.shape[0], cache.shape[1], -1,
                                                  cache.shape[3])
    return dense[:, :, :context].contiguous()


def make_problem(batch: int, context: int, q_len: int, **kwargs) -> BenchProblem:
    """`batch` sequences of `context` tokens, the last `q_len` of each are queries, with the
    contiguous K/V kept for the SDPA baseline. Keyword arguments as for `make_mixed`."""
    return make_mixed([context] * batch, [q_len] * batch, keep_dense=True, **kwargs)


def sdpa_dense(p: BenchProblem) -> Callable[[], torch.Tensor]:
    """A closure running the same attention on the contiguous K/V through torch's
    scaled_dot_product_attention (bottom-right causal mask). GQA uses `enable_gqa` where torch has
    it, so SDPA reads each KV head once like the paged kernels; all tensors are prepared here, out
    of the timed region."""
    assert p.dense_k is not None and p.dense_v is not None, "needs make_problem(...)"
    batch, num_kv_heads, context, head_size = p.dense_k.shape
    num_heads, q_len = p.query.shape[1], p.q_lens[0]
    q = p.query.view(batch, q_len, num_heads, head_size).transpose(1, 2)
    k, v = p.dense_k, p.dense_v
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kwargs: dict = {}
    if q_len == context:
        kwargs["is_causal"] = True
    elif q_len > 1:
        rows = torch.arange(context - q_len, context, device=q.device)[:, None]
        kwargs["attn_mask"] = torch.arange(context, device=q.device)[None, :] <= rows
    if num_heads != num_kv_heads:
        try:
            sdpa(q[:1, :, :1], k[:1, :, :1], v[:1, :, :1], enable_gqa=True)
            kwargs["enable_gqa"] = True
        except TypeError:  # torch < 2.5: expand the KV heads once, outside the timed region
            group = num_heads // num_kv_heads
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
    return lambda: sdpa(q, k, v, **kwargs)
