"""Weight-only quantization from a GGUF file: projections that keep the file's own blocks.

A `QuantizedWeight` holds a projection twice: the blocks exactly as the GGUF file stores them
(`GGUFBlocks`: Q4_1 or Q8_0, 32 weights per block) and the dense weight the model was loaded with
(oneDNN-packed on a CPU). `quantized_linear` multiplies by the blocks directly (C++,
`engine/csrc/quant_matmul.cpp`): every weight is dequantised in float32, which is exact, so the
product uses the file's weights rather than a bfloat16-rounded copy, and a matmul streams ~3.5x
(Q4_1) or ~1.9x (Q8_0) fewer bytes than bfloat16. The model's `_linear` takes that path when a
step has at most `max_rows` token rows (decode of a few sequences, where the weights' bytes bound
the time) and the dense path otherwise (prefill, large batches: compute-bound, oneDNN is faster).

In bfloat16 on a CPU with AVX-512 BF16, the blocks are held tiled instead (`TiledWeight`, the same
bytes repacked once at load time, engine/model/quant_tiled.py): `tiled_linear` forms the same
exact products 16 output features at a time and reuses each unpacked weight for up to 12 rows,
so it beats oneDNN over more rows (`MAX_ROWS[torch.bfloat16]`).

`attach_gguf_weights` puts QuantizedWeights into a loaded `DecoderForCausalLM`, fusing the q/k/v and
gate/up parts the way the model fuses its dense weights (block rows concatenated, the llama.cpp
rotary row permutation already undone by `engine.model.gguf_reader.gguf_blocks`), or taking a
file's fused tensor as it is (Phi-3's `qkv_proj`, `gate_up_proj`). See
docs/quant.md. A tensor-parallel rank keeps only its shard of each file tensor's blocks
(engine/model/sharding.py): whole rows of blocks of a column-parallel projection, whole blocks of
32 input columns of a row-parallel one (which stays dense when its shard's columns are not
multiples of 32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Union

import torch

from engine.config import QUANTIZATION_MODES
from engine.model.checkpoint_names import fused_parts, layer_tensors
from engine.model.gguf_blocks import BLOCK_BYTES, QK, GGUFBlocks
from engine.model.packed_weight import LazyKernel
from engine.model.quant_int8 import X_DTYPES, Int8Weight, bad_x, pack_int8
from engine.model.quant_tiled import (TiledWeight, pack_tiled, tiled_kernel_problem,
                                      tiled_simd_path)
from engine.model.sharding import take_blocks
from engine.model.weight_arena import WeightArena

if TYPE_CHECKING:
    from engine.native_build import QuantKernel, TiledKernel

__all__ = ["QK", "BLOCK_BYTES", "MAX_ROWS", "FLOAT32_MAX_ROWS", "TILED_BF16_MAX_ROWS",
           "AMX_BF16_MAX_ROWS", "UNTILED_BF16_MAX_ROWS", "QUANTIZATION_MODES", "float32_max_rows",
           "tiled_max_rows",
           "GGUFBlocks", "TiledWeight", "QuantizedWeight", "quantized_linear", "kernel_problem",
           "attach_gguf_weights"]

#: Per dtype of the dense weight (and the activations): the most token rows for which the blocks
#: are used; above it the dense weight is. Measured crossovers of SmolLM2-135M's decode-step
#: matmuls on a 2-core Zen 4 (docs/quant.md): bfloat16 on the tiled blocks (`TiledWeight`),
#: float32 on the file's layout with the kernel's AVX-512 path.
MAX_ROWS = {torch.bfloat16: 48, torch.float32: 8}
#: Per kernel path (`QuantKernel.simd_paths`), its float32 crossover where it differs from
#: `MAX_ROWS[float32]`: the AVX2 path, measured on a 2-core Zen 3, against oneDNN's float32 matmul
#: without AVX-512 (docs/quant.md: the Q8_0 head about even at 40 to 48 rows, the Q4_1
#: projections ahead at 48).
FLOAT32_MAX_ROWS = {"avx2": 40}
#: Per GGUF format, the tiled bfloat16 path's crossover where it is below `MAX_ROWS[bfloat16]`:
#: Q8_0 costs more to unpack than Q4_1, and its one matrix here, the output head (49152 rows),
#: is where oneDNN's dense kernel is at its most efficient.
TILED_BF16_MAX_ROWS = {"Q8_0": 16}
#: Per GGUF format, the tiled path's crossover on AMX (`TiledKernel.simd_paths == "amx-bf16"`,
#: where oneDNN's dense bfloat16 matmul runs on AMX too), measured on a 2-core Xeon with AMX
#: (docs/quant.md): the Q4_1 projections ahead of oneDNN at 32 rows and behind at 48, the Q8_0
#: head about even at 16.
AMX_BF16_MAX_ROWS = {"Q4_1": 32, "Q8_0": 16}
#: The crossover of bfloat16 on the file's layout (`quantized_linear`), where the CPU lacks
#: AVX-512 BF16 and the blocks stay untiled.
UNTILED_BF16_MAX_ROWS = 4


def quantized_linear(x: torch.Tensor, blocks: GGUFBlocks,
                     kernel: Optional["QuantKernel"] = None) -> torch.Tensor:
    """`x @ W.T` for `x` `[M, cols]` (float32 or bfloat16) and W given as `blocks`, computed from
    the blocks (float32 dequantisation and accumulation); returns `[M, rows]` in x's dtype, with
    bfloat16 rounded to nearest even once at the end. Runs on torch's thread count; the result
    does not depend on it. `kernel`: a build of the kernel (tests pass the portable one); default
    this machine's."""
    if x.dim() != 2 or x.shape[1] != blocks.cols or x.dtype not in X_DTYPES or not x.is_cpu:
        raise bad_x(x, blocks.cols)  # one combined test: this runs ~120 times per decode step
    return _KERNEL.get(kernel).matmul(x.contiguous(), blocks.data, blocks.qtype,
                                      torch.get_num_threads())


