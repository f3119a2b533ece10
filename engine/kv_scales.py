"""The KV cache's storage type and the per-layer, per-KV-head scales of an 8-bit cache.

`kv_cache_dtype(name, model_dtype)` maps the engine's setting (vLLM's names) to the cache tensor's
dtype. An 8-bit cache stores `q = convert(x / scale[kv_head])` and attention reads
`q * scale[kv_head]` (docs/abi.md); `LayerKVScales` holds one layer's `k_scale` and `v_scale`,
float32 `[num_kv_heads]` on the cache's device, where they come from, in this order:

1. the model file (`DecoderForCausalLM.kv_scales_from_file`, read from a Hugging Face checkpoint's
   `self_attn.k_scale` / `v_scale` tensors), for fp8 caches: such scales map the layer's
   largest value to e4m3's 448, beyond int8's range, so an int8 cache calibrates instead;
2. calibration (`calculate_kv_scales`, on by default): the engine runs one calibration prompt
   when it is built (`calibration_prompt_ids`: a chat rendered by the model's template, with
   prose, code and numbers, cut to what one step and the KV pool hold), so the scales depend
   neither on the first client's prompt nor on a server's warm-up request. At that first
   forward step, before its K/V are written, `scale[h] = amax(|x[:, h, :]|) / format_max`, per
   layer and KV head, over the step's tokens (after rotary for K); format_max is 448 for e4m3,
   57344 for e5m2 and 127 for int8 (symmetric). The scales are then fixed: a later prompt with
   larger values saturates (fp8 to +-format_max, int8 to [-128, 127]). vLLM's on-the-fly
   calibration differs: one scale per tensor, on the first batch, amax over fixed constants
   (200 for K, 100 for V) that leave headroom;
3. 1.0 for fp8 (calibration off and no scales in the file); an int8 cache needs scales from 1
   or 2 (ValueError).

A head whose calibration amax is 0 (or not finite) keeps the scale 1.0. The calibration runs
on the device without reading any value back (no synchronisation).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

__all__ = ["KV_CACHE_DTYPES", "FORMAT_MAX", "LayerKVScales", "kv_cache_dtype", "is_quantized",
           "file_scales_from", "make_kv_scales", "calibration_prompt_ids"]

#: The engine's `kv_cache_dtype` names (vLLM's, plus "int8") -> the cache dtype (None: the
#: model's dtype). "fp8" is e4m3, as in vLLM.
KV_CACHE_DTYPES: dict[str, Optional[torch.dtype]] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}

#: The largest magnitude a scaled value may take in each 8-bit format (int8: symmetric).
FORMAT_MAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
    torch.int8: 127.0,
}

#: One layer's file scales: (k_scale, v_scale), float32 `[num_kv_heads]`.
FileScales = tuple[torch.Tensor, torch.Tensor]


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for the setting `name` (a key of KV_CACHE_DTYPES)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of {tuple(KV_CACHE_DTYPES)}, got "
                         f"{name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` is 8-bit (needs scales)."""
    return dtype in FORMAT_MAX


