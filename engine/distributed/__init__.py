"""Tensor parallelism on `torch.distributed`: the rank's process group (parallel_state.py)."""
