"""Llama 3.x against transformers: tiny random checkpoints (Llama 3 8B's 4:1 grouped-query layout
scaled down) with Llama 3.1's rotary scaling and biases on attention and MLP in every harness
case, then in the small case through the cuda-host kernels and the Triton interpreter; a linear
scaling with chunked prefill; a dynamic (NTK) scaling past `max_position_embeddings`.

Dynamic NTK rotates a token with its sequence's length at the step that computes it, so the
engine equals transformers (which computes a prompt in one forward) only where no key is
computed in a step of another length than transformers': its cases are the prefix-cache hits
(on blocks shorter than `max_position_embeddings`) and preemption by swap, never chunked prefill
or recompute.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.families import config_from_hf
from engine.model.rope import RotaryEmbedding
from family_case import (assert_engine_matches_transformers, assert_small_case_matches,
                         write_checkpoint)

#: Llama 3.1's scaling with a short original length: wavelengths under 8 positions kept,
#: over 32 divided by 8, smoothed between (all three bands occur at head_dim 64).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 10000.0}
#: Dynamic NTK over a 48-position training length: prompt plus continuation reach 69.
DYNAMIC_MAX_POS = 48


def llama_config(rope_parameters=None, **overrides):
    """A small `transformers.LlamaConfig`: 8 query heads over 2 KV heads of size 64 (the
    cuda-host kernels' smallest)."""
    import transformers

    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, rope_parameters=dict(rope_parameters or LLAMA3))
    return transformers.LlamaConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def llama3_checkpoint(tmp_path_factory):
    cfg = llama_config(attention_bias=True, mlp_bias=True)
    return write_checkpoint(str(tmp_path_factory.mktemp("llama3")), cfg)


def test_config_reads_llama3_scaling_and_biases():
    config = config_from_hf(llama_config(attention_bias=True, mlp_bias=True).to_dict())
    assert config.architecture == "llama" and config.rope_theta == 1e4
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (True, True, True)
    assert config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_scaling["original_max_position_embeddings"] == 32
    scaled = RotaryEmbedding(64, 1e4, config.rope_scaling, 128).trained_inv_freq
    plain = RotaryEmbedding(64, 1e4, None, 128).trained_inv_freq
    kept, divided = scaled == plain, torch.isclose(scaled, plain / 8)
    assert kept.any() and divided.any() and not (kept | divided).all()


def test_config_dynamic_stretches_the_length_and_refuses_unknown_scalings():
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    config = config_from_hf(llama_config(dynamic, max_position_embeddings=48).to_dict())
    assert config.max_positions == 96
    raw = {**llama_config().to_dict(), "rope_parameters": {"rope_type": "mrope",
                                                           "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="mrope"):
        config_from_hf(raw)


def test_llama3_with_biases_matches_transformers(llama3_checkpoint):
    assert_engine_matches_transformers(llama3_checkpoint)


def test_linear_scaling_matches_transformers(tmp_path):
    linear = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    path = write_checkpoint(str(tmp_path), llama_config(linear))
    assert_engine_matches_transformers(path, cases=("chunked",))


def test_dynamic_scaling_past_max_position_embeddings_matches_transformers(tmp_path):
    """Prompts of 37 and 23 tokens plus 32 new ones pass the 48 trained positions (usable: 96);
    unchunked cases only (module docstring)."""
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    cfg = llama_config(dynamic, max_position_embeddings=DYNAMIC_MAX_POS)
    path = write_checkpoint(str(tmp_path), cfg)
    assert_engine_matches_transformers(path, cases=("prefix", "swap"))


@pytest.mark.parametrize("backend", ["cuda-host", "triton"])
def test_kernel_backends_match_transformers(llama3_checkpoint, backend):
    if backend == "triton":
        pytest.importorskip("triton_env")  # skips where Triton is unusable
    assert_small_case_matches(llama3_checkpoint, backend=backend)