class QuantizedWeight:
    """A projection weight with both forms: `blocks` (the file's weights, in the file's layout,
    `GGUFBlocks`, or tiled, `TiledWeight`, which needs a bfloat16 `dense`) and `dense` (the
    model's own weight, plain or oneDNN-packed, same `[rows, cols]`). The model's `_linear`
    multiplies by the blocks when `use_blocks(x)` (at most `max_rows` rows; default in float32
    `float32_max_rows()`; in bfloat16 `MAX_ROWS[bfloat16]`, `TILED_BF16_MAX_ROWS` of the format
    where it has one, and `UNTILED_BF16_MAX_ROWS` on untiled blocks) and by `dense`
    otherwise; or, when `int8` is set (quantization "gguf-int8"), always by that tiled copy of
    the blocks with int8 activations (engine/model/quant_int8.py)."""

    def __init__(self, blocks: Union[GGUFBlocks, TiledWeight], dense: torch.Tensor,
                 max_rows: Optional[int] = None, int8: Optional[Int8Weight] = None) -> None:
        if tuple(dense.shape) != tuple(blocks.shape):
            raise ValueError(f"dense: expected shape {blocks.shape} (the blocks'), got "
                             f"{tuple(dense.shape)}")
        if dense.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dense: expected float32 or bfloat16 (the kernel's activation "
                             f"dtypes), got {dense.dtype}")
        if isinstance(blocks, TiledWeight) and dense.dtype != torch.bfloat16:
            raise ValueError(f"dense: expected bfloat16 with tiled blocks (the tiled kernel's "
                             f"activations), got {dense.dtype}")
        if int8 is not None and int8.shape != tuple(blocks.shape):
            raise ValueError(f"int8: expected shape {blocks.shape} (the blocks'), got "
                             f"{int8.shape}")
        self.blocks = blocks
        self.dense = dense
        self.int8 = int8
        self.max_rows = _default_max_rows(blocks, dense) if max_rows is None else max_rows

    @property
    def shape(self) -> torch.Size:
        return self.dense.shape

    @property
    def tiled(self) -> bool:
        """Whether the blocks are tiled (`TiledWeight`, read by `tiled_linear`) rather than in
        the file's layout (`GGUFBlocks`, read by `quantized_linear`)."""
        return isinstance(self.blocks, TiledWeight)

    def operand(self, rows: int) -> torch.Tensor:
        """The tensor that the model's `_linear` (engine/model/decoder.py) reads for `rows`
        activation rows: the int8 tiles when the weight has them, else the blocks (tiled or in
        the file's layout) when `rows <= max_rows`, else the dense weight. Its bytes are what
        one such matmul streams from memory (bench/decode_roofline.py)."""
        if self.int8 is not None:
            return self.int8.packed
        if rows <= self.max_rows:
            return self.blocks.packed if self.tiled else self.blocks.data
        return self.dense

    def use_blocks(self, x: torch.Tensor) -> bool:
        """Whether the model's `_linear(x, self)` reads the blocks (few rows) rather than the
        dense weight."""
        return x.shape[0] <= self.max_rows

    def __repr__(self) -> str:
        path = "int8" if self.int8 is not None else f"max_rows={self.max_rows}"
        path += ", tiled" if self.tiled else ""
        return f"QuantizedWeight({self.blocks.qtype}, shape={tuple(self.shape)}, {path})"


