"""The whole engine against Hugging Face transformers on the same GGUF file (float32).

The oracle shares no code with the engine: transformers' own Llama, loaded from the default
model's GGUF, with its contiguous attention, its `generate(do_sample=False)` for greedy
continuations and plain full-context forward passes for beam search, penalties and logprobs.
Every engine here fills its KV cache with NaN (a slot read before it is written would poison the
logits), and after every test the engine's integrity check holds and no block is in use.
CPU time is scarce: one model of each kind per module, short prompts, few tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, BeamSearchParams, SamplingParams
from engine.model.loader import load_model

MAX_TOKENS = 6
TEXTS = ["The capital of France is",
         "Once upon a time, in a land far away, there lived a kind old man who",
         "1, 2, 3,"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf(hf_default_model):
    return hf_default_model


@pytest.fixture(scope="module")
def prompts(loaded):
    """Token ids of prompts of different lengths (one longer than a 16-token block)."""
    return [loaded.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def hf_greedy(hf_greedy_continuations, prompts):
    """transformers' greedy continuation of each prompt (token ids after the prompt)."""
    return hf_greedy_continuations(prompts, MAX_TOKENS)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log-softmax of the next-token logits after every prefix of `ids`, float64 [len, vocab]."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def make_llm(loaded, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 64)
    return LLM(model=loaded, kv_fill=float("nan"), **kw)


def assert_clean(llm: LLM) -> None:
    eng = llm.llm_engine
    eng.check_integrity()
    assert not eng.has_unfinished_requests()
    assert eng.kv_cache_manager.num_used_blocks == 0, "KV blocks leaked"


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def as_inputs(prompts):
    return [{"prompt_token_ids": ids} for ids in prompts]


def check_greedy(llm: LLM, prompts, hf_greedy) -> list:
    outs = llm.generate(as_inputs(prompts), greedy(), use_tqdm=False)
    for out, ids, expected in zip(outs, prompts, hf_greedy):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].finish_reason in ("length", "stop")
    return outs


# ------------------------------------------------------------------ greedy equals transformers
def test_greedy_matches_transformers_with_defaults(loaded, prompts, hf_greedy):
    llm = LLM(model=loaded, kv_fill=float("nan"))  # the default pool, budgets and block size
    outs = check_greedy(llm, prompts, hf_greedy)
    tok = loaded.tokenizer
    assert outs[0].outputs[0].text == tok.decode(hf_greedy[0])
    assert outs[0].outputs[0].index == 0 and outs[0].outputs[0].logprobs is None
    assert_clean(llm)


