"""Gemma 2 and Gemma 3 (text) against transformers on tiny random checkpoints.

Gemma 2: Gemma 2 2B's 2:1 grouped-query layout scaled down, sliding layers alternating with
global ones over a window shorter than the prompts, both soft caps small enough to bite, a
`query_pre_attn_scalar` other than the head size. Gemma 3: Gemma 3 1B's 4:1 layout, three local
layers to one global, Q/K norms, two rotary bases. Norm weights are centred on 0 (RMSNorm
multiplies by `1 + w`). Head size 64: the smallest the cuda-host kernels are built for.
"""

from __future__ import annotations

import pytest

from engine.model.families import config_from_hf
from family_case import (SMALL_CHUNK, SMALL_LENS, SMALL_NEW_TOKENS,
                         assert_engine_matches_transformers, prompts, write_checkpoint)

#: Shorter than the prompts, also than the longer one of the small case (`SMALL_LENS`).
WINDOW = 6


def gemma2_config(**overrides):
    """A small `transformers.Gemma2Config`: 4 query heads over 2 KV heads, 4 layers (even ones
    slide over `WINDOW` positions), caps 4 on the attention scores and 3 on the logits."""
    import transformers

    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  query_pre_attn_scalar=48, max_position_embeddings=128, rms_norm_eps=1e-6,
                  sliding_window=WINDOW, attn_logit_softcapping=4.0,
                  final_logit_softcapping=3.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.Gemma2Config(**{**fields, **overrides})


def gemma3_config(**overrides):
    """A small `transformers.Gemma3TextConfig`: 4 query heads over 1 KV head, 4 layers (the
    last one global, the others slide over `WINDOW` positions), rotary bases 1e6 (global,
    scaled linearly by 8 as in the released 4B-27B configs) and 1e4 (local, not scaled),
    `query_pre_attn_scalar` other than the head size (as Gemma 3 27B's)."""
    import transformers

    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                  query_pre_attn_scalar=96, max_position_embeddings=128, rms_norm_eps=1e-6,
                  sliding_window=WINDOW, sliding_window_pattern=4, rope_theta=1e6,
                  rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.Gemma3TextConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def gemma2_checkpoint(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("gemma2")), gemma2_config(),
                            norm_center=0.0)


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("gemma3")), gemma3_config(),
                            norm_center=0.0)