def _default_max_rows(blocks: Union[GGUFBlocks, TiledWeight], dense: torch.Tensor) -> int:
    if dense.dtype != torch.bfloat16:
        return float32_max_rows()
    if not isinstance(blocks, TiledWeight):
        return UNTILED_BF16_MAX_ROWS
    return tiled_max_rows(blocks.qtype)


def tiled_max_rows(qtype: str, kernel: Optional["TiledKernel"] = None) -> int:
    """The tiled bfloat16 crossover of `qtype` on `kernel` (default this machine's build): its
    `AMX_BF16_MAX_ROWS` entry on the AMX path, else its `TILED_BF16_MAX_ROWS` entry, else
    `MAX_ROWS[bfloat16]`."""
    if tiled_simd_path(kernel) == "amx-bf16":
        return AMX_BF16_MAX_ROWS[qtype]
    return TILED_BF16_MAX_ROWS.get(qtype, MAX_ROWS[torch.bfloat16])


def _load() -> "QuantKernel":
    from engine.native_build import load_quant

    return load_quant()


_KERNEL: LazyKernel["QuantKernel"] = LazyKernel(_load)


def float32_max_rows(kernel: Optional["QuantKernel"] = None) -> int:
    """The float32 crossover of `kernel` (default this machine's build): its path's
    `FLOAT32_MAX_ROWS` entry, else `MAX_ROWS[float32]`. Raises BuildFailed when the kernel does
    not build."""
    return FLOAT32_MAX_ROWS.get(_KERNEL.get(kernel).simd_paths, MAX_ROWS[torch.float32])


def kernel_problem(require_simd: bool = False) -> Optional[str]:
    """None when the quantized-matmul kernel builds (or is built) on this machine, and, with
    `require_simd`, has a SIMD path, AVX-512 or AVX2 (the portable path was never measured
    against the dense one); else what is missing."""
    from engine.native_build import BuildFailed

    try:
        kernel = _KERNEL.get()
    except BuildFailed as exc:
        return f"its C++ kernel, which did not build: {exc}"
    if require_simd and kernel.simd_paths == "portable":
        return "a CPU with AVX2 (or AVX-512 F, BW, VL), FMA and F16C for a SIMD path"
    return None


