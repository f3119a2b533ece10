"""The engine on an 8-bit KV cache (fp8 e4m3 / e5m2, int8): its settings, the block budget, the
scales (calibrated on the first step, or from the model file), and prefix caching,
copy-on-write, swap and beam search on 8-bit blocks, with the default model in float32.

Oracles: the calibrated scales and the stored codes are checked against the K/V the model hands
to `write_kv`, with plain formulas here (the format's largest value, its rounding bound); a run
that uses a feature (prefix-cache hits, preemption by swap, beam search over shared blocks) is
checked against the same 8-bit engine with the same scales that does not use it (a large pool,
no sharing, one prefill per prefix). fp8 caches are filled with NaN and int8 ones with an
extreme value first, so a slot read before it is written shows. CPU time is scarce: short
prompts, few tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.kv_cache import KVCache
from engine.kv_scales import kv_cache_dtype, make_kv_scales
from engine.model.config import DecoderConfig
from engine.model.decoder import DecoderForCausalLM
from engine.model.loader import LoadedModel, load_model
from engine.sampling_params import BeamSearchParams
from paged_kernels.attention import AttentionPlan

TEXTS = ["The capital of France is",
         "Once upon a time, in a land far away, there lived a kind old man who",
         "1, 2, 3,"]
MAX_TOKENS = 5
#: The largest scaled magnitude of each format, and its rounding error bound: relative
#: (2^-(mantissa bits + 1)) above the smallest normal, absolute (half the smallest subnormal
#: step, in scaled units) below it; int8 rounds to integers.
FORMATS = {"fp8_e4m3": (448.0, 2.0 ** -4, 2.0 ** -10),
           "fp8_e5m2": (57344.0, 2.0 ** -3, 2.0 ** -17),
           "int8": (127.0, 0.0, 0.5)}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(loaded):
    return [loaded.tokenizer.encode(t) for t in TEXTS]


def poison(name: str) -> float:
    return -128.0 if name == "int8" else float("nan")


BACKEND = "auto"


def make_llm(loaded, name: str, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("backend", BACKEND)
    return LLM(model=loaded, kv_cache_dtype=name, kv_fill=poison(name), **kw)


def copy_scales(dst: LLM, src: LLM) -> None:
    """Gives `dst` the scales `src` calibrated (so both quantise alike)."""
    for d, s in zip(dst.llm_engine.kv_cache.scales, src.llm_engine.kv_cache.scales):
        assert not s.pending
        d.k_scale.copy_(s.k_scale)
        d.v_scale.copy_(s.v_scale)
        d.pending = False


def greedy(llm: LLM, prompts, max_tokens: int = MAX_TOKENS) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


#: How far a token's log-probability may move when only the rounding of the arithmetic differs
#: (another batch, block size or kernel path): a K/V value near a rounding boundary of the
#: 8-bit format can land on the other side, which later layers carry on (measured: up to ~0.02
#: nats). A slot read from the wrong block, or never written, moves it far more, or to NaN.
LOGPROB_TOLERANCE = 0.1


def assert_same_run(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_TOLERANCE)


def assert_clean(llm: LLM) -> None:
    eng = llm.llm_engine
    eng.check_integrity()
    assert not eng.has_unfinished_requests()
    assert eng.kv_cache_manager.num_used_blocks == 0, "KV blocks leaked"


# ------------------------------------------------------------------------------- settings
def test_settings_names_and_errors():
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn  # vLLM's alias
    assert kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert kv_cache_dtype("int8", torch.float32) == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of .* got 'fp16'"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="calculate_kv_scales: expected a bool"):
        EngineConfig(calculate_kv_scales=1)
    with pytest.raises(ValueError, match="calculate_kv_scales: expected True for kv_cache_dtype"):
        make_kv_scales(torch.int8, 2, 3, "cpu", calculate_kv_scales=False)
    default = make_kv_scales(torch.float8_e5m2, 2, 3, "cpu", calculate_kv_scales=False)
    assert [s.source for s in default] == ["default"] * 2 and not default[0].pending
    assert torch.equal(default[1].v_scale, torch.ones(3))
    assert make_kv_scales(torch.bfloat16, 2, 3, "cpu") is None
    scales = make_kv_scales(torch.int8, 1, 3, "cpu")
    with pytest.raises(ValueError, match=r"kv_fill: expected a value in \[-128, 127\]"):
        KVCache(1, 3, 8, 2, 4, torch.int8, fill=float("nan"), scales=scales)
    with pytest.raises(ValueError, match="scales: expected one LayerKVScales per layer"):
        KVCache(1, 3, 8, 2, 4, torch.int8)
    with pytest.raises(ValueError, match="scales: expected None for a torch.float32 cache"):
        KVCache(1, 3, 8, 2, 4, torch.float32, scales=scales)


def test_calibration_takes_each_heads_amax_once():
    layer = make_kv_scales(torch.float8_e4m3fn, 1, 3, "cpu")[0]
    key = torch.zeros(5, 3, 4)
    key[2, 0, 1], key[4, 2, 3] = -4.48, 8.96  # head 1 stays all zero: it keeps the scale 1.0
    value = torch.full((5, 3, 4), 0.448)
    assert layer.pending and layer.source == "calibration"
    k, v = layer.for_step(key, value)
    assert torch.allclose(k, torch.tensor([0.01, 1.0, 0.02])) and torch.allclose(v, torch.full(
        (3,), 0.001))
    layer.for_step(key * 100, value * 100)  # fixed after the first step: larger values saturate
    assert torch.allclose(layer.k_scale, torch.tensor([0.01, 1.0, 0.02])) and not layer.pending


# -------------------------------------------------------------------------------- budget
def test_a_kv_budget_holds_twice_the_blocks_of_a_bfloat16_cache(loaded):
    # the default model's shape and tokenizer, bfloat16 weights left uninitialised (only the
    # calibration prompt runs on them)
    config = loaded.config
    model = LoadedModel(DecoderForCausalLM(config, dtype=torch.bfloat16), config, loaded.tokenizer,
                        "bfloat16 shape", loaded.path)
    per_block_bf16 = 2 * config.num_hidden_layers * config.num_key_value_heads * 16 \
        * config.head_dim * 2
    budget = 40 * per_block_bf16 + 123
    blocks = {name: LLM(model=model, kv_cache_memory_bytes=budget, kv_cache_dtype=name,
                        preemption_mode="swap").llm_engine for name in ("auto", "fp8", "int8")}
    assert blocks["auto"].kv_cache.dtype == torch.bfloat16
    assert blocks["auto"].kv_cache_manager.num_blocks == 40
    for name in ("fp8", "int8"):
        eng = blocks[name]
        assert eng.kv_cache_manager.num_blocks == 80
        device, host = eng.kv_cache.device_caches[0][0], eng.kv_cache.host_caches[0][0]
        assert device.dtype == host.dtype == kv_cache_dtype(name, torch.bfloat16)
        assert device.shape[0] == host.shape[0] == 80  # the swap pool: same dtype and size


# ------------------------------------------------------------------------------- scales
def _first_step(llm: LLM, prompts) -> list[list[int]]:
    """Adds `prompts` and runs one step (their prefill); returns each one's block table."""
    eng = llm.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=2))
    eng.step()
    return [eng.kv_cache_manager.block_table(eng._groups[f"r{i}"].seqs[0].seq_id)
            for i in range(len(prompts))]


