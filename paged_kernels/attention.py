"""The public API: paged attention and the cache operations over a block-table KV cache.

The ABI (layouts, positions, masks, what is never read, errors) is stated once in docs/abi.md and
checked once in `paged_kernels.abi`; every backend implements exactly that. A model that runs one
step's metadata through many layers checks it once with `plan(...)` and calls the returned
`AttentionPlan`'s `run` / `write_kv` per layer (paged_kernels/plan.py).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from paged_kernels.abi import (
    check_attention_args,
    check_attention_contents,
    check_copy_blocks_args,
    check_merge_args,
    check_scales_now,
    check_slot_contents,
    check_swap_blocks_args,
    check_write_kv_args,
    content_checks_requested,
)
from paged_kernels.backends import NativeEntryPoints, call_write_kv, resolve_backend
from paged_kernels.plan import AttentionPlan, plan

#: A scale argument: a float, or a float32 tensor `[1]` or `[num_kv_heads]`.
ScaleArg = Union[float, torch.Tensor, None]

__all__ = ["paged_attention", "write_kv", "copy_blocks", "swap_blocks", "merge_attn_states",
           "plan", "AttentionPlan", "NativeEntryPoints"]


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
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
    backend: str = "auto",
    check: Optional[bool] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Causal attention of `query` over the paged K/V of each sequence (docs/abi.md).

    Sequence `s` has `seq_lens[s]` tokens in the cache, stored in blocks
    `block_tables[s, :ceil(seq_lens[s] / block_size)]`; its query tokens are
    `query[cu_seqlens_q[s]:cu_seqlens_q[s+1]]` (one per sequence when `cu_seqlens_q` is None) and
    sit at its last positions. Returns `out` (`query`'s shape and dtype), or `(out, lse)` with
    `lse` float32 `[num_tokens, num_heads]` when `return_lse`.

    An 8-bit cache (`torch.float8_e4m3fn`, `torch.float8_e5m2`, `torch.int8`, both caches alike)
    needs `k_scale` and `v_scale`: a float or a float32 tensor `[1]` (per tensor) or
    `[num_kv_heads]` (per KV head); K/V are read as `float32(q) * scale[kv_head]`. A float cache
    has the query's dtype and takes no scales.

    Raises TypeError/ValueError for malformed arguments, NotImplementedError when the chosen
    backend does not support the request, RuntimeError when no backend can run it here.
    `check=True` (or PAGED_KERNELS_CHECK=1) also checks the contents (block ids, lengths).
    """
    problem = check_attention_args(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q=cu_seqlens_q,
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
        alibi_slopes=alibi_slopes, out=out, return_lse=return_lse, k_scale=k_scale,
        v_scale=v_scale)
    impl = resolve_backend(backend, problem.query.device)
    impl.support.check(impl.name, problem)
    contents = impl.always_check_contents or content_checks_requested(check)
    check_scales_now(problem.k_scale, problem.v_scale, contents)
    if contents:
        check_attention_contents(problem)
    if problem.num_tokens:
        impl.paged_attention(problem)
    if return_lse:
        return problem.out, problem.lse  # type: ignore[return-value]
    return problem.out


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
    backend: str = "auto",
    check: Optional[bool] = None,
) -> None:
    """Writes token `i`'s `key[i]`/`value[i]` (`[num_kv_heads, head_size]`) to slot
    `slot_mapping[i] = block * block_size + offset` of the caches; negative slots are skipped.
    Slots must be distinct among the non-negative ones (a slot written twice is undefined).
    `check=True` (or PAGED_KERNELS_CHECK=1) also checks that every slot is in range; backends
    that do not check skip out-of-range slots.

    A float cache has the rows' dtype. An 8-bit cache takes rows of any float dtype and needs
    `k_scale`/`v_scale` (as for `paged_attention`); it stores `convert(float32(x) / scale)`,
    saturating fp8 and rounding to nearest even (docs/abi.md). NotImplementedError when the
    backend does not declare the cache dtype."""
    key, value, k_cache, v_cache, ks, vs = check_write_kv_args(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    impl = resolve_backend(backend, k_cache.device)
    impl.support.check_kv_cache(impl.name, k_cache.dtype, key.dtype)
    if not key.shape[0]:
        return
    contents = impl.always_check_contents or content_checks_requested(check)
    check_scales_now(ks, vs, contents)
    if contents:
        check_slot_contents(slot_mapping, k_cache.shape[0] * k_cache.shape[2])
    call_write_kv(impl, key, value, k_cache, v_cache, slot_mapping, ks, vs)



def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """For each `(src, dst)` row of `block_mapping` (int64 `[n, 2]`), copies block `src` to block
    `dst` in every layer's key and value cache (the copy step of copy-on-write). A `dst` must not
    also be a `src` in the same call."""
    keys, values, mapping = check_copy_blocks_args(key_caches, value_caches, block_mapping)
    if mapping.shape[0]:
        resolve_backend(backend, keys[0].device).copy_blocks(keys, values, mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor, *,
                backend: str = "auto") -> None:
    """For each `(s, d)` row of `block_mapping` (int64 `[n, 2]`, on the CPU), copies block `s` of
    cache `src` to block `d` of cache `dst`. The caches may be on different devices (CPU memory and
    an accelerator) and must agree in dtype and per-block shape."""
    src, dst, mapping = check_swap_blocks_args(src, dst, block_mapping)
    accel = dst.device if dst.device.type != "cpu" else src.device
    if mapping.shape[0]:
        resolve_backend(backend, accel).swap_blocks(src, dst, mapping)


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly combines two attentions of the same queries over disjoint key sets.

    `out_*` are `[num_tokens, num_heads, head_size]`, `lse_*` float32 `[num_tokens, num_heads]`
    (as returned with `return_lse=True`). A side with no visible keys has `lse = -inf` and
    contributes nothing. Returns `(out, lse)` in `out_a`'s dtype and float32.
    """
    check_merge_args(out_a, lse_a, out_b, lse_b)
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse))
    w_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse))
    # where(), not a product, so that an empty side's unwritten (even NaN) rows contribute nothing
    part_a = torch.where(w_a[..., None] > 0, out_a.float() * w_a[..., None], 0.0)
    part_b = torch.where(w_b[..., None] > 0, out_b.float() * w_b[..., None], 0.0)
    merged = part_a + part_b
    return merged.to(out_a.dtype), lse
