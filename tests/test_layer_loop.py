"""The native layer loop (engine/model/layer_loop.py, engine/csrc/layer_loop.cpp): the steps it
runs give the bits of the Python layers (same tokens, same log-probabilities, same KV cache
bytes), it runs the steps it claims and no others, and it says why a model does not qualify."""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model import layer_loop
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["gguf", "gguf-int8"])
def loaded(request):
    model = load_model(None, dtype=torch.bfloat16, quantization=request.param)
    problem = layer_loop.loop_problem(model.model)
    if problem is not None:
        pytest.skip(f"the layer loop needs {problem} on this machine")
    return model


class Spy:
    """Counts the steps `LayerLoop.run` ran (returned hidden states) and declined (None)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ran = self.declined = 0
        real = layer_loop.LayerLoop.run

        def run(loop, *args, **kwargs) -> Optional[torch.Tensor]:
            out = real(loop, *args, **kwargs)
            if out is None:
                self.declined += 1
            else:
                self.ran += 1
            return out

        monkeypatch.setattr(layer_loop.LayerLoop, "run", run)


def _generate(loaded, loop: bool, kv_cache_dtype: str = "auto", prompt_len: int = 20,
              threads: int = 1):
    """Four greedy requests of different prompt lengths, 12 tokens each: their (tokens,
    log-probabilities) and the engine's device KV caches."""
    layer_loop.use_loop = loop
    loaded.model.weights_changed()
    torch.set_num_threads(threads)
    try:
        engine = LLMEngine(loaded, config=EngineConfig(max_model_len=256,
                                                       kv_cache_dtype=kv_cache_dtype))
        rng = random.Random(0)
        for i in range(4):
            engine.add_request(str(i), [rng.randrange(256, 32000)
                                        for _ in range(prompt_len + 9 * i)],
                               SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0,
                                              logprobs=2))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
    finally:
        layer_loop.use_loop = True
        loaded.model.weights_changed()
        torch.set_num_threads(1)
    results = {k: (o.token_ids, [sorted(d.items())
                                 for d in o.logprobs]) for k, o in done.items()}
    return results, engine.runner.kv_cache.device_caches


@pytest.mark.parametrize("threads", [1, 2])
def test_steps_give_the_python_layers_bits(loaded, monkeypatch, threads):
    """The same requests with the loop and without: the same tokens and log-probabilities
    (float32, bit for bit) and the same KV cache bytes in every layer; the loop ran every decode
    step (and, with int8 tiles, the prefill steps too)."""
    python, python_caches = _generate(loaded, loop=False, threads=threads)
    spy = Spy(monkeypatch)
    native, native_caches = _generate(loaded, loop=True, threads=threads)
    assert native == python
    _assert_same_bytes(python_caches, native_caches)
    assert spy.ran >= 11  # the decode steps
    int8 = loaded.model.layer_loop().int8
    assert spy.declined == (0 if int8 else 1)  # tiled weights: the 4-prompt prefill is dense


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8bit_cache_steps_give_the_python_layers_bits(loaded, monkeypatch, kv_cache_dtype):
    """An 8-bit cache: the engine's calibration step sets the layers' scales from its K/V in
    the Python layers; the loop runs the later steps with those scales (tiled weights: not the
    dense prefill), and everything is bit for bit the Python layers' (tokens,
    log-probabilities, the cache bytes)."""
    python, python_caches = _generate(loaded, loop=False, kv_cache_dtype=kv_cache_dtype)
    spy = Spy(monkeypatch)
    native, native_caches = _generate(loaded, loop=True, kv_cache_dtype=kv_cache_dtype)
    assert native == python
    _assert_same_bytes(python_caches, native_caches)
    assert spy.ran >= 11 and spy.declined <= 2


def _assert_same_bytes(caches0, caches1) -> None:
    assert len(caches0) == len(caches1)
    for (k0, v0), (k1, v1) in zip(caches0, caches1):
        assert torch.equal(k0.view(torch.uint8), k1.view(torch.uint8))
        assert torch.equal(v0.view(torch.uint8), v1.view(torch.uint8))


def test_steps_with_more_rows_than_the_tiles_take_the_python_layers(loaded, monkeypatch):
    loop = loaded.model.layer_loop()
    if loop.int8:
        pytest.skip("int8 tiles take every row count")
    spy = Spy(monkeypatch)
    _generate(loaded, loop=True, prompt_len=loop.max_rows + 1)
    assert spy.declined >= 1 and spy.ran >= 11


