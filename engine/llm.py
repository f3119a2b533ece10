"""The offline API: `LLM(...).generate(prompts, sampling_params)`, `chat`, `beam_search`.

Like vLLM's `LLM`: prompts are strings or `{"prompt_token_ids": [...]}` dicts; results come back
in the order of the prompts, whatever order the engine finished them in.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from engine.beam_search import BeamSearcher, BeamSearchOutput
from engine.config import EngineConfig
from engine.dtypes import resolve_dtype
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel
from engine.outputs import RequestOutput
from engine.sampling_params import BeamSearchParams, SamplingParams

Prompt = Union[str, dict]

class LLM:
    """A model with its paged KV cache, ready for offline batched generation.

    `model`: None (the default SmolLM2-135M-Instruct GGUF), a `.gguf` path, a Hugging Face
    directory, or a `LoadedModel`. `dtype`: float32 or bfloat16, or a name of
    `engine.dtypes.DTYPE_NAMES` ("auto": bfloat16 where the device multiplies it natively,
    else float32). The other arguments
    are `EngineConfig`'s (see there): the KV pool as `num_kv_blocks` or `kv_cache_memory_bytes`,
    the step budgets, prefix caching, the preemption mode, the attention backend and
    `quantization` ("auto", "gguf" or "none": whether small batches multiply by a GGUF file's
    own quantized blocks; docs/quant.md; ignored for a `LoadedModel`), `kv_allocation` ("paged"
    or a contiguous-reservation baseline: "reserve-max", "reserve-pow2", "reserve-oracle"; see
    engine/kv_allocation.py), `kv_cache_dtype` ("auto" = the model's dtype, "fp8" /
    "fp8_e4m3", "fp8_e5m2" or "int8": an 8-bit cache with per-layer, per-KV-head scales from the
    model file, else calibrated on a built-in prompt when `calculate_kv_scales`, else 1.0 for fp8;
    engine/kv_scales.py), `speculative_config` (vLLM's dict: "ngram" or "draft_model"
    speculative decoding, docs/spec-decode.md). `kv_fill` (a testing aid) fills the KV cache
    with a value such as NaN (for an int8 cache, a value in [-128, 127]).
    `tensor_parallel_size` > 1 splits the model over that many processes,
    `tensor_parallel_threads` torch threads each on a CPU (docs/distributed.md); under
    `torchrun`, the call returns only on rank 0: the other ranks serve its steps and exit when
    it shuts down. Call `shutdown()` (or let the interpreter exit) to end the worker processes.
    `prefault_kv_cache` makes the CPU KV pool resident when the engine is built.
    """

    def __init__(self, model: Union[str, None, LoadedModel] = None,
                 dtype: Union[str, torch.dtype] = torch.float32, block_size: int = 16,
                 num_kv_blocks: Optional[int] = None,
                 kv_cache_memory_bytes: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 preemption_mode: str = "recompute", backend: str = "auto",
                 max_model_len: Optional[int] = None, num_host_blocks: Optional[int] = None,
                 device: Union[str, torch.device] = "cpu",
                 kv_fill: Optional[float] = None,
                 quantization: Optional[str] = "auto", kv_allocation: str = "paged",
                 kv_cache_dtype: str = "auto", calculate_kv_scales: bool = True,
                 speculative_config: Optional[dict[str, Any]] = None,
                 tensor_parallel_size: int = 1, tensor_parallel_threads: int = 1,
                 prefault_kv_cache: bool = False) -> None:
        config = EngineConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                              kv_cache_memory_bytes=kv_cache_memory_bytes,
                              num_host_blocks=num_host_blocks, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              enable_prefix_caching=enable_prefix_caching,
                              preemption_mode=preemption_mode, max_model_len=max_model_len,
                              backend=backend, quantization=quantization,
                              kv_allocation=kv_allocation, kv_cache_dtype=kv_cache_dtype,
                              calculate_kv_scales=calculate_kv_scales,
                              speculative_config=speculative_config,
                              tensor_parallel_size=tensor_parallel_size,
                              tensor_parallel_threads=tensor_parallel_threads,
                              prefault_kv_cache=prefault_kv_cache)
        self.llm_engine = LLMEngine(model, resolve_dtype(dtype, device), config, device,
                                    kv_fill)
        self._counter = 0

    def shutdown(self) -> None:
        """Ends the engine's tensor-parallel workers (none in one process); idempotent."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    # ---------------------------------------------------------------- generate
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt; returns one finished `RequestOutput` per prompt, in order.

        `sampling_params` is one `SamplingParams` for all prompts or a list with one per prompt
        (default: `SamplingParams()`).
        """
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = self._params_per_prompt(sampling_params, len(items))
        ids: list[str] = []
        try:
            for p, sp in zip(items, params):
                ids.append(self._add(self._encode(p), p, sp))
            finished = self._run(len(ids), use_tqdm)
        except BaseException:
            for request_id in ids:  # leave the engine clean (e.g. after Ctrl-C)
                self.llm_engine.abort_request(request_id)
            raise
        return [finished[i] for i in ids]

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation (a list of `{"role", "content"}`
        dicts) or a list of them, then generates as `generate` does."""
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"messages: expected a non-empty list of messages or of "
                             f"conversations, got {messages!r}")
        conversations = messages if isinstance(messages[0], list) else [messages]
        tok = self.llm_engine.tokenizer
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text,
                            "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: Union[Prompt, Sequence[Prompt]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search for each prompt (branches share KV blocks); results in prompt order."""
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        encoded = []
        for p in items:
            ids = self._encode(p)
            self.llm_engine.check_prompt(ids)
            encoded.append((p if isinstance(p, str) else p.get("prompt"), ids))
        return BeamSearcher(self.llm_engine).run(encoded, params)

    # ---------------------------------------------------------------- helpers
    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.llm_engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.llm_engine.tokenizer.encode(prompt["prompt"])
        raise ValueError(f"prompts: expected a str or a dict with 'prompt_token_ids' (or "
                         f"'prompt'), got {prompt!r}")

    @staticmethod
    def _params_per_prompt(params: Union[SamplingParams, Sequence[SamplingParams], None],
                           count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"sampling_params: expected one SamplingParams or a list of "
                             f"{count} (one per prompt), got a list of {len(params)}")
        return params

    def _add(self, ids: list[int], prompt: Prompt, params: SamplingParams) -> str:
        request_id = f"offline-{self._counter}"
        self._counter += 1
        text = prompt if isinstance(prompt, str) else prompt.get("prompt")
        self.llm_engine.add_request(request_id, ids, params, prompt=text)
        return request_id

    def _run(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return finished
