"""The tokenizer built from the default GGUF's metadata against transformers' tokenizer for the
same file; chat templates; incremental detokenisation of multi-byte characters; a Hugging Face
directory's special tokens and chat template files."""

from __future__ import annotations

import json
import os

import pytest

from engine.model.gguf_reader import gguf_metadata, open_gguf
from engine.model.loader import default_model_path
from engine.tokenizer import IncrementalDetokenizer, Tokenizer, render_chat_template

TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnew lines", "émoji 🎉 and 中文字符",
         "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n    return x ** 2  # 😀😀",
         "numbers 1234567 and CamelCaseWords, don't stop!"]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3? ☃"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_metadata(open_gguf(default_model_path())))


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                      gguf_file=os.path.basename(path))


def test_encode_and_decode_match_transformers(tok, hf_tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids) == text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.vocab_size == len(hf_tok)
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert tok.eos_token_ids == {hf_tok.eos_token_id}


def test_special_tokens_are_single_ids_and_skippable(tok):
    ids = tok.encode("<|im_start|>assistant\nok<|im_end|>")
    assert ids[0] == tok.encode("<|im_start|>")[0] and len(tok.encode("<|im_end|>")) == 1
    assert tok.decode(ids) == "assistant\nok"
    assert tok.is_special(ids[0]) and not tok.is_special(ids[1])


def test_chat_template_matches_transformers(tok, hf_tok):
    for messages in (MESSAGES, MESSAGES[1:2]):
        for gen in (True, False):
            want = hf_tok.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == want


def test_chat_template_globals_and_errors():
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                "{% endif %}{{ bos_token }}{{ messages | tojson }}"
                "{% if add_generation_prompt %}>{% endif %}")
    msgs = [{"role": "user", "content": "é"}]
    assert render_chat_template(template, msgs, bos_token="<s>") == \
        '<s>[{"role": "user", "content": "é"}]>'
    with pytest.raises(ValueError, match="user first"):
        render_chat_template(template, [{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="^messages:"):
        render_chat_template(template, ["not a dict"])
    year = render_chat_template("{{ strftime_now('%Y') }}", msgs)
    assert year.isdigit() and len(year) == 4


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) == detok.text
    assert detok.token_ids == ids
    return deltas


def test_incremental_detokenizer_never_splits_a_character(tok):
    prompt = tok.encode("Say something:")
    for text in TEXTS + ["🎉🎉 中文 ﷽ 𝄞 done"]:
        ids = tok.encode(text)
        for skip in (True, False):
            deltas = _stream(tok, prompt, ids, skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in d for d in deltas)
    # the emoji is split over several byte tokens: the first ones yield nothing
    ids = tok.encode("a🎉")
    assert len(ids) > 2
    deltas = _stream(tok, [], ids, True)
    assert deltas[0] == "a" and deltas[1:-1] == [""] * (len(ids) - 2) and deltas[-1] == "🎉"


def test_incremental_detokenizer_skips_special_tokens(tok):
    ids = tok.encode("ok<|im_end|>\nnext")
    assert "".join(_stream(tok, [1], ids, True)) == "ok\nnext"
    assert "".join(_stream(tok, [1], ids, False)) == "ok<|im_end|>\nnext"


def test_unsupported_gguf_tokenizer_is_an_error(tok):
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert"})


def _write_json(path, value) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f)


def test_hf_dir_special_tokens_and_chat_template_sources(tmp_path):
    """Special tokens as strings or AddedToken dicts, extra EOS ids; the chat template from
    chat_template.jinja, else tokenizer_config.json, else chat_template.json (of named templates
    "default", else the first); no tokenizer.json is an error naming it."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "hi": 3}
    Backend(models.WordLevel(vocab, unk_token="<s>")).save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    _write_json(tmp_path / "tokenizer_config.json", config)

    def load() -> Tokenizer:
        return Tokenizer.from_hf_dir(str(tmp_path), extra_eos_token_ids=[2])

    tok = load()
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token) == ("<s>", 0, "</s>")
    assert tok.eos_token_ids == {1, 2} and tok.chat_template is None
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    _write_json(tmp_path / "chat_template.json", {"chat_template": named})
    assert load().chat_template == "D"
    _write_json(tmp_path / "chat_template.json", {"chat_template": named[:1]})
    assert load().chat_template == "T"
    _write_json(tmp_path / "tokenizer_config.json", {**config, "chat_template": "C"})
    assert load().chat_template == "C"
    (tmp_path / "chat_template.jinja").write_text("J{{ bos_token }}", encoding="utf-8")
    assert load().apply_chat_template([{"role": "user", "content": "hi"}]) == "J<s>"
    os.remove(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="^model: expected .*tokenizer.json"):
        load()


def test_min_num_tokens_never_exceeds_the_count(tok):
    """`max_chars_per_token` is a true bound for the byte-level vocabulary: no token of random
    text (ASCII, multi-byte and 4-byte characters, special-token strings, long runs of the
    characters the longest tokens are made of) covers more characters, so `min_num_tokens`
    never exceeds the real count."""
    import random

    bound = tok.max_chars_per_token
    assert bound is not None and bound >= max(len(t) for t in ("<|im_start|>", "<|im_end|>"))
    rng = random.Random(15)
    pieces = ["a", " ", "\n", "#", "=", "-", "é", "中", "🎉", "\u0301", "<|im_start|>",
              "<|endoftext|>", " " * 90, "\n" + " " * 85, "#" * 100, "word ", "1234"]
    for _ in range(60):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 120)))
        enc = tok._tok.encode(text, add_special_tokens=False)
        covered = [end - start for start, end in enc.offsets]
        assert max(covered) <= bound, text
        assert tok.min_num_tokens(text) <= len(tok.encode(text)), text


def test_long_texts_encode_the_same_without_the_gil(tok):
    text = " ".join(TEXTS) * 200  # over the GIL-free threshold
    assert len(text) > 4096
    assert tok.encode(text) == tok._tok.encode(text).ids
    assert tok.encode(text, add_special_tokens=False) == \
        tok._tok.encode(text, add_special_tokens=False).ids


def test_a_tokenizer_that_may_fuse_text_has_no_bound(tok):
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a", "b"]}
    assert Tokenizer.from_gguf_metadata(meta).max_chars_per_token is None
    assert Tokenizer.from_gguf_metadata(meta).min_num_tokens("x" * 100) == 0
