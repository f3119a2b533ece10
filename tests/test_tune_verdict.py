"""cuda.paged_cuda.tune_verdict: the rule that picks the CUDA planner's defaults from tune_decode's
rows, on made-up timings (the real ones need a GPU)."""

from __future__ import annotations

import pytest

from cuda.paged_cuda import tune_verdict as tv

TILE32 = "cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32"
TILE32_S4 = "cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32,PAGED_KERNELS_CUDA_DECODE_STAGES=4"
TILE32_P1024 = "cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32,PAGED_KERNELS_CUDA_PARTITION=1024"
WARPS8 = "cuda:PAGED_KERNELS_CUDA_VARLEN_WARPS=8"
DECODE = [(1, 16384), (32, 4096), (128, 4096)]
PREFILL = [(1, 4096, 4096), (8, 8192, 512)]


def rows(decode: dict[str, list[float]], prefill: dict[str, list[float]] | None = None,
         **extra) -> list[dict]:
    """tune_decode-like rows: variant -> times (us) at DECODE (and PREFILL) in order; the copy
    fraction is 100 us / time."""
    out = []
    for variant, times in decode.items():
        for (b, c), us in zip(DECODE, times):
            out.append({"variant": variant, "kind": "decode", "batch": b, "context": c,
                        "q_len": 1, "us": us, "frac_copy": 100 / us, "rel_err_vs_sdpa": 3e-3,
                        **extra.get(variant, {})})
    for variant, times in (prefill or {}).items():
        for (b, c, q), us in zip(PREFILL, times):
            out.append({"variant": variant, "kind": "prefill", "batch": b, "context": c,
                        "q_len": q, "us": us, "rel_err_vs_sdpa": 3e-3})
    return out


def test_a_variant_no_slower_anywhere_and_faster_at_32x4096_becomes_the_default():
    data = rows({"cuda": [40, 120, 110], TILE32: [40.5, 105, 100], TILE32_S4: [39, 110, 99]})
    v = tv.verdict(data)
    assert v["decode_default"] == TILE32  # the faster of the two at 32 x 4096
    assert v["target"]["cuda"] == pytest.approx(100 / 120)
    assert not v["target"]["cuda_met"]
    assert v["target"]["chosen_frac"] == pytest.approx(100 / 105) and v["target"]["chosen_met"]


@pytest.mark.parametrize("times,why", [
    ([44, 105, 100], "slower at 1 x 16384 by more than the noise"),
    ([40, 119, 100], "not faster at the key shape by more than the noise"),
])
def test_the_default_stays_when_no_variant_qualifies(times, why):
    v = tv.verdict(rows({"cuda": [40, 120, 110], TILE32: times}))
    assert v["decode_default"] == "cuda", why
    assert any("-> no" in line for line in v["why"])


@pytest.mark.parametrize("extra", [{"rel_err_vs_sdpa": 0.5}, {"rel_err_vs_sdpa": float("nan")}])
def test_a_wrong_or_nan_variant_is_never_chosen(extra):
    v = tv.verdict(rows({"cuda": [40, 120, 110], TILE32: [30, 90, 80]}, **{TILE32: extra}))
    assert v["decode_default"] == "cuda"


def test_a_variant_with_an_error_row_or_a_missing_shape_is_never_chosen():
    data = rows({"cuda": [40, 120, 110], TILE32: [30, 90, 80]})
    data[-1] = {k: data[-1][k] for k in ("variant", "kind", "batch", "context", "q_len")} | {
        "error": "RuntimeError: boom"}
    assert tv.verdict(data)["decode_default"] == "cuda"
    partial = [r for r in rows({"cuda": [40, 120, 110], TILE32: [30, 90, 80]})
               if not (r["variant"] == TILE32 and r["batch"] == 128)]
    v = tv.verdict(partial)
    assert v["decode_default"] == "cuda" and any("every shape" in line for line in v["why"])


def test_forced_partitions_are_never_defaults_but_raise_the_refit_alarm():
    data = rows({"cuda": [40, 120, 110], TILE32: [40, 118, 110], TILE32_P1024: [30, 90, 80]})
    v = tv.verdict(data)
    assert v["decode_default"] == "cuda"
    assert any("refit" in a and "32x4096" in a for a in v["alarms"])


def test_prefill_rule_a_variant_faster_at_one_prefill_shape_and_no_slower_elsewhere():
    data = rows({"cuda": [40, 120, 110]}, {"cuda": [1000, 800], WARPS8: [900, 800]})
    v = tv.verdict(data)
    assert v["prefill_default"] == WARPS8
    assert v["decode_default"] == "cuda" and not v["alarms"]
    slower = rows({"cuda": [40, 120, 110]}, {"cuda": [1000, 800], WARPS8: [900, 830]})
    assert tv.verdict(slower)["prefill_default"] == "cuda"


def test_no_clean_default_timing_decides_nothing():
    v = tv.verdict(rows({"cuda": [40, 120, 110]}, **{"cuda": {"rel_err_vs_sdpa": 1.0}}))
    assert v["decode_default"] == "cuda" and "nothing decided" in v["why"][0]
    assert v["target"]["cuda"] is not None  # the fraction is still reported


def test_summary_lines_fit_a_terminal():
    data = rows({"cuda": [40, 120, 110], TILE32_S4: [39, 100, 99]})
    lines = tv.summary_lines(tv.verdict(data))
    assert lines[0].endswith("DECODE_TILE=32,DECODE_STAGES=4")
    assert all(len(line) <= 80 for line in lines)
