"""Getting an admitted request to a worker that takes it: plain, disaggregated, and the prefill hop.

Every path runs the same loop, `try_workers`: take the current candidates
(the healthy pool, recomputed before every choice, less the workers already
tried), let a chooser pick one, and attempt it. An attempt ends in `Done`
(its value is the answer), `Retry` (this worker failed; it may hand over a
5xx to answer with if no other worker does better) or `GiveUp` (no other
worker would do better). The loop stops when no candidate is left or more
than `max_retries` workers have been tried, so a request gets at most
`max_retries + 1` attempts; each attempt after the first counts in
`ferry_gateway_retries`. The paths differ only in their candidates, chooser
and attempt:

Before either path, a request whose model has no healthy worker may wait for
one (`wait_for_worker`, with `--hold-timeout`: scale from zero).

- plain (`route`): the model's colocated pool, the policy's choice
  (routing.py), one exchange (passthrough.py); when every attempt fails the
  client gets the last worker's 5xx, or a 503.
- disaggregated (`route_pd`): the decode worker is chosen first, since the
  prefill hop sends the prompt's KV blocks to it; then the prefill hop (below,
  unless the decode worker caches enough of the prompt to prefill it
  itself), then the loop over the decode pool starting with that worker.
- prefill hop (`prefill`): the prefill pool (the API key's named pool, if
  any), one non-streamed POST with `max_tokens` 1. A 4xx other than 429 gives
  up (the request's own fault: the decode worker, prefilling it itself, will
  say what it is); a 429 (queue full) or 5xx tries another prefill worker.
  Connection errors, 502 and 503 count against the breaker, as in
  passthrough.py, but a timeout while reading (or a 504) does not (a long prompt is
  slow, not broken). When no prefill worker can, the decode worker prefills
  the prompt itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from ferry.gateway.admission import RequestContext
from ferry.gateway.disagg import (
    DISAGGREGATED,
    FALLBACK,
    LOCAL,
    decode_body,
    prefill_body,
    receiver_of,
    why_not_disaggregated,
)
from ferry.gateway.kv_index import KVMirrors
from ferry.gateway.metrics import GatewayMetrics
from ferry.gateway.passthrough import UpstreamError, pass_through, send, worker_headers
from ferry.gateway.prompts import PromptTokenizer
from ferry.gateway.replicas import MonitorConfig, Worker, pool
from ferry.gateway.responses import PREFILL_HEADER, WORKER_HEADER, error_response
from ferry.gateway.routing import Routing
from ferry.gateway.settlement import Settlement
from ferry.gateway.waiting_room import TIMED_OUT, WaitingRoom

UNKNOWN_MODEL = "unknown"

logger = logging.getLogger(__name__)
ALL_ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class Done:
    value: Any


@dataclass(frozen=True)
class Retry:
    error: UpstreamError | None = None  # this worker's 5xx, to answer with if no other worker does better


@dataclass(frozen=True)
class GiveUp:
    error: UpstreamError | None = None  # the answer to give, if this attempt got one


@dataclass
class Tries:
    """How `try_workers` ended."""

    done: Done | None  # the attempt that succeeded, if one did
    tried: set[str]  # the URLs of the workers attempted
    last_error: UpstreamError | None  # the last 5xx an attempt handed over


async def try_workers(
    candidates: Callable[[], list[Worker]],
    choose: Callable[[list[Worker]], Awaitable[Worker]],
    attempt: Callable[[Worker], Awaitable[Done | Retry | GiveUp]],
    *,
    max_retries: int,
    on_retry: Callable[[], None],
    first: Worker | None = None,
) -> Tries:
    """Attempt workers one at a time until one is done or gives up, none is left, or more than
    `max_retries` have been tried. `candidates()` is the current pool (workers already tried are
    left out here); `choose` picks one of a non-empty list; `first`, if given, is attempted
    first without asking either. `on_retry` runs before every attempt but the first."""
    tried: set[str] = set()
    last_error: UpstreamError | None = None
    worker = first
    while True:
        if worker is None:
            left = [w for w in candidates() if w.url not in tried]
            if not left or len(tried) > max_retries:
                return Tries(None, tried, last_error)
            if tried:
                on_retry()
            worker = await choose(left)
        tried.add(worker.url)
        outcome = await attempt(worker)
        if isinstance(outcome, Done):
            return Tries(outcome, tried, last_error)
        if isinstance(outcome, GiveUp):
            return Tries(None, tried, outcome.error or last_error)
        last_error = outcome.error or last_error
        worker = None


class Proxy:
    def __init__(self, workers: list[Worker], routing: Routing, kv: KVMirrors, prompts: PromptTokenizer,
                 settlement: Settlement, metrics: GatewayMetrics, breaker: MonitorConfig, max_retries: int,
                 pd_min_prefill_tokens: int, waiting_room: WaitingRoom) -> None:  # fmt: skip
        self.workers, self.routing, self.kv, self.prompts = workers, routing, kv, prompts
        self.settlement, self.metrics, self.breaker = settlement, metrics, breaker
        self.max_retries, self.pd_min_prefill_tokens = max_retries, pd_min_prefill_tokens
        self.waiting_room = waiting_room
        self.client: httpx.AsyncClient | None = None  # the gateway's, once it has started

    async def wait_for_worker(self, ctx: RequestContext, roles: tuple[tuple[str, ...], ...]) -> Response | None:
        """With --hold-timeout: wait until a pool of one of `roles` has a healthy worker of the
        model (waiting_room.py). None to go on (a pool is ready, or nothing may wait: the retry loop
        then answers 503 as before); else the answer: 503 when the wait ended without a worker, 404
        when the workers that came up do not serve the model."""

        def ready() -> bool:  # a pool to route to, or the knowledge that the model is nobody's (a 404)
            if any(pool(self.workers, ctx.model, r)[0] for r in roles):
                return True
            return not pool(self.workers, ctx.model, ALL_ROLES)[1] and any(w.models for w in self.workers)

        why = await self.waiting_room.wait(ready)
        if why is not None and why != "disabled":
            self.metrics.failed.labels(self._model_label(ctx.model)).inc()
            if why == TIMED_OUT:
                message = f"no worker for model `{ctx.model}` became ready within {self.waiting_room.timeout:g} s"
            else:
                message = "too many requests are waiting for a worker to become ready"
            return error_response(503, message, "service_unavailable", headers={"Retry-After": "5"})
        if not pool(self.workers, ctx.model, ALL_ROLES)[1]:  # admitted while no worker had answered yet
            return error_response(404, f"The model `{ctx.model}` does not exist.", "NotFoundError", "model")
        return None

    def _model_label(self, model: str) -> str:
        """A metric's model label: the model, if a worker serves it; else "unknown". A request's
        model is the client's text, and one series per name it makes up would grow without bound
        (while no worker has answered yet, as when scaled to zero, any name gets this far)."""
        return model if pool(self.workers, model, ALL_ROLES)[1] else UNKNOWN_MODEL

    async def route(self, ctx: RequestContext, request: Request) -> Response:
        """Pick a worker and forward; retry elsewhere while workers fail before their first byte."""
        refused = await self.wait_for_worker(ctx, (("both",),))
        if refused is not None:
            return refused

        async def choose(candidates: list[Worker]) -> Worker:
            return (await self.routing.decide(ctx, candidates)).worker

        tries = await self._try(ctx, lambda: pool(self.workers, ctx.model)[0], choose,
                                self._forward(ctx, request, ctx.raw))  # fmt: skip
        return tries.done.value if tries.done is not None else self._no_worker(ctx, tries)

    async def route_pd(self, ctx: RequestContext, request: Request) -> Response:
        """Disaggregated: prefill on a prefill worker (unless not worth it), decode on a decode worker."""
        refused = await self.wait_for_worker(ctx, (("decode",), ("both",)))  # a prefill pool is optional
        if refused is not None:
            return refused
        decode_pool, _ = pool(self.workers, ctx.model, ("decode",))
        if not decode_pool:
            return await self.route(ctx, request)  # colocated workers of this model, if any
        d = self.routing.choose_decode(decode_pool)
        answer, prefill_worker, decision, prefill_seconds = None, None, LOCAL, None
        # Its in-flight count rises only when the decode request is sent, after the prefill hop: until
        # then the choice counts in its load, or every request of a burst would see the same loads.
        d.reserved += 1
        try:
            if why_not_disaggregated(ctx.data, ctx.kind) is None:
                ids = await ctx.token_ids(self.prompts, d)
                block_size = (d.info or {}).get("block_size")
                if ids and block_size:
                    hashes = self.kv.block_hashes(ids, block_size, ctx.cache_salt, ctx.model, d)
                    uncached = len(ids) - self.kv.overlap(d, hashes) * block_size
                    if uncached >= self.pd_min_prefill_tokens:
                        t0 = time.monotonic()
                        answer, prefill_worker = await self.prefill(ctx, d, hashes)
                        prefill_seconds = time.monotonic() - t0
                        decision = DISAGGREGATED if answer is not None and answer.get("ok") else FALLBACK
                    self.kv.add_pending(d, hashes)
        finally:
            d.reserved -= 1
        self.metrics.pd_decisions.labels(ctx.model, decision).inc()
        self.metrics.activity.pd_decided(ctx.model, decision, d.url, prefill_worker.url if prefill_worker else None,
                                         prefill_seconds)  # fmt: skip
        extra = {PREFILL_HEADER: prefill_worker.url} if prefill_worker is not None else {}

        async def choose(candidates: list[Worker]) -> Worker:
            return self.routing.choose_decode(candidates)

        attempt = self._forward(ctx, request, decode_body(ctx.data, answer), extra)
        tries = await self._try(ctx, lambda: pool(self.workers, ctx.model, ("decode",))[0], choose, attempt, first=d)
        return tries.done.value if tries.done is not None else self._no_worker(ctx, tries)

    async def prefill(self, ctx: RequestContext, decode: Worker,
                      hashes: list[bytes]) -> tuple[dict | None, Worker | None]:  # fmt: skip
        """(the prefill worker's kv_transfer_params, that worker), retrying on other prefill workers
        of the pool; (None, None) when none could."""
        body = prefill_body(ctx.data, receiver_of(decode))

        def candidates() -> list[Worker]:
            prefill_pool, _ = pool(self.workers, ctx.model, ("prefill",))
            if ctx.prefill_pool is not None:
                prefill_pool = [w for w in prefill_pool if w.prefill_pool == ctx.prefill_pool]
            return prefill_pool

        async def choose(candidates: list[Worker]) -> Worker:
            return self.routing.choose_prefill(candidates, hashes)

        async def attempt(worker: Worker) -> Done | Retry | GiveUp:
            t0 = time.monotonic()
            worker.in_flight += 1
            ctx.delivered = True
            try:
                r = await self.client.post(worker.url + ctx.path, content=body,
                                           headers=worker_headers(ctx.request_id))  # fmt: skip
            except (httpx.TransportError, OSError) as e:
                if not isinstance(e, httpx.ReadTimeout):  # a long prefill is slow, not broken
                    worker.record_failure(f"{type(e).__name__}: {e}", self.breaker)
                logger.warning("prefill worker %s failed: %s", worker.url, e)
                return Retry()
            finally:
                worker.in_flight -= 1
            if r.status_code != 200:
                if r.status_code in (502, 503):  # not 504: the request's own deadline, slow, not dead
                    worker.record_failure(f"HTTP {r.status_code}", self.breaker)
                logger.warning("prefill worker %s answered %d: %s", worker.url, r.status_code, r.text[:300])
                if r.status_code < 500 and r.status_code != 429:
                    return GiveUp()  # the request's own fault: the decode worker will say what it is
                return Retry()  # broken or busy (429: its queue is full): another prefill worker
            worker.consecutive_failures = 0
            try:
                answer = r.json()["kv_transfer_params"]
                answer["first_token_ids"], answer["prompt_digest"]  # noqa: B018 -- both must be there
            except (ValueError, KeyError, TypeError):
                logger.warning("prefill worker %s sent no kv_transfer_params", worker.url)
                return Retry()
            if not answer.get("ok"):
                logger.warning("KV transfer %s -> %s failed: %s", worker.url, decode.url, answer.get("error"))
            self.metrics.prefill_seconds.observe(time.monotonic() - t0)
            self.kv.add_pending(worker, hashes)
            return Done((answer, worker))

        tries = await self._try(ctx, candidates, choose, attempt)
        return tries.done.value if tries.done is not None else (None, None)

    async def _try(self, ctx: RequestContext, candidates, choose, attempt, first: Worker | None = None) -> Tries:
        """try_workers with this gateway's max_retries, counting retries per model."""

        def on_retry() -> None:
            self.metrics.retries.labels(ctx.model).inc()

        return await try_workers(candidates, choose, attempt, max_retries=self.max_retries, on_retry=on_retry,
                                 first=first)  # fmt: skip

    def _forward(self, ctx: RequestContext, request: Request, body: bytes, extra_headers: dict[str, str] | None = None):
        """The attempt that sends `body` to a worker and, once it answers, passes its response through."""
        accept = request.headers.get("accept")

        async def attempt(worker: Worker) -> Done | Retry:
            ctx.delivered = True
            upstream, error = await send(self.client, worker, ctx.path, body, accept, self.breaker, ctx.request_id)
            if upstream is None:
                return Retry(error) if error is None or error.retry else GiveUp(error)
            ctx.handed_off = True
            return Done(pass_through(ctx, worker, upstream, self.settlement, extra_headers))

        return attempt

    def _no_worker(self, ctx: RequestContext, tries: Tries) -> Response:
        self.metrics.failed.labels(self._model_label(ctx.model)).inc()
        self.settlement.release(ctx)  # nothing ran: nothing charged
        if tries.last_error is not None:  # every attempt got a 5xx: the last one says why
            e = tries.last_error
            return Response(e.body, status_code=e.status, headers={**e.headers, WORKER_HEADER: e.worker.url})
        message = f"no worker for model `{ctx.model}` could take the request" if tries.tried else (
            f"no healthy worker for model `{ctx.model}`")  # fmt: skip
        return error_response(503, message, "service_unavailable", headers={"Retry-After": "1"})
