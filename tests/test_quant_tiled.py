"""The tiled bf16 matmul on GGUF weights (engine/model/quant_tiled.py, csrc/tiled_matmul.cpp).

Oracle: the `gguf` package's own dequantisation of the same bytes (it shares no code with the
kernel), then a float64 matmul (`test_quant.check`: float32 accumulation over K terms of
magnitude |x| (|w| + 16|d| + |m|), plus bfloat16's final rounding). Blocks are random bytes with
random float16 scales (some subnormal, some zero) between rows of NaN scales, and x sits between
NaN rows, so any read outside the operands poisons the result. M runs past the two-chain limit
(4 rows), the row group (12) and several balanced group splits; N is not a multiple of the
16-feature tile.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model.quant import (
    AMX_BF16_MAX_ROWS,
    MAX_ROWS,
    TILED_BF16_MAX_ROWS,
    UNTILED_BF16_MAX_ROWS,
    GGUFBlocks,
    QuantizedWeight,
    float32_max_rows,
    tiled_max_rows,
)
from engine.model.quant_tiled import TiledWeight, pack_tiled, tiled_linear
from engine.native_build import TILED_TIERS, load_tiled
from paged_kernels.cpp_build import compile_flags

pytest.importorskip("gguf")
from test_quant import check, padded_blocks, padded_x, random_blocks  # noqa: E402

#: Row counts: 1-3 (two chains), 4-12 (one group), 13-24 (two groups), 25-36 (three), 37-48 (four).
ROWS = (1, 2, 3, 4, 5, 7, 11, 12, 13, 16, 24, 25, 32, 37, 48)


@pytest.fixture(scope="module")
def portable():
    """The portable (non-SIMD) build: a second build (seconds, once per machine)."""
    return load_tiled(compile_flags(TILED_TIERS, frozenset()))


def random_x(rng: np.random.Generator, m: int, cols: int) -> torch.Tensor:
    """bf16 [m, cols] ~N(0, 1), with a few bfloat16 subnormals (which the kernel reads as zero:
    within the bound, as their products are below 1e-30)."""
    x = torch.from_numpy(rng.normal(0.0, 1.0, (m, cols))).to(torch.bfloat16)
    x.view(-1)[:: 7] = torch.tensor(1e-39, dtype=torch.bfloat16)
    return x


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows,cols", [(37, 96), (131, 64)])
def test_kernel_matches_gguf_dequantisation(qtype, rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    raw = random_blocks(rng, qtype, rows, cols)
    weight = pack_tiled(padded_blocks(raw, qtype, cols))
    for m in ROWS:
        x = random_x(rng, m, cols)
        check(tiled_linear(padded_x(x), weight), x, raw, qtype)


def on_amx() -> bool:
    """Whether this machine's build runs 4 rows or more on AMX tiles (two chains at every M)."""
    return load_tiled().simd_paths == "amx-bf16"


def rows_alone(x: torch.Tensor, weight: TiledWeight, kernel=None) -> torch.Tensor:
    """Each row of x multiplied on its own (one row: the two-chain order)."""
    return torch.cat([tiled_linear(x[r:r + 1].contiguous(), weight, kernel)
                      for r in range(x.shape[0])])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_portable_build_gives_the_same_bits(portable, qtype):
    """The portable path emulates vdpbf16ps (exact products, the same summation order, subnormals
    flushed) and matches the oracle; on a CPU with AVX-512 BF16 it gives the SIMD path's bits,
    and on AMX the bits of each row alone (the two-chain order at every M)."""
    assert portable.simd_paths == "portable"
    rng = np.random.default_rng(11)
    raw = random_blocks(rng, qtype, 53, 160)
    blocks = padded_blocks(raw, qtype, 160)
    simd, port = pack_tiled(blocks), pack_tiled(blocks, kernel=portable)
    assert torch.equal(simd.packed, port.packed)
    for m in (1, 3, 4, 13, 25):
        x = random_x(rng, m, 160)
        got = tiled_linear(padded_x(x), port, kernel=portable)
        check(got, x, raw, qtype)
        want = rows_alone(x, port, portable) if on_amx() else got
        assert same_bits(tiled_linear(x, simd), want), m


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_amx_rows_equal_the_rows_alone(portable, qtype):
    """On AMX (4 rows or more on tiles: groups of up to 16, several groups, a ragged N), every
    row's bits are those of the row alone, from the AMX build and from the portable one."""
    if not on_amx():
        pytest.skip("this CPU runs no AMX path (amx_bf16 absent or not granted)")
    rng = np.random.default_rng(17)
    raw = random_blocks(rng, qtype, 83, 288)
    weight = pack_tiled(padded_blocks(raw, qtype, 288))
    port = pack_tiled(padded_blocks(raw, qtype, 288), kernel=portable)
    for m in (4, 5, 15, 16, 17, 31, 33, 48):
        x = random_x(rng, m, 288)
        got = tiled_linear(padded_x(x), weight)
        check(got, x, raw, qtype)
        assert same_bits(got, rows_alone(x, weight)), m
        assert same_bits(got, rows_alone(x, port, portable)), m


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_tiles_take_the_blocks_bytes(qtype):
    """A tiled weight is as large as the file's blocks when rows fill whole tiles."""
    raw = random_blocks(np.random.default_rng(2), qtype, 48, 96)
    weight = pack_tiled(GGUFBlocks(qtype, torch.from_numpy(raw), 96))
    assert weight.packed.numel() == raw.size and weight.shape == (48, 96)
    assert weight.packed.data_ptr() % 64 == 0


