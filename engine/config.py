"""The engine's settings: one small dataclass, checked when it is built.

`EngineConfig` holds what the KV cache manager, the scheduler and the runner need. Values that
depend on the model (the number of KV blocks derived from a memory budget, the default
`max_model_len`) are resolved by `engine.llm_engine.LLMEngine` once the model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from engine import kv_scales
from engine.speculative_config import SpeculativeConfig

PREEMPTION_MODES = ("recompute", "swap")
KV_ALLOCATIONS = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")  # engine/kv_allocation
QUANTIZATION_MODES = ("auto", "gguf", "gguf-int8", "none")  # see docs/quant.md
KV_CACHE_DTYPES = tuple(kv_scales.KV_CACHE_DTYPES)


def _require_int(name: str, value: object, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an int >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


@dataclass
class EngineConfig:
    """Scheduling and memory settings of one engine.

    - `block_size`: tokens per KV block.
    - `num_kv_blocks` / `kv_cache_memory_bytes`: the device block pool, as a count or as a budget
      in bytes (at most one may be given; with neither, the engine picks a default budget).
    - `num_host_blocks`: the host pool used by preemption by swap (0 when `preemption_mode` is
      "recompute" unless given).
    - `max_num_seqs`: most sequences in one step; `max_num_batched_tokens`: most tokens in one step
      (a prefill longer than that is chunked over several steps).
    - `enable_prefix_caching`: reuse cached full blocks of earlier requests (under "paged" only).
    - `preemption_mode`: "recompute" (free the blocks, recompute later) or "swap" (copy the blocks
      to the host pool and back).
    - `max_model_len`: most tokens (prompt + output) in one sequence; None = from the model.
    - `backend`: the attention backend name passed to `paged_kernels` ("auto" by default).
    - `quantization`: how a model is loaded when the engine loads it (docs/quant.md): "gguf"
      multiplies small batches by a GGUF file's own Q4_1/Q8_0 blocks, "gguf-int8" every matmul
      (int8 activations, llama.cpp's scheme), "none" (or None) uses dense weights only, "auto"
      (default) is "gguf" wherever it applies.
    - `kv_allocation`: "paged" (default: blocks as tokens arrive) or a contiguous-reservation
      baseline of the vLLM paper, where a request reserves its slots at admission:
      "reserve-max" (`max_model_len`), "reserve-pow2" (the next power of two of prompt +
      `max_tokens`) or "reserve-oracle" (prompt + `max_tokens`); see engine/kv_allocation.py.
      Under a reservation, prefix caching is off and requests that share blocks (`n > 1`, beam
      search) are refused.
    - `kv_cache_dtype`: the KV cache's storage, vLLM's names: "auto" (the model's dtype),
      "fp8" / "fp8_e4m3" (float8 e4m3fn), "fp8_e5m2" or "int8"; an 8-bit cache holds twice the
      blocks of a 16-bit one in the same `kv_cache_memory_bytes`. Its scales (per layer, per KV
      head) come from the model file, else from `calculate_kv_scales` (calibrated on a built-in
      prompt when the engine is built), else 1.0 for fp8 (engine/kv_scales.py).
    - `tensor_parallel_size`: ranks the model is split over (docs/distributed.md): one process
      each, this one the driver; 1 runs everything in this process.
    - `tensor_parallel_threads`: torch threads of each rank on a CPU when
      `tensor_parallel_size > 1` (the driver's process included).
    - `speculative_config`: vLLM's dict (or a `SpeculativeConfig`) turning on speculative
      decoding (docs/spec-decode.md); parsed into a `SpeculativeConfig` here. None: off.
    - `prefault_kv_cache`: make every page of a CPU KV pool resident when the engine is built
      (`paged_kernels.prefault`), so that no step pays a page's first-touch fault; the server's
      default. False (the library's default): pages become resident as blocks are first
      written.
    """

    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    num_host_blocks: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    max_model_len: Optional[int] = None
    backend: str = "auto"
    quantization: Optional[str] = "auto"
    kv_allocation: str = "paged"
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = True
    tensor_parallel_size: int = 1
    tensor_parallel_threads: int = 1
    speculative_config: Union[None, dict[str, Any], SpeculativeConfig] = None
    prefault_kv_cache: bool = False

    def __post_init__(self) -> None:
        _require_int("block_size", self.block_size, 1)
        _require_int("num_kv_blocks", self.num_kv_blocks, 1, allow_none=True)
        _require_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, allow_none=True)
        _require_int("num_host_blocks", self.num_host_blocks, 0, allow_none=True)
        _require_int("max_num_seqs", self.max_num_seqs, 1)
        _require_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _require_int("max_model_len", self.max_model_len, 1, allow_none=True)
        _require_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _require_int("tensor_parallel_threads", self.tensor_parallel_threads, 1)
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("num_kv_blocks: expected None when kv_cache_memory_bytes is given "
                             f"(give one of them), got {self.num_kv_blocks}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode: expected one of {PREEMPTION_MODES}, got "
                             f"{self.preemption_mode!r}")
        if not isinstance(self.prefault_kv_cache, bool):
            raise ValueError("prefault_kv_cache: expected a bool, got "
                             f"{self.prefault_kv_cache!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError("enable_prefix_caching: expected a bool, got "
                             f"{self.enable_prefix_caching!r}")
        if not isinstance(self.backend, str):
            raise ValueError(f"backend: expected a str, got {self.backend!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization: expected one of {QUANTIZATION_MODES} or None, got "
                             f"{self.quantization!r}")
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(f"kv_allocation: expected one of {KV_ALLOCATIONS}, got "
                             f"{self.kv_allocation!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError("calculate_kv_scales: expected a bool, got "
                             f"{self.calculate_kv_scales!r}")
        if self.speculative_config is not None \
                and not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        spec = self.speculative_config
        if spec is not None and spec.draft_layers is not None and self.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config['draft_layers']: expected tensor_parallel_size"
                             f"=1 (the target's first layers would run on the driver alone), "
                             f"got tensor_parallel_size={self.tensor_parallel_size}; use "
                             f"'ngram' or a draft 'model'")
