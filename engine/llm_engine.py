"""The engine loop: one `step()` = schedule -> run the model -> sample -> post-process.

`LLMEngine` owns the model, the KV cache and its manager, the scheduler and the sampler.
`execute_step` is the one path that runs the model on a scheduled step; `step()` and beam search
(engine/beam_search.py) both go through it.
Requests come in as token ids (`add_request`); each `step()` advances every scheduled sequence
and returns a `RequestOutput` for each request that produced tokens. Post-processing appends the
sampled tokens, detokenizes them incrementally and applies the stop conditions: EOS (unless
`ignore_eos`), `stop_token_ids`, `stop` strings, `max_tokens` and the model's length limit; none
but the length limits before `min_tokens` tokens. A sequence with `structured_outputs` has its
own grammar matcher (engine/structured_output.py), advanced with each sampled token; it ends when
its grammar has accepted its end token, and a stop string ends it only where its text is
complete under the grammar.

With `EngineConfig.speculative_config` the engine holds a `Speculator`
(engine/spec_decode/speculator.py, docs/spec-decode.md): decoding sequences get lookahead slots
from the scheduler, `execute_step` asks the proposer for tokens after the block moves and the
target computes each such sequence's last token and its proposals in one varlen step; `step()`
verifies them (engine/spec_decode/rejection.py), appends the accepted tokens one by one through
the same post-processing (a stop condition ends the sequence there), advances
`num_computed_tokens` by the accepted proposals only, commits only their full blocks to the
prefix cache and gives back the slots past them.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Optional, Union
from typing import Sequence as Seq

import torch

from engine.config import EngineConfig
from engine.distributed import launch
from engine.distributed.executor import TensorParallelExecutor
from engine.distributed.worker import WorkerSpec, serve_launched_rank
from engine.kv_cache import (DEFAULT_KV_CACHE_BYTES, KVCacheSpec, kv_cache_for,
                             num_blocks_for_budget)
from engine.kv_allocation import reserved_tokens, resolved_max_tokens
from engine.kv_scales import calibration_prompt_ids, kv_cache_dtype
from engine.kv_cache_manager import KVCacheManager
from engine.model.decoder import check_tensor_parallel
from engine.model.loader import LoadedModel, load_model
from engine.outputs import CompletionOutput, RequestOutput
from engine.parallel_state import TensorParallel
from engine.request import Sequence, SequenceGroup, SequenceStatus
from engine.runner import ModelRunner
from engine.sampler import Sampler, SamplingState
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode import make_proposer
from engine.spec_decode.rejection import Verdict
from engine.spec_decode.speculator import SpecCounters, Speculator
from engine.stats import EngineStats
from engine.stop_strings import StopMatch
from engine.structured_output import StructuredOutputCompiler, grammar_for, make_compiler
from engine.tokenizer import IncrementalDetokenizer


class LLMEngine:
    """Continuous-batching inference over a paged KV cache.

    `model` is a path (see `engine.model.loader.load_model`), None for the default model, or an
    already `LoadedModel` (shared between engines; its weights are not copied). `kv_fill` (a
    testing aid) fills every KV slot with that value (NaN proves unwritten slots are never read).
    """

    def __init__(self, model: Union[str, None, LoadedModel] = None,
                 dtype: torch.dtype = torch.float32, config: Optional[EngineConfig] = None,
                 device: Union[str, torch.device] = "cpu", kv_fill: Optional[float] = None
                 ) -> None:
        self.config = config = config or EngineConfig()
        self.executor: Optional[TensorParallelExecutor] = None
        if config.tensor_parallel_size > 1:
            self.loaded = self._start_tensor_parallel(model, dtype, device)
            device = self.executor.device  # type: ignore[union-attr]
        else:
            self.loaded = (model if isinstance(model, LoadedModel)
                           else load_model(model, dtype, device, config.quantization))
        self.model_config = mc = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.device = torch.device(device)
        self.dtype = next(self.loaded.model.parameters()).dtype
        self.kv_cache_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.max_model_len = self._resolve_max_model_len()
        num_blocks = self._resolve_num_blocks()
        num_host = config.num_host_blocks
        if num_host is None:
            num_host = num_blocks if config.preemption_mode == "swap" else 0
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, num_host,
                                               config.enable_prefix_caching, config.kv_allocation)
        cache_spec = KVCacheSpec(num_blocks, config.block_size, num_host, self.kv_cache_dtype,
                                 config.backend, kv_fill, config.calculate_kv_scales,
                                 config.prefault_kv_cache)
        self.kv_cache = kv_cache_for(self.loaded.model, cache_spec, self.device)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.max_model_len)
        self.runner: Union[ModelRunner, TensorParallelExecutor]
        if self.executor is not None:
            self.executor.attach(self.loaded.model, cache_spec, self.kv_cache)
            self.runner = self.executor
        else:
            self.runner = ModelRunner(self.loaded.model, self.kv_cache, config.backend,
                                      self.device)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(mc.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids)
        self._seq_ids = itertools.count()
        self._groups: dict[str, SequenceGroup] = {}
        self._compiler: Optional[StructuredOutputCompiler] = None
        self._compiler_lock = threading.Lock()
        self.speculator: Optional[Speculator] = None  # calibration runs without it
        self._calibrate_kv_scales()
        if config.speculative_config is not None:
            spec = config.speculative_config
            self.speculator = Speculator(spec, make_proposer(self, spec),  # type: ignore[arg-type]
                                         mc.vocab_size)
            self.scheduler.lookahead = self.speculator.num_lookahead

    def _start_tensor_parallel(self, model: Union[str, None, LoadedModel], dtype: torch.dtype,
                               device: Union[str, torch.device]) -> LoadedModel:
        """Loads the driver's shard, checks that the heads split, then starts the other ranks
        (docs/distributed.md). Under a launcher (torchrun), a process of rank > 0 serves steps
        here until the driver shuts down, then exits (SystemExit(0))."""
        size = self.config.tensor_parallel_size
        if isinstance(model, LoadedModel):
            raise ValueError(f"model: expected a path or None with tensor_parallel_size={size} "
                             "(each rank loads its own shard), got a LoadedModel")
        spec = WorkerSpec(model, dtype, str(torch.device(device)), self.config.quantization,
                          self.config.tensor_parallel_threads)
        if torch.device(device).type == "cpu":
            torch.set_num_threads(spec.num_threads)
        if launch.env_rank() != 0:
            serve_launched_rank(spec, size)
            raise SystemExit(0)
        tp = TensorParallel(0, size)
        loaded = load_model(model, dtype, launch.rank_device(device, 0), self.config.quantization,
                            tp=tp)
        check_tensor_parallel(loaded.config, size)
        self.executor = TensorParallelExecutor(spec, size)
        return loaded

    def shutdown(self) -> None:
        """Ends the tensor-parallel workers (a no-op in one process); the engine cannot step
        after it. Idempotent."""
        if self.executor is not None:
            self.executor.shutdown()

    @property
    def structured_output(self) -> StructuredOutputCompiler:
        """The compiler of structured-output constraints for this model's vocabulary (built
        on first use; thread-safe, shared with the server's worker threads)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = make_compiler(self.tokenizer, self.model_config.vocab_size,
                                               self.eos_token_ids)
            return self._compiler

    def _calibrate_kv_scales(self) -> None:
        """Runs `kv_scales.calibration_prompt_ids` through the model (one prefill step, one
        token, then freed, the prefix cache emptied) when the cache's scales wait for
        calibration. A pool or reservation too small for any calibration prompt leaves them
        to the first step."""
        scales = self.kv_cache.scales
        if not scales or not any(s.pending for s in scales):
            return
        cfg, kvm = self.config, self.kv_cache_manager
        room = min(cfg.max_num_batched_tokens, self.max_model_len - 1,
                   kvm.num_blocks * cfg.block_size - 1)
        ids = calibration_prompt_ids(self.tokenizer, room)
        request_id = "__kv_scale_calibration__"
        try:
            self.add_request(request_id, ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                             ignore_eos=True))
        except ValueError:
            return
        while self.has_unfinished_requests():
            self.step()
        kvm.reset_prefix_cache()

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_positions
        wanted = self.config.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"max_model_len: expected at most the model's {limit} positions "
                             f"(max_position_embeddings, times a dynamic rotary factor), "
                             f"got {wanted}")
        return wanted or limit

    def _resolve_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        mc = self.model_config
        budget = self.config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
        return num_blocks_for_budget(budget, mc.num_hidden_layers, mc.num_key_value_heads,
                                     mc.head_dim, self.config.block_size, self.kv_cache_dtype)

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                    arrival_time: Optional[float] = None, prompt: Optional[str] = None) -> None:
        """Queues a request. ValueError for a duplicate id, an empty or out-of-vocabulary prompt,
        a prompt that leaves no room under `max_model_len`, `n > max_num_seqs`, `n > 1` under a
        reservation `kv_allocation`, or a request that could never fit in the KV pool; also
        for `logit_bias` ids outside the vocabulary and `structured_outputs` that do not
        compile. `best_of` counts as `n` for these checks."""
        if request_id in self._groups:
            raise ValueError(f"request_id: expected an id not in use, got {request_id!r}")
        ids = self.check_prompt(prompt_token_ids)
        num_seqs = params.num_seqs
        name = "best_of" if params.best_of else "n"
        if num_seqs > self.config.max_num_seqs:
            raise ValueError(f"{name}: expected at most max_num_seqs={self.config.max_num_seqs}"
                             f" sequences per request, got {num_seqs}")
        if num_seqs > 1:
            self.require_paged(f"{name}={num_seqs}")
        self._check_fits(len(ids), params.max_tokens, num_seqs)
        self._check_logit_bias(params)
        if params.structured_outputs is not None:
            self.structured_output.compile(params.structured_outputs)
        group = SequenceGroup(request_id, ids, params,
                              time.monotonic() if arrival_time is None else arrival_time,
                              self.next_seq_id(), prompt, num_seqs=num_seqs)
        if params.seed is not None:
            group.generator = torch.Generator().manual_seed(params.seed)
        self._init_seq(group.seqs[0])
        self._groups[request_id] = group
        self.scheduler.add(group)

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias: expected token ids in [0, {vocab}), got {bad[0]}")

    def check_prompt(self, prompt_token_ids: Seq[int]) -> list[int]:
        """The prompt as a list; ValueError unless it is a non-empty list of in-vocabulary ids
        shorter than `max_model_len`."""
        ids = list(prompt_token_ids)
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("prompt_token_ids: expected at least one token, got []")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            bad = next(t for t in ids if not (isinstance(t, int) and 0 <= t < vocab))
            raise ValueError(f"prompt_token_ids: expected ints in [0, {vocab}), got {bad!r}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt_token_ids: expected fewer than max_model_len="
                             f"{self.max_model_len} tokens, got {len(ids)}")
        return ids

    def require_paged(self, what: str) -> None:
        """ValueError under a reservation `kv_allocation` for `what` ("n=4", "beam search"):
        a request whose sequences share blocks (the baselines serve one sequence per request)."""
        policy = self.config.kv_allocation
        if policy != "paged":
            raise ValueError(f"kv_allocation: expected 'paged' for {what} (its sequences share "
                             f"KV blocks), got {policy!r}")

    def _check_fits(self, prompt_len: int, max_tokens: Optional[int], num_seqs: int) -> None:
        output = resolved_max_tokens(max_tokens, prompt_len, self.max_model_len)
        reserved = reserved_tokens(self.config.kv_allocation, prompt_len, output,
                                   self.max_model_len)
        total = max(prompt_len + output, reserved or 0)
        blocks = num_seqs * -(-total // self.config.block_size)
        if blocks > self.kv_cache_manager.num_blocks:
            raise ValueError(f"num_kv_blocks: a request of {prompt_len} prompt tokens, "
                             f"max_tokens={max_tokens} and n={num_seqs} may need {blocks} blocks; "
                             f"expected a pool of at least that, got "
                             f"{self.kv_cache_manager.num_blocks}")

    def _init_seq(self, seq: Sequence) -> None:
        params = seq.group.params
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.group.prompt_token_ids,
                                                 params.skip_special_tokens)
        seq.sampling_state = SamplingState(params=params,
                                           prompt_token_ids=seq.group.prompt_token_ids,
                                           output_token_ids=seq.output_token_ids,
                                           generator=seq.group.generator)
        if params.structured_outputs is not None:
            seq.sampling_state.grammar = grammar_for(self.structured_output,
                                                     params.structured_outputs,
                                                     seq.output_token_ids)
        if params.logprobs is not None and seq.logprobs is None:
            seq.logprobs = []
        matcher = params.stop_matcher
        seq.stop_scanner = matcher.scanner() if matcher is not None else None
        if seq.stop_scanner is not None and seq.text:
            seq.stop_scanner.feed(seq.text)  # a fork goes on from its parent's text

    def abort_request(self, request_id: str) -> None:
        """Stops the request wherever it is and frees its blocks; unknown ids are ignored."""
        if self.scheduler.abort(request_id) is not None:
            self._groups.pop(request_id, None)
            if self.speculator is not None:
                self.speculator.sweep()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step; returns outputs of the requests that produced tokens."""
        out = self.scheduler.schedule()
        self._check_progress(out)
        started = self.speculator.clock() if self.speculator is not None else 0.0
        sampled, logits = self.execute_step(out)
        touched = []
        if sampled:
            assert logits is not None
            touched = (self._sample_speculative(sampled, logits, out) if out.lookahead
                       else self._sample(sampled, logits))
        for group in self.scheduler.remove_finished():
            self._groups.pop(group.request_id, None)
        if self.speculator is not None:
            self.speculator.end_step(out, self.speculator.clock() - started)
            self.speculator.sweep()
        return [self._output(g) for g in touched]

    def execute_step(self, out: SchedulerOutput) -> tuple[list[Sequence], Optional[torch.Tensor]]:
        """Runs the model on one scheduled step: every path that runs the model goes here.

        `out` comes from the scheduler (`schedule`, or `schedule_seqs` for sequences outside its
        queues), so each scheduled `(sequence, num_new_tokens)` pair has its slots allocated; any
        number of query tokens per sequence. Moves the step's blocks, computes the tokens' K/V,
        then advances each sequence's `num_computed_tokens` and enters its newly full blocks
        into the prefix cache. Returns the sequences whose step reached their last token and
        their float32 logits `[len(sequences), vocab]` (None when there are none).

        With lookahead in `out` (speculative decoding), the proposer fills `out.drafts` after
        the block moves; the drafts' K/V is computed too and a drafting sequence gets
        `1 + len(draft)` consecutive logits rows. Its scheduled tokens advance as above; the
        accepted proposals are the caller's to advance (`step()` does, after verification).
        """
        kvm = self.kv_cache_manager
        tables = [kvm.block_table(s.seq_id) for s, _ in out.scheduled]
        if self.speculator is None:
            sampled, logits = self.runner.execute(out, tables)
        else:
            sampled, logits = self.runner.execute(out, tables, lambda: self._propose(out, tables))
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            kvm.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        return sampled, logits

    def _propose(self, out: SchedulerOutput, tables: list[list[int]]) -> dict[int, list[int]]:
        """After the step's block moves: the proposer's moves, then `out.drafts`."""
        assert self.speculator is not None
        self.speculator.move_blocks(out)
        if out.lookahead:
            out.drafts = self.speculator.propose(out, tables)
        return out.drafts

    def next_seq_id(self) -> int:
        """A sequence id no other sequence of this engine has."""
        return next(self._seq_ids)

    def _check_progress(self, out: SchedulerOutput) -> None:
        if out.is_empty and not out.preempted and self.scheduler.has_unfinished():
            sched = self.scheduler
            raise RuntimeError(f"the scheduler can make no progress: {len(sched.waiting)} "
                               f"waiting, {len(sched.running)} running, "
                               f"{self.kv_cache_manager.num_free_blocks} free KV blocks")

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SequenceGroup]:
        rows, targets = [], []
        for i, seq in enumerate(seqs):
            group = seq.group
            family = [seq]
            if not group.forked:
                group.forked = True
                family += [self._fork(seq, k) for k in range(1, group.num_seqs_reserved)]
            rows += [i] * len(family)
            targets += family
        if len(rows) != len(seqs):
            logits = logits[torch.tensor(rows)]
        result = self.sampler.sample(logits, [s.sampling_state for s in targets])
        for j, seq in enumerate(targets):
            top = result.top_logprobs[j] if result.top_logprobs else None
            seq.append_token(result.token_ids[j], result.logprobs[j], top)
            if seq.sampling_state.grammar is not None:
                seq.sampling_state.grammar.accept(result.token_ids[j])
            self._post_process(seq)
        return list(dict.fromkeys(s.group for s in targets))

    def _sample_speculative(self, seqs: list[Sequence], logits: torch.Tensor,
                            out: SchedulerOutput) -> list[SequenceGroup]:
        """`_sample` for the plain rows, verification for the drafting sequences' rows; then
        every sequence that had lookahead gives back the slots past its computed tokens."""
        plain, plain_rows, drafting = [], [], []
        row = 0
        for seq in seqs:
            n = 1 + len(out.drafts.get(seq.seq_id, ()))
            if n == 1:
                plain.append(seq)
                plain_rows.append(row)
            else:
                drafting.append((seq, row, n))
            row += n
        touched = self._sample(plain, logits[plain_rows]) if plain else []
        assert self.speculator is not None
        for seq, row, n in drafting:
            self._accept(seq, self.speculator.verify(self.sampler, seq, logits[row:row + n]))
            touched.append(seq.group)
        kvm = self.kv_cache_manager
        for seq, _ in out.scheduled:
            if seq.seq_id in out.lookahead and kvm.is_resident(seq.seq_id):
                kvm.trim(seq.seq_id, seq.num_computed_tokens)
        return list(dict.fromkeys(touched))

    def _accept(self, seq: Sequence, verdict: Verdict) -> None:
        """Appends the verified tokens one by one through post-processing (a stop ends the
        sequence there and drops the rest); a sequence still running has its accepted
        proposals counted as computed and their full blocks committed."""
        for token, logprob, top in zip(verdict.token_ids, verdict.logprobs,
                                       verdict.top_logprobs):
            seq.append_token(token, logprob, top)
            self._post_process(seq)
            if seq.is_finished:
                return
        seq.num_computed_tokens += verdict.num_accepted
        self.kv_cache_manager.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        child = parent.fork(self.next_seq_id(), index)
        self.scheduler.fork(parent, child)
        self._init_seq(child)
        return child

    def _post_process(self, seq: Sequence) -> None:
        """Detokenizes the new token and finishes the sequence if a stop condition holds."""
        params = seq.group.params
        token = seq.output_token_ids[-1]
        delta = seq.detokenizer.add(token)
        seq.text += delta
        # every delta goes through the scanner (a stop string may begin before min_tokens)
        stop = seq.stop_scanner.feed(delta) if seq.stop_scanner is not None and delta else None
        num_out = len(seq.output_token_ids)
        status = None
        if num_out >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                status = SequenceStatus.FINISHED_STOPPED
            elif params.stop_token_ids and token in params.stop_token_ids:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            elif stop is not None and self._stop_string_ends(seq, len(delta), stop):
                self._cut_at_stop_string(seq, len(delta), stop)
                status = SequenceStatus.FINISHED_STOPPED
        grammar = seq.sampling_state.grammar
        if status is None and grammar is not None and grammar.is_terminated:
            status = SequenceStatus.FINISHED_STOPPED  # its end token, even under ignore_eos
        if status is None and ((params.max_tokens is not None and num_out >= params.max_tokens)
                               or seq.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish_seq(seq, status)

    def _stop_string_ends(self, seq: Sequence, delta_len: int, stop: StopMatch) -> bool:
        """Whether the stop string that ended in the last `delta_len` characters ends `seq`:
        always, unless the sequence is constrained and the text it would keep is not a whole
        sentence of its grammar (then the stop string is ignored and generation goes on)."""
        grammar = seq.sampling_state.grammar
        if grammar is None:
            return True
        end = len(seq.text) - delta_len + stop.end
        kept = seq.text[:end if seq.group.params.include_stop_str_in_output
                        else end - len(stop.stop)]
        return grammar.completes(kept)

    def _cut_at_stop_string(self, seq: Sequence, delta_len: int, stop: StopMatch) -> None:
        """Truncates `seq.text` at the stop string that ended in its last `delta_len`
        characters (after it with `include_stop_str_in_output`) and records it."""
        end = len(seq.text) - delta_len + stop.end
        seq.text = seq.text[:end if seq.group.params.include_stop_str_in_output
                            else end - len(stop.stop)]
        seq.stop_reason = stop.stop

    def _output(self, group: SequenceGroup) -> RequestOutput:
        """The request's outputs by index. With `best_of > n`: none until every sequence has
        finished, then the `n` with the highest cumulative log-probability (ties: the lower
        index), indexed 0..n-1 in that order."""
        seqs = sorted(group.seqs, key=lambda s: s.index)
        params = group.params
        ranked = bool(getattr(params, "best_of", None)) and params.best_of > params.n
        if ranked:
            seqs = (sorted(seqs, key=lambda s: -s.cumulative_logprob)[:params.n]
                    if group.is_finished else [])
        outputs = [CompletionOutput(index=k if ranked else s.index, text=s.text,
                                    token_ids=list(s.output_token_ids),
                                    cumulative_logprob=s.cumulative_logprob,
                                    logprobs=None if s.logprobs is None else list(s.logprobs),
                                    finish_reason=s.status.finish_reason,
                                    stop_reason=s.stop_reason)
                   for k, s in enumerate(seqs)]
        return RequestOutput(group.request_id, group.prompt, list(group.prompt_token_ids),
                             outputs, finished=group.is_finished)

    # ------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        """A snapshot of queue lengths, KV usage, prefix-cache counters, preemptions and
        speculative decoding counters."""
        kvm = self.kv_cache_manager
        sched = self.scheduler
        spec = self.speculator.counters() if self.speculator is not None else SpecCounters()
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped), kv_cache_usage_perc=kvm.usage(),
            prefix_cache_queries=kvm.prefix_cache_queries,
            prefix_cache_hits=kvm.prefix_cache_hits, num_preemptions=sched.num_preemptions,
            num_free_blocks=kvm.num_free_blocks, num_total_blocks=kvm.num_blocks,
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=spec.accepted_per_pos)

    def check_integrity(self) -> None:
        """The KV cache manager's invariants, and that exactly the running sequences hold device
        blocks and exactly the swapped ones hold host blocks."""
        kvm = self.kv_cache_manager
        kvm.check_integrity()
        for group in self.scheduler.groups():
            for seq in group.seqs:
                resident, swapped = kvm.is_resident(seq.seq_id), kvm.is_swapped(seq.seq_id)
                if seq.status is SequenceStatus.RUNNING:
                    assert resident and not swapped, f"{seq} is running without blocks"
                elif seq.status is SequenceStatus.SWAPPED:
                    assert swapped and not resident, f"{seq} is swapped without host blocks"
                else:
                    assert not resident and not swapped, f"{seq} holds blocks"
        holders = {s.seq_id for g in self.scheduler.groups() for s in g.seqs
                   if s.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED)}
        assert kvm.sequences() == holders, "blocks held by a sequence that is not live"
