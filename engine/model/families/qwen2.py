"""Qwen2 and Qwen2.5: Llama's layers with biases on the Q, K and V projections (not the output
projection) and, with `use_sliding_window`, a sliding window on the layers from
`max_window_layers` on."""

from __future__ import annotations

from typing import Any, Optional

from engine.model.config import DecoderConfig
from engine.model.families.common import llama_fields, refuse_unless

NAME = "qwen2"
HF_ARCHITECTURES = ("Qwen2ForCausalLM",)
HF_MODEL_TYPES = ("qwen2",)

#: transformers' default `max_window_layers` (Qwen2Config, Qwen3Config).
MAX_WINDOW_LAYERS = 28


def window_layout(raw: dict[str, Any], family: str
                  ) -> tuple[Optional[int], Optional[list[str]]]:
    """`(sliding_window, layer_types)` of a Qwen2 or Qwen3 config, as transformers reads it:
    the window counts only with `use_sliding_window`; without `layer_types`, the layers from
    index `max_window_layers` on slide and the ones before attend to everything. `(None,
    None)`: every layer attends to everything. ValueError naming `use_sliding_window` when
    `layer_types` has sliding layers but the config turns the window off (transformers cannot
    run that either)."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    types = raw.get("layer_types")
    if window is None:
        if types and "sliding_attention" in types:
            raise ValueError(f"model: use_sliding_window={raw.get('use_sliding_window')!r} with "
                             f"sliding_window={raw.get('sliding_window')!r} and sliding_attention "
                             f"layers is not supported for {family} models; expected "
                             f"use_sliding_window=true and a sliding_window")
        return None, None
    if types is None:
        first = raw.get("max_window_layers", MAX_WINDOW_LAYERS)
        types = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(raw["num_hidden_layers"])]
    return window, list(types)


def config_from_hf(raw: dict[str, Any]) -> DecoderConfig:
    """A Qwen2 / Qwen2.5 config.json as a `DecoderConfig`: Q, K and V biased, the output and
    MLP projections not (transformers' Qwen2 has no switch for them), the window layout of
    `window_layout`."""
    refuse_unless(raw, NAME, "hidden_act", "silu")
    window, types = window_layout(raw, NAME)
    return DecoderConfig(**llama_fields(raw), architecture=NAME, qkv_bias=True,
                         sliding_window=window, layer_types=types)
