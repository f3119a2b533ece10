"""`paged_kernels.kv_quant` (the reference definition of the 8-bit caches) against the tests' own
quantisation (tests/oracle.py), and that oracle against values read off the formats' tables.

The hard cases of each format: every representable value, every midpoint between neighbours (a
tie, rounded to the even code) and the float32 values just beside it, subnormals, saturation of
values and infinities, signed zeros and NaN.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from oracle import dequantize_oracle, fp8_decode, quantize_oracle

from paged_kernels.kv_quant import FP8_MAX, INT8_RANGE, QUANTIZED_CACHE_DTYPES, dequantize, quantize

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def test_oracle_decodes_the_formats_known_values() -> None:
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    assert fp8_decode(0x7E, e4m3) == 448.0 == FP8_MAX[e4m3]
    assert math.isnan(fp8_decode(0x7F, e4m3)) and math.isnan(fp8_decode(0xFF, e4m3))
    assert fp8_decode(0x01, e4m3) == 2.0 ** -9 and fp8_decode(0x08, e4m3) == 2.0 ** -6
    assert fp8_decode(0x38, e4m3) == 1.0 and fp8_decode(0xB9, e4m3) == -1.125
    assert fp8_decode(0x7B, e5m2) == 57344.0 == FP8_MAX[e5m2]
    assert fp8_decode(0x7C, e5m2) == math.inf and fp8_decode(0xFC, e5m2) == -math.inf
    assert all(math.isnan(fp8_decode(c, e5m2)) for c in (0x7D, 0x7E, 0x7F))
    assert fp8_decode(0x01, e5m2) == 2.0 ** -16 and fp8_decode(0x3C, e5m2) == 1.0


def _hard_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the fp8 format, the midpoints between neighbours, the float32
    values beside each midpoint, values beyond the largest, infinities, zeros and NaN."""
    values = np.unique([fp8_decode(c, dtype) for c in range(0x80)
                        if math.isfinite(fp8_decode(c, dtype))]).astype(np.float32)
    mids = ((values[1:].astype(np.float64) + values[:-1]) / 2).astype(np.float32)
    beside = np.concatenate([np.nextafter(mids, np.float32(np.inf)),
                             np.nextafter(mids, np.float32(0))])
    top = np.float32(FP8_MAX[dtype])
    extra = np.array([top * 1.03, top * 1.07, top * 4, np.inf, 0.0, np.nan], dtype=np.float32)
    x = np.concatenate([values, mids, beside, extra])
    return torch.from_numpy(np.concatenate([x, -x]))


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_quantize_equals_the_oracle_on_the_hard_values(dtype: torch.dtype) -> None:
    x = _hard_values(dtype).view(-1, 1, 1)  # [n, num_kv_heads=1, 1], scale 1: y = x exactly
    got = quantize(x, torch.ones(1), dtype).view(torch.uint8)
    want = quantize_oracle(x, [1.0], dtype)
    nan = torch.isnan(x)
    assert torch.isnan(got[nan].view(dtype).float()).all(), "NaN must stay NaN"
    assert torch.equal(got[~nan], want[~nan])
    top = FP8_MAX[dtype]
    assert dequantize(got.view(dtype), torch.ones(1))[~nan].abs().max() == top  # saturated


def test_fp8_rounds_ties_to_even() -> None:
    """1 + 1/16 lies halfway between e4m3's 1 and 1.125 and goes to 1 (even code);
    1 + 3/16 halfway between 1.125 and 1.25 goes to 1.25."""
    x = torch.tensor([1.0625, 1.1875, -1.0625]).view(3, 1)
    got = quantize(x, torch.ones(1), torch.float8_e4m3fn).float().flatten().tolist()
    assert got == [1.0, 1.25, -1.0]


def test_int8_rounds_half_to_even_clamps_and_zeroes_nan() -> None:
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.5, 300.0, -128.5, -129.0,
                      math.inf, -math.inf, math.nan, -0.0]).view(-1, 1)
    got = quantize(x, torch.ones(1), torch.int8)
    assert got.flatten().tolist() == [0, 2, 2, 0, -2, 126, 127, 127, -128, -128, 127, -128, 0, 0]
    assert torch.equal(got.view(torch.uint8), quantize_oracle(x, [1.0], torch.int8))
    assert INT8_RANGE == (-128, 127)


@pytest.mark.parametrize("dtype", QUANTIZED_CACHE_DTYPES, ids=str)
def test_per_head_scales_on_a_cache_shaped_tensor(dtype: torch.dtype) -> None:
    """Scale `h` divides KV head `h` (dim 1) of a `[num_blocks, num_kv_heads, block_size,
    head_size]` tensor; the division is float32's, then the conversion; `dequantize` is
    `float32(q) * scale[h]`, as the oracle reads it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, 16, generator=gen, dtype=torch.float64) * 50
    scale = torch.tensor([0.03, 0.5, 1.0, 7.0])
    got = quantize(x, scale, dtype).view(torch.uint8)
    want = quantize_oracle(x, scale.tolist(), dtype)
    assert torch.equal(got, want)
    back = dequantize(got.view(dtype), scale)
    assert back.dtype == torch.float32
    assert torch.equal(back.double(), dequantize_oracle(want, scale.tolist(), dtype))


def test_quantize_refuses_a_float_dtype() -> None:
    with pytest.raises(ValueError, match="dtype: expected one of .*float16"):
        quantize(torch.ones(2, 1), torch.ones(1), torch.float16)
