"""engine/model/rope.py against transformers' own rotary embeddings (the oracle: its
`LlamaRotaryEmbedding` / `Phi3RotaryEmbedding` forward, which runs `ROPE_INIT_FUNCTIONS` and the
`dynamic_rope_update` rule), for every supported `rope_type`, on both sides of the length
thresholds of the sequence-length-dependent ones; and `check_scaling`'s refusals."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from engine.model.rope import RotaryEmbedding, check_scaling, max_positions

HEAD_DIM = 16
MAX_POS = 64
ULPS = 2 * torch.finfo(torch.float32).eps  # cos/sin are at most ~1.2 in magnitude here
SIZES = dict(vocab_size=10, hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
             num_hidden_layers=1, intermediate_size=8, max_position_embeddings=MAX_POS)
_rng = random.Random(0)
SHORT = [1 + _rng.random() for _ in range(HEAD_DIM // 2)]
LONG = [1 + 3 * _rng.random() for _ in range(HEAD_DIM // 2)]

# (rope_parameters, the sequence lengths to compare at)
LLAMA_CASES = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, (MAX_POS,)),
    "linear": ({"rope_type": "linear", "factor": 2.5, "rope_theta": 10000.0}, (MAX_POS,)),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                "rope_theta": 500000.0}, (MAX_POS,)),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
              "rope_theta": 10000.0}, (MAX_POS,)),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                     "beta_fast": 8, "beta_slow": 2, "mscale": 0.7, "mscale_all_dim": 1.0,
                     "truncate": False, "rope_theta": 10000.0}, (MAX_POS,)),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                (40, MAX_POS, MAX_POS + 1, 100)),
    "dynamic-odd-factor": ({"rope_type": "dynamic", "factor": 3.7, "rope_theta": 500000.0},
                           (MAX_POS, MAX_POS + 1, 3 * MAX_POS)),
}


def _scaling(rope_parameters: dict) -> dict:
    return {k: v for k, v in rope_parameters.items() if k != "rope_theta"}


def _hf_tables(embedding: torch.nn.Module, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin `[seq_len, head_dim]` for one sequence of `seq_len` tokens
    computed in one forward (a fresh module each time: the dynamic update keeps state)."""
    cos, sin = embedding(torch.zeros(1), torch.arange(seq_len)[None])
    return cos[0], sin[0]


