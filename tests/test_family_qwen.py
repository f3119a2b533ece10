"""Qwen2/Qwen2.5 and Qwen3 against transformers on tiny random checkpoints.

Qwen2: Qwen2.5-0.5B's 7:1 grouped-query layout (14 query heads over 2 KV heads of 64) with
biased Q, K and V, `use_sliding_window` with `max_window_layers=1`: the first layer attends to
everything, the second slides over a window shorter than the prompts. Qwen3: Qwen3-0.6B's 2:1
layout with heads larger than hidden_size / heads, per-head Q/K norms, the same window layout.
Each runs chunked prefill, prefix-cache hits and one preemption mode of the harness
(tests/family_case.py), then the small case through the cuda-host kernels and the Triton
interpreter.
"""

from __future__ import annotations

import pytest

from engine.model.families import config_from_hf
from family_case import (assert_engine_matches_transformers, assert_small_case_matches,
                         write_checkpoint)

WINDOW = 6
FAMILIES = ("qwen2", "qwen3")


def qwen2_config(**overrides):
    """A small `transformers.Qwen2Config`: 14 query heads over 2 KV heads of size 64, two
    layers, the second sliding over `WINDOW` positions, rotary base 1e6 and tied embeddings
    (as Qwen2.5-0.5B)."""
    import transformers

    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=128, rms_norm_eps=1e-6, use_sliding_window=True,
                  sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  bos_token_id=1, eos_token_id=2)
    return transformers.Qwen2Config(**{**fields, **overrides})


def qwen3_config(**overrides):
    """A small `transformers.Qwen3Config`: 4 query heads over 2 KV heads of size 64 (more than
    hidden_size / heads), two layers, the second sliding over `WINDOW` positions."""
    import transformers

    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=128, rms_norm_eps=1e-6, use_sliding_window=True,
                  sliding_window=WINDOW, max_window_layers=1, bos_token_id=1, eos_token_id=2)
    return transformers.Qwen3Config(**{**fields, **overrides})


CONFIGS = {"qwen2": qwen2_config, "qwen3": qwen3_config}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family's checkpoint directory, written on first use."""
    paths: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in paths:
            path = str(tmp_path_factory.mktemp(family))
            paths[family] = write_checkpoint(path, CONFIGS[family]())
        return paths[family]

    return get


# --- config translation ---------------------------------------------------------------------

def raw_config(family: str, **overrides) -> dict:
    """The config.json dict transformers writes for the family's small config."""
    return CONFIGS[family](**overrides).to_dict()


def test_qwen2_biases_qkv_only():
    config = config_from_hf(raw_config("qwen2"))
    assert config.architecture == "qwen2"
    assert (config.qkv_bias, config.o_bias, config.mlp_bias, config.qk_norm) == (
        True, False, False, False)
    assert (config.rope_theta, config.tie_word_embeddings) == (1e6, True)


def test_qwen3_norms_qk_and_biases_as_its_config_says():
    config = config_from_hf(raw_config("qwen3"))
    assert config.architecture == "qwen3"
    assert (config.qk_norm, config.qkv_bias, config.o_bias) == (True, False, False)
    biased = config_from_hf(raw_config("qwen3", attention_bias=True))
    assert (biased.qkv_bias, biased.o_bias, biased.mlp_bias) == (True, True, False)


def test_qwen3_head_dim_defaults_to_transformers_default():
    raw = raw_config("qwen3")
    del raw["head_dim"]
    assert config_from_hf(raw).head_dim == 128


@pytest.mark.parametrize("family", FAMILIES)
def test_layers_from_max_window_layers_slide(family):
    config = config_from_hf(raw_config(family, num_hidden_layers=4, max_window_layers=1))
    assert [config.layer_window(i) for i in range(4)] == [None, WINDOW, WINDOW, WINDOW]


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_without_layer_types_is_derived_as_transformers_does(family):
    """Configs written before `layer_types` existed: the layers from max_window_layers on."""
    raw = raw_config(family, num_hidden_layers=3, max_window_layers=2)
    del raw["layer_types"]
    config = config_from_hf(raw)
    assert [config.layer_window(i) for i in range(3)] == [None, None, WINDOW]


@pytest.mark.parametrize("family", FAMILIES)
def test_window_counts_only_with_use_sliding_window(family):
    """Qwen2.5's released configs: a sliding_window, but use_sliding_window false."""
    raw = {**raw_config(family), "use_sliding_window": False}
    del raw["layer_types"]
    config = config_from_hf(raw)
    assert [config.layer_window(i) for i in range(2)] == [None, None]


@pytest.mark.parametrize("family", FAMILIES)
def test_sliding_layers_without_window_are_refused(family):
    raw = {**raw_config(family), "use_sliding_window": False}
    with pytest.raises(ValueError, match="use_sliding_window"):
        config_from_hf(raw)


@pytest.mark.parametrize("family", FAMILIES)
def test_another_activation_is_refused(family):
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf({**raw_config(family), "hidden_act": "gelu"})


# --- the engine against transformers --------------------------------------------------------

#: The harness cases of each family: both preempt, one by recompute, one by swap (the two
#: modes do not depend on the family; tests/test_family_mistral.py runs both on one model).
HARNESS_CASES = {"qwen2": ("chunked", "prefix", "recompute"),
                 "qwen3": ("chunked", "prefix", "swap")}


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_matches_transformers(checkpoints, family):
    assert_engine_matches_transformers(checkpoints(family), cases=HARNESS_CASES[family])


@pytest.mark.parametrize("backend", ["cuda-host", "triton"])
@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_backends_match_transformers(checkpoints, family, backend):
    if backend == "triton":
        pytest.importorskip("triton_env")  # skips where Triton is unusable
    assert_small_case_matches(checkpoints(family), backend=backend)
