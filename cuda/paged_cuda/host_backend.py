"""Backend "cuda-host": the CUDA backend's own kernel sources, run on the CPU by the emulator.

The kernels in cuda/csrc are compiled as host C++ over cuda/host/ (see host_build.py) into
`_pk_cuda_host` and driven through the same adapter as the GPU backend (launch.py: the same
planner, the same params structs, the same launchers), with CPU tensors and stream 0. It exists
to check the kernels' indexing, masking, reductions, barriers and algorithm in CI without a GPU;
docs/cuda-host.md says what it proves and what it does not. It is slow (every CUDA thread is a
fiber), so its priority is below the reference backend's and "auto" never picks it.

Plans are made for `PK_HOST_NUM_SMS` multiprocessors (default 132, an H100/H200), so the host run
exercises the same split-K partitioning as the GPU.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from cuda.paged_cuda import host_build, launch, params
from paged_kernels.abi import AttentionProblem, Support
from paged_kernels.backends import Backend, BackendUnavailable

#: Declared support (read by tools/support_matrix.py without building anything): the CUDA
#: kernels' support, on CPU tensors. A build with PK_HOST_INSTANTIATIONS narrows the head sizes.
SUPPORT: Support = launch.support(("cpu",))

NUM_SMS_ENV = "PK_HOST_NUM_SMS"
DEFAULT_NUM_SMS = 132
HOST_STREAM = 0


def _num_sms() -> int:
    value = os.environ.get(NUM_SMS_ENV, str(DEFAULT_NUM_SMS))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{NUM_SMS_ENV}: expected a positive integer, got {value!r}")
    return int(value)


class CudaHostBackend(Backend):
    """The CUDA kernels executed on the CPU (see the module docstring).

    Raises BackendUnavailable (with the compiler's message) when g++ or pybind11 is missing or
    the host build fails. Content checks always run first: an out-of-range block id would make
    the kernels read outside the cache, which on the host is a crash, not an error code.
    """

    name = "cuda-host"
    priority = -20
    always_check_contents = True
    block_ops = "own kernel (pk_copy_blocks_kernel, cuda/csrc/pk_cache.cuh), on the CPU"

    def __init__(self) -> None:
        try:
            self._ext = host_build.host_module()
            params.check_layout(self._ext)
        except (host_build.HostBuildError, ImportError, RuntimeError) as exc:
            raise BackendUnavailable(f"host build of the CUDA kernels failed: {exc}") from exc
        self._num_sms = _num_sms()
        reduced = os.environ.get("PK_HOST_INSTANTIATIONS")
        self._support = launch.support(("cpu",), params.REDUCED_HEAD_SIZES) if reduced else SUPPORT

    @property
    def support(self) -> Support:
        return self._support

    def paged_attention(self, problem: AttentionProblem) -> None:
        launch.paged_attention(self._ext, problem, HOST_STREAM, self._num_sms)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        _require_cpu("key_cache", key_cache)
        launch.write_kv(self._ext, key, value, key_cache, value_cache, slot_mapping, HOST_STREAM,
                        k_scale, v_scale)

    def copy_blocks(self, key_caches: Sequence[torch.Tensor],
                    value_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor) -> None:
        _require_cpu("key_caches", key_caches[0])
        launch.copy_blocks(self._ext, key_caches, value_caches, block_mapping, HOST_STREAM)

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor,
                    block_mapping: torch.Tensor) -> None:
        _require_cpu("src", src)
        _require_cpu("dst", dst)
        launch.swap_blocks_on_device(self._ext, src, dst, block_mapping, HOST_STREAM)


def _require_cpu(arg: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{arg}: expected a CPU tensor (backend 'cuda-host' runs on the CPU), "
                         f"got a tensor on {t.device}")
