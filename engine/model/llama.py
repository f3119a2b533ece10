"""A Llama-architecture decoder whose attention runs on a paged KV cache.

RMSNorm, rotary embeddings (rotate-half convention, as Hugging Face's Llama), grouped-query
attention through `paged_kernels.attention`, SwiGLU MLP, tied or separate output embedding.

For speed on a CPU the projections are fused (one `qkv_proj` and one `gate_up_proj` matmul per
layer) and, once loaded, packed in oneDNN's layout (`pack_weights`); the element-wise ops
(RMSNorm fused with the previous residual add, rotary in place from the float32 tables, SiLU * up)
are one fused call each on CPU tensors (`layer_ops`); the forward never synchronises (no
`.item()`); the attention metadata is built once per step by the caller and checked once per
forward (`paged_kernels.attention.plan`), then each layer runs the plan on its own caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_scales import LayerKVScales, file_scales_from
from engine.model import layer_ops
from engine.model.checkpoint_names import KV_SCALE_TENSORS, LAYER_TENSORS
from engine.model.metadata import AttentionMetadata
from engine.model.quant import QuantizedWeight, quantized_linear
from engine.model.quant_int8 import int8_linear
from paged_kernels.attention import AttentionPlan, plan

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class LlamaConfig:
    """The architecture hyper-parameters (Hugging Face's `LlamaConfig` names).

    `head_dim` defaults to `hidden_size // num_attention_heads`. `eos_token_id` may be one id or a
    list of ids (some chat models stop on several).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Union[int, list[int], None] = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: expected a divisor of num_attention_heads="
                             f"{self.num_attention_heads}, got {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even size (rotary pairs), got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: expected a float > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: expected a float > 0, got {self.rope_theta!r}")

    @property
    def eos_token_ids(self) -> list[int]:
        """`eos_token_id` as a list (empty when unset)."""
        return self.eos_ids_of(self.eos_token_id)

    @staticmethod
    def eos_ids_of(value: Union[int, list[int], None]) -> list[int]:
        """An `eos_token_id` setting (None, one id or a list) as a list."""
        if value is None:
            return []
        if isinstance(value, int):
            return [value]
        return list(value)


