"""`SpeculativeConfig` under the spec_decode package's name. It lives in
engine/speculative_config.py, which imports nothing from the engine, so that `EngineConfig` can
parse it without an import cycle between engine/config.py and this package."""

from engine.speculative_config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
