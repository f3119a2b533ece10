"""engine.dtypes: the dtype names, and "auto" per device (bfloat16 only where it is native)."""

import pytest
import torch

from engine.dtypes import DTYPE_NAMES, auto_dtype, has_native_bf16, resolve_dtype
from engine.serve import build_parser

AVX2_ONLY = frozenset({"avx", "avx2", "fma", "f16c", "bmi2"})
ZEN4 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = AVX2_ONLY | {"avx512f", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize("flags, expected", [(AVX2_ONLY, torch.float32),
                                             (ZEN4, torch.bfloat16),
                                             (SAPPHIRE_RAPIDS, torch.bfloat16),
                                             (frozenset(), torch.float32)])
def test_auto_is_bfloat16_only_with_native_bf16_instructions(flags, expected):
    assert auto_dtype("cpu", flags) is expected
    assert has_native_bf16("cpu", flags) == (expected is torch.bfloat16)


def test_auto_on_this_cpu_follows_its_flags():
    from paged_kernels.cpp_build import cpu_flags

    native = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    assert resolve_dtype("auto") is (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("name", sorted(DTYPE_NAMES))
def test_every_name_resolves_to_a_float_dtype(name):
    assert resolve_dtype(name) in (torch.float32, torch.float16, torch.bfloat16)


def test_names_and_dtypes_pass_through():
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("half") is torch.float16
    assert resolve_dtype("fp32") is torch.float32
    assert resolve_dtype(torch.bfloat16) is torch.bfloat16


@pytest.mark.parametrize("bad", ["int8", "bfloat", "", None, 32])
def test_unknown_dtype_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"dtype: expected a torch.dtype or one of .*got"):
        resolve_dtype(bad)


def test_server_flag_takes_the_same_names():
    parser = build_parser()
    for name in DTYPE_NAMES:
        assert parser.parse_args(["--dtype", name]).dtype == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int4"])
