"""GGUF files of the model families against the safetensors checkpoints they come from.

Each file is written here, with the `gguf` package's writer, from a tiny random checkpoint
(tests/family_case.py) the way llama.cpp's converter writes that architecture: its metadata
keys, its tensor names (from `gguf`'s own name map, not the engine's), Llama's Q/K row
permutation and Llama 3's `rope_freqs` (each frequency's divisor), Gemma's norm weights stored
as `1 + w`, Phi-3's fused tensors and LongRoPE factor tensors. Loading the GGUF must give the
`DecoderConfig` and the greedy continuations of the safetensors directory (engine against
engine; the family tests compare the directories with transformers). A Q8_0 Phi-3 file also
runs on its blocks (`quantization="gguf"`), fused `attn_qkv` / `ffn_up` included.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch

from engine.model.families import config_from_hf
from family_case import engine_greedy, prompts, write_checkpoint

HALF = 8  # head_dim / 2 of the tiny models
#: Model -> (transformers config class, its settings, the norms' neutral value); a model's
#: GGUF architecture is its name up to the first "-".
MODELS = {
    "llama": ("LlamaConfig", dict(head_dim=16), 1.0),
    "qwen2": ("Qwen2Config", dict(), 1.0),
    "qwen3": ("Qwen3Config", dict(head_dim=16), 1.0),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                    pad_token_id=0), 0.0),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16,
                                        sliding_window=8, pad_token_id=0), 0.0),
    "phi3": ("Phi3Config", dict(sliding_window=8, original_max_position_embeddings=128,
                                pad_token_id=0), 1.0),
    "llama-llama3": ("LlamaConfig", dict(head_dim=16, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), 1.0),
    "phi3-longrope": ("Phi3Config", dict(
        original_max_position_embeddings=16, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [round(1.0 + 0.02 * i, 2) for i in range(HALF)],
                         "long_factor": [1.0 + 0.5 * i for i in range(HALF)]}), 1.0),
}
BATCH = prompts(5, lens=(21, 7))
NEW_TOKENS = 8
#: Engine settings of every run: chunked prefill, and a pool of 64 blocks (the default budget
#: takes seconds to allocate, and these runs hold 12 blocks).
SETTINGS = dict(max_num_batched_tokens=16, enable_prefix_caching=False, num_kv_blocks=64)


def hf_config(model: str):
    import transformers

    cls, settings, _ = MODELS[model]
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    return getattr(transformers, cls)(**{**base, **settings})


def permute_rotary_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K permutation: each head's halves (i, i + d/2) become
    interleaved pairs (2i, 2i + 1)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_metadata(writer, arch: str, cfg: dict) -> None:
    """The hyper-parameters llama.cpp's converter writes for `arch`."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' rotary
    if arch != "gemma2":
        writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if "head_dim" in cfg and arch != "phi3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if arch == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if arch in ("gemma2", "gemma3"):
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        writer.add_sliding_window(cfg.get("sliding_window") or 0)


