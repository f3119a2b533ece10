"""The device's two ceilings, measured in the run that uses them: copy bandwidth (a large
device-to-device copy, bytes read + bytes written) and matmul rate (a large product of random
matrices, never zeros)."""

from __future__ import annotations

import torch

from bench.timing import median_seconds


def copy_bandwidth(device: str, num_bytes: int) -> dict:
    """GB/s of `dst.copy_(src)` for buffers of `num_bytes`, counting read + write."""
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, warmup=3, repeat=20)
    return {"bytes": 2 * num_bytes, "seconds": seconds, "GB/s": 2 * num_bytes / seconds / 1e9}


def matmul_rate(device: str, n: int, dtype: torch.dtype) -> dict:
    """TFLOP/s of an n x n x n product of random matrices in `dtype`."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    seconds = median_seconds(lambda: a @ b, device, warmup=3, repeat=10)
    return {"n": n, "dtype": str(dtype), "seconds": seconds, "TFLOP/s": 2 * n**3 / seconds / 1e12}
