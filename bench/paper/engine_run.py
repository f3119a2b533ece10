"""The same measurements on the real engine (`engine.llm.LLM`), model and all.

The engine is not changed: its `execute_step` is wrapped for the run (an instance attribute
that is removed afterwards), so that after each step computes its tokens the run records the
KV cache manager's `memory_stats()` and the running requests (the point where the replay records
them), and the step's tokens and context (`bench.paper.replay.context_tokens`).

The clock of `run_trace` is the engine's own time: each `LLMEngine.step()` advances it by the
step's measured wall time, and an idle engine jumps to the next arrival (no sleeping), so the
harness's own overhead is not counted and the run takes only the engine's time. A request joins
when the clock reaches its arrival. The measured steps (`StepSample`s) are what `--fit` fits.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional


from engine.dtypes import resolve_dtype
from engine.llm import LLM
from engine.model.loader import LoadedModel, load_model
from engine.sampling_params import BeamSearchParams, SamplingParams

from bench.paper.record import RequestRecord, RunRecord
from bench.paper.replay import context_tokens
from bench.paper.step_model import StepSample
from bench.paper.traces import TraceRequest

if TYPE_CHECKING:
    from bench.paper.figures import Settings


@contextmanager
def hooked_execute_step(llm: LLM, after: Callable[[Any, int], None]) -> Iterator[None]:
    """While inside, each `execute_step(out)` of `llm`'s engine calls `after(out, context)`
    once it has run (`context` counted before it ran); the engine's own method comes back at
    the exit."""
    engine = llm.llm_engine
    original = engine.execute_step

    def execute_step(out):
        context = context_tokens(out)
        result = original(out)
        after(out, context)
        return result

    engine.execute_step = execute_step
    try:
        yield
    finally:
        del engine.execute_step


def run_trace(llm: LLM, trace: list[TraceRequest], n: int = 1,
              on_step: Optional[Callable[[Any], None]] = None
              ) -> tuple[RunRecord, list[StepSample]]:
    """Serves `trace` on `llm` (idle at the start) with `n` greedy samples of exactly each
    request's output length; returns the run's record and its measured steps. `on_step(out)`,
    when given, is called after each step's `execute_step(out)`, once per measured step."""
    engine = llm.llm_engine
    record, samples, seen = RunRecord(), [], {}

    def after(out, context):
        seen.update(tokens=out.num_batched_tokens, context=context,
                    stats=engine.kv_cache_manager.memory_stats(),
                    running=len(engine.scheduler.running))
        if on_step is not None:
            on_step(out)

    pending = deque(sorted(trace, key=lambda r: r.arrival_s))
    clock = 0.0
    with hooked_execute_step(llm, after):
        while pending or engine.has_unfinished_requests():
            while pending and pending[0].arrival_s <= clock:
                _add(llm, pending.popleft(), n, record)
            if not engine.has_unfinished_requests():
                clock = pending[0].arrival_s
                continue
            seen.clear()
            start = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - start
            clock += seconds
            if seen:
                record.add_step(clock, seen["running"], seen["stats"])
                samples.append(StepSample(seen["tokens"], seen["context"], seconds))
            _note_outputs(record, outputs, clock)
    return record, samples


def _add(llm: LLM, request: TraceRequest, n: int, record: RunRecord) -> None:
    params = SamplingParams(n=n, temperature=0.0, max_tokens=request.output_len,
                            ignore_eos=True)
    llm.llm_engine.add_request(request.request_id, list(request.prompt_token_ids), params,
                               arrival_time=request.arrival_s)
    record.requests[request.request_id] = RequestRecord(request.arrival_s, request.output_len)


def _note_outputs(record: RunRecord, outputs: list, clock: float) -> None:
    for out in outputs:
        req = record.requests[out.request_id]
        if req.first_token_s is None:
            req.first_token_s = clock
        if out.finished:
            req.finish_s = clock


def run_beam_search(llm: LLM, trace: list[TraceRequest], beam_width: int) -> RunRecord:
    """Beam search of width `beam_width` on each request of `trace` in turn (arrival times
    ignored), each for exactly its output length; the record holds every step's memory."""
    engine = llm.llm_engine
    record = RunRecord()
    steps = 0

    def after(out, context):
        nonlocal steps
        steps += 1
        record.add_step(float(steps), 0, engine.kv_cache_manager.memory_stats())

    with hooked_execute_step(llm, after):
        for request in trace:
            params = BeamSearchParams(beam_width=beam_width, max_tokens=request.output_len,
                                      ignore_eos=True)
            llm.beam_search({"prompt_token_ids": list(request.prompt_token_ids)}, params)
    return record


def load(dtype: str = "auto") -> LoadedModel:
    """The engine's default model in `dtype` (a name of engine.dtypes.DTYPE_NAMES: "auto",
    "float32", "bfloat16", ...), shared by the runs."""
    return load_model(None, resolve_dtype(dtype))


def make_llm(policy: str, settings: "Settings", loaded: LoadedModel, reduced: bool = True
             ) -> LLM:
    """An engine over `loaded` under `policy` with the settings' KV budget and
    `max_model_len` at the reduced scale (or at full length), warmed up (idle on return)."""
    config = settings.config(policy, reduced)
    llm = LLM(model=loaded, block_size=config.block_size, num_kv_blocks=config.num_kv_blocks,
              max_model_len=config.max_model_len, kv_allocation=policy)
    warm_up(llm)
    return llm


def make_engine(loaded: LoadedModel, **config: Any) -> LLM:
    """An engine over `loaded` with `config` (keyword arguments of `LLM`: block size, KV
    budget, prefix caching, preemption mode), warmed up (idle on return)."""
    llm = LLM(model=loaded, **config)
    warm_up(llm)
    return llm


def warm_up(llm: LLM) -> None:
    """A short request through the engine, so that one-time costs (first calls of the kernels at
    new shapes) do not land in a measured step."""
    llm.generate({"prompt_token_ids": list(range(1, 40))},
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