def _rotary_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and signed sin `[max_position_embeddings, head_dim]`: `cos` repeated over both
    halves, `sin` negated in the first half, so that rotating is `x * cos + swap_halves(x) * sin`.
    Angles are computed the way Hugging Face computes them (float32 inverse frequencies times
    float32 positions), so the tables match its values exactly."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float()
                                            / dim))
    positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    sin = angles.sin()
    sin[:, :dim // 2].neg_()
    return angles.cos(), sin


def _linear(x: torch.Tensor, weight: Union[torch.Tensor, QuantizedWeight]) -> torch.Tensor:
    """`x @ weight.T`: with int8 activations when a `QuantizedWeight` has int8 tiles
    (engine/model/quant_int8.py), from its GGUF blocks when `x` has few rows
    (engine/model/quant.py), else through oneDNN directly when the weight was packed by
    `pack_weights`."""
    if isinstance(weight, QuantizedWeight):
        if weight.int8 is not None:
            return int8_linear(x, weight.int8)
        if weight.use_blocks(x):
            return quantized_linear(x, weight.blocks)
        weight = weight.dense
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def _pack(module: nn.Module, name: str) -> bool:
    """Replaces the weight `module.<name>` by a oneDNN-packed copy; False when not possible."""
    weight = getattr(module, name)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    module._parameters.pop(name, None)
    setattr(module, name, packed)
    return True


#: The step's positions (int64 `[T]`) and the float32 cos / signed sin tables of `_rotary_tables`.
Rotary = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block: attention over the paged cache, then the SwiGLU MLP."""

    def __init__(self, config: LlamaConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.eps = config.rms_norm_eps
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * d

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device),
                                requires_grad=False)

        self.input_layernorm = param(h)
        self.qkv_proj = param(qkv_rows, h)
        self.o_proj = param(h, self.num_heads * d)
        self.post_attention_layernorm = param(h)
        self.gate_up_proj = param(2 * config.intermediate_size, h)
        self.down_proj = param(h, config.intermediate_size)

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], rotary: Rotary,
                kv_cache: KVCache, attn: AttentionPlan,
                kv_scales: Optional[LayerKVScales] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden` `[T, hidden_size]` is the previous block's output before its residual add,
        `residual` the residual stream (None for the first block, whose `hidden` is the
        embeddings). Returns `(output, residual)` the same way (the residual is updated in
        place, so each add is fused with the next norm); writes this step's K/V to `kv_cache`
        at the plan's slots, with `kv_scales` for an 8-bit cache (None for a float one)."""
        if residual is None:
            residual = hidden
            x = layer_ops.rms_norm(hidden, self.input_layernorm, self.eps)
        else:
            x = layer_ops.add_rms_norm_(residual, hidden, self.input_layernorm, self.eps)
        x = layer_ops.add_rms_norm_(residual,
                                    self._attention(x, rotary, kv_cache, attn, kv_scales),
                                    self.post_attention_layernorm, self.eps)
        gate_up = _linear(x, self.gate_up_proj)
        return _linear(layer_ops.silu_mul(gate_up), self.down_proj), residual

    def _attention(self, x: torch.Tensor, rotary: Rotary, kv_cache: KVCache,
                   attn: AttentionPlan, kv_scales: Optional[LayerKVScales]) -> torch.Tensor:
        num_tokens, nh, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = _linear(x, self.qkv_proj).view(num_tokens, -1, self.head_dim)
        layer_ops.rotary_(qkv, nh + nkv, *rotary)  # q and k, in place (qkv is ours)
        # strided row views: write_kv honours any strides with a contiguous last dimension
        key, value = qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]
        k_cache, v_cache = kv_cache
        if kv_scales is not None:
            # the plan reads its scale tensors at every call: load this layer's into them
            k_scale, v_scale = kv_scales.for_step(key, value)
            attn.k_scale.copy_(k_scale)
            attn.v_scale.copy_(v_scale)
        attn.write_kv(key, value, k_cache, v_cache)
        out = attn.run(qkv[:, :nh], k_cache, v_cache)
        return _linear(out.reshape(num_tokens, -1), self.o_proj)


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus the output head. Parameters are created uninitialised; fill them
    with `load_weights` (Hugging Face tensor names) before use."""

    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.float32,
                 device: Union[str, torch.device] = "cpu") -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.packed = False
        #: The checkpoint's KV cache scales, `(k_scale, v_scale)` per layer (float32, one
        #: element or `[num_kv_heads]`), or None; set by `load_weights`.
        self.kv_scales_from_file: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype, device)
                                    for _ in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype, device=device),
                                 requires_grad=False)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Parameter(torch.empty_like(self.embed_tokens), requires_grad=False)
        cos, sin = _rotary_tables(config)
        self.register_buffer("rotary_cos", cos.to(device), persistent=False)
        self.register_buffer("rotary_sin", sin.to(device), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                kv_scales: Optional[list[LayerKVScales]] = None) -> torch.Tensor:
        """Runs `input_ids` (int64 `[T]`) at `positions` (int64 `[T]`, each
        `< max_position_embeddings`) through every layer; `kv_caches[i]` is layer `i`'s
        `(key_cache, value_cache)`, each `[num_blocks, num_kv_heads, block_size, head_dim]` in
        the model dtype or an 8-bit one, whose scales are `kv_scales[i]` (engine/kv_scales.py;
        pending ones are calibrated on this step's K/V). Returns the final-normed hidden states
        `[T, hidden_size]`; pass the rows that need logits to `compute_logits`."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches: expected {len(self.layers)} (key, value) pairs, one "
                             f"per layer, got {len(kv_caches)}")
        if kv_scales is not None and len(kv_scales) != len(self.layers):
            raise ValueError(f"kv_scales: expected {len(self.layers)} LayerKVScales, one per "
                             f"layer, got {len(kv_scales)}")
        rotary = (positions, self.rotary_cos, self.rotary_sin)
        attn = self.plan_attention(meta, input_ids.shape[0], kv_caches[0][0],
                                   kv_scales is not None)
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual = None
        scales = kv_scales or [None] * len(self.layers)
        for layer, kv_cache, layer_scales in zip(self.layers, kv_caches, scales):
            # .forward: no module hooks are used, and nn.Module.__call__ costs ~3 us a layer
            hidden, residual = layer.forward(hidden, residual, rotary, kv_cache, attn,
                                             layer_scales)
        return layer_ops.add_rms_norm_(residual, hidden, self.norm, self.config.rms_norm_eps)

    def plan_attention(self, meta: AttentionMetadata, num_tokens: int,
                       key_cache: torch.Tensor, quantized: bool = False) -> AttentionPlan:
        """The step's attention plan (metadata checked once, run by every layer); `key_cache` is
        any layer's (all layers' caches have one shape and dtype). For an 8-bit cache
        (`quantized`) the plan gets its own float32 `[num_kv_heads]` scale tensors, which
        each layer fills with its scales before its calls."""
        c = self.config
        scales = {}
        if quantized:
            ones = torch.ones(c.num_key_value_heads, dtype=torch.float32,
                              device=key_cache.device)
            scales = {"k_scale": ones, "v_scale": ones.clone()}
        return plan(meta.block_tables, meta.seq_lens, cu_seqlens_q=meta.cu_seqlens_q,
                    slot_mapping=meta.slot_mapping, num_tokens=num_tokens,
                    num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                    head_size=c.head_dim, block_size=key_cache.shape[2],
                    num_blocks=key_cache.shape[0], dtype=self.dtype,
                    kv_cache_dtype=key_cache.dtype, backend=meta.backend, **scales)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits `[N, vocab_size]` for final hidden states `[N, hidden_size]`."""
        return _linear(hidden, self.lm_head).float()

    @torch.no_grad()
    def pack_weights(self) -> bool:
        """For CPU inference: re-lays every projection weight (and the output head) out in
        oneDNN's blocked format, which makes each matmul about 1.3-2x faster on a CPU (the
        weight is no longer re-packed at every call). Same results in bfloat16; float32
        accumulates in a different order (differences of ~1e-6 relative). After this the model
        cannot load weights or move devices. Returns False (and changes nothing) when the
        model is not on a CPU or oneDNN is unavailable."""
        if self.packed:
            return True
        if self.embed_tokens.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        targets = [(layer, name) for layer in self.layers
                   for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
        if not _pack(self, "lm_head"):
            return False
        for module, name in targets:
            ok = _pack(module, name)
            assert ok, "oneDNN packed the output head but not a layer weight"
        self.packed = True
        return True

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies tensors named as in a Hugging Face Llama checkpoint (`model.layers.0.self_attn.
        q_proj.weight`, ...) into the fused parameters, converting to the model dtype.

        Raises ValueError for an unknown name or a wrong shape, and when a parameter is left
        unloaded (`lm_head.weight` is optional when the embedding is tied). KV cache scales
        (`self_attn.k_scale` / `v_scale` / `kv_scale`) go to `kv_scales_from_file`.
        """
        if self.packed:
            raise RuntimeError("load_weights: the weights were packed for inference "
                               "(pack_weights); load into a fresh model")
        loaded: set[str] = set()
        found_scales: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            if self._kv_scale(name, tensor, found_scales):
                continue
            target, rows = self._locate(name)
            if target is None:
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer some checkpoints carry; recomputed from rope_theta
                raise ValueError(f"weights: unexpected tensor {name!r} for a Llama model")
            dest = target if rows is None else target[rows[0]:rows[1]]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"weights: expected {name!r} of shape {tuple(dest.shape)}, got "
                                 f"{tuple(tensor.shape)}")
            dest.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(self._expected_names()) - loaded)
        if missing:
            raise ValueError(f"weights: missing tensors {missing[:6]}"
                             f"{' ...' if len(missing) > 6 else ''} ({len(missing)} in all)")
        c = self.config
        self.kv_scales_from_file = file_scales_from(found_scales, c.num_hidden_layers,
                                                    c.num_key_value_heads)

    def _kv_scale(self, name: str, tensor: torch.Tensor,
                  found: dict[int, dict[str, torch.Tensor]]) -> bool:
        """Records a KV cache scale tensor (`model.layers.N.self_attn.k_scale`, ...) in
        `found[N]`; False for any other name."""
        parts = name.split(".")
        key = ".".join(parts[3:])
        if (len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit()
                or key not in KV_SCALE_TENSORS or int(parts[2]) >= len(self.layers)):
            return False
        for which in KV_SCALE_TENSORS[key]:
            found.setdefault(int(parts[2]), {})[which] = tensor
        return True

    def _expected_names(self) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(len(self.layers)):
            p = f"model.layers.{i}."
            names += [p + s + ".weight" for s in LAYER_TENSORS]
        return names

    def _locate(self, name: str) -> tuple[Optional[torch.Tensor], Optional[tuple[int, int]]]:
        """The parameter a checkpoint tensor goes to, and its row range inside a fused one."""
        if name == "model.embed_tokens.weight":
            return self.embed_tokens, None
        if name == "model.norm.weight":
            return self.norm, None
        if name == "lm_head.weight":
            if self.config.tie_word_embeddings:
                return None, None
            return self.lm_head, None
        parts = name.split(".")
        if (len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit()
                or parts[-1] != "weight" or int(parts[2]) >= len(self.layers)):
            return None, None
        layer = self.layers[int(parts[2])]
        key = ".".join(parts[3:-1])
        if key not in LAYER_TENSORS:
            return None, None
        fused, index = LAYER_TENSORS[key]
        target = getattr(layer, fused)
        if index is None:
            return target, None
        return target, self._row_range(fused, index)

    def _row_range(self, fused: str, index: int) -> tuple[int, int]:
        c = self.config
        if fused == "gate_up_proj":
            sizes = [c.intermediate_size, c.intermediate_size]
        else:
            sizes = [c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                     c.num_key_value_heads * c.head_dim]
        start = sum(sizes[:index])
        return start, start + sizes[index]
