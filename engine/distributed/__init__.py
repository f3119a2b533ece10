"""Tensor parallelism on `torch.distributed`: the driver's executor (executor.py), the workers'
loop (worker.py) and how ranks start or join a group (launch.py); a rank's place in the group is
`engine.parallel_state.TensorParallel`."""
