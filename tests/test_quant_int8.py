"""The int8 matmul on GGUF weights (engine/model/quant_int8.py, engine/csrc/int8_matmul.cpp).

Oracles that share no code with the kernel: the `gguf` package dequantises the same bytes (so
the packed tiles must hold the file's weights), numpy quantizes x with the float32 operations
the kernel's contract states (scale 127 / absmax, round half to even), and the products are
summed in float64. What remains is float32 rounding: each block adds d * xd * s and m * xs with
one rounding each, so the bound is a few float32 ulps per block of the sum of those magnitudes.
Weights and activations sit between NaN rows, so a read outside them poisons the result.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model.quant import GGUFBlocks, QuantizedWeight
from engine.model.quant_int8 import Int8Weight, int8_linear, pack_int8
from engine.native_build import INT8_TIERS, load_int8
from paged_kernels.cpp_build import compile_flags, cpu_flags

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402  (after the skip)
from test_quant import padded_blocks, padded_x, random_blocks  # noqa: E402

U32 = 2.0 ** -24


#: The CPU features of the AVX2 tier (INT8_TIERS' narrower one).
AVX2 = frozenset({"avx2", "fma", "f16c"})


@pytest.fixture(scope="module")
def portable():
    """The portable (non-SIMD) build: a second build (seconds, once per machine)."""
    return load_int8(compile_flags(INT8_TIERS, frozenset()))


@pytest.fixture(scope="module")
def avx2():
    """The AVX2 build (the path of CPUs without AVX-512 VNNI), compiled with those flags
    whatever this CPU's widest tier is; skipped where the CPU cannot run it."""
    if not AVX2 <= cpu_flags():
        pytest.skip(f"the AVX2 build needs a CPU with {sorted(AVX2)}; this one lacks "
                    f"{sorted(AVX2 - cpu_flags())}")
    return load_int8(compile_flags(INT8_TIERS, AVX2))


def quantize_oracle(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int8 [M, K], d float32 [M, K/32], s float32 [M, K/32]) with the float32 operations of
    the kernel's contract: inv = 127 / absmax, q = rint(x * inv), d = absmax / 127, s = d sum q."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(xb).max(-1)
    safe = np.where(amax > 0, amax, np.float32(1))
    inv = np.where(amax > 0, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((xb * inv[..., None]).astype(np.float32)), -127, 127).astype(np.int8)
    d = (amax / np.float32(127)).astype(np.float32)
    s = (d * q.astype(np.int64).sum(-1).astype(np.float32)).astype(np.float32)
    return q.reshape(m, k), d, s


def file_weights(raw: np.ndarray, qtype: str, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(W float64 [N, K] by the gguf package, d m-free check: the blocks' scale d per block)."""
    w = dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype)).astype(np.float64)
    return w.reshape(raw.shape[0], cols)


