"""`logit_bias`, `best_of` and `structured_outputs` in `SamplingParams` and the sampler, without
a model: the batched bias against a per-row loop, the checks of each field, and the grammar mask
over a toy vocabulary (xgrammar over five tokens) in a batch with unconstrained rows.
"""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from engine.sampler import Sampler, SamplingState
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_output import GrammarState, StructuredOutputCompiler

VOCAB = ["a", "b", "c", "ab", "</s>"]
EOS = 4


def state(params: SamplingParams, output=(), grammar=None) -> SamplingState:
    return SamplingState(params, [0], list(output), None, grammar=grammar)


def test_logit_bias_is_added_per_row_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    biases = [{3: 5.0, 7: -100.0, 49: 0.5}, None, {0: 100.0}, {7: 2.5, 3: -1.0}]
    states = [state(SamplingParams(logit_bias=b)) for b in biases]
    original = logits.clone()
    got = Sampler().processed_logits(logits, states)
    expected = logits.clone()
    for row, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            expected[row, token] = logits[row, token] + value
    assert torch.equal(got, expected)
    assert torch.equal(logits, original)  # the input is untouched
    out = Sampler().sample(logits, [state(SamplingParams(temperature=0.0, logit_bias=b))
                                    for b in biases])
    assert out.token_ids[2] == 0  # +100 wins over randn logits
    assert out.logprobs[2] == pytest.approx(torch.log_softmax(logits[2], -1)[0].item())


@pytest.mark.parametrize("kwargs, says", [
    ({"logit_bias": {1: 100.5}}, "logit_bias: expected biases in [-100, 100]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias: expected token ids"),
    ({"logit_bias": {"3": 1.0}}, "logit_bias: expected token ids"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias: expected biases"),
    ({"n": 3, "best_of": 2}, "best_of: expected an int >= 3, got 2"),
    ({"best_of": True}, "best_of: expected an int"),
    ({"structured_outputs": {"json": {}}}, "structured_outputs: expected None or a"),
])
def test_bad_values_name_the_field(kwargs, says):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(says)


@pytest.mark.parametrize("kwargs, says", [
    ({}, "structured_outputs: expected exactly one of"),
    ({"json_object": False}, "structured_outputs: expected exactly one of"),
    ({"choice": []}, "structured_outputs.choice: expected a non-empty list"),
    ({"choice": ["a", ""]}, "structured_outputs.choice: expected a non-empty list"),
    ({"regex": 5}, "structured_outputs.regex: expected a non-empty str"),
    ({"json": 5}, "structured_outputs.json: expected a JSON schema"),
])
def test_bad_constraints_name_the_field(kwargs, says):
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(**kwargs)
    assert str(info.value).startswith(says)


@pytest.fixture(scope="module")
def compiler() -> StructuredOutputCompiler:
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[EOS])
    return StructuredOutputCompiler(info)


def test_the_mask_allows_exactly_the_grammar_and_leaves_other_rows(compiler):
    grammar = GrammarState(compiler.compile(StructuredOutputsParams(regex="ab?c")))
    logits = torch.zeros(2, len(VOCAB))
    x = Sampler([EOS]).processed_logits(logits, [state(SamplingParams()),
                                                 state(SamplingParams(), grammar=grammar)])
    assert torch.equal(x[0], logits[0])
    assert torch.isfinite(x[1]).tolist() == [True, False, False, True, False]  # a, ab
    grammar.accept(3)  # "ab"
    x = Sampler([EOS]).processed_logits(logits[1:], [state(SamplingParams(), grammar=grammar)])
    assert torch.isfinite(x[0]).tolist() == [False, False, True, False, False]  # c
    grammar.accept(2)
    x = Sampler([EOS]).processed_logits(logits[1:], [state(SamplingParams(), grammar=grammar)])
    assert torch.isfinite(x[0]).tolist() == [False, False, False, False, True]  # the end
    with pytest.raises(RuntimeError, match="not allowed"):
        GrammarState(grammar.compiled).accept(1)


def test_the_grammar_wins_over_min_tokens_and_logit_bias(compiler):
    spec = StructuredOutputsParams(choice=["ab", "c"])
    grammar = GrammarState(compiler.compile(spec), [3])  # "ab": only the end may follow
    params = SamplingParams(temperature=0.0, min_tokens=5, logit_bias={1: 100.0, 2: 1.0})
    out = Sampler([EOS]).sample(torch.zeros(1, len(VOCAB)), [state(params, [3], grammar)])
    assert out.token_ids == [EOS]
    fresh = GrammarState(compiler.compile(spec))
    out = Sampler([EOS]).sample(torch.zeros(1, len(VOCAB)), [state(params, [], fresh)])
    assert out.token_ids == [2]  # "b" is biased most but not allowed; "c" is


def test_compiled_grammars_are_cached_by_constraint(compiler):
    before = compiler.num_compiled
    first = compiler.compile(StructuredOutputsParams(choice=["x", "y"]))
    assert compiler.compile(StructuredOutputsParams(choice=("x", "y"))) is first
    assert compiler.compile(StructuredOutputsParams(choice=["y", "x"])) is not first
    assert compiler.num_compiled == before + 2
    assert GrammarState(first).completes("x") and not GrammarState(first).completes("xy")
