"""Verification of proposals (engine/spec_decode/rejection.py) on hand-made distributions, the
n-gram lookup, and `SpeculativeConfig`'s checks. No model runs here.

The distribution test is the one that matters: with a draft that is often wrong, the first token
rejection sampling emits must be distributed as the target's processed softmax. It runs 4000
fixed seeds and compares the counts with a chi-square test at significance 0.001 (so a correct
sampler fails with probability 0.001 for a random seed set; these seeds are fixed, the test is
deterministic). An "accept everything" or "resample from p" bug shifts the counts far past it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from engine.sampler import Sampler, SamplingState
from engine.sampling_params import SamplingParams
from engine.spec_decode import Proposal, SpeculativeConfig
from engine.spec_decode.ngram import ngram_lookup
from engine.spec_decode.rejection import accept_greedy, accept_random, verify

VOCAB = 8
SIGNIFICANCE = 1e-3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def state(params: SamplingParams, output=(), seed=None) -> SamplingState:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingState(params, [1, 2, 3], list(output), generator)


# ------------------------------------------------------------------ hand-made p / q
def test_greedy_accepts_while_the_argmax_agrees_then_corrects():
    x = torch.full((4, VOCAB), -1.0)
    x[0, 5] = x[1, 6] = x[2, 2] = x[3, 7] = 1.0
    assert accept_greedy(x, [5, 6, 3]) == [5, 6, 2]      # third proposal replaced
    assert accept_greedy(x, [4, 6, 2]) == [5]            # first rejected: nothing accepted
    assert accept_greedy(x, [5, 6, 2]) == [5, 6, 2, 7]   # all accepted: the bonus token


def one_hot(token: int) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[token] = 1.0
    return row


def test_random_accepts_sure_proposals_and_draws_the_bonus_from_the_last_row():
    p = torch.stack([one_hot(3), one_hot(4), one_hot(6)])
    assert accept_random(p, [3, 4], None, torch.Generator().manual_seed(0)) == [3, 4, 6]


def test_random_rejects_a_proposal_the_target_never_makes_and_resamples_without_it():
    p = torch.stack([torch.tensor([0.0, 0.5, 0.5, 0, 0, 0, 0, 0]), one_hot(1)])
    for seed in range(20):
        tokens = accept_random(p, [2 if seed % 2 else 0], None,
                               torch.Generator().manual_seed(seed))
        if seed % 2:   # p(2) = 0.5 under a one-hot q: accepted half the time, else replaced by 1
            assert tokens in ([2, 1], [1])
        else:          # p(0) = 0: always rejected, replaced by a draw from p without 0
            assert len(tokens) == 1 and tokens[0] in (1, 2)


def test_random_resamples_from_the_positive_part_of_p_minus_q():
    p = torch.tensor([[0.5, 0.5, 0, 0, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0, 0, 0]])
    q = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0]])   # proposes 0, which p accepts half the time
    outcomes = {tuple(accept_random(p, [0], q, torch.Generator().manual_seed(s)))
                for s in range(40)}
    assert outcomes == {(0, 0), (1,)}   # accepted (then bonus 0), or replaced by (p - q)+ = {1}


def test_q_equal_to_p_accepts_always():
    p = torch.softmax(torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)), -1)
    for seed in range(20):
        tokens = accept_random(p, [2, 5], p[:2], torch.Generator().manual_seed(seed))
        assert tokens[:2] == [2, 5] and len(tokens) == 3


def test_verify_counts_earlier_proposals_as_output_for_penalties():
    """Row 1 sees proposal 0 as output: a presence penalty moves its argmax away from it."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 4] = 2.0
    logits[:, 5] = 1.0
    params = SamplingParams(temperature=0.0, presence_penalty=1.5, max_tokens=8)
    verdict = verify(Sampler(), logits, state(params), Proposal([4]))
    assert verdict.token_ids == [4, 5] and verdict.num_accepted == 1
    # without the penalty row 1 would repeat 4
    plain = verify(Sampler(), logits, state(SamplingParams(temperature=0.0)), Proposal([4]))
    assert plain.token_ids == [4, 4]


def test_verify_reports_raw_logprobs_and_top_logprobs():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    target = logits.argmax(-1).tolist()
    params = SamplingParams(temperature=0.0, logprobs=2)
    verdict = verify(Sampler(), logits, state(params), Proposal(target[:2]))
    assert verdict.token_ids == target and verdict.num_accepted == 2
    raw = torch.log_softmax(logits, -1)
    for j, token in enumerate(target):
        assert verdict.logprobs[j] == pytest.approx(float(raw[j, token]))
        top = verdict.top_logprobs[j]
        assert top is not None and set(top) >= {token} and len(top) <= 3


