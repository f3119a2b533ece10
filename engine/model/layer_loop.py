"""A step's decoder layers in one native call, for the engine's GGUF models on the CPU.

At decode sizes a decoder layer is ten kernel calls of 2-20 us each, and the Python between them
(the model's helpers, the attention plan's per-layer checks, argument conversion, one allocation
per op) costs about as much again. `LayerLoop.run` runs every layer of a step from C++
(engine/csrc/layer_loop.cpp): the same kernels (the tiled bf16 or the int8 matmul, the fused
layer ops, the cpu backend's `write_kv` and `paged_attention`, by the addresses its plan gives)
with the same arguments, in the same order, so the output has the bits of
`DecoderForCausalLM`'s Python path (tests/test_layer_loop.py).

Which models (`loop_problem` says what stops one): bfloat16 on the CPU, one rank, a Llama-style
layer (no biases, no q/k norms, no sandwich norms, SiLU), every layer full attention, every
projection in the tiled bf16 layout (`quantization="gguf"`) or with int8 tiles (`"gguf-int8"`),
and the fused layer ops built. Which steps (`run` returns None for the others, which take the
Python path): a plan whose backend has native entry points of the cpu backend's types
(`AttentionPlan.native_entry_points`), no ALiBi or LSE, a float cache or an 8-bit one whose
layers' scales are final (a first step that calibrates them runs in Python), and, for tiled
weights, at most the rows that the tiled kernel takes (more rows go to oneDNN's dense matmul).

`PK_ENGINE_LAYER_LOOP=0` at start-up (or `layer_loop.use_loop = False`) turns it off.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from engine.model import layer_ops
from engine.model.quant import QuantizedWeight
from paged_kernels.attention import AttentionPlan, NativeEntryPoints
from paged_kernels.cpp_build import BuildFailed, load

if TYPE_CHECKING:
    from engine.kv_scales import LayerKVScales
    from engine.model.rope import Rotary

__all__ = ["LayerLoop", "build_layer_loop", "loop_problem", "use_loop"]

#: The entry points' types this build was compiled against (`NativeEntryPoints.header`).
ENTRY_POINTS_HEADER = "cpu_impl/csrc/entry_points.h"
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "layer_loop.cpp"
ENV = "PK_ENGINE_LAYER_LOOP"
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_QTYPES = {"Q4_1": 0, "Q8_0": 1}

use_loop = os.environ.get(ENV, "1") != "0"
#: When set, a float64 tensor [4] to which every loop adds its steps' wall-clock seconds in
#: matmuls, attention, `write_kv` and the rest (norms, rotary, SiLU): bench.serve_profile's
#: breakdown of the native layers. None (the default) reads no clock.
timers: Optional[torch.Tensor] = None
_module: Optional[Any] = None


def native() -> Any:
    """The compiled extension (with the fused layer ops' flags, so that the row kernels they
    share compile alike). Raises BuildFailed."""
    global _module
    if _module is None:
        _module = load(SOURCE, "engine_layer_loop", layer_ops.compile_flags(),
                       "engine layer loop")
    return _module


def loop_problem(model: torch.nn.Module) -> Optional[str]:
    """None when `model`'s layers can run as one native loop, else what stops them."""
    if not use_loop:
        return f"turned off ({ENV}=0)"
    if model.dtype != torch.bfloat16 or model.embed_tokens.device.type != "cpu":
        return "a bfloat16 model on the CPU"
    if model.tp.size != 1:
        return "one rank (no tensor parallelism)"
    if layer_ops.native() is None:
        return "the fused layer ops, which are not built"
    for layer in model.layers:
        problem = _layer_problem(layer, model.layers[0].layer_type)
        if problem is not None:
            return problem
    return None


def _layer_problem(layer: Any, layer_type: str) -> Optional[str]:
    if any(b is not None for b in (layer.qkv_bias, layer.o_bias, layer.gate_up_bias,
                                   layer.down_bias)):
        return "a layer without biases"
    if layer.q_norm is not None or layer.sandwich_norm:
        return "a layer without q/k norms or sandwich norms"
    if layer.act_mul is not layer_ops.silu_mul:
        return "SiLU as the MLP's activation"
    if layer.window is not None or layer.layer_type != layer_type:
        return "full attention in every layer, with one rotary embedding"
    weights = [getattr(layer, name) for name in PROJECTIONS]
    if not all(isinstance(w, QuantizedWeight) for w in weights):
        return "GGUF weights (quantization 'gguf' or 'gguf-int8')"
    if not (all(w.int8 is not None for w in weights) or all(w.tiled for w in weights)):
        return "projections all tiled (bfloat16) or all with int8 tiles"
    return None


