"""bench.tune_decode's variant syntax and the scoping of a variant's settings (the timing itself
needs a GPU; bench/results/ holds its output from one)."""

from __future__ import annotations

import os

import pytest
import torch

from bench import tune_decode
from cuda.paged_cuda import settings


def test_parse_variant_reads_backend_and_settings():
    assert tune_decode.parse_variant("cuda") == ("cuda", {})
    assert tune_decode.parse_variant("triton:PROGRAMS_PER_SM=8,PAGED_KERNELS_X=1") == (
        "triton", {"PROGRAMS_PER_SM": "8", "PAGED_KERNELS_X": "1"})


@pytest.mark.parametrize("text", ["triton:HOME=/", "triton:PROGRAMS_PER_SM", "cuda:=3"])
def test_parse_variant_rejects_unknown_or_malformed_settings(text):
    with pytest.raises(ValueError, match="variant"):
        tune_decode.parse_variant(text)


def test_applied_sets_and_restores_settings(monkeypatch):
    pytest.importorskip("triton")
    from triton_impl import decode

    monkeypatch.delenv("PAGED_KERNELS_TUNE_PROBE", raising=False)
    before = decode.PROGRAMS_PER_SM
    with tune_decode.applied({"PROGRAMS_PER_SM": str(before + 3),
                              "PAGED_KERNELS_TUNE_PROBE": "7"}):
        assert decode.PROGRAMS_PER_SM == before + 3
        assert os.environ["PAGED_KERNELS_TUNE_PROBE"] == "7"
    assert decode.PROGRAMS_PER_SM == before
    assert "PAGED_KERNELS_TUNE_PROBE" not in os.environ


@pytest.mark.parametrize("shapes", [["3x"], ["0x4096"], ["32-4096"]])
def test_bad_shapes_are_refused_before_any_timing(shapes, capsys):
    with pytest.raises(SystemExit):
        tune_decode.main(["--shapes", *shapes])
    assert "--shapes" in capsys.readouterr().err


def test_default_variants_and_shapes_parse():
    """The defaults a GPU run times without arguments are valid (a misspelt CUDA setting or value
    would fail here, not on the GPU)."""
    for text in [*tune_decode.VARIANTS, *tune_decode.PREFILL_VARIANTS]:
        tune_decode.parse_variant(text)
    assert {"cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32",
            "cuda"} <= set(tune_decode.VARIANTS)
    assert {"cuda", "cuda:PAGED_KERNELS_CUDA_VARLEN_WARPS=8"} <= set(tune_decode.PREFILL_VARIANTS)


@pytest.mark.parametrize("text,match", [
    ("cuda:PAGED_KERNELS_CUDA_DECODE=simt", "not a setting of the CUDA planner"),
    ("cuda:PAGED_KERNELS_CUDA_DECODE_TILE=48", "expected 64 or 32"),
    ("cuda:PAGED_KERNELS_CUDA_VARLEN_STAGES=1", "not a setting of the CUDA planner"),
    ("cuda:PAGED_KERNELS_CUDA_VARLEN_WARPS=2", "expected 4 or 8"),
    ("cuda:PAGED_KERNELS_CUDA_PARTITION=100", "multiple of 16")])
def test_cuda_settings_are_checked_before_timing(text, match):
    with pytest.raises(ValueError, match=match):
        tune_decode.parse_variant(text)


def test_parse_shape_decode_and_prefill():
    decode, prefill = tune_decode.parse_shape("32x4096"), tune_decode.parse_shape("8x8192x512")
    assert (decode.kind, decode.batch, decode.context, decode.q_len) == ("decode", 32, 4096, 1)
    assert (prefill.kind, prefill.batch, prefill.context, prefill.q_len) == (
        "prefill", 8, 8192, 512)
    for bad in ("8x512x1024", "1x2x3x4", "ax4", "4x0"):
        with pytest.raises(ValueError, match="BATCHxCONTEXT"):
            tune_decode.parse_shape(bad)


