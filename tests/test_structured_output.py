"""Structured outputs in the engine (engine/structured_output.py, the sampler's mask, the
engine's matcher per sequence): outputs parse and validate (checked by `jsonschema` and Python's
`re`, which share no code with xgrammar) for JSON schemas, JSON mode, regexes, choices and
grammars; with constrained and unconstrained requests in one batch, `n > 1`, forced preemption
and stop strings; "length" when max_tokens runs out; errors name the field; compiled grammars
are cached per schema.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.llm import LLM
from engine.model.loader import load_model
from engine.sampler import Sampler, SamplingState
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_output import GrammarState

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPT = "Describe a person as JSON:"


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="module")
def llm(loaded):
    return LLM(model=loaded, num_kv_blocks=64)


def text_ids(llm: LLM, text: str) -> dict:
    return {"prompt_token_ids": llm.llm_engine.tokenizer.encode(text)}


def constrained(max_tokens: int = 48, **kw) -> SamplingParams:
    kw.setdefault("structured_outputs", StructuredOutputsParams(json=PERSON))
    return SamplingParams(max_tokens=max_tokens, **kw)


def test_random_logits_over_the_whole_vocabulary_always_give_valid_json(llm):
    """No model: random logits, so many tokens the mask lets through are tried."""
    engine = llm.llm_engine
    compiled = engine.structured_output.compile(StructuredOutputsParams(json=PERSON))
    sampler = Sampler(engine.eos_token_ids)
    gen = torch.Generator().manual_seed(0)
    states = [SamplingState(SamplingParams(temperature=1.0), [1], [], gen,
                            grammar=GrammarState(compiled)) for _ in range(2)]
    states.append(SamplingState(SamplingParams(temperature=1.0), [1], [], gen))  # unconstrained
    for _ in range(200):
        live = [s for s in states[:2] if not s.grammar.is_terminated]
        if not live:
            break
        logits = torch.randn(len(live) + 1, engine.model_config.vocab_size, generator=gen)
        out = sampler.sample(logits * 3, live + [states[2]])
        for s, t in zip(live, out.token_ids):
            s.grammar.accept(t)
            s.output_token_ids.append(t)
    for s in states[:2]:
        assert s.grammar.is_terminated
        text = engine.tokenizer.decode(s.output_token_ids)
        jsonschema.validate(json.loads(text), PERSON)


def test_mixed_batch_n_and_forced_preemption_validate(loaded):
    llm = LLM(model=loaded, block_size=2, num_kv_blocks=63, kv_fill=float("nan"))
    free = SamplingParams(max_tokens=24, temperature=0.0)
    reqs = [text_ids(llm, "The capital of France is"), text_ids(llm, "A person, in JSON:"),
            text_ids(llm, PROMPT)]
    params = [free, constrained(temperature=0.0), constrained(36, n=3, temperature=1.0, seed=7)]
    outs = llm.generate(reqs, params, use_tqdm=False)
    assert llm.llm_engine.stats().num_preemptions > 0
    for comp in outs[1].outputs + outs[2].outputs:
        assert comp.finish_reason == "stop", comp
        jsonschema.validate(json.loads(comp.text), PERSON)
    assert len({c.text for c in outs[2].outputs}) > 1  # each of n has its own matcher
    assert len(outs[0].outputs[0].token_ids) == 24
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize("spec, check", [
    (StructuredOutputsParams(regex=r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}"),
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}", t)),
    (StructuredOutputsParams(choice=["Paris", "Lyon", "Nice \"quoted\""]),
     lambda t: t in ("Paris", "Lyon", "Nice \"quoted\"")),
    (StructuredOutputsParams(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
     lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
    (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_grammar_and_json_mode(llm, spec, check):
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, structured_outputs=spec)
    out = llm.generate([text_ids(llm, "The capital of France is")], params, use_tqdm=False)
    for comp in out[0].outputs:
        assert comp.finish_reason == "stop" and check(comp.text), comp


def test_stop_strings_end_only_a_complete_output(llm):
    spec = StructuredOutputsParams(regex=r"(ab){2,4}c")
    params = SamplingParams(max_tokens=20, temperature=0.0, stop=["b"],
                            include_stop_str_in_output=True, structured_outputs=spec)
    out = llm.generate([text_ids(llm, "x")], params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"(ab){2,4}c", out.text), out  # "ab" alone is not a whole match
    schema_stop = SamplingParams(max_tokens=48, temperature=0.0, stop=['"'],
                                 structured_outputs=StructuredOutputsParams(json=PERSON))
    out = llm.generate([text_ids(llm, PROMPT)], schema_stop, use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), PERSON)


def test_a_schema_longer_than_max_tokens_ends_with_length(llm):
    out = llm.generate([text_ids(llm, PROMPT)], constrained(max_tokens=3, temperature=0.0),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_bad_constraints_name_the_field_and_schemas_are_cached(llm):
    compiler = llm.llm_engine.structured_output
    for spec, field in [(StructuredOutputsParams(json={"type": "no-such-type"}),
                         "structured_outputs"),
                        (StructuredOutputsParams(json="{not json"), "structured_outputs"),
                        (StructuredOutputsParams(regex="a(b"), "structured_outputs"),
                        (StructuredOutputsParams(grammar="root ::= undefined_rule"),
                         "structured_outputs")]:
        with pytest.raises(ValueError, match=rf"^{field}: expected .* that compiles"):
            llm.llm_engine.add_request("bad", [1, 2], SamplingParams(structured_outputs=spec))
    with pytest.raises(ValueError, match="response_format: expected a JSON schema"):
        compiler.compile(StructuredOutputsParams(json={"type": "nope"}), "response_format")
    with pytest.raises(ValueError, match="^structured_outputs: expected exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    before = compiler.num_compiled
    first = compiler.compile(StructuredOutputsParams(json={"a": 1, "type": "object"}))
    again = compiler.compile(StructuredOutputsParams(json='{"a":1,"type":"object"}'))
    assert again is first and compiler.num_compiled == before + 1
