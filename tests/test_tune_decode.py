"""bench.tune_decode's variant syntax and the scoping of a variant's settings (the timing itself
needs a GPU; bench/results/ holds its output from one)."""

from __future__ import annotations

import os

import pytest

from bench import tune_decode


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
