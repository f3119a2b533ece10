"""`write_kv` as a Triton kernel: scatter new K/V rows into their cache slots.

`_write_kv_kernel`
    grid: (num_tokens,). One program owns one token: it copies that token's
    [num_kv_heads, head_size] key and value rows to slot `slot_mapping[token]` =
    block * block_size + offset of both caches.
    Bytes moved: 2 * num_kv_heads * head_size * elem read and written per token, + 8 for the slot.
    Invariants: slots are distinct among the non-negative ones (docs/abi.md). A negative slot is
    skipped; so is a slot >= num_blocks * block_size, which the host rejects first when content
    checks are on -- the kernel never writes outside the caches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, num_slots,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ch, stride_co, stride_db, stride_dh, stride_do,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_PAD)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_SIZE)[None, :]
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd,
                mask=mask)
    tl.store(k_cache_ptr + block * stride_cb + offset * stride_co + h[:, None] * stride_ch
             + d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + block * stride_db + offset * stride_do + h[:, None] * stride_dh
             + d[None, :], v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`cache[slot // block_size, :, slot % block_size] = row` for every non-negative slot.

    Arguments were checked by `paged_kernels.attention.write_kv`, and slots past the cache too
    when content checks were requested (docs/abi.md); otherwise (no host synchronisation) the
    kernel skips them.
    """
    num_blocks, num_kv_heads, block_size, head_size = key_cache.shape
    num_slots = num_blocks * block_size
    head_pad = triton.next_power_of_2(head_size)
    _write_kv_kernel[(key.shape[0],)](
        key, value, key_cache, value_cache, slot_mapping, num_slots,
        *key.stride(), *value.stride(), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        num_warps=4 if num_kv_heads * head_pad >= 1024 else 1)