def _one_step_args(loaded):
    """The arguments of one decode-sized forward of `loaded`'s model (a 10-token prompt's
    prefill), for direct calls of the loop: (input_ids, positions, kv_caches, meta)."""
    model = loaded.model
    engine = LLMEngine(loaded, config=EngineConfig(max_model_len=256))
    engine.add_request("0", list(range(300, 310)), SamplingParams(max_tokens=3,
                                                                  temperature=0.0))
    captured = {}
    real = model.forward

    def forward(input_ids, positions, kv_caches, meta, kv_scales=None):
        captured.update(args=(input_ids, positions, kv_caches, meta))
        return real(input_ids, positions, kv_caches, meta, kv_scales)

    model.forward = forward
    try:
        engine.step()
    finally:
        del model.forward
    return captured["args"]


def _run_loop(model, input_ids, positions, kv_caches, meta):
    rotary = model._step_rotary(positions, meta)
    plans = model.plan_attention(meta, input_ids.shape[0], kv_caches[0][0])
    hidden = torch.nn.functional.embedding(input_ids, model.embed_tokens)
    return model.layer_loop().run(hidden, rotary, kv_caches, plans)


def test_caches_unlike_the_first_layers_are_refused(loaded):
    """The plan checks the first layer's caches; the loop refuses any other layer's that differ
    from them, before it runs anything."""
    input_ids, positions, kv_caches, meta = _one_step_args(loaded)
    k, v = kv_caches[1]
    caches = list(kv_caches)
    caches[1] = (k[:-1], v[:-1])
    with pytest.raises(RuntimeError, match="caches: expected every layer's caches to match"):
        _run_loop(loaded.model, input_ids, positions, caches, meta)


def test_block_ids_the_kernel_refuses_raise_the_abis_error(loaded):
    """A block table the plan did not scan (content checks are on request for the cpu
    backend) with a block id past the cache: the kernel refuses it, and the loop raises the
    error the plan's own `run` raises, which names `block_tables`."""
    input_ids, positions, kv_caches, meta = _one_step_args(loaded)
    bad = meta.block_tables.clone()
    bad[0, 0] = kv_caches[0][0].shape[0] + 5
    with pytest.raises(ValueError, match="^block_tables") as raised:
        _run_loop(loaded.model, input_ids, positions, kv_caches,
                  dataclasses.replace(meta, block_tables=bad))
    assert "rejected the attention metadata" in str(raised.value.__context__)


def test_loop_problem_names_what_stops_a_model(loaded, monkeypatch):
    assert layer_loop.loop_problem(loaded.model) is None
    monkeypatch.setattr(layer_loop, "use_loop", False)
    assert "PK_ENGINE_LAYER_LOOP=0" in layer_loop.loop_problem(loaded.model)
    monkeypatch.setattr(layer_loop, "use_loop", True)
    dense = load_model(None, dtype=torch.bfloat16, quantization="none")
    assert layer_loop.loop_problem(dense.model) == ("GGUF weights (quantization 'gguf' or "
                                                    "'gguf-int8')")
    assert dense.model.layer_loop() is None
    fp32 = load_model(None, dtype=torch.float32, quantization="none")
    assert layer_loop.loop_problem(fp32.model) == "a bfloat16 model on the CPU"


def test_new_weights_rebuild_the_loop(loaded):
    model = loaded.model
    first = model.layer_loop()
    assert first is not None and model.layer_loop() is first
    model.weights_changed()
    second = model.layer_loop()
    assert second is not None and second is not first


def test_timers_split_the_steps_it_runs(loaded, monkeypatch):
    """`layer_loop.timers` (bench.serve_profile's) gets every part of the steps the loop ran."""
    timers = torch.zeros(4, dtype=torch.float64)
    monkeypatch.setattr(layer_loop, "timers", timers)
    spy = Spy(monkeypatch)
    _generate(loaded, loop=True)
    assert spy.ran >= 11 and bool((timers > 0).all())
    monkeypatch.setattr(layer_loop, "timers", torch.zeros(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"times: expected a float64 tensor \[4\]"):
        _generate(loaded, loop=True)
