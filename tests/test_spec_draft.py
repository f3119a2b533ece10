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
from engine.speculative_config import SpeculativeConfig
from engine.spec_decode.draft_model import first_layers, make_draft_proposer
from family_case import prompts, write_checkpoint
from spec_timing import fake_step_times

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


def test_a_random_request_draws_from_its_processed_distribution(target, hf_target):
    # top_k=1: the draft's distribution is one-hot on its greedy token, whatever the draw
    eng, seqs, tables = prefilled(target, prompts(6, lens=(12,)))
    seqs[0].sampling_state.params = SamplingParams(temperature=0.8, top_k=1, max_tokens=64,
                                                   ignore_eos=True)
    proposer = make_draft_proposer(eng, SpeculativeConfig("draft_model", K, model=target))
    (proposal,) = proposer.propose(seqs, [K], tables)
    assert proposal.token_ids == hf_greedy(hf_target, seqs[0].token_ids, K)
    assert proposal.probs is not None and proposal.probs.shape == (K, 300)
    assert torch.equal(proposal.probs.argmax(1), torch.tensor(proposal.token_ids))
    assert torch.equal(proposal.probs.sum(1), torch.ones(K))


# ------------------------------------------------------- in the engine (k = 1, 3, 5)
NEW_TOKENS = 20
#: Engine settings of each case: prefix-cache hits (warm prompts first), preemption by
#: recompute and by swap, n = 2 (forks share the prompt's blocks: copy-on-write).
E2E_CASES = {
    "prefix": dict(enable_prefix_caching=True),
    "recompute": dict(num_kv_blocks=28, max_num_seqs=4, preemption_mode="recompute",
                      enable_prefix_caching=False),
    "swap": dict(num_kv_blocks=28, max_num_seqs=4, preemption_mode="swap",
                 enable_prefix_caching=False),
    "n=2": dict(enable_prefix_caching=False),
}
#: k of each case, so that each draft method runs with k = 1, 3 and 5.
E2E_K = {"prefix": 1, "recompute": 3, "swap": 5, "n=2": 3}


@pytest.fixture(scope="module")
def batch():
    return prompts(0, lens=(37, 5, 23, 11), shared_prefix=4)


@pytest.fixture(scope="module")
def hf_batch(hf_target, batch):
    return [hf_greedy(hf_target, p, NEW_TOKENS) for p in batch]


@pytest.mark.parametrize("case", list(E2E_CASES))
@pytest.mark.parametrize("draft", ["model", "layers"])
def test_greedy_output_with_a_draft_equals_transformers(target, batch, hf_batch, draft, case):
    k = E2E_K[case]
    spec = ({"method": "draft_model", "model": target, "num_speculative_tokens": k}
            if draft == "model" else
            {"method": "draft_model", "draft_layers": 2, "num_speculative_tokens": k})
    settings = {"num_kv_blocks": 256, **E2E_CASES[case]}
    llm = LLM(target, dtype=torch.float32, block_size=BLOCK_SIZE, speculative_config=spec,
              **settings)
    fake_step_times(llm)
    n = 2 if case == "n=2" else 1
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=n)
    if case == "prefix":
        llm.generate([{"prompt_token_ids": batch[0]}], params, use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for out, want in zip(outs, hf_batch):
        assert [list(c.token_ids) for c in out.outputs] == [want] * n
    eng = llm.llm_engine
    eng.check_integrity()
    assert eng.kv_cache_manager.num_used_blocks == 0
    if case == "prefix":
        assert eng.stats().prefix_cache_hits > 0
    if case in ("recompute", "swap"):
        assert eng.stats().num_preemptions > 0
    counters = eng.speculator.counters()
    assert counters.num_drafts > 0
    if draft == "model":
        # the target is its own draft: every proposal is its greedy token, so a draft cache that
        # missed a block move, a preemption or a fork would show up as a rejection
        assert counters.num_accepted_tokens == counters.num_draft_tokens
