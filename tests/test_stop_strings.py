"""The incremental stop-string matcher (engine/stop_strings.py) against a brute-force reference
(the per-token scan of every stop string over the window ending in the new text), on random
texts, stop lists and splits into deltas; SamplingParams builds it once."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling_params import SamplingParams
from engine.stop_strings import StopStringMatcher


def reference(text: str, delta_len: int, stops: list[str]):
    """(index, start) of the first listed stop string with an occurrence ending in the last
    `delta_len` characters of `text`, at its first such occurrence; None without one."""
    for index, stop in enumerate(stops):
        start = max(0, len(text) - delta_len - len(stop) + 1)
        at = text.find(stop, start)
        if at != -1:
            return index, at
    return None


def run_both(stops: list[str], deltas: list[str], checked: list[bool]) -> None:
    scanner = StopStringMatcher(stops).scanner()
    text = ""
    for delta, check in zip(deltas, checked):
        text += delta
        got = scanner.feed(delta)
        if not check or not delta:
            continue  # the engine feeds every delta but checks only some (min_tokens)
        want = reference(text, len(delta), stops)
        if want is None:
            assert got is None, (stops, text, delta)
            continue
        assert got is not None, (stops, text, delta, want)
        start = len(text) - len(delta) + got.end - len(got.stop)
        assert (got.index, start) == want, (stops, text, delta)
        assert got.stop == stops[got.index]


small_text = st.text(alphabet="aab\u00e9\U0001f600", max_size=6)


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text(alphabet="ab\u00e9\U0001f600", min_size=1, max_size=5),
                      min_size=1, max_size=8),
       deltas=st.lists(small_text, min_size=1, max_size=12),
       data=st.data())
def test_matches_the_brute_force_scan(stops, deltas, data):
    checked = data.draw(st.lists(st.booleans(), min_size=len(deltas), max_size=len(deltas)))
    run_both(stops, deltas, checked)


def test_matches_on_longer_random_runs():
    rng = random.Random(15)
    for _ in range(200):
        alphabet = rng.choice(["ab", "abc", "a\u00e9\U0001f600 "])
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
                 for _ in range(rng.randint(1, 30))]
        deltas = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 7)))
                  for _ in range(60)]
        run_both(stops, deltas, [rng.random() < 0.7 for _ in deltas])


def test_first_listed_wins_over_earliest_ending():
    scanner = StopStringMatcher(["cd", "abc", "b"]).scanner()
    match = scanner.feed("xabcd")
    assert (match.index, match.stop, match.end) == (0, "cd", 5)
    assert StopStringMatcher(["b", "b"]).scanner().feed("abb").end == 2  # first occurrence


def test_bad_stop_lists_are_errors():
    for bad in ("abc", ["a", ""], [1]):
        with pytest.raises(ValueError, match="^stops: expected a list of non-empty str"):
            StopStringMatcher(bad)


def test_sampling_params_builds_the_matcher_once():
    params = SamplingParams(stop=["x", "yz"])
    assert params.stop_matcher is params.stop_matcher
    assert params.stop_matcher.stops == ["x", "yz"]
    assert SamplingParams().stop_matcher is None
