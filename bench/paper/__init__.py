"""The vLLM paper's memory experiments on this engine, with its baselines in the same engine.

`python -m bench.paper --out DIR` measures, for the allocation policies of
`engine.config.KV_ALLOCATIONS` ("paged" and the paper's contiguous reservations):

- Fig. 2: the share of allocated KV slots holding a token, and the waste split into reserved but
  unused, internal fragmentation and free slots;
- Fig. 13: the mean number of running requests at a fixed rate;
- Fig. 12: normalized latency against request rate, and the highest rate each policy sustains
  under a latency bound;
- Fig. 15: the KV blocks saved by sharing, for parallel sampling and beam search;
- the agreement of the real engine and the replay on the same trace at a reduced scale.

and, on the real engine at the reduced scale (`serving`):

- Fig. 16: throughput and prefix-cache hit rate of few-shot prompts with prefix caching on and off;
- Fig. 18: normalized latency at a fixed rate for block sizes 1-256, the KV slots fixed;
- Fig. 19: time per preempted token, by recompute and by swap, for block sizes 1-256.

Modules: `traces` (the workloads), `step_model` (the replay's clock), `replay` (the real scheduler
and KV cache manager without the model), `engine_run` (the same on the real engine), `record`
(what a run records and the numbers taken from it), `figures` (the memory experiments),
`serving` (Fig. 16, 18, 19), `report` and `serving_report` (report.md, JSON, plots), `__main__`
(the command line; `--figures` selects).
"""
