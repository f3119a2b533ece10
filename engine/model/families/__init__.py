"""The model families the engine runs, each a module that turns its Hugging Face config into a
`DecoderConfig` (engine/model/config.py); all run on the one decoder (engine/model/decoder.py).

Every module of this package except `common` is a family. A family module defines `NAME`,
`HF_ARCHITECTURES` (its `architectures` entries in config.json), `HF_MODEL_TYPES` (its
`model_type`s) and `config_from_hf(raw) -> DecoderConfig`, which raises ValueError naming any
config field it cannot honour. GGUF files reach the same functions:
`engine.model.gguf_reader` writes a GGUF's metadata as the Hugging Face config it stands for.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any

from engine.model.config import DecoderConfig

__all__ = ["FAMILIES", "config_from_hf", "family_of"]


def _discover() -> tuple[ModuleType, ...]:
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "common")
    return tuple(importlib.import_module(f"{__name__}.{name}") for name in names)


#: Every family (its module), by module name.
FAMILIES: tuple[ModuleType, ...] = _discover()


def family_of(raw: dict[str, Any]) -> ModuleType:
    """The family of a Hugging Face config dict: by its `architectures`, else its `model_type`.
    ValueError naming both when no family has them."""
    archs = raw.get("architectures") or []
    for family in FAMILIES:
        if set(archs) & set(family.HF_ARCHITECTURES):
            return family
    for family in FAMILIES:
        if raw.get("model_type") in family.HF_MODEL_TYPES:
            return family
    known = sorted(a for family in FAMILIES for a in family.HF_ARCHITECTURES)
    raise ValueError(f"model: architectures {archs} (model_type {raw.get('model_type')!r}) is "
                     f"not supported; expected one of {known}")


def config_from_hf(raw: dict[str, Any]) -> DecoderConfig:
    """The `DecoderConfig` of a Hugging Face config.json dict, by its family."""
    return family_of(raw).config_from_hf(raw)
