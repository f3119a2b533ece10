"""A weight matrix as a GGUF file stores it: blocks of 32 weights in Q4_1 or Q8_0 (`GGUFBlocks`),
the form both quantized matmuls read (`engine.model.quant`, `engine.model.quant_int8`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QK", "BLOCK_BYTES", "GGUFBlocks"]

#: Weights per GGUF block, and bytes per block of each format the kernel reads.
QK = 32
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True)
class GGUFBlocks:
    """One weight matrix `[rows, cols]` as GGUF blocks: `data` is uint8 `[rows, cols/32 * bytes
    per block]`, each row's blocks contiguous (ggml's layout), for `qtype` "Q4_1" or "Q8_0"."""

    qtype: str
    data: torch.Tensor
    cols: int

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"qtype: expected one of {sorted(BLOCK_BYTES)}, got {self.qtype!r}")
        if self.cols < QK or self.cols % QK:
            raise ValueError(f"cols: expected a positive multiple of {QK}, got {self.cols}")
        want = self.cols // QK * BLOCK_BYTES[self.qtype]
        if (self.data.dtype != torch.uint8 or self.data.dim() != 2
                or self.data.shape[1] != want or not self.data.is_contiguous()):
            raise ValueError(f"data: expected a contiguous uint8 tensor [rows, {want}] for "
                             f"{self.qtype} with {self.cols} columns, got {self.data.dtype} "
                             f"{tuple(self.data.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """`(rows, cols)` of the weight matrix."""
        return self.data.shape[0], self.cols

    @staticmethod
    def concat(parts: list["GGUFBlocks"]) -> "GGUFBlocks":
        """The row-wise concatenation of `parts` (one fused weight). ValueError unless all parts
        share the format and the column count."""
        kinds = {(p.qtype, p.cols) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"parts: expected one format and column count to fuse, got "
                             f"{sorted(kinds)}")
        return GGUFBlocks(parts[0].qtype, torch.cat([p.data for p in parts]), parts[0].cols)
