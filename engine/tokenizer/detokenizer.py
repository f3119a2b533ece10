"""Incremental detokenising: the text of one request's generated tokens, one token at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from engine.tokenizer.tokenizer import Tokenizer

#: Tokens of context decoded before the new ones, so that spacing rules see their neighbours.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns generated ids into text one token at a time.

    `add(token_id)` returns the new text; it never returns part of a UTF-8 character: while the
    bytes decoded so far end in an incomplete character, it returns "" and holds them back until
    a later token completes it. `text` is the whole generated text so far (prompt excluded).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        prompt = list(prompt_ids)[-_CONTEXT_TOKENS:]
        if skip_special_tokens:
            prompt = [i for i in prompt if not tokenizer.is_special(i)]
        self._ids = prompt
        self._prefix_offset = 0  # start of the context window in self._ids
        self._read_offset = len(prompt)  # ids before this are already emitted as text
        self.text = ""
        self.token_ids: list[int] = []

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the newly completed text (maybe "")."""
        self.token_ids.append(token_id)
        if self._skip and self._tokenizer.is_special(token_id):
            return ""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        window = self._ids[self._prefix_offset:]
        before = decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        full = decode(window, self._skip)
        if full.endswith("\ufffd") or len(full) <= len(before):
            return ""  # an incomplete UTF-8 character at the end: wait for its other bytes
        delta = full[len(before):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
