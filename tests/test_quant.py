"""The GGUF quantized matmul (engine/model/quant.py, engine/csrc/quant_matmul.cpp).

Oracle: the `gguf` package's own dequantisation of the same bytes (it shares no code with the
kernel), then a float64 matmul. Blocks are random bytes with random float16 scales (some
subnormal, some zero); every row of x and of the blocks that must not be read sits next to NaN
rows (a NaN scale poisons any sum that reads it). The error bound is float32 accumulation over K
terms of magnitude |x| (|w| + 16|d| + |m|) (the bf16 path sums d * sum(x q) and m * sum(x)
separately), plus bfloat16's final rounding when x is bf16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model.quant import (
    BLOCK_BYTES,
    FLOAT32_MAX_ROWS,
    MAX_ROWS,
    GGUFBlocks,
    QuantizedWeight,
    attach_gguf_weights,
    float32_max_rows,
    quantized_linear,
)
from paged_kernels.cpp_build import cpu_flags

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402  (after the skip)

U32 = 2.0 ** -24
#: The CPU features of the AVX2 build (engine.native_build.TIERS' last tier).
AVX2 = frozenset({"avx2", "fma", "f16c"})
#: Every crossover (M past each is where a test's M list must reach).
CROSSOVERS = {*MAX_ROWS.values(), *FLOAT32_MAX_ROWS.values()}


def random_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, cols/32 * bytes] of random blocks: scales ~N(0, 0.02) as float16, with one
    block in 7 given a subnormal scale and one in 11 a zero scale; quants uniform."""
    nb = cols // 32
    d = rng.normal(0.0, 0.02, (rows, nb))
    d[rng.random((rows, nb)) < 1 / 7] = 3.1e-6  # float16 subnormal
    d[rng.random((rows, nb)) < 1 / 11] = 0.0
    parts = [d.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)]
    if qtype == "Q4_1":
        parts.append(rng.normal(0.0, 0.1, (rows, nb)).astype(np.float16).view(np.uint8)
                     .reshape(rows, nb, 2))
        parts.append(rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8))
    else:
        parts.append(rng.integers(0, 256, (rows, nb, 32), dtype=np.uint8))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def scale_terms(raw: np.ndarray, qtype: str, cols: int) -> np.ndarray:
    """Per weight, 16|d| + |m| of its block, float64 [rows, cols] (read from the raw bytes)."""
    rows, nb = raw.shape[0], cols // 32
    blocks = raw.reshape(rows, nb, BLOCK_BYTES[qtype])
    d = np.abs(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64))
    s = 16 * d
    if qtype == "Q4_1":
        s = s + np.abs(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
    return np.repeat(s, 32, axis=1)


def padded_blocks(raw: np.ndarray, qtype: str, cols: int) -> GGUFBlocks:
    """`raw` as GGUFBlocks whose rows sit between two rows of 0xFF bytes (NaN scales)."""
    full = np.full((raw.shape[0] + 2, raw.shape[1]), 0xFF, dtype=np.uint8)
    full[1:-1] = raw
    return GGUFBlocks(qtype, torch.from_numpy(full)[1:-1], cols)


def padded_x(x: torch.Tensor) -> torch.Tensor:
    """A contiguous view of `x` between two NaN rows."""
    full = torch.full((x.shape[0] + 2, x.shape[1]), float("nan"), dtype=x.dtype)
    full[1:-1] = x
    return full[1:-1]


def check(y: torch.Tensor, x: torch.Tensor, raw: np.ndarray, qtype: str) -> None:
    """`y` against the float64 oracle within the error bound of the module docstring."""
    cols = x.shape[1]
    w = dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype)).astype(np.float64)
    w = torch.from_numpy(w.reshape(raw.shape[0], cols))
    x64 = x.double()
    want = x64 @ w.T
    mag = x64.abs() @ (w.abs() + torch.from_numpy(scale_terms(raw, qtype, cols))).T
    tol = 2 * cols * U32 * mag + 1e-30
    if x.dtype == torch.bfloat16:
        tol = tol + 2.0 ** -8 * want.abs()
    assert y.dtype == x.dtype and y.shape == want.shape
    err = (y.double() - want).abs()
    assert torch.isfinite(y).all(), "a NaN row or scale was read"
    assert (err <= tol).all(), f"max error {float(err.max()):.3g}, worst excess " \
                               f"{float((err - tol).max()):.3g}"


