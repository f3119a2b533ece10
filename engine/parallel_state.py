"""One rank's place in a tensor-parallel group, and the collectives the sharded model calls.

`TensorParallel(rank, size, group)` is what a sharded model is built with: `rank` in
`[0, size)`, `group` a `torch.distributed` process group (None: the default group). With
`size == 1` every collective is the identity and nothing of `torch.distributed` is touched,
so the single-process engine pays nothing for it.

It sits beside `engine.model` and `engine.distributed` rather than inside either: the sharded
model calls these collectives and the tensor-parallel runtime builds the group and imports the
model, so a module of either package here would make the two packages import each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank in a tensor-parallel group of `size` ranks."""

    rank: int = 0
    size: int = 1
    group: Optional[Any] = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size: expected an int >= 1, got {self.size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) \
                or not 0 <= self.rank < self.size:
            raise ValueError(f"rank: expected an int in [0, {self.size}), got {self.rank!r}")

    @property
    def is_driver(self) -> bool:
        """Rank 0 holds the scheduler, the block manager and the sampler."""
        return self.rank == 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place; returns `x`."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates the ranks' `x` (one shape on every rank) along the last dimension, rank 0's
        first; returns a new tensor (`x` itself when `size == 1`)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


#: The single-process case: rank 0 of 1.
SINGLE = TensorParallel()
