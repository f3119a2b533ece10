"""Sampling parameters with vLLM's names, defaults and meanings; checked on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from engine.stop_strings import StopStringMatcher

#: Temperatures below this are greedy (as in vLLM).
GREEDY_EPS = 1e-5
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