def write_tokenizer(writer, path: str, vocab_size: int) -> None:
    """The tiny byte-level BPE tokenizer of `path` as GGUF "gpt2" tokenizer metadata, padded
    to `vocab_size` with unused `[PAD<id>]` tokens as the converter pads it."""
    import gguf

    with open(os.path.join(path, "tokenizer.json")) as f:
        model = json.load(f)["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    kinds = [gguf.TokenType.CONTROL if i < 3 else gguf.TokenType.NORMAL
             for i in range(len(tokens))]
    kinds += [gguf.TokenType.UNUSED] * (vocab_size - len(tokens))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_gguf(hf_dir: str, arch: str, qtype: str = "F32") -> str:
    """`hf_dir`'s checkpoint as `<hf_dir>/model.<qtype>.gguf`, converted as llama.cpp does;
    matrices in `qtype` ("F32" or "Q8_0"), norms and vectors in F32."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    path = os.path.join(hf_dir, f"model.{qtype}.gguf")
    writer = gguf.GGUFWriter(path, arch)
    write_metadata(writer, arch, cfg)
    write_tokenizer(writer, hf_dir, cfg["vocab_size"])
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()),
                                     cfg["num_hidden_layers"])
    kv_heads = cfg["num_key_value_heads"]
    for name, tensor in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if arch.startswith("gemma") and name == "lm_head.weight":
            continue  # tied; the converter skips it
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1.0  # Gemma's RMSNorm multiplies by 1 + w
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = kv_heads if "k_proj" in name else cfg["num_attention_heads"]
            tensor = permute_rotary_rows(tensor, heads)
        data = tensor.float().numpy()
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new_name is not None, name
        if qtype == "Q8_0" and data.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(new_name, quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(new_name, data)
    rope = cfg.get("rope_parameters") or {}
    if arch == "llama" and rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg, rope))
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        scale = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
        original = cfg["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for key in ("long", "short"):
            writer.add_tensor(f"rope_factors_{key}.weight",
                              np.array(rope[f"{key}_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_freqs(cfg: dict, rope: dict) -> np.ndarray:
    """The divisor of each rotary frequency that llama.cpp's converter stores for Llama 3's
    scaling: 1 for wavelengths under `original / high_freq_factor`, `factor` over `original /
    low_freq_factor`, between them the reciprocal of the interpolated multiplier."""
    head_dim = cfg["head_dim"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    assert 1.0 in divisors and factor in divisors and len(set(divisors)) > 2  # three bands
    return np.array(divisors, dtype=np.float32)


@pytest.fixture(scope="module", params=sorted(MODELS))
def converted(request, tmp_path_factory) -> tuple[str, str, str]:
    """(model, safetensors directory, F32 GGUF path) of one `MODELS` entry."""
    model = request.param
    hf_dir = write_checkpoint(str(tmp_path_factory.mktemp(model)), hf_config(model),
                              norm_center=MODELS[model][2])
    return model, hf_dir, write_gguf(hf_dir, model.split("-")[0])


def test_gguf_equals_its_safetensors_checkpoint(converted) -> None:
    from engine.model.gguf_reader import gguf_config, gguf_metadata, open_gguf

    _, hf_dir, path = converted
    reader = open_gguf(path)
    with open(os.path.join(hf_dir, "config.json")) as f:
        from_json = config_from_hf(json.load(f))
    want = dataclasses.asdict(from_json)
    got = dataclasses.asdict(gguf_config(gguf_metadata(reader), reader.tensors))
    if want["rope_scaling"] and want["rope_scaling"]["rope_type"] == "llama3":
        # the file states each frequency's divisor, config.json the parameters they come from
        assert_same_rotary(from_json, got["rope_scaling"])
        want["rope_scaling"] = got["rope_scaling"]
    if want["rope_scaling"] and want["rope_scaling"]["rope_type"] == "longrope":
        # the file states LongRoPE's attention factor, config.json the factor it comes from
        factor = want["rope_scaling"].pop("factor")
        scaling = got["rope_scaling"]
        assert scaling.pop("factor") == factor
        original = scaling["original_max_position_embeddings"]
        assert math.isclose(scaling.pop("attention_factor"),
                            math.sqrt(1 + math.log(factor) / math.log(original)), rel_tol=1e-6)
    assert got == want
    from_gguf, _ = engine_greedy(path, BATCH, NEW_TOKENS, quantization="none", **SETTINGS)
    from_hf, _ = engine_greedy(hf_dir, BATCH, NEW_TOKENS, **SETTINGS)
    assert from_gguf == from_hf


def assert_same_rotary(config, scaling: dict) -> None:
    """The rotary tables of `config` equal those of its theta with `scaling` (float32 ulps)."""
    from engine.model.rope import RotaryEmbedding

    want = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                           config.max_position_embeddings)
    got = RotaryEmbedding(config.head_dim, config.rope_theta, scaling,
                          config.max_position_embeddings)
    assert scaling["rope_type"] == "freq_factors"
    torch.testing.assert_close(got.cos, want.cos, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.sin, want.sin, rtol=0, atol=1e-5)


def test_phi3_q8_0_runs_on_its_fused_blocks(tmp_path) -> None:
    """Phi-3's fused `attn_qkv` and `ffn_up` Q8_0 tensors become the layers' `qkv_proj` and
    `gate_up_proj` blocks, and decode on them continues as the dense load of the same file."""
    from engine.model.quant import QuantizedWeight

    hf_dir = write_checkpoint(str(tmp_path), hf_config("phi3"))
    path = write_gguf(hf_dir, "phi3", "Q8_0")
    blocks, engine = engine_greedy(path, BATCH, NEW_TOKENS, quantization="gguf", **SETTINGS)
    for name in ("qkv_proj", "gate_up_proj", "o_proj", "down_proj"):
        weight = getattr(engine.loaded.model.layers[0], name)
        assert isinstance(weight, QuantizedWeight) and weight.blocks.qtype == "Q8_0", name
    dense, _ = engine_greedy(path, BATCH, NEW_TOKENS, quantization="none", **SETTINGS)
    assert blocks == dense


def test_gguf_refuses_what_it_cannot_read() -> None:
    from engine.model.gguf_reader import gguf_config

    meta = {"general.architecture": "llama", "llama.attention.head_count": 4,
            "llama.embedding_length": 64, "llama.feed_forward_length": 96,
            "llama.block_count": 2, "llama.vocab_size": 300}
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_config({**meta, "llama.rope.scaling.type": "linear"}, ["rope_freqs.weight"])
    with pytest.raises(ValueError, match="general.architecture 'falcon'"):
        gguf_config({**meta, "general.architecture": "falcon"}, [])
    with pytest.raises(ValueError, match="rope.dimension_count"):
        gguf_config({**meta, "llama.rope.dimension_count": 8}, [])
    assert np.isclose(gguf_config(meta, []).rope_theta, 10000.0)
