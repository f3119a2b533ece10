"""The decoder every family runs (engine/model/families/), its attention on a paged KV cache.

What a `DecoderConfig` describes: RMSNorm (optionally also after attention and around the MLP),
rotary embeddings (rotate-half convention, as Hugging Face's; engine/model/rope.py, one kind per
layer type), grouped-query attention through `paged_kernels.attention` (sliding windows, a logit
soft cap and the softmax scale are the ABI's arguments), optional Q/K/V, output and MLP biases,
optional per-head RMSNorm of Q and K, a SwiGLU or GeGLU MLP, tied or separate output embedding,
and an optional soft cap on the logits.

For speed on a CPU the projections are fused (one `qkv_proj` and one `gate_up_proj` matmul per
layer) and, once loaded, packed in oneDNN's layout (`pack_weights`); the element-wise ops
(RMSNorm fused with the previous residual add, rotary in place from the float32 tables, SiLU * up)
are one fused call each on CPU tensors (`layer_ops`); the forward never synchronises (no
`.item()`); the attention metadata is built once per step by the caller and checked once per
forward and sliding window (`paged_kernels.attention.plan`), then each layer runs its plan on
its own caches. Where the model and the step qualify (a bfloat16 Llama-style model on GGUF tiles,
the cpu backend), `forward` runs every layer in one native call instead
(engine/model/layer_loop.py): the same kernels and bits, without the Python between them.

Under tensor parallelism (`tp`, engine/parallel_state.py) each rank builds and loads only its
shard (engine/model/sharding.py: column-parallel QKV and gate/up, row-parallel output and down
projections each followed by an all-reduce, a vocabulary-parallel output head whose logits are
all-gathered, the embedding and norms replicated); every rank runs `forward` and
`compute_logits` on the same inputs and gets the same full-size results.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_scales import LayerKVScales, file_scales_from
from engine.model import layer_ops
from engine.model.checkpoint_names import KV_SCALE_TENSORS, NORM_PARAMS, layer_tensors
from engine.model.config import DecoderConfig
from engine.model.layer_loop import LayerLoop, build_layer_loop
from engine.model.metadata import AttentionMetadata
from engine.model.quant import QuantizedWeight, quantized_linear
from engine.model.quant_int8 import int8_linear
from engine.model.quant_tiled import tiled_linear
from engine.model.rope import Rotary, RotaryEmbedding
from engine.model.sharding import ModelShard, check_tensor_parallel, take
from engine.parallel_state import SINGLE, TensorParallel
from paged_kernels.attention import AttentionPlan, plan

KVCache = tuple[torch.Tensor, torch.Tensor]
#: The step's attention plan of each sliding window (None: full attention).
Plans = dict[Optional[int], AttentionPlan]

__all__ = ["DecoderForCausalLM", "DecoderLayer", "KVCache", "check_tensor_parallel"]


def _linear(x: torch.Tensor, weight: Union[torch.Tensor, QuantizedWeight],
            bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)`: with int8 activations when a `QuantizedWeight` has int8 tiles
    (engine/model/quant_int8.py), from its GGUF blocks, tiled or in the file's layout, when `x`
    has few rows (engine/model/quant.py, quant_tiled.py), else through oneDNN directly when the
    weight was packed by `pack_weights`."""
    if isinstance(weight, QuantizedWeight):
        out = None
        if weight.int8 is not None:
            out = int8_linear(x, weight.int8)
        elif weight.use_blocks(x):
            out = (tiled_linear(x, weight.blocks) if weight.tiled
                   else quantized_linear(x, weight.blocks))
        if out is not None:
            return out if bias is None else out.add_(bias)
        weight = weight.dense
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


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