class LayerLoop:
    """A model's layers as one native loop (see the module docstring); built by
    `build_layer_loop`. Holds references to the model's packed weights and norms; `weights`
    lists each layer's projections (`PROJECTIONS`, `QuantizedWeight`s) in order."""

    def __init__(self, model: torch.nn.Module) -> None:
        layers = model.layers
        self.weights = weights = [[getattr(layer, name) for name in PROJECTIONS]
                                  for layer in layers]
        self.int8 = weights[0][0].int8 is not None
        packed = [[w.int8 if self.int8 else w.blocks for w in ws] for ws in weights]
        self.max_rows = (None if self.int8 else
                         min(w.max_rows for ws in weights for w in ws))
        first, config = layers[0], model.config
        self._loop = native().LayerLoop(
            _kernel_address(self.int8), self.int8, first.num_heads, first.num_kv_heads,
            first.head_dim, config.hidden_size, model.shard.local_intermediate_size, first.eps)
        for layer, ps in zip(layers, packed):
            self._loop.add_layer(layer.input_layernorm, layer.post_attention_layernorm,
                                 [p.packed for p in ps], [_QTYPES[p.qtype] for p in ps],
                                 [p.rows for p in ps])
        self._final_norm = model.norm
        self._layer_type = first.layer_type

    def run(self, hidden: torch.Tensor, rotary: dict[str, "Rotary"],
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            plans: dict[Optional[int], AttentionPlan],
            kv_scales: Optional[list["LayerKVScales"]] = None) -> Optional[torch.Tensor]:
        """`DecoderForCausalLM.forward`'s layers and final norm on the embeddings `hidden`
        (`[T, hidden_size]`, updated in place as the residual stream), with each layer's
        `kv_scales` for an 8-bit cache, or None, having done nothing, when this step is not one
        the loop runs (see the module docstring)."""
        num_tokens = hidden.shape[0]
        attn = plans.get(None)
        if (num_tokens == 0 or len(plans) != 1 or attn is None
                or (self.max_rows is not None and num_tokens > self.max_rows)
                or not _plan_qualifies(attn, kv_scales)):
            return None
        entry = attn.native_entry_points()
        if entry is None or entry.header != ENTRY_POINTS_HEADER:
            return None
        scales = [] if kv_scales is None else [t for s in kv_scales
                                               for t in (s.k_scale, s.v_scale)]
        key_cache, value_cache = kv_caches[0]
        _check_caches(attn, key_cache, value_cache)  # the others must equal these (C++)
        positions, cos, sin = rotary[self._layer_type]
        caches = [c for pair in kv_caches for c in pair]
        cu = attn.cu_seqlens_q
        try:
            return self._run(hidden, positions, cos, sin, caches, attn, entry, cu, scales)
        except RuntimeError as exc:
            if "rejected the attention metadata" not in str(exc):
                raise
            # the plan's own call raises the ABI's message for the contents the kernel refused
            attn.run(torch.zeros(attn.layer.query_shape, dtype=attn.layer.dtype), key_cache,
                     value_cache)
            raise

    def _run(self, hidden: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, caches: list[torch.Tensor], attn: AttentionPlan,
             entry: NativeEntryPoints, cu: Optional[torch.Tensor],
             scales: list[torch.Tensor]) -> torch.Tensor:
        return self._loop.run(
            hidden, positions.contiguous(), cos, sin, caches, attn.block_tables.contiguous(),
            attn.seq_lens.contiguous(), None if cu is None else cu.contiguous(),
            attn.slot_mapping.contiguous(), attn.scale, attn.sliding_window or 0,
            attn.soft_cap or 0.0, entry.paged_attention, entry.write_kv, entry.tile,
            entry.threads, entry.read_ahead, entry.prefetch_lines, self._final_norm, scales,
            timers)


def _plan_qualifies(attn: AttentionPlan, kv_scales: Optional[list["LayerKVScales"]]) -> bool:
    """Whether `attn` has what the loop passes: slots planned, no ALiBi slopes, no LSE; a
    float cache without `kv_scales`, or an 8-bit one with them, none pending calibration (that
    reads the step's K/V in the Python layers)."""
    if attn.slot_mapping is None or attn.alibi_slopes is not None or attn.return_lse:
        return False
    if kv_scales is None:
        return attn.layer.cache_dtype is None and attn.k_scale is None
    return attn.layer.cache_dtype is not None and not any(s.pending for s in kv_scales)


def _check_caches(attn: AttentionPlan, key_cache: torch.Tensor,
                  value_cache: torch.Tensor) -> None:
    """The plan's per-layer checks of `AttentionPlan.run` and `write_kv`, on one layer's caches
    with a query (and K/V rows) of the planned shape: they raise what those calls raise."""
    layer = attn.layer
    query = torch.empty(layer.query_shape, dtype=layer.dtype)
    layer.check_run(query, key_cache, value_cache, query)
    rows = query[:, :layer.kv_shape[1]]
    layer.check_write(rows, rows, key_cache, value_cache)


def _kernel_address(int8: bool) -> int:
    """The address of the int8 kernel's `int8_linear` or the tiled one's `tiled_linear`."""
    if int8:
        from engine.model.quant_int8 import _KERNEL as kernel
    else:
        from engine.model.quant_tiled import _KERNEL as kernel  # type: ignore[no-redef]
    return ctypes.cast(kernel.get()._linear, ctypes.c_void_p).value  # type: ignore[arg-type]


def build_layer_loop(model: torch.nn.Module) -> Optional[LayerLoop]:
    """`model`'s `LayerLoop`, or None when `loop_problem` names a problem or the extension does
    not build (the notice says so once)."""
    if loop_problem(model) is not None:
        return None
    try:
        return LayerLoop(model)
    except BuildFailed as exc:
        print(f"engine layer loop: using the Python layers ({exc})")
        return None
