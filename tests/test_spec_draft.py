"""Draft-model proposers (engine/spec_decode/draft_model.py) on a tiny random-weight Llama.

Oracles from transformers, which shares no code with the engine: the target's first L layers
(transformers' model cut to L layers, its final norm and head kept) and the whole target,
each generating greedily from the sequence's tokens. The proposers run inside an engine whose
sequence has been prefilled and given slots for the proposals, as the engine's speculative step
gives them.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine import LLM, SamplingParams
from engine.spec_decode import SpeculativeConfig
from engine.spec_decode.draft_model import first_layers, make_draft_proposer
from family_case import prompts, write_checkpoint

NUM_LAYERS = 4
K = 3
BLOCK_SIZE = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_config(**overrides):
    import transformers

    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2)
    return transformers.LlamaConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("target")), tiny_config())


@pytest.fixture(scope="module")
def hf_target(target):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, ids: list[int], new_tokens: int, num_layers: int = NUM_LAYERS) -> list[int]:
    """transformers' greedy continuation of `ids` by the model's first `num_layers` layers
    (its final norm and head kept), one full forward per token (no cache)."""
    model = copy.deepcopy(model)
    del model.model.layers[num_layers:]
    model.config.num_hidden_layers = num_layers
    out = list(ids)
    for _ in range(new_tokens):
        logits = model(torch.tensor([out]), use_cache=False).logits[0, -1]
        out.append(int(logits.argmax()))
    return out[len(ids):]


def prefilled(path: str, prompt_ids: list[list[int]], **settings):
    """An engine that has prefilled `prompt_ids` (greedy requests) and sampled each one's first
    token, with slots for K more; its sequences and their block tables."""
    llm = LLM(path, dtype=torch.float32, block_size=BLOCK_SIZE, num_kv_blocks=64, **settings)
    eng = llm.llm_engine
    for i, p in enumerate(prompt_ids):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=64,
                                                   ignore_eos=True))
    eng.step()
    seqs = [eng._groups[f"r{i}"].seqs[0] for i in range(len(prompt_ids))]
    kvm = eng.kv_cache_manager
    for s in seqs:
        assert s.num_computed_tokens == s.num_tokens - 1
        assert kvm.allocate_slots(s.seq_id, s.num_computed_tokens, 1 + K) == []
    return eng, seqs, [kvm.block_table(s.seq_id) for s in seqs]


@pytest.mark.parametrize("layers", [1, 3])
def test_draft_layers_propose_the_first_layers_greedy_continuation(target, hf_target, layers):
    batch = prompts(3, lens=(9, 14))
    eng, seqs, tables = prefilled(target, batch)
    proposer = make_draft_proposer(eng, SpeculativeConfig("draft_model", K,
                                                          draft_layers=layers))
    got = proposer.propose(seqs, [K, 2], tables)
    for seq, proposal, k in zip(seqs, got, (K, 2)):
        want = hf_greedy(hf_target, seq.token_ids, k, num_layers=layers)
        assert proposal.token_ids == want and proposal.probs is None
    # the target keeps its layers: its own view is untouched
    assert len(eng.loaded.model.layers) == NUM_LAYERS


def test_draft_model_of_the_target_itself_proposes_its_greedy_continuation(target, hf_target):
    batch = prompts(4, lens=(6, 17))
    eng, seqs, tables = prefilled(target, batch)
    proposer = make_draft_proposer(eng, SpeculativeConfig("draft_model", K, model=target))
    assert proposer.own_cache is not None
    assert proposer.own_cache.num_blocks == eng.kv_cache.num_blocks
    got = proposer.propose(seqs, [K, K], tables)
    for seq, proposal in zip(seqs, got):
        assert proposal.token_ids == hf_greedy(hf_target, seq.token_ids, K)
        # the draft's cache holds every token it fed: the sequence and K-1 proposals
        assert proposer.num_cached_tokens(seq.seq_id) == seq.num_tokens + K - 1


def test_first_layers_refuses_a_count_out_of_range(target):
    eng, _, _ = prefilled(target, prompts(5, lens=(5,)))
    for bad in (0, NUM_LAYERS, NUM_LAYERS + 1, True):
        with pytest.raises(ValueError, match=rf"speculative_config\['draft_layers'\]: expected "
                                             rf"an int in \[1, {NUM_LAYERS}\)"):
            first_layers(eng.loaded.model, bad)


def test_a_draft_that_fails_to_load_or_has_another_vocabulary_is_refused(target, tmp_path):
    eng, _, _ = prefilled(target, prompts(5, lens=(5,)))
    missing = str(tmp_path / "no-such-model.gguf")
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]: expected a model the "
                                         r"engine can load, got '.*no-such-model.gguf'"):
        make_draft_proposer(eng, SpeculativeConfig("draft_model", K, model=missing))
    other = write_checkpoint(str(tmp_path / "other"), tiny_config(vocab_size=320,
                                                                  num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"vocabulary of 300 tokens\), got '.*other' with a "
                                         r"vocabulary of 320 tokens"):
        make_draft_proposer(eng, SpeculativeConfig("draft_model", K, model=other))
