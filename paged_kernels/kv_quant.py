"""8-bit KV caches: the readable definitions of quantisation and dequantisation (docs/abi.md).

A cache may store K/V in `torch.float8_e4m3fn`, `torch.float8_e5m2` or `torch.int8`, with a
float32 scale per KV head. `write_kv` stores `q = convert(x_f32 / scale[kv_head])` and
`paged_attention` reads `float32(q) * scale[kv_head]`:
- fp8: saturate to the format's largest finite value (`FP8_MAX`), then round to nearest even
  (torch's conversion of a float32 rounds RNE); NaN stays NaN.
- int8: round half to even, clamp to `INT8_RANGE`; NaN becomes 0 (int8 has no NaN).

The reference backend uses these functions; the tests check every backend against their own,
independent quantisation (tests/oracle.py), never against this module.
"""

from __future__ import annotations

import torch

#: The 8-bit cache storage dtypes, besides the float caches equal to the query's dtype.
QUANTIZED_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)

#: The largest finite value of each fp8 format (e4m3fn has no infinity; e5m2 has).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

#: The int8 range the rounded values are clamped to.
INT8_RANGE = (-128, 127)


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether `dtype` is one of the 8-bit cache dtypes."""
    return dtype in QUANTIZED_CACHE_DTYPES


def _per_head(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`scale` (`[num_kv_heads]`) shaped to broadcast over `x`, whose dim 1 is the KV head."""
    return scale.view(1, -1, *([1] * (x.dim() - 2)))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` (`[n, num_kv_heads, ...]`, any float dtype) stored as `dtype` with the float32 scales
    `scale` (`[num_kv_heads]`): `convert(float32(x) / scale[head])` as the module docstring says."""
    y = x.float() / _per_head(scale, x)
    if dtype == torch.int8:
        low, high = INT8_RANGE
        return torch.round(y).clamp_(low, high).nan_to_num_(0.0).to(torch.int8)
    if dtype not in FP8_MAX:
        raise ValueError(f"dtype: expected one of {QUANTIZED_CACHE_DTYPES}, got {dtype}")
    limit = FP8_MAX[dtype]
    return y.clamp_(-limit, limit).to(dtype)  # clamp keeps NaN; the conversion rounds RNE


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 `float32(q) * scale[head]` of an 8-bit `q` (`[n, num_kv_heads, ...]`)."""
    return q.float() * _per_head(scale, q)
