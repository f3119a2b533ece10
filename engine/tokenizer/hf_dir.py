"""A Hugging Face model directory's tokenizer files: `tokenizer.json` (the fast tokenizer),
`tokenizer_config.json` (special tokens, maybe the chat template) and `chat_template.jinja` /
`chat_template.json`."""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

from tokenizers import Tokenizer as BackendTokenizer


def load_backend(path: str) -> BackendTokenizer:
    """The fast tokenizer in `path`/tokenizer.json; FileNotFoundError naming it when absent."""
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise FileNotFoundError(f"model: expected {tok_file} (a Hugging Face fast tokenizer)")
    return BackendTokenizer.from_file(tok_file)


def tokenizer_config(path: str) -> dict[str, Any]:
    """`path`/tokenizer_config.json, or {} when there is none."""
    return _read_json(os.path.join(path, "tokenizer_config.json"))


def token_text(token: Union[str, dict, None]) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def chat_template(path: str, cfg: dict[str, Any]) -> Optional[str]:
    """The directory's chat template: `chat_template.jinja`, else `cfg`'s, else
    `chat_template.json`'s; of named templates the "default" one (else the first). None when
    there is none."""
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


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
