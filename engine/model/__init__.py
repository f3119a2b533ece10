"""The model side of the engine: the Llama decoder on a paged KV cache and its loaders."""

from engine.model.llama import LlamaConfig, LlamaForCausalLM
from engine.model.loader import LoadedModel, load_model
from engine.model.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "LlamaConfig", "LlamaForCausalLM", "LoadedModel", "load_model"]
