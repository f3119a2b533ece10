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
from paged_kernels.cpp_build import compile_flags

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402  (after the skip)
from test_quant import padded_blocks, padded_x, random_blocks  # noqa: E402

U32 = 2.0 ** -24


@pytest.fixture(scope="module")
def portable():
    """The portable (non-SIMD) build: a second build (seconds, once per machine)."""
    return load_int8(compile_flags(INT8_TIERS, frozenset()))


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


@pytest.mark.parametrize("build", ["simd", "portable"])
def test_activation_quantization_is_the_stated_float32_arithmetic(portable, build):
    kernel = portable if build == "portable" else load_int8()
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
