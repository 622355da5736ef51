"""Prometheus metrics for GET /metrics, in a registry of their own (not the global one).

Named as vLLM names them (`vllm:...`, every series labelled `model_name`), so the Grafana
dashboards made for vLLM work unchanged; what vLLM has no name for is `pagedllm:...`.
Latencies and token counts come from the engine's outputs as they pass (OutputObserver);
gauges, and counters the engine keeps itself (preemptions, prefix cache, speculative
decoding), are read from its stats at each scrape.
"""
from __future__ import annotations

import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.outputs import RequestOutput

# No `*_created` series beside every counter and histogram (as vLLM): nothing reads them,
# and they would double the exposition. prometheus_client's switch is process-wide.
prometheus_client.disable_created_metrics()

# Seconds; wide enough for a slow CPU and a loaded GPU alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (a token count's histogram)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class _FromTotal:
    """A counter fed from a running total the engine keeps: each scrape adds what is new."""

    def __init__(self, counter: Counter) -> None:
        self.counter, self.seen = counter, 0

    def set_total(self, total: int) -> None:
        if total > self.seen:
            self.counter.inc(total - self.seen)
            self.seen = total


class ServerMetrics:
    """Every metric of the server, its series labelled with the served model's name."""

    def __init__(self, model_name: str = "", max_model_len: int = 4096,
                 enable_lora: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._engine_metrics()
        # vLLM's: one series, its labels the adapters now running and waiting, its value
        # the unix time it was set (here: at each scrape). Only with LoRA, as vLLM.
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                               ["model_name", "max_lora", "waiting_lora_adapters",
                                "running_lora_adapters"],
                               registry=self.registry) if enable_lora else None
        self._request_metrics(max_model_len)
        # request id -> time its latest token was seen
        self._last_token_time: dict[str, float] = {}

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def _engine_metrics(self) -> None:
        """What the engine's stats give at each scrape."""
        gauge, counter = self._gauge, self._counter
        self.num_running = gauge("vllm:num_requests_running", "Requests in the running batch")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.num_swapped = gauge("pagedllm:num_requests_swapped",
                                 "Requests swapped out to host memory")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc",
                                    "Fraction of KV cache blocks in use (0-1)")
        self.prefix_cache_hit_rate = gauge(
            "pagedllm:prefix_cache_hit_rate",
            "Fraction of queried prompt tokens found in the prefix cache, since start")
        self.weight_bytes = gauge("pagedllm:model_weight_bytes",
                                  "Bytes of the model's weights as stored (quantized or not)")
        self.spec_acceptance_rate = gauge("pagedllm:spec_decode_acceptance_rate",
                                          "Accepted / proposed tokens (0-1)")
        self.spec_mean_accepted_length = gauge(
            "pagedllm:spec_decode_mean_accepted_length",
            "Tokens per speculative row and step: accepted proposals + the target's own")
        self.preemptions = _FromTotal(counter("vllm:num_preemptions",
                                              "Preemptions since the engine started"))
        self.prefix_queries = _FromTotal(counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"))
        self.prefix_hits = _FromTotal(counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache"))
        self.spec_drafts = _FromTotal(counter("vllm:spec_decode_num_drafts",
                                              "Speculative rows verified (one draft each)"))
        self.spec_draft_tokens = _FromTotal(counter(
            "vllm:spec_decode_num_draft_tokens", "Proposed tokens scored by the target model"))
        self.spec_accepted_tokens = _FromTotal(counter(
            "vllm:spec_decode_num_accepted_tokens", "Proposed tokens the target model accepted"))

    def _request_metrics(self, max_model_len: int) -> None:
        self.sequence_errors = self._counter(
            "pagedllm:sequence_errors",
            "Sequences that ended with finish_reason error (a grammar limit hit mid-way)")
        """What the requests' outputs give as they pass."""
        r, model_name = self.registry, self.model_name
        counter, histogram = self._counter, self._histogram
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests that ran")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self._success = Counter("vllm:request_success", "Requests finished, by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)  # every series from the first scrape
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Time from arrival to the first generated token", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Time from arrival to the end of a request", REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Time from arrival to the first schedule", REQUEST_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Time from the first schedule to the first token",
                                      REQUEST_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Time from the first token to the end", REQUEST_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Time from the first schedule to the end",
                                        REQUEST_BUCKETS)
        buckets = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Prompt tokens per finished request", buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished request", buckets)

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
            # Several tokens in one step (a decode window, speculative decoding) share the
            # gap: one observation per token, so the count is the tokens' as vLLM's.
            tokens = max(1, max(len(ids) for _, ids in output.deltas))
            for _ in range(tokens):
                self.itl.observe(max(0.0, gap / tokens))
            self._last_token_time[output.request_id] = last
        if output.finished:
            self._last_token_time.pop(output.request_id, None)
            errors = sum(o.finish_reason == "error" for o in output.outputs)
            if errors:
                self.sequence_errors.inc(errors)
            if output.error is None:
                self._on_finished(output)

    def _on_finished(self, output: RequestOutput) -> None:
        """A request's totals and latencies once it is done (a pooling request's too: its
        prompt tokens count here, as it generates none)."""
        if output.embedding is not None:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            reason = "stop"
        else:
            reason = output.outputs[0].finish_reason if output.outputs else "stop"
        self._success.labels(self.model_name, reason or "stop").inc()
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(sum(len(o.token_ids) for o in output.outputs))
        m = output.metrics
        if m is None:
            return
        end = m.finished_time or time.monotonic()
        self.e2e.observe(max(0.0, end - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            self.inference_time.observe(max(0.0, end - m.first_scheduled_time))
            if m.first_token_time is not None:
                self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.first_token_time is not None:
            self.decode_time.observe(max(0.0, end - m.first_token_time))

    def on_abort(self, request_id: str) -> None:
        """A request ended before finishing (its client left, or the engine failed)."""
        self._last_token_time.pop(request_id, None)
        self._success.labels(self.model_name, "abort").inc()

    def render(self, stats) -> bytes:
        """The exposition text, with the gauges read from engine stats now."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.num_swapped.set(stats.num_swapped)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_cache_hit_rate.set(stats.prefix_cache_hit_rate)
        self.weight_bytes.set(stats.weight_bytes)
        self.preemptions.set_total(stats.num_preemptions)
        self.prefix_queries.set_total(getattr(stats, "prefix_cache_queries", 0))
        self.prefix_hits.set_total(getattr(stats, "prefix_cache_hits", 0))
        self.spec_drafts.set_total(getattr(stats, "spec_num_verified_rows", 0))
        self.spec_draft_tokens.set_total(getattr(stats, "spec_num_draft_tokens", 0))
        self.spec_accepted_tokens.set_total(getattr(stats, "spec_num_accepted_tokens", 0))
        self.spec_acceptance_rate.set(getattr(stats, "spec_acceptance_rate", 0.0))
        self.spec_mean_accepted_length.set(getattr(stats, "spec_mean_accepted_length", 0.0))
        if self.lora_info is not None:
            self._set_lora_info(stats)
        return generate_latest(self.registry)

    def _set_lora_info(self, stats) -> None:
        """The one current series (the last scrape's labels are dropped, not kept stale)."""
        self.lora_info.clear()
        self.lora_info.labels(self.model_name, str(stats.max_loras),
                              ",".join(stats.waiting_lora_adapters),
                              ",".join(stats.running_lora_adapters)).set_to_current_time()
