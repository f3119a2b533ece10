"""The decoder layer's element-wise ops (RMSNorm with the residual add, rotary, SiLU * up),
fused in C++ for CPU tensors (engine/csrc/layer_ops.cpp), with PyTorch versions for the rest.

At decode sizes each of PyTorch's CPU ops costs 5-40 us (dispatch, allocation, bfloat16
conversions) for a few thousand elements, and a layer ran about ten of them; the fused ops do each
job in one pass over the rows, computing in float32 and rounding once to the tensor's dtype.
Results equal the PyTorch versions up to that rounding (float32: a few ulp, summation order;
bfloat16: at most one bfloat16 ulp per element, from the one rounding instead of several).

The extension is compiled at first use (paged_kernels.cpp_build: ~20 s once per machine, cached);
when it cannot be built, or for other devices and dtypes, the PyTorch versions run.
`PK_ENGINE_LAYER_OPS=torch` at start-up (or `layer_ops.use_native = False`) forces them.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

from paged_kernels.cpp_build import BASE_FLAGS, BuildFailed, load, simd_flags

__all__ = ["add_rms_norm_", "argmax_logsumexp", "gelu_tanh_mul", "rms_norm", "rotary_", "silu_mul",
           "native"]

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "layer_ops.cpp"
ENV = "PK_ENGINE_LAYER_OPS"
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)
#: SIMD tiers (paged_kernels.cpp_build.ISA), widest first.
TIERS = ("avx512 + fma", "avx2 + fma")
#: With a SIMD set: divisions and square roots as a reciprocal estimate plus a Newton step (~2
#: ulp of float32): SiLU's 1 / (1 + e^-x) ran 2.5x faster than with vdivps.
_RECIP = ["-freciprocal-math", "-mrecip"]

#: False runs the PyTorch versions everywhere (read once: the ops are called ~150 times a step).
use_native = os.environ.get(ENV) != "torch"
_module: Optional[ModuleType] = None
_tried = False


def compile_flags(cpu: Optional[frozenset[str]] = None) -> list[str]:
    """C++ flags for a CPU with /proc/cpuinfo flags `cpu` (default this machine's): the first
    of TIERS it has completely, with _RECIP."""
    simd = simd_flags(TIERS, cpu)
    # -fno-trapping-math: lets the float -> int conversion in exp_approx vectorise
    return [*BASE_FLAGS, "-fno-trapping-math", *simd, *(_RECIP if simd else [])]


def native() -> Optional[ModuleType]:
    """The compiled extension, or None (build failed, or `use_native` is False)."""
    global _module, _tried
    if not use_native:
        return None
    if not _tried:
        _tried = True
        try:
            _module = load(SOURCE, "engine_layer_ops", compile_flags(), "engine layer ops")
        except BuildFailed as exc:
            print(f"engine layer ops: using PyTorch ops ({exc})")
    return _module


def _fused(t: torch.Tensor) -> Optional[ModuleType]:
    if not t.is_cpu or t.dtype not in _NATIVE_DTYPES:  # is_cpu: a third of device.type's cost
        return None
    return native()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x**2, -1) + eps) * weight` for `x` `[T, H]`, a new tensor."""
    ops = _fused(x)
    if ops is None or x.stride(-1) != 1:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return ops.add_rms_norm(x, None, weight, eps)


def add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """`residual += x` (in place), then returns `rms_norm(residual, weight, eps)` (new)."""
    ops = _fused(residual)
    if ops is None or residual.stride(-1) != 1 or x.stride(-1) != 1 or x.dtype != residual.dtype:
        residual += x
        return F.rms_norm(residual, residual.shape[-1:], weight, eps)
    return ops.add_rms_norm(residual, x, weight, eps)


def rotary_(x: torch.Tensor, heads: int, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """Rotates heads `[0, heads)` of `x` `[T, num_heads, head_size]` in place by Hugging Face's
    rotate-half rule: `x * cos[p] + swap_halves(x) * sin[p]` at token `t`'s position `p =
    positions[t]`, with `cos`/`sin` the float32 `[max_positions, head_size]` tables whose `sin`
    carries rotate-half's sign (negative in the first half)."""
    ops = _fused(x)
    if ops is not None and x.stride(-1) == 1:
        ops.rotary(x, heads, positions.contiguous(), cos, sin)
        return
    part = x[:, :heads]
    c = cos[positions].to(x.dtype)[:, None, :]
    s = sin[positions].to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    swapped = torch.cat((part[..., half:], part[..., :half]), dim=-1)
    part.copy_(part * c + swapped * s)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where `gate, up = gate_up.chunk(2, dim=-1)` (`[T, 2 * I]` -> `[T, I]`)."""
    ops = _fused(gate_up)
    if ops is None or gate_up.stride(-1) != 1:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return ops.silu_mul(gate_up)


def argmax_logsumexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For float32 logits `x` `[N, vocab]`: (the first index of each row's maximum, int64 `[N]`;
    `log(sum(exp(x)))` of each row, float32 `[N]`), from one read of `x` (the sampler's greedy
    choice and the chosen token's log-probability `x[i, t] - lse[i]`, without a log-softmax of
    every row). Rows holding a NaN get torch's answers (`argmax`, `logsumexp`)."""
    ops = native() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if ops is None or x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] == 0:
        return x.argmax(dim=-1), torch.logsumexp(x, dim=-1)
    best, lse = ops.argmax_logsumexp(x)
    bad = torch.isnan(lse)
    if bad.any():
        best[bad], lse[bad] = x[bad].argmax(dim=-1), torch.logsumexp(x[bad], dim=-1)
    return best, lse


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh(gate) * up` (GeGLU with the tanh approximation of GELU) where `gate, up =
    gate_up.chunk(2, dim=-1)` (`[T, 2 * I]` -> `[T, I]`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
