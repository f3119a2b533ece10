"""A GGUF file's metadata as the Hugging Face config.json it stands for, read by the model
families (engine/model/families/) like any other config.

llama.cpp's converter writes a model's hyper-parameters under `<architecture>.<key>`
(`llama.block_count`, ...) and leaves out what its runtime fixes per architecture; this module
writes them back under Hugging Face's names and puts in what llama.cpp assumes:
- `gemma2` / `gemma3`: the softmax scale is `head_dim ** -0.5` (`hidden_size / heads` for the
  27B models, told apart by their layer count) unless the file has `attention.scale`; Gemma 2's
  layers alternate sliding and global, Gemma 3's every 6th layer is global unless the file
  has `attention.sliding_window_pattern`; Gemma 3's local layers use base 10000 unless the file
  has `rope.freq_base_swa`.
- `phi3`: a `sliding_window` of 0 means none; LongRoPE's factors are the tensors
  `rope_factors_long` / `rope_factors_short`, its attention factor `rope.scaling.attn_factor`.
- Llama 3's rotary scaling, which the converter stores as the tensor `rope_freqs` (a divisor of
  each frequency) rather than as parameters, is the rotary scaling `freq_factors`
  (engine/model/rope.py).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from engine.model.config import DecoderConfig
from engine.model.families import config_from_hf

__all__ = ["HF_ARCHITECTURES", "architecture_of", "gguf_config", "hf_config_dict"]

#: GGUF `general.architecture` -> (Hugging Face `architectures` entry, `model_type`).
HF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}
#: Layer counts of the Gemma 27B models, whose softmax scale llama.cpp takes from
#: `hidden_size / heads` rather than from the head size.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def architecture_of(meta: dict[str, Any]) -> str:
    """The file's `general.architecture`; ValueError naming it when no family reads it."""
    arch = meta.get("general.architecture")
    if arch not in HF_ARCHITECTURES:
        raise ValueError(f"model: GGUF general.architecture {arch!r} is not supported; "
                         f"expected one of {sorted(HF_ARCHITECTURES)}")
    return arch


def gguf_config(meta: dict[str, Any], tensors: Iterable[Any]) -> DecoderConfig:
    """The `DecoderConfig` of a GGUF file: `hf_config_dict` read by its family."""
    return config_from_hf(hf_config_dict(meta, tensors))


def hf_config_dict(meta: dict[str, Any], tensors: Iterable[Any]) -> dict[str, Any]:
    """The Hugging Face config.json dict a GGUF's metadata `meta` stands for. `tensors`: the
    file's tensors (`GGUFReader.tensors`, with `name` and `data`) or only their names, which
    do unless the config reads a tensor (Phi-3's LongRoPE factors). ValueError naming the key
    that is missing or not supported."""
    arch = architecture_of(meta)
    by_name = {getattr(t, "name", t): t for t in tensors}
    raw = _common_fields(meta, arch, by_name)
    _ARCH_FIELDS.get(arch, lambda *_: None)(raw, meta, arch, by_name)
    return raw


