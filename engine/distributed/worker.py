"""A tensor-parallel rank: what every rank does with a step, and the loop of ranks 1..N-1.

Every step the driver (rank 0) sends one `StepMessage` over the control group: the block moves
of the step (swap out, swap in, copy-on-write copies, in that order) and the step's tensors
(`input_ids`, `positions`, the `AttentionMetadata`, the rows to compute logits of), built once
on the driver. Every rank, the driver included, then runs `run_step` on its own shard and its
own cache: the same block ids, its own KV heads. The model's forward and `compute_logits` are
collective (each all-reduces inside), so every rank runs them with the same inputs; only the
driver keeps the logits. A message with `shutdown` ends the loop.

A worker loads its shard itself (`load_model(..., tp=...)`), then waits for the driver's
`KVCacheSpec` (one message) before its first step.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from engine.block_pool import BlockCopy
from engine.distributed import launch
from engine.kv_cache import KVCache, KVCacheSpec, kv_cache_for
from engine.model.metadata import AttentionMetadata


@dataclass
class WorkerSpec:
    """How a rank loads its shard: `load_model`'s arguments, plus the torch threads of each
    rank on a CPU."""

    model: Optional[str]
    dtype: torch.dtype
    device: str
    quantization: Optional[str]
    num_threads: int = 1


@dataclass
class StepTensors:
    """One step's model inputs (on the CPU while they travel) and the rows to sample from."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor

    def to(self, device: torch.device) -> "StepTensors":
        if device.type == "cpu":
            return self
        m = self.meta
        meta = AttentionMetadata(
            m.slot_mapping.to(device), m.block_tables.to(device), m.seq_lens.to(device),
            None if m.cu_seqlens_q is None else m.cu_seqlens_q.to(device), m.backend)
        return StepTensors(self.input_ids.to(device), self.positions.to(device), meta,
                           self.logits_indices.to(device))


@dataclass
class StepMessage:
    """What the driver sends once per step (see the module docstring)."""

    swap_out: list[BlockCopy] = field(default_factory=list)
    swap_in: list[BlockCopy] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)
    inputs: Optional[StepTensors] = None
    shutdown: bool = False


def send(message: Any, control: Any) -> None:
    """Driver side: broadcasts `message` (any picklable object) from rank 0 to every rank."""
    dist.broadcast_object_list([message], src=0, group=control)


def receive(control: Any) -> Any:
    """Worker side: the driver's next `send`."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


@torch.inference_mode()
def run_step(model: Any, kv_cache: KVCache, message: StepMessage,
             device: torch.device) -> Optional[torch.Tensor]:
    """Moves the step's blocks in this rank's cache, then runs its shard on the step's tensors
    (collective); returns the float32 logits of the rows to sample (None when there are none
    or the step runs no tokens)."""
    kv_cache.move_blocks(message.swap_out, message.swap_in, message.copies)
    if message.inputs is None:
        return None
    inputs = message.inputs.to(device)
    hidden = model(inputs.input_ids, inputs.positions, kv_cache.device_caches, inputs.meta,
                   kv_cache.scales)
    if inputs.logits_indices.numel() == 0:
        return None
    return model.compute_logits(hidden[inputs.logits_indices]).float()


def serve_steps(model: Any, group: launch.RankGroup) -> None:
    """A worker's life after loading: receive the cache spec, then run steps until the driver
    says shut down."""
    spec: KVCacheSpec = receive(group.control)
    kv_cache = kv_cache_for(model, spec, group.device)
    while True:
        message: StepMessage = receive(group.control)
        if message.shutdown:
            return
        run_step(model, kv_cache, message, group.device)


def load_shard(spec: WorkerSpec, group: launch.RankGroup) -> Any:
    """This rank's shard of the model (its `DecoderForCausalLM`)."""
    from engine.model.loader import load_model

    return load_model(spec.model, spec.dtype, group.device, spec.quantization, tp=group.tp).model


def run_rank(spec: WorkerSpec, group: launch.RankGroup) -> None:
    """Loads this worker's shard and serves steps; leaves the group at the end."""
    try:
        serve_steps(load_shard(spec, group), group)
    finally:
        launch.leave_group()


def worker_main(rank: int, size: int, port: int, spec: WorkerSpec) -> None:
    """The entry point of a spawned worker (rank >= 1): exits with its parent, joins the group
    at the driver's store on loopback `port`, then `run_rank`."""
    launch.exit_with_parent()
    if torch.device(spec.device).type == "cpu":
        torch.set_num_threads(spec.num_threads)
    group = launch.init_group(rank, size, spec.device, launch.worker_store(port, size))
    try:
        run_rank(spec, group)
    except Exception as exc:  # the traceback goes to stderr; the driver sees the exit code
        print(f"tensor-parallel worker rank {rank}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        raise


def serve_launched_rank(spec: WorkerSpec, size: int) -> None:
    """A launcher's (torchrun's) rank > 0: joins the `env://` group of `size` ranks, loads its
    shard and serves the driver's steps until the driver shuts down."""
    launch.check_env_size(size)
    run_rank(spec, launch.init_group(launch.env_rank(), size, spec.device))