def transformers_logprobs(path, prompt, new_tokens):
    """transformers' greedy continuation of `prompt` and the log-softmax `[new_tokens, vocab]`
    of its logits at each generated token (float32)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return out.sequences[0, len(prompt):].tolist(), logprobs


def assert_logprobs_match(path, lens=SMALL_LENS, new_tokens=SMALL_NEW_TOKENS, **settings):
    """`family_case.assert_small_case_matches` plus log-probabilities: the engine's greedy
    continuations of prompts of `lens` tokens (one batch, prefilled in chunks of `SMALL_CHUNK`)
    equal transformers', and so do the log-probabilities of each new token's top 5 (within
    1e-4): a missing window or soft cap shows there even where the greedy choices hide it
    (a tiny random model soon repeats one token)."""
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(path, dtype=torch.float32, block_size=4, num_kv_blocks=64,
              max_num_batched_tokens=SMALL_CHUNK, enable_prefix_caching=False, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            logprobs=5)
    batch = prompts(lens=lens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    for prompt, output in zip(batch, outputs):
        tokens, want = transformers_logprobs(path, prompt, new_tokens)
        got = output.outputs[0]
        assert list(got.token_ids) == tokens, f"engine {got.token_ids} != transformers {tokens}"
        for step, top in enumerate(got.logprobs):
            for token, logprob in top.items():
                assert abs(logprob - want[step, token].item()) < 1e-4, (len(prompt), step,
                                                                          token)


# --- config translation ---------------------------------------------------------------------

def test_gemma2_config():
    config = config_from_hf(gemma2_config().to_dict())
    assert config.architecture == "gemma2"
    assert [config.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (4.0, 3.0)
    assert config.attention_scale == 48 ** -0.5
    assert config.embedding_multiplier == 8.0
    assert (config.norm_weight_offset, config.sandwich_norm, config.hidden_act) == (
        1.0, True, "gelu_pytorch_tanh")
    assert config.tie_word_embeddings and not config.qk_norm


def test_gemma2_config_json_without_layer_types_or_caps():
    """An older config.json: no `layer_types` (even layers slide), caps at their defaults."""
    raw = gemma2_config().to_dict()
    for key in ("layer_types", "attn_logit_softcapping", "final_logit_softcapping"):
        del raw[key]
    config = config_from_hf(raw)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)


def test_gemma3_config_from_rope_parameters():
    config = config_from_hf(gemma3_config(attn_logit_softcapping=50.0).to_dict())
    assert config.architecture == "gemma3" and config.qk_norm
    assert [config.layer_window(i) for i in range(4)] == [WINDOW, WINDOW, WINDOW, None]
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    # transformers' Gemma 3 attention ignores attn_logit_softcapping
    assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None


def test_gemma3_older_config_json():
    """transformers 4's spelling: `rope_theta`, `rope_local_base_freq`, `rope_scaling` for the
    global layers only, `sliding_window_pattern` instead of `layer_types`."""
    raw = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=300,
               hidden_size=64, intermediate_size=96, num_hidden_layers=7,
               num_attention_heads=4, num_key_value_heads=1, head_dim=64,
               rope_theta=5e5, rope_local_base_freq=2e4, sliding_window=WINDOW,
               sliding_window_pattern=6, rope_scaling={"rope_type": "linear", "factor": 8.0},
               attn_logit_softcapping=None, final_logit_softcapping=None)
    config = config_from_hf(raw)
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention",
                                                              "sliding_attention"]
    assert (config.rope_theta, config.local_rope_theta) == (5e5, 2e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}


@pytest.mark.parametrize("raw", [
    {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
     "text_config": {"model_type": "gemma3_text"}},
    {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3_text"},
], ids=["nested", "flat"])
def test_gemma3_multimodal_config_is_refused(raw):
    if "text_config" in raw:
        raw = {**raw, "text_config": gemma3_config().to_dict()}
    else:
        raw = {**gemma3_config().to_dict(), **raw}
    with pytest.raises(ValueError, match="only the text model is supported"):
        config_from_hf(raw)


@pytest.mark.parametrize("make, key, value", [
    (gemma2_config, "hidden_activation", "gelu"),
    (gemma3_config, "hidden_activation", "silu"),
    (gemma3_config, "use_bidirectional_attention", True),
    (gemma2_config, "query_pre_attn_scalar", 0),
])
def test_unsupported_fields_are_refused(make, key, value):
    raw = {**make().to_dict(), key: value}
    with pytest.raises(ValueError, match=key):
        config_from_hf(raw)


def test_gemma3_scaled_local_rotary_is_refused():
    raw = gemma3_config().to_dict()
    raw["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0,
                                                   "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_parameters"):
        config_from_hf(raw)


# --- the engine against transformers --------------------------------------------------------

def test_gemma2_matches_transformers(gemma2_checkpoint):
    assert_engine_matches_transformers(gemma2_checkpoint)


def test_gemma2_logprobs_are_those_of_the_capped_logits(gemma2_checkpoint):
    """The final soft cap leaves greedy choices alone (tanh is monotonic), not the
    log-probabilities."""
    assert_logprobs_match(gemma2_checkpoint)


def test_gemma3_matches_transformers(gemma3_checkpoint):
    assert_engine_matches_transformers(gemma3_checkpoint)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_cuda_host_backend_matches_transformers(family, request):
    path = request.getfixturevalue(f"{family}_checkpoint")
    assert_logprobs_match(path, backend="cuda-host")


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_triton_interpreter_matches_transformers(family, request):
    import triton_env  # noqa: F401  (skips where Triton is unusable)

    path = request.getfixturevalue(f"{family}_checkpoint")
    assert_logprobs_match(path, backend="triton")
