"""Exact bfloat16 matmuls on a GGUF file's weights, tiled (`quantization="gguf"` in bfloat16).

The projection weights keep the file's Q4_1 / Q8_0 values exactly, repacked once at load time into
tiles of 16 output features (`TiledWeight`, the same bytes as the file's blocks); a matmul with
bfloat16 activations forms every product `q x` exactly with AVX-512 BF16's `vdpbf16ps` (16
features x 2 inputs per instruction, the activation pair broadcast) and sums in float32:
`y = sum_b d S + m sum(x)` per block (no m for Q8_0), rounded to bfloat16 once. The unpacked
weights of a tile meet up to 12 activation rows held in registers, so this path beats oneDNN's
dense bfloat16 matmul up to `engine.model.quant.MAX_ROWS[bfloat16]` rows. On a CPU with AMX,
4 rows or more run on AMX tiles (one `TDPBF16PS` per 16 rows x 16 features x 32 inputs), every
row with the bits of the row alone (`engine.model.quant.AMX_BF16_MAX_ROWS` rows at most).
`engine/csrc/tiled_matmul.cpp` states the arithmetic, the summation order and the packed layout
exactly; docs/quant.md has the measurements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from engine.model.packed_weight import LazyKernel, PackedWeight

if TYPE_CHECKING:
    from engine.model.gguf_blocks import GGUFBlocks
    from engine.model.weight_arena import WeightArena
    from engine.native_build import TiledKernel

__all__ = ["TiledWeight", "pack_tiled", "tiled_linear", "tiled_kernel_problem", "tiled_simd_path"]


class TiledWeight(PackedWeight):
    """One `[rows, cols]` weight in the tiled bf16 kernel's layout: `packed` is uint8, `qtype`
    the GGUF format it came from ("Q4_1" or "Q8_0")."""


def pack_tiled(blocks: "GGUFBlocks", kernel: Optional["TiledKernel"] = None,
               arena: Optional["WeightArena"] = None) -> TiledWeight:
    """The tiled form of `blocks` (the same weights, bit for bit, in as many bytes). `kernel`: a
    build of the kernel (tests pass the portable one); default this machine's. `arena`: where
    the packed bytes go (`engine.model.weight_arena`); default a buffer of their own."""
    return TiledWeight.pack(blocks, _KERNEL.get(kernel), arena)


def tiled_linear(x: torch.Tensor, weight: TiledWeight,
                 kernel: Optional["TiledKernel"] = None) -> torch.Tensor:
    """`x @ W.T` for bfloat16 `x` `[M, cols]` on the CPU and W the file's exact weights; returns
    `[M, rows]` bfloat16, rounded to nearest even once. Runs on torch's thread count; the result
    does not depend on it (a row's bits depend on M only through the size of its row group,
    tiled_matmul.cpp). ValueError naming `x` for any other x."""
    if x.dim() != 2 or x.shape[1] != weight.cols or x.dtype != torch.bfloat16 or not x.is_cpu:
        raise _bad_x(x, weight.cols)  # one combined test: this runs ~120 times per decode step
    return _KERNEL.get(kernel).linear(x.contiguous(), weight.packed, weight.qtype, weight.rows,
                                      torch.get_num_threads())


def _bad_x(x: torch.Tensor, cols: int) -> ValueError:
    if x.dim() != 2 or x.shape[1] != cols:
        return ValueError(f"x: expected a [M, {cols}] tensor, got {tuple(x.shape)}")
    return ValueError(f"x: expected a bfloat16 CPU tensor, got {x.dtype} on {x.device}")


def _load() -> "TiledKernel":
    from engine.native_build import load_tiled

    return load_tiled()


_KERNEL: LazyKernel["TiledKernel"] = LazyKernel(_load)


def tiled_simd_path(kernel: Optional["TiledKernel"] = None) -> str:
    """The path `kernel` (default this machine's build) runs: "amx-bf16" (AMX tiles from 4 rows
    up, when the CPU has AMX and Linux grants it), "avx512-bf16" or "portable"."""
    return _KERNEL.get(kernel).simd_paths


def tiled_kernel_problem() -> Optional[str]:
    """None when the tiled kernel builds (or is built) on this machine with its AVX-512 BF16
    path, else what is missing (the portable path was never measured against oneDNN)."""
    from engine.native_build import BuildFailed

    try:
        kernel = _KERNEL.get()
    except BuildFailed as exc:
        return f"its C++ kernel, which did not build: {exc}"
    if kernel.simd_paths == "portable":
        return "a CPU with AVX-512 BF16 for its fast path"
    return None
