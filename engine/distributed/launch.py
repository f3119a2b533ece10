"""Starting a tensor-parallel group: one process per rank, joined by `torch.distributed`.

Two ways in, one code path after:

- spawned: the engine's process is rank 0 (the driver); it starts ranks 1..N-1 with
  `torch.multiprocessing` ("spawn") and they meet at a `TCPStore` the driver serves on a free
  loopback port (the driver waits for every worker there, and fails at once if one exits);
- launched: `torchrun` (or any launcher) has started every rank with the `env://` variables
  (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK`); each process joins that
  group, so the ranks may be on several hosts.

The backend is gloo for CPU tensors and NCCL for CUDA ones (rank r on `cuda:LOCAL_RANK`). The
step messages always travel over a second, gloo group (CPU objects) whose timeout is long: a
worker waits there between steps for as long as the engine is idle. The default group, which
the model's all-reduces use, times out after `COLLECTIVE_TIMEOUT` (a rank that died closes its
sockets, which makes the others' collectives fail at once; the timeout covers a rank that hangs).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from engine.parallel_state import TensorParallel

#: What `torchrun` sets for every rank; all present means "join the launcher's group".
ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
#: Longest a rank waits in one all-reduce (or at start-up) for the others.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
#: The store key each spawned worker adds 1 to when it has reached the driver's store.
JOINED = "tp_workers_joined"
#: Longest a worker waits for the driver's next step message (an idle engine sends none).
IDLE_TIMEOUT = timedelta(days=365)


@dataclass
class RankGroup:
    """This process's place in the group: `tp` (rank, size, the default group, for the model's
    all-reduces), `control` (the gloo group of the step messages) and `device`."""

    tp: TensorParallel
    control: Any
    device: torch.device


def launched_by_env() -> bool:
    """Whether a launcher (torchrun) set every `env://` variable."""
    return all(os.environ.get(name) for name in ENV_VARS)


def env_rank() -> int:
    """This process's `RANK` under a launcher (0 when not launched)."""
    return int(os.environ.get("RANK", "0")) if launched_by_env() else 0


def check_env_size(size: int) -> None:
    """ValueError unless the launcher's `WORLD_SIZE` is `size` (tensor_parallel_size)."""
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"tensor_parallel_size: expected the launcher's WORLD_SIZE ({world}), "
                         f"got {size}")


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device | str, local_rank: int) -> torch.device:
    """The rank's device: `cuda:local_rank` for a CUDA engine, the CPU otherwise."""
    device = torch.device(device)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def exit_with_parent(poll_s: float = 0.5) -> None:
    """Starts a daemon thread that ends this process when its parent has gone (reparented):
    no orphan worker outlives a driver killed by SIGKILL. (Not `PR_SET_PDEATHSIG`: that fires
    when the parent's spawning thread ends, and the server builds its engine in a thread it may
    restart.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def driver_store(port: int, size: int) -> dist.TCPStore:
    """The spawned group's rendezvous store, served by the driver on loopback `port`."""
    return dist.TCPStore("127.0.0.1", port, size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                         wait_for_workers=False)


def worker_store(port: int, size: int) -> dist.TCPStore:
    """A spawned worker's client of the driver's store; counts itself in `JOINED`."""
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    store.add(JOINED, 1)
    return store


def wait_for_workers(store: dist.TCPStore, procs: list[Any]) -> None:
    """Waits until every spawned worker has reached the store; RuntimeError naming the first
    one that exited before (instead of waiting for the rendezvous timeout)."""
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    while store.add(JOINED, 0) < len(procs):
        for rank, proc in enumerate(procs, start=1):
            if proc.exitcode is not None:
                raise RuntimeError(
                    f"tensor parallelism: worker rank {rank} exited with code {proc.exitcode} "
                    "during start-up (its traceback is above; a script that builds the engine "
                    "must do so under `if __name__ == \"__main__\":`, as spawned processes "
                    "import the script again)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor parallelism: the workers did not start within "
                               f"{COLLECTIVE_TIMEOUT.total_seconds():g} s")
        time.sleep(0.05)


def init_group(rank: int, size: int, device: torch.device | str,
               store: Optional[dist.Store] = None) -> RankGroup:
    """Joins the group as `rank` of `size` (at `store` when spawned, else at `env://`, the
    device `cuda:LOCAL_RANK`), with NCCL for a CUDA `device` and gloo otherwise, and makes the
    gloo control group. Collective: every rank calls it."""
    local_rank = rank if store is not None else int(os.environ.get("LOCAL_RANK", rank))
    device = rank_device(device, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if store is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return RankGroup(TensorParallel(rank, size, None), control, device)


def leave_group() -> None:
    """Destroys this process's groups (a no-op when it is in none)."""
    if dist.is_initialized():
        dist.destroy_process_group()