def test_greedy_with_prefix_cache_hits(loaded, prompts, hf_greedy):
    llm = make_llm(loaded, block_size=4)
    check_greedy(llm, prompts, hf_greedy)
    first_hits = llm.llm_engine.stats().prefix_cache_hits
    check_greedy(llm, prompts, hf_greedy)  # every full prompt block now comes from the cache
    stats = llm.llm_engine.stats()
    assert stats.prefix_cache_hits - first_hits >= sum((len(p) - 1) // 4 * 4 for p in prompts)
    # A prompt sharing only a prefix reuses it.
    shared = prompts[1][:9] + prompts[2]
    llm.generate(as_inputs([shared]), greedy(2), use_tqdm=False)
    assert llm.llm_engine.stats().prefix_cache_hits - stats.prefix_cache_hits == 8
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_under_forced_preemption(loaded, prompts, hf_greedy, mode, monkeypatch):
    llm = make_llm(loaded, block_size=2, num_kv_blocks=16, preemption_mode=mode)
    swaps = []
    cache = llm.llm_engine.kv_cache
    orig = cache.swap_out
    monkeypatch.setattr(cache, "swap_out", lambda pairs: (swaps.append(len(pairs)), orig(pairs)))
    check_greedy(llm, prompts, hf_greedy)
    assert llm.llm_engine.stats().num_preemptions > 0
    assert (sum(swaps) > 0) == (mode == "swap")
    assert_clean(llm)


def test_greedy_with_chunked_prefill(loaded, prompts, hf_greedy):
    llm = make_llm(loaded, max_num_batched_tokens=5, block_size=4)
    check_greedy(llm, prompts, hf_greedy)
    assert_clean(llm)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_greedy_matches_transformers_on_each_cpu_backend(loaded, prompts, hf_greedy, backend):
    import paged_kernels

    if backend not in paged_kernels.available_backends():
        pytest.skip(f"backend {backend!r} unavailable: "
                    f"{paged_kernels.unavailable_backends().get(backend)}")
    llm = make_llm(loaded, backend=backend, block_size=4, max_num_batched_tokens=12)
    check_greedy(llm, prompts, hf_greedy)
    assert_clean(llm)


# ---------------------------------------------------------------------------- sharing blocks
def test_n_samples_share_the_prompt_blocks(loaded, prompts):
    llm = make_llm(loaded)
    eng = llm.llm_engine
    ids = prompts[1]  # more than one block: one full block and a partial one
    eng.add_request("r", ids, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=3))
    outs = eng.step()  # the prompt's prefill, then four samples from its last position
    group = eng._groups["r"]
    assert len(group.seqs) == 4
    prompt_blocks = -(-len(ids) // 16)
    assert eng.kv_cache_manager.num_used_blocks == prompt_blocks
    eng.step()  # three sequences copy the shared partial block before writing; one writes in place
    assert eng.kv_cache_manager.num_used_blocks == prompt_blocks + 3
    while eng.has_unfinished_requests():
        outs = eng.step()
        eng.check_integrity()
    final = outs[0]
    assert final.finished and [o.index for o in final.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 3 for o in final.outputs)
    assert_clean(llm)


def hf_beam_search(hf, ids: list[int], width: int, max_tokens: int, eos: set[int],
                   length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
    """A plain beam search over full-context forward passes: the rules of engine.beam_search."""
    beams = [([], 0.0)]
    finished = []
    for _ in range(max_tokens):
        if not beams:
            break
        with torch.no_grad():  # every beam has the same length: one batch, no padding
            logits = hf(torch.tensor([ids + tokens for tokens, _ in beams])).logits[:, -1]
        logp = torch.log_softmax(logits.double(), dim=-1)
        cands = []
        for (tokens, cum), row in zip(beams, logp):
            values, top = torch.topk(row, 2 * width)  # the global best 2w are among these
            cands += [(cum + v, tokens, t) for v, t in zip(values.tolist(), top.tolist())]
        cands.sort(key=lambda c: -c[0])
        beams = []
        for rank, (value, tokens, t) in enumerate(cands[:2 * width]):
            if t in eos:
                if rank < width:
                    finished.append((tokens + [t], value))
                continue
            beams.append((tokens + [t], value))
            if len(beams) == width:
                break
    finished += beams
    finished.sort(key=lambda f: -f[1] / (len(f[0]) ** length_penalty))
    return finished[:width]


def test_beam_search_matches_plain_beam_search_over_transformers(loaded, hf, prompts):
    llm = make_llm(loaded, block_size=4)
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    outs = llm.beam_search(as_inputs(prompts[:2]), params)
    eos = llm.llm_engine.eos_token_ids
    for out, ids in zip(outs, prompts[:2]):
        expected = hf_beam_search(hf, ids, 3, 4, eos)
        assert [s.token_ids for s in out.sequences] == [e[0] for e in expected]
        for s, (_, cum) in zip(out.sequences, expected):
            assert s.cum_logprob == pytest.approx(cum, abs=2e-3)
    assert_clean(llm)


def test_beam_search_runs_the_model_only_through_execute_step(loaded, prompts, monkeypatch):
    """Beam search has no path to the model of its own: every runner call is an execute_step."""
    llm = make_llm(loaded, block_size=4, max_num_batched_tokens=8)
    eng = llm.llm_engine
    calls = {"execute_step": 0, "runner": 0}
    execute_step, runner_execute = eng.execute_step, eng.runner.execute

    def counted_step(out):
        calls["execute_step"] += 1
        return execute_step(out)

    def counted_runner(out, tables):
        calls["runner"] += 1
        return runner_execute(out, tables)

    monkeypatch.setattr(eng, "execute_step", counted_step)
    monkeypatch.setattr(eng.runner, "execute", counted_runner)
    llm.beam_search(as_inputs(prompts[1:2]), BeamSearchParams(beam_width=2, max_tokens=2))
    assert len(prompts[1]) > 16  # a prefill of 8-token chunks, then one step for both beams
    assert calls["runner"] == calls["execute_step"] == -(-len(prompts[1]) // 8) + 1
    assert_clean(llm)


# ---------------------------------------------------------------------------------- sampling
def test_seeded_sampling_is_reproducible_alone_and_in_a_mixed_batch(loaded, prompts):
    llm = make_llm(loaded)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS)
    alone = llm.generate(as_inputs(prompts[:1]), seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=4),
              SamplingParams(temperature=0.7, seed=5, max_tokens=8)]
    mixed = llm.generate(as_inputs([prompts[2], prompts[0], prompts[1]]),
                         [others[0], seeded, others[1]], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    again = llm.generate(as_inputs(prompts[:1]), seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    assert_clean(llm)


def test_streamed_text_equals_decoding_the_tokens_even_for_multibyte_characters(loaded):
    llm = make_llm(loaded)
    tok = loaded.tokenizer
    prompt = tok.encode("Emoji and accents: 🎉🙂 café naïve 日本語 ->")
    outs = llm.generate(as_inputs([prompt, prompt]),
                        [SamplingParams(temperature=1.5, seed=s, max_tokens=12) for s in (3, 4)],
                        use_tqdm=False)
    for out in outs:
        o = out.outputs[0]
        assert o.text == tok.decode(o.token_ids)
    assert_clean(llm)


def test_stop_strings_and_stop_tokens(loaded, prompts, hf_greedy):
    llm = make_llm(loaded)
    tok = loaded.tokenizer
    full = tok.decode(hf_greedy[2])
    stop = full.strip()[2:4]  # a stop string inside the greedy continuation
    at = full.find(stop)
    assert at > 0
    cut = llm.generate(as_inputs([prompts[2]]), greedy(stop=[stop]), use_tqdm=False)[0]
    assert cut.outputs[0].text == full[:at]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    kept = llm.generate(as_inputs([prompts[2]]),
                        greedy(stop=stop, include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == full[:at + len(stop)]
    token = hf_greedy[2][2]
    first = hf_greedy[2].index(token)
    by_id = llm.generate(as_inputs([prompts[2]]), greedy(stop_token_ids=[token]),
                         use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == hf_greedy[2][:first + 1] and by_id.finish_reason == "stop"
    assert by_id.stop_reason == token
    # min_tokens holds the stop token back (the sampler masks it), so generation goes on.
    late = llm.generate(as_inputs([prompts[2]]),
                        greedy(stop_token_ids=[token], min_tokens=4, max_tokens=5),
                        use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= 4 and token not in late.token_ids[:4]
    assert_clean(llm)


def test_penalties_match_a_greedy_loop_over_transformers(loaded, hf, prompts):
    llm = make_llm(loaded)
    ids = prompts[2]
    params = greedy(8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    got = llm.generate(as_inputs([ids]), params, use_tqdm=False)[0].outputs[0].token_ids
    out: list[int] = []
    for _ in range(8):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0, -1].double()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[ids + out] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / 1.3, logits * 1.3), logits)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long),
                                minlength=logits.shape[0]).double()
        logits = logits - 0.4 * counts - 0.5 * (counts > 0).double()
        out.append(int(logits.argmax()))
    assert got == out
    unpenalised = llm.generate(as_inputs([ids]), greedy(8), use_tqdm=False)[0].outputs[0]
    assert unpenalised.token_ids != got  # the penalties did change something
    assert_clean(llm)


def test_logprobs_match_transformers_log_softmax(loaded, hf, prompts):
    llm = make_llm(loaded)
    ids = prompts[0]
    out = llm.generate(as_inputs([ids]), greedy(4, logprobs=3), use_tqdm=False)[0].outputs[0]
    ref = hf_logprobs(hf, ids + out.token_ids)
    cum = 0.0
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(ids) - 1 + i]
        top = torch.topk(row, 3).indices.tolist()
        assert set(top) | {token} == set(entry)
        for t, lp in entry.items():
            assert lp == pytest.approx(float(row[t]), abs=2e-3)
        cum += float(row[token])
    assert out.cumulative_logprob == pytest.approx(cum, abs=5e-3)
    assert_clean(llm)


# -------------------------------------------------------------------------- API and lifecycle
def test_strings_and_chat_go_through_the_tokenizer(loaded, prompts, hf_greedy):
    llm = make_llm(loaded)
    by_text = llm.generate(TEXTS[0], greedy(), use_tqdm=True)[0]
    assert by_text.prompt == TEXTS[0] and by_text.prompt_token_ids == prompts[0]
    assert by_text.outputs[0].token_ids == hf_greedy[0]
    chat = llm.chat([{"role": "user", "content": "Hi"}], greedy(3), use_tqdm=False)[0]
    assert chat.prompt.startswith("<|im_start|>") and len(chat.outputs[0].token_ids) >= 1
    assert chat.prompt_token_ids == loaded.tokenizer.encode(chat.prompt, add_special_tokens=False)
    assert_clean(llm)


def test_abort_mid_generation_frees_everything(loaded, prompts):
    llm = make_llm(loaded, max_num_batched_tokens=8)
    eng = llm.llm_engine
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{i}", ids, SamplingParams(n=2, temperature=1.0, max_tokens=20))
    eng.step()
    eng.step()
    eng.abort_request("r1")
    eng.check_integrity()
    eng.step()
    eng.abort_request("r0")
    eng.abort_request("r2")
    eng.abort_request("unknown")
    assert_clean(llm)


def test_bad_requests_raise_value_errors(loaded):
    llm = make_llm(loaded, num_kv_blocks=4, block_size=4)
    eng = llm.llm_engine
    with pytest.raises(ValueError, match="prompt_token_ids"):
        eng.add_request("a", [], greedy())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        eng.add_request("a", [10 ** 9], greedy())
    with pytest.raises(ValueError, match="num_kv_blocks"):
        eng.add_request("a", [1] * 10, greedy(10))
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([3.5], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [greedy()], use_tqdm=False)
    assert_clean(llm)
