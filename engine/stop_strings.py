"""Stop strings found incrementally: an Aho-Corasick automaton over a request's `stop` list.

`StopStringMatcher(stops)` is built once per request (it is immutable and shared by the
request's sequences); each sequence feeds its new text to its own `StopStringScanner`, which
keeps the automaton's state between calls. Feeding `k` characters costs O(k) whatever the
number and length of the stop strings: no stop string is ever re-scanned.

Which stop string wins (vLLM's rule, which the engine has always followed): among the stop
strings with an occurrence that ends in the new text, the one listed first; it is cut at its
first such occurrence. An occurrence may begin in earlier text.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

#: `best` value of a state that ends no stop string.
_NONE = 1 << 62


@dataclass(frozen=True)
class StopMatch:
    """A stop string found in fed text: `index` in the stop list, the string itself, and
    `end`, the offset just past it within the text passed to that `feed` call (it may begin
    before that text: `end - len(stop)` is then negative)."""

    index: int
    stop: str
    end: int


class StopStringMatcher:
    """The Aho-Corasick automaton of `stops` (non-empty strings; duplicates allowed, the first
    one counts). Build cost O(total length of `stops`).

    States are trie nodes numbered from 0 (the root). `best[s]` is the smallest list index of a
    stop string that is a suffix of state `s`'s string, so a scan learns which stop strings end
    at a position in O(1) without walking the output links."""

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stops: expected a list of non-empty str, got {stops!r:.200}")
        self.stops = list(stops)
        self.max_len = max((len(s) for s in self.stops), default=0)
        self._goto: list[dict[str, int]] = [{}]
        self._best: list[int] = [_NONE]
        for index, stop in enumerate(self.stops):
            self._insert(stop, index)
        self._fail = self._link()

    def _insert(self, stop: str, index: int) -> None:
        state = 0
        for ch in stop:
            nxt = self._goto[state].get(ch)
            if nxt is None:
                nxt = len(self._goto)
                self._goto[state][ch] = nxt
                self._goto.append({})
                self._best.append(_NONE)
            state = nxt
        self._best[state] = min(self._best[state], index)

    def _link(self) -> list[int]:
        """Failure links by breadth-first search; folds each state's `best` with its link's."""
        fail = [0] * len(self._goto)
        queue = deque(self._goto[0].values())
        while queue:
            state = queue.popleft()
            for ch, child in self._goto[state].items():
                f = fail[state]
                while f and ch not in self._goto[f]:
                    f = fail[f]
                fail[child] = self._goto[f].get(ch, 0)
                self._best[child] = min(self._best[child], self._best[fail[child]])
                queue.append(child)
        return fail

    @property
    def num_states(self) -> int:
        """Trie nodes, the root included."""
        return len(self._goto)

    def step(self, state: int, ch: str) -> int:
        """The state after reading `ch` in `state`."""
        goto, fail = self._goto, self._fail
        while True:
            nxt = goto[state].get(ch)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]

    def scanner(self) -> "StopStringScanner":
        """A fresh scanner (no text read yet) over this automaton."""
        return StopStringScanner(self)


class StopStringScanner:
    """One sequence's position in a `StopStringMatcher`: `feed` the text as it is generated."""

    def __init__(self, matcher: StopStringMatcher) -> None:
        self.matcher = matcher
        self.state = 0

    def feed(self, text: str) -> Optional[StopMatch]:
        """Reads `text` (the characters that follow all text fed so far) and returns the stop
        string that wins among those ending inside `text` (the first listed; its first
        occurrence), or None. The state advances over all of `text` either way."""
        m = self.matcher
        goto, fail, best = m._goto, m._fail, m._best
        state, found, found_end = self.state, _NONE, 0
        for i, ch in enumerate(text):
            while True:  # `StopStringMatcher.step`, inlined: this loop is the hot path
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
            if best[state] < found:
                found, found_end = best[state], i + 1
        self.state = state
        if found == _NONE:
            return None
        return StopMatch(found, m.stops[found], found_end)
