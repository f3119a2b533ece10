"""Compiles the engine's quantized matmuls at first use, as plain shared libraries (no torch
headers: a build takes seconds), through the build helper every C++ build shares
(`paged_kernels.cpp_build`), and wraps them for tensors: `QuantKernel`
(`engine/csrc/quant_matmul.cpp`, float activations) and `Int8Kernel`
(`engine/csrc/int8_matmul.cpp`, int8 activations, AVX-512 VNNI or AVX2) and `TiledKernel`
(`engine/csrc/tiled_matmul.cpp`, bfloat16 activations on tiles of the file's weights, AVX-512 BF16).

SIMD tiers (`TIERS`, `INT8_TIERS`): the quantized matmul's AVX-512 path (F/BW/VL, FMA, F16C), with
the bf16 dot-product path on top when the CPU has AVX-512 BF16, else its AVX2 path (AVX2, FMA,
F16C); the int8 kernel's AVX-512 VNNI path (which also needs BF16, FMA and F16C), else its AVX2
path (with FMA and F16C); the tiled bf16 kernel's AVX-512 BF16 path, with its AMX path on top
when the CPU has AMX tiles and AMX-BF16 (`TILED_TIERS`). Elsewhere
the portable C++ path is compiled.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Callable, Optional

import torch

from paged_kernels.cpp_build import BuildFailed, compile_flags, load_library

__all__ = ["SOURCE", "INT8_SOURCE", "TILED_SOURCE", "TIERS", "INT8_TIERS", "TILED_TIERS",
           "BuildFailed", "QuantKernel", "Int8Kernel", "TiledKernel", "load_quant", "load_int8",
           "load_tiled"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "quant_matmul.cpp"
INT8_SOURCE = Path(__file__).resolve().parent / "csrc" / "int8_matmul.cpp"
TILED_SOURCE = Path(__file__).resolve().parent / "csrc" / "tiled_matmul.cpp"
#: The quantized matmul's SIMD tiers (paged_kernels.cpp_build.ISA): its AVX-512 path, with the
#: bfloat16 dot-product path for bf16 activations (Zen 4, Sapphire Rapids) where the CPU has it,
#: and its AVX2 path (Zen 2/3, Haswell and later) below them.
TIERS = ("avx512 + fma + f16c + bf16", "avx512 + fma + f16c", "avx2 + fma + f16c")
#: The int8 kernel's SIMD paths: VNNI dot products, bf16 output conversion, f16 scales; else
#: AVX2's u8 x s8 pair products (vpmaddubsw) on the same packed layout, with the same bits.
INT8_TIERS = ("avx512 + vnni + bf16 + fma + f16c", "avx2 + fma + f16c")
#: The tiled bf16 kernel's SIMD paths: AMX (TDPBF16PS) from 4 rows on top of vdpbf16ps, nibble
#: table lookups (BW), f16 scales.
TILED_TIERS = ("avx512 + bf16 + fma + f16c + amx", "avx512 + bf16 + fma + f16c")
#: The kernel's codes for the block formats.
_QTYPES = {"Q4_1": 0, "Q8_0": 1}
#: The kernels built in this process, per (source, flags).
_kernels: dict[tuple[str, ...], object] = {}


def _load(kind: type, source: Path, prefix: str, what: str, cflags: list[str]):
    """`kind(library)` for `source` built with `cflags`, once per process and flag set."""
    key = (str(source), *cflags)
    if key not in _kernels:
        _kernels[key] = kind(load_library(source, prefix, cflags, what))
    return _kernels[key]


class QuantKernel:
    """The compiled kernel, called with tensors. `matmul` does not check its inputs:
    `engine.model.quant.quantized_linear` does, and `GGUFBlocks` holds its own invariants."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._matmul = library.quant_matmul
        self._matmul.restype = ctypes.c_int
        self._matmul.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int]
        library.quant_simd_paths.restype = ctypes.c_char_p
        self.simd_paths: str = library.quant_simd_paths().decode()
        """The code paths compiled in: "avx512,bf16-dot", "avx512", "avx2" or "portable"."""

    def matmul(self, x: torch.Tensor, data: torch.Tensor, qtype: str,
               threads: int) -> torch.Tensor:
        """`x @ W.T` for contiguous `x` `[M, cols]` (float32 or bfloat16), W the `[rows, cols]`
        weight whose GGUF blocks of format `qtype` are `data` (`GGUFBlocks.data`: uint8
        `[rows, ...]`), on `threads` OpenMP threads; `[M, rows]` in x's dtype. The call releases
        the GIL (ctypes)."""
        y = torch.empty(x.shape[0], data.shape[0], dtype=x.dtype)
        failed = self._matmul(x.data_ptr(), x.dtype == torch.bfloat16, data.data_ptr(),
                              _QTYPES[qtype], y.data_ptr(), x.shape[0], data.shape[0],
                              x.shape[1], threads)
        assert not failed, "quant_matmul refused inputs that GGUFBlocks accepted"
        return y


