"""The `Tokenizer` of one model: text <-> token ids (through the `tokenizers` library), its
special tokens and its chat template.

A `Tokenizer` comes from a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json`,
read by `hf_dir`) or from a GGUF file's `tokenizer.ggml.*` metadata, rebuilt as a BPE tokenizer
by `gguf_vocab`.

`max_chars_per_token` bounds how many characters of text one token can stand for, so that a text
of `c` characters has at least `ceil(c / max_chars_per_token)` tokens: a server refuses a prompt
that cannot fit the model without tokenising it. Long texts are encoded without holding the GIL.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

from tokenizers import Tokenizer as BackendTokenizer

from engine.tokenizer import hf_dir
from engine.tokenizer.chat_template import render_chat_template
from engine.tokenizer.gguf_vocab import gguf_backend, gguf_token, length_bounded


#: Texts longer than this are encoded with the GIL released (a thread switch costs more than
#: encoding a shorter one).
_GIL_FREE_CHARS = 4096


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model.

    `encode(text, add_special_tokens=True)` adds what the model's tokenizer adds (a BOS for
    vocabularies that want one; nothing for byte-level GGUF vocabularies, as transformers does).
    `length_bounded`: whether every token stands for at most as many characters of the text as
    its vocabulary string has (true of the GGUF vocabularies `gguf_vocab` builds, see
    `gguf_vocab.length_bounded`); it makes `max_chars_per_token` known.
    """

    def __init__(self, backend: BackendTokenizer, *, bos_token: Optional[str],
                 eos_tokens: Iterable[Optional[str]], chat_template: Optional[str],
                 add_bos: bool = False, length_bounded: bool = False) -> None:
        self._tok = backend
        self._length_bounded = length_bounded
        self._max_chars: Optional[int] = None
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
    def backend(self) -> BackendTokenizer:
        """The `tokenizers` object underneath (its vocabulary, decoder and settings)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_chars_per_token(self) -> Optional[int]:
        """The most characters of text one token stands for (the longest vocabulary string,
        special tokens included; computed once), or None when this tokenizer has no such
        bound (one with a normalizer, or that can fuse unknown text into one token)."""
        if self._length_bounded and self._max_chars is None:
            n = self.vocab_size
            self._max_chars = max(1, max(len(self._tok.id_to_token(i) or "") for i in range(n)))
        return self._max_chars

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))` from the length of `text` alone (0 when
        `max_chars_per_token` is None)."""
        bound = self.max_chars_per_token
        return 0 if bound is None else math.ceil(len(text) / bound)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids. A text of more
        than `_GIL_FREE_CHARS` characters is encoded with the GIL released (other threads run
        meanwhile)."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        if len(text) > _GIL_FREE_CHARS:
            # `encode_batch` runs without the GIL; `encode` holds it throughout
            ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
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
        ValueError. Its EOS tokens are the file's eos, eot and eom tokens."""
        backend, add_bos = gguf_backend(meta)
        eos = [gguf_token(meta, key) for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
        return cls(backend, bos_token=gguf_token(meta, "bos_token_id"), eos_tokens=eos,
                   chat_template=meta.get("tokenizer.chat_template"), add_bos=add_bos,
                   length_bounded=length_bounded(meta))

    @classmethod
    def from_hf_dir(cls, path: str, extra_eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        """Loads `tokenizer.json` and `tokenizer_config.json` (and `chat_template.jinja` /
        `chat_template.json` when present) from a Hugging Face model directory;
        `extra_eos_token_ids` (e.g. generation_config.json's) also end a sequence.
        FileNotFoundError without `tokenizer.json`."""
        backend = hf_dir.load_backend(path)
        cfg = hf_dir.tokenizer_config(path)
        eos = [hf_dir.token_text(cfg.get("eos_token"))]
        eos += [backend.id_to_token(i) for i in extra_eos_token_ids]
        return cls(backend, bos_token=hf_dir.token_text(cfg.get("bos_token")), eos_tokens=eos,
                   chat_template=hf_dir.chat_template(path, cfg), add_bos=False)
