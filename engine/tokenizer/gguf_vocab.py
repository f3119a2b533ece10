"""A GGUF's `tokenizer.ggml.*` metadata -> a `tokenizers` BPE tokenizer.

`tokenizer.ggml.model` "gpt2" is a byte-level BPE vocabulary (GPT-2's byte alphabet, a split
pattern chosen by `tokenizer.ggml.pre`); "llama" is a SentencePiece-style BPE vocabulary ("▁" for
spaces, byte fallback), whose merges are derived from the token scores when the file has none.
Token ids are positions in `tokenizer.ggml.tokens`.
"""

from __future__ import annotations

from typing import Any, Optional

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# GGUF token types (llama.cpp's llama_token_type)
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

#: Split patterns of byte-level vocabularies whose merges were learned on a split other than
#: GPT-2's, keyed by `tokenizer.ggml.pre`. Anything else uses GPT-2's pattern.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}


def gguf_backend(meta: dict[str, Any]) -> tuple[BackendTokenizer, bool]:
    """The tokenizer `meta` describes, its control tokens added as special tokens and its
    user-defined ones as plain added tokens, and whether `encode` should add a BOS: never for
    "gpt2" (as transformers does), for "llama" unless `tokenizer.ggml.add_bos_token` is false.
    ValueError for any other `tokenizer.ggml.model`."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = gguf_tokens(meta)
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = list(meta.get("tokenizer.ggml.merges") or [])
    if kind == "gpt2":
        backend = byte_level_bpe(tokens, merges, meta.get("tokenizer.ggml.pre"))
        alphabet = set(byte_alphabet().values())
        special = [t for t, k in zip(tokens, types)
                   if k == _GGUF_CONTROL and set(t) <= alphabet]
        add_bos = False
    elif kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        backend = sentencepiece_bpe(tokens, merges, scores,
                                    tokens[unk] if unk is not None else None)
        special = [t for t, k in zip(tokens, types) if k == _GGUF_CONTROL]
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise ValueError(f"tokenizer.ggml.model: expected 'gpt2' (byte-level BPE) or "
                         f"'llama' (SentencePiece BPE), got {kind!r}")
    user = [t for t, k in zip(tokens, types) if k == _GGUF_USER_DEFINED]
    _add_tokens(backend, special, user)
    return backend, add_bos


def length_bounded(meta: dict[str, Any]) -> bool:
    """Whether each token of the tokenizer `gguf_backend(meta)` builds stands for at most as
    many characters of the input text as its vocabulary string has. Neither kind normalizes
    the text. "gpt2": a token's string has one character per byte it covers, and a character
    is at least one byte; added tokens match their own text. "llama": a token's string is the
    text it covers (" " spelled "▁", one character for one) or a byte token; this holds unless
    a byte token is missing, since then unknown text is fused into one unknown token."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        return True
    if kind == "llama":
        return {f"<0x{b:02X}>" for b in range(256)} <= set(gguf_tokens(meta))
    return False


def gguf_tokens(meta: dict[str, Any]) -> list[str]:
    """The vocabulary, in id order."""
    return list(meta.get("tokenizer.ggml.tokens") or [])


def gguf_token(meta: dict[str, Any], key: str) -> Optional[str]:
    """The text of the token whose id `tokenizer.ggml.<key>` holds (e.g. "eos_token_id"); None
    when the key is absent or the id is outside the vocabulary."""
    tokens = gguf_tokens(meta)
    i = meta.get(f"tokenizer.ggml.{key}")
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None


def _add_tokens(backend: BackendTokenizer, special: list[str], user: list[str]) -> None:
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def byte_alphabet() -> dict[int, str]:
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


def byte_level_bpe(tokens: list[str], merges: list[str], pre: Optional[str]) -> BackendTokenizer:
    """A byte-level BPE tokenizer over `tokens` (ids = positions) and `merges` ("a b" strings),
    split by `pre`'s pattern (GPT-2's when `pre` has none of its own)."""
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    # a token stored in plain text (outside the byte alphabet) is respelled byte by byte
    vocab = {(t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
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


def sentencepiece_bpe(tokens: list[str], merges: list[str], scores: list[float],
                      unk: Optional[str]) -> BackendTokenizer:
    """A SentencePiece-style BPE tokenizer: spaces become "▁", one is prepended to the text,
    bytes missing from the vocabulary fall back to "<0xXX>" tokens. Without merges in the file
    they are derived from the vocabulary, best-scored merged token first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = merges_from_scores(tokens, scores)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk,
                                          fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁",
                                                     prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "),
                                         decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    return backend


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
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
