"""Qwen3 (dense): Llama's layers with an RMSNorm over each query and key head before rotary,
`attention_bias` (off in the released models) on Q, K, V and the output projection, and
Qwen2's sliding-window layout."""

from __future__ import annotations

from typing import Any

from engine.model.config import DecoderConfig
from engine.model.families.common import llama_fields, refuse_unless
from engine.model.families.qwen2 import window_layout

NAME = "qwen3"
HF_ARCHITECTURES = ("Qwen3ForCausalLM",)
HF_MODEL_TYPES = ("qwen3",)

#: transformers' default `head_dim` of Qwen3 (Qwen3Config), not hidden_size // heads.
HEAD_DIM = 128


def config_from_hf(raw: dict[str, Any]) -> DecoderConfig:
    """A Qwen3 config.json as a `DecoderConfig`: per-head Q/K RMSNorm (`qk_norm`),
    `attention_bias` on Q, K, V and the output projection, the window layout of
    `qwen2.window_layout`; `head_dim` is `HEAD_DIM` when the config omits it."""
    refuse_unless(raw, NAME, "hidden_act", "silu")
    window, types = window_layout(raw, NAME)
    fields = llama_fields(raw)
    fields["head_dim"] = raw.get("head_dim") or HEAD_DIM
    bias = bool(raw.get("attention_bias", False))
    return DecoderConfig(**fields, architecture=NAME, qk_norm=True, qkv_bias=bias, o_bias=bias,
                         sliding_window=window, layer_types=types)
