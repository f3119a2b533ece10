"""Speculative decoding through the whole engine (n-gram proposals, and fake proposers).

Greedy output with speculation must equal the engine's output without it and transformers'
greedy continuation (tests/conftest.py's oracle) token for token, for k = 1, 3, 5, in batches
that mix prompts whose output copies the prompt (proposals accepted) with ones where nothing
matches, a seeded random request, an `n = 2` request (copy-on-write between forks) and one that
stops mid-draft (`max_tokens`); also under preemption (recompute and swap) and on a second pass
served from the prefix cache. After each run the engine's integrity check holds, no block is
in use, and every block in the prefix cache holds tokens of a final output (never a rejected
proposal). Every engine fills its KV cache with NaN: a slot read before it is written poisons
the logits. CPU time is scarce: one model per module, short prompts, 16 tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.loader import load_model
from engine.server.metrics import ServerMetrics
from engine.spec_decode import Proposal
from spec_timing import fake_step_times

MAX_TOKENS = 16
TEXTS = [
    "Copy this line twice: the quick brown fox jumps over the lazy dog. "
    "the quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "# the same two functions with type hints:\n",
    "The capital of France is",
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(loaded):
    return [loaded.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(loaded, prompts, hf_greedy_continuations):
    """The engine's greedy outputs without speculation, checked against transformers'."""
    outs = make_llm(loaded).generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                     use_tqdm=False)
    ids = [o.outputs[0].token_ids for o in outs]
    assert ids == hf_greedy_continuations(prompts, MAX_TOKENS)
    return ids


def make_llm(loaded, spec=None, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 64)
    return LLM(model=loaded, kv_fill=float("nan"), speculative_config=spec, **kw)


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 1}


def mixed_batch(prompts):
    """(requests, params): the greedy prompts, a seeded random one, an n=2 greedy one and one
    that stops after 5 tokens."""
    reqs = [{"prompt_token_ids": p} for p in prompts]
    params = [GREEDY] * len(prompts)
    reqs += [{"prompt_token_ids": prompts[0]}] * 3
    params += [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7),
               SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=2),
               SamplingParams(max_tokens=5, temperature=0.0)]
    return reqs, params


def check_every_step(llm) -> None:
    """After every step of `llm`: integrity, and no sequence holds a block past its computed
    tokens (the slots of rejected proposals were given back)."""
    engine = llm.llm_engine
    step = engine.step

    def checked():
        outputs = step()
        engine.check_integrity()
        kvm = engine.kv_cache_manager
        for group in engine.scheduler.running:
            for seq in group.seqs:
                if kvm.is_resident(seq.seq_id):
                    assert len(kvm.block_table(seq.seq_id)) == \
                        -(-seq.num_computed_tokens // kvm.block_size), seq
        return outputs

    engine.step = checked


def check_mixed(llm, outs, reference) -> None:
    greedy = [o.outputs[0].token_ids for o in outs[:len(reference)]]
    assert greedy == reference
    assert [c.token_ids for c in outs[-2].outputs] == [reference[0]] * 2
    assert outs[-1].outputs[0].token_ids == reference[0][:5]
    assert len(outs[-3].outputs[0].token_ids) == MAX_TOKENS
    check_clean(llm, outs)


def check_clean(llm, outs) -> None:
    """Integrity, no block in use, and the prefix cache holds only blocks of final outputs."""
    engine = llm.llm_engine
    engine.check_integrity()
    kvm = engine.kv_cache_manager
    assert kvm.num_used_blocks == 0
    bs = kvm.block_size
    seqs = [o.prompt_token_ids + c.token_ids for o in outs for c in o.outputs]
    blocks = {tuple(s[i:i + bs]) for s in seqs for i in range(0, len(s) - bs + 1, bs)}
    cached = [kvm.pool.tokens(b) for b in range(kvm.num_blocks) if kvm.pool.is_cached(b)]
    assert cached and all(t in blocks for t in cached)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_equals_plain_in_a_mixed_batch(loaded, prompts, reference, k):
    llm = make_llm(loaded, ngram(k))
    fake_step_times(llm)
    check_every_step(llm)
    outs = llm.generate(*mixed_batch(prompts), use_tqdm=False)
    check_mixed(llm, outs, reference)
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_accepted_tokens
    assert len(stats.spec_decode_num_accepted_tokens_per_pos) == k
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == \
        stats.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_output_equals_plain_under_preemption(loaded, prompts, reference, mode):
    llm = make_llm(loaded, ngram(3), num_kv_blocks=6, preemption_mode=mode)
    check_every_step(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.llm_engine.stats().num_preemptions > 0
    check_clean(llm, outs)


def test_a_second_pass_from_the_prefix_cache(loaded, prompts, reference):
    llm = make_llm(loaded, ngram(3))
    reqs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(reqs, GREEDY, use_tqdm=False)
    hits = llm.llm_engine.stats().prefix_cache_hits
    outs = llm.generate(reqs, GREEDY, use_tqdm=False)
    assert llm.llm_engine.stats().prefix_cache_hits > hits
    assert [o.outputs[0].token_ids for o in outs] == reference
    check_clean(llm, outs)


class WrongProposer:
    """Proposes k copies of a token the target does not choose, drawn from a known q."""

    def __init__(self, vocab: int, token: int) -> None:
        self.q = torch.full((vocab,), 0.5 / (vocab - 1))
        self.q[token] = 0.5
        self.token = token
        self.calls = 0

    def propose(self, seqs, num_tokens, block_tables):
        self.calls += 1
        return [Proposal([self.token] * k, self.q.expand(k, -1).clone()) for k in num_tokens]

    def move_blocks(self, out):
        pass

    def forget(self, seq_id):
        pass


def test_a_wrong_draft_changes_no_greedy_token_and_backs_off(loaded, prompts, reference):
    llm = make_llm(loaded, ngram(3))
    fake_step_times(llm)
    fake = WrongProposer(loaded.config.vocab_size, token=0)
    llm.llm_engine.speculator.proposer = fake
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_accepted_tokens == 0
    # always speculating, each request would propose at each of its 15 decode steps; the
    # controller stops after a rejection or two and probes after 8 more tokens
    assert stats.spec_decode_num_drafts <= len(prompts) * 3
    check_clean(llm, outs)
    seeded = [SamplingParams(max_tokens=8, temperature=1.0, seed=3)] * 2
    twice = llm.generate([{"prompt_token_ids": prompts[2]}] * 2, seeded, use_tqdm=False)
    assert twice[0].outputs[0].token_ids == twice[1].outputs[0].token_ids


def test_spec_counters_on_the_metrics_page(loaded, prompts):
    llm = make_llm(loaded, ngram(2))
    fake_step_times(llm)
    llm.generate([{"prompt_token_ids": prompts[1]}], GREEDY, use_tqdm=False)
    stats = llm.llm_engine.stats()
    metrics = ServerMetrics("m")
    metrics.update_from_stats(stats)
    page = metrics.render().decode()
    for name, value in (("drafts", stats.spec_decode_num_drafts),
                        ("draft_tokens", stats.spec_decode_num_draft_tokens),
                        ("accepted_tokens", stats.spec_decode_num_accepted_tokens)):
        assert value > 0
        assert f'vllm:spec_decode_num_{name}_total{{model_name="m"}} {float(value)}' in page
    first = stats.spec_decode_num_accepted_tokens_per_pos[0]
    assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} '
            f'{float(first)}') in page


def test_a_draft_model_that_fails_to_load(loaded):
    with pytest.raises((ValueError, FileNotFoundError), match="/nonexistent/draft.gguf"):
        make_llm(loaded, {"method": "draft_model", "model": "/nonexistent/draft.gguf",
                          "num_speculative_tokens": 2})
