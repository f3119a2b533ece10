"""What the families' config translations share: Llama's fields, the rotary settings under
their two spellings, and refusing what a family cannot honour."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["llama_fields", "refuse_unless", "rope_settings"]


def rope_settings(raw: dict[str, Any], layer_type: Optional[str] = None
                  ) -> tuple[float, Optional[dict[str, Any]]]:
    """`(rope_theta, rope_scaling)` of a config: newer transformers write `rope_parameters`
    (`{"rope_type", "rope_theta", ...}`, or one such dict per layer type, picked by
    `layer_type`), older ones `rope_theta` and `rope_scaling`. The scaling is None for plain
    rotary ("default")."""
    params = raw.get("rope_parameters") or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = dict(raw.get("rope_scaling") or {})
    scaling.update({k: v for k, v in params.items() if k != "rope_theta"})
    scaling.pop("rope_theta", None)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, (None if kind == "default" else scaling)


def llama_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The `DecoderConfig` fields every family reads the way Llama's config writes them."""
    theta, scaling = rope_settings(raw)
    try:
        return dict(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads"), head_dim=raw.get("head_dim"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"))
    except KeyError as exc:
        raise ValueError(f"model: config.json lacks {exc.args[0]!r}") from exc


def refuse_unless(raw: dict[str, Any], family: str, key: str, *allowed: Any) -> None:
    """ValueError naming `key` when `raw` sets it to a value outside `allowed` (absent counts as
    allowed)."""
    if key in raw and raw[key] is not None and raw[key] not in allowed:
        raise ValueError(f"model: {key}={raw[key]!r} is not supported for {family} models; "
                         f"expected one of {list(allowed)}")
