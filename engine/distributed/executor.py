"""The driver's side of tensor parallelism: `ModelRunner`'s interface over N ranks.

`TensorParallelExecutor` starts (or joins) the group, sends each step to the workers once (one
`StepMessage` broadcast: the block moves and the step's tensors), runs the driver's own shard
with them and returns the driver's logits. `move_blocks` moves the driver's blocks at once and
keeps the moves for the next message, so the workers apply them in the same order before that
step's forward; `execute` therefore broadcasts once per step.

Lifecycle: a watchdog thread waits on the spawned workers' process sentinels. A worker that
dies (or a collective that fails) makes the current or next step raise `WorkerDiedError`
naming the rank and its exit code; the group is then unusable and every later step raises the
same error. `shutdown()` (also run at interpreter exit) sends the workers a shutdown message,
waits a few seconds for them to exit, then terminates and kills what is left. A spawned worker
also exits when the driver's process is gone (its step broadcast fails, and a thread watches
its parent).
"""

from __future__ import annotations

import multiprocessing.connection
import os
import threading
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.distributed import launch
from engine.distributed.worker import (StepMessage, StepTensors, WorkerSpec, run_step, send,
                                       worker_main)
from engine.kv_cache import KVCache, KVCacheSpec
from engine.request import Sequence
from engine.runner import build_inputs
from engine.scheduler import SchedulerOutput

