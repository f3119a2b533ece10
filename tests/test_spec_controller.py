"""The speculation controller (engine/spec_decode/controller.py): given an acceptance rate and
step costs it speculates, shrinks k, stops and probes again; it learns step costs from timings
without being thrown by a stall. Times are fake: a step of R query rows "takes" a chosen T(R).
The engine-level checks run the default model with the same fake clock: a request whose
proposals are always wrong ends up proposing rarely, one whose output copies its prompt keeps
proposing k, and greedy output still equals the engine's without speculation.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.loader import load_model
from engine.spec_decode import Proposal
from spec_timing import fake_step_times, linear

from engine.spec_decode.controller import (PROBE_MAX, Acceptance, SpecController,
                                           StepCosts, expected_tokens)


def trained(max_k: int, cost, rows=range(1, 8)) -> SpecController:
    """A controller that has seen every step size in `rows` a few times at cost `cost`."""
    ctl = SpecController(max_k)
    for _ in range(4):
        for r in rows:
            ctl.end_step({0: (r, 1)}, cost(r))
    return ctl


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 5) == 1.0


@pytest.mark.parametrize("alpha, slope, want", [
    (0.9, 0.25, 5),    # copying: all k are worth their rows
    (0.6, 0.25, 2),    # middling: a shorter proposal is worth more per second
    (0.6, 0.05, 4),    # the same acceptance with cheap rows: longer
    (0.25, 0.1, 1),    # a 25 % acceptance wins at k = 1 when a row costs 10 %
    (0.25, 0.25, 0),   # and loses at every k when a row costs 25 %: no speculation
    (0.01, 0.0, 0),    # hardly anything accepted: even free rows gain under 2 %
])
def test_best_k_maximises_tokens_per_second(alpha, slope, want):
    ctl = trained(5, linear(slope))
    assert ctl.best_k(alpha) == want


def test_best_k_in_a_batch_weighs_the_other_sequences_tokens():
    # with 15 other rows and tokens, one more row adds 0.25 to a step of 4.75 (5 %) and 0.5
    # expected tokens to 16 (3 %): not worth it, though alone it is (0.5 tokens for 25 %)
    ctl = trained(3, linear(0.25), rows=range(1, 20))
    alone = ctl.best_k(0.5)
    assert alone == 1
    assert ctl.best_k(0.5, other_rows=15, other_tokens=15) == 0  # 0.25 / 4.75 > 0.5 / 16: no


def test_prior_before_any_measurement():
    ctl = SpecController(3)
    assert ctl.best_k(Acceptance().alpha) == 1  # alpha 0.5, a row 25 % of a step
    assert ctl.best_k(0.9) == 3


def test_costs_are_learnt_and_a_stall_moves_them_little():
    costs = StepCosts()
    assert costs.seconds(1) is None
    for _ in range(5):
        costs.observe(1, 0.010)
        costs.observe(4, 0.013)
    assert costs.seconds(1) == pytest.approx(0.010)
    assert costs.row_cost() == pytest.approx(0.1)  # weight 5 at 0.1 against the prior's 2
    assert costs.seconds(6) == pytest.approx(0.010 * 1.5)  # small steps: on the line
    costs.observe(1, 1.0)  # a 100x stall: clipped to 2x, weighted 0.2
    assert costs.seconds(1) == pytest.approx(0.012)


def test_a_size_measured_in_a_stall_does_not_look_dear_for_ever():
    costs = StepCosts()
    for _ in range(20):
        costs.observe(1, 1.0)
        costs.observe(4, 1.75)
    for _ in range(3):
        costs.observe(3, 5.0)  # three steps of 3 rows during a stall
    assert costs.row_cost() == pytest.approx(0.25)
    assert costs.seconds(3) == pytest.approx(1.5)
    ctl = SpecController(3)
    ctl.costs = costs
    assert ctl.best_k(0.6) == 2  # 2.0 / T(3) beats 1.6 / T(2) and 2.18 / T(4)


def test_large_steps_use_their_own_measurements():
    costs = StepCosts()
    for _ in range(3):
        costs.observe(1, 1.0)
        costs.observe(40, 4.0)
    assert costs.seconds(40) == pytest.approx(4.0)
    assert costs.seconds(42) == pytest.approx(4.0 * (1 + 0.25 * 41) / (1 + 0.25 * 39))


def run(ctl: SpecController, accepts, num_tokens: int, cost) -> list[int]:
    """Drives one sequence for `num_tokens` output tokens: each step the controller chooses k,
    the first `accepts(k, out)` proposals are accepted, the step costs `cost(1 + k)`. Returns
    the k chosen at each step."""
    out, ks = 0, []
    while out < num_tokens:
        k = ctl.choose(7, out)
        ks.append(k)
        accepted = accepts(k, out) if k else 0
        if k:
            ctl.record(7, k, accepted)
        ctl.end_step({7: (1 + k, 1 + accepted)}, cost(1 + k))
        out += 1 + accepted
    return ks


def test_a_sequence_that_copies_nothing_stops_and_probes_ever_more_rarely():
    ctl = SpecController(5)
    ks = run(ctl, lambda k, out: 0, 512, linear(0.25))
    steps_with_proposals = sum(1 for k in ks if k)
    # the prior speculates a few times, then only probes: at 8, 16, 32, 64, 64, ... tokens
    assert steps_with_proposals <= 3 + 512 // PROBE_MAX + 4
    assert all(k <= 1 for k in ks[10:])
    assert ctl.num_probes >= 512 // PROBE_MAX - 1  # it keeps probing


def test_a_sequence_that_copies_keeps_k():
    ctl = SpecController(5)
    ks = run(ctl, lambda k, out: k, 256, linear(0.25))
    assert ks[-20:] == [5] * 20
    assert ctl.alpha(7) > 0.95


def test_a_probe_brings_speculation_back_when_the_output_starts_copying():
    ctl = SpecController(4)
    ks = run(ctl, lambda k, out: 0 if out < 300 else k, 420, linear(0.25))
    assert all(k <= 1 for k in ks[20:300 - PROBE_MAX])
    assert ks[-5:] == [4] * 5


def test_when_rows_get_expensive_k_shrinks_then_stops():
    ctl = SpecController(5)
    run(ctl, lambda k, out: max(0, min(k, 2)), 64, linear(0.1))  # ~2 of every proposal
    cheap = ctl.best_k(ctl.alpha(7))
    assert cheap >= 2
    for _ in range(30):  # the machine gets busier with larger steps
        for r in range(1, 7):
            ctl.end_step({7: (r, 1)}, linear(1.0)(r))
    assert ctl.best_k(ctl.alpha(7)) < cheap
    for _ in range(30):
        for r in range(1, 7):
            ctl.end_step({7: (r, 1)}, linear(3.0)(r))
    assert ctl.best_k(ctl.alpha(7)) == 0


# ------------------------------------------------------------------ the engine, fake clock
@pytest.fixture(scope="module")
def loaded(one_torch_thread):
    return load_model(None, dtype=torch.float32)


class CountingWrong:
    """Proposes a token the target never picks; counts the tokens it proposed."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.proposed = 0

    def propose(self, seqs, num_tokens, block_tables):
        self.proposed += sum(num_tokens)
        return [Proposal([self.token] * k) for k in num_tokens]

    def move_blocks(self, out):
        pass

    def forget(self, seq_id):
        pass


