"""A small vLLM-style inference engine on the paged KV cache of `paged_kernels`.

`from engine import LLM, SamplingParams` for offline generation; `LLMEngine` is the step-level
API a server drives (add_request / step / abort_request / stats).
"""

from engine.beam_search import BeamSearchOutput, BeamSearchSequence
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import BeamSearchParams, SamplingParams
from engine.stats import EngineStats

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "BeamSearchParams", "RequestOutput",
    "CompletionOutput", "BeamSearchOutput", "BeamSearchSequence", "EngineStats",
]