#: Seconds `shutdown` waits for workers to exit before it terminates them.
EXIT_GRACE_S = 5.0
#: Seconds a failed collective waits for the watchdog to see which worker died.
DEATH_NOTICE_S = 2.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited, or a collective failed: the engine cannot step."""


class TensorParallelExecutor:
    """Runs every step on `size` ranks; this process is rank 0.

    Build it with `TensorParallelExecutor(spec, size)` (spawns ranks 1..size-1, or joins the
    launcher's group when the `env://` variables are set), then `attach(model, kv_cache_spec,
    kv_cache)` once the driver's shard and cache exist.
    """

    def __init__(self, spec: WorkerSpec, size: int) -> None:
        self.size = size
        self.procs: list[Any] = []
        self.model: Any = None
        self.kv_cache: Optional[KVCache] = None
        self._moves = StepMessage()
        self._error: Optional[WorkerDiedError] = None
        self._closed = False
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size: this process is already in a "
                               "torch.distributed group (one tensor-parallel engine per process "
                               "at a time: shut the other one down first)")
        self._wake_r, self._wake_w = os.pipe()
        if launch.launched_by_env():
            launch.check_env_size(size)
            self.group = launch.init_group(0, size, spec.device)
        else:
            self.group = self._spawn(spec, size)
        self.device = self.group.device
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()
        # runs once: at shutdown(), or at interpreter exit (the bound _state keeps self alive)
        self._finalizer = weakref.finalize(self, TensorParallelExecutor._stop, self.procs,
                                           self.group.control, self._state)

    def _spawn(self, spec: WorkerSpec, size: int) -> launch.RankGroup:
        port = launch.free_port()
        store = launch.driver_store(port, size)
        ctx = mp.get_context("spawn")
        try:
            for rank in range(1, size):
                proc = ctx.Process(target=worker_main, args=(rank, size, port, spec),
                                   name=f"tp-worker-{rank}", daemon=True)
                proc.start()
                self.procs.append(proc)
            launch.wait_for_workers(store, self.procs)
            return launch.init_group(0, size, spec.device, store)
        except BaseException:
            self._kill_all(self.procs)
            raise

    def attach(self, model: Any, cache_spec: KVCacheSpec, kv_cache: KVCache) -> None:
        """Sends the workers the cache spec (they build their caches from it) and keeps the
        driver's shard and cache."""
        self.model, self.kv_cache = model, kv_cache
        self._send(cache_spec)

    # ------------------------------------------------------------------ steps
    @property
    def backend(self) -> str:
        assert self.kv_cache is not None
        return self.kv_cache.backend

    def move_blocks(self, out: SchedulerOutput) -> None:
        """Moves the driver's blocks now (swap out, swap in, copy-on-write copies) and the
        workers' with the next step's message."""
        assert self.kv_cache is not None
        self._check()
        self.kv_cache.move_blocks(out.swap_out, out.swap_in, out.block_copies)
        self._moves.swap_out += out.swap_out
        self._moves.swap_in += out.swap_in
        self._moves.copies += out.block_copies

    def forward(self, scheduled: list[tuple[Sequence, int]], block_tables: list[list[int]],
                drafts: Optional[dict[int, list[int]]] = None
                ) -> tuple[list[Sequence], Optional[torch.Tensor]]:
        """As `ModelRunner.forward` (`drafts`: speculative decoding's proposals, computed after
        their sequences' scheduled tokens), on every rank: one message to the workers, then the
        driver's shard; returns the sequences to sample and the driver's logits."""
        assert self.kv_cache is not None
        self._check()
        if not scheduled:
            return [], None
        inputs = build_inputs(scheduled, block_tables, self.kv_cache.block_size, self.backend,
                              drafts=drafts)
        message, self._moves = self._moves, StepMessage()
        message.inputs = StepTensors(inputs.input_ids, inputs.positions, inputs.meta,
                                     inputs.logits_indices)
        self._send(message)
        driver_step = StepMessage(inputs=message.inputs)  # the driver's blocks moved already
        try:
            logits = run_step(self.model, self.kv_cache, driver_step, self.device)
        except RuntimeError as exc:
            raise self._fail(exc) from exc
        return (inputs.sampled_seqs, logits) if inputs.sampled_seqs else ([], None)

    def execute(self, out: SchedulerOutput, block_tables: list[list[int]],
                propose: Optional[Callable[[], dict[int, list[int]]]] = None
                ) -> tuple[list[Sequence], Optional[torch.Tensor]]:
        """Moves the step's blocks, then runs `forward`: one message per step. `propose`
        (speculative decoding, on the driver only), called between the two, returns the
        step's drafts."""
        self.move_blocks(out)
        drafts = propose() if propose is not None else None
        return self.forward(out.scheduled, block_tables, drafts)

    def _send(self, message: Any) -> None:
        try:
            send(message, self.group.control)
        except RuntimeError as exc:
            raise self._fail(exc) from exc

    def _check(self) -> None:
        if self._closed:
            raise WorkerDiedError("tensor parallelism: the executor is shut down")
        if self._error is not None:
            raise self._error

    # -------------------------------------------------------------- lifecycle
    def _state(self) -> bool:
        """Whether the workers may still be told to shut down (the group works)."""
        return self._error is None and not self._closed

    def _watch(self) -> None:
        """Waits until a worker exits or the executor closes; records a death."""
        sentinels = [p.sentinel for p in self.procs]
        if not sentinels:
            return
        multiprocessing.connection.wait(sentinels + [self._wake_r])
        if not self._closed and self._error is None:
            self._error = self._death_error()

    def _death_error(self) -> Optional[WorkerDiedError]:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                return WorkerDiedError(f"tensor parallelism: worker rank {rank} (pid {proc.pid})"
                                       f" exited with code {proc.exitcode}; the engine cannot "
                                       "run further steps")
        return None

    def _fail(self, exc: BaseException) -> WorkerDiedError:
        """The error of a failed collective: the dead worker's when one exits within
        `DEATH_NOTICE_S`, else the collective's own."""
        if self._error is None:
            for proc in self.procs:
                proc.join(DEATH_NOTICE_S / max(1, len(self.procs)))
            self._error = self._death_error() or WorkerDiedError(
                f"tensor parallelism: a collective failed ({exc}); the engine cannot run "
                "further steps")
        return self._error

    def shutdown(self) -> None:
        """Ends every worker (idempotent): a shutdown message while the group works, then
        terminate / kill after `EXIT_GRACE_S`; leaves the group."""
        if self._closed:
            return
        self._finalizer()
        self._closed = True
        os.write(self._wake_w, b"x")

    @staticmethod
    def _stop(procs: list[Any], control: Any, group_works: Any) -> None:
        if group_works():
            try:
                send(StepMessage(shutdown=True), control)
            except RuntimeError:
                pass
        for proc in procs:
            proc.join(EXIT_GRACE_S)
        TensorParallelExecutor._kill_all(procs)
        launch.leave_group()

    @staticmethod
    def _kill_all(procs: list[Any]) -> None:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
