"""Dense float64 attention on unpaged K/V: the oracle. Shares no code with any backend.

Written as directly as possible from docs/abi.md, one sequence and one head at a time. The 8-bit
cache formats are decoded from their bit layouts and encoded with numpy (`quantize_oracle`,
`dequantize_oracle`), independently of `paged_kernels.kv_quant` and of torch's fp8 conversions.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch


def attention_oracle(
    query: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
    q_lens: Sequence[int], *, scale: Optional[float] = None, sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out float64 [num_tokens, num_heads, head_size], lse float64 [num_tokens, heads]).

    `keys[s]`/`values[s]` are sequence s's K/V `[seq_len, num_kv_heads, head_size]`; its
    `q_lens[s]` query tokens are the next rows of `query` and sit at its last positions.
    """
    num_tokens, num_heads, head_size = query.shape
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    out = torch.empty(num_tokens, num_heads, head_size, dtype=torch.float64)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float64)
    t = 0
    for k, v, q_len in zip(keys, values, q_lens):
        k, v = k.double().cpu(), v.double().cpu()
        seq_len, num_kv_heads = k.shape[0], k.shape[1]
        group = num_heads // num_kv_heads
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            q = query[t].double().cpu()
            for h in range(num_heads):
                kh, vh = k[lo:pos + 1, h // group], v[lo:pos + 1, h // group]
                s = (kh @ q[h]) * scale
                if soft_cap is not None:
                    s = soft_cap * torch.tanh(s / soft_cap)
                if alibi_slopes is not None:
                    k_pos = torch.arange(lo, pos + 1, dtype=torch.float64)
                    s = s + float(alibi_slopes[h]) * (k_pos - pos)
                m = s.max()
                w = torch.exp(s - m)
                lse[t, h] = m + torch.log(w.sum())
                out[t, h] = (w / w.sum()) @ vh
            t += 1
    return out, lse


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64; NaN anywhere gives inf."""
    x = x.double().cpu()
    ref = ref.double().cpu()
    if not torch.isfinite(x).all():
        return math.inf
    norm = torch.linalg.vector_norm
    return float(norm(x - ref) / norm(ref).clamp_min(1e-300))


# --- 8-bit caches: an independent quantisation, from the formats' bit layouts (docs/abi.md) -----
# (exponent bits, mantissa bits, has infinities); e4m3fn spends its top code on NaN only.
FP8_FORMATS = {torch.float8_e4m3fn: (4, 3, False), torch.float8_e5m2: (5, 2, True)}


def fp8_decode(code: int, dtype: torch.dtype) -> float:
    """The value of the fp8 byte `code`, from its sign, exponent and mantissa fields."""
    e_bits, m_bits, has_inf = FP8_FORMATS[dtype]
    bias = 2 ** (e_bits - 1) - 1
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> m_bits) & (2 ** e_bits - 1)
    mantissa = code & (2 ** m_bits - 1)
    top = exponent == 2 ** e_bits - 1
    if top and (has_inf or mantissa == 2 ** m_bits - 1):
        return sign * math.inf if has_inf and mantissa == 0 else math.nan
    if exponent == 0:
        return sign * mantissa * 2.0 ** (1 - bias - m_bits)
    return sign * (1 + mantissa / 2 ** m_bits) * 2.0 ** (exponent - bias)


def _fp8_grid(dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The finite non-negative values of the format, ascending, and their codes."""
    codes = [c for c in range(0x80) if math.isfinite(fp8_decode(c, dtype))]
    values = np.array([fp8_decode(c, dtype) for c in codes])
    order = np.argsort(values)
    return values[order], np.array(codes, dtype=np.uint8)[order]


def _fp8_encode(y: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float32 `y` to fp8 bytes: saturate to the largest finite value, round to nearest even on
    the format's grid (mantissa quantum from the exponent; subnormals below the smallest normal)."""
    e_bits, m_bits, _ = FP8_FORMATS[dtype]
    values, codes = _fp8_grid(dtype)
    bias = 2 ** (e_bits - 1) - 1
    mag = np.minimum(np.abs(y.astype(np.float64)), values[-1])
    _, exp = np.frexp(np.maximum(mag, 2.0 ** (1 - bias)))  # mag = m * 2**exp, m in [0.5, 1)
    quantum = np.ldexp(1.0, exp - 1 - m_bits)
    rounded = np.rint(np.nan_to_num(mag) / quantum) * quantum  # np.rint: half to even
    index = np.searchsorted(values, rounded)
    assert np.array_equal(values[index], rounded), "rounded off the format's grid"
    out = codes[index] | np.where(np.signbit(y), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(y), np.uint8(0x7F), out).astype(np.uint8)


def quantize_oracle(x: torch.Tensor, scale: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """The bytes (uint8, `x`'s shape) an 8-bit cache of `dtype` stores for `x` (`[n, num_kv_heads,
    ...]`) with per-head float32 scales: `convert(float32(x) / float32(scale[head]))`. NaN is 0x7F
    in fp8 (any NaN byte is right: compare NaN-ness, not NaN payloads) and 0 in int8."""
    s = np.asarray(scale, dtype=np.float32).reshape(1, -1, *([1] * (x.dim() - 2)))
    y = x.detach().cpu().float().numpy() / s  # float32 division, correctly rounded
    if dtype == torch.int8:
        q = np.clip(np.rint(np.nan_to_num(y, nan=0.0, posinf=127.0, neginf=-128.0)), -128, 127)
        return torch.from_numpy(q.astype(np.int8).view(np.uint8))
    return torch.from_numpy(_fp8_encode(y, dtype))


def dequantize_oracle(codes: torch.Tensor, scale: Sequence[float],
                      dtype: torch.dtype) -> torch.Tensor:
    """float64 values of 8-bit bytes (uint8 `[n, num_kv_heads, ...]`): `decode(code) *
    scale[head]` rounded once to float32, as the ABI reads them (the float64 product is exact:
    at most 8 + 24 significant bits)."""
    c = codes.cpu().numpy().astype(np.int64)
    if dtype == torch.int8:
        v = (c.astype(np.uint8).view(np.int8)).astype(np.float64)
    else:
        table = np.array([fp8_decode(k, dtype) for k in range(256)])
        v = table[c]
    s = np.asarray(scale, dtype=np.float32).astype(np.float64)
    product = v * s.reshape(1, -1, *([1] * (c.ndim - 2)))
    return torch.from_numpy(product.astype(np.float32).astype(np.float64))
