"""Structured outputs with xgrammar (vLLM's default backend): a constraint
(`sampling_params.StructuredOutputsParams`) compiled once per distinct constraint, one matcher per
sequence, applied as a token bitmask to a step's logits.

- `StructuredOutputCompiler` turns a constraint into an xgrammar `CompiledGrammar` over the
  model's vocabulary (its `TokenizerInfo` built from the engine's tokenizer) and keeps the last
  `cache_size` of them, keyed by `StructuredOutputsParams.key`. A schema, regex or grammar
  xgrammar cannot compile is a ValueError naming the field.
- `GrammarState` is one sequence's matcher: it advances with each accepted token; the engine
  keeps a sequence's generated tokens across preemption, so the state stays valid there.
- `apply_grammar_masks` sets to -inf, in place, every token the matcher of a row does not
  allow, for the constrained rows of a batch (one bitmask, one masked write).

JSON schemas and JSON mode are compiled without free whitespace (`": "` and `", "` separators),
so a model cannot loop on blanks inside a value. The matcher ends a completion only with one of
the engine's EOS tokens.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any, Iterable, Optional, Sequence

import torch
import xgrammar as xgr

from engine.sampling_params import StructuredOutputsParams

#: Compiled grammars kept per compiler (least recently used dropped first).
DEFAULT_CACHE_SIZE = 256
#: xgrammar's messages begin with "[time] /path/file.cc:line: "; the rest is the reason.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]
                   ) -> xgr.TokenizerInfo:
    """xgrammar's view of `tokenizer` (an `engine.tokenizer.Tokenizer`): its vocabulary strings
    in id order, padded to the model's `vocab_size` (the width of its logits), the encoding of
    those strings (byte-level, or SentencePiece-style with byte fallback, read from the
    `tokenizers` backend's decoder) and the ids that end a sequence."""
    backend = tokenizer.backend
    n = tokenizer.vocab_size
    vocab = [backend.id_to_token(i) or "" for i in range(n)]
    kind, prefix_space = _vocab_type(json.loads(backend.to_str()))
    return xgr.TokenizerInfo(vocab, kind, vocab_size=max(vocab_size, n),
                             stop_token_ids=sorted(stop_token_ids),
                             add_prefix_space=prefix_space)


def _vocab_type(spec: dict[str, Any]) -> tuple[xgr.VocabType, bool]:
    """(vocabulary encoding, whether a space is prepended to the text) of a tokenizer.json."""
    text = json.dumps(spec.get("decoder"))
    if '"ByteLevel"' in text:
        return xgr.VocabType.BYTE_LEVEL, False
    if '"ByteFallback"' in text:
        prepend = '"Prepend"' in json.dumps(spec.get("normalizer")) or (
            '"Metaspace"' in json.dumps(spec.get("pre_tokenizer"))
            and '"never"' not in json.dumps(spec.get("pre_tokenizer")))
        return xgr.VocabType.BYTE_FALLBACK, prepend
    return xgr.VocabType.RAW, False


class StructuredOutputCompiler:
    """Compiles constraints for one model's vocabulary; thread-safe (the server compiles in
    its worker threads, the engine looks up in its own)."""

    def __init__(self, info: xgr.TokenizerInfo, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, spec: StructuredOutputsParams, field: str = "structured_outputs"
                ) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`, from the cache when an equal one was compiled.
        ValueError naming `field` (and the part at fault) when it does not compile."""
        key = spec.key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        compiled = self._compile(spec, field)
        with self._lock:
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams, field: str) -> xgr.CompiledGrammar:
        kind, text = spec.key
        try:
            if kind == "json":
                json.loads(text)  # xgrammar's own message for bad JSON is only a check name
                return self._compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}',
                                                          any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(spec.choice or ()))
            return self._compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as exc:
            what = {"json": "a JSON schema", "json_object": "JSON mode",
                    "regex": "a regular expression", "choice": "a list of choices",
                    "grammar": "an EBNF grammar"}[kind]
            raise ValueError(f"{field}: expected {what} that compiles, got one that does not "
                             f"({_reason(exc)})") from None


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string literals are EBNF
    string literals)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _reason(exc: Exception) -> str:
    lines = [_LOCATION.sub("", line).strip() for line in str(exc).splitlines()]
    return "; ".join(line for line in lines if line)[:300] or type(exc).__name__


class GrammarState:
    """One sequence's position in a compiled grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar, tokens: Iterable[int] = ()) -> None:
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        for token in tokens:
            self.accept(token)

    def accept(self, token: int) -> None:
        """Advances past `token`; RuntimeError if the grammar does not allow it (the mask
        makes that impossible for sampled tokens)."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} is not allowed by the sequence's grammar")

    @property
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and its end token accepted: nothing may follow."""
        return self.matcher.is_terminated()

    def completes(self, text: str) -> bool:
        """Whether `text` from the start of the output is a whole sentence of the grammar."""
        probe = xgr.GrammarMatcher(self.compiled)
        return probe.accept_string(text) and probe.is_completed()


def apply_grammar_masks(x: torch.Tensor, rows: Sequence[int],
                        grammars: Sequence[GrammarState]) -> None:
    """Sets `x[rows[i], t]` to -inf for every token `t` that `grammars[i]` does not allow
    next; `x` is float32 `[N, vocab]`, changed in place, other rows untouched."""
    bitmask = xgr.allocate_token_bitmask(x.shape[0], x.shape[1])
    for row, grammar in zip(rows, grammars):
        grammar.matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(x, bitmask, indices=list(rows))


def make_compiler(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                  cache_size: int = DEFAULT_CACHE_SIZE) -> StructuredOutputCompiler:
    """A compiler for `tokenizer`'s vocabulary padded to `vocab_size` ids."""
    return StructuredOutputCompiler(tokenizer_info(tokenizer, vocab_size, stop_token_ids),
                                    cache_size)


def grammar_for(compiler: Optional[StructuredOutputCompiler],
                spec: Optional[StructuredOutputsParams], tokens: Iterable[int] = ()
                ) -> Optional[GrammarState]:
    """A fresh `GrammarState` for `spec` (None without one) that has accepted `tokens`."""
    if spec is None or compiler is None:
        return None
    return GrammarState(compiler.compile(spec), tokens)
