"""Prometheus metrics of `ferry serve`: vLLM's names with the `ferry:` prefix.

Dashboards and the Gateway API Inference Extension written for vLLM work by
changing `vllm:` to `ferry:`. Gauges and cache counters come from the core's
EngineStats (sent with every step); latency histograms are measured in the
API process, where tokens reach the client.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from ferry.engine.async_llm import MetricsSink, SeqTiming
from ferry.engine.messages import EngineInfo, EngineStats
from ferry.kv_transfer.outcome import KVTransferDone

disable_created_metrics()  # `*_created` series only double the scrape size

# vLLM's buckets, so percentiles compare across the two.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]  # fmt: skip
TRANSFER_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
N_BUCKETS = [1, 2, 5, 10, 20]
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]  # vLLM's


def buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets: token-count histograms)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]  # fmt: skip


class ServerMetrics(MetricsSink):
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        # process_* (CPU, memory, open fds, start time): a gateway tells a restart by the start time.
        ProcessCollector(registry=self.registry)
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"ferry:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"ferry:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"ferry:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.model_name = model_name
        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        # Speculative decoding, as vLLM names them (spec_decode_num_accepted_tokens_per_pos by position).
        self.spec_drafts = counter("spec_decode_num_drafts", "Requests' steps that verified draft tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens the model kept.")
        self._spec_per_pos = Counter("ferry:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens kept, by position in the draft (0: the first).",
                                     ["model_name", "position"], registry=r)  # fmt: skip
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens received.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter(
            "ferry:request_success", "Finished sequences by reason.", ["model_name", "finished_reason"], registry=r
        )
        for reason in ("stop", "length", "abort"):  # zeros from the start (vLLM's): rates see the first one
            self._success.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduling.", REQUEST_BUCKETS)
        # Per finished sequence, as vLLM's (phases from the first scheduling: queue, prefill to the
        # first token, decode to the last).
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduling to first token.",
                                      REQUEST_BUCKETS)  # fmt: skip
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.", REQUEST_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduling to last token.",
                                        REQUEST_BUCKETS)  # fmt: skip
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "A request's decode time over its tokens after the first.", ITL_BUCKETS)  # fmt: skip
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step (prompt and decode).",
                                          ITERATION_BUCKETS)  # fmt: skip
        self._histogram = histogram
        self.request_tokens: dict[str, Histogram] = {}  # by max_model_len (set_engine_info): token-count buckets
        self._cache_info = Gauge(
            "ferry:cache_config_info", "KV-cache configuration.", ["block_size", "num_gpu_blocks"], registry=r
        )
        # Prefill/decode disaggregation (kv_transfer/connector.py), by direction: sent | received.
        self._kv_bytes = Counter("ferry:kv_transfer_bytes", "KV-cache bytes moved to or from other workers.",
                                 ["model_name", "direction"], registry=r)  # fmt: skip
        self._kv_blocks = Counter("ferry:kv_transfer_blocks", "KV-cache blocks moved (imported or sent).",
                                  ["model_name", "direction"], registry=r)  # fmt: skip
        self._kv_seconds = Histogram("ferry:kv_transfer_seconds", "Duration of a KV transfer.",
                                     ["model_name", "direction"], buckets=TRANSFER_BUCKETS, registry=r)  # fmt: skip
        self._kv_failures = Counter("ferry:kv_transfer_failures", "KV transfers that failed.",
                                    ["model_name", "direction"], registry=r)  # fmt: skip
        self._remote_prefill = Counter(
            "ferry:remote_prefill_requests", "Requests prefilled by another worker: continued from its token, or "
            "recomputed here (the token could not be used: logprobs, n > 1, another prompt).",
            ["model_name", "outcome"], registry=r)  # fmt: skip
        for direction in ("sent", "received"):  # zeros from the start, so rates and deltas work
            for family in (self._kv_bytes, self._kv_blocks, self._kv_failures):
                family.labels(model_name, direction)
        for outcome in ("continued", "recomputed"):
            self._remote_prefill.labels(model_name, outcome)
        self._last: EngineStats | None = None
        # Plain totals beside the counters, for the periodic log line (stats_log.py).
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    @property
    def last_stats(self) -> EngineStats | None:
        """The core's latest stats (running totals, and the batch as it stands)."""
        return self._last

    def set_engine_info(self, info: EngineInfo) -> None:
        self._cache_info.labels(str(info.block_size), str(info.num_kv_blocks)).set(1)
        if not self.request_tokens:
            tokens = buckets_1_2_5(info.max_model_len)
            for name, doc, buckets in (
                ("request_prompt_tokens", "A finished request's prompt tokens.", tokens),
                ("request_generation_tokens", "A finished sequence's generated tokens.", tokens),
                (
                    "request_max_num_generation_tokens",
                    "The most tokens one of a finished request's sequences generated.",
                    tokens,
                ),
                ("request_params_max_tokens", "The max_tokens a request asked for.", tokens),
                ("request_params_n", "The n a request asked for.", N_BUCKETS),
            ):
                self.request_tokens[name] = self._histogram(name, doc, buckets)

    def on_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        if stats.step_tokens:
            self.iteration_tokens.observe(stats.step_tokens)
        last = self._last
        # The core sends running totals; counters take the increments.
        for counter, now, before in (
            (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries if last else 0),
            (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits if last else 0),
            (self.preemptions, stats.num_preemptions, last.num_preemptions if last else 0),
            (self.spec_drafts, stats.spec_num_drafts, last.spec_num_drafts if last else 0),
            (self.spec_draft_tokens, stats.spec_num_draft_tokens, last.spec_num_draft_tokens if last else 0),
            (self.spec_accepted, stats.spec_num_accepted_tokens, last.spec_num_accepted_tokens if last else 0),
        ):
            if now > before:
                counter.inc(now - before)
        before_pos = last.spec_accepted_per_pos if last else []
        for pos, now in enumerate(stats.spec_accepted_per_pos):
            seen = before_pos[pos] if pos < len(before_pos) else 0
            child = self._spec_per_pos.labels(self.model_name, str(pos))  # every position, from zero
            if now > seen:
                child.inc(now - seen)
        self._last = stats

    def on_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)
        self.prompt_tokens_total += num_tokens

    def on_first_token(self, ttft: float, queue_time: float | None) -> None:
        self.ttft.observe(ttft)
        if queue_time is not None:
            self.queue.observe(max(queue_time, 0.0))

    def on_tokens(self, num_tokens: int, inter_token_latency: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        self.generation_tokens_total += num_tokens
        if inter_token_latency is not None:
            self.itl.observe(inter_token_latency)

    def on_finished(self, reason: str, e2e: float, seq: SeqTiming | None = None) -> None:
        self._success.labels(self.model_name, reason).inc()
        self.e2e.observe(e2e)
        tally = seq.tally if seq is not None else None
        if tally is not None:
            tally.unfinished -= 1
            tally.max_tokens_generated = max(tally.max_tokens_generated, seq.num_tokens)
            if tally.unfinished == 0 and self.request_tokens:  # the request's last sequence
                self.request_tokens["request_max_num_generation_tokens"].observe(tally.max_tokens_generated)
        if seq is None or seq.first_token is None or seq.last_token is None:
            return  # nothing generated (aborted in the queue): no phases to time
        scheduled = seq.arrival + (seq.queue_time or 0.0)
        decode = seq.last_token - seq.first_token
        self.prefill_time.observe(max(seq.first_token - scheduled, 0.0))
        self.decode_time.observe(decode)
        self.inference_time.observe(max(seq.last_token - scheduled, 0.0))
        if seq.num_tokens > 1:
            self.tpot.observe(decode / (seq.num_tokens - 1))
        hist = self.request_tokens
        if hist:
            hist["request_generation_tokens"].observe(seq.num_tokens)
            if seq.num_prompt_tokens:  # a request's first sequence: its prompt and parameters, once
                hist["request_prompt_tokens"].observe(seq.num_prompt_tokens)
                hist["request_params_n"].observe(seq.n)
                if seq.max_tokens is not None:
                    hist["request_params_max_tokens"].observe(seq.max_tokens)

    def on_kv_transfer(self, done: KVTransferDone) -> None:
        labels = (self.model_name, done.direction)
        if not done.ok:
            self._kv_failures.labels(*labels).inc()
            return
        self._kv_bytes.labels(*labels).inc(done.num_bytes)
        self._kv_blocks.labels(*labels).inc(done.num_blocks)
        self._kv_seconds.labels(*labels).observe(done.seconds)

    def on_remote_prefill(self, continued: bool) -> None:
        self._remote_prefill.labels(self.model_name, "continued" if continued else "recomputed").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
