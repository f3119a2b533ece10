"""This machine's oneDNN bf16 and float32 2048^3 matmul rates at 1 and 2 threads, and its copy
bandwidth (256 MiB, read + written, 2 threads). Usage: python machine.py"""

import time

import torch


def rate(dtype: torch.dtype, threads: int, n: int = 2048, reps: int = 10) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9


def copy_gbps(reps: int = 10) -> float:
    torch.set_num_threads(2)
    x = torch.empty(256 * 2 ** 20 // 4)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    t = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    return 2 * x.numel() * 4 * reps / (time.perf_counter() - t) / 1e9


if __name__ == "__main__":
    for dtype in (torch.bfloat16, torch.float32):
        for threads in (1, 2):
            print(f"{dtype} {threads} thread(s): {rate(dtype, threads):.0f} GFLOP/s")
    print(f"copy: {copy_gbps():.1f} GB/s")
