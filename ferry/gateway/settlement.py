"""Settlement: what the gateway does once a worker's response has been passed through.

The response's usage (response_usage.py) reconciles the key's rate-limit
charge (the estimate admission.py took: nothing if the worker refused, the
real usage if it finished and reported it, else the estimate stands), feeds
the OpenTelemetry GenAI metrics, and a complete deterministic response goes
into the result cache.

It must run exactly once per passed-through response, whatever becomes of
the client, or in-flight counts and charges leak. Hence `PassThroughResponse`:
Starlette may cancel a response whose client is already gone before its body
generator starts, and then the generator's own `finally` never runs, so the
close (which settles) runs in the response's `__call__` instead. A request
that never reached a worker is settled by `release` (nothing ran: nothing is
charged).
"""

from __future__ import annotations

import time

from fastapi.responses import StreamingResponse

from ferry.gateway.admission import RequestContext
from ferry.gateway.metrics import GatewayMetrics
from ferry.gateway.rate_limit import TokenRateLimiter
from ferry.gateway.replicas import Worker
from ferry.gateway.response_usage import UsageChunkFilter, has_error_event, response_usage
from ferry.gateway.result_cache import ResultCache


class PassThroughResponse(StreamingResponse):
    """A streamed pass-through whose `close` always runs: Starlette may cancel a response whose
    client is already gone before its body generator starts, and then the generator's own
    `finally` never runs."""

    def __init__(self, content, close, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


class Settlement:
    def __init__(self, rate_limiter: TokenRateLimiter, metrics: GatewayMetrics,
                 result_cache: ResultCache | None) -> None:  # fmt: skip
        self.rate_limiter, self.metrics, self.result_cache = rate_limiter, metrics, result_cache

    def release(self, ctx: RequestContext) -> None:
        """No worker ran the request: give its charge back whole (once, however often called)."""
        if ctx.charge is not None:
            self.rate_limiter.reconcile(ctx.charge, 0, 0)  # nothing ran: nothing charged
            ctx.charge = None

    def abandoned(self, ctx: RequestContext) -> None:
        """The client left before any response reached it. Sent to a worker already (a prefill hop,
        or a request being computed), it keeps the prompt part of its charge: leaving must not be a
        way to have prompts computed for free. Sent nowhere yet, it is given back whole."""
        if ctx.charge is not None and ctx.delivered:
            self.rate_limiter.reconcile(ctx.charge, None, 0)  # the prompt's estimate stands, nothing generated
            ctx.charge = None
        else:
            self.release(ctx)

    def settle(self, ctx: RequestContext, worker: Worker, status: int, headers: dict[str, str],
               body: bytes | None, complete: bool, first_token_at: float | None,
               client_left: bool = False) -> None:  # fmt: skip
        """After a passed-through response: usage, rate-limit reconciliation, metrics, cache."""
        if client_left:
            self.metrics.client_gone.labels("during_response").inc()
        prompt = completion = None
        exact = False
        if body is not None and status == 200:
            prompt, completion, exact = response_usage(body, ctx.streamed)
        if ctx.charge is not None:
            if status != 200:
                self.rate_limiter.reconcile(ctx.charge, 0, 0)  # refused by the worker: nothing generated
            elif complete and exact:
                self.rate_limiter.reconcile(ctx.charge, prompt, completion)
            # else: the estimate stands (a broken or unmetered response may have used all of it)
        if status != 200:
            return
        m, labels = self.metrics, (ctx.model, ctx.key_name)
        if prompt is not None:
            m.token_usage.labels(*labels, "input").observe(prompt)
        if completion is not None:
            m.token_usage.labels(*labels, "output").observe(completion)
        ttft = tpot = None
        if first_token_at is not None:  # streamed: a non-streamed body's first byte is its last
            ttft = first_token_at - ctx.started
            m.ttft.labels(*labels).observe(ttft)
            if completion and completion > 1 and complete:
                tpot = (time.monotonic() - first_token_at) / (completion - 1)
                m.tpot.labels(*labels).observe(tpot)
        m.activity.settled(completion, ttft, tpot)
        cacheable = complete and body is not None and not (ctx.streamed and has_error_event(body))
        if cacheable and ctx.cache_key is not None and self.result_cache is not None:
            kept = {k: v for k, v in headers.items() if k.lower() == "content-type"}
            if ctx.strip_usage:  # replayed as the client got it; the usage is kept beside it
                strip = UsageChunkFilter()
                body = strip.feed(body) + strip.flush()
            self.result_cache.put(ctx.cache_key, status, kept, body, worker.url, (prompt, completion))
