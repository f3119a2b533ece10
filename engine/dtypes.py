"""The model dtypes the engine takes by name (vLLM's names) and what "auto" means on a device.

"auto" is bfloat16 where the device multiplies bfloat16 natively: a CUDA GPU that supports it,
or a CPU with AVX-512 BF16 or AMX-BF16 (`NATIVE_BF16_CPU_FLAGS`). Elsewhere it is float32: a CPU
without those instructions (AVX2-only x86, for example) converts every bfloat16 operand to
float32 inside each matmul, which makes a bfloat16 model several times slower than the same
model in float32, so "auto" never picks it there.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from paged_kernels.cpp_build import cpu_flags

__all__ = ["DTYPE_NAMES", "NATIVE_BF16_CPU_FLAGS", "auto_dtype", "has_native_bf16",
           "resolve_dtype"]

#: Accepted names -> dtype; "auto" -> None (resolved per device by `auto_dtype`).
DTYPE_NAMES: dict[str, Optional[torch.dtype]] = {
    "auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}

#: /proc/cpuinfo flags of x86 instructions that multiply bfloat16 operands directly; any one
#: of them makes bfloat16 the CPU's "auto" dtype.
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def has_native_bf16(device: Union[str, torch.device] = "cpu",
                    flags: Optional[frozenset[str]] = None) -> bool:
    """Whether `device` multiplies bfloat16 natively: on a CPU, whether its feature flags
    (`flags`, default this machine's /proc/cpuinfo) list one of `NATIVE_BF16_CPU_FLAGS`; on a
    CUDA device, `torch.cuda.is_bf16_supported()`."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in NATIVE_BF16_CPU_FLAGS)


def auto_dtype(device: Union[str, torch.device] = "cpu",
               flags: Optional[frozenset[str]] = None) -> torch.dtype:
    """bfloat16 where `has_native_bf16(device, flags)`, float32 elsewhere."""
    return torch.bfloat16 if has_native_bf16(device, flags) else torch.float32


def resolve_dtype(dtype: Union[str, torch.dtype],
                  device: Union[str, torch.device] = "cpu") -> torch.dtype:
    """`dtype` itself when it is a torch.dtype; the dtype a name of `DTYPE_NAMES` stands for,
    "auto" resolved by `auto_dtype(device)`. ValueError naming `dtype` otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        named = DTYPE_NAMES[dtype]
        return auto_dtype(device) if named is None else named
    raise ValueError(f"dtype: expected a torch.dtype or one of {sorted(DTYPE_NAMES)}, "
                     f"got {dtype!r}")
