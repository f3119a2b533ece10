"""Tokenizer (through the `tokenizers` library), chat templates (jinja2) and incremental
detokenisation.

A `Tokenizer` comes from a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json`) or
from a GGUF file's `tokenizer.ggml.*` metadata, rebuilt as a byte-level BPE tokenizer.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Iterable, Optional, Union

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _BackendTokenizer

# GGUF token types (llama.cpp's llama_token_type)
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

#: Split patterns of byte-level vocabularies whose merges were learned on a split other than
#: GPT-2's, keyed by `tokenizer.ggml.pre`. Anything else uses GPT-2's pattern.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies:
    printable Latin-1 bytes map to themselves, the others to code points 256 and up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model.

    `encode(text, add_special_tokens=True)` adds what the model's tokenizer adds (a BOS for
    vocabularies that want one; nothing for byte-level GGUF vocabularies, as transformers does).
    """

    def __init__(self, backend: _BackendTokenizer, *, bos_token: Optional[str],
                 eos_tokens: Iterable[str], chat_template: Optional[str],
                 add_bos: bool = False) -> None:
        self._tok = backend
        self.bos_token = bos_token
        self.bos_token_id: Optional[int] = self._id_of(bos_token)
        eos_list = [t for t in eos_tokens if t is not None]
        self.eos_token = eos_list[0] if eos_list else None
        self.eos_token_ids: set[int] = {i for i in map(self._id_of, eos_list) if i is not None}
        self.chat_template = chat_template
        self._add_bos = add_bos and self.bos_token_id is not None

    def _id_of(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (special tokens dropped when `skip_special_tokens`)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[Optional[str]]:
        """The vocabulary strings of `ids`."""
        return [self._tok.id_to_token(i) for i in ids]

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special (control) token."""
        return token_id in self._special_ids

    @property
    def _special_ids(self) -> set[int]:
        if not hasattr(self, "_special_cache"):
            added = self._tok.get_added_tokens_decoder()
            self._special_cache = {i for i, t in added.items() if t.special}
        return self._special_cache

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Renders `messages` (dicts with "role" and "content") with the model's chat template.
        ValueError when the model has no template or the template rejects the messages."""
        if self.chat_template is None:
            raise ValueError("messages: this model has no chat template (none in its GGUF "
                             "metadata or tokenizer_config.json); pass a prompt instead")
        return render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token or "",
                                    eos_token=self.eos_token or "", **kwargs)

    # -- construction --------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        """Builds the tokenizer a GGUF describes: `tokenizer.ggml.model` "gpt2" (byte-level BPE;
        no BOS added, as transformers does) or "llama" (SentencePiece-style BPE with byte
        fallback; BOS added unless `tokenizer.ggml.add_bos_token` is false). Others raise
        ValueError."""
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = list(meta.get("tokenizer.ggml.merges") or [])
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, merges, meta.get("tokenizer.ggml.pre"))
            alphabet = set(_byte_alphabet().values())
            special = [t for t, k in zip(tokens, types)
                       if k == _GGUF_CONTROL and set(t) <= alphabet]
            add_bos = False
        elif kind == "llama":
            scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
            unk = meta.get("tokenizer.ggml.unknown_token_id")
            backend = _sentencepiece_bpe(tokens, merges, scores,
                                         tokens[unk] if unk is not None else None)
            special = [t for t, k in zip(tokens, types) if k == _GGUF_CONTROL]
            add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        else:
            raise ValueError(f"tokenizer.ggml.model: expected 'gpt2' (byte-level BPE) or "
                             f"'llama' (SentencePiece BPE), got {kind!r}")
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t in special])
        user = [t for t, k in zip(tokens, types) if k == _GGUF_USER_DEFINED]
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

        def token(key: str) -> Optional[str]:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        eos = [token("eos_token_id"), token("eot_token_id"), token("eom_token_id")]
        return cls(backend, bos_token=token("bos_token_id"), eos_tokens=eos,
                   chat_template=meta.get("tokenizer.chat_template"), add_bos=add_bos)

    @classmethod
    def from_hf_dir(cls, path: str, extra_eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        """Loads `tokenizer.json` and `tokenizer_config.json` (and `chat_template.jinja` /
        `chat_template.json` when present) from a Hugging Face model directory."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"model: expected {tok_file} (a Hugging Face fast tokenizer)")
        backend = _BackendTokenizer.from_file(tok_file)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        bos = _token_text(cfg.get("bos_token"))
        eos = [_token_text(cfg.get("eos_token"))]
        eos += [backend.id_to_token(i) for i in extra_eos_token_ids]
        tok = cls(backend, bos_token=bos, eos_tokens=eos,
                  chat_template=_hf_chat_template(path, cfg), add_bos=False)
        return tok


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: Optional[str]) -> _BackendTokenizer:
    """A byte-level BPE tokenizer over `tokens` (ids = positions) and `merges` ("a b" strings)."""
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    # a token stored in plain text (outside the byte alphabet) is respelled byte by byte
    vocab = {(t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = _BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                           byte_fallback=False))
    split = _PRE_SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], merges: list[str], scores: list[float],
                       unk: Optional[str]) -> _BackendTokenizer:
    """A SentencePiece-style BPE tokenizer: spaces become "▁", one is prepended to the text,
    bytes missing from the vocabulary fall back to "<0xXX>" tokens. Without merges in the file
    they are derived from the vocabulary, best-scored merged token first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = _merges_from_scores(tokens, scores)
    backend = _BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk,
                                           fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁",
                                                     prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "),
                                         decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, ordered by the merged token's score (highest
    first), then longer left and right parts first, then vocabulary order."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        splits = sorted((lr for lr in splits if lr[0] in vocab and lr[1] in vocab),
                        key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found += [(score, left, right) for left, right in splits]
    found.sort(key=lambda f: (-f[0], -len(f[1]), -len(f[2])))  # stable: ties keep the order
    return [(left, right) for _, left, right in found]


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(token: Union[str, dict, None]) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _hf_chat_template(path: str, cfg: dict[str, Any]) -> Optional[str]:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = cfg.get("chat_template") or _read_json(
        os.path.join(path, "chat_template.json")).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


# -- chat templates ----------------------------------------------------------------------

def _raise_exception(message: str) -> None:
    raise ValueError(f"messages: rejected by the chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # unlike jinja's own filter, no HTML escaping: templates emit raw JSON into prompts
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


_TEMPLATE_CACHE: dict[str, Any] = {}


def _compiled(template: str) -> Any:
    if template not in _TEMPLATE_CACHE:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _TEMPLATE_CACHE[template] = env.from_string(template)
    return _TEMPLATE_CACHE[template]


def render_chat_template(template: str, messages: list[dict[str, Any]], *,
                         add_generation_prompt: bool = True, **variables: Any) -> str:
    """Renders a Hugging Face-style chat template (sandboxed jinja2, `trim_blocks` and
    `lstrip_blocks` on, `raise_exception` / `strftime_now` / a non-escaping `tojson`)."""
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"messages: expected a list of dicts with 'role' and 'content', got "
                         f"{messages!r:.200}")
    return _compiled(template).render(messages=messages,
                                      add_generation_prompt=add_generation_prompt, **variables)


# -- incremental detokenisation ------------------------------------------------------------

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
