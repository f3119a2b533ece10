"""Registers the Triton backend (registry name "triton", docs/triton.md).

`TritonBackend()` raises `BackendUnavailable` when Triton cannot be imported, or when there is
neither a CUDA device nor TRITON_INTERPRET=1. On a CUDA device it runs natively, outranks the
reference for backend="auto" and takes CUDA tensors; under the interpreter it takes CPU tensors and
ranks below the reference, so "auto" on the CPU keeps the (much faster) reference.
"""

from __future__ import annotations

import dataclasses

import torch

from paged_kernels.abi import FEATURES, FLOAT_DTYPES, AttentionProblem, Support
from paged_kernels.backends import GENERIC_BLOCK_OPS, Backend, BackendUnavailable

MAX_HEAD_SIZE = 256
MAX_BLOCK_SIZE = 256

#: What the backend supports on any machine; an instance narrows `device_types` to where it runs
#: here ("cuda" natively, or "cpu" under the interpreter).
SUPPORT = Support(
    dtypes=frozenset(FLOAT_DTYPES),
    device_types=frozenset({"cuda", "cpu"}),
    features=frozenset(FEATURES),
    max_head_size=MAX_HEAD_SIZE,
    max_block_size=MAX_BLOCK_SIZE,
    kv_cache_dtypes=frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.int8}),
    reasons=(
        ("max_head_size", "one program's [rows, head_size] float32 accumulator lives in "
                          "registers; head sizes are padded to a power of two"),
        ("max_block_size", "larger blocks would work (keys are gathered token by token) but are "
                           "untested"),
        ("device_types", "cuda natively; cpu only in Triton's interpreter (TRITON_INTERPRET=1), "
                         "ranked below the reference there"),
    ),
)


class TritonBackend(Backend):
    """Paged attention and write_kv as Triton kernels (decode with split-K, unified varlen)."""

    name = "triton"
    block_ops = GENERIC_BLOCK_OPS

    def __init__(self) -> None:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailable(f"triton cannot be imported: {exc}") from exc
        from triton_impl import runtime
        self._runtime = runtime
        if runtime.interpreting():
            device_type, self.priority = "cpu", -10
        elif torch.cuda.is_available():
            device_type, self.priority = "cuda", 10
        else:
            raise BackendUnavailable("no CUDA device, and TRITON_INTERPRET=1 is not set")
        kv_cache_dtypes = SUPPORT.kv_cache_dtypes
        if device_type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
            # Triton has no e4m3 type before sm_89 (docs/triton.md)
            kv_cache_dtypes = kv_cache_dtypes - {torch.float8_e4m3fn}
        self._support = dataclasses.replace(SUPPORT, device_types=frozenset({device_type}),
                                            kv_cache_dtypes=kv_cache_dtypes)
        from triton_impl import decode, unified, write_kv
        self._decode, self._varlen, self._write_kv = (decode.paged_decode, unified.paged_varlen,
                                                      write_kv.write_kv)

    @property
    def support(self) -> Support:
        return self._support

    def paged_attention(self, problem: AttentionProblem) -> None:
        problem = _dense_indices(problem)
        with self._runtime.device_of(problem.query):
            if problem.is_decode:
                self._decode(problem)
            else:
                self._varlen(problem)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        with self._runtime.device_of(key_cache):
            self._write_kv(key, value, key_cache, value_cache, slot_mapping.contiguous(),
                           k_scale, v_scale)


def _dense_indices(p: AttentionProblem) -> AttentionProblem:
    """`p` with contiguous index tensors: the kernels index block tables, lengths, offsets and
    slopes with unit strides (the ABI allows any strides there; copies are rare and small)."""
    fields = ("block_tables", "seq_lens", "cu_seqlens_q", "alibi_slopes")
    strided = {f: getattr(p, f).contiguous() for f in fields
               if getattr(p, f) is not None and not getattr(p, f).is_contiguous()}
    return dataclasses.replace(p, **strided) if strided else p
