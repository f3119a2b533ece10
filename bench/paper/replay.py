"""Model-free replay: the engine's real scheduler and KV cache manager, a modelled clock.

`replay` feeds a trace to `engine.scheduler.Scheduler` over an `engine.kv_cache_manager.
KVCacheManager` built from an `EngineConfig` as `engine.llm_engine.LLMEngine` builds them, and
does every step what `LLMEngine.step` does, without the model:

1. `schedule()`; a step that schedules nothing, moves nothing and preempts nothing while requests
   wait is the engine's "no progress" error (RuntimeError);
2. as `LLMEngine.execute_step`: each scheduled sequence's `num_computed_tokens` advances by its
   share and its newly full blocks are committed to the prefix cache;
3. the clock advances by the step model's duration (`bench.paper.step_model`);
4. as `LLMEngine._sample`: each sequence whose step reached its last token gets one token (a
   request with `n > 1` first forks into `n` sequences through `Scheduler.fork`), and finishes
   once it has its drawn output length or reaches `max_model_len`; finished groups leave.

After step 2, the step's `memory_stats()` and running requests are recorded (the real-engine run,
`bench.paper.engine_run`, records at the same point). Requests join the waiting queue once the
clock reaches their arrival; an idle replay jumps to the next arrival. Sampled tokens are all 0:
token contents only matter to the prefix cache, and the trace's prompts share no prefix.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Optional

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Sequence, SequenceGroup, SequenceStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

from bench.paper.record import RequestRecord, RunRecord
from bench.paper.step_model import StepTimeModel
from bench.paper.traces import TraceRequest


def build_scheduler(config: EngineConfig, max_model_len: int) -> Scheduler:
    """A scheduler over a KV cache manager, both as `LLMEngine.__init__` builds them
    (`config.num_kv_blocks` must be given: there is no model to size a byte budget by)."""
    if config.num_kv_blocks is None:
        raise ValueError("num_kv_blocks: expected a block count for the replay, got None")
    num_host = config.num_host_blocks
    if num_host is None:
        num_host = config.num_kv_blocks if config.preemption_mode == "swap" else 0
    kvm = KVCacheManager(config.num_kv_blocks, config.block_size, num_host,
                         config.enable_prefix_caching, config.kv_allocation)
    return Scheduler(config, kvm, max_model_len)


def context_tokens(out: SchedulerOutput) -> int:
    """Context tokens the step's attention reads: per scheduled sequence, its computed tokens
    plus its new ones (evaluated before the step advances them)."""
    return sum(seq.num_computed_tokens + n for seq, n in out.scheduled)


class Replay:
    """One replay: a scheduler, its manager, a clock and the run's record."""

    def __init__(self, config: EngineConfig, max_model_len: int,
                 step_model: StepTimeModel) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.step_model = step_model
        self.scheduler = build_scheduler(config, max_model_len)
        self.kvm = self.scheduler.kv_cache_manager
        self.clock = 0.0
        self.record = RunRecord()
        self._seq_ids = itertools.count()

    def add(self, request: TraceRequest, n: int = 1) -> None:
        """Queues a trace request as `LLMEngine.add_request` does (output of exactly
        `request.output_len` tokens per sequence, `n` sequences)."""
        params = SamplingParams(n=n, max_tokens=request.output_len, ignore_eos=True)
        group = SequenceGroup(request.request_id, list(request.prompt_token_ids), params,
                              request.arrival_s, next(self._seq_ids), num_seqs=n)
        self.scheduler.add(group)
        self.record.requests[request.request_id] = RequestRecord(request.arrival_s,
                                                                 request.output_len)

    def step(self) -> None:
        """One engine step (see the module docstring)."""
        sched = self.scheduler
        out = sched.schedule()
        if out.is_empty and not out.preempted and sched.has_unfinished():
            raise RuntimeError(f"the scheduler can make no progress: {len(sched.waiting)} "
                               f"waiting, {len(sched.running)} running, "
                               f"{self.kvm.num_free_blocks} free KV blocks")
        seconds = self.step_model.seconds(out.num_batched_tokens, context_tokens(out))
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            self.kvm.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        self.record.add_step(self.clock + seconds, len(sched.running), self.kvm.memory_stats())
        self.clock += seconds
        for seq, _ in out.scheduled:
            if seq.num_computed_tokens == seq.num_tokens:
                self._sample(seq)
        for group in sched.remove_finished():
            self.record.requests[group.request_id].finish_s = self.clock

    def _sample(self, seq: Sequence) -> None:
        group = seq.group
        family = [seq]
        if not group.forked:
            group.forked = True
            for k in range(1, group.num_seqs_reserved):
                child = seq.fork(next(self._seq_ids), k)
                self.scheduler.fork(seq, child)
                family.append(child)
        req = self.record.requests[group.request_id]
        if req.first_token_s is None:
            req.first_token_s = self.clock
        for s in family:
            s.append_token(0, 0.0)
            if len(s.output_token_ids) >= group.params.max_tokens \
                    or s.num_tokens >= self.max_model_len:
                self.scheduler.finish_seq(s, SequenceStatus.FINISHED_LENGTH)

    def run(self, trace: list[TraceRequest], n: int = 1,
            max_steps: Optional[int] = None) -> RunRecord:
        """Replays `trace` (sorted by arrival) to the end, or for at most `max_steps` steps."""
        pending = deque(sorted(trace, key=lambda r: r.arrival_s))
        steps = 0
        while (pending or self.scheduler.has_unfinished()) and steps != max_steps:
            while pending and pending[0].arrival_s <= self.clock:
                self.add(pending.popleft(), n)
            if not self.scheduler.has_unfinished():
                self.clock = pending[0].arrival_s
                continue
            self.step()
            steps += 1
        return self.record


def replay(trace: list[TraceRequest], config: EngineConfig, max_model_len: int,
           step_model: StepTimeModel, n: int = 1) -> RunRecord:
    """Replays `trace` under `config` (its `num_kv_blocks` given) with `n` samples per request;
    returns the run's record."""
    return Replay(config, max_model_len, step_model).run(trace, n)
