"""Gemma 3, the text model (`Gemma3ForCausalLM`): Gemma 2's layers (engine/model/families/
gemma2.py) plus RMSNorm of each query and key head (with `(1 + w)` weights too), a pattern of
sliding-window (local) and global layers, and two rotary embeddings: the local layers' own
base without scaling, the global layers' base with their scaling (linear in the released
checkpoints). No soft cap on the attention scores: transformers' Gemma 3 ignores
`attn_logit_softcapping`; the logits are capped when `final_logit_softcapping` is set.

The multimodal `Gemma3ForConditionalGeneration` (model_type "gemma3") is refused."""

from __future__ import annotations

from typing import Any

from engine.model.config import DecoderConfig
from engine.model.families.common import rope_settings
from engine.model.families.gemma2 import alternating_layer_types, gemma_fields
from engine.model.rope import rope_type_of

NAME = "gemma3"
HF_ARCHITECTURES = ("Gemma3ForCausalLM",)
#: "gemma3" is the multimodal model's type: listed so that its configs reach the refusal.
HF_MODEL_TYPES = ("gemma3_text", "gemma3")

#: `Gemma3TextConfig`'s defaults of the keys a config.json may omit.
DEFAULTS: dict[str, Any] = dict(sliding_window=4096, final_logit_softcapping=None,
                                max_position_embeddings=131072, rope_theta=1_000_000.0)


def _refuse_multimodal(raw: dict[str, Any]) -> None:
    archs = raw.get("architectures") or []
    if (raw.get("model_type") == "gemma3" or "text_config" in raw
            or "Gemma3ForConditionalGeneration" in archs):
        raise ValueError(f"model: architectures {archs} (model_type {raw.get('model_type')!r}) "
                         f"is the multimodal Gemma 3; only the text model is supported "
                         f"(Gemma3ForCausalLM, model_type 'gemma3_text')")


def local_rope_theta(raw: dict[str, Any]) -> float:
    """The sliding layers' rotary base: `rope_parameters["sliding_attention"]["rope_theta"]`
    (transformers 5) or `rope_local_base_freq` (default 10000). ValueError naming
    `rope_parameters` when the sliding layers' rotary is scaled."""
    params = (raw.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(params, dict):
        if rope_type_of(params) != "default":
            raise ValueError(f"model: rope_parameters['sliding_attention']={params!r} is not "
                             f"supported for {NAME} models; expected rope_type 'default' (the "
                             f"sliding layers' rotary is not scaled)")
        return float(params.get("rope_theta", raw.get("rope_local_base_freq", 10000.0)))
    return float(raw.get("rope_local_base_freq", 10000.0))


def config_from_hf(raw: dict[str, Any]) -> DecoderConfig:
    """A Gemma 3 text config.json as a `DecoderConfig` (omitted keys take `Gemma3TextConfig`'s
    defaults). Without `layer_types`, every `sliding_window_pattern`-th layer (default 6) is
    global, the others slide. ValueError for the multimodal model's config."""
    _refuse_multimodal(raw)
    raw = {**DEFAULTS, **raw}
    fields = gemma_fields(raw, NAME)
    fields["rope_theta"], fields["rope_scaling"] = rope_settings(raw, "full_attention")
    pattern = raw.get("sliding_window_pattern", 6)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"model: sliding_window_pattern: expected an int >= 1, got "
                         f"{pattern!r}")
    layer_types = raw.get("layer_types") or alternating_layer_types(
        fields["num_hidden_layers"], pattern)
    return DecoderConfig(**fields, qk_norm=True, layer_types=list(layer_types),
                         local_rope_theta=local_rope_theta(raw))
