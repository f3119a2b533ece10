"""Llama (1, 2, 3.x) and other checkpoints that declare the Llama architecture: RMSNorm, SwiGLU,
rotary embeddings with Llama 3's, linear or dynamic (NTK) scaling, optional biases."""

from __future__ import annotations

from typing import Any

from engine.model.config import DecoderConfig
from engine.model.families.common import llama_fields, refuse_unless

NAME = "llama"
HF_ARCHITECTURES = ("LlamaForCausalLM",)
HF_MODEL_TYPES = ("llama",)


def config_from_hf(raw: dict[str, Any]) -> DecoderConfig:
    """A Llama config.json as a `DecoderConfig`: `attention_bias` puts biases on Q, K, V and
    the output projection, `mlp_bias` on the MLP's projections."""
    refuse_unless(raw, NAME, "hidden_act", "silu")
    refuse_unless(raw, NAME, "pretraining_tp", 1)
    bias = bool(raw.get("attention_bias", False))
    return DecoderConfig(**llama_fields(raw), architecture=NAME, qkv_bias=bias, o_bias=bias,
                         mlp_bias=bool(raw.get("mlp_bias", False)))