@pytest.mark.parametrize("args,flag", [
    (["--prefill-shapes", "32x4096"], "--prefill-shapes"),
    (["--shapes", "1x4096x4096"], "--shapes"),
    (["--prefill-variants", "cuda:PAGED_KERNELS_CUDA_VARLEN_WARPS=0"], "--prefill-variants")])
def test_bad_prefill_arguments_are_refused_before_any_timing(args, flag, capsys):
    with pytest.raises(SystemExit):
        tune_decode.main(args)
    assert flag in capsys.readouterr().err


def test_run_sets_each_variants_settings_for_its_own_timing(monkeypatch):
    """`run` on the CPU with backend "cuda-host" standing in for the GPU (timing replaced by one
    call): every variant is timed with its own settings in the environment and nobody else's,
    each row has the metrics and SDPA ratio, and the emulated kernels' outputs under each
    variant agree with SDPA (decode with 32-key tiles, prefill with 4 and 8 varlen warps)."""
    pytest.importorskip("triton")  # `applied` imports the triton heuristic's module
    import paged_kernels as pk

    if "cuda-host" not in pk.available_backends():
        pytest.skip("cuda-host unavailable")
    from bench import kernels

    seen = []
    prepare = kernels.prepare
    monkeypatch.setattr(kernels, "prepare", lambda b, shape, dtype, device: prepare(
        b, shape, torch.float16, "cpu"))

    def one_call(prepared, repeat):
        seen.append({k: v for k, v in os.environ.items() if k.startswith("PAGED_KERNELS_CUDA")})
        prepared.run()
        return 1e-3

    monkeypatch.setattr(kernels, "graph_seconds", one_call)
    monkeypatch.setattr(tune_decode, "copy_bandwidth", lambda device: {"copy_GBps": 100.0})
    for name in settings.PLAN_ENVS:
        monkeypatch.delenv(name, raising=False)
    small = {"num_heads": 8, "num_kv_heads": 2, "head_size": 64}
    shapes = [kernels.Shape("decode", 2, 200, **small),
              kernels.Shape("prefill", 1, 96, 80, **small)]
    variants = ["cuda-host", "cuda-host:PAGED_KERNELS_CUDA_DECODE_TILE=32",
                "cuda-host:PAGED_KERNELS_CUDA_VARLEN_WARPS=8"]
    rows = tune_decode.run(variants, shapes, repeat=1)
    assert [r["variant"] for r in rows] == [kernels.SDPA, *variants] * 2
    assert seen == [{}, {}, {"PAGED_KERNELS_CUDA_DECODE_TILE": "32"},
                    {"PAGED_KERNELS_CUDA_VARLEN_WARPS": "8"}] * 2
    for r in rows:
        assert "error" not in r, r
        assert r["us"] == pytest.approx(1000.0) and r["x_sdpa"] == pytest.approx(1.0)
        if r["variant"] != kernels.SDPA:
            assert r["rel_err_vs_sdpa"] < 1e-2, r
    assert not any(k.startswith("PAGED_KERNELS_CUDA") for k in os.environ)


def test_cuda_summary_names_the_fastest_cuda_variant_per_shape():
    def row(variant, us, batch=32, kind="decode", q_len=1):
        return {"variant": variant, "kind": kind, "batch": batch, "context": 4096,
                "q_len": q_len, "us": us}

    failed = row("cuda:PAGED_KERNELS_CUDA_DECODE_STAGES=3", 0.0)
    del failed["us"]  # a variant that failed has no time
    rows = [row("torch-sdpa", 100.0), row("triton", 90.0), row("cuda", 160.0),
            row("cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32", 120.0), failed,
            row("cuda", 50.0, batch=1), row("cuda:X=1", 55.0, batch=1),
            row("cuda", 900.0, kind="prefill", q_len=512)]
    assert tune_decode.cuda_summary(rows) == [
        ("decode 32x4096: fastest cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32 120.0 us = 0.750 x "
         "cuda's 160.0 us"),
        "decode 1x4096: fastest cuda 50.0 us = 1.000 x cuda's 50.0 us",
        "prefill 32x4096x512: fastest cuda 900.0 us = 1.000 x cuda's 900.0 us"]
