"""The decoder layer's fused element-wise ops (engine/model/layer_ops.py) against float64
oracles written here, on the C++ path and on the PyTorch fallback, decode and prefill sizes
(prefill sizes take the OpenMP path)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model import layer_ops

DTYPES = [torch.float32, torch.bfloat16]
#: Relative error allowed per element: a few float32 ulp; one bfloat16 rounding (plus the
#: inputs' own rounding of intermediate values the oracle keeps exact).
TOL = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7}
ROWS = [1, 5, 70]


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    if request.param == "native":
        if layer_ops.native() is None:
            pytest.skip("the C++ layer ops could not be built here")
    else:
        monkeypatch.setattr(layer_ops, "use_native", False)
    return request.param


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    got, want = got.double(), want.double()
    err = ((got - want).abs() / want.abs().clamp_min(1e-3)).max().item()
    assert err <= TOL[dtype], f"relative error {err:.3g}"


def rms_oracle(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x, weight = x.double(), weight.double()
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_and_add(path: str, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    h = 576
    x = torch.randn(rows, h, generator=gen).to(dtype)
    residual = (3 * torch.randn(rows, h, generator=gen)).to(dtype)
    weight = torch.rand(h, generator=gen).add(0.5).to(dtype)
    close(layer_ops.rms_norm(residual, weight, 1e-5), rms_oracle(residual, weight, 1e-5), dtype)
    expected_sum = (residual.double() + x.double()).to(dtype)  # one rounding, like torch's add
    before = residual.clone()
    out = layer_ops.add_rms_norm_(residual, x, weight, 1e-5)
    assert torch.equal(residual, expected_sum), "residual += x is not the rounded sum"
    assert not torch.equal(residual, before)
    close(out, rms_oracle(expected_sum, weight, 1e-5), dtype)
    assert out.dtype == dtype and out.shape == (rows, h)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_in_place_on_the_first_heads(path: str, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(10 + rows)
    heads, rotated, d, max_pos = 7, 5, 64, 300
    x = torch.randn(rows, heads, d, generator=gen).to(dtype)
    positions = torch.randint(0, max_pos, (rows,), generator=gen)
    angles = torch.rand(max_pos, d // 2, generator=gen) * 6.0
    c, s = angles.cos(), angles.sin()  # float32 tables: the oracle uses the same values
    cos = torch.cat((c, c), dim=-1)
    sin = torch.cat((-s, s), dim=-1)  # rotate-half's sign folded in
    want = x.double().clone()
    half = d // 2
    for t in range(rows):
        ct, st = c[positions[t]].double(), s[positions[t]].double()
        x1, x2 = want[t, :rotated, :half].clone(), want[t, :rotated, half:].clone()
        want[t, :rotated, :half] = x1 * ct - x2 * st
        want[t, :rotated, half:] = x2 * ct + x1 * st
    untouched = x[:, rotated:].clone()
    layer_ops.rotary_(x, rotated, positions, cos, sin)
    # error relative to each vector's scale (a rotated pair may cancel to ~0)
    scale = want[:, :rotated].abs().amax(dim=-1, keepdim=True)
    err = ((x[:, :rotated].double() - want[:, :rotated]).abs() / scale).max().item()
    assert err <= TOL[dtype], f"relative error {err:.3g}"
    assert torch.equal(x[:, rotated:], untouched), "rotated a head past `heads`"


def test_rotary_rejects_positions_past_the_table(path: str) -> None:
    x = torch.zeros(2, 2, 8)
    table = torch.zeros(4, 8)
    with pytest.raises((RuntimeError, IndexError), match="positions|index"):
        layer_ops.rotary_(x, 2, torch.tensor([0, 4]), table, table)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul(path: str, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(20 + rows)
    n = 1536
    gate_up = (4 * torch.randn(rows, 2 * n, generator=gen)).to(dtype)
    gate_up[0, 0] = -100.0  # silu -> -0: exp's clamp
    gate_up[0, 1] = 100.0   # silu -> x
    g, u = gate_up.double().chunk(2, dim=-1)
    want = g / (1.0 + torch.exp(-g)) * u
    got = layer_ops.silu_mul(gate_up)
    assert got.shape == (rows, n) and got.dtype == dtype
    err = ((got.double() - want).abs() / want.abs().clamp_min(1e-2)).max().item()
    assert err <= TOL[dtype], f"relative error {err:.3g}"


def test_nan_stays_in_its_row(path: str) -> None:
    """A NaN poisons its own row and no other (rows are independent)."""
    x = torch.randn(3, 64).to(torch.bfloat16)
    x[1, 5] = math.nan
    weight = torch.ones(64, dtype=torch.bfloat16)
    out = layer_ops.rms_norm(x, weight, 1e-6)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()
    gate_up = torch.randn(3, 128).to(torch.bfloat16)
    gate_up[2, 3] = math.nan
    act = layer_ops.silu_mul(gate_up)
    assert torch.isnan(act[2, 3]) and torch.isnan(act).sum() == 1


@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, 1024), (16, 49152), (5, 3000)])
def test_argmax_logsumexp_against_float64(path: str, rows: int, vocab: int) -> None:
    """The sampler's one-read row statistics: the first index of each row's maximum (ties and
    a maximum in a later chunk included) and log-sum-exp, against float64."""
    gen = torch.Generator().manual_seed(rows * vocab)
    x = 8 * torch.randn(rows, vocab, generator=gen)
    x[0, vocab // 2] = x[0].max() + 3     # the maximum past the first chunk
    x[0, vocab - 1] = x[0, vocab // 2]    # a tie after it: the first one wins
    x[-1, :] = x[-1, 0]                   # a row of equal values: index 0
    best, lse = layer_ops.argmax_logsumexp(x)
    want_lse = torch.logsumexp(x.double(), dim=-1)
    want_best = [int((row == row.max()).nonzero()[0]) for row in x]
    assert best.dtype == torch.int64 and lse.dtype == torch.float32
    assert best.tolist() == want_best
    assert ((lse.double() - want_lse).abs() / want_lse.abs().clamp_min(1)).max() <= 1e-6


def test_argmax_logsumexp_nan_and_infinite_rows(path: str) -> None:
    """A row holding a NaN gets torch's answers; a row of -inf gets -inf; -inf entries weigh 0."""
    x = torch.randn(4, 2500)
    x[1, 1700] = math.nan
    x[2, :] = -math.inf
    x[3, :2000] = -math.inf
    best, lse = layer_ops.argmax_logsumexp(x)
    assert best[1] == 1700 and math.isnan(lse[1])
    assert lse[2] == -math.inf
    assert best[3] == 2000 + int(x[3, 2000:].argmax())
    assert abs(lse[3].item() - torch.logsumexp(x[3, 2000:].double(), 0).item()) < 1e-5
    assert best[0] == int(x[0].argmax())