class DecoderLayer(nn.Module):
    """One pre-norm block: attention over the paged cache, then the gated MLP (with Gemma's
    extra norms when `sandwich_norm`); this rank's `shard` of it, whose row-parallel outputs are
    summed over `tp`."""

    def __init__(self, config: DecoderConfig, index: int, dtype: torch.dtype,
                 device: torch.device, shard: Optional[ModelShard] = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        shard = ModelShard.of(config) if shard is None else shard
        h, d, inter = config.hidden_size, config.head_dim, shard.local_intermediate_size
        self.tp = tp
        self.num_heads = shard.num_local_heads
        self.num_kv_heads = shard.num_local_kv_heads
        self.head_dim = d
        self.eps = config.rms_norm_eps
        self.window = config.layer_window(index)
        self.layer_type = config.layer_types[index]
        self.sandwich_norm = config.sandwich_norm
        self.act_mul = (layer_ops.silu_mul if config.hidden_act == "silu"
                        else layer_ops.gelu_tanh_mul)
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * d

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device),
                                requires_grad=False)

        def optional(wanted: bool, *shape: int) -> Optional[nn.Parameter]:
            return param(*shape) if wanted else None

        self.input_layernorm = param(h)
        self.qkv_proj = param(qkv_rows, h)
        self.qkv_bias = optional(config.qkv_bias, qkv_rows)
        self.q_norm = optional(config.qk_norm, d)
        self.k_norm = optional(config.qk_norm, d)
        self.o_proj = param(h, self.num_heads * d)
        self.o_bias = optional(config.o_bias, h)
        self.post_attention_layernorm = param(h)
        self.pre_feedforward_layernorm = optional(config.sandwich_norm, h)
        self.post_feedforward_layernorm = optional(config.sandwich_norm, h)
        self.gate_up_proj = param(2 * inter, h)
        self.gate_up_bias = optional(config.mlp_bias, 2 * inter)
        self.down_proj = param(h, inter)
        self.down_bias = optional(config.mlp_bias, h)

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                rotary: dict[str, Rotary], kv_cache: KVCache, plans: Plans,
                kv_scales: Optional[LayerKVScales] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden` `[T, hidden_size]` is the previous block's output before its residual add,
        `residual` the residual stream (None for the first block, whose `hidden` is the
        embeddings). Returns `(output, residual)` the same way (the residual is updated in
        place, so each add is fused with the next norm); writes this step's K/V to `kv_cache`
        at the plans' slots, with `kv_scales` for an 8-bit cache (None for a float one).
        `rotary` and `plans` hold the step's rotary of each layer type and attention plan of
        each sliding window."""
        if residual is None:
            residual = hidden
            x = layer_ops.rms_norm(hidden, self.input_layernorm, self.eps)
        else:
            x = layer_ops.add_rms_norm_(residual, hidden, self.input_layernorm, self.eps)
        attn = self._attention(x, rotary[self.layer_type], kv_cache, plans[self.window],
                               kv_scales)
        if not self.sandwich_norm:
            x = layer_ops.add_rms_norm_(residual, attn, self.post_attention_layernorm, self.eps)
            return self._mlp(x), residual
        attn = layer_ops.rms_norm(attn, self.post_attention_layernorm, self.eps)
        x = layer_ops.add_rms_norm_(residual, attn, self.pre_feedforward_layernorm, self.eps)
        return layer_ops.rms_norm(self._mlp(x), self.post_feedforward_layernorm,
                                  self.eps), residual

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = _linear(x, self.gate_up_proj, self.gate_up_bias)
        return self._row_parallel(self.act_mul(gate_up), self.down_proj, self.down_bias)

    def _row_parallel(self, x: torch.Tensor, weight: Union[torch.Tensor, QuantizedWeight],
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
        """`x @ weight.T + bias` for this rank's input columns `x` and `weight`, summed over the
        ranks; the (replicated) bias is added once, after the sum."""
        if self.tp.size == 1:
            return _linear(x, weight, bias)
        out = self.tp.all_reduce_(_linear(x, weight))
        return out if bias is None else out.add_(bias)

    def _attention(self, x: torch.Tensor, rotary: Rotary, kv_cache: KVCache,
                   attn: AttentionPlan, kv_scales: Optional[LayerKVScales]) -> torch.Tensor:
        num_tokens, nh, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = _linear(x, self.qkv_proj, self.qkv_bias).view(num_tokens, -1, self.head_dim)
        if self.q_norm is not None:
            for heads, weight in ((slice(0, nh), self.q_norm), (slice(nh, nh + nkv), self.k_norm)):
                qkv[:, heads] = F.rms_norm(qkv[:, heads], (self.head_dim,), weight, self.eps)
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
        return self._row_parallel(out.reshape(num_tokens, -1), self.o_proj, self.o_bias)


def sliding_windows(layers: Iterable[DecoderLayer]) -> list[Optional[int]]:
    """The distinct sliding windows of `layers` (None: full attention), full attention first
    then by size: the plans a step makes."""
    return sorted({layer.window for layer in layers}, key=lambda w: -1 if w is None else w)


class DecoderForCausalLM(nn.Module):
    """The decoder stack plus the output head: rank `tp.rank`'s shard of it (the whole model for
    `SINGLE`; engine/model/sharding.py says what a rank holds: its `num_local_heads` query heads
    and `num_local_kv_heads` KV heads, its share of the MLP and of the output head's vocabulary,
    the embedding whole). Parameters are created uninitialised; fill them with `load_weights`
    (Hugging Face tensor names, full-size: each rank keeps its slice) before use. ValueError
    (`check_tensor_parallel`) when the heads do not split over `tp.size` ranks."""

    def __init__(self, config: DecoderConfig, dtype: torch.dtype = torch.float32,
                 device: Union[str, torch.device] = "cpu", tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.packed = False
        self.tp = tp
        self.shard = ModelShard.of(config, tp.rank, tp.size)
        self._full_shard = ModelShard.of(config)  # the checkpoint's tensors are of this one
        self.num_local_heads = self.shard.num_local_heads
        self.num_local_kv_heads = self.shard.num_local_kv_heads
        #: The checkpoint's KV cache scales, `(k_scale, v_scale)` per layer (float32, one
        #: element or `[num_kv_heads]`), or None; set by `load_weights`.
        self.kv_scales_from_file: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device, self.shard, tp)
                                    for i in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype, device=device),
                                 requires_grad=False)
        v0, v1 = self.shard.vocab
        if config.tie_word_embeddings:
            # this rank's rows of the embedding (all of it for one rank), no copy
            self.lm_head = (self.embed_tokens if tp.size == 1
                            else self.embed_tokens.detach()[v0:v1])
        else:
            self.lm_head = nn.Parameter(torch.empty(v1 - v0, config.hidden_size, dtype=dtype,
                                                    device=device), requires_grad=False)
        self.rotary = self._rotary_embeddings(config, device)
        self.embedding_multiplier = (None if config.embedding_multiplier is None else
                                     torch.tensor(config.embedding_multiplier, dtype=dtype))
        self.windows = sliding_windows(self.layers)
        self._layer_loop: Optional[LayerLoop] = None
        self._layer_loop_built = False

    def layer_loop(self) -> Optional[LayerLoop]:
        """The native loop that runs this model's layers in decode-sized steps
        (engine/model/layer_loop.py), built at the first call after the weights are loaded, or
        None where the model does not qualify (`loop_problem`)."""
        if not self._layer_loop_built:
            self._layer_loop_built = True
            self._layer_loop = build_layer_loop(self)
        return self._layer_loop

    def weights_changed(self) -> None:
        """Drops the layer loop (it holds the weights it was built from); the next step builds
        it again. Called by `load_weights` and by whatever replaces the projections."""
        self._layer_loop = None
        self._layer_loop_built = False

    @staticmethod
    def _rotary_embeddings(config: DecoderConfig,
                           device: torch.device) -> dict[str, RotaryEmbedding]:
        """The rotary embedding of each layer type the model has."""
        c = config
        full = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling,
                               c.max_position_embeddings, device)
        local = full
        if c.local_rope_theta is not None:
            local = RotaryEmbedding(c.head_dim, c.local_rope_theta, None,
                                    c.max_position_embeddings, device)
        return {"full_attention": full, "sliding_attention": local}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                kv_scales: Optional[list[LayerKVScales]] = None) -> torch.Tensor:
        """Runs `input_ids` (int64 `[T]`) at `positions` (int64 `[T]`, each
        `< config.max_positions`) through every layer; `kv_caches[i]` is layer `i`'s
        `(key_cache, value_cache)`, each `[num_blocks, num_local_kv_heads, block_size,
        head_dim]` in the model dtype or an 8-bit one, whose scales are `kv_scales[i]`
        (engine/kv_scales.py, over this rank's KV heads; pending ones are calibrated on this
        step's K/V). Returns the final-normed hidden states `[T, hidden_size]`, full-size on
        every rank; pass the rows that need logits to `compute_logits`. Under tensor
        parallelism every rank calls it with the same inputs (it all-reduces twice a layer)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches: expected {len(self.layers)} (key, value) pairs, one "
                             f"per layer, got {len(kv_caches)}")
        if kv_scales is not None and len(kv_scales) != len(self.layers):
            raise ValueError(f"kv_scales: expected {len(self.layers)} LayerKVScales, one per "
                             f"layer, got {len(kv_scales)}")
        rotary = self._step_rotary(positions, meta)
        plans = self.plan_attention(meta, input_ids.shape[0], kv_caches[0][0],
                                    kv_scales is not None)
        hidden = F.embedding(input_ids, self.embed_tokens)
        if self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        loop = self.layer_loop()
        out = None if loop is None else loop.run(hidden, rotary, kv_caches, plans, kv_scales)
        if out is not None:
            return out
        residual = None
        scales = kv_scales or [None] * len(self.layers)
        for layer, kv_cache, layer_scales in zip(self.layers, kv_caches, scales):
            # .forward: no module hooks are used, and nn.Module.__call__ costs ~3 us a layer
            hidden, residual = layer.forward(hidden, residual, rotary, kv_cache, plans,
                                             layer_scales)
        return layer_ops.add_rms_norm_(residual, hidden, self.norm, self.config.rms_norm_eps)

    def _step_rotary(self, positions: torch.Tensor,
                     meta: AttentionMetadata) -> dict[str, Rotary]:
        """Each layer type's `Rotary` for this step's tokens (tables that depend on the
        sequence length get each token's sequence length from `meta`)."""
        token_seq_lens = None
        if any(r.depends_on_seq_len for r in self.rotary.values()):
            seq_lens = meta.seq_lens.to(torch.int64)
            if meta.cu_seqlens_q is None:
                token_seq_lens = seq_lens
            else:
                token_seq_lens = seq_lens.repeat_interleave(meta.cu_seqlens_q.diff().to(
                    torch.int64), output_size=positions.shape[0])
        done: dict[int, Rotary] = {}  # layer types sharing one embedding share its tables
        for r in self.rotary.values():
            if id(r) not in done:
                done[id(r)] = r.for_step(positions, token_seq_lens)
        return {kind: done[id(r)] for kind, r in self.rotary.items()}

    def plan_attention(self, meta: AttentionMetadata, num_tokens: int,
                       key_cache: torch.Tensor, quantized: bool = False) -> Plans:
        """The step's attention plan of each sliding window the layers use (metadata checked
        once per window, run by every layer with that window); `key_cache` is any layer's
        (all layers' caches have one shape and dtype). The plans are of this rank's heads. For
        an 8-bit cache (`quantized`) the plans share float32 `[num_local_kv_heads]` scale
        tensors, which each layer fills with its scales before its calls."""
        c = self.config
        scales = {}
        if quantized:
            ones = torch.ones(self.num_local_kv_heads, dtype=torch.float32,
                              device=key_cache.device)
            scales = {"k_scale": ones, "v_scale": ones.clone()}
        return {window: plan(meta.block_tables, meta.seq_lens, cu_seqlens_q=meta.cu_seqlens_q,
                             slot_mapping=meta.slot_mapping, num_tokens=num_tokens,
                             num_heads=self.num_local_heads, num_kv_heads=self.num_local_kv_heads,
                             head_size=c.head_dim, block_size=key_cache.shape[2],
                             num_blocks=key_cache.shape[0], dtype=self.dtype,
                             kv_cache_dtype=key_cache.dtype, backend=meta.backend,
                             scale=c.attention_scale, sliding_window=window,
                             soft_cap=c.attn_logit_softcapping, **scales)
                for window in self.windows}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits `[N, vocab_size]` for final hidden states `[N, hidden_size]` (soft
        capped when the config says so), on every rank. Under tensor parallelism every rank
        calls it with the same `hidden` (each computes its vocabulary rows, then all-gathers)."""
        logits = _linear(hidden, self.lm_head).float()
        if self.tp.size > 1:
            logits = self._gather_vocab(logits)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The full-vocabulary logits from each rank's `[N, rows of its shard]`."""
        vocab, per_rank = self.config.vocab_size, self.shard.vocab_per_rank
        if logits.shape[1] < per_rank:
            logits = F.pad(logits, (0, per_rank - logits.shape[1]))
        logits = self.tp.all_gather(logits)
        return logits if logits.shape[1] == vocab else logits[:, :vocab].contiguous()

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
        self.weights_changed()
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
        """Copies tensors named as in the family's Hugging Face checkpoint (`model.layers.0.
        self_attn.q_proj.weight`, ...; `checkpoint_names.layer_tensors`), full-size, into the
        fused parameters, converting to the model dtype; each tensor is cut to this rank's
        shard as it arrives, so `weights` may yield them one at a time from a file without the
        whole model ever being in memory. RMSNorm weights get the config's
        `norm_weight_offset` added.

        Raises ValueError for an unknown name or a wrong shape, and when a parameter is left
        unloaded (`lm_head.weight` is optional when the embedding is tied). KV cache scales
        (`self_attn.k_scale` / `v_scale` / `kv_scale`) go to `kv_scales_from_file`.
        """
        if self.packed:
            raise RuntimeError("load_weights: the weights were packed for inference "
                               "(pack_weights); load into a fresh model")
        self.weights_changed()
        table = layer_tensors(self.config)
        loaded: set[str] = set()
        found_scales: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            if self._kv_scale(name, tensor, found_scales):
                continue
            target, rows, is_norm = self._locate(name, table)
            if target is None:
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer some checkpoints carry; recomputed from the config
                raise ValueError(f"weights: unexpected tensor {name!r} for a "
                                 f"{self.config.architecture} model")
            want = self._checkpoint_shape(name, table)
            if tuple(tensor.shape) != want:
                raise ValueError(f"weights: expected {name!r} of shape {want}, got "
                                 f"{tuple(tensor.shape)}")
            dest = target if rows is None else target[rows[0]:rows[1]]
            dest.copy_(take(tensor, self.shard.pieces(*self._param_of(name, table))))
            if is_norm and self.config.norm_weight_offset:
                dest.add_(self.config.norm_weight_offset)
            loaded.add(name)
        missing = sorted(set(self.checkpoint_names()) - loaded)
        if missing:
            raise ValueError(f"weights: missing tensors {missing[:6]}"
                             f"{' ...' if len(missing) > 6 else ''} ({len(missing)} in all)")
        c = self.config
        scales = file_scales_from(found_scales, c.num_hidden_layers, c.num_key_value_heads)
        k0, k1 = self.shard.kv_heads
        self.kv_scales_from_file = None if scales is None else [
            tuple(s if s.numel() == 1 else s[k0:k1].clone() for s in pair)  # type: ignore[misc]
            for pair in scales]

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

    def checkpoint_names(self) -> list[str]:
        """Every tensor name `load_weights` needs (KV cache scales are optional)."""
        table = layer_tensors(self.config)
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(len(self.layers)):
            names += [f"model.layers.{i}.{key}" for key in table]
        return names

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape `load_weights` expects of each tensor of `checkpoint_names` (the full
        checkpoint's, whatever this rank's shard)."""
        table = layer_tensors(self.config)
        return {name: self._checkpoint_shape(name, table) for name in self.checkpoint_names()}

    def _checkpoint_shape(self, name: str, table: dict[str, tuple[str, Optional[int]]]
                          ) -> tuple[int, ...]:
        """The full shape of checkpoint tensor `name` (one `_locate` finds)."""
        target, rows, _ = self._locate(name, table)
        shape = list(target.shape if rows is None else (rows[1] - rows[0], *target.shape[1:]))
        full = self._full_shard.layout(*self._param_of(name, table))
        if full is not None:
            dim, ranges = full
            shape[dim] = sum(b - a for a, b in ranges)
        return tuple(shape)

    @staticmethod
    def _param_of(name: str, table: dict[str, tuple[str, Optional[int]]]
                  ) -> tuple[str, Optional[int]]:
        """The (parameter, part index) a checkpoint tensor loads into ("lm_head" for the output
        head; the embedding and the final norm count as whole parameters)."""
        if name == "lm_head.weight":
            return "lm_head", None
        if name.startswith("model.layers."):
            return table[name.split(".", 3)[3]]
        return name, None

    def _locate(self, name: str, table: dict[str, tuple[str, Optional[int]]]
                ) -> tuple[Optional[torch.Tensor], Optional[tuple[int, int]], bool]:
        """The parameter a checkpoint tensor goes to, its row range inside a fused one, and
        whether it is an RMSNorm weight."""
        if name == "model.embed_tokens.weight":
            return self.embed_tokens, None, False
        if name == "model.norm.weight":
            return self.norm, None, True
        if name == "lm_head.weight":
            if self.config.tie_word_embeddings:
                return None, None, False
            return self.lm_head, None, False
        parts = name.split(".")
        if (len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit()
                or int(parts[2]) >= len(self.layers)):
            return None, None, False
        key = ".".join(parts[3:])
        if key not in table:
            return None, None, False
        param, index = table[key]
        target = getattr(self.layers[int(parts[2])], param)
        rows = None if index is None else self._row_range(param, index)
        return target, rows, param in NORM_PARAMS

    def _row_range(self, fused: str, index: int) -> tuple[int, int]:
        sizes = self.shard.part_sizes(fused)
        start = sum(sizes[:index])
        return start, start + sizes[index]
