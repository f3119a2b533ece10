"""Sampling parameters with vLLM's names, defaults and meanings; checked on construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from engine.stop_strings import StopStringMatcher

#: Temperatures below this are greedy (as in vLLM).
GREEDY_EPS = 1e-5
#: The range of a `logit_bias` value (OpenAI's).
LOGIT_BIAS_MAX = 100.0
#: The range of `seed`: a signed 64-bit integer (vLLM's bound; torch's generator takes it).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1


def _fail(name: str, expected: str, value: object) -> None:
    raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(name: str, value: object, low: int) -> None:
    if not _is_int(value) or value < low:  # type: ignore[operator]
        _fail(name, f"an int >= {low}", value)


def _check_real(name: str, value: object, low: float, high: float, *, low_open: bool = False,
                high_open: bool = False) -> None:
    ok = _is_real(value) and (value > low if low_open else value >= low) and (  # type: ignore
        value < high if high_open else value <= high)  # type: ignore[operator]
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        _fail(name, f"a number in {lo}{low}, {high}{hi}", value)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output text (vLLM's `StructuredOutputsParams`); exactly one of:

    - `json`: a JSON schema (a dict or its JSON text): the output is a JSON value that
      validates against it;
    - `json_object`: True: the output is a JSON object (OpenAI's JSON mode);
    - `regex`: the output matches the regular expression whole;
    - `choice`: the output is exactly one of these non-empty strings;
    - `grammar`: the output is a sentence of this EBNF grammar (GBNF, root rule `root`).

    Checked on construction (ValueError naming the field); whether the schema, regex or
    grammar compiles is checked by `engine.structured_output.StructuredOutputCompiler`.
    `key` identifies the constraint (a dict schema by its canonical JSON text) for caches.
    """

    json: Union[str, dict[str, Any], None] = None
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            _fail("structured_outputs", "exactly one of json, json_object, regex, choice, "
                  "grammar", given or "none")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            _fail("structured_outputs.json", "a JSON schema (an object or its JSON text)",
                  self.json)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            _fail("structured_outputs.json_object", "a bool", self.json_object)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                _fail(f"structured_outputs.{name}", "a non-empty str", value)
        if self.choice is not None:
            if not (isinstance(self.choice, (list, tuple)) and self.choice and all(
                    isinstance(c, str) and c for c in self.choice)):
                _fail("structured_outputs.choice", "a non-empty list of non-empty str",
                      self.choice)
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): equal for equal constraints (a dict schema as compact JSON text, its keys
        in their order)."""
        if self.json is not None:
            # key order kept: a schema's property order is the order generated
            text = self.json if isinstance(self.json, str) else json.dumps(
                self.json, separators=(",", ":"))
            return "json", text
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", str(self.grammar)


@dataclass
class SamplingParams:
    """How to sample the completions of one prompt (vLLM's `SamplingParams`).

    - `n` completions per prompt. `temperature` 0 means greedy.
    - `top_k` 0 or -1: off; otherwise keep the k most likely tokens. `top_p`: keep the smallest
      set of most likely tokens whose probability reaches p. `min_p`: drop tokens less likely
      than `min_p` times the most likely one.
    - `seed`: this request's own random stream (reproducible whatever else is in the batch), a
      signed 64-bit integer.
    - `presence_penalty` / `frequency_penalty` (in [-2, 2]) subtract from the logits of tokens
      already generated (once / per occurrence); `repetition_penalty` (> 0, 1 = off) divides
      positive and multiplies negative logits of tokens in the prompt or the output.
    - `max_tokens` (None: up to the model's length), `min_tokens` (EOS and `stop_token_ids`
      cannot be sampled before that many tokens).
    - `stop` strings end the completion (excluded from the text unless
      `include_stop_str_in_output`); `stop_token_ids` end it too; `ignore_eos` keeps going past
      EOS.
    - `logprobs`: None, or the number of most likely tokens whose log-probabilities are returned
      with each generated token (the sampled one is always included).
    - `skip_special_tokens`: leave special tokens out of the text.
    - `logit_bias`: token id -> a number in [-100, 100] added to that token's logit before
      sampling (OpenAI's meaning; -100 in effect bans a token, 100 all but forces it).
    - `best_of`: generate this many sequences (at least `n`) and return the `n` with the
      highest cumulative log-probability, when all have finished (vLLM's meaning).
    - `structured_outputs`: a `StructuredOutputsParams` constraint on the output (a JSON
      schema, a regex, ...), applied as a token mask before sampling.

    Invalid values raise ValueError naming the field. `stop_matcher`, the automaton that finds
    the stop strings (`engine.stop_strings`), is built on first use and shared by every request
    that uses these parameters.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Union[str, list[str], None] = None
    include_stop_str_in_output: bool = False
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    logit_bias: Optional[dict[int, float]] = None
    best_of: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    _logit_bias_tensors: Optional[tuple[torch.Tensor, torch.Tensor]] = field(
        default=None, init=False, repr=False, compare=False)
    _stop_matcher: Optional[StopStringMatcher] = field(default=None, init=False, repr=False,
                                                        compare=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        _check_real("temperature", self.temperature, 0.0, math.inf, high_open=True)
        _check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", "0 or -1 (off) or an int >= 1", self.top_k)
        _check_real("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None and not (_is_int(self.seed)
                                          and SEED_MIN <= self.seed <= SEED_MAX):
            _fail("seed", f"None or an int in [{SEED_MIN}, {SEED_MAX}]", self.seed)
        _check_real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                    low_open=True, high_open=True)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"at most max_tokens={self.max_tokens}", self.min_tokens)
        self._check_stops()
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, "a bool", getattr(self, name))
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
        self._check_logit_bias()
        if self.best_of is not None:
            _check_int("best_of", self.best_of, self.n)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            _fail("structured_outputs", "None or a StructuredOutputsParams",
                  self.structured_outputs)

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            _fail("logit_bias", "None or a dict of token id -> bias", bias)
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                _fail("logit_bias", "token ids (keys) that are ints >= 0", token)
            if not (_is_real(value) and -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX):
                _fail("logit_bias", f"biases in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}] "
                      f"(token {token})", value)

    def _check_stops(self) -> None:
        stop = self.stop
        if stop is not None:
            strings = [stop] if isinstance(stop, str) else stop
            if not isinstance(strings, (list, tuple)) or not all(
                    isinstance(s, str) and s for s in strings):
                _fail("stop", "None, a non-empty str or a list of non-empty str", stop)
            self.stop = list(strings)
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple, set)) or not all(
                    _is_int(i) and i >= 0 for i in ids):
                _fail("stop_token_ids", "None or a list of ints >= 0", ids)
            self.stop_token_ids = list(dict.fromkeys(ids))  # repeats would only slow each check

    @property
    def greedy(self) -> bool:
        """Whether this samples greedily (temperature below 1e-5)."""
        return self.temperature < GREEDY_EPS

    @property
    def num_seqs(self) -> int:
        """How many sequences the request generates: `best_of`, else `n`."""
        return self.best_of or self.n

    @property
    def logit_bias_tensors(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """`logit_bias` as (token ids int64, biases float32), built once; None without one."""
        if self._logit_bias_tensors is None and self.logit_bias:
            ids = torch.tensor(list(self.logit_bias), dtype=torch.long)
            values = torch.tensor(list(self.logit_bias.values()), dtype=torch.float32)
            self._logit_bias_tensors = ids, values
        return self._logit_bias_tensors

    @property
    def stop_matcher(self) -> Optional[StopStringMatcher]:
        """The matcher of `stop` (built once, O(total length of the strings)); None without
        stop strings."""
        if self._stop_matcher is None and self.stop:
            self._stop_matcher = StopStringMatcher(self.stop)
        return self._stop_matcher


@dataclass
class BeamSearchParams:
    """Beam search (vLLM's `BeamSearchParams`): keep `beam_width` hypotheses for up to
    `max_tokens` steps; rank finished ones by cumulative log-probability divided by
    `length ** length_penalty`. Invalid values raise ValueError naming the field."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", "a bool", self.ignore_eos)
        _check_real("temperature", self.temperature, 0.0, math.inf, high_open=True)
        if not _is_real(self.length_penalty):
            _fail("length_penalty", "a finite number", self.length_penalty)