def load_quant(cflags: list[str] | None = None) -> QuantKernel:
    """The quantized-matmul kernel built with `cflags` (default: `compile_flags(TIERS)`, this
    CPU's), compiled once per machine and flag set. Tests pass `compile_flags(TIERS, frozenset())`
    for the portable build. Raises BuildFailed when the compile fails."""
    return _load(QuantKernel, SOURCE, "engine_quant", "engine quantized matmul",
                 compile_flags(TIERS) if cflags is None else cflags)


class _PackingKernel:
    """A compiled kernel that repacks GGUF blocks into its own layout (`{prefix}_packed_bytes`,
    `{prefix}_pack`) and says which code path it was compiled with (`{prefix}_simd_paths`).
    Every call releases the GIL (ctypes)."""

    def __init__(self, library: ctypes.CDLL, prefix: str) -> None:
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._prefix = prefix
        self._packed_bytes = getattr(library, f"{prefix}_packed_bytes")
        self._packed_bytes.restype, self._packed_bytes.argtypes = i64, [c_int, i64, i64]
        self._pack = getattr(library, f"{prefix}_pack")
        self._pack.restype, self._pack.argtypes = c_int, [ptr, c_int, i64, i64, ptr, c_int]
        simd_paths = getattr(library, f"{prefix}_simd_paths")
        simd_paths.restype = ctypes.c_char_p
        self.simd_paths: str = simd_paths().decode()
        """The code path compiled in: a SIMD set's name or "portable"."""

    def pack(self, data: torch.Tensor, qtype: str, cols: int, threads: int,
             allocate: Optional[Callable[[int], torch.Tensor]] = None) -> torch.Tensor:
        """The packed form (uint8, 64-byte aligned start) of the `[rows, cols]` weight whose
        GGUF blocks of format `qtype` are `data` (`GGUFBlocks.data`; the kernel's source states
        the layout). `allocate(n)`: where its n bytes go (a contiguous uint8 tensor with a
        64-byte aligned start, e.g. `WeightArena.take`); default a buffer of its own."""
        rows = data.shape[0]
        out = (allocate or _aligned_empty)(self._packed_bytes(_QTYPES[qtype], rows, cols))
        failed = self._pack(data.data_ptr(), _QTYPES[qtype], rows, cols, out.data_ptr(),
                            threads)
        assert not failed, f"{self._prefix}_pack refused inputs that GGUFBlocks accepted"
        return out