def _common_fields(meta: dict[str, Any], arch: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """What every architecture writes the same way: sizes, norm epsilon, rotary base and
    scaling, context length, tied output, special tokens."""
    heads = _uniform(meta, f"{arch}.attention.head_count", required=True)
    hidden = int(_need(meta, f"{arch}.embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    hf_arch, model_type = HF_ARCHITECTURES[arch]
    raw = dict(
        architectures=[hf_arch], model_type=model_type,
        vocab_size=int(meta.get(f"{arch}.vocab_size",
                                len(meta.get("tokenizer.ggml.tokens", ())))),
        hidden_size=hidden, intermediate_size=int(_need(meta, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_need(meta, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=_uniform(meta, f"{arch}.attention.head_count_kv") or heads,
        head_dim=head_dim,
        rms_norm_eps=_decimal(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_decimal(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch, tensors),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"))
    rotary_dims = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary_dims != head_dim:
        if arch != "phi3":
            raise ValueError(f"model: GGUF {arch}.rope.dimension_count={rotary_dims} (rotary "
                             f"over part of each head of {head_dim}) is not supported")
        raw["partial_rotary_factor"] = rotary_dims / head_dim
    return raw


def _decimal(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (the converter was
    given 1e-05, the file holds 9.99999975e-06): what config.json said, as far as float32
    tells."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _need(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ValueError(f"model: GGUF metadata lacks {key!r}")
    return meta[key]


def _uniform(meta: dict[str, Any], key: str, required: bool = False) -> Any:
    """An int setting that GGUF may also write per layer (a list): the one value, None when
    absent and not `required`; ValueError naming `key` when the layers differ."""
    value = _need(meta, key) if required else meta.get(key)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"model: GGUF {key}={value} (a different value per layer) is not "
                             "supported")
        value = value[0]
    return None if value is None else int(value)


def _rope_scaling(meta: dict[str, Any], arch: str,
                  tensors: dict[str, Any]) -> dict[str, Any] | None:
    """The rotary scaling the metadata states, as Hugging Face writes it."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:  # Llama 3's scaling, as the converter stores it
        if kind not in (None, "none"):
            raise ValueError(f"model: GGUF tensor 'rope_freqs' with {arch}.rope.scaling.type="
                             f"{kind!r} is not supported; expected one of them")
        return {"rope_type": "freq_factors",
                "freq_factors": _factors(tensors["rope_freqs.weight"], "rope_freqs.weight")}
    if kind in (None, "none"):
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear",
                "factor": _decimal(_need(meta, f"{arch}.rope.scaling.factor"))}
    if kind == "yarn" and factor is not None:
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": _decimal(factor),
                "original_max_position_embeddings": original}
    raise ValueError(f"model: GGUF {arch}.rope.scaling.type={kind!r} is not supported; expected "
                     "'none', 'linear' or 'yarn'")


def _flag_tensor(name: str) -> Callable[[dict[str, Any], dict[str, Any], str, dict[str, Any]],
                                        None]:
    """Fields setter: `attention_bias` when layer 0 has the tensor `name`."""
    def fields(raw: dict[str, Any], meta: dict[str, Any], arch: str,
               tensors: dict[str, Any]) -> None:
        raw["attention_bias"] = name in tensors
        if arch == "llama":
            raw["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    return fields


def _gemma_fields(raw: dict[str, Any], meta: dict[str, Any], arch: str,
                  tensors: dict[str, Any]) -> None:
    """Gemma 2 / 3: GeGLU, the softmax scale, soft caps, sliding window and layer pattern,
    Gemma 3's local rotary base."""
    raw["hidden_activation"] = "gelu_pytorch_tanh"
    scale = meta.get(f"{arch}.attention.scale")
    if scale is not None:
        raw["query_pre_attn_scalar"] = _decimal(scale) ** -2
    elif raw["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]:
        raw["query_pre_attn_scalar"] = raw["hidden_size"] // raw["num_attention_heads"]
    else:
        raw["query_pre_attn_scalar"] = raw["head_dim"]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"{arch}.{key}" in meta:  # absent: the family's default, which is llama.cpp's
            raw[key] = _decimal(meta[f"{arch}.{key}"])
    if arch == "gemma3":
        raw["attn_logit_softcapping"] = None
        raw["rope_local_base_freq"] = _decimal(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is not None:
        raw["sliding_window"] = int(window)
    raw["layer_types"] = _gemma_layer_types(meta, arch, raw["num_hidden_layers"],
                                            window is not None or arch == "gemma2")


def _gemma_layer_types(meta: dict[str, Any], arch: str, layers: int,
                       sliding: bool) -> list[str]:
    """Each layer's kind: from `attention.sliding_window_pattern` (every n-th layer global, or a
    per-layer list with true for sliding), else llama.cpp's pattern for the architecture
    (2 for Gemma 2, 6 for Gemma 3); all global when the file has no sliding window (Gemma 3)."""
    if not sliding:
        return ["full_attention"] * layers
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern",
                       2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"model: GGUF {arch}.attention.sliding_window_pattern: expected "
                             f"{layers} entries, got {len(pattern)}")
        return ["sliding_attention" if s else "full_attention" for s in pattern]
    return ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
            for i in range(layers)]


def _phi3_fields(raw: dict[str, Any], meta: dict[str, Any], arch: str,
                 tensors: dict[str, Any]) -> None:
    """Phi-3: sliding window (0: none), the pretraining context, LongRoPE's factors."""
    raw["sliding_window"] = int(meta.get(f"{arch}.attention.sliding_window", 0)) or None
    raw["original_max_position_embeddings"] = int(meta.get(
        f"{arch}.rope.scaling.original_context_length", raw["max_position_embeddings"]))
    names = ("rope_factors_long.weight", "rope_factors_short.weight")
    if not any(name in tensors for name in names):
        return
    if raw["rope_scaling"] is not None or not all(name in tensors for name in names):
        raise ValueError(f"model: GGUF expected both of {list(names)} and no "
                         f"{arch}.rope.scaling.type for LongRoPE, got tensors "
                         f"{[n for n in names if n in tensors]}, type {raw['rope_scaling']}")
    long, short = (_factors(tensors[name], name) for name in names)
    raw["rope_scaling"] = {"rope_type": "longrope", "long_factor": long, "short_factor": short}
    if f"{arch}.rope.scaling.attn_factor" in meta:
        raw["rope_scaling"]["attention_factor"] = _decimal(meta[f"{arch}.rope.scaling.attn_factor"])


def _factors(tensor: Any, name: str) -> list[float]:
    if not hasattr(tensor, "data"):
        raise ValueError(f"tensors: expected the file's tensors (with data) to read {name!r}, "
                         "got only names")
    return [_decimal(x) for x in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]


_ARCH_FIELDS: dict[str, Callable[[dict[str, Any], dict[str, Any], str, dict[str, Any]],
                                 None]] = {
    "llama": _flag_tensor("blk.0.attn_q.bias"),
    "qwen3": _flag_tensor("blk.0.attn_q.bias"),
    "gemma2": _gemma_fields,
    "gemma3": _gemma_fields,
    "phi3": _phi3_fields,
}
