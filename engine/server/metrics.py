"""Prometheus metrics under vLLM's names, in a registry of their own (one per server).

Gauges follow the engine's `stats()` snapshot after every step; the engine's cumulative counts
(prefix-cache queries and hits, preemptions, speculative decoding's drafts, draft tokens and
accepted tokens, the last also by position) are turned into counter increments; token counters and
latency histograms are fed per request by `engine.server.async_engine`. Every metric carries the
`model_name` label, as vLLM's do.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Bucket edges in seconds (vLLM's, trimmed to what a CPU server sees).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0)

#: Cumulative counters in the engine's stats() -> our counter attribute.
_ENGINE_COUNTERS = {"prefix_cache_queries": "prefix_cache_queries",
                    "prefix_cache_hits": "prefix_cache_hits",
                    "num_preemptions": "num_preemptions",
                    "spec_decode_num_drafts": "spec_decode_num_drafts",
                    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
                    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens"}
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """The server's Prometheus metrics for one served model."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running",
                                          "Requests being computed (in the running batch).")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting",
                                          "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("vllm:kv_cache_usage_perc",
                                         "Fraction of KV-cache blocks in use (1 = all).")
        self.num_free_kv_blocks = gauge("engine:num_free_kv_blocks",
                                        "KV-cache blocks not held by any request.")
        self.num_total_kv_blocks = gauge("engine:num_total_kv_blocks",
                                         "KV-cache blocks in the device pool.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("vllm:num_preemptions", "Preemptions of requests.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.request_success = Counter("vllm:request_success", "Requests finished, by reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Arrival to first generated token.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Time between consecutive generated tokens.",
                                             _ITL_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Arrival to the last token.", _E2E_BUCKETS)
        self.spec_decode_num_drafts = counter("vllm:spec_decode_num_drafts",
                                              "Speculative verification steps (one per sequence "
                                              "with proposals).")
        self.spec_decode_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                                    "Proposed (draft) tokens.")
        self.spec_decode_num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                                       "Proposed tokens the target accepted.")
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted proposed tokens by position in the draft (0: the first).",
            ["model_name", "position"], registry=r)
        self.engine_loop_restarts = counter("engine:engine_loop_restarts",
                                            "Restarts of the engine loop after its thread died.")
        self._engine_counts = {key: 0 for key in _ENGINE_COUNTERS}
        self._per_pos_counts: list[int] = []

    def update_from_stats(self, stats: Any) -> None:
        """Sets the gauges and advances the engine-side counters from an engine stats snapshot
        (an object with attributes or a dict with the keys of `LLMEngine.stats()`)."""
        get = stats.get if isinstance(stats, dict) else (lambda k, d=None: getattr(stats, k, d))
        self.num_requests_running.set(get("num_running", 0))
        self.num_requests_waiting.set(get("num_waiting", 0))
        self.kv_cache_usage_perc.set(get("kv_cache_usage_perc", 0.0))
        if get("num_free_blocks") is not None:
            self.num_free_kv_blocks.set(get("num_free_blocks"))
        if get("num_total_blocks") is not None:
            self.num_total_kv_blocks.set(get("num_total_blocks"))
        for key, attr in _ENGINE_COUNTERS.items():
            value = int(get(key, 0) or 0)
            if value > self._engine_counts[key]:
                getattr(self, attr).inc(value - self._engine_counts[key])
                self._engine_counts[key] = value
        self._advance_per_pos(get(_PER_POS, ()) or ())

    def _advance_per_pos(self, counts: Any) -> None:
        """Advances the per-position accepted-token counters to the engine's `counts`."""
        for pos, value in enumerate(counts):
            if pos == len(self._per_pos_counts):
                self._per_pos_counts.append(0)
            if value > self._per_pos_counts[pos]:
                self.spec_decode_num_accepted_tokens_per_pos.labels(
                    self.model_name, str(pos)).inc(value - self._per_pos_counts[pos])
                self._per_pos_counts[pos] = value

    def set_baseline(self, stats: Any) -> None:
        """Takes the engine's cumulative counts in `stats` as the zero of the counters (work done
        before serving, such as the warm-up request, is not reported)."""
        get = stats.get if isinstance(stats, dict) else (lambda k, d=None: getattr(stats, k, d))
        for key in _ENGINE_COUNTERS:
            self._engine_counts[key] = int(get(key, 0) or 0)
        self._per_pos_counts = [int(v) for v in get(_PER_POS, ()) or ()]

    def observe_finished(self, reason: str) -> None:
        self.request_success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
