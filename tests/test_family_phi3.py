"""Phi-3 against transformers on a tiny random checkpoint (tests/family_case.py): fused
`qkv_proj` / `gate_up_proj` tensors, Phi-3-medium's 4:1 grouped-query layout (heads of 64, a size
the cuda-host kernels compile), a sliding window
shorter than the prompts on every layer; through the default backend in every harness case and
through the cuda-host emulator and the Triton interpreter on one case each."""

from __future__ import annotations

import json
import os

import pytest

from engine.model.families import config_from_hf
from family_case import (assert_engine_matches_transformers, assert_small_case_matches,
                         engine_greedy, prompts, transformers_greedy, write_checkpoint)

WINDOW = 8
#: LongRoPE's pretraining length in the LongRoPE test.
ORIGINAL_LEN = 16


def phi3_config(**overrides):
    """A tiny Phi3Config: 4 query heads over 1 KV head of size 64, window `WINDOW`."""
    import transformers

    settings = dict(vocab_size=300, hidden_size=256, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                    original_max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1,
                    eos_token_id=2, pad_token_id=0, sliding_window=WINDOW)
    return transformers.Phi3Config(**{**settings, **overrides})


@pytest.fixture(scope="module")
def phi3_path(tmp_path_factory) -> str:
    return write_checkpoint(str(tmp_path_factory.mktemp("phi3")), phi3_config())


def test_phi3_config_fields(phi3_path) -> None:
    with open(os.path.join(phi3_path, "config.json")) as f:
        config = config_from_hf(json.load(f))
    assert (config.architecture, config.fused_checkpoint, config.head_dim) == ("phi3", True, 64)
    assert config.layer_types == ["sliding_attention"] * 2 and config.sliding_window == WINDOW
    assert config.rope_scaling is None and config.num_key_value_heads == 1


def test_phi3_matches_transformers(phi3_path) -> None:
    assert_engine_matches_transformers(phi3_path)


@pytest.mark.parametrize("backend", ["cuda-host", "triton"])
def test_phi3_kernel_backends_match_transformers(phi3_path, backend) -> None:
    """The small case (a prompt past the window) through a backend whose window path runs
    here only under a real model."""
    if backend == "triton":
        pytest.importorskip("triton_env")  # skips where Triton is unusable
    assert_small_case_matches(phi3_path, backend=backend)


def test_phi3_longrope_matches_transformers(tmp_path) -> None:
    """LongRoPE: a sequence longer than `ORIGINAL_LEN` all along (long factors) and one shorter
    all along (short factors), with the attention factor of 128/16, equal to transformers
    unchunked and after preemption by recompute. A sequence that crosses the length while it
    decodes is left out: transformers' Phi-3 then recomputes its whole cache with the long
    factors, the engine keeps the keys it has (docs/models.md)."""
    half = 32  # head_dim / 2
    scaling = {"rope_type": "longrope", "rope_theta": 10000.0,
               "short_factor": [1.0 + 0.02 * i for i in range(half)],
               "long_factor": [1.0 + 0.5 * i for i in range(half)]}
    config = phi3_config(rope_parameters=scaling, original_max_position_embeddings=ORIGINAL_LEN)
    path = write_checkpoint(str(tmp_path), config)
    with open(os.path.join(path, "config.json")) as f:
        rope = config_from_hf(json.load(f)).rope_scaling
    assert (rope["rope_type"], rope["original_max_position_embeddings"]) == ("longrope", 16)
    batch = prompts(7, lens=(ORIGINAL_LEN + 4, 5))
    new_tokens = ORIGINAL_LEN - 5  # the short one ends at ORIGINAL_LEN tokens
    want = transformers_greedy(path, batch, new_tokens)
    got, _ = engine_greedy(path, batch, new_tokens, num_kv_blocks=64)
    assert got == want
    got, engine = engine_greedy(path, batch, new_tokens, num_kv_blocks=9,
                                preemption_mode="recompute", enable_prefix_caching=False)
    assert engine.stats().num_preemptions > 0 and got == want


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
