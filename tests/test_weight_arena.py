"""`engine.model.weight_arena.WeightArena`: 64-byte aligned buffers back to back in one mapping
(a new one when the current is full), valid after the arena is gone; `attach_gguf_weights` puts
a model's packed weights there in load order, in huge pages where the kernel offers them, with
the same products as weights packed into buffers of their own."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.model.config import DecoderConfig
from engine.model.decoder import DecoderForCausalLM
from engine.model.gguf_blocks import GGUFBlocks
from engine.model.quant import attach_gguf_weights
from engine.model.quant_int8 import int8_linear, pack_int8
from engine.model.quant_tiled import pack_tiled, tiled_linear
from engine.model.weight_arena import ALIGNMENT, HUGE_PAGE, WeightArena

sys.path.insert(0, str(Path(__file__).parent))
from test_cache_memory import THP, _anon_huge_kib  # noqa: E402
from test_quant import random_blocks  # noqa: E402


def test_buffers_are_aligned_and_back_to_back():
    arena = WeightArena(chunk_bytes=1 << 20)
    first, second, third = arena.take(1000), arena.take(4096), arena.take(0)
    for buf, size in ((first, 1000), (second, 4096), (third, 0)):
        assert buf.dtype == torch.uint8 and buf.numel() == size and buf.is_contiguous()
    assert first.data_ptr() % HUGE_PAGE == 0  # a mapping's first buffer starts a huge page
    assert second.data_ptr() % ALIGNMENT == 0
    assert second.data_ptr() == first.data_ptr() + 1024  # the next cache line after 1000 bytes
    first.fill_(1)
    second.fill_(2)
    assert int(first.sum()) == 1000 and int(second.sum()) == 2 * 4096


def test_a_full_mapping_starts_another_and_a_large_buffer_gets_its_own():
    arena = WeightArena(chunk_bytes=8192)
    a, b = arena.take(6000), arena.take(6000)  # b does not fit after a
    assert b.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() != a.data_ptr()
    big = arena.take(3 * 8192)
    assert big.numel() == 3 * 8192 and big.data_ptr() % HUGE_PAGE == 0
    big.fill_(7)
    after = arena.take(100)  # the large buffer's mapping is full: another one
    assert after.data_ptr() % HUGE_PAGE == 0 and int(big.sum()) == 7 * 3 * 8192


def test_buffers_outlive_the_arena():
    arena = WeightArena()
    bufs = [arena.take(n) for n in (100, 5000, 64)]
    for i, buf in enumerate(bufs):
        buf.fill_(i + 1)
    del arena
    gc.collect()
    assert [int(b.sum()) for b in bufs] == [100, 2 * 5000, 3 * 64]


def test_bad_sizes_name_the_argument():
    with pytest.raises(ValueError, match="nbytes: expected >= 0, got -1"):
        WeightArena().take(-1)
    with pytest.raises(ValueError, match="chunk_bytes: expected at least 64, got 8"):
        WeightArena(chunk_bytes=8)


def _layer_blocks(rng: np.random.Generator) -> list[tuple[str, GGUFBlocks]]:
    """Q4_1 blocks for every projection of a 2-layer model of hidden size 64."""
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64),
              "self_attn.v_proj": (32, 64), "self_attn.o_proj": (64, 64),
              "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64), "mlp.down_proj": (64, 96)}
    return [(f"model.layers.{i}.{name}.weight",
             GGUFBlocks("Q4_1", torch.from_numpy(random_blocks(rng, "Q4_1", *shape)), shape[1]))
            for i in range(2) for name, shape in shapes.items()]


def _model(dtype: torch.dtype) -> DecoderForCausalLM:
    config = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           tie_word_embeddings=True)
    return DecoderForCausalLM(config, dtype=dtype)


@pytest.mark.parametrize("mode", ["tiled", "int8", "file layout"])
def test_attached_weights_lie_in_load_order_in_one_mapping(mode):
    """Each layer's fused qkv, o, gate_up and down buffers follow one another (at most one cache
    line of padding between them), layer after layer, and multiply as the same weights packed
    into buffers of their own do, bit for bit."""
    given = _layer_blocks(np.random.default_rng(3))
    dtype = torch.float32 if mode == "file layout" else torch.bfloat16
    model = _model(dtype)
    attach_gguf_weights(model, given, int8=mode == "int8", tiled=mode == "tiled")
    weights = [getattr(layer, name) for layer in model.layers
               for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    buffers = [w.int8.packed if mode == "int8" else w.blocks.packed if mode == "tiled"
               else w.blocks.data for w in weights]
    for before, after in zip(buffers, buffers[1:]):
        gap = after.data_ptr() - (before.data_ptr() + before.numel())
        assert 0 <= gap < ALIGNMENT
    by_name = dict(given)
    down = GGUFBlocks("Q4_1", by_name["model.layers.1.mlp.down_proj.weight"].data, 96)
    x = torch.randn(3, 96).to(dtype)
    got = model.layers[1].down_proj
    if mode == "int8":
        assert torch.equal(int8_linear(x, got.int8), int8_linear(x, pack_int8(down)))
    elif mode == "tiled":
        assert torch.equal(tiled_linear(x, got.blocks), tiled_linear(x, pack_tiled(down)))
    else:
        assert torch.equal(got.blocks.data, down.data)


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="no transparent huge pages in this kernel")
def test_a_models_packed_weights_are_in_huge_pages():
    """12 MiB of packed weights (a 2-layer model of hidden size 1024): its arena's mapping holds
    huge pages once they are written (THP in `madvise` or `always` mode)."""
    rng = np.random.default_rng(4)
    config = DecoderConfig(vocab_size=64, hidden_size=1024, intermediate_size=4096,
                           num_hidden_layers=2, num_attention_heads=8, tie_word_embeddings=True)
    model = DecoderForCausalLM(config, dtype=torch.bfloat16)
    given = [(f"model.layers.{i}.mlp.{name}.weight",
              GGUFBlocks("Q4_1", torch.from_numpy(random_blocks(rng, "Q4_1", *shape)), shape[1]))
             for i in range(2) for name, shape in (("gate_proj", (4096, 1024)),
                                                   ("up_proj", (4096, 1024)),
                                                   ("down_proj", (1024, 4096)))]
    attach_gguf_weights(model, given, tiled=True)
    packed = model.layers[0].gate_up_proj.blocks.packed
    assert _anon_huge_kib(packed.data_ptr()) >= 4 * 1024


def test_bench_weight_pages_counts_the_models_weights(tmp_path):
    """`bench.weight_pages` on the default model, one round at 2 rows: every quantized
    projection and the head in both placements, with the bytes the int8 kernel reads."""
    from bench import weight_pages
    from engine.model.loader import default_model_path, load_model

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    out = tmp_path / "pages.json"
    lines: list[str] = []
    weight_pages.main(["--rows", "2", "--modes", "gguf-int8", "--rounds", "1", "--json",
                       str(out)], out=lines.append)
    (row,) = json.loads(out.read_text())["rows"]
    model = load_model(None, dtype=torch.bfloat16, quantization="gguf-int8").model
    weights = weight_pages.step_weights(model)
    assert len(weights) == 4 * len(model.layers) + 1
    assert row["weight_bytes"] == sum(w.int8.packed.numel() for w in weights)
    assert row["huge_pages"]["median_ms"] > 0 and row["own_buffers"]["median_ms"] > 0
    assert lines[-1].startswith("| gguf-int8 | 2 |")
    copy = weight_pages.own_buffers(weights[0])
    assert copy.int8.packed.data_ptr() != weights[0].int8.packed.data_ptr()
    assert torch.equal(copy.int8.packed, weights[0].int8.packed)