@pytest.fixture(scope="module")
def portable():
    """The portable (non-SIMD) build of the kernel: a second build (seconds, once per machine)."""
    from engine.native_build import TIERS, load_quant
    from paged_kernels.cpp_build import compile_flags

    return load_quant(compile_flags(TIERS, frozenset()))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows,cols", [(1, 32), (37, 96), (131, 576)])
def test_kernel_matches_gguf_dequantisation(qtype, dtype, rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    raw = random_blocks(rng, qtype, rows, cols)
    blocks = padded_blocks(raw, qtype, cols)
    for m in sorted({1, 2, 3, 5, *CROSSOVERS, *(n + 1 for n in CROSSOVERS), 17}):
        x = torch.from_numpy(rng.normal(0.0, 1.0, (m, cols))).to(dtype)
        check(quantized_linear(padded_x(x), blocks), x, raw, qtype)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_portable_build_matches_gguf_dequantisation(portable, qtype, dtype):
    assert portable.simd_paths == "portable"
    rng = np.random.default_rng(7)
    raw = random_blocks(rng, qtype, 53, 160)
    blocks = padded_blocks(raw, qtype, 160)
    for m in (1, 3, 5, 10):
        x = torch.from_numpy(rng.normal(0.0, 1.0, (m, 160))).to(dtype)
        check(quantized_linear(padded_x(x), blocks, kernel=portable), x, raw, qtype)


@pytest.fixture(scope="module")
def avx2():
    """The AVX2 build of the kernel (AVX2 + FMA + F16C, also on a CPU with AVX-512): a build of
    its own (seconds, once per machine); skipped on a CPU without those features."""
    from engine.native_build import TIERS, load_quant
    from paged_kernels.cpp_build import compile_flags

    missing = sorted(AVX2 - cpu_flags())
    if missing:
        pytest.skip(f"the AVX2 build needs a CPU with {sorted(AVX2)}; this one lacks {missing}")
    return load_quant(compile_flags(TIERS, AVX2))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows,cols", [(1, 32), (37, 96), (131, 576)])
def test_avx2_build_matches_gguf_dequantisation(avx2, qtype, dtype, rows, cols):
    """M across the direct path's 4-row passes (1-4 rows) and the buffered path's 3-row tiles
    (5 and more: M % 3 = 2, 0, 1 at 5, 6, 7; 16 and 25 split their last 4 rows in 2 + 2), past
    every crossover; N odd (a last 1-feature group)."""
    assert avx2.simd_paths == "avx2"
    rng = np.random.default_rng(rows * 1000 + cols + 1)
    raw = random_blocks(rng, qtype, rows, cols)
    blocks = padded_blocks(raw, qtype, cols)
    for m in sorted({1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, *CROSSOVERS,
                     *(n + 1 for n in CROSSOVERS)}):
        x = torch.from_numpy(rng.normal(0.0, 1.0, (m, cols))).to(dtype)
        check(quantized_linear(padded_x(x), blocks, kernel=avx2), x, raw, qtype)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_avx2_rows_do_not_depend_on_the_batch(avx2, qtype):
    """A row's bits are the same alone (the direct path) and in any row group, in every place
    of the buffered path's row tiles (3 rows, or 2 + 2 for the last 4) and of its feature pairs
    (N odd): its sums' order is fixed."""
    rng = np.random.default_rng(11)
    raw = random_blocks(rng, qtype, 21, 192)
    blocks = GGUFBlocks(qtype, torch.from_numpy(raw), 192)
    x = torch.from_numpy(rng.normal(0.0, 1.0, (25, 192))).float()
    alone = torch.cat([quantized_linear(x[i:i + 1], blocks, kernel=avx2)
                       for i in range(x.shape[0])])
    for group in (4, 5, 6, 7, 25):
        for start in range(0, x.shape[0] - group + 1, 3):
            got = quantized_linear(x[start:start + group], blocks, kernel=avx2)
            assert torch.equal(got, alone[start:start + group]), (group, start)


def test_float32_crossover_follows_the_kernel_path(portable, avx2):
    assert float32_max_rows(avx2) == FLOAT32_MAX_ROWS["avx2"]
    assert float32_max_rows(portable) == MAX_ROWS[torch.float32]
    dense = torch.zeros(16, 64)
    blocks = GGUFBlocks("Q4_1", torch.from_numpy(random_blocks(np.random.default_rng(1), "Q4_1",
                                                               16, 64)), 64)
    assert QuantizedWeight(blocks, dense).max_rows == float32_max_rows()


@pytest.mark.parametrize("build", ["this machine's", "avx2"])
def test_result_does_not_depend_on_the_thread_count(request, build):
    kernel = request.getfixturevalue("avx2") if build == "avx2" else None
    rng = np.random.default_rng(3)
    raw = random_blocks(rng, "Q4_1", 300, 128)
    blocks = GGUFBlocks("Q4_1", torch.from_numpy(raw), 128)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quantized_linear(x, blocks, kernel=kernel)
        torch.set_num_threads(2)
        two = quantized_linear(x, blocks, kernel=kernel)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_build_flags_follow_the_cpu():
    from engine.native_build import TIERS
    from paged_kernels.cpp_build import compile_flags

    base = {"avx512f", "avx512bw", "avx512vl", "fma", "f16c"}
    assert "-mavx512f" in compile_flags(TIERS, frozenset(base))
    assert "-mavx512bf16" not in compile_flags(TIERS, frozenset(base))
    assert "-mavx512bf16" in compile_flags(TIERS, frozenset(base | {"avx512_bf16"}))
    without = compile_flags(TIERS, frozenset(base - {"avx512bw"} | {"avx512_bf16"}))
    assert not any(f.startswith("-m") for f in without) and "-fopenmp" in without
    avx2 = compile_flags(TIERS, frozenset(base - {"avx512bw"} | {"avx2"}))
    assert {"-mavx2", "-mfma", "-mf16c"} <= set(avx2)
    assert not any(f.startswith("-mavx512") for f in avx2)
    assert not any(f.startswith("-m") for f in compile_flags(TIERS, frozenset({"avx2", "fma"})))


def test_bad_inputs_name_the_argument():
    data = torch.zeros(4, 3 * 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="qtype"):
        GGUFBlocks("Q4_K", data, 96)
    with pytest.raises(ValueError, match="cols"):
        GGUFBlocks("Q4_1", data, 90)
    with pytest.raises(ValueError, match=r"data: .*\[rows, 40\]"):
        GGUFBlocks("Q4_1", data, 64)
    blocks = GGUFBlocks("Q4_1", data, 96)
    with pytest.raises(ValueError, match=r"x: expected a \[M, 96\]"):
        quantized_linear(torch.zeros(2, 64), blocks)
    with pytest.raises(ValueError, match="x: expected a float32 or bfloat16"):
        quantized_linear(torch.zeros(2, 96, dtype=torch.float16), blocks)
    with pytest.raises(ValueError, match="dense: expected shape"):
        QuantizedWeight(blocks, torch.zeros(4, 64))
    with pytest.raises(ValueError, match="parts: expected one format"):
        GGUFBlocks.concat([blocks, GGUFBlocks("Q8_0", torch.zeros(1, 3 * 34, dtype=torch.uint8),
                                              96)])


def test_model_blocks_are_the_hf_weights(hf_default_model):
    """The default GGUF's blocks attached to a model (q/k/v and gate/up fused, the rotary row
    permutation undone) multiply like transformers' own weights of the same file."""
    from engine.model.gguf_reader import gguf_blocks, gguf_config, gguf_metadata, open_gguf
    from engine.model.decoder import DecoderForCausalLM
    from engine.model.loader import default_model_path

    reader = open_gguf(default_model_path())
    config = gguf_config(gguf_metadata(reader), {t.name for t in reader.tensors})
    model = DecoderForCausalLM(config, dtype=torch.float32)  # dense weights left uninitialised
    converted = attach_gguf_weights(model, gguf_blocks(reader, config))
    assert len(converted) == 4 * config.num_hidden_layers + 1
    hf = hf_default_model.model
    x = torch.randn(2, config.intermediate_size)
    for i in (0, config.num_hidden_layers - 1):
        ours, theirs = model.layers[i], hf.layers[i]
        pairs = {"qkv_proj": [theirs.self_attn.q_proj, theirs.self_attn.k_proj,
                              theirs.self_attn.v_proj],
                 "o_proj": [theirs.self_attn.o_proj],
                 "gate_up_proj": [theirs.mlp.gate_proj, theirs.mlp.up_proj],
                 "down_proj": [theirs.mlp.down_proj]}
        for name, parts in pairs.items():
            w = torch.cat([p.weight.detach() for p in parts])
            xi = x[:, :w.shape[1]].contiguous()
            assert_f32_product(quantized_linear(xi, getattr(ours, name).blocks), xi, w)
    xh = x[:, :config.hidden_size].contiguous()
    assert_f32_product(quantized_linear(xh, model.lm_head.blocks), xh,
                       hf_default_model.lm_head.weight.detach())


def assert_f32_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`got` is x @ w.T up to float32 accumulation over w's columns."""
    x64, w64 = x.double(), w.double()
    tol = 2 * w.shape[1] * U32 * (x64.abs() @ w64.abs().T)
    assert ((got.double() - x64 @ w64.T).abs() <= tol).all()


def test_attach_keeps_mixed_or_missing_parts_dense():
    """A fused projection converts only when every part has blocks of one format."""
    from engine.model.config import DecoderConfig
    from engine.model.decoder import DecoderForCausalLM

    config = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=2, tie_word_embeddings=True)
    model = DecoderForCausalLM(config, dtype=torch.float32)

    def blocks(qtype: str, rows: int, cols: int) -> GGUFBlocks:
        raw = random_blocks(np.random.default_rng(rows), qtype, rows, cols)
        return GGUFBlocks(qtype, torch.from_numpy(raw), cols)

    given = {"model.layers.0.self_attn.q_proj.weight": blocks("Q4_1", 64, 64),
             "model.layers.0.self_attn.k_proj.weight": blocks("Q4_1", 64, 64),
             "model.layers.0.self_attn.v_proj.weight": blocks("Q8_0", 64, 64),  # mixed: dense
             "model.layers.0.mlp.gate_proj.weight": blocks("Q4_1", 96, 64),
             "model.layers.0.mlp.up_proj.weight": blocks("Q4_1", 96, 64),
             "model.layers.1.mlp.down_proj.weight": blocks("Q8_0", 64, 96),
             "model.layers.1.mlp.gate_proj.weight": blocks("Q4_1", 96, 64)}  # no up: dense
    converted = attach_gguf_weights(model, given.items())
    assert converted == ["layers.0.gate_up_proj", "layers.1.down_proj"]
    assert isinstance(model.layers[0].qkv_proj, torch.nn.Parameter)
    assert model.layers[0].gate_up_proj.blocks.shape == (192, 64)
    with pytest.raises(ValueError, match="dense: expected shape"):
        attach_gguf_weights(DecoderForCausalLM(config, dtype=torch.float32),
                            [("model.layers.0.self_attn.o_proj.weight", blocks("Q4_1", 32, 64))])
