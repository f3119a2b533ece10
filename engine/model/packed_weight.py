"""A GGUF weight repacked once at load time for one of the engine's C++ matmul kernels, and the
kernel, built or loaded at first use.

`PackedWeight` is one `[rows, cols]` weight in a kernel's own layout: uint8 `packed`, holding the
file's Q4_1 / Q8_0 values exactly, and `qtype`, the GGUF format they came from. Its kinds are
`Int8Weight` (engine/model/quant_int8.py, the int8-activation kernel) and `TiledWeight`
(engine/model/quant_tiled.py, the exact bfloat16 one); `pack` makes either from the file's
blocks through the kernel's `pack`. `LazyKernel` holds one kernel per process (these two
kernels' and quant.py's file-layout one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Optional, TypeVar

import torch

if TYPE_CHECKING:
    from engine.model.gguf_blocks import GGUFBlocks
    from engine.model.weight_arena import WeightArena

__all__ = ["PackedWeight", "LazyKernel"]

K = TypeVar("K")
W = TypeVar("W", bound="PackedWeight")


@dataclass(frozen=True)
class PackedWeight:
    """One `[rows, cols]` weight in a kernel's layout: `packed` is uint8, `qtype` the GGUF format
    it came from ("Q4_1" or "Q8_0")."""

    qtype: str
    packed: torch.Tensor
    rows: int
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @classmethod
    def pack(cls: type[W], blocks: "GGUFBlocks", kernel: Any,
             arena: Optional["WeightArena"] = None) -> W:
        """`blocks` repacked by `kernel` (its `pack(data, qtype, cols, threads, allocate)`), on
        torch's thread count: the same weights, bit for bit, in a buffer from `arena` (default
        one of their own)."""
        rows, cols = blocks.shape
        packed = kernel.pack(blocks.data, blocks.qtype, cols, torch.get_num_threads(),
                             None if arena is None else arena.take)
        return cls(blocks.qtype, packed, rows, cols)


class LazyKernel(Generic[K]):
    """A kernel built or loaded by `load` at the first `get` (once per process)."""

    def __init__(self, load: Callable[[], K]) -> None:
        self._load = load
        self._kernel: Optional[K] = None

    def get(self, kernel: Optional[K] = None) -> K:
        """`kernel` when given (tests pass other builds), else this machine's build."""
        if kernel is not None:
            return kernel
        if self._kernel is None:
            self._kernel = self._load()
        return self._kernel
