"""Registers the reference backend: any dtype, head size, block size and feature, on any device
torch runs on. Content checks always run before it, so its errors are the ABI's errors."""

from __future__ import annotations

from typing import Sequence

import torch

from paged_kernels.abi import FEATURES, FLOAT_DTYPES, AttentionProblem, Support
from paged_kernels.backends import Backend
from reference import attention, cache_ops


class ReferenceBackend(Backend):
    """The readable definition of the ABI; the baseline every other backend is checked against."""

    name = "reference"
    priority = 0
    always_check_contents = True
    _support = Support(
        dtypes=frozenset(FLOAT_DTYPES),
        device_types=frozenset({"cpu", "cuda"}),
        features=frozenset(FEATURES),
    )

    @property
    def support(self) -> Support:
        return self._support

    def paged_attention(self, problem: AttentionProblem) -> None:
        attention.paged_attention(problem)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        cache_ops.write_kv(key, value, key_cache, value_cache, slot_mapping)

    def copy_blocks(self, key_caches: Sequence[torch.Tensor],
                    value_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor) -> None:
        cache_ops.copy_blocks(key_caches, value_caches, block_mapping)

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor,
                    block_mapping: torch.Tensor) -> None:
        cache_ops.swap_blocks(src, dst, block_mapping)
