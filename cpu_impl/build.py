"""Compiles `csrc/paged_attention.cpp` (and the headers it includes) at first use, through the
build helper every C++ build shares (`paged_kernels.cpp_build`: flags, cache, lock, loader).

SIMD tiers: AVX2 + FMA + F16C; on top of them AVX-512 F/BW/VL/DQ with BF16's vdpbf16ps when
/proc/cpuinfo lists all of those too; on top of that AMX-TILE and AMX-BF16 (Q.K^T on tiles,
csrc/amx.h) when it lists those; elsewhere the portable C++ path.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Optional

from paged_kernels import cpp_build
from paged_kernels.cpp_build import BuildFailed

__all__ = ["SOURCE", "TIERS", "BuildFailed", "compile_flags", "extension_name", "load"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"
TIERS = ("avx2 + fma + f16c + avx512 + avx512dq + bf16 + amx",
         "avx2 + fma + f16c + avx512 + avx512dq + bf16 + vbmi",
         "avx2 + fma + f16c + avx512 + avx512dq + bf16", "avx2 + fma + f16c")
_PREFIX = "pk_cpu"


def compile_flags(cpu: Optional[frozenset[str]] = None) -> list[str]:
    """The kernel's flags for a CPU with /proc/cpuinfo flags `cpu` (default this machine's)."""
    return cpp_build.compile_flags(TIERS, cpu)


def extension_name(cflags: list[str]) -> str:
    """A name unique to the sources and the flags (the build cache's key)."""
    return cpp_build.extension_name(_PREFIX, SOURCE, cflags)


def load(cflags: Optional[list[str]] = None) -> ModuleType:
    """The compiled module for `cflags` (default: `compile_flags()`), built on the first call of
    the process for those flags and cached on disk after. Tests pass the portable flags
    (`compile_flags(frozenset())`) to check the non-SIMD code path too."""
    return cpp_build.load(SOURCE, _PREFIX, compile_flags() if cflags is None else cflags,
                          "paged_kernels cpu backend")
