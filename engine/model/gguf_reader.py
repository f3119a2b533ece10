"""Reading a Llama GGUF file: its metadata, a `DecoderConfig`, and float32 tensors under Hugging
Face names (dequantised with the `gguf` package).

llama.cpp's converter permutes the rows of each head of the Q and K projections so that rotary
embeddings rotate adjacent pairs (0,1), (2,3), ...; our model (like Hugging Face's Llama) rotates
halves (i, i + head_dim/2). `gguf_tensors` undoes that permutation, so a GGUF and the Hugging Face
checkpoint it came from load to the same weights. `gguf_blocks` yields the quantized tensors as
stored (for `engine.model.quant`), with the same permutation undone on their block rows.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from engine.model.config import DecoderConfig
from engine.model.quant import BLOCK_BYTES, GGUFBlocks

#: GGUF per-layer tensor name -> Hugging Face per-layer name.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def open_gguf(path: str) -> Any:
    """A `gguf.GGUFReader` over `path`; ValueError when the file is not a readable GGUF."""
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("reading a .gguf model needs the `gguf` package: pip install gguf") \
            from exc
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
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


def gguf_config(meta: dict[str, Any], tensor_names: set[str]) -> DecoderConfig:
    """The `DecoderConfig` described by a GGUF's metadata (architecture "llama" only)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"model: expected a GGUF of architecture 'llama', got {arch!r}")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise ValueError(f"model: rotary scaling {scaling!r} (or rope_freqs) is not supported; "
                         "expected plain rotary embeddings")

    def need(key: str) -> Any:
        if f"llama.{key}" not in meta:
            raise ValueError(f"model: GGUF metadata lacks 'llama.{key}'")
        return meta[f"llama.{key}"]

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = meta.get("llama.vocab_size", len(meta.get("tokenizer.ggml.tokens", ())))
    return DecoderConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=int(meta.get("llama.attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get("llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; ValueError for a tensor a Llama does not have."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"model: unexpected GGUF tensor {gguf_name!r} for a Llama model")


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K row permutation: within each head, rows stored as interleaved
    pairs (2i, 2i+1) go back to halves (i, i + head_dim/2)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def _unpermute(name: str, tensor: torch.Tensor, config: DecoderConfig) -> torch.Tensor:
    """`tensor` (rows first) with llama.cpp's rotary row permutation undone when `name` is a Q or
    K projection."""
    if name.endswith("self_attn.q_proj.weight"):
        return unpermute_rotary_rows(tensor, config.num_attention_heads)
    if name.endswith("self_attn.k_proj.weight"):
        return unpermute_rotary_rows(tensor, config.num_key_value_heads)
    return tensor


def gguf_blocks(reader: Any, config: DecoderConfig) -> Iterator[tuple[str, GGUFBlocks]]:
    """Yields `(hugging_face_name, GGUFBlocks)` for every matrix of the file stored in a format
    `engine.model.quant` reads (Q4_1, Q8_0); other tensors are skipped. The blocks are a copy of
    the file's bytes with rows in Hugging Face order (the rotary permutation of Q and K undone on
    whole rows of blocks)."""
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in BLOCK_BYTES or len(t.shape) != 2:
            continue
        name = hf_name(t.name)
        cols, rows = (int(n) for n in t.shape)  # GGUF lists dimensions fastest-first
        data = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(rows, -1))
        yield name, GGUFBlocks(qtype, _unpermute(name, data, config).contiguous(), cols)


def gguf_tensors(reader: Any, config: DecoderConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields `(hugging_face_name, float32 tensor)` for every tensor of the file, dequantised and
    with the rotary permutation of Q and K undone."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        name = hf_name(t.name)
        array = dequantize(t.data, t.tensor_type)
        # GGUF lists dimensions fastest-first; torch wants them slowest-first
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        array = np.ascontiguousarray(array, dtype=np.float32)
        if not array.flags.writeable:  # unquantised tensors are views of the memory-mapped file
            array = array.copy()
        yield name, _unpermute(name, torch.from_numpy(array).reshape(shape), config)
