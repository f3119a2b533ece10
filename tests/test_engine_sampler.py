"""SamplingParams validation and the Sampler, against hand computations written here in plain
Python (no code shared with engine/sampler.py)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampler, SamplingState, argmax, sampling_probs
from engine.sampling_params import BeamSearchParams, SamplingParams

EOS = 3


def state(params: SamplingParams, prompt=(0,), output=(), seed=None) -> SamplingState:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingState(params, list(prompt), list(output), gen)


# -- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 1.5), ("n", True), ("temperature", -0.1), ("temperature", float("nan")),
    ("temperature", float("inf")), ("top_p", 0.0), ("top_p", 1.1), ("top_k", -2), ("top_k", 2.0),
    ("min_p", -0.1), ("min_p", 1.5), ("seed", 1.5), ("seed", "1"),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1), ("frequency_penalty", 3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("max_tokens", 0),
    ("max_tokens", -5), ("min_tokens", -1), ("stop", ""), ("stop", [""]), ("stop", 5),
    ("stop", ["ok", 3]), ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]),
    ("stop_token_ids", 7), ("include_stop_str_in_output", 1), ("ignore_eos", "yes"),
    ("logprobs", -1), ("logprobs", 1.0), ("skip_special_tokens", None),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_invalid():
    with pytest.raises(ValueError, match="^min_tokens:"):
        SamplingParams(max_tokens=3, min_tokens=4)
    SamplingParams(max_tokens=None, min_tokens=100)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == \
        (1, 1.0, 1.0, 0, 0.0, 16, 0)
    assert p.stop is None and p.logprobs is None and p.skip_special_tokens and not p.ignore_eos
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize("field,value", [
    ("beam_width", 0), ("max_tokens", 0), ("ignore_eos", 1), ("temperature", -1.0),
    ("length_penalty", float("nan"))])
def test_invalid_beam_search_params_name_the_field(field, value):
    kwargs = dict(beam_width=2, max_tokens=4)
    kwargs[field] = value
    with pytest.raises(ValueError, match=f"^{field}:"):
        BeamSearchParams(**kwargs)


# -- greedy, logprobs ------------------------------------------------------------------------

def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    params = SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5)
    out = Sampler().sample(logits, [state(params, prompt=[]) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    for i, row in enumerate(logits.tolist()):
        norm = math.log(sum(math.exp(v) for v in row))
        assert out.logprobs[i] == pytest.approx(row[out.token_ids[i]] - norm, abs=1e-5)
        best = sorted(range(50), key=lambda t: -row[t])[:3]
        assert set(out.top_logprobs[i]) == set(best)
        for t in best:
            assert out.top_logprobs[i][t] == pytest.approx(row[t] - norm, abs=1e-5)


def test_logprobs_ignore_penalties_and_temperature_and_include_the_chosen_token():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(temperature=0.0, logprobs=1, presence_penalty=2.0)
    out = Sampler().sample(logits, [state(params, output=[0])])
    # the penalty makes token 1 the greedy choice; logprobs still come from the raw logits
    assert out.token_ids == [1]
    raw = torch.log_softmax(logits, -1)[0]
    assert out.logprobs[0] == pytest.approx(float(raw[1]))
    assert out.top_logprobs[0] == pytest.approx({0: float(raw[0]), 1: float(raw[1])})
    out = Sampler().sample(logits, [state(SamplingParams(temperature=0, logprobs=0))])
    assert out.top_logprobs[0] == pytest.approx({0: float(raw[0])})
    assert Sampler().sample(logits, [state(SamplingParams())]).top_logprobs == [None]


# -- penalties and min_tokens ----------------------------------------------------------------

def test_penalties_match_hand_computation():
    logits = [1.5, -0.5, 2.0, 0.0, -2.0, 0.7]
    prompt, output = [0, 1], [2, 2, 4]
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25)
    got = Sampler().processed_logits(torch.tensor([logits]), [state(params, prompt, output)])[0]
    want = []
    for t, v in enumerate(logits):
        if t in prompt or t in output:  # repetition: over prompt and output
            v = v / 1.3 if v > 0 else v * 1.3
        count = output.count(t)  # presence / frequency: over the output only
        v -= 0.25 * count + (0.4 if count else 0.0)
        want.append(v)
    assert got.tolist() == pytest.approx(want, abs=1e-6)


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0, 2.0]])  # EOS (3) best, then 2 (a stop id)
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    sampler = Sampler(eos_token_ids=[EOS])
    assert sampler.sample(logits, [state(params, output=[1])]).token_ids == [4]
    assert sampler.sample(logits, [state(params, output=[1, 1])]).token_ids == [EOS]
    # ignore_eos: EOS does not stop, so it is not masked; the stop id still is
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2], ignore_eos=True)
    assert sampler.sample(logits, [state(params)]).token_ids == [EOS]
    # an EOS id carried by the state counts too
    params = SamplingParams(temperature=0, min_tokens=1)
    s = SamplingState(params, [0], [], None, frozenset({EOS}))
    assert Sampler().sample(logits, [s]).token_ids == [2]


# -- truncation ------------------------------------------------------------------------------

def _hand_probs(row: list[float], p: SamplingParams) -> list[float]:
    """The sampling distribution, written out directly from the definitions."""
    x = [v / p.temperature for v in row]
    order = sorted(range(len(x)), key=lambda t: -x[t])
    keep = set(order[:p.top_k] if p.top_k > 0 else order)
    z = sum(math.exp(x[t]) for t in keep)
    kept, mass = set(), 0.0
    for t in order:
        if t in keep and mass < p.top_p:
            kept.add(t)
            mass += math.exp(x[t]) / z
    last = min(x[t] for t in kept)
    kept = {t for t in range(len(x)) if x[t] >= last}  # a token tied with the last kept one too
    z = sum(math.exp(x[t]) for t in kept)
    probs = [math.exp(x[t]) / z if t in kept else 0.0 for t in range(len(x))]
    biggest = max(probs)
    probs = [q if q >= p.min_p * biggest else 0.0 for q in probs]
    return [q / sum(probs) for q in probs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=3), SamplingParams(top_k=-1, top_p=0.6),
    SamplingParams(temperature=1.5, top_p=0.8), SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.5, top_k=5, top_p=0.9, min_p=0.05),
    SamplingParams(top_k=1),
])
def test_sampling_probs_match_hand_computation(params):
    torch.manual_seed(1)
    logits = torch.randn(3, 12) * 2
    # rows with other settings alongside must not change this row's result
    other = SamplingParams(temperature=2.0, top_k=2)
    got = sampling_probs(logits, [params, other, params])
    for i in (0, 2):
        assert got[i].tolist() == pytest.approx(_hand_probs(logits[i].tolist(), params),
                                                abs=1e-6)


@pytest.mark.parametrize("params", [SamplingParams(top_p=0.9), SamplingParams(top_p=0.3),
                                    SamplingParams(top_k=1500, top_p=0.95)])
def test_sampling_probs_with_a_large_nucleus(params):
    # a flat row over 9000 tokens: the nucleus holds more than the first candidates
    torch.manual_seed(3)
    logits = torch.randn(2, 9000) * 0.1
    logits[1] *= 30  # a peaked row alongside
    got = sampling_probs(logits, [params, params])
    for i in range(2):
        want = _hand_probs(logits[i].tolist(), params)
        assert got[i].tolist() == pytest.approx(want, abs=1e-6)
    assert int((got[0] > 0).sum()) > 1024


def test_samples_only_from_the_kept_tokens_with_the_right_frequencies():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=7)
    want = _hand_probs(logits[0].tolist(), params)
    st = state(params, seed=7)
    sampler = Sampler()
    draws = 2000
    counts = [0] * 6
    for _ in range(draws):
        counts[sampler.sample(logits, [st]).token_ids[0]] += 1
    for t in range(6):
        if want[t] == 0:
            assert counts[t] == 0
        else:  # within 5 standard deviations of the binomial count
            sd = math.sqrt(draws * want[t] * (1 - want[t]))
            assert abs(counts[t] - draws * want[t]) <= 5 * sd + 1


# -- seeds -----------------------------------------------------------------------------------

def test_seeded_request_is_reproducible_alone_and_in_a_batch():
    torch.manual_seed(2)
    steps = [torch.randn(4, 100) for _ in range(6)]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(rows: list[int], seed_of_row0: int) -> list[int]:
        sampler = Sampler()
        others = [SamplingParams(temperature=1.3, top_k=10, seed=None if r % 2 else 99)
                  for r in rows[1:]]
        states = [state(seeded, seed=seed_of_row0)] + [
            state(p, seed=p.seed) for p in others]
        tokens = []
        for logits in steps:
            out = sampler.sample(logits[rows], states)
            tokens.append(out.token_ids[0])
            for s, t in zip(states, out.token_ids):
                s.output_token_ids.append(t)
        return tokens

    alone = run([0], 1234)
    assert run([0, 1, 2, 3], 1234) == alone
    assert run([0, 3], 1234) == alone
    assert run([0], 1234) == alone
    assert run([0], 4321) != alone  # a different seed gives a different stream


def test_wrong_logits_shape_is_an_error():
    with pytest.raises(ValueError, match="^logits:"):
        Sampler().sample(torch.zeros(2, 5), [state(SamplingParams())])


@pytest.mark.parametrize("vocab", [1, 7, 2047, 2048, 3000, 4096, 49152])
def test_argmax_is_torchs_first_maximum(vocab: int) -> None:
    """The two-level argmax picks torch's index (the first maximum), ties and -inf included."""
    gen = torch.Generator().manual_seed(vocab)
    few_values = torch.randint(-3, 3, (6, vocab), generator=gen).float()  # many ties
    spread = torch.randn(6, vocab, generator=gen)
    spread[0] = float("-inf")
    spread[1, -1] = 100.0  # the maximum in a short last chunk
    for x in (few_values, spread):
        assert torch.equal(argmax(x), x.argmax(dim=-1))