def test_default_crossovers_follow_the_path_and_format():
    dense = torch.zeros(16, 64, dtype=torch.bfloat16)
    for qtype in ("Q4_1", "Q8_0"):
        raw = random_blocks(np.random.default_rng(4), qtype, 16, 64)
        blocks = GGUFBlocks(qtype, torch.from_numpy(raw), 64)
        tiled = QuantizedWeight(pack_tiled(blocks), dense).max_rows
        assert tiled == (AMX_BF16_MAX_ROWS[qtype] if on_amx()
                         else TILED_BF16_MAX_ROWS.get(qtype, MAX_ROWS[torch.bfloat16]))
        assert QuantizedWeight(blocks, dense).max_rows == UNTILED_BF16_MAX_ROWS
        assert QuantizedWeight(blocks, dense.float()).max_rows == float32_max_rows()


def test_crossover_follows_the_kernel_path(portable):
    """The AMX path has its own crossovers; the portable and AVX-512 BF16 builds the others."""
    assert tiled_max_rows("Q4_1", portable) == MAX_ROWS[torch.bfloat16]
    assert tiled_max_rows("Q8_0", portable) == TILED_BF16_MAX_ROWS["Q8_0"]

    class Amx:
        simd_paths = "amx-bf16"

    assert tiled_max_rows("Q4_1", Amx()) == AMX_BF16_MAX_ROWS["Q4_1"]
    assert tiled_max_rows("Q8_0", Amx()) == AMX_BF16_MAX_ROWS["Q8_0"]