def _gather(cache: torch.Tensor, tables: list[list[int]], lens: list[int]) -> torch.Tensor:
    """The rows `[sum(lens), num_kv_heads, head_size]` of the sequences' first tokens."""
    bs = cache.shape[2]
    rows = [cache[table[t // bs], :, t % bs] for table, n in zip(tables, lens) for t in range(n)]
    return torch.stack(rows)


@pytest.mark.parametrize("name", list(FORMATS))
def test_calibration_prompt_sets_each_layer_and_heads_scale_and_codes_saturate(loaded, prompts,
                                                                              name, monkeypatch):
    fmax, relative, absolute = FORMATS[name]
    written = []  # per layer: the K/V the model hands to write_kv, and the scales in effect
    write_kv = AttentionPlan.write_kv

    def recording(plan, key, value, key_cache, value_cache):
        written.append((key.clone(), value.clone(), plan.k_scale.clone(), plan.v_scale.clone()))
        write_kv(plan, key, value, key_cache, value_cache)

    monkeypatch.setattr(AttentionPlan, "write_kv", recording)
    llm = make_llm(loaded, name, num_kv_blocks=16)  # built: one calibration prefill, freed
    cache = llm.llm_engine.kv_cache
    assert len(written) == len(cache.scales) and written[0][0].shape[0] > 100
    for scales, (key, value, _, _) in zip(cache.scales, written):
        assert scales.source == "calibration" and not scales.pending
        assert torch.equal(scales.k_scale, key.abs().amax(dim=(0, 2)) / fmax)
        assert torch.equal(scales.v_scale, value.abs().amax(dim=(0, 2)) / fmax)
    assert_clean(llm)
    assert llm.llm_engine.kv_cache_manager.num_cached_blocks == 0

    written.clear()
    lens = [len(p) for p in prompts[:2]]
    tables = _first_step(llm, prompts[:2])
    for layer, (scales, (key, value, k_used, v_used)) in enumerate(zip(cache.scales, written)):
        for which, x, scale, used in ((0, key, scales.k_scale, k_used),
                                      (1, value, scales.v_scale, v_used)):
            assert torch.equal(used, scale), "the layer wrote with other scales"
            codes = _gather(cache.device_caches[layer][which], tables, lens)
            got = codes.float() * scale[None, :, None]
            # larger values saturate; int8's range is [-128, 127]
            limit = fmax * scale[None, :, None]
            low = -(fmax + 1 if name == "int8" else fmax) * scale[None, :, None]
            want = torch.maximum(torch.minimum(x, limit), low)
            bound = torch.maximum(relative * want.abs(), absolute * scale[None, :, None])
            slack = 1e-6 * want.abs()  # float32 rounding of `got` itself
            assert ((got - want).abs() <= bound + slack).all(), (layer, which)
    before = [s.k_scale.clone() for s in cache.scales]
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()  # decode steps: the scales stay fixed
    assert all(torch.equal(b, s.k_scale) for b, s in zip(before, cache.scales))
    assert_clean(llm)


def test_scales_from_the_model_file(loaded, prompts, monkeypatch):
    config = DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    model = DecoderForCausalLM(config)
    weights = {name: torch.zeros(shape) for name, shape in model.checkpoint_shapes().items()}
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
              "model.layers.0.self_attn.v_scale": torch.tensor([0.25, 0.125]),
              "model.layers.1.self_attn.kv_scale": torch.tensor([2.0])}
    model.load_weights({**weights, **scales}.items())
    (k0, v0), (k1, v1) = model.kv_scales_from_file
    assert k0.tolist() == [0.5] and v0.tolist() == [0.25, 0.125]
    assert k1.tolist() == v1.tolist() == [2.0]
    for bad, match in (({"model.layers.0.self_attn.k_scale": torch.tensor(1.0)},
                        "expected a v_scale for every layer"),
                       ({**scales, "model.layers.1.self_attn.kv_scale": torch.tensor(-1.0)},
                        "layer 1 k_scale finite and > 0"),
                       ({**scales, "model.layers.1.self_attn.kv_scale": torch.ones(3)},
                        "layer 1 k_scale of 1 or 2 elements")):
        with pytest.raises(ValueError, match=match):
            DecoderForCausalLM(config).load_weights({**weights, **bad}.items())

    # The engine takes a checkpoint's scales for an fp8 cache and keeps them.
    layers = loaded.config.num_hidden_layers
    file_scales = [(torch.tensor(0.02), torch.full((3,), 0.01 + i / 1000)) for i in range(layers)]
    monkeypatch.setattr(loaded.model, "kv_scales_from_file", file_scales)
    llm = make_llm(loaded, "fp8_e4m3")
    greedy(llm, prompts[:1], 2)
    for (k, v), s in zip(file_scales, llm.llm_engine.kv_cache.scales):
        assert s.source == "file"
        assert torch.equal(s.k_scale, k.expand(3)) and torch.equal(s.v_scale, v)
    # fp8 scales map the amax to 448, beyond int8's range: an int8 cache calibrates its own.
    assert {s.source for s in make_llm(loaded, "int8").llm_engine.kv_cache.scales} == {
        "calibration"}


# ------------------------------------------------------------------ features on 8-bit blocks
@pytest.mark.parametrize("name", ["fp8_e4m3", "int8"])
def test_prefix_cache_hits_and_swap_on_8bit_blocks(loaded, prompts, name, monkeypatch):
    ref = make_llm(loaded, name, enable_prefix_caching=False)
    want = greedy(ref, prompts)

    cached = make_llm(loaded, name, block_size=4)
    copy_scales(cached, ref)
    assert_same_run(greedy(cached, prompts), want)
    hits = cached.llm_engine.stats().prefix_cache_hits
    assert_same_run(greedy(cached, prompts), want)  # full prompt blocks from the 8-bit cache
    assert cached.llm_engine.stats().prefix_cache_hits - hits >= sum(
        (len(p) - 1) // 4 * 4 for p in prompts)
    assert_clean(cached)

    swapped = make_llm(loaded, name, block_size=2, num_kv_blocks=16, preemption_mode="swap")
    copy_scales(swapped, ref)
    moved = []
    cache = swapped.llm_engine.kv_cache
    swap_out = cache.swap_out
    monkeypatch.setattr(cache, "swap_out", lambda pairs: (moved.append(len(pairs)),
                                                          swap_out(pairs)))
    assert_same_run(greedy(swapped, prompts), want)
    assert swapped.llm_engine.stats().num_preemptions > 0 and sum(moved) > 0
    assert_clean(swapped)


def test_beam_search_and_copy_on_write_on_8bit_blocks(loaded, prompts, monkeypatch):
    llm = make_llm(loaded, "fp8_e4m3", block_size=4)
    copies = []
    cache = llm.llm_engine.kv_cache
    copy = cache.copy
    monkeypatch.setattr(cache, "copy", lambda pairs: (copies.append(len(pairs)), copy(pairs)))
    prompt = prompts[0]
    out = llm.beam_search([{"prompt_token_ids": prompt}],
                          BeamSearchParams(beam_width=2, max_tokens=3))[0]
    assert sum(copies) > 0, "the beams never copied a shared partial block"
    assert_clean(llm)

    # Each beam's cumulative log-probability, from one prefill per prefix without sharing.
    oracle = make_llm(loaded, "fp8_e4m3", enable_prefix_caching=False)
    copy_scales(oracle, llm)
    prefixes = [(seq, k) for seq in out.sequences for k in range(len(seq.token_ids))]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    outs = oracle.generate([{"prompt_token_ids": prompt + seq.token_ids[:k]}
                            for seq, k in prefixes], params, use_tqdm=False)
    totals: dict[int, float] = {}
    for (seq, k), o in zip(prefixes, outs):
        logprob = o.outputs[0].logprobs[0].get(seq.token_ids[k], float("-inf"))
        totals[id(seq)] = totals.get(id(seq), 0.0) + logprob
    for seq in out.sequences:
        assert seq.cum_logprob == pytest.approx(totals[id(seq)], abs=LOGPROB_TOLERANCE)
    assert_clean(oracle)
