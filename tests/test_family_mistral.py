"""Mistral against transformers: a tiny random checkpoint (Mistral 7B's 4:1 grouped-query
layout scaled down) whose every layer slides over a window shorter than the prompts, in every
harness case, then in the small case through the cuda-host kernels and the Triton
interpreter."""

from __future__ import annotations

import pytest

from engine.model.families import config_from_hf
from family_case import (assert_engine_matches_transformers, assert_small_case_matches,
                         write_checkpoint)


def mistral_config(**overrides):
    """A small `transformers.MistralConfig`: 8 query heads over 2 KV heads of size 64 (the
    cuda-host kernels' smallest), sliding window 7."""
    import transformers

    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=128, rms_norm_eps=1e-5, sliding_window=7,
                  bos_token_id=1, eos_token_id=2)
    return transformers.MistralConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("mistral")), mistral_config())


def test_config_slides_every_layer_over_its_window():
    config = config_from_hf(mistral_config().to_dict())
    assert config.architecture == "mistral"
    assert [config.layer_window(i) for i in range(2)] == [7, 7]


def test_config_without_window_attends_to_everything():
    config = config_from_hf(mistral_config(sliding_window=None).to_dict())
    assert [config.layer_window(i) for i in range(2)] == [None, None]


def test_config_refuses_another_activation():
    raw = {**mistral_config().to_dict(), "hidden_act": "gelu"}
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf(raw)


def test_engine_matches_transformers(checkpoint):
    assert_engine_matches_transformers(checkpoint)


@pytest.mark.parametrize("backend", ["cuda-host", "triton"])
def test_kernel_backends_match_transformers(checkpoint, backend):
    if backend == "triton":
        pytest.importorskip("triton_env")  # skips where Triton is unusable
    assert_small_case_matches(checkpoint, backend=backend)
