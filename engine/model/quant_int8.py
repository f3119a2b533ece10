"""Int8 matmuls on a GGUF file's weights (`quantization="gguf-int8"`): llama.cpp's CPU scheme.

The projection weights keep the file's Q4_1 / Q8_0 values exactly, repacked once at load time into
tiles of 16 output features (`Int8Weight`); every matmul quantizes its activations to int8 per
block of 32 (scale = absmax / 127, round half to even) and sums the products in int32 with AVX-512
VNNI (`vpdpbusd`, 64 products per instruction: twice the multiply rate of the bfloat16 dot product
on Zen 4, and a quarter of bfloat16's weight bytes for Q4_1), or on CPUs with AVX2 (FMA, F16C) but
no VNNI with AVX2's `vpmaddubsw`, with the same result bit for bit. Only the activations are
approximated: a relative error of up to 1/254 of each block's largest value per element, as in
llama.cpp. `engine/csrc/int8_matmul.cpp` states the arithmetic and the packed layout exactly;
docs/quant.md has the measurements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from engine.model.packed_weight import LazyKernel, PackedWeight

if TYPE_CHECKING:
    from engine.model.gguf_blocks import GGUFBlocks
    from engine.model.weight_arena import WeightArena
    from engine.native_build import Int8Kernel

__all__ = ["Int8Weight", "pack_int8", "int8_linear", "int8_kernel_problem"]


class Int8Weight(PackedWeight):
    """One `[rows, cols]` weight in the int8 kernel's tiled layout: `packed` is uint8, `qtype`
    the GGUF format it came from ("Q4_1" or "Q8_0")."""


def pack_int8(blocks: "GGUFBlocks", kernel: Optional["Int8Kernel"] = None,
              arena: Optional["WeightArena"] = None) -> Int8Weight:
    """The tiled form of `blocks` (the same weights, bit for bit). `kernel`: a build of the
    kernel (tests pass the portable one); default this machine's."""
    return Int8Weight.pack(blocks, _KERNEL.get(kernel), arena)


def int8_linear(x: torch.Tensor, weight: Int8Weight,
                kernel: Optional["Int8Kernel"] = None) -> torch.Tensor:
    """`x @ W.T` for `x` `[M, cols]` (float32 or bfloat16, CPU), with x quantized to int8 per
    block of 32 and W the file's exact weights; returns `[M, rows]` in x's dtype (bfloat16
    rounded to nearest even once). Runs on torch's thread count; the result does not depend
    on it."""
    if x.dim() != 2 or x.shape[1] != weight.cols or x.dtype not in X_DTYPES or not x.is_cpu:
        raise bad_x(x, weight.cols)  # one combined test: this runs ~120 times per decode step
    return _KERNEL.get(kernel).linear(x.contiguous(), weight.packed, weight.qtype, weight.rows,
                                      torch.get_num_threads())


#: The activation dtypes of both GGUF kernels (this one and engine/model/quant.py's).
X_DTYPES = (torch.float32, torch.bfloat16)


def bad_x(x: torch.Tensor, cols: int) -> ValueError:
    """The error for an activation `x` that is not a `[M, cols]` float32/bfloat16 CPU tensor."""
    if x.dim() != 2 or x.shape[1] != cols:
        return ValueError(f"x: expected a [M, {cols}] tensor, got {tuple(x.shape)}")
    return ValueError(f"x: expected a float32 or bfloat16 CPU tensor, got {x.dtype} on "
                      f"{x.device}")


def _load() -> "Int8Kernel":
    from engine.native_build import load_int8

    return load_int8()


_KERNEL: LazyKernel["Int8Kernel"] = LazyKernel(_load)


def int8_kernel_problem() -> Optional[str]:
    """None when the int8 kernel builds (or is built) on this machine, else what is missing.
    A machine without AVX-512 VNNI gets the AVX2 path, and one without AVX2, FMA or F16C the
    portable (slow) one, which is not a problem."""
    from engine.native_build import BuildFailed

    try:
        _KERNEL.get()
    except BuildFailed as exc:
        return f"its C++ kernel, which did not build: {exc}"
    return None
