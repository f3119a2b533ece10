"""A tiny GGUF written here (random weights stored the way llama.cpp stores them, a separate
output head, F32 / F16 / Q8_0 tensors, a SentencePiece-style vocabulary) loads to the same
logits and the same token ids as transformers loading that file."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_engine_model import PagedSequences, assert_logits_close, hf_logits

from engine.model import load_model
from engine.tokenizer import IncrementalDetokenizer

gguf = pytest.importorskip("gguf")

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, CTX = 64, 96, 2, 4, 2, 128
PIECES = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "\u2581h", "he", "ll", "lo", "\u2581he", "llo",
          "\u2581hel", "\u2581hello", "\u2581w", "or", "\u2581wor", "ld", "\u2581world"]
MERGES = ["\u2581 h", "h e", "l l", "l o", "\u2581h e", "ll o", "\u2581he l", "\u2581hel lo",
          "\u2581 w", "o r", "\u2581w or", "l d", "\u2581wor ld"]


def _vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(PIECES)  # unknown, control, byte, normal
    scores = [0.0] * 259 + [-float(i) for i in range(len(PIECES))]
    return tokens, scores, types


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, the two rotary halves interleaved."""
    head_dim = w.shape[0] // heads
    return w.reshape(heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: str, with_merges: bool = True) -> None:
    tokens, scores, types = _vocabulary()
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(CTX)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(20000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if with_merges:  # without, both sides derive the merges from the scores
        w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                        "{% endfor %}")

    def tensor(name: str, *shape: int, kind: str = "f32") -> None:
        data = (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1
                else 0.15 * rng.standard_normal(shape)).astype(np.float32)
        if name.endswith("attn_q.weight"):
            data = _llama_cpp_permute(data, HEADS)
        elif name.endswith("attn_k.weight"):
            data = _llama_cpp_permute(data, KV_HEADS)
        if kind == "f16":
            w.add_tensor(name, data.astype(np.float16))
        elif kind == "q8_0":
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(data, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, data)

    head_dim = HIDDEN // HEADS
    tensor("token_embd.weight", len(tokens), HIDDEN, kind="q8_0")
    tensor("output_norm.weight", HIDDEN)
    tensor("output.weight", len(tokens), HIDDEN, kind="f16")
    for i in range(LAYERS):
        b = f"blk.{i}."
        tensor(b + "attn_norm.weight", HIDDEN)
        tensor(b + "ffn_norm.weight", HIDDEN)
        tensor(b + "attn_q.weight", HEADS * head_dim, HIDDEN, kind="q8_0")
        tensor(b + "attn_k.weight", KV_HEADS * head_dim, HIDDEN, kind="f16")
        tensor(b + "attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(b + "attn_output.weight", HIDDEN, HEADS * head_dim)
        tensor(b + "ffn_gate.weight", FFN, HIDDEN, kind="q8_0")
        tensor(b + "ffn_up.weight", FFN, HIDDEN)
        tensor(b + "ffn_down.weight", HIDDEN, FFN, kind="f16")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_gguf") / "tiny-llama.gguf")
    _write_tiny_gguf(path)
    return path


@pytest.mark.parametrize("with_merges", [True, False])
def test_tiny_gguf_tokenizer_matches_transformers(tiny_gguf, tmp_path, with_merges):
    transformers = pytest.importorskip("transformers")
    if not with_merges:
        tiny_gguf = str(tmp_path / "no-merges.gguf")
        _write_tiny_gguf(tiny_gguf, with_merges=False)
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(tiny_gguf),
                                                    gguf_file=os.path.basename(tiny_gguf))
    tok = load_model(tiny_gguf).tokenizer
    for text in ["hello world", "hello  world\n", "held low", "zebra é 🎉", "hellohello"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text), text
        assert ids[0] == 1  # SentencePiece vocabularies get a BOS
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text
    assert tok.encode("hello world", add_special_tokens=False) == \
        hf.encode("hello world", add_special_tokens=False)
    assert tok.eos_token_ids == {2}
    # streaming text: byte-fallback pieces of é and 🎉 are held back until complete
    ids = tok.encode("hello world zebra é 🎉 hello", add_special_tokens=False)
    for prompt in ([], tok.encode("held")):
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = [detok.add(i) for i in ids]
        # the continuation of the prompt's text (a SentencePiece word keeps its space)
        want = tok.decode(prompt + ids)[len(tok.decode(prompt)):]
        assert "".join(deltas) == detok.text == want
        assert not any("\ufffd" in d for d in deltas) and "" in deltas
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"


@torch.no_grad()
def test_tiny_gguf_logits_match_transformers(tiny_gguf):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(tiny_gguf), gguf_file=os.path.basename(tiny_gguf),
        dtype=torch.float32).eval()
    loaded = load_model(tiny_gguf)
    assert not loaded.config.tie_word_embeddings and loaded.config.rope_theta == 20000.0
    assert loaded.name == "tiny-llama"
    assert load_model(os.path.dirname(tiny_gguf)).path == tiny_gguf  # a folder with one GGUF
    prompts = [loaded.tokenizer.encode("hello world"), loaded.tokenizer.encode("held low zebra")]
    seqs = PagedSequences(loaded.config, torch.float32, 32, len(prompts), seed=3)
    ids, pos, meta = seqs.step(dict(enumerate(prompts)))
    rows = loaded.model.compute_logits(loaded.model(ids, pos, seqs.kv_caches, meta))
    rows = rows.split([len(p) for p in prompts])
    for s, p in enumerate(prompts):
        want = hf_logits(hf, p)
        assert_logits_close(rows[s], want)
        assert torch.equal(rows[s].argmax(-1), want.argmax(-1))