class Int8Kernel(_PackingKernel):
    """The compiled int8 kernel (simd_paths "avx512-vnni", "avx2" or "portable"), called with
    tensors (engine/model/quant_int8.py checks inputs). Every call releases the GIL (ctypes)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        super().__init__(library, "int8")
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._quantize = library.int8_quantize
        self._quantize.restype = c_int
        self._quantize.argtypes = [ptr, c_int, i64, i64, ptr, ptr, ptr, c_int]
        self._linear = library.int8_linear
        self._linear.restype = c_int
        self._linear.argtypes = [ptr, c_int, ptr, c_int, ptr, i64, i64, i64, c_int]

    def quantize(self, x: torch.Tensor, threads: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(xq, xd, xs)` of contiguous `x` `[M, K]` (float32 or bfloat16), block-major: xq
        int8 `[K/32, M, 32]`, the scales xd and the sums xd * sum(xq) float32 `[K/32, M]`."""
        rows, cols = x.shape
        xq = torch.empty(cols // 32, rows, 32, dtype=torch.int8)
        xd, xs = torch.empty(2, cols // 32, rows, dtype=torch.float32)
        failed = self._quantize(x.data_ptr(), x.dtype == torch.bfloat16, rows, cols,
                                xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), threads)
        assert not failed, "int8_quantize refused a K that is a multiple of 32"
        return xq, xd, xs

    def linear(self, x: torch.Tensor, packed: torch.Tensor, qtype: str, rows: int,
               threads: int) -> torch.Tensor:
        """`x @ W.T` for contiguous `x` `[M, K]` quantized as `quantize` does (inside the same
        C call), W the `packed` tiles of `rows` features: `[M, rows]` in x's dtype."""
        y = torch.empty(x.shape[0], rows, dtype=x.dtype)
        failed = self._linear(x.data_ptr(), x.dtype == torch.bfloat16, packed.data_ptr(),
                              _QTYPES[qtype], y.data_ptr(), x.shape[0], rows, x.shape[1],
                              threads)
        assert not failed, "int8_linear refused checked inputs"
        return y


def _aligned_empty(size: int, alignment: int = 64) -> torch.Tensor:
    """A uint8 tensor of `size` bytes whose first byte is `alignment`-aligned (a view into a
    slightly larger buffer), so every packed tile-block starts on a cache line."""
    buffer = torch.empty(size + alignment, dtype=torch.uint8)
    shift = -buffer.data_ptr() % alignment
    return buffer[shift:shift + size]


def load_int8(cflags: list[str] | None = None) -> Int8Kernel:
    """The int8 kernel built with `cflags` (default: `compile_flags(INT8_TIERS)`, this CPU's),
    compiled once per machine and flag set. Raises BuildFailed when the compile fails."""
    return _load(Int8Kernel, INT8_SOURCE, "engine_int8", "engine int8 matmul",
                 compile_flags(INT8_TIERS) if cflags is None else cflags)


class TiledKernel(_PackingKernel):
    """The compiled tiled bf16 kernel (simd_paths "avx512-bf16" or "portable"), called with
    tensors (engine/model/quant_tiled.py checks inputs). Every call releases the GIL (ctypes)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        super().__init__(library, "tiled")
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._linear = library.tiled_linear
        self._linear.restype = c_int
        self._linear.argtypes = [ptr, ptr, c_int, ptr, i64, i64, i64, c_int]

    def linear(self, x: torch.Tensor, packed: torch.Tensor, qtype: str, rows: int,
               threads: int) -> torch.Tensor:
        """`x @ W.T` for contiguous bfloat16 `x` `[M, K]`, W the `packed` tiles of `rows`
        features: `[M, rows]` bfloat16."""
        y = torch.empty(x.shape[0], rows, dtype=torch.bfloat16)
        failed = self._linear(x.data_ptr(), packed.data_ptr(), _QTYPES[qtype], y.data_ptr(),
                              x.shape[0], rows, x.shape[1], threads)
        assert not failed, "tiled_linear refused checked inputs"
        return y


def load_tiled(cflags: list[str] | None = None) -> TiledKernel:
    """The tiled bf16 kernel built with `cflags` (default: `compile_flags(TILED_TIERS)`, this
    CPU's), compiled once per machine and flag set. Tests pass `compile_flags(TILED_TIERS,
    frozenset())` for the portable build. Raises BuildFailed when the compile fails."""
    return _load(TiledKernel, TILED_SOURCE, "engine_tiled", "engine tiled bf16 matmul",
                 compile_flags(TILED_TIERS) if cflags is None else cflags)
