"""`paged_attention` and `write_kv` as torch custom operators, for `torch.compile` and CUDA graphs.

Importing this module registers two operators in the `paged_kernels` namespace:

    paged_kernels::paged_attention(Tensor query, Tensor key_cache, Tensor value_cache,
        Tensor block_tables, Tensor seq_lens, Tensor? cu_seqlens_q, Tensor(a!) out,
        Tensor(b!)? lse, float? scale, SymInt? sliding_window, float? soft_cap,
        Tensor? alibi_slopes, Tensor? k_scale, Tensor? v_scale, str backend) -> ()
    paged_kernels::write_kv(Tensor key, Tensor value, Tensor(a!) key_cache,
        Tensor(b!) value_cache, Tensor slot_mapping, Tensor? k_scale, Tensor? v_scale,
        str backend) -> ()

Both write into tensors the caller owns (`out`/`lse`, the caches) and return nothing: the output
buffer of attention is then a fixed address a CUDA graph can replay into, and `torch.compile`
functionalises the mutation and re-inplaces it, so a compiled model allocates nothing extra.
Optional floats and ints travel as `float?`/`SymInt?`, so `None` keeps its meaning ("default
scale", "no window", "no cap"); the backend name is a `str` and is resolved when the operator
runs, not when it is traced. The scales of an 8-bit cache travel as tensors (`Tensor?`): the
wrappers below turn a float scale into a float32 tensor `[1]` on the cache's device, and a
`[num_kv_heads]` tensor reaches the kernel as is, so a CUDA graph reads its current values.

The operators are opaque to the compiler: the fake (meta) implementations run the same host-side
ABI checks as the eager API (so a malformed call fails at trace time with the same message) and
produce no values. The eager implementations call `paged_kernels.attention`, so every backend's
behaviour, errors and support limits are exactly the eager API's.

`paged_attention` and `write_kv` below are keyword-compatible with `paged_kernels.attention`'s,
minus `check` (content checks synchronise, which a CUDA graph cannot capture; set
PAGED_KERNELS_CHECK=1 to get them in eager runs).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from paged_kernels import attention
from paged_kernels.abi import check_attention_args, check_lse, check_write_kv_args

__all__ = ["paged_attention", "write_kv"]


@torch.library.custom_op("paged_kernels::paged_attention", mutates_args=("out", "lse"))
def _paged_attention_op(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
    out: torch.Tensor, lse: Optional[torch.Tensor], scale: Optional[float],
    sliding_window: Optional[int], soft_cap: Optional[float],
    alibi_slopes: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor], backend: str,
) -> None:
    """Writes attention into `out` (and the log-sum-exp into `lse` when it is not None)."""
    result = attention.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q=cu_seqlens_q,
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
        alibi_slopes=alibi_slopes, out=out, return_lse=lse is not None, k_scale=k_scale,
        v_scale=v_scale, backend=backend)
    if lse is not None:
        # the eager API allocates its own lse; [num_tokens, num_heads] floats, a small copy
        lse.copy_(result[1])


@_paged_attention_op.register_fake
def _paged_attention_fake(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
    out: torch.Tensor, lse: Optional[torch.Tensor], scale: Optional[float],
    sliding_window: Optional[int], soft_cap: Optional[float],
    alibi_slopes: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor], backend: str,
) -> None:
    check_attention_args(query, key_cache, value_cache, block_tables, seq_lens,
                         cu_seqlens_q=cu_seqlens_q, scale=scale, sliding_window=sliding_window,
                         soft_cap=soft_cap, alibi_slopes=alibi_slopes, out=out, k_scale=k_scale,
                         v_scale=v_scale)
    check_lse(lse, query)


@torch.library.custom_op("paged_kernels::write_kv", mutates_args=("key_cache", "value_cache"))
def _write_kv_op(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
    backend: str,
) -> None:
    """Scatters `key`/`value` rows into their slots of the caches (negative slots skipped)."""
    attention.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale,
                       v_scale=v_scale, backend=backend)


@_write_kv_op.register_fake
def _write_kv_fake(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
    backend: str,
) -> None:
    # the host-side checks of attention.write_kv, so a malformed call fails at trace time
    check_write_kv_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    k_scale: Union[float, torch.Tensor, None] = None,
    v_scale: Union[float, torch.Tensor, None] = None,
    backend: str = "auto",
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`paged_kernels.attention.paged_attention` through the `paged_kernels::paged_attention`
    operator (same arguments and results, no `check`); traceable with `torch.compile(fullgraph=
    True)`. Allocates `out` (contiguous, like `query`) when not given and, with `return_lse`, a
    float32 `[num_tokens, num_heads]` lse; returns `out` or `(out, lse)`."""
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    lse = None
    if return_lse:
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    torch.ops.paged_kernels.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out, lse, scale,
        sliding_window, soft_cap, alibi_slopes, _scale_tensor(k_scale, key_cache),
        _scale_tensor(v_scale, key_cache), backend)
    if lse is not None:
        return out, lse
    return out


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: Union[float, torch.Tensor, None] = None,
    v_scale: Union[float, torch.Tensor, None] = None,
    backend: str = "auto",
) -> None:
    """`paged_kernels.attention.write_kv` through the `paged_kernels::write_kv` operator: writes
    `key[i]`/`value[i]` to slot `slot_mapping[i]` of the caches in place (negative slots
    skipped); traceable with `torch.compile(fullgraph=True)`."""
    torch.ops.paged_kernels.write_kv(key, value, key_cache, value_cache, slot_mapping,
                                     _scale_tensor(k_scale, key_cache),
                                     _scale_tensor(v_scale, key_cache), backend)


def _scale_tensor(scale: Union[float, torch.Tensor, None],
                  cache: torch.Tensor) -> Optional[torch.Tensor]:
    """A float scale as a float32 tensor `[1]` on the cache's device (the operators take tensors);
    anything else unchanged, for the operator's checks to judge."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        device = cache.device if isinstance(cache, torch.Tensor) else None
        return torch.full((1,), float(scale), dtype=torch.float32, device=device)
    return scale
