"""Phi-3 against transformers on a tiny random checkpoint (tests/family_case.py): fused
`qkv_proj` / `gate_up_proj` tensors, Phi-3-medium's 4:1 grouped-query layout (heads of 64, a size
the cuda-host kernels compile), a sliding window
shorter than the prompts on every layer; through the default backend in every harness case and
through the cuda-host emulator and the Triton interpreter on one case each."""

from __future__ import annotations

import pytest

from engine.model.families import config_from_hf
from family_case import (assert_engine_matches_transformers, engine_greedy, prompts,
                         transformers_greedy, write_checkpoint)

WINDOW = 8


def phi3_config(**overrides):
    """A tiny Phi3Config: 4 query heads over 1 KV head of size 64, window `WINDOW`."""
    import transformers

    settings = dict(vocab_size=300, hidden_size=256, intermediate_size=96, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                    original_max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1,
                    eos_token_id=2, pad_token_id=0, sliding_window=WINDOW)
    return transformers.Phi3Config(**{**settings, **overrides})


@pytest.fixture(scope="module")
def phi3_path(tmp_path_factory) -> str:
    return write_checkpoint(str(tmp_path_factory.mktemp("phi3")), phi3_config())


def test_phi3_config_fields(phi3_path) -> None:
    import json
    import os

    with open(os.path.join(phi3_path, "config.json")) as f:
        config = config_from_hf(json.load(f))
    assert (config.architecture, config.fused_checkpoint, config.head_dim) == ("phi3", True, 64)
    assert config.layer_types == ["sliding_attention"] * 3 and config.sliding_window == WINDOW
    assert config.rope_scaling is None and config.num_key_value_heads == 1


def test_phi3_matches_transformers(phi3_path) -> None:
    assert_engine_matches_transformers(phi3_path)


@pytest.mark.parametrize("backend", ["cuda-host", "triton"])
def test_phi3_kernel_backends_match_transformers(phi3_path, backend) -> None:
    """One short batch (prompts and continuations both past the window) through a backend
    whose window path runs here only under a real model."""
    if backend == "triton":
        pytest.importorskip("triton_env")  # skips where Triton is unusable
    batch = prompts(3, lens=(13, 6))
    want = transformers_greedy(phi3_path, batch, new_tokens=6)
    got, _ = engine_greedy(phi3_path, batch, new_tokens=6, backend=backend,
                           max_num_batched_tokens=8, enable_prefix_caching=False)
    assert got == want


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"),
                                          ("partial_rotary_factor", 0.75)])
def test_phi3_refuses_what_it_cannot_run(field, value) -> None:
    raw = phi3_config().to_dict()
    raw["architectures"] = ["Phi3ForCausalLM"]
    if field == "partial_rotary_factor":
        raw["rope_parameters"] = {**raw["rope_parameters"], field: value}
    else:
        raw[field] = value
    with pytest.raises(ValueError, match=field):
        config_from_hf(raw)
