"""Gemma 2: RMSNorm with `(1 + w)` weights, norms after attention and around the MLP, GeGLU
(tanh GELU), embeddings scaled by sqrt(hidden_size), softmax scale `query_pre_attn_scalar **
-0.5`, soft caps on the attention scores and on the logits, and sliding-window layers
alternating with global ones (layer 0 slides)."""

from __future__ import annotations

from typing import Any

from engine.model.config import DecoderConfig
from engine.model.families.common import llama_fields, refuse_unless

NAME = "gemma2"
HF_ARCHITECTURES = ("Gemma2ForCausalLM",)
HF_MODEL_TYPES = ("gemma2",)


def alternating_layer_types(num_layers: int, pattern: int) -> list[str]:
    """transformers' default `layer_types` of a Gemma model whose every `pattern`-th layer is
    global: layer `i` is "full_attention" when `(i + 1) % pattern == 0`, else
    "sliding_attention"."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)]


def gemma_fields(raw: dict[str, Any], family: str, **defaults: Any) -> dict[str, Any]:
    """The `DecoderConfig` fields Gemma 2 and 3 share: Llama's, plus the norm offset, the
    sandwich norms, GeGLU, the embedding scale, `query_pre_attn_scalar` and the Q/K/V/O
    biases of `attention_bias`. `defaults` are the family's config class defaults of keys a
    config.json may omit (`sliding_window`, `final_logit_softcapping`,
    `max_position_embeddings`). ValueError naming `hidden_activation` (or `hidden_act`) when it
    is not the tanh GELU, and `use_bidirectional_attention` when it is set."""
    for key in ("hidden_activation", "hidden_act"):
        refuse_unless(raw, family, key, "gelu_pytorch_tanh")
    refuse_unless(raw, family, "use_bidirectional_attention", False)
    raw = {**defaults, **raw}
    fields = llama_fields(raw)
    fields["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", True))
    scalar = raw.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not scalar > 0:
        raise ValueError(f"model: query_pre_attn_scalar: expected a number > 0, got {scalar!r}")
    bias = bool(raw.get("attention_bias", False))
    return dict(fields, architecture=family, qkv_bias=bias, o_bias=bias,
                norm_weight_offset=1.0, sandwich_norm=True, hidden_act="gelu_pytorch_tanh",
                embedding_multiplier=fields["hidden_size"] ** 0.5,
                attention_scale=float(scalar) ** -0.5,
                final_logit_softcapping=raw.get("final_logit_softcapping"),
                sliding_window=raw.get("sliding_window"))


def config_from_hf(raw: dict[str, Any]) -> DecoderConfig:
    """A Gemma 2 config.json as a `DecoderConfig` (omitted keys take `Gemma2Config`'s
    defaults). Without `layer_types`, even layers (0, 2, ...) slide and odd ones are global, as
    transformers sets them."""
    fields = gemma_fields(raw, NAME, sliding_window=4096, final_logit_softcapping=30.0,
                          max_position_embeddings=8192)
    layer_types = raw.get("layer_types") or alternating_layer_types(
        fields["num_hidden_layers"], 2)
    return DecoderConfig(**fields, layer_types=list(layer_types),
                         attn_logit_softcapping=raw.get("attn_logit_softcapping", 50.0))
