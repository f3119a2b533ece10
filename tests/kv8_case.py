"""8-bit KV cache cases for the backend tests of the triton and cuda-host backends.

`quantize` is an independent definition of what `write_kv` stores (docs/abi.md), written with
torch's own conversions (float32 division, clamp, then `.to(float8)`, which rounds to nearest
even; `torch.round` for int8); it shares no code with `paged_kernels.kv_quant` or any backend.
`quantized_case` turns a tests/paged_case.py case into one with an 8-bit cache and, as its truth,
the dequantised values `float64(q) * scale[kv_head]`, so tests/oracle.py checks the result.
"""

from __future__ import annotations

import dataclasses

import torch
from paged_case import PagedCase

CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
MAX_FINITE = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x / scale` (float32, `scale` broadcast against `x`) stored in `dtype`: fp8 saturates to
    +-max finite and rounds to nearest even, NaN stays NaN; int8 rounds half to even, clamps to
    [-128, 127], NaN -> 0."""
    y = x.float() / scale
    if dtype == torch.int8:
        return torch.where(y.isnan(), 0.0, torch.round(y.clamp(-128.0, 127.0))).to(torch.int8)
    limit = MAX_FINITE[dtype]
    return torch.where(y.isnan(), y, y.clamp(-limit, limit)).to(dtype)


def special_values() -> torch.Tensor:
    """float32 values that probe the rounding: ties between neighbours of every format (fp8
    e4m3 and e5m2 grid midpoints, int8 halves), subnormals, signed zeros, saturation,
    infinities; 64 of them."""
    ties = [1.0625, 1.1875, 2.125, -3.25, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.5,
            1.125, 1.375, 0.15625, -0.21875, 208.0, 464.0, 240.0, 61440.0]
    small = [2.0 ** -9, 3 * 2.0 ** -10, 2.0 ** -10, -2.0 ** -11, 2.0 ** -16, 2.0 ** -17,
             3 * 2.0 ** -17, 2.0 ** -7 * 1.0625, 1e-30]
    big = [448.0, 449.0, 480.0, 500.0, -1e4, 57344.0, 61439.0, 1e6, -1e9, 3e38,
           float("inf"), float("-inf"), 127.0, 128.0, -128.0, -129.0]
    signs = [0.0, -0.0]
    values = ties + small + big + signs
    rest = torch.linspace(-300.0, 300.0, 64 - len(values)).tolist()
    return torch.tensor(values + rest, dtype=torch.float32)


def _quantize_cache(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    int8_poison: int) -> torch.Tensor:
    """An 8-bit copy of a float cache `[blocks, kv_heads, block_size, head_size]` whose unused
    slots are NaN: they stay NaN in fp8 and become `int8_poison` in int8 (which has no NaN)."""
    q = quantize(cache, scale[None, :, None, None], dtype)
    if dtype == torch.int8:
        q[cache.isnan()] = int8_poison
    return q


def quantized_case(case: PagedCase, dtype: torch.dtype, k_scale: torch.Tensor,
                   v_scale: torch.Tensor, int8_poison: int = -128) -> PagedCase:
    """`case` with its caches quantised to `dtype` with per-KV-head scales (float32
    `[num_kv_heads]`) and its truth replaced by the dequantised values."""
    def truth(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return quantize(rows, scale[None, :, None], dtype).double() * scale.double()[None, :, None]

    return dataclasses.replace(
        case,
        key_cache=_quantize_cache(case.key_cache, k_scale, dtype, int8_poison),
        value_cache=_quantize_cache(case.value_cache, v_scale, dtype, int8_poison),
        keys=[truth(k, k_scale) for k in case.keys],
        values=[truth(v, v_scale) for v in case.values])


def scales(num_kv_heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct per-KV-head (k_scale, v_scale) in [0.05, 0.55) (the cases' K/V are N(0, 1), so
    the stored values span about +-60 of the format)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(num_kv_heads, generator=g) * 0.5 + 0.05,
            torch.rand(num_kv_heads, generator=g) * 0.5 + 0.05)