COPY = ("Repeat this sentence word for word: the paged KV cache stores keys and values in "
        "blocks of sixteen tokens each.")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_llm(loaded, k: int) -> LLM:
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    return LLM(model=loaded, num_kv_blocks=32, speculative_config=spec)


def test_engine_a_wrong_proposer_ends_up_proposing_rarely(loaded):
    llm = make_llm(loaded, 3)
    fake_step_times(llm, linear(0.25))
    wrong = CountingWrong(token=0)
    llm.llm_engine.speculator.proposer = wrong
    prompt = loaded.tokenizer.encode("The capital of France is")
    llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    # always k would propose 3 tokens at each of 23 decode steps (69); the prior proposes one
    # token twice, then a probe after 8 tokens and one after 16 more
    assert wrong.proposed <= 6
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_accepted_tokens == 0


def test_engine_a_copying_request_keeps_k_and_its_greedy_output(loaded):
    tok = loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": COPY}],
                                                add_generation_prompt=True),
                        add_special_tokens=False)
    plain = LLM(model=loaded, num_kv_blocks=32).generate(
        [{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm = make_llm(loaded, 3)
    fake_step_times(llm, linear(0.25))
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == plain
    counters = llm.llm_engine.speculator.counters()
    assert counters.num_accepted_tokens / counters.num_draft_tokens > 0.6
    assert counters.chosen_k[3] >= 3 and counters.chosen_k[3] >= counters.chosen_k[0]
