"""The gateway's Prometheus metrics (`GET /metrics`), in a registry of its own.

Its own `CollectorRegistry`, not the process-wide default, so `/metrics`
shows the gateway's series only and two Gateway objects in one process do not
collide on metric names. Routing, retries, failures, the result cache, rate
limiting and PD decisions are counted where they happen; token usage, time to
first token and time per output token follow the OpenTelemetry GenAI semantic
conventions (as Prometheus names) and are observed when a passed-through
response settles (settlement.py). The per-worker gauges are set from the
workers' state at scrape time. Beside the registry, `activity` keeps the
recent decisions and a short latency history for the dashboard (activity.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from ferry.gateway.activity import Activity
from ferry.gateway.replicas import Worker

disable_created_metrics()  # `*_created` series only double the scrape size (as the server's)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.activity = Activity()
        r = self.registry
        self.decisions = Counter("ferry_gateway_routing_decisions", "routing decisions", ["model", "worker", "reason"],
                                 registry=r)  # fmt: skip
        self.overlap = Histogram("ferry_gateway_prefix_overlap", "cached share of the prompt on the chosen worker",
                                 buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)  # fmt: skip
        self.retries = Counter("ferry_gateway_retries", "requests retried on another worker", ["model"], registry=r)
        self.failed = Counter("ferry_gateway_failed_requests", "requests no worker could take", ["model"], registry=r)
        self.cache = Counter("ferry_gateway_result_cache", "result cache lookups", ["result"], registry=r)
        self.rate_limited = Counter("ferry_gateway_rate_limited", "requests refused by a token limit", ["key"],
                                    registry=r)  # fmt: skip
        # OpenTelemetry GenAI semantic conventions, as Prometheus names.
        self.token_usage = Histogram("gen_ai_client_token_usage", "tokens per request",
                                     ["gen_ai_request_model", "key", "gen_ai_token_type"], registry=r,
                                     buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536))  # fmt: skip
        self.ttft = Histogram("gen_ai_server_time_to_first_token_seconds", "time to the first token",
                              ["gen_ai_request_model", "key"], registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))  # fmt: skip
        self.tpot = Histogram("gen_ai_server_time_per_output_token_seconds", "time per output token after the first",
                              ["gen_ai_request_model", "key"], registry=r,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5))  # fmt: skip
        self.pd_decisions = Counter("ferry_gateway_pd_decisions", "disaggregated serving: where a prompt was "
                                    "prefilled (disaggregated | local: on its decode worker | fallback: no prefill "
                                    "worker could)", ["model", "decision"], registry=r)  # fmt: skip
        self.prefill_seconds = Histogram("ferry_gateway_prefill_seconds", "remote prefill, KV transfer included",
                                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                         registry=r)  # fmt: skip
        self.healthy = Gauge("ferry_gateway_worker_healthy", "1 if the worker is in its pools", ["worker"], registry=r)
        self.in_flight = Gauge("ferry_gateway_worker_in_flight", "requests in flight", ["worker"], registry=r)
        self.in_progress = Gauge("ferry_gateway_requests_in_progress", "API requests the gateway is handling, "
                                 "from their first byte to their response's last", registry=r)  # fmt: skip
        self.held = Gauge("ferry_gateway_requests_held", "requests waiting for a worker of their model to become "
                          "ready (--hold-timeout: scale from zero)", registry=r)  # fmt: skip
        self.held_outcomes = Counter("ferry_gateway_held_requests", "how waits for a worker ended (ready: a "
                                     "worker came | timeout | full: no place left to wait)", ["outcome"],
                                     registry=r)  # fmt: skip
        self.client_gone = Counter("ferry_gateway_client_disconnects", "requests whose client left before their "
                                   "response ended (stage: before_response | during_response); what they started "
                                   "on a worker is aborted there", ["stage"], registry=r)  # fmt: skip

    def render(self, workers: list[Worker]) -> bytes:
        for w in workers:
            self.healthy.labels(w.url).set(1.0 if w.healthy else 0.0)
            self.in_flight.labels(w.url).set(w.in_flight)
        return generate_latest(self.registry)
