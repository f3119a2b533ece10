"""The Hugging Face checkpoint names of a decoder layer's tensors and the model parameters they
load into: the dense loader (`engine.model.decoder`) and the GGUF weights (`engine.model.quant`)
both read this table, so neither imports the other for it."""

from __future__ import annotations

from typing import Optional

from engine.model.config import DecoderConfig

__all__ = ["LAYER_TENSORS", "KV_SCALE_TENSORS", "fused_parts", "layer_tensors", "NORM_PARAMS"]

#: Llama's checkpoint sub-name -> (fused parameter, index of its part, or None when not fused).
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

#: The layer parameters that are RMSNorm weights (they take `norm_weight_offset`).
NORM_PARAMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm", "q_norm", "k_norm")

#: Checkpoint sub-name of a KV cache scale (fp8 checkpoints: a scalar per layer, or one per KV
#: head) -> which scales it sets ("kv_scale", an older name, sets both).
KV_SCALE_TENSORS: dict[str, tuple[str, ...]] = {
    "self_attn.k_scale": ("k",),
    "self_attn.v_scale": ("v",),
    "self_attn.kv_scale": ("k", "v"),
}


def layer_tensors(config: DecoderConfig) -> dict[str, tuple[str, Optional[int]]]:
    """Every tensor a layer of `config`'s checkpoint holds, as `"<sub-name>.weight"` or
    `".bias"` -> (layer parameter, index of its part in a fused parameter or None). Bias
    parameters are named after their weight with `_bias` for `_proj` (`qkv_bias`, ...)."""
    table = {f"{key}.weight": target for key, target in LAYER_TENSORS.items()}
    if config.fused_checkpoint:
        for fused in ("qkv_proj", "gate_up_proj"):
            parts = fused_parts()[fused]
            for part in parts:
                del table[f"{part}.weight"]
            prefix = "self_attn." if fused == "qkv_proj" else "mlp."
            table[f"{prefix}{fused}.weight"] = (fused, None)
    if config.qk_norm:
        table["self_attn.q_norm.weight"] = ("q_norm", None)
        table["self_attn.k_norm.weight"] = ("k_norm", None)
    if config.sandwich_norm:
        table["pre_feedforward_layernorm.weight"] = ("pre_feedforward_layernorm", None)
        table["post_feedforward_layernorm.weight"] = ("post_feedforward_layernorm", None)
    biased = {"qkv_proj": config.qkv_bias, "o_proj": config.o_bias,
              "gate_up_proj": config.mlp_bias, "down_proj": config.mlp_bias}
    for key, (param, index) in list(table.items()):
        if key.endswith(".weight") and biased.get(param):
            table[key[:-len("weight")] + "bias"] = (param[:-len("proj")] + "bias", index)
    return table


def fused_parts(config: Optional[DecoderConfig] = None) -> dict[str, list[str]]:
    """Each projection of a decoder layer with the checkpoint sub-names of its parts, in row
    order, as `config`'s checkpoint stores them (`layer_tensors`; one part when it stores the
    projection fused, as Phi-3's `self_attn.qkv_proj`), or as Llama's does for None (e.g.
    "qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])."""
    table = ({f"{key}.weight": target for key, target in LAYER_TENSORS.items()}
             if config is None else layer_tensors(config))
    parts: dict[str, list[tuple[int, str]]] = {}
    for key, (param, index) in table.items():
        if key.endswith(".weight") and param.endswith("_proj"):
            parts.setdefault(param, []).append((index or 0, key[:-len(".weight")]))
    return {param: [key for _, key in sorted(found)] for param, found in parts.items()}
