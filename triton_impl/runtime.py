"""Where the Triton kernels run: natively on a CUDA device, or in Triton's interpreter on the CPU.

`TRITON_INTERPRET=1` must be set before Triton is imported for the interpreter to be used: Triton
decides at `@triton.jit` decoration time whether a kernel is compiled or interpreted.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import ContextManager

import torch

from paged_kernels.abi import AttentionProblem

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (CPU tensors, numpy semantics)."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0", "false", "False")


def device_type() -> str:
    """'cpu' under the interpreter, else 'cuda'. Callers have checked that one of them exists."""
    return "cpu" if interpreting() else "cuda"


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device; 4 under the interpreter (keeps grids small)."""
    if interpreting():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count_for(t: torch.Tensor) -> int:
    """`num_sms` for the device holding `t`."""
    index = (t.device.index or 0) if t.device.type == "cuda" else 0
    return num_sms(index)


def device_of(t: torch.Tensor) -> ContextManager:
    """Makes `t`'s CUDA device current while kernels launch (Triton launches on the current
    device); a no-op on the CPU or when it already is current."""
    if t.device.type != "cuda" or t.device.index in (None, torch.cuda.current_device()):
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def kernel_flags(p: AttentionProblem) -> dict[str, bool]:
    """The constexpr switches of the attention kernels for `p`: its features, exact float32
    products (IEEE; tl.dot would use TF32), and UPCAST, the interpreter's bf16 tl.dot workaround
    (attend.py), which is set only under the interpreter so the GPU keeps its bf16 tensor-core dot;
    KV_SCALED, an 8-bit cache whose per-KV-head scales the kernels apply.
    """
    return {
        "USE_WINDOW": p.sliding_window is not None, "USE_SOFT_CAP": p.soft_cap is not None,
        "USE_ALIBI": p.alibi_slopes is not None, "HAS_LSE": p.lse is not None,
        "IEEE": p.query.dtype == torch.float32,
        "UPCAST": interpreting() and p.query.dtype == torch.bfloat16,
        "KV_SCALED": p.k_scale is not None,
    }
