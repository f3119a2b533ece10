"""The Llama model on a paged cache against Hugging Face transformers on the same GGUF.

Our model runs prefill (a batch of different-length prompts, one of them in two chunks) through
a NaN-filled paged cache with random non-contiguous block tables, then decode steps one token per
sequence. The oracle is transformers' own Llama, loaded from the same GGUF in float32, run once on
each full token sequence with its ordinary contiguous attention.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from engine.model import AttentionMetadata, DecoderConfig, DecoderForCausalLM, load_model
from engine.model.gguf_reader import unpermute_rotary_rows
from engine.model.loader import _safetensors_weights, hf_config

BLOCK_SIZE = 4
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n <", "Hi",
           "Once upon a time, in a land far away, there lived a"]
DECODE_STEPS = 3


@pytest.fixture(scope="module")
def ours():
    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_model(hf_default_model):
    return hf_default_model


class PagedSequences:
    """Sequences in a paged cache with random, non-contiguous block tables; NaN everywhere
    nothing was written."""

    def __init__(self, config: DecoderConfig, dtype: torch.dtype, max_len: int, num_seqs: int,
                 seed: int = 0) -> None:
        self.blocks_per_seq = -(-max_len // BLOCK_SIZE)
        num_blocks = 3 * num_seqs * self.blocks_per_seq
        rng = random.Random(seed)
        ids = rng.sample(range(num_blocks), num_seqs * self.blocks_per_seq)
        self.tables = torch.tensor(ids, dtype=torch.int32).view(num_seqs, self.blocks_per_seq)
        shape = (num_blocks, config.num_key_value_heads, BLOCK_SIZE, config.head_dim)
        self.kv_caches = [(torch.full(shape, float("nan"), dtype=dtype),
                           torch.full(shape, float("nan"), dtype=dtype))
                          for _ in range(config.num_hidden_layers)]
        self.lens = [0] * num_seqs

    def step(self, chunks: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor,
                                                         AttentionMetadata]:
        """Inputs for appending `chunks[s]` (non-empty) to each sequence `s` in `chunks`; the
        other sequences sit this step out."""
        ids, positions, slots, q_lens = [], [], [], []
        for s, chunk in chunks.items():
            for j, token in enumerate(chunk):
                pos = self.lens[s] + j
                ids.append(token)
                positions.append(pos)
                slots.append(int(self.tables[s, pos // BLOCK_SIZE]) * BLOCK_SIZE
                             + pos % BLOCK_SIZE)
            self.lens[s] += len(chunk)
            q_lens.append(len(chunk))
        seqs = list(chunks)
        decode = all(n == 1 for n in q_lens)
        cu = None if decode else torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                              dtype=torch.int32)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64),
                                 block_tables=self.tables[seqs].contiguous(),
                                 seq_lens=torch.tensor([self.lens[s] for s in seqs],
                                                       dtype=torch.int32),
                                 cu_seqlens_q=cu)
        return (torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                meta)


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max()
    err = (got - want).abs().max()
    assert err <= 1e-4 * scale, f"max |diff| {err:.3g} vs max |logit| {scale:.3g}"


@torch.no_grad()
def test_paged_prefill_and_decode_match_transformers(ours, hf_model):
    tok, model = ours.tokenizer, ours.model
    prompts = [tok.encode(p) for p in PROMPTS]
    last = len(prompts) - 1
    seqs = PagedSequences(ours.config, torch.float32, max(map(len, prompts)) + DECODE_STEPS,
                          len(prompts))
    got: list[list[torch.Tensor]] = [[] for _ in prompts]  # our logits per sequence, in order

    def run(chunks: dict[int, list[int]]) -> None:
        ids, pos, meta = seqs.step(chunks)
        logits = model.compute_logits(model(ids, pos, seqs.kv_caches, meta))
        assert logits.dtype == torch.float32 and not logits.isnan().any()
        for s, rows in zip(chunks, logits.split([len(c) for c in chunks.values()])):
            got[s].append(rows)

    # prefill in two steps; the last prompt is split in two chunks (chunked prefill)
    split = len(prompts[last]) // 2
    run({s: (p if s < last else p[:split]) for s, p in enumerate(prompts)})
    run({last: prompts[last][split:]})
    tokens = [list(p) for p in prompts]
    for _ in range(DECODE_STEPS):  # decode: one token per sequence, greedy from our logits
        nexts = {s: [int(g[-1][-1].argmax())] for s, g in enumerate(got)}
        for s, n in nexts.items():
            tokens[s] += n
        run(nexts)

    for s, t in enumerate(tokens):
        want = hf_logits(hf_model, t)
        mine = torch.cat(got[s])
        assert mine.shape == (len(t), ours.config.vocab_size) == want.shape
        assert_logits_close(mine, want)
        assert torch.equal(mine.argmax(-1), want.argmax(-1))  # greedy tokens identical


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's converter, written from its definition: per head, row (half c, index j) of the
    # Hugging Face layout is stored at row (j, c) (pairs interleaved)
    heads, head_dim, cols = 3, 8, 5
    hf = torch.randn(heads * head_dim, cols)
    stored = torch.empty_like(hf)
    for h in range(heads):
        for c in range(2):
            for j in range(head_dim // 2):
                stored[h * head_dim + 2 * j + c] = hf[h * head_dim + c * head_dim // 2 + j]
    assert torch.equal(unpermute_rotary_rows(stored, heads), hf)


# -- a tiny random Hugging Face directory -----------------------------------------------------

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=300,
            hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=5000.0,
            max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2, torch_dtype="float32")


def _tiny_tokenizer_json(path: str) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY["vocab_size"],
                                  special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["hello world, the paged cache says hello"] * 20, trainer)
    backend.save(os.path.join(path, "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from safetensors.torch import save_file

    path = str(tmp_path_factory.mktemp("tiny_llama"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY, f)
    g = torch.Generator().manual_seed(0)
    c = TINY
    h, d, i = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (c["vocab_size"], h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (c["num_attention_heads"] * d, h),
            p + "self_attn.k_proj.weight": (c["num_key_value_heads"] * d, h),
            p + "self_attn.v_proj.weight": (c["num_key_value_heads"] * d, h),
            p + "self_attn.o_proj.weight": (h, c["num_attention_heads"] * d),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i)})
    tensors = {n: (1.0 + 0.1 * torch.randn(s, generator=g)) if len(s) == 1
               else 0.2 * torch.randn(s, generator=g) for n, s in shapes.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    _tiny_tokenizer_json(path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>",
                   "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
                                    "</s>{% endfor %}{% if add_generation_prompt %}<s>assistant:"
                                    "{% endif %}"}, f)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_tiny_hf_directory_matches_transformers(tiny_dir, dtype):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    loaded = load_model(tiny_dir, dtype=dtype)
    assert loaded.config.head_dim == 16 and not loaded.config.tie_word_embeddings
    assert loaded.tokenizer.eos_token_ids == {2}
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<s>user: hi</s><s>assistant:"
    prompts = [loaded.tokenizer.encode("hello world"), loaded.tokenizer.encode("the cache")]
    seqs = PagedSequences(loaded.config, dtype, 16, len(prompts), seed=1)
    ids, pos, meta = seqs.step(dict(enumerate(prompts)))
    hidden = loaded.model(ids, pos, seqs.kv_caches, meta)
    assert hidden.dtype == dtype
    logits = loaded.model.compute_logits(hidden)
    ids, pos, meta = seqs.step({0: [5], 1: [7]})
    step = loaded.model.compute_logits(loaded.model(ids, pos, seqs.kv_caches, meta))
    rows = logits.split([len(p) for p in prompts])
    # the loader packs the weights for oneDNN (bfloat16 only where oneDNN has bfloat16 kernels:
    # not on an AVX2-only CPU); the plain F.linear path gives the same logits
    assert loaded.model.packed or (dtype == torch.bfloat16
                                   and not torch.ops.mkldnn._is_mkldnn_bf16_supported())
    plain = DecoderForCausalLM(loaded.config, dtype=dtype)
    plain.load_weights(_safetensors_weights([os.path.join(tiny_dir, "model.safetensors")]))
    seqs_plain = PagedSequences(loaded.config, dtype, 16, len(prompts), seed=2)
    ids, pos, meta = seqs_plain.step(dict(enumerate(prompts)))
    plain_logits = plain.compute_logits(plain(ids, pos, seqs_plain.kv_caches, meta))
    torch.testing.assert_close(plain_logits, logits, rtol=1e-5, atol=1e-5 * logits.abs().max())
    for s, (p, nxt) in enumerate(zip(prompts, [5, 7])):
        want = hf_logits(hf, p + [nxt])
        mine = torch.cat([rows[s], step[s:s + 1]])
        if dtype == torch.float32:
            assert_logits_close(mine, want)
        else:  # bfloat16 keeps about 3 significant digits through two layers
            assert (mine - want).abs().max() <= 0.05 * want.abs().max()


def test_hf_config_rejects_non_llama():
    with pytest.raises(ValueError, match="model_type"):
        hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    assert hf_config({**TINY, "rope_scaling": llama3}).rope_scaling == llama3
    with pytest.raises(ValueError, match="'mrope'"):
        hf_config({**TINY, "rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="'high_freq_factor'"):
        hf_config({**TINY, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0}})
    config = hf_config({**TINY, "rope_parameters": {"rope_type": "default", "rope_theta": 3e4},
                        "head_dim": None})
    assert config.rope_theta == 3e4 and config.head_dim == 48 // 4


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing there"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="GGUF"):
        load_model(str(bad))
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(bad), dtype=torch.int8)
