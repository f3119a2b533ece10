"""Rotary position embeddings as Hugging Face computes them, with its rotary scalings.

`RotaryEmbedding` gives each step's `Rotary` triple for `layer_ops.rotary_`: the token positions
and float32 cos / signed-sin tables `[rows, head_dim]` whose row `positions[t]` rotates token `t`
(rotate-half convention: `cos` repeated over both halves, `sin` negated in the first half).

Scalings whose frequencies do not depend on the sequence (`default`, and the others listed in
`STATIC_TYPES`) are one table over `max_position_embeddings` positions, built once. Those that do
(`SEQ_LEN_TYPES`) follow transformers' rule for a sequence generated on its own: a token's
frequencies are those of its sequence's length after the step that computes it (the largest
position of that step plus one). The engine computes the tables for each step's tokens from
their sequences' lengths; a chunked prefill therefore rotates a chunk's keys with the chunk's
own length, as transformers would had it been given the prompt in those pieces.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["RotaryEmbedding", "STATIC_TYPES", "SEQ_LEN_TYPES", "check_scaling", "rope_type_of"]

#: `rope_type`s whose tables depend on the position only.
STATIC_TYPES = ("default",)
#: `rope_type`s whose tables depend on the sequence's length too.
SEQ_LEN_TYPES: tuple[str, ...] = ()

#: The step's positions (int64 `[T]`) and the float32 cos / signed sin tables.
Rotary = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rope_type_of(scaling: Optional[dict[str, Any]]) -> str:
    """The `rope_type` of a Hugging Face rotary scaling dict (older configs say `type`);
    "default" for None."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def check_scaling(scaling: Optional[dict[str, Any]]) -> str:
    """The `rope_type` of `scaling`; ValueError naming it when it is not supported."""
    rope_type = rope_type_of(scaling)
    if rope_type not in STATIC_TYPES + SEQ_LEN_TYPES:
        raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported; "
                         f"expected one of {list(STATIC_TYPES + SEQ_LEN_TYPES)}")
    return rope_type


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """float32 `1 / theta^(2i / head_dim)`, computed as transformers computes it."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta ** exponents)


def _tables(inv_freq: torch.Tensor, positions: torch.Tensor,
            attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin `[len(positions), head_dim]` (float32) for float32 `inv_freq`
    `[head_dim / 2]`, each multiplied by `attention_factor`."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    sin[:, :inv_freq.shape[0]].neg_()
    return cos, sin


class RotaryEmbedding:
    """The rotary embedding of one kind of layer: `head_dim`, base `theta`, Hugging Face
    `scaling` (None or a dict with `rope_type`), for positions `< max_position_embeddings`.

    ValueError naming the `rope_type` (or parameter) when the scaling is not supported.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict[str, Any]],
                 max_position_embeddings: int, device: Optional[torch.device] = None) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = dict(scaling or {})
        self.rope_type = check_scaling(scaling)
        self.max_position_embeddings = max_position_embeddings
        self.depends_on_seq_len = self.rope_type in SEQ_LEN_TYPES
        self.cos: Optional[torch.Tensor] = None
        self.sin: Optional[torch.Tensor] = None
        if not self.depends_on_seq_len:
            positions = torch.arange(max_position_embeddings, dtype=torch.int64)
            cos, sin = _tables(_default_inv_freq(head_dim, theta), positions)
            self.cos, self.sin = cos.to(device or "cpu"), sin.to(device or "cpu")

    def for_step(self, positions: torch.Tensor,
                 token_seq_lens: Optional[torch.Tensor] = None) -> Rotary:
        """The `Rotary` triple of a step's tokens at `positions` (int64 `[T]`);
        `token_seq_lens` (int64 `[T]`, each token's sequence length after the step) is read
        only when the tables depend on it."""
        if not self.depends_on_seq_len:
            return positions, self.cos, self.sin
        raise NotImplementedError  # filled in with SEQ_LEN_TYPES
