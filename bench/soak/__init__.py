"""`python -m bench.soak`: a bounded-time soak with faults against real `engine.serve` servers.

One server per preemption mode (recompute, swap), each with a KV pool small enough to preempt,
run side by side. Each gets a clean greedy run, then concurrent clients (the official `openai`
client and raw httpx; completions and chats, streaming or not, `n > 1`, shared prefixes, stop
strings, bad requests, clients that leave mid-stream or before the answer) while faults are
injected through the debug endpoints (`engine.server.debug`): a model step that raises, and
the engine thread killed. At the end each server must have answered every request completely
or with a clear error, leaked no KV block, kept its memory, reproduced the clean run's greedy
answers and still serve. Modules: `workload` (what is sent), `clients` (sending and judging one
request), `server` (the subprocess), `run` (one server's soak), `judge` (its verdict), `report`.
"""
