"""The "cuda" backend: the CUDA C++ kernels of cuda/csrc on an NVIDIA GPU.

Launchers come from `loader.load_launchers()` (built extension, else NVRTC through CuPy); every
call goes through launch.py, which plans the launch on the host without synchronising (CUDA-graph
safe for paged_attention and write_kv). The factory raises BackendUnavailable when torch has no
CUDA device, so on a CPU-only machine the backend is simply absent.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from cuda.paged_cuda import launch
from paged_kernels.abi import AttentionProblem, Support
from paged_kernels.backends import Backend, BackendUnavailable


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


class CudaBackend(Backend):
    """CUDA kernels: split-K decode, tensor-core varlen attention, cache ops (docs/cuda.md)."""

    name = "cuda"
    priority = 20
    block_ops = ("own kernel (pk_copy_blocks_kernel, cuda/csrc/pk_cache.cuh); host <-> device "
                 "swaps: one copy per block")
    _support = launch.support(("cuda",))

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable("torch.cuda is not available (no CUDA device or a CPU-only "
                                     "torch build)")
        from cuda.paged_cuda import loader
        try:
            self._ext, self.launcher_kind = loader.load_launchers()
        except ImportError as exc:
            raise BackendUnavailable(str(exc)) from exc

    @property
    def support(self) -> Support:
        return self._support

    def paged_attention(self, problem: AttentionProblem) -> None:
        device = problem.query.device
        with torch.cuda.device(device):
            launch.paged_attention(self._ext, problem, _stream(device), _num_sms(device.index or 0))

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        with torch.cuda.device(key_cache.device):
            launch.write_kv(self._ext, key, value, key_cache, value_cache, slot_mapping,
                            _stream(key_cache.device), k_scale, v_scale)

    def copy_blocks(self, key_caches: Sequence[torch.Tensor],
                    value_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor) -> None:
        device = key_caches[0].device
        with torch.cuda.device(device):
            launch.copy_blocks(self._ext, key_caches, value_caches, block_mapping, _stream(device))

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor,
                    block_mapping: torch.Tensor) -> None:
        if src.device == dst.device and src.is_cuda:
            with torch.cuda.device(src.device):
                launch.swap_blocks_on_device(self._ext, src, dst, block_mapping,
                                             _stream(src.device))
            return
        # Host <-> device: one asynchronous copy per block (cudaMemcpyAsync underneath; pinned
        # host memory makes it truly asynchronous).
        launch.check_swap_ids(src, dst, block_mapping)
        for s, d in block_mapping.tolist():
            dst[d].copy_(src[s], non_blocking=True)