def test_verify_rejects_logits_of_the_wrong_height():
    with pytest.raises(ValueError, match="logits: expected 3 rows"):
        verify(Sampler(), torch.zeros(2, VOCAB), state(SamplingParams()), Proposal([1, 2]))


# -------------------------------------------------------------------- distribution
def test_first_token_follows_the_targets_distribution_with_a_wrong_draft():
    """4000 seeds; the draft q favours tokens the target (temperature 0.8, top-k 6) rarely or
    never picks; chi-square of the first emitted token's counts against p_0."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=8)
    q = torch.tensor([0.02, 0.03, 0.05, 0.1, 0.1, 0.2, 0.3, 0.2])  # 6 and 7 are outside top-k
    sampler = Sampler()
    p0 = sampler_probs(sampler, logits[:1], params)
    counts = np.zeros(VOCAB)
    rejected = 0
    num = 4000
    for seed in range(num):
        s = state(params, seed=seed)
        d = int(torch.multinomial(q, 1, generator=s.generator))
        verdict = verify(sampler, logits, s, Proposal([d], q[None]))
        counts[verdict.token_ids[0]] += 1
        rejected += verdict.num_accepted == 0
    assert rejected > num // 3, "the draft should be wrong often"
    support = p0 > 0
    assert counts[~support].sum() == 0
    expected = num * p0[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    assert stat < chi2.ppf(1 - SIGNIFICANCE, int(support.sum()) - 1), (counts, expected)


def sampler_probs(sampler: Sampler, logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """The target's distribution the oracle way: temperature, then top-k by sorting, softmax."""
    x = logits[0].double() / params.temperature
    kth = x.sort(descending=True).values[params.top_k - 1]
    x = torch.where(x < kth, torch.tensor(float("-inf"), dtype=x.dtype), x)
    return torch.softmax(x, -1).numpy()


# -------------------------------------------------------------------------- n-gram
@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),        # longest match wins
    ([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, [7, 1, 2]),  # the latest earlier occurrence
    ([1, 2, 3, 4, 5, 1, 2, 3], 1, [4]),              # at most k
    ([7, 8, 9, 8, 9], 4, [8, 9]),                    # overlapping: stops at the end
    ([1, 2, 3], 3, []),                              # nothing to copy
    ([5], 3, []),
])
def test_ngram_lookup(tokens, k, expected):
    assert ngram_lookup(np.array(tokens), k, 1, 4) == expected


def test_ngram_lookup_respects_the_minimum_length():
    assert ngram_lookup(np.array([4, 1, 2, 9, 5, 2]), 2, 2, 3) == []     # only a 1-gram matches
    assert ngram_lookup(np.array([4, 1, 2, 9, 5, 2]), 2, 1, 3) == [9, 5]


# -------------------------------------------------------------------------- config
@pytest.mark.parametrize("config, message", [
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "unknown key 'lookahead'"),
    ({"method": "medusa", "num_speculative_tokens": 3}, r"\['method'\]: expected one of"),
    ({"method": "ngram"}, r"\['num_speculative_tokens'\].*required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"expected an int >= 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, r"expected an int >= 1, got '3'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, r"\['prompt_lookup_max'\]: expected an int >= prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "m.gguf"},
     r"\['model'\]: expected no value with method 'ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "exactly one of 'model' and"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "m", "draft_layers": 2},
     "exactly one of 'model' and"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "draft_layers": 0},
     r"\['draft_layers'\]: expected an int >= 1, got 0"),
    ("ngram", "expected a dict"),
])
def test_bad_speculative_config(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(config)


def test_config_defaults_and_inference():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_min": 7})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (7, 7)
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "draft_layers": 3})
    assert (c.method, c.draft_layers, c.model) == ("draft_model", 3, None)


def test_engine_config_parses_and_the_cli_refuses(capsys):
    from engine.config import EngineConfig
    from engine.serve import build_parser

    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert cfg.speculative_config == SpeculativeConfig("ngram", 2, 5, 1)
    with pytest.raises(ValueError, match="unknown key 'k'"):
        EngineConfig(speculative_config={"method": "ngram", "k": 2})
    args = build_parser().parse_args(["--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config.num_speculative_tokens == 3
    for text, message in (('{"method": "ngram"', "expected a JSON object"),
                          ('{"method": "ngram", "num_speculative_tokens": -1}',
                           "expected an int >= 1, got -1")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--speculative-config", text])
        assert message in capsys.readouterr().err
