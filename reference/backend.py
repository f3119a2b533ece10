"""Registers the reference backend: any dtype, head size, block size and feature, every 8-bit cache
dtype, on any device torch runs on. Content checks always run before it, so its errors are the
ABI's errors."""

from __future__ import annotations

from typing import Optional

import torch

from paged_kernels.abi import FEATURES, FLOAT_DTYPES, AttentionProblem, Support
from paged_kernels.backends import GENERIC_BLOCK_OPS, Backend
from paged_kernels.kv_quant import QUANTIZED_CACHE_DTYPES
from reference import attention, cache_ops


class ReferenceBackend(Backend):
    """The readable definition of the ABI; the baseline every other backend is checked against."""

    name = "reference"
    priority = 0
    always_check_contents = True
    block_ops = GENERIC_BLOCK_OPS
    _support = Support(
        dtypes=frozenset(FLOAT_DTYPES),
        device_types=frozenset({"cpu", "cuda"}),
        features=frozenset(FEATURES),
        kv_cache_dtypes=frozenset(QUANTIZED_CACHE_DTYPES),
    )

    @property
    def support(self) -> Support:
        return self._support

    def paged_attention(self, problem: AttentionProblem) -> None:
        attention.paged_attention(problem)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: Optional[torch.Tensor] = None,
                 v_scale: Optional[torch.Tensor] = None) -> None:
        cache_ops.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
