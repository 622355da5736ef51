"""Prometheus metrics for GET /metrics, in a registry of their own (not the global one)."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.outputs import RequestOutput

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    """Latency and token counts from every engine output; gauges set from stats at scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_running = Gauge("pagedllm:num_requests_running",
                                 "Requests in the running batch", registry=r)
        self.num_waiting = Gauge("pagedllm:num_requests_waiting",
                                 "Requests waiting to be scheduled", registry=r)
        self.num_swapped = Gauge("pagedllm:num_requests_swapped",
                                 "Requests swapped out to host memory", registry=r)
        self.kv_cache_usage = Gauge("pagedllm:kv_cache_usage_perc",
                                    "Fraction of KV cache blocks in use (0-1)", registry=r)
        self.prefix_cache_hit_rate = Gauge("pagedllm:prefix_cache_hit_rate",
                                           "Fraction of prompt tokens found in the prefix cache",
                                           registry=r)
        self.num_preemptions = Gauge("pagedllm:num_preemptions",
                                     "Preemptions since the engine started", registry=r)
        self.weight_bytes = Gauge("pagedllm:model_weight_bytes",
                                  "Bytes of the model's weights as stored (quantized or not)",
                                  registry=r)
        # Speculative decoding (0 without it): proposals scored and accepted since start.
        self.spec_draft_tokens = Gauge("pagedllm:spec_decode_num_draft_tokens",
                                       "Proposed tokens scored by the target model", registry=r)
        self.spec_accepted_tokens = Gauge("pagedllm:spec_decode_num_accepted_tokens",
                                          "Proposed tokens the target model accepted",
                                          registry=r)
        self.spec_acceptance_rate = Gauge("pagedllm:spec_decode_acceptance_rate",
                                          "Accepted / proposed tokens (0-1)", registry=r)
        self.spec_mean_accepted_length = Gauge(
            "pagedllm:spec_decode_mean_accepted_length",
            "Tokens per speculative row and step: accepted proposals + the target's own",
            registry=r)
        self.ttft = Histogram("pagedllm:time_to_first_token_seconds",
                              "Time from arrival to the first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pagedllm:inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pagedllm:prompt_tokens_total",
                                     "Prompt tokens of requests that started", registry=r)
        self.generation_tokens = Counter("pagedllm:generation_tokens_total",
                                         "Tokens generated", registry=r)
        self.sequence_errors = Counter(
            "pagedllm:sequence_errors_total",
            "Sequences that ended with finish_reason error (a grammar limit hit mid-way)",
            registry=r)
        # request id -> time its latest token was seen
        self._last_token_time: dict[str, float] = {}

    # OutputObserver: called on the event loop for every engine output.
    def on_output(self, output: RequestOutput) -> None:
        new_tokens = sum(len(ids) for _, ids in output.deltas)
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
        if output.request_id not in self._last_token_time and new_tokens:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            metrics = output.metrics
            first = metrics.first_token_time if metrics and metrics.first_token_time else None
            if metrics is not None and first is not None:
                self.ttft.observe(max(0.0, first - metrics.arrival_time))
            self._last_token_time[output.request_id] = first or time.monotonic()
        elif new_tokens:
            last = output.metrics.last_token_time if output.metrics else None
            last = last or time.monotonic()
            gap = last - self._last_token_time[output.request_id]
            # Several tokens in one step (speculative decoding) share the gap.
            per_token = gap / max(1, max(len(ids) for _, ids in output.deltas))
            self.itl.observe(max(0.0, per_token))
            self._last_token_time[output.request_id] = last
        if output.finished:
            self._last_token_time.pop(output.request_id, None)
            errors = sum(o.finish_reason == "error" for o in output.outputs)
            if errors:
                self.sequence_errors.inc(errors)

    def on_abort(self, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)

    def render(self, stats) -> bytes:
        """The exposition text, with the gauges read from engine stats now."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.num_swapped.set(stats.num_swapped)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_cache_hit_rate.set(stats.prefix_cache_hit_rate)
        self.num_preemptions.set(stats.num_preemptions)
        self.weight_bytes.set(stats.weight_bytes)
        self.spec_draft_tokens.set(getattr(stats, "spec_num_draft_tokens", 0))
        self.spec_accepted_tokens.set(getattr(stats, "spec_num_accepted_tokens", 0))
        self.spec_acceptance_rate.set(getattr(stats, "spec_acceptance_rate", 0.0))
        self.spec_mean_accepted_length.set(getattr(stats, "spec_mean_accepted_length", 0.0))
        return generate_latest(self.registry)