@pytest.mark.parametrize("m", [3, 16, 25])
def test_result_does_not_depend_on_the_thread_count(m):
    rng = np.random.default_rng(3)
    weights = [pack_tiled(GGUFBlocks(q, torch.from_numpy(random_blocks(rng, q, 300, 128)), 128))
               for q in ("Q4_1", "Q8_0")]
    x = torch.randn(m, 128, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [tiled_linear(x, w) for w in weights]
        torch.set_num_threads(2)
        two = [tiled_linear(x, w) for w in weights]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_bad_inputs_name_the_argument():
    raw = random_blocks(np.random.default_rng(1), "Q4_1", 16, 64)
    blocks = GGUFBlocks("Q4_1", torch.from_numpy(raw), 64)
    weight = pack_tiled(blocks)
    with pytest.raises(ValueError, match=r"x: expected a \[M, 64\] tensor, got \(2, 32\)"):
        tiled_linear(torch.zeros(2, 32, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="x: expected a bfloat16 CPU tensor, got torch.float32"):
        tiled_linear(torch.zeros(2, 64), weight)
    with pytest.raises(ValueError, match="dense: expected bfloat16 with tiled blocks"):
        QuantizedWeight(weight, torch.zeros(16, 64))
    with pytest.raises(ValueError, match=r"dense: expected shape \(16, 64\)"):
        QuantizedWeight(weight, torch.zeros(16, 32, dtype=torch.bfloat16))


def test_model_reads_the_tiles_up_to_the_crossover(monkeypatch):
    """A bfloat16 model gets tiled blocks (a float32 one the file's layout) and `_linear` reads
    them up to `max_rows` rows, the dense weight above."""
    import engine.model.decoder as decoder
    from engine.model.config import DecoderConfig
    from engine.model.decoder import DecoderForCausalLM
    from engine.model.quant import attach_gguf_weights

    config = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=1, num_attention_heads=2, tie_word_embeddings=True)
    rng = np.random.default_rng(5)
    raw = random_blocks(rng, "Q4_1", 64, 96)
    given = [("model.layers.0.mlp.down_proj.weight",
              GGUFBlocks("Q4_1", torch.from_numpy(raw), 96))]
    f32 = DecoderForCausalLM(config, dtype=torch.float32)
    attach_gguf_weights(f32, given)
    assert not f32.layers[0].down_proj.tiled
    assert f32.layers[0].down_proj.max_rows == float32_max_rows()
    untiled = DecoderForCausalLM(config, dtype=torch.bfloat16)
    attach_gguf_weights(untiled, given, tiled=False)
    assert untiled.layers[0].down_proj.max_rows == UNTILED_BF16_MAX_ROWS
    model = DecoderForCausalLM(config, dtype=torch.bfloat16)
    attach_gguf_weights(model, given, tiled=True)
    weight = model.layers[0].down_proj
    assert isinstance(weight.blocks, TiledWeight) and weight.max_rows == tiled_max_rows("Q4_1")
    weight.dense = torch.from_numpy(rng.normal(0, 1, (64, 96))).to(torch.bfloat16)
    calls = []
    kernel = decoder.tiled_linear
    monkeypatch.setattr(decoder, "tiled_linear", lambda x, w: calls.append(1) or kernel(x, w))
    for m in (1, weight.max_rows):
        x = random_x(rng, m, 96)
        check(decoder._linear(x, weight), x, raw, "Q4_1")
    assert len(calls) == 2
    x = torch.randn(weight.max_rows + 1, 96, dtype=torch.bfloat16)
    torch.testing.assert_close(decoder._linear(x, weight), x @ weight.dense.T)
    assert len(calls) == 2


def order_probe(kernel, m: int, one: int, up: int, tie: int, minus: int) -> torch.Tensor:
    """Row 0 of a Q8_0 block with d = 1 (the other 15 rows zero): q = 1 at k = one, up, tie and
    -1 at k = minus, against x = 1 at one and minus, 0.75 ulp of 1 at up and 0.5 ulp at tie;
    returns feature 0 of the m rows in ulps of 1 (2^-23), after checking the zero features."""
    raw = np.zeros((16, 34), np.uint8)
    raw[:, 0:2] = np.array([1.0], np.float16).view(np.uint8).reshape(1, 2)
    q = np.zeros(32, np.int8)
    q[[one, up, tie]], q[minus] = 1, -1
    raw[0, 2:] = q.view(np.uint8)
    blocks = GGUFBlocks("Q8_0", torch.from_numpy(raw), 32)
    x = torch.zeros(m, 32)
    x[:, one], x[:, up], x[:, tie], x[:, minus] = 1.0, 3 * 2.0 ** -25, 2.0 ** -24, 1.0
    y = tiled_linear(x.bfloat16(), pack_tiled(blocks, kernel), kernel)
    assert (y[:, 1:] == 0).all()
    return y[:, 0].float() / 2.0 ** -23


@pytest.mark.parametrize("m", [1, 4])
def test_summation_order_is_the_stated_one(portable, m):
    """tiled_matmul.cpp's order, on a block whose result depends on it: pair 0 gives S = 1, pair
    1 adds its odd product (half an ulp of 1: a tie, kept at 1) then its even one (0.75 ulp:
    rounds up), pair 2 subtracts 1, leaving one ulp of 1. In two chains (fewer than 4 rows, and
    every M on AMX) pair 1 sums in its own chain, exactly: 1.25 ulps. Both builds."""
    for kernel in (None, portable):
        two_chains = m < 4 or (kernel is None and on_amx())
        assert (order_probe(kernel, m, one=0, up=2, tie=3, minus=4)
                == (1.25 if two_chains else 1.0)).all()


@pytest.mark.parametrize("m", [1, 4, 16])
def test_odd_product_of_a_pair_comes_first_in_every_chain(portable, m):
    """Within a chain a pair adds its odd product first: chain 0 of Q8_0 (the even pairs in both
    orders) holds 1, then pair 2's odd product (half an ulp: a tie, kept at 1) and its even one
    (0.75 ulp: rounds up), then pair 4's -1: one ulp (two ulps the other way round)."""
    for kernel in (None, portable):
        assert (order_probe(kernel, m, one=0, up=4, tie=5, minus=8) == 1.0).all()
