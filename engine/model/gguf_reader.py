"""Reading a GGUF file: its metadata, its `DecoderConfig` (through the Hugging Face config it
stands for, engine/model/gguf_config.py), and float32 tensors under Hugging Face names
(dequantised with the `gguf` package), for the architectures in `gguf_config.HF_ARCHITECTURES`.

Each architecture's GGUF tensor names map to Hugging Face's (`hf_name`), and what llama.cpp's
converter stores differently is undone, so a GGUF and the checkpoint it came from load to the
same weights:
- `llama`: the rows of each head of the Q and K projections are permuted so that rotary
  embeddings rotate adjacent pairs (0,1), (2,3), ...; our model (like Hugging Face's) rotates
  halves (i, i + head_dim/2). `unpermute_rotary_rows` undoes it.
- `gemma2` / `gemma3`: RMSNorm weights are stored as `1 + w` (Hugging Face stores `w`).
- `phi3`: `qkv_proj` and `gate_up_proj` stay fused (`attn_qkv`, `ffn_up`); LongRoPE's factors
  are tensors that the config reads, not weights.
`gguf_blocks` yields the quantized tensors as stored (for `engine.model.quant`), with the same
permutation undone on their block rows.
"""

from __future__ import annotations

import struct
from typing import Any, Iterator

import numpy as np
import torch

from engine.model.config import DecoderConfig
from engine.model.gguf_config import architecture_of, gguf_config
from engine.model.gguf_file import GGUFFile
from engine.model.quant import BLOCK_BYTES, GGUFBlocks

__all__ = ["open_gguf", "gguf_metadata", "gguf_config", "hf_name", "unpermute_rotary_rows",
           "gguf_blocks", "gguf_tensors"]

#: GGUF per-layer tensor name -> Hugging Face per-layer name (Llama's layout).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: Per architecture, the layer names that differ from `_LAYER_NAMES`.
_ARCH_LAYER_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
#: Tensors that are settings rather than weights (the config reads them).
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")
#: Architectures whose converter stores RMSNorm weights as `1 + w`.
_NORM_PLUS_ONE = ("gemma2", "gemma3")


def open_gguf(path: str) -> GGUFFile:
    """The header of the GGUF file at `path` (`engine.model.gguf_file`, GGUFReader's interface);
    ValueError when the file is not a readable GGUF."""
    try:
        import gguf  # noqa: F401 - the tensor types and the dequantisation
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("reading a .gguf model needs the `gguf` package: pip install gguf") \
            from exc
    try:
        return GGUFFile(path)
    except (ValueError, OSError, IndexError, KeyError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"model: expected a readable GGUF file at {path!r}, got an error "
                         f"reading it: {exc}") from exc


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata key with its value as Python data (strings, numbers, lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor of architecture `arch`; ValueError for a tensor
    that architecture does not have."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    raise ValueError(f"model: unexpected GGUF tensor {gguf_name!r} for architecture {arch!r}")


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K row permutation: within each head, rows stored as interleaved
    pairs (2i, 2i+1) go back to halves (i, i + head_dim/2)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def _architecture(reader: Any) -> str:
    field = reader.fields.get("general.architecture")
    return architecture_of({"general.architecture": field.contents() if field else None})


def _as_stored_by_hf(name: str, tensor: torch.Tensor, arch: str,
                     config: DecoderConfig) -> torch.Tensor:
    """`tensor` (rows first) as the Hugging Face checkpoint stores it: llama.cpp's rotary row
    permutation undone on a Llama Q or K projection, the `1 +` taken off a Gemma norm weight."""
    if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
        return unpermute_rotary_rows(tensor, config.num_attention_heads)
    if arch == "llama" and name.endswith("self_attn.k_proj.weight"):
        return unpermute_rotary_rows(tensor, config.num_key_value_heads)
    if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
        return tensor - 1.0
    return tensor


def gguf_blocks(reader: Any, config: DecoderConfig) -> Iterator[tuple[str, GGUFBlocks]]:
    """Yields `(hugging_face_name, GGUFBlocks)` for every matrix of the file stored in a format
    `engine.model.quant` reads (Q4_1, Q8_0); other tensors are skipped. The blocks are a copy of
    the file's bytes with rows in Hugging Face order (the rotary permutation of Q and K undone on
    whole rows of blocks)."""
    arch = _architecture(reader)
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in BLOCK_BYTES or len(t.shape) != 2 or t.name in _CONFIG_TENSORS:
            continue
        name = hf_name(t.name, arch)
        cols, rows = (int(n) for n in t.shape)  # GGUF lists dimensions fastest-first
        data = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(rows, -1))
        yield name, GGUFBlocks(qtype, _as_stored_by_hf(name, data, arch, config).contiguous(),
                               cols)


def gguf_tensors(reader: Any, config: DecoderConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields `(hugging_face_name, float32 tensor)` for every weight of the file, dequantised
    and as the Hugging Face checkpoint stores it (`_as_stored_by_hf`)."""
    from gguf.quants import dequantize

    arch = _architecture(reader)
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        name = hf_name(t.name, arch)
        array = dequantize(t.data, t.tensor_type)
        # GGUF lists dimensions fastest-first; torch wants them slowest-first
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        array = np.ascontiguousarray(array, dtype=np.float32)
        if not array.flags.writeable:  # unquantised tensors are views of the memory-mapped file
            array = array.copy()
        yield name, _as_stored_by_hf(name, torch.from_numpy(array).reshape(shape), arch, config)