class LayerKVScales:
    """One layer's `k_scale` and `v_scale` (float32 `[num_kv_heads]`), calibrated at the first
    `for_step` call when `pending` (see the module docstring). `source` says where the values
    come from: "file", "calibration" (still pending until the first step) or "default"."""

    __slots__ = ("k_scale", "v_scale", "pending", "source", "format_max")

    def __init__(self, k_scale: torch.Tensor, v_scale: torch.Tensor, source: str,
                 format_max: float) -> None:
        self.k_scale = k_scale
        self.v_scale = v_scale
        self.source = source
        self.pending = source == "calibration"
        self.format_max = format_max

    def for_step(self, key: torch.Tensor, value: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales to write `key`/`value` (`[num_tokens, num_kv_heads, head_size]`) with,
        calibrated from them first when pending."""
        if self.pending and key.shape[0]:
            self.k_scale.copy_(self._calibrate(key))
            self.v_scale.copy_(self._calibrate(value))
            self.pending = False
        return self.k_scale, self.v_scale

    def _calibrate(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.detach().abs().amax(dim=(0, 2)).float()
        usable = (amax > 0) & torch.isfinite(amax)
        return torch.where(usable, amax / self.format_max, torch.ones_like(amax))


def file_scales_from(found: dict[int, dict[str, torch.Tensor]], num_layers: int,
                     num_kv_heads: int) -> Optional[list[FileScales]]:
    """The per-layer `(k_scale, v_scale)` of a checkpoint, from `found[layer]["k" | "v"]`
    tensors of one element or `num_kv_heads` elements; None when it has none. ValueError when
    some layer lacks one, or for a wrong size or a non-positive or non-finite value."""
    if not found:
        return None
    result = []
    for layer in range(num_layers):
        pair = []
        for which in ("k", "v"):
            name = f"layer {layer} {which}_scale"
            tensor = found.get(layer, {}).get(which)
            if tensor is None:
                raise ValueError(f"weights: expected a {which}_scale for every layer once one "
                                 f"is present, got none for layer {layer}")
            values = tensor.detach().float().reshape(-1).cpu()
            if values.numel() not in (1, num_kv_heads):
                raise ValueError(f"weights: expected {name} of 1 or {num_kv_heads} elements, "
                                 f"got shape {tuple(tensor.shape)}")
            if not bool(torch.isfinite(values).all() and (values > 0).all()):
                raise ValueError(f"weights: expected {name} finite and > 0, got "
                                 f"{values.tolist()}")
            pair.append(values)
        result.append((pair[0], pair[1]))
    return result


def make_kv_scales(cache_dtype: torch.dtype, num_layers: int, num_kv_heads: int,
                   device: Union[str, torch.device],
                   file_scales: Optional[Sequence[FileScales]] = None,
                   calculate_kv_scales: bool = True) -> Optional[list[LayerKVScales]]:
    """Each layer's scales for a cache of `cache_dtype` (None for a float cache), chosen as the
    module docstring says. ValueError for an int8 cache with calibration off."""
    if not is_quantized(cache_dtype):
        return None
    fmax = FORMAT_MAX[cache_dtype]
    use_file = file_scales is not None and cache_dtype != torch.int8
    if not use_file and not calculate_kv_scales and cache_dtype == torch.int8:
        raise ValueError("calculate_kv_scales: expected True for kv_cache_dtype 'int8' (an int8 "
                         "cache has no usable default scale; calibration or scales from the "
                         "model file are needed), got False")
    source = "file" if use_file else ("calibration" if calculate_kv_scales else "default")
    scales = []
    for layer in range(num_layers):
        if use_file:
            k, v = file_scales[layer]  # type: ignore[index]
            k = k.to(device=device, dtype=torch.float32).expand(num_kv_heads).contiguous()
            v = v.to(device=device, dtype=torch.float32).expand(num_kv_heads).contiguous()
        else:
            k = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
            v = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
        scales.append(LayerKVScales(k, v, source, fmax))
    return scales


#: The calibration conversation: what a served model sees (a system prompt, questions, prose,
#: code, numbers and punctuation), rendered by the model's chat template when it has one.
CALIBRATION_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Answer clearly and briefly."},
    {"role": "user", "content": "What is the capital of France, and how many people live there? "
                                "Also write a Python function that returns the n-th Fibonacci "
                                "number."},
    {"role": "assistant", "content": (
        "The capital of France is Paris. About 2.1 million people live in the city itself and "
        "roughly 12 million in its metropolitan area (2023 estimates).\n\n```python\n"
        "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n"
        "        a, b = b, a + b\n    return a\n```\n\nFor example, fibonacci(10) == 55. The "
        "loop runs in O(n) time and O(1) memory.")},
    {"role": "user", "content": "Thanks! Summarise the history of the printing press in three "
                                "sentences, then list 3 prime numbers above 100."},
    {"role": "assistant", "content": (
        "Johannes Gutenberg built a movable-type printing press in Mainz around 1440. Printed "
        "books spread quickly across Europe: by 1500 presses in more than 200 cities had "
        "produced millions of copies. Cheap books fed the Renaissance, the Reformation and "
        "the Scientific Revolution.\n\nThree primes above 100: 101, 103 and 107.")},
]


def calibration_prompt_ids(tokenizer: Any, max_tokens: int) -> list[int]:
    """The token ids of `CALIBRATION_MESSAGES` (rendered by `tokenizer`'s chat template, or
    joined as plain text when it has none), cut to at most `max_tokens` (>= 1)."""
    try:
        text = tokenizer.apply_chat_template(CALIBRATION_MESSAGES, add_generation_prompt=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
    except ValueError:  # no chat template
        text = "\n\n".join(m["content"] for m in CALIBRATION_MESSAGES)
        ids = tokenizer.encode(text, add_special_tokens=True)
    return list(ids[:max(1, max_tokens)])
