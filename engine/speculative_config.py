"""`SpeculativeConfig`: vLLM's `speculative_config` dict, checked once (no engine imports).

Keys (vLLM's names): `method` ("ngram" or "draft_model"; inferred as "draft_model" when absent
and `model` or `draft_layers` is given), `num_speculative_tokens` (k, required), for "ngram"
`prompt_lookup_max` / `prompt_lookup_min` (the longest and shortest n-gram looked up; defaults
5 and 1, a missing max is at least the min), for "draft_model" either `model`
(a path the engine loads, sharing the target's tokenizer) or `draft_layers` (the target's first
L layers with its final norm and LM head). Any other key, or a value of the wrong type or
range, is a ValueError naming the key, what was expected and what was given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

METHODS = ("ngram", "draft_model")
KNOWN_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
              "model", "draft_layers")
DEFAULT_LOOKUP_MAX = 5
DEFAULT_LOOKUP_MIN = 1


def _int_at_least(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"speculative_config[{key!r}]: expected an int >= {minimum}, "
                         f"got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative decoding setup; build it with `SpeculativeConfig.from_dict`."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    model: Optional[str] = None
    draft_layers: Optional[int] = None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "SpeculativeConfig":
        """Parses vLLM's dict (see the module docstring); ValueError on any bad key or value."""
        if not isinstance(config, Mapping):
            raise ValueError(f"speculative_config: expected a dict, got {config!r}")
        unknown = [k for k in config if k not in KNOWN_KEYS]
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; expected keys "
                             f"among {KNOWN_KEYS}")
        method = config.get("method")
        if method is None and ("model" in config or "draft_layers" in config):
            method = "draft_model"
        if method not in METHODS:
            raise ValueError(f"speculative_config['method']: expected one of {METHODS}, "
                             f"got {method!r}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config['num_speculative_tokens']: expected an int "
                             ">= 1, got nothing (the key is required)")
        k = _int_at_least("num_speculative_tokens", config["num_speculative_tokens"], 1)
        if method == "ngram":
            return cls._ngram(config, k)
        return cls._draft_model(config, k)

    @classmethod
    def _ngram(cls, config: Mapping[str, Any], k: int) -> "SpeculativeConfig":
        _refuse_keys(config, ("model", "draft_layers"), "ngram")
        lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if lo is not None:
            lo = _int_at_least("prompt_lookup_min", lo, 1)
        if hi is not None:
            hi = _int_at_least("prompt_lookup_max", hi, 1)
        lo, hi = _lookup_range(lo, hi)
        if hi < lo:
            raise ValueError(f"speculative_config['prompt_lookup_max']: expected an int >= "
                             f"prompt_lookup_min={lo}, got {hi}")
        return cls("ngram", k, prompt_lookup_max=hi, prompt_lookup_min=lo)

    @classmethod
    def _draft_model(cls, config: Mapping[str, Any], k: int) -> "SpeculativeConfig":
        _refuse_keys(config, ("prompt_lookup_max", "prompt_lookup_min"), "draft_model")
        model, layers = config.get("model"), config.get("draft_layers")
        if (model is None) == (layers is None):
            raise ValueError("speculative_config['model']: expected exactly one of 'model' "
                             f"and 'draft_layers' with method 'draft_model', got model="
                             f"{model!r}, draft_layers={layers!r}")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config['model']: expected a non-empty path, "
                             f"got {model!r}")
        if layers is not None:
            layers = _int_at_least("draft_layers", layers, 1)
        return cls("draft_model", k, model=model, draft_layers=layers)


def _lookup_range(lo: Optional[int], hi: Optional[int]) -> tuple[int, int]:
    """(min, max) n-gram lengths: given ones kept; one missing takes the other's value (as vLLM);
    both missing give (DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX)."""
    if lo is None and hi is None:
        return DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX
    if lo is None:
        return min(DEFAULT_LOOKUP_MIN, hi), hi  # type: ignore[arg-type]
    if hi is None:
        return lo, max(lo, DEFAULT_LOOKUP_MAX)
    return lo, hi


def _refuse_keys(config: Mapping[str, Any], keys: tuple[str, ...], method: str) -> None:
    """ValueError naming the first of `keys` that has a value: it does not apply to `method`."""
    for key in keys:
        if config.get(key) is not None:
            raise ValueError(f"speculative_config[{key!r}]: expected no value with method "
                             f"{method!r}, got {config[key]!r}")
