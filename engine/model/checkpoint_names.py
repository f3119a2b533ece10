"""The Hugging Face checkpoint names of a Llama decoder layer's tensors and the model parameters
they load into: the dense loader (`engine.model.llama`) and the GGUF weights
(`engine.model.quant`) both read this table, so neither imports the other for it."""

from __future__ import annotations

from typing import Optional

__all__ = ["LAYER_TENSORS", "KV_SCALE_TENSORS", "fused_parts"]

#: Checkpoint sub-name -> (fused parameter, index of its part, or None when not fused).
LAYER_TENSORS: dict[str, tuple[str, Optional[int]]] = {
    "input_layernorm": ("input_layernorm", None),
    "post_attention_layernorm": ("post_attention_layernorm", None),
    "self_attn.q_proj": ("qkv_proj", 0),
    "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2),
    "self_attn.o_proj": ("o_proj", None),
    "mlp.gate_proj": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1),
    "mlp.down_proj": ("down_proj", None),
}

#: Checkpoint sub-name of a KV cache scale (fp8 checkpoints: a scalar per layer, or one per KV
#: head) -> which scales it sets ("kv_scale", an older name, sets both).
KV_SCALE_TENSORS: dict[str, tuple[str, ...]] = {
    "self_attn.k_scale": ("k",),
    "self_attn.v_scale": ("v",),
    "self_attn.kv_scale": ("k", "v"),
}


def fused_parts() -> dict[str, list[str]]:
    """Each projection of a decoder layer with the checkpoint sub-names of its parts, in row
    order (e.g. "qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])."""
    parts: dict[str, list[tuple[int, str]]] = {}
    for key, (fused, index) in LAYER_TENSORS.items():
        if fused.endswith("_proj"):
            parts.setdefault(fused, []).append((index or 0, key))
    return {fused: [key for _, key in sorted(found)] for fused, found in parts.items()}