def oracle(x: torch.Tensor, raw: np.ndarray, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the int8 product in float64, its error bound) for x [M, K] and the file's blocks."""
    m, k = x.shape
    q, d, s = quantize_oracle(x.float().numpy())
    xhat = (q.reshape(m, k // 32, 32).astype(np.float64) * d[..., None].astype(np.float64))
    w = file_weights(raw, qtype, k).reshape(raw.shape[0], k // 32, 32)
    # per block: d xd (sum q_w q_x) + m xs, i.e. sum w * xhat with w = d q_w + m (exactly)
    terms = np.einsum("mbj,nbj->mnb", xhat, w)
    want = terms.sum(-1)
    mag = np.einsum("mbj,nbj->mnb", np.abs(xhat), np.abs(w)).sum(-1)
    tol = 4 * (k // 32 + 2) * U32 * mag + 1e-30
    return torch.from_numpy(want), torch.from_numpy(tol)


def check(y: torch.Tensor, x: torch.Tensor, raw: np.ndarray, qtype: str) -> None:
    want, tol = oracle(x, raw, qtype)
    if y.dtype == torch.bfloat16:
        tol = tol + 2.0 ** -8 * want.abs()
    assert y.dtype == x.dtype and y.shape == want.shape
    assert torch.isfinite(y).all(), "a NaN row of x or of the blocks was read"
    err = (y.double() - want).abs()
    assert (err <= tol).all(), f"max error {float(err.max()):.3g}, worst excess " \
                               f"{float((err - tol).max()):.3g}"


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows,cols", [(1, 32), (40, 96), (131, 576)])
def test_kernel_matches_oracle(qtype, dtype, rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    raw = random_blocks(rng, qtype, rows, cols)
    weight = pack_int8(padded_blocks(raw, qtype, cols))
    for m in (1, 2, 5, 16, 17, 33, 130):  # one tile group, a remainder, > one row chunk (128)
        x = torch.from_numpy(rng.normal(0.0, 1.0, (m, cols)) * rng.lognormal(0, 1, (1, cols)))
        x = x.to(dtype)
        x[0, :32] = 0.0  # an all-zero block: scale 0
        check(int8_linear(padded_x(x), weight), x, raw, qtype)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_portable_build_matches_oracle_and_simd_bit_for_bit(portable, qtype, dtype):
    assert portable.simd_paths == "portable"
    rng = np.random.default_rng(11)
    raw = random_blocks(rng, qtype, 53, 160)
    blocks = padded_blocks(raw, qtype, 160)
    slow = pack_int8(blocks, kernel=portable)
    fast = pack_int8(blocks)
    assert torch.equal(slow.packed, fast.packed)
    for m in (1, 3, 17):
        x = torch.from_numpy(rng.normal(0.0, 1.0, (m, 160))).to(dtype)
        y = int8_linear(padded_x(x), slow, kernel=portable)
        check(y, x, raw, qtype)
        # same operations in the same order per output (the contract), so the same bits
        assert torch.equal(y, int8_linear(x, fast))


def linear_at(threads: int, x: torch.Tensor, weight: Int8Weight, kernel=None) -> torch.Tensor:
    """`int8_linear` on `threads` torch threads (restored after)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return int8_linear(x, weight, kernel=kernel)
    finally:
        torch.set_num_threads(before)


def check_avx2(avx2, portable, raw: np.ndarray, qtype: str, xs: list[torch.Tensor]) -> None:
    """The AVX2 build against the oracle, bit for bit against the portable build and this
    machine's default build (AVX-512 VNNI where the CPU has it), at 1 and 2 threads."""
    assert avx2.simd_paths == "avx2" and portable.simd_paths == "portable"
    blocks = padded_blocks(raw, qtype, raw.shape[1] // (20 if qtype == "Q4_1" else 34) * 32)
    weight = pack_int8(blocks, kernel=avx2)
    assert torch.equal(weight.packed, pack_int8(blocks, kernel=portable).packed)
    for x in xs:
        want = int8_linear(padded_x(x), weight, kernel=portable)
        check(want, x, raw, qtype)
        assert torch.equal(want, int8_linear(x, weight))  # the default build: same layout
        for threads in (1, 2):
            assert torch.equal(linear_at(threads, padded_x(x), weight, kernel=avx2), want)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_avx2_build_matches_oracle_and_portable_bit_for_bit(avx2, portable, qtype, dtype):
    """Random blocks, N not a multiple of 16, M across the 16-row groups (one row, a partial
    group, one group, a group and a remainder, more than the 128-row chunk)."""
    rng = np.random.default_rng(21)
    raw = random_blocks(rng, qtype, 53, 160)
    xs = []
    for m in (1, 2, 15, 16, 17, 33, 130):
        x = torch.from_numpy(rng.normal(0.0, 1.0, (m, 160)) * rng.lognormal(0, 1, (1, 160)))
        x[0, :32] = 0.0  # an all-zero block: scale 0
        xs.append(x.to(dtype))
    check_avx2(avx2, portable, raw, qtype, xs)


def extreme_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int) -> np.ndarray:
    """Blocks whose codes sit at the ends of their range, where a saturating int16 sum would
    show, in turn by row: Q8_0 all q = 0 (file value -128), all q = 255 (127), q alternately
    255 and 0, random; Q4_1 all nibbles 15, k < 16 at 0 and k >= 16 at 15, random. Scales are
    normal float16 values, so no product hides behind a zero or subnormal scale."""
    raw = random_blocks(rng, qtype, rows, cols).reshape(rows, cols // 32, -1)
    raw[..., 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    codes = raw[..., 2:] if qtype == "Q8_0" else raw[..., 4:]
    ends = ([[0x80], [0x7F], [0x7F, 0x80], None] if qtype == "Q8_0"
            else [[0xFF], [0xF0], None])
    for r in range(rows):
        end = ends[r % len(ends)]
        if end is not None:
            codes[r] = np.resize(np.array(end, dtype=np.uint8), codes.shape[-1])
    return raw.reshape(rows, -1)


def extreme_x(m: int, cols: int) -> torch.Tensor:
    """Rows whose blocks quantize to all +127, all -127, alternating +-127, and random values:
    per block the largest products of a pair (2 * 15 * 127 with nibbles, 2 * 255 * 127 with
    Q8_0 codes) and of the 8 groups summed (8 * 2 * 15 * 127 = 30480, just inside int16)."""
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    pattern = torch.tensor([1.0, -1.0] * 16)
    for r in range(m):
        for b in range(cols // 32):
            kind = (r + b) % 4
            if kind < 3:
                x[r, 32 * b:32 * b + 32] = 0.75 * (pattern if kind == 2 else 1 - 2 * kind)
    return x


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_avx2_build_is_exact_at_the_extreme_codes(avx2, portable, qtype, dtype):
    """vpmaddubsw saturates its int16 pair sums: every block here reaches the largest sums the
    AVX2 path forms, and the result must still be the oracle's and the portable build's."""
    raw = extreme_blocks(np.random.default_rng(4), qtype, 37, 192)
    check_avx2(avx2, portable, raw, qtype, [extreme_x(m, 192).to(dtype) for m in (1, 16, 19)])


def test_avx2_bf16_output_rounds_half_to_even(avx2, portable):
    """Outputs that are exact odd integers in [257, 381]: halfway between two bfloat16 values,
    so they must round to the even one as torch does (257 -> 256, 259 -> 260). With x = (127,
    1, 0, ...) the scale is 1 and xq = x; Q8_0 codes (2, y - 254, 0, ...) with d = 1, m = -128
    make every float32 operation exact and y = 2 * 127 + (y - 254)."""
    ys = np.arange(257, 383, 2)
    raw = np.zeros((len(ys), 34), dtype=np.uint8)
    raw[:, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    raw[:, 2] = 2
    raw[:, 3] = (ys - 254).astype(np.int8).view(np.uint8)
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, :2] = torch.tensor([127.0, 1.0])
    exact = torch.from_numpy(ys.astype(np.float32))[None]
    want = exact.to(torch.bfloat16)
    assert want[0, 0] == 256 and want[0, 1] == 260  # ties, to even
    for kernel in (avx2, portable, None):
        weight = pack_int8(GGUFBlocks("Q8_0", torch.from_numpy(raw), 32), kernel=kernel)
        assert torch.equal(int8_linear(x.float(), weight, kernel=kernel), exact)
        assert torch.equal(int8_linear(x, weight, kernel=kernel), want)


@pytest.mark.parametrize("build", ["simd", "avx2", "portable"])
def test_activation_quantization_is_the_stated_float32_arithmetic(request, build):
    kernel = load_int8() if build == "simd" else request.getfixturevalue(build)
    rng = np.random.default_rng(5)
    x = rng.normal(0.0, 1.0, (7, 96)) * rng.lognormal(0, 2, (1, 96))
    x[2, 32:64] = 0.0
    x[3, 5] = 1e-30  # tiny but nonzero absmax
    for dtype in (torch.float32, torch.bfloat16):
        xt = torch.from_numpy(x).to(dtype)
        q, d, s = quantize_oracle(xt.float().numpy())
        xq, xd, xs = kernel.quantize(xt, 2)  # block-major: [K/32, M, 32], [K/32, M]
        assert np.array_equal(xq.permute(1, 0, 2).reshape(7, 96).numpy(), q)
        assert np.array_equal(xd.T.numpy(), d)
        assert np.array_equal(xs.T.numpy(), s)


def test_packed_tiles_hold_the_file_weights():
    """Reads the packed layout as int8_matmul.cpp documents it and compares each weight's
    q, d and m with the file's block bytes."""
    rng = np.random.default_rng(9)
    for qtype, cols in (("Q4_1", 64), ("Q8_0", 96)):
        rows, nb = 21, cols // 32  # 2 tiles, the second padded
        raw = random_blocks(rng, qtype, rows, cols)
        packed = pack_int8(GGUFBlocks(qtype, torch.from_numpy(raw), cols)).packed.numpy()
        tb = 320 if qtype == "Q4_1" else 576
        tiles = packed.reshape(2, nb, tb)
        blocks = raw.reshape(rows, nb, -1)
        for n in range(32):
            t, j = divmod(n, 16)
            for b in range(nb):
                tile = tiles[t, b]
                scales = tile[tb - 64:].copy().view(np.float16)
                if qtype == "Q4_1":
                    vec = tile[:256].reshape(4, 16, 4)[:, j]  # [h, u]
                    q = np.concatenate([vec & 15, vec >> 4]).reshape(32)
                else:
                    q = tile[:512].reshape(8, 16, 4)[:, j].reshape(32)
                if n >= rows:
                    assert not q.any() and not scales[[j, 16 + j]].any()
                    continue
                blk = blocks[n, b]
                d = blk[0:2].copy().view(np.float16)[0]
                if qtype == "Q4_1":
                    want = np.concatenate([blk[4:] & 15, blk[4:] >> 4])
                    m = blk[2:4].copy().view(np.float16)[0]
                else:
                    want = (blk[2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
                    m = np.float16(-128.0 * np.float32(d))
                assert np.array_equal(q, want)
                assert scales[j].tobytes() == d.tobytes()
                assert scales[16 + j].tobytes() == np.float16(m).tobytes()


def test_result_does_not_depend_on_the_thread_count():
    rng = np.random.default_rng(3)
    raw = random_blocks(rng, "Q4_1", 300, 128)
    weight = pack_int8(GGUFBlocks("Q4_1", torch.from_numpy(raw), 128))
    x = torch.randn(150, 128, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int8_linear(x, weight)
        torch.set_num_threads(2)
        two = int8_linear(x, weight)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bad_inputs_name_the_argument():
    raw = random_blocks(np.random.default_rng(1), "Q8_0", 16, 64)
    blocks = GGUFBlocks("Q8_0", torch.from_numpy(raw), 64)
    weight = pack_int8(blocks)
    with pytest.raises(ValueError, match=r"x: expected a \[M, 64\] tensor, got \(2, 32\)"):
        int8_linear(torch.zeros(2, 32), weight)
    with pytest.raises(ValueError, match="x: expected a float32 or bfloat16 CPU tensor, got "
                                         "torch.float16"):
        int8_linear(torch.zeros(2, 64, dtype=torch.float16), weight)
    other = Int8Weight("Q8_0", weight.packed, 8, 64)
    with pytest.raises(ValueError, match=r"int8: expected shape \(16, 64\)"):
        QuantizedWeight(blocks, torch.zeros(16, 64), int8=other)


TEXTS = ["The capital of France is",
         "Once upon a time, in a land far away, there lived a kind old man who",
         "1, 2, 3,",
         "def fibonacci(n):",
         "The three primary colours are",
         "Water boils at",
         "Explain why the sky is blue.",
         "Write a haiku about autumn leaves."]
NEW_TOKENS = 16
NEAR_TIE = 0.5  # nats. Largest gaps seen: 0.12 here; over 12 prompts x 48 tokens
# (bench/quant_accuracy.py, bench/results/2026-11-30-quant-accuracy-cpu/) 0.38 in bf16,
# 0.52 in float32


@pytest.mark.usefixtures("one_torch_thread")
def test_engine_picks_only_transformers_near_ties(hf_default_model, monkeypatch):
    """Greedy decoding with every matmul in int8 (bf16 activations, the serving setting): at
    every position, the token the engine picks is transformers' (float32) own choice for that
    context or within NEAR_TIE nats of it, and most prompts keep transformers' whole greedy
    continuation. A wrong weight, scale or row would pick tokens transformers rates far lower."""
    import engine.model.decoder as decoder
    from bench.quant_accuracy import gaps
    from engine import LLM, SamplingParams
    from engine.model.loader import load_model

    loaded = load_model(None, dtype=torch.bfloat16, quantization="gguf-int8")
    assert loaded.quantization == "gguf-int8"
    weights = [w for layer in loaded.model.layers for w in vars(layer).values()
               if isinstance(w, QuantizedWeight)] + [loaded.model.lm_head]
    assert len(weights) == 4 * len(loaded.model.layers) + 1
    assert all(w.int8 is not None for w in weights)
    calls = []
    kernel = decoder.int8_linear
    monkeypatch.setattr(decoder, "int8_linear", lambda x, w: calls.append(1) or kernel(x, w))
    monkeypatch.setattr(decoder, "quantized_linear", None)  # never the float path

    prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
    llm = LLM(model=loaded, kv_fill=float("nan"), num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [params] * len(prompts),
                        use_tqdm=False)
    assert calls
    kept = 0
    for ids, out in zip(prompts, outs):
        gap = gaps(hf_default_model, ids, out.outputs[0].token_ids)
        assert max(gap) <= NEAR_TIE, (TEXTS[prompts.index(ids)], gap)
        kept += all(g == 0 for g in gap)
    assert kept >= len(prompts) // 2 - 1, f"only {kept} of {len(prompts)} continuations kept"
