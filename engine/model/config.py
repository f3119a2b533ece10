"""One config for every decoder family the engine runs (engine/model/families/): the Llama
hyper-parameters (Hugging Face's names) plus the features the other families switch on.

A family module translates its Hugging Face `config.json` (or a GGUF file's metadata, through
`engine.model.gguf_reader`) into a `DecoderConfig`; `engine.model.decoder` builds the network
from it alone, so two families that set the same fields are the same network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from engine.model.rope import check_scaling, max_positions

__all__ = ["ACTIVATIONS", "LAYER_TYPES", "DecoderConfig"]

#: MLP activations: SwiGLU ("silu") and GeGLU with the tanh approximation ("gelu_pytorch_tanh").
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
#: Per-layer attention kinds (Hugging Face's `layer_types` names).
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class DecoderConfig:
    """The architecture of a pre-norm decoder with rotary embeddings and grouped-query attention.

    Llama's fields (Hugging Face names): `head_dim` defaults to `hidden_size //
    num_attention_heads`; `eos_token_id` may be one id or a list of ids.

    Features, all off by default (plain Llama):
    - `architecture`: the family's name (`engine.model.families`), for messages and listings.
    - `qkv_bias` / `o_bias` / `mlp_bias`: biases on the Q, K, V projections / the output
      projection / the MLP's projections.
    - `qk_norm`: RMSNorm of each query and key head (weights `[head_dim]`) before rotary.
    - `norm_weight_offset`: every RMSNorm multiplies by `offset + weight` (Gemma: 1.0); the
      loader adds it to the stored weights, so the layers see plain RMSNorm weights.
    - `sandwich_norm`: norms after attention and after the MLP too (Gemma 2/3: `post_attention_
      layernorm` normalises the attention output, `pre_feedforward_layernorm` and `post_
      feedforward_layernorm` wrap the MLP).
    - `hidden_act`: one of `ACTIVATIONS`.
    - `embedding_multiplier`: the embeddings are multiplied by it, rounded to the model dtype
      first (Gemma: sqrt(hidden_size)).
    - `attention_scale`: the softmax scale (None: `head_dim ** -0.5`).
    - `attn_logit_softcapping` / `final_logit_softcapping`: `c * tanh(x / c)` on the attention
      scores / on the logits.
    - `layer_types`: one of `LAYER_TYPES` per layer (None: every layer "sliding_attention" when
      `sliding_window` is set, else "full_attention"); sliding layers attend to the last
      `sliding_window` positions, themselves included.
    - `rope_scaling`: the global layers' rotary scaling as Hugging Face writes it (a dict with
      `rope_type` and its parameters; engine/model/rope.py), None for plain rotary.
    - `local_rope_theta`: the sliding layers' own rotary base, without scaling (Gemma 3); None:
      they use the global layers' rotary.
    - `fused_checkpoint`: the checkpoint stores `qkv_proj` and `gate_up_proj` fused (Phi-3)
      rather than as q/k/v and gate/up parts.
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
    architecture: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_weight_offset: float = 0.0
    sandwich_norm: bool = False
    hidden_act: str = "silu"
    embedding_multiplier: Optional[float] = None
    attention_scale: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    sliding_window: Optional[int] = None
    layer_types: Optional[list[str]] = None
    rope_scaling: Optional[dict[str, Any]] = None
    local_rope_theta: Optional[float] = None
    fused_checkpoint: bool = False

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self._check_sizes()
        self._check_features()

    def _check_sizes(self) -> None:
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
        for name in ("rope_theta", "local_rope_theta", "attention_scale",
                     "attn_logit_softcapping", "final_logit_softcapping",
                     "embedding_multiplier"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < 1e30):
                raise ValueError(f"{name}: expected a finite float > 0, got {value!r}")

    def _check_features(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act: expected one of {list(ACTIVATIONS)}, got "
                             f"{self.hidden_act!r}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or not
                                                isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"sliding_window: expected an int >= 1 or None, got "
                             f"{self.sliding_window!r}")
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers or not set(
                self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types: expected {self.num_hidden_layers} entries from "
                             f"{list(LAYER_TYPES)}, got {self.layer_types!r}")
        check_scaling(self.rope_scaling)
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("sliding_window: expected an int >= 1 with sliding_attention "
                             "layers, got None")

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of layer `layer` (None: it attends to every earlier position)."""
        if self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def max_positions(self) -> int:
        """The number of positions the model runs: `max_position_embeddings`, stretched by a
        `dynamic` rotary scaling's `factor` (engine/model/rope.py)."""
        return max_positions(self.max_position_embeddings, self.rope_scaling)

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
