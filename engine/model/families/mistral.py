"""Mistral: Llama's layers with sliding-window attention in every layer (`sliding_window`;
None or absent: full attention)."""

from __future__ import annotations

from typing import Any

from engine.model.config import DecoderConfig
from engine.model.families.common import llama_fields, refuse_unless

NAME = "mistral"
HF_ARCHITECTURES = ("MistralForCausalLM",)
HF_MODEL_TYPES = ("mistral",)


def config_from_hf(raw: dict[str, Any]) -> DecoderConfig:
    """A Mistral config.json as a `DecoderConfig`: every layer attends to the last
    `sliding_window` positions when it is set. transformers' Mistral ignores `layer_types`, so
    this does too."""
    refuse_unless(raw, NAME, "hidden_act", "silu")
    return DecoderConfig(**llama_fields(raw), architecture=NAME,
                         sliding_window=raw.get("sliding_window"))
