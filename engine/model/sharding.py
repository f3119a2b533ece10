"""Tensor parallelism of the decoder (Megatron-style, as vLLM does): which slice of each
checkpoint tensor a rank holds.

Of `size` ranks, rank `r` holds:
- attention: its `num_attention_heads / size` query heads and their KV heads (column-parallel:
  its rows of q, k and v, and of their biases); when `num_key_value_heads < size` the KV heads
  are replicated, each rank holding the one KV head its query heads read (`size` is then a
  multiple of `num_key_value_heads`); the output projection is row-parallel (its columns of
  `o_proj`), summed over the ranks by an all-reduce;
- the MLP: its rows of gate and up (column-parallel, an even split of `intermediate_size`, any
  size) and the same columns of `down_proj` (row-parallel, all-reduced);
- the output head: vocabulary-parallel, rows `[r * c, (r + 1) * c)` of `lm_head` with
  `c = ceil(vocab_size / size)` (the last ranks' shards may be short), its logits all-gathered;
- replicated: the input embedding (every rank looks up every token, so the residual stream needs
  no collective to start), the norms (per-head q/k norms too: they act on one head) and the
  biases of the row-parallel projections (added once, after the all-reduce).

`ModelShard.pieces` says which ranges of a full checkpoint tensor go into the rank's parameter,
`take` and `take_blocks` cut them out of a dense tensor and out of a GGUF file's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.model.config import DecoderConfig
from engine.model.gguf_blocks import BLOCK_BYTES, QK, GGUFBlocks

__all__ = ["Pieces", "ModelShard", "check_tensor_parallel", "take", "take_blocks"]

#: `(dim, ranges)`: the rank's part of a full tensor is the concatenation, along `dim`, of the
#: half-open index ranges `ranges` of that dimension.
Pieces = tuple[int, tuple[tuple[int, int], ...]]
Range = tuple[int, int]


def check_tensor_parallel(config: DecoderConfig, size: int) -> None:
    """ValueError naming the sizes unless `config`'s heads split over `size` ranks:
    `num_attention_heads % size == 0`, and `num_key_value_heads % size == 0` or (replicated KV
    heads) `size % num_key_value_heads == 0`."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size: expected an int >= 1, got {size!r}")
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    kv_ok = nkv % size == 0 if nkv >= size else size % nkv == 0
    if nh % size or not kv_ok:
        raise ValueError(f"tensor_parallel_size: expected a divisor of num_attention_heads={nh} "
                         f"that divides num_key_value_heads={nkv} or is a multiple of it, got "
                         f"{size}")


@dataclass(frozen=True)
class ModelShard:
    """Rank `rank` of `size`'s share of a model: half-open ranges of the query heads, KV heads,
    MLP rows and vocabulary rows it holds, with the full sizes they are ranges of."""

    rank: int
    size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    heads: Range
    kv_heads: Range
    intermediate: Range
    vocab: Range

    @classmethod
    def of(cls, config: DecoderConfig, rank: int = 0, size: int = 1) -> "ModelShard":
        """The shard of rank `rank` of `size` (`check_tensor_parallel`'s ValueError when the heads
        do not split)."""
        check_tensor_parallel(config, size)
        nh, nkv = config.num_attention_heads, config.num_key_value_heads
        heads = _block(nh, rank, size)
        if nkv >= size:
            kv_heads = _block(nkv, rank, size)
        else:  # replicated: size // nkv ranks share each KV head
            k = rank // (size // nkv)
            kv_heads = (k, k + 1)
        inter = config.intermediate_size
        split = (inter * rank // size, inter * (rank + 1) // size)
        per_rank = -(-config.vocab_size // size)
        vocab = (min(rank * per_rank, config.vocab_size),
                 min((rank + 1) * per_rank, config.vocab_size))
        return cls(rank, size, config.head_dim, nh, nkv, inter, config.vocab_size, heads,
                   kv_heads, split, vocab)

    @property
    def num_local_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_local_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def local_intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_per_rank(self) -> int:
        """Rows of every rank's output-head shard once padded (the all-gather wants one size)."""
        return -(-self.vocab_size // self.size)

    def part_sizes(self, fused: str) -> list[int]:
        """The rows of each part of fused projection `fused` ("qkv_proj" or "gate_up_proj", or
        its bias) in this rank's parameter."""
        if fused.startswith("gate_up"):
            return [self.local_intermediate_size] * 2
        d = self.head_dim
        return [self.num_local_heads * d, self.num_local_kv_heads * d,
                self.num_local_kv_heads * d]

    def pieces(self, param: str, index: Optional[int]) -> Optional[Pieces]:
        """Which ranges of the checkpoint tensor of layer parameter `param` (part `index` of a
        fused one, None for the whole) or of "lm_head" this rank holds; None for all of it."""
        if self.size == 1:
            return None
        return self.layout(param, index)

    def layout(self, param: str, index: Optional[int]) -> Optional[Pieces]:
        """`pieces` even for one rank (then the ranges cover the whole tensor); None for a tensor
        every rank holds whole."""
        d, weight = self.head_dim, param.replace("_bias", "_proj")
        if weight == "qkv_proj":
            kv = _scaled(self.kv_heads, d)
            offsets = (0, self.num_heads * d, (self.num_heads + self.num_kv_heads) * d)
            return 0, _parts((_scaled(self.heads, d), kv, kv), offsets, index)
        if weight == "gate_up_proj":
            return 0, _parts((self.intermediate,) * 2, (0, self.intermediate_size), index)
        if param == "o_proj":
            return 1, (_scaled(self.heads, d),)
        if param == "down_proj":
            return 1, (self.intermediate,)
        if param == "lm_head":
            return 0, (self.vocab,)
        return None


def _block(total: int, rank: int, size: int) -> Range:
    per = total // size
    return rank * per, (rank + 1) * per


def _scaled(r: Range, factor: int) -> Range:
    return r[0] * factor, r[1] * factor


def _parts(parts: tuple[Range, ...], offsets: tuple[int, ...],
           index: Optional[int]) -> tuple[Range, ...]:
    """The ranges of part `index` inside its own tensor, or of every part inside the fused
    tensor (index None) whose parts start at `offsets`."""
    if index is not None:
        return (parts[index],)
    return tuple((o + a, o + b) for (a, b), o in zip(parts, offsets))


def take(tensor: torch.Tensor, pieces: Optional[Pieces]) -> torch.Tensor:
    """The rank's part of a full `tensor` (a view when it is one range; `tensor` for None)."""
    if pieces is None:
        return tensor
    dim, ranges = pieces
    slices = [tensor.narrow(dim, a, b - a) for a, b in ranges]
    return slices[0] if len(slices) == 1 else torch.cat(slices, dim)


def take_blocks(blocks: GGUFBlocks, pieces: Optional[Pieces]) -> Optional[GGUFBlocks]:
    """The rank's part of a weight stored as GGUF `blocks`: whole rows of blocks, or (dim 1) whole
    blocks of 32 columns; None when a column range does not fall on block boundaries."""
    if pieces is None:
        return blocks
    dim, ranges = pieces
    if dim == 0:
        data = torch.cat([blocks.data[a:b] for a, b in ranges])
        return GGUFBlocks(blocks.qtype, data.contiguous(), blocks.cols)
    if any(a % QK or b % QK for a, b in ranges):
        return None
    per_block = BLOCK_BYTES[blocks.qtype]
    data = torch.cat([blocks.data[:, a // QK * per_block:b // QK * per_block]
                      for a, b in ranges], dim=1)
    return GGUFBlocks(blocks.qtype, data.contiguous(), sum(b - a for a, b in ranges))
