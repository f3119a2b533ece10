"""The model side of the engine: one decoder for every supported family (engine/model/families/)
on a paged KV cache, and its loaders."""

from engine.model.config import DecoderConfig
from engine.model.decoder import DecoderForCausalLM
from engine.model.loader import LoadedModel, load_model
from engine.model.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "DecoderConfig", "DecoderForCausalLM", "LoadedModel", "load_model"]
