"""Helpers of the in-process A/B runs of cpu-backend builds (the scripts under bench/results that
compare compiled extensions in one process, so that every build sees the same machine load): the
extension at a path, and the engine's attention shape with random caches."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch

#: The default model's attention (SmolLM2-135M): query heads, KV heads, head size; the engine's
#: block size and layer count.
HEADS, KV_HEADS, HEAD_SIZE, BLOCK, LAYERS = 9, 3, 64, 16, 30


def load_extension(path: str) -> ModuleType:
    """The compiled extension module at `path` (a .so under ~/.cache/torch_extensions)."""
    name = path.rsplit("/", 1)[1].split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class EngineAttentionCase:
    """`seqs` sequences of `context` tokens each at the engine's attention shape: `layers` pairs
    of random bf16 K/V caches, one random non-contiguous block table for all of them."""

    caches: list[tuple[torch.Tensor, torch.Tensor]]
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def engine_attention_case(seqs: int, context: int, layers: int, *,
                          seed: int = 0) -> EngineAttentionCase:
    torch.manual_seed(seed)
    per_seq = (context + BLOCK - 1) // BLOCK
    num_blocks = seqs * per_seq + 8
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_SIZE)
    caches = [(torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16))
              for _ in range(layers)]
    tables = torch.randperm(num_blocks)[: seqs * per_seq].view(seqs, per_seq).int().contiguous()
    return EngineAttentionCase(caches, tables, torch.full((seqs,), context, dtype=torch.int32))