def _ours(rope: RotaryEmbedding, positions: torch.Tensor,
          seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our cos and (unsigned) sin rows of tokens at `positions` of sequences `seq_lens` long."""
    rows, cos, sin = rope.for_step(positions, seq_lens)
    cos, sin = cos[rows], sin[rows].clone()
    sin[:, :HEAD_DIM // 2].neg_()
    return cos, sin


def _assert_tables(ours: tuple[torch.Tensor, torch.Tensor],
                   theirs: tuple[torch.Tensor, torch.Tensor]) -> None:
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=ULPS)


def _phi3_config() -> transformers.Phi3Config:
    return transformers.Phi3Config(**SIZES, original_max_position_embeddings=32, pad_token_id=0,
                                   eos_token_id=1, bos_token_id=1,
                                   rope_parameters={"rope_type": "longrope",
                                                    "short_factor": SHORT, "long_factor": LONG,
                                                    "rope_theta": 10000.0})


LONGROPE = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
            "original_max_position_embeddings": 32}


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_tables_equal_transformers(case: str) -> None:
    params, lengths = LLAMA_CASES[case]
    config = transformers.LlamaConfig(**SIZES, rope_parameters=dict(params))
    rope = RotaryEmbedding(HEAD_DIM, params["rope_theta"], _scaling(params), MAX_POS)
    for seq_len in lengths:
        ours = _ours(rope, torch.arange(seq_len), torch.full((seq_len,), seq_len))
        _assert_tables(ours, _hf_tables(LlamaRotaryEmbedding(config), seq_len))


@pytest.mark.parametrize("seq_len", [20, 32, 33, MAX_POS])
def test_longrope_equals_transformers_both_sides_of_original_length(seq_len: int) -> None:
    """Phi-3's rule: short factors up to `original_max_position_embeddings` (32), long ones
    beyond; the attention factor from `max_position_embeddings / 32`."""
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, LONGROPE, MAX_POS)
    ours = _ours(rope, torch.arange(seq_len), torch.full((seq_len,), seq_len))
    _assert_tables(ours, _hf_tables(Phi3RotaryEmbedding(_phi3_config()), seq_len))
    assert rope.attention_factor != 1.0


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_one_step_mixes_sequences_of_different_lengths(kind: str) -> None:
    """Tokens of one step get their own sequence's tables: a prefill chunk and decode tokens of
    sequences on both sides of the threshold, each row equal to transformers' for that
    sequence."""
    if kind == "dynamic":
        params = LLAMA_CASES["dynamic"][0]
        rope = RotaryEmbedding(HEAD_DIM, 10000.0, _scaling(params), MAX_POS)
        config = transformers.LlamaConfig(**SIZES, rope_parameters=dict(params))

        def oracle() -> torch.nn.Module:
            return LlamaRotaryEmbedding(config)
    else:
        rope = RotaryEmbedding(HEAD_DIM, 10000.0, LONGROPE, MAX_POS)

        def oracle() -> torch.nn.Module:
            return Phi3RotaryEmbedding(_phi3_config())
    lengths = [100, 30, 70, 33, MAX_POS] if kind == "dynamic" else [40, 30, 33, 32]
    prefill = 20  # the second sequence's last 20 tokens are this step's chunk
    positions = torch.tensor([lengths[0] - 1] + list(range(lengths[1] - prefill, lengths[1]))
                             + [n - 1 for n in lengths[2:]])
    seq_lens = torch.tensor([lengths[0]] + [lengths[1]] * prefill + lengths[2:])
    expected = [_hf_tables(oracle(), int(n)) for n in seq_lens]
    cos = torch.stack([c[p] for (c, _), p in zip(expected, positions)])
    sin = torch.stack([s[p] for (_, s), p in zip(expected, positions)])
    _assert_tables(_ours(rope, positions, seq_lens), (cos, sin))


def test_su_is_longrope_and_dynamic_stretches_the_usable_length() -> None:
    assert check_scaling({**LONGROPE, "type": "su", "rope_type": "su"}) == "longrope"
    assert max_positions(MAX_POS, {"rope_type": "dynamic", "factor": 2.0}) == 2 * MAX_POS
    assert max_positions(MAX_POS, {"rope_type": "linear", "factor": 2.0}) == MAX_POS
    assert RotaryEmbedding(HEAD_DIM, 1e4, {"rope_type": "dynamic", "factor": 2.0},
                           MAX_POS).max_positions == 2 * MAX_POS


@pytest.mark.parametrize("scaling, named", [
    ({"rope_type": "mrope"}, "'mrope'"),
    ({"rope_type": "linear"}, "'factor'"),
    ({"rope_type": "dynamic", "factor": -2.0}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "'high_freq_factor'"),
    ({"rope_type": "longrope", "short_factor": SHORT}, "'long_factor'"),
    ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": "x"}, "long_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
     "original_max_position_embeddings"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
])
def test_check_scaling_names_what_is_wrong(scaling: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        check_scaling(scaling)


def test_longrope_factor_lists_must_cover_half_the_head() -> None:
    with pytest.raises(ValueError, match="expected 8 numbers"):
        RotaryEmbedding(HEAD_DIM, 1e4, {**LONGROPE, "short_factor": SHORT[:3]}, MAX_POS)


def test_seq_len_types_need_token_seq_lens() -> None:
    rope = RotaryEmbedding(HEAD_DIM, 1e4, {"rope_type": "dynamic", "factor": 2.0}, MAX_POS)
    with pytest.raises(ValueError, match="token_seq_lens"):
        rope.for_step(torch.arange(4))
