"""Backend registry and the "auto" choice.

A backend is a `Backend` subclass registered by name with a lazy import path, so importing
`paged_kernels` never imports Triton, CuPy or a compiled extension. A backend that cannot run here
(missing package, no GPU) is simply absent from `available_backends()`; why is kept in
`unavailable_backends()`.

`backend="auto"` tries the registered backends fastest first and takes the first that is
available, runs on the tensors' device and has a priority >= 0 (interpreters and emulations have a
negative priority and are never chosen, nor loaded, by "auto"). The environment variable
PAGED_KERNELS_BACKEND forces a name for every call that says "auto".
"""

from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from paged_kernels import cache_ops
from paged_kernels.abi import AttentionProblem, Support

BACKEND_ENV = "PAGED_KERNELS_BACKEND"

#: `Backend.block_ops` of a backend that runs the generic PyTorch `copy_blocks`/`swap_blocks`.
GENERIC_BLOCK_OPS = "generic (paged_kernels.cache_ops)"

#: name -> "module:attribute" of a zero-argument factory returning a Backend, in the order
#: "auto" tries them (fastest first). Nothing is imported until a backend is first asked for.
_REGISTRY: dict[str, str] = {
    "cuda": "cuda.paged_cuda.backend:CudaBackend",
    "triton": "triton_impl.backend:TritonBackend",
    "cpu": "cpu_impl.backend:CpuBackend",
    "reference": "reference.backend:ReferenceBackend",
    "cuda-host": "cuda.paged_cuda.host_backend:CudaHostBackend",
}


@dataclass(frozen=True)
class NativeEntryPoints:
    """A backend's `paged_attention` and `write_kv` as C++ function pointers, for native
    callers built against the same torch that run many layers without returning to Python
    (engine/csrc/layer_loop.cpp). `header` is the repository path of the header that declares
    their types (a caller checks that it was compiled against that one); `paged_attention` and
    `write_kv` are their addresses; the rest are the arguments the backend's own Python calls
    pass beyond the ABI's tensors, as they stand now (tuning values, read at each call)."""

    header: str
    paged_attention: int
    write_kv: int
    tile: int
    threads: int
    read_ahead: bool
    prefetch_lines: int


class Backend(ABC):
    """One implementation of the ABI (docs/abi.md).

    Contract: `paged_attention` receives a problem that passed `check_attention_args` and
    `support.check`, writes every element of `problem.out` (and of `problem.lse` when it is not
    None) and returns nothing. The cache operations receive checked arguments and modify the caches
    in place. A backend never falls back silently to another one.
    """

    #: Registry name.
    name: str = ""
    #: Orders `available_backends()`; a negative priority keeps "auto" from ever choosing it.
    priority: int = 0
    #: Whether content checks (block ids, lengths) always run before this backend.
    always_check_contents: bool = False
    #: Which `copy_blocks`/`swap_blocks` this backend runs: GENERIC_BLOCK_OPS (the methods
    #: below), or, for a backend that overrides both, where its own kernels are. Each backend
    #: declares it; docs/support-matrix.md lists it.
    block_ops: str = GENERIC_BLOCK_OPS

    @property
    @abstractmethod
    def support(self) -> Support:
        """What this backend supports (dtypes, sizes, features, device types)."""

    @abstractmethod
    def paged_attention(self, problem: AttentionProblem) -> None:
        """Writes attention for `problem` into `problem.out` (and `problem.lse`)."""

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: Optional[torch.Tensor] = None,
                 v_scale: Optional[torch.Tensor] = None) -> None:
        """Scatters `key`/`value` rows to their slots; negative slots are skipped.

        For an 8-bit cache (a dtype of `support.kv_cache_dtypes`), `k_scale`/`v_scale` are
        contiguous float32 `[num_kv_heads]` tensors on the cache's device and each row is stored
        quantised (docs/abi.md, `paged_kernels.kv_quant`); for a float cache they are None and
        not passed (`call_write_kv`), so a backend without 8-bit support may omit them."""

    def native_entry_points(self) -> Optional[NativeEntryPoints]:
        """This backend's kernels for native callers (`NativeEntryPoints`), or None (the
        default: it has no such entry)."""
        return None

    def copy_blocks(self, key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                    block_mapping: torch.Tensor) -> None:
        """Copies block `src` to block `dst` for each row of `block_mapping`, in every layer."""
        cache_ops.copy_blocks(key_caches, value_caches, block_mapping)

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor,
                    block_mapping: torch.Tensor) -> None:
        """Copies block `src` of cache `src` to block `dst` of cache `dst` (devices may differ)."""
        cache_ops.swap_blocks(src, dst, block_mapping)


def call_write_kv(impl: Backend, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> None:
    """`impl.write_kv` with checked arguments; the scales are passed only for an 8-bit cache,
    so a backend without 8-bit support keeps its five-argument `write_kv`."""
    if k_scale is None:
        impl.write_kv(key, value, key_cache, value_cache, slot_mapping)
    else:
        impl.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale,
                      v_scale=v_scale)


class BackendUnavailable(RuntimeError):
    """Raised by a backend's factory when it cannot run on this machine; the message says why."""


_instances: dict[str, Backend] = {}
_unavailable: dict[str, str] = {}


def _load(name: str) -> Optional[Backend]:
    if name in _instances:
        return _instances[name]
    if name in _unavailable:
        return None
    module_name, attr = _REGISTRY[name].split(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
        backend = factory()
    except (ImportError, BackendUnavailable, OSError) as exc:
        _unavailable[name] = f"{type(exc).__name__}: {exc}"
        return None
    _instances[name] = backend
    return backend


def registered_backends() -> list[str]:
    """Every registered backend name, available here or not."""
    return list(_REGISTRY)


def factory_path(name: str) -> str:
    """The `"module:attribute"` of backend `name`'s factory (importable without running it)."""
    if name not in _REGISTRY:
        raise ValueError(f"name: expected one of {list(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name]


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine, highest priority first."""
    loaded = [b for b in (_load(n) for n in _REGISTRY) if b is not None]
    return [b.name for b in sorted(loaded, key=lambda b: -b.priority)]


def unavailable_backends() -> dict[str, str]:
    """Registered backends that cannot run here, with the reason."""
    available_backends()
    return dict(_unavailable)


def get_backend(name: str) -> Backend:
    """The backend called `name`; ValueError if unknown, RuntimeError if it cannot run here."""
    if name not in _REGISTRY:
        raise ValueError(f"backend: expected one of {['auto', *_REGISTRY]}, got {name!r}")
    backend = _load(name)
    if backend is None:
        raise RuntimeError(f"backend {name!r} is not available here: {_unavailable[name]}")
    return backend


def resolve_backend(name: str, device: torch.device) -> Backend:
    """Resolves `name` ("auto" or a registered name) for tensors on `device`."""
    if not isinstance(name, str):
        raise TypeError(f"backend: expected a str, got {type(name).__name__}")
    if name == "auto":
        forced = os.environ.get(BACKEND_ENV)
        if forced:
            return get_backend(forced)
        return _auto(device)
    return get_backend(name)


def _auto(device: torch.device) -> Backend:
    """The first backend, in registry order, that runs on `device` with priority >= 0. Later
    backends are not even loaded (an emulation's build costs minutes)."""
    for name in _REGISTRY:
        backend = _load(name)
        if backend is not None and backend.priority >= 0 \
                and device.type in backend.support.device_types:
            return backend
    raise RuntimeError(f"no backend runs on device {device}; unavailable: {_unavailable}")
