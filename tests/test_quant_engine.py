"""The engine with GGUF quantization on (engine/model/quant.py) against transformers (float32).

The oracle is transformers' own Llama loaded from the same GGUF file, with `generate(do_sample=
False)`; it shares no code with the engine. Six prompts with different output lengths make the
running batch shrink from 6 sequences to 1. With the default float32 crossover (8 rows on the
kernel's AVX-512 path, 40 on AVX2: `float32_max_rows`) prefill runs on the dense weights and every
decode step on the file's blocks; with the crossover lowered to 3, decode steps take both paths.
A spy proves which ran. The KV cache is filled with NaN.
"""

from __future__ import annotations

import pytest
import torch

import engine.model.decoder as decoder
from engine import LLM, SamplingParams
from engine.model.loader import _gguf_quantization_applies, load_model
from engine.model.quant import QuantizedWeight, float32_max_rows

TEXTS = ["The capital of France is",
         "Once upon a time, in a land far away, there lived a kind old man who",
         "1, 2, 3,",
         "def fibonacci(n):",
         "The three primary colours are",
         "Water boils at"]
MAX_TOKENS = [9, 3, 7, 5, 2, 6]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype=torch.float32, quantization="gguf")


@pytest.fixture(scope="module")
def prompts(loaded):
    return [loaded.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def hf_greedy(hf_greedy_continuations, prompts):
    """transformers' greedy continuation of each prompt, MAX_TOKENS[i] tokens."""
    return hf_greedy_continuations(prompts, MAX_TOKENS)


@pytest.mark.parametrize("crossover", ["default", "lowered"])
def test_greedy_equals_transformers_on_both_paths(loaded, prompts, hf_greedy, monkeypatch,
                                                   crossover):
    assert loaded.quantization == "gguf"
    max_rows = float32_max_rows() if crossover == "default" else 3
    weights = [w for layer in loaded.model.layers for w in vars(layer).values()
               if isinstance(w, QuantizedWeight)] + [loaded.model.lm_head]
    assert len(weights) == 4 * len(loaded.model.layers) + 1
    assert loaded.model.lm_head.blocks.qtype == "Q8_0"
    for w in weights:
        monkeypatch.setattr(w, "max_rows", max_rows)
    rows_seen = []
    use_blocks = QuantizedWeight.use_blocks
    monkeypatch.setattr(QuantizedWeight, "use_blocks",
                        lambda self, x: rows_seen.append(x.shape[0]) or use_blocks(self, x))
    calls = []
    kernel = decoder.quantized_linear
    monkeypatch.setattr(decoder, "quantized_linear", lambda x, b: calls.append(1) or kernel(x, b))

    llm = LLM(model=loaded, kv_fill=float("nan"), num_kv_blocks=64)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == hf_greedy
    blocks_rows = {r for r in rows_seen if r <= max_rows}
    dense_rows = {r for r in rows_seen if r > max_rows}
    assert len(calls) == sum(r <= max_rows for r in rows_seen)
    assert blocks_rows >= {1, min(3, max_rows)} and any(r > 8 for r in dense_rows)  # prefill
    if max_rows < len(TEXTS):
        assert dense_rows & set(range(max_rows + 1, len(TEXTS) + 1)), "no dense decode step"


def test_quantization_option_is_checked():
    with pytest.raises(ValueError, match="quantization: expected one of"):
        LLM(quantization="int4")
    with pytest.raises(ValueError, match="quantization: 'gguf' needs dtype float32 or bfloat16"):
        load_model(None, dtype=torch.float16, quantization="gguf")
    assert _gguf_quantization_applies("auto", torch.bfloat16, "cpu")
    assert not _gguf_quantization_applies("auto", torch.float16, "cpu")
    assert not _gguf_quantization_applies("auto", torch.float32, "meta")
    assert not _gguf_quantization_applies("none", torch.float32, "cpu")


def test_auto_needs_the_simd_kernel(monkeypatch):
    """`auto` turns the blocks on only where the kernel has a measured SIMD path (AVX-512 or
    AVX2); `gguf` takes the portable one too."""
    import engine.model.quant as quant
    from engine.native_build import TIERS, load_quant
    from paged_kernels.cpp_build import compile_flags

    monkeypatch.setattr(quant._KERNEL, "_kernel", load_quant(compile_flags(TIERS, frozenset())))
    assert not _gguf_quantization_applies("auto", torch.bfloat16, "cpu")
    assert _gguf_quantization_applies("gguf", torch.bfloat16, "cpu")


def test_gguf_quantization_of_a_hugging_face_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="quantization: 'gguf' reads a .gguf model"):
        load_model(str(tmp_path), quantization="gguf")
