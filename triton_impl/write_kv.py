"""`write_kv` as a Triton kernel: scatter new K/V rows into their cache slots.

`_write_kv_kernel`
    grid: (num_tokens,). One program owns one token: it copies that token's
    [num_kv_heads, head_size] key and value rows to slot `slot_mapping[token]` =
    block * block_size + offset of both caches; into an 8-bit cache it stores
    `quantize(row / scale[kv_head])` (docs/abi.md: fp8 saturates to the format's largest finite
    value and rounds to nearest even, NaN stays NaN; int8 rounds half to even, clamps to
    [-128, 127], NaN -> 0).
    Bytes moved: 2 * num_kv_heads * head_size * (elem read + cache elem written) per token, + 8
    for the slot (+ 8 * num_kv_heads for the scales).
    Invariants: slots are distinct among the non-negative ones (docs/abi.md). A negative slot is
    skipped; so is a slot >= num_slots = num_blocks * block_size, which the host rejects first
    when content checks are on -- the kernel never writes outside the caches.

Rounding is done in float32 before the store: a value is first rounded to the target format's
grid (to nearest even, by adding and subtracting a power-of-two-scaled 1.5 * 2^23), so the final
conversion to the cache type is exact whatever rounding the conversion itself uses (Triton's
interpreter does not round fp8 ties to even; GPUs without fp8 instructions convert in software).

Interpreter workaround (Triton 3.9): its float32 -> fp8 conversion truncates bits and turns NaN
into a finite e4m3 value, so under the interpreter only (`NAN_STAND_IN`, see
`runtime.interpreting`) NaN is replaced by the finite float32 whose truncation is the format's
NaN byte (+-480 for e4m3fn, +-114688 for e5m2). On the GPU NaN is converted as it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_impl import runtime

#: fp8 cache dtype -> the float32 the interpreter's truncating conversion turns into its NaN byte.
_INTERPRETER_NAN = {torch.float8_e4m3fn: 480.0, torch.float8_e5m2: 114688.0}
#: Cache dtype -> (QUANT code, largest finite value, mantissa bits, smallest normal exponent).
_FORMATS = {
    torch.float8_e4m3fn: (1, 448.0, 3, -6),
    torch.float8_e5m2: (1, 57344.0, 2, -14),
    torch.int8: (2, 127.0, 0, 0),
}


@triton.jit
def _fp8_grid(x, MAX_FINITE: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
              NAN_STAND_IN: tl.constexpr):
    """`x` saturated to +-MAX_FINITE and rounded to nearest even onto the grid of a float8
    format with MANTISSA bits and smallest normal exponent MIN_EXP (subnormals included); the
    sign of zero kept, NaN kept (or, if NAN_STAND_IN is not 0, replaced by +-NAN_STAND_IN: the
    interpreter workaround of the module docstring)."""
    a = tl.minimum(tl.abs(x), MAX_FINITE)
    exponent = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 127 + MIN_EXP)
    # 1.5 * 2^23 * ulp, where ulp = 2^(exponent - 127 - MANTISSA) is the grid step at |x|
    shift = (((exponent - MANTISSA + 23) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (a + shift) - shift
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31
    if NAN_STAND_IN != 0.0:
        nan = (sign | tl.full(x.shape, NAN_STAND_IN, tl.float32).to(tl.int32, bitcast=True))
        r = tl.where(x != x, nan, r.to(tl.int32, bitcast=True) | sign).to(tl.float32,
                                                                            bitcast=True)
    else:
        r = tl.where(x != x, x, (r.to(tl.int32, bitcast=True) | sign).to(tl.float32,
                                                                         bitcast=True))
    return r


@triton.jit
def _quantize(x, scale, QUANT: tl.constexpr, MAX_FINITE: tl.constexpr, MANTISSA: tl.constexpr,
              MIN_EXP: tl.constexpr, NAN_STAND_IN: tl.constexpr):
    """The value to store: `x` itself for a float cache (QUANT 0), else `x / scale` on the
    fp8 grid (QUANT 1) or the int8 grid (QUANT 2), as float32."""
    if QUANT == 0:
        r = x
    else:
        y = x.to(tl.float32) / scale
        if QUANT == 1:
            r = _fp8_grid(y, MAX_FINITE, MANTISSA, MIN_EXP, NAN_STAND_IN)
        else:
            # + and - 1.5 * 2^23 rounds |y| < 2^22 to an integer, to nearest even
            r = (tl.minimum(tl.maximum(y, -128.0), 127.0) + 12582912.0) - 12582912.0
            r = tl.where(y != y, 0.0, r)
    return r


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_scale_ptr, v_scale_ptr, num_slots,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ch, stride_co, stride_db, stride_dh, stride_do,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr,
    MAX_FINITE: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
    NAN_STAND_IN: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_PAD)
    h_ok = h < NUM_KV_HEADS
    mask = h_ok[:, None] & (d < HEAD_SIZE)[None, :]
    k_scale = 1.0
    v_scale = 1.0
    if QUANT != 0:
        k_scale = tl.load(k_scale_ptr + h, mask=h_ok, other=1.0)[:, None]
        v_scale = tl.load(v_scale_ptr + h, mask=h_ok, other=1.0)[:, None]
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd,
                mask=mask)
    k = _quantize(k, k_scale, QUANT, MAX_FINITE, MANTISSA, MIN_EXP, NAN_STAND_IN)
    v = _quantize(v, v_scale, QUANT, MAX_FINITE, MANTISSA, MIN_EXP, NAN_STAND_IN)
    tl.store(k_cache_ptr + block * stride_cb + offset * stride_co + h[:, None] * stride_ch
             + d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_db + offset * stride_do + h[:, None] * stride_dh
             + d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """`cache[slot // block_size, :, slot % block_size] = row` for every non-negative slot,
    quantised with the per-KV-head `k_scale` / `v_scale` (float32 `[num_kv_heads]`, given
    exactly when the caches are 8-bit).

    Arguments were checked by `paged_kernels.attention.write_kv`, and slots past the cache too
    when content checks were requested (docs/abi.md); otherwise (no host synchronisation) the
    kernel skips them.
    """
    num_blocks, num_kv_heads, block_size, head_size = key_cache.shape
    num_slots = num_blocks * block_size
    head_pad = triton.next_power_of_2(head_size)
    quant, max_finite, mantissa, min_exp = _FORMATS.get(key_cache.dtype, (0, 0.0, 0, 0))
    nan_stand_in = _INTERPRETER_NAN.get(key_cache.dtype, 0.0) if runtime.interpreting() else 0.0
    _write_kv_kernel[(key.shape[0],)](
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, num_slots,
        *key.stride(), *value.stride(), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, QUANT=quant,
        MAX_FINITE=max_finite, MANTISSA=mantissa, MIN_EXP=min_exp, NAN_STAND_IN=nan_stand_in,
        num_warps=4 if num_kv_heads * head_pad >= 1024 else 1)
