"""Phi-3 (and Phi-3.5 mini, Phi-4 mini with full rotary): Llama's layer with the Q, K, V
projections stored as one `qkv_proj` and the gate and up projections as one `gate_up_proj`, an
optional sliding window on every layer, and LongRoPE scaling (`longrope`; transformers reads
`su` and `yarn` in a Phi-3 config as `longrope` too, and so does this module).

LongRoPE's settings live partly outside the scaling dict in a Phi-3 config.json:
`original_max_position_embeddings` (which then wins over the dict's own, as transformers
decides) and the default `factor`, `max_position_embeddings / original_max_position_embeddings`,
from which transformers derives the attention factor. `config_from_hf` writes both into the
`rope_scaling` it hands on, so the scaling dict alone says what the rotary tables are.
"""

from __future__ import annotations

from typing import Any, Optional

from engine.model.config import DecoderConfig
from engine.model.families.common import llama_fields, refuse_unless

NAME = "phi3"
HF_ARCHITECTURES = ("Phi3ForCausalLM",)
HF_MODEL_TYPES = ("phi3",)


def config_from_hf(raw: dict[str, Any]) -> DecoderConfig:
    """A Phi-3 config.json as a `DecoderConfig` (fused checkpoint tensors; `sliding_window`,
    when set, on every layer). ValueError naming `hidden_act` other than silu or a
    `partial_rotary_factor` other than 1.0 (rotary over part of each head is not
    implemented)."""
    refuse_unless(raw, NAME, "hidden_act", "silu")
    refuse_unless(raw, NAME, "partial_rotary_factor", 1.0, 1)
    refuse_unless(raw.get("rope_parameters") or {}, NAME, "partial_rotary_factor", 1.0, 1)
    refuse_unless(raw.get("rope_scaling") or {}, NAME, "partial_rotary_factor", 1.0, 1)
    fields = llama_fields(raw)
    fields["head_dim"] = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    fields["rope_scaling"] = _longrope_settings(raw, fields["rope_scaling"])
    return DecoderConfig(**fields, architecture=NAME, fused_checkpoint=True,
                         sliding_window=raw.get("sliding_window"))


def _longrope_settings(raw: dict[str, Any],
                       scaling: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """`scaling` (from `rope_settings`) with `su` and `yarn` named `longrope` and, for LongRoPE, the
    config's `original_max_position_embeddings` and default `factor` written in."""
    if scaling is None:
        return None
    scaling = dict(scaling)
    kind = scaling.pop("type", None)
    scaling.setdefault("rope_type", kind)
    if scaling["rope_type"] in ("su", "yarn"):  # as transformers' Phi3Config renames them
        scaling["rope_type"] = "longrope"
    if scaling["rope_type"] != "longrope":
        return scaling  # DecoderConfig refuses what rope.py does not implement, naming it
    max_len = raw.get("max_position_embeddings", 2048)
    original = raw.get("original_max_position_embeddings",
                       scaling.get("original_max_position_embeddings", max_len))
    scaling["original_max_position_embeddings"] = original
    if scaling.get("factor") is None:
        scaling["factor"] = max_len / original
    scaling.pop("partial_rotary_factor", None)  # 1.0, checked above
    return scaling
