"""What the device can do at best, measured in the same run as the kernels, so that kernel numbers
from different machines compare as fractions of these ceilings:

- copy bandwidth: a large device-to-device copy, counted as bytes read + bytes written;
- matmul rate: a large square matmul, 2 * n**3 flops (and on the CPU an int8 one, int8 x int8
  into int32 through oneDNN's VNNI path, `torch._int_mm`: the rate for int8-activation kernels);
- int8 block rate (CPU, AVX-512 VNNI): the instruction mix of an int8 matmul whose operands
  carry a scale per block of 32 inputs, GGUF weights times Q8 activations
  (bench/csrc/int8_block_mix.cpp): 8 vpdpbusd and the block's scaling (a multiply, two fmas)
  per row and block, on operands in L1. Where those share execution pipes (Zen 4), it is 8/11
  of the rate of `vpdpbusd` alone: the ceiling of the engine's `gguf-int8` matmuls;
- read bandwidth (CPU): one buffer in huge pages, larger than the last-level cache, summed by
  every thread over its contiguous share (bench/csrc/read_ceiling.cpp): the rate at which a
  decode step can stream its weights and its K/V, which only read. On a 2-vCPU VM it differs
  from the copy rate in both directions from one memory phase to the next, so kernels that
  stream read-only bytes are measured against it, in the same run.

On a GPU the sizes are large enough to leave every cache behind (1 GiB copy, n = 8192 matmul); on
the CPU they are small enough to finish in a second or two.

    python -m bench.ceilings [--device cuda|cpu] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path
from typing import Any, Optional

import torch

from bench.timing import median_seconds

GPU_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 64 << 20
GPU_MATMUL_N = 8192
CPU_MATMUL_N = 1024
CPU_READ_BYTES = 256 << 20
READ_SOURCE = Path(__file__).resolve().parent / "csrc" / "read_ceiling.cpp"
BLOCK_MIX_SOURCE = Path(__file__).resolve().parent / "csrc" / "int8_block_mix.cpp"


def copy_bandwidth(device: str, nbytes: Optional[int] = None, repeat: int = 10) -> dict:
    """GB/s of `dst.copy_(src)` for `nbytes`-byte tensors on `device` (read + write counted)."""
    if nbytes is None:
        nbytes = GPU_COPY_BYTES if device == "cuda" else CPU_COPY_BYTES
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, repeat=repeat)
    moved = 2 * src.numel() * src.element_size()
    return {"copy_bytes": moved, "copy_seconds": seconds, "copy_GBps": moved / seconds / 1e9}


def read_bandwidth(nbytes: int = CPU_READ_BYTES, threads: Optional[int] = None,
                   repeat: int = 10) -> dict:
    """GB/s of reading an `nbytes` CPU buffer in huge pages (`paged_kernels.empty_cache`, where
    Linux offers them) on `threads` threads (default torch's count), the median of `repeat`."""
    from paged_kernels.cache_memory import empty_cache

    threads = torch.get_num_threads() if threads is None else threads
    words = empty_cache((nbytes // 8,), torch.int64)
    words.fill_(1)  # resident before the timing
    lib = _read_library()
    seconds = median_seconds(
        lambda: lib.read_words(words.data_ptr(), words.numel(), threads), "cpu", repeat=repeat)
    moved = words.numel() * 8
    return {"read_bytes": moved, "read_seconds": seconds, "read_GBps": moved / seconds / 1e9,
            "read_threads": threads}


def _read_library() -> Any:
    from paged_kernels.cpp_build import BASE_FLAGS, load_library

    lib = load_library(READ_SOURCE, "bench_read_ceiling", list(BASE_FLAGS), "bench read ceiling")
    lib.read_words.restype = ctypes.c_uint64
    lib.read_words.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lib


def matmul_rate(device: str, dtype: torch.dtype, n: Optional[int] = None,
                repeat: int = 10) -> dict:
    """TFLOP/s of an `n x n` by `n x n` matmul in `dtype` on `device`."""
    if n is None:
        n = GPU_MATMUL_N if device == "cuda" else CPU_MATMUL_N
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = median_seconds(lambda: torch.matmul(a, b, out=out), device, repeat=repeat)
    return {"matmul_dtype": str(dtype).replace("torch.", ""), "matmul_n": n,
            "matmul_seconds": seconds, "matmul_TFLOPs": 2 * n ** 3 / seconds / 1e12}


def int8_matmul_rate(n: int = CPU_MATMUL_N, repeat: int = 10) -> dict:
    """TOP/s of an `n x n` by `n x n` int8 matmul into int32 on the CPU (`torch._int_mm`)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (n, n), generator=gen, dtype=torch.int8)
    b = torch.randint(-127, 128, (n, n), generator=gen, dtype=torch.int8)
    seconds = median_seconds(lambda: torch._int_mm(a, b), "cpu", repeat=repeat)
    return {"int8_matmul_n": n, "int8_matmul_seconds": seconds,
            "int8_matmul_TOPs": 2 * n ** 3 / seconds / 1e12}


def int8_block_rate(threads: Optional[int] = None, iterations: int = 4_000_000,
                    repeat: int = 5) -> dict:
    """TOP/s of the int8 block mix (bench/csrc/int8_block_mix.cpp) on `threads` threads (default
    torch's count), `iterations` per thread, the median of `repeat` runs; {} on a CPU or build
    without AVX-512 VNNI (the int8 kernel's AVX2 path has another mix)."""
    threads = torch.get_num_threads() if threads is None else threads
    lib = _block_mix_library()
    sink = ctypes.c_float()
    runs = sorted(lib.int8_block_mix(iterations, threads, ctypes.byref(sink))
                  for _ in range(repeat))
    seconds = runs[len(runs) // 2]
    if seconds < 0:
        return {}
    ops = lib.int8_block_mix_ops_per_iteration() * iterations * threads
    return {"int8_block_seconds": seconds, "int8_block_threads": threads,
            "int8_block_TOPs": ops / seconds / 1e12}


def _block_mix_library() -> Any:
    from engine.native_build import INT8_TIERS
    from paged_kernels.cpp_build import compile_flags, load_library

    lib = load_library(BLOCK_MIX_SOURCE, "bench_int8_block_mix", compile_flags(INT8_TIERS),
                       "bench int8 block mix")
    lib.int8_block_mix.restype = ctypes.c_double
    lib.int8_block_mix.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_float)]
    lib.int8_block_mix_ops_per_iteration.restype = ctypes.c_int64
    return lib


def measure_ceilings(device: str, dtype: torch.dtype) -> dict:
    """Copy bandwidth and the matmul rate in `dtype` (the kernels' dtype), one dict."""
    return {**copy_bandwidth(device), **matmul_rate(device, dtype)}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Measure the copy bandwidth and matmul rate.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None,
                        help="matmul dtype (default: bfloat16 on cuda, float32 on cpu)")
    args = parser.parse_args(argv)
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    print(json.dumps(measure_ceilings(args.device, getattr(torch, dtype_name)), indent=2))


if __name__ == "__main__":
    main()
