"""The tensor-parallel group of a rank and its collectives: `engine.parallel_state`, under the
name the runtime imports it by (the module itself lives outside this package so that the model
can import it without `engine.model` and `engine.distributed` importing each other)."""

from engine.parallel_state import SINGLE, TensorParallel

__all__ = ["SINGLE", "TensorParallel"]