def attach_gguf_weights(model: torch.nn.Module, blocks: Iterable[tuple[str, GGUFBlocks]],
                        max_rows: Optional[int] = None, int8: bool = False,
                        tiled: Optional[bool] = None) -> list[str]:
    """Replaces each projection weight of `model` (a loaded `DecoderForCausalLM`) by a
    `QuantizedWeight` over its GGUF blocks; `blocks` yields `(hugging_face_name, GGUFBlocks)`
    for the file's tensors in a supported format (others are absent: those projections stay
    dense, and so does a fused projection whose parts differ in format). `max_rows`: see
    `QuantizedWeight`; `int8`: also keep each one's int8 tiles (every matmul then uses them);
    `tiled`: hold the blocks tiled instead of in the file's layout (bfloat16 models only; default:
    for a bfloat16 model without `int8` when the tiled kernel has its AVX-512 BF16 path).
    Returns the names of the model attributes converted (e.g.
    "layers.0.qkv_proj", "lm_head"). ValueError when blocks do not match the model's shapes.
    Each file tensor is cut to the model's tensor-parallel shard (`model.shard`) as it arrives,
    so only the shard's blocks are ever held. The blocks (tiled, int8 or in the file's layout)
    lie back to back in huge pages, in the order a step reads them (`WeightArena`)."""
    by_name = _shard_blocks(model, blocks)
    model.weights_changed()
    if tiled is None:
        tiled = (not int8 and model.dtype == torch.bfloat16
                 and tiled_kernel_problem() is None)
    converted = []
    arena = WeightArena()  # the packed weights back to back, in the order a step reads them
    targets = [(f"layers.{i}.", f"model.layers.{i}.", layer)
               for i, layer in enumerate(model.layers)]
    for prefix, hf_prefix, layer in targets:
        for fused, parts in fused_parts(model.config).items():
            found = [by_name.get(hf_prefix + part + ".weight") for part in parts]
            if None in found or len({(b.qtype, b.cols) for b in found}) != 1:
                continue
            _attach(layer, fused, GGUFBlocks.concat(found), max_rows, int8, tiled, arena)
            converted.append(prefix + fused)
    head = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    if head in by_name:
        _attach(model, "lm_head", by_name[head], max_rows, int8, tiled, arena)
        converted.append("lm_head")
    return converted


def _copied_into(blocks: GGUFBlocks, arena: WeightArena) -> GGUFBlocks:
    """`blocks` with their bytes copied into `arena` (the file's layout, for `quantized_linear`)."""
    data = arena.take(blocks.data.numel()).view(blocks.data.shape)
    data.copy_(blocks.data)
    return GGUFBlocks(blocks.qtype, data, blocks.cols)


def _shard_blocks(model: torch.nn.Module,
                  blocks: Iterable[tuple[str, GGUFBlocks]]) -> dict[str, GGUFBlocks]:
    """`blocks` by name, each cut to `model.shard`'s part of it (dropped when that part is not
    whole blocks, and when the model has no projection for it)."""
    table = layer_tensors(model.config)
    head = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    kept = {}
    for name, full in blocks:
        parts = name.split(".", 3)
        if name == head:
            target = ("lm_head", None)
        elif len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in table:
            target = table[parts[3]]
        else:
            continue
        piece = take_blocks(full, model.shard.pieces(*target))
        if piece is not None:
            kept[name] = piece
    return kept


def _attach(module: torch.nn.Module, name: str, blocks: GGUFBlocks, max_rows: Optional[int],
            int8: bool, tiled: bool, arena: WeightArena) -> None:
    dense = getattr(module, name)
    module._parameters.pop(name, None)  # a Parameter slot takes no other type
    if tiled:
        weight = pack_tiled(blocks, arena=arena)
    elif int8:  # every matmul reads the int8 tiles: the file's blocks stay where they are
        weight = blocks
    else:
        weight = _copied_into(blocks, arena)
    int8_weight = pack_int8(blocks, arena=arena) if int8 else None
    setattr(module, name, QuantizedWeight(weight, dense, max_rows, int8_weight))
