"""`ferry gateway`: one OpenAI-compatible endpoint over many `ferry serve` replicas.

This file wires the pieces together and holds the HTTP routes; a request's
way through `handle` is, in order:

- admission.py: API key, body, model, result cache, token rate limit; it
  answers errors and cache hits itself, else gives a RequestContext;
- proxy.py: the request to a worker of the model's pool, chosen by
  routing.py (policies.py's Router fed with the prompt's cached overlap),
  retried on another worker while one fails before its first byte, in two
  hops when prefill and decode are disaggregated (disagg.py);
- passthrough.py: the worker's response, streamed or not, passed through
  byte for byte with an `x-ferry-worker` header;
- settlement.py: once it ends, its usage settles the rate-limit charge,
  feeds the GenAI metrics (metrics.py) and the result cache.

Beside the requests, replicas.py keeps each worker's health and load current
and kv_index.py mirrors each worker's prefix cache from its KV events; with
`--hold-timeout`, a request that finds no ready worker waits for one in
waiting_room.py (scale from zero).
`/dashboard` (web/) is a live page over `/gateway/state`: the workers, the
recent routing and PD decisions and latency over time (activity.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from prometheus_client import Gauge
from starlette.requests import ClientDisconnect

from ferry.entrypoints.draining_server import wait_drained
from ferry.entrypoints.openai.http_middleware import add_http_middleware
from ferry.entrypoints.openai.protocol import wait_for_disconnect
from ferry.gateway.admission import Admission, RequestContext, unauthorized
from ferry.gateway.auth import ApiKeys
from ferry.gateway.disagg import parse_prefill_spec
from ferry.gateway.kv_index import KVMirrors
from ferry.gateway.metrics import GatewayMetrics
from ferry.gateway.policies import PolicyConfig, Router
from ferry.gateway.prefix_index import PrefixIndex
from ferry.gateway.prompts import PromptTokenizer
from ferry.gateway.proxy import Proxy
from ferry.gateway.rate_limit import TokenRateLimiter
from ferry.gateway.replicas import MonitorConfig, Worker, WorkerMonitor
from ferry.gateway.responses import WORKER_HEADER, error_response
from ferry.gateway.result_cache import ResultCache
from ferry.gateway.routing import Routing
from ferry.gateway.settlement import Settlement
from ferry.gateway.waiting_room import WaitingRoom
from ferry.utils.bearer import key_digest, match_digest
from ferry.utils.web_pages import WebPages

logger = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per scrape otherwise


def internal_error(exc: Exception) -> Response:
    """A bug answers an OpenAI-style 500, as ferry serve's does, not Starlette's plain text; the
    exception stays in the log under the id the client is told (its text may name a worker or
    another request's data)."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s", error_id, exc_info=exc)
    return error_response(500, f"internal server error (id {error_id} in the gateway log)", "internal_server_error")


@dataclass
class GatewayConfig:
    workers: list[str]
    policy: str = "kv-aware"
    tokenizer: str | None = None  # default: what each worker's /ferry/info names
    trust_remote_code: bool = False  # load a tokenizer that is its own code (as the workers do, vLLM's flag)
    max_retries: int = 2
    request_timeout: float = 600.0
    prefix_index_blocks: int = 200_000
    api_keys_file: str | None = None
    result_cache: bool = False
    result_cache_entries: int = 1024
    result_cache_bytes: int = 64 << 20
    result_cache_ttl: float = 600.0
    # Prefill/decode disaggregation (gateway/disagg.py): `[POOL=]URL` prefill workers, decode workers.
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    pd_min_prefill_tokens: int = 256
    admin_key: str | None = None  # may read /metrics and /gateway/* (as may a key file's admin keys)
    share_prefix_cache: bool = False  # else each API key's requests carry its own cache_salt
    worker_header: bool = True  # name the serving worker in `x-ferry-worker`
    drain_timeout: float = 30.0  # seconds the requests in flight get after SIGTERM
    dashboard: bool = True  # serve the live dashboard at /dashboard (its data needs the admin key)
    # Scale from zero (waiting_room.py): seconds a request waits for a worker of its model to become
    # ready (0: none waits, no worker is a 503), and how many may wait at once.
    hold_timeout: float = 0.0
    max_held_requests: int = 256
    # The deployment's secret (utils/deployment_secret.py): authenticates the workers' KV events and
    # salts the gateway's block hashes as the workers salt theirs.
    kv_secret: bytes | None = field(default=None, repr=False)
    # vLLM's serve flags, here too (entrypoints/openai/http_middleware.py): CORSMiddleware's options
    # (None: no browser access) and X-Request-Id on every answer.
    cors: dict | None = None
    request_id_headers: bool = False
    # How https:// workers' certificates are checked (httpx's `verify`: True, the default trust store;
    # or an SSLContext with the CAs and client certificate of --worker-ssl-*, entrypoints/tls.py).
    worker_verify: ssl.SSLContext | bool = True


class Gateway:
    def __init__(self, config: GatewayConfig, monitor: MonitorConfig | None = None,
                 policy: PolicyConfig | None = None) -> None:  # fmt: skip
        if not config.workers and not config.decode:
            raise ValueError("give at least one --worker URL (or --prefill and --decode URLs)")
        if bool(config.prefill) != bool(config.decode):
            raise ValueError("disaggregated serving needs both --prefill and --decode workers")
        if config.pd_min_prefill_tokens < 0:
            raise ValueError("--pd-min-prefill-tokens must be >= 0")
        if config.hold_timeout < 0 or config.max_held_requests < 1:
            raise ValueError("--hold-timeout must be >= 0 and --max-held-requests >= 1")
        self.config = config
        self.monitor_config = monitor or MonitorConfig()
        self.router = Router(config.policy, policy)
        by_url: dict[str, Worker] = {}
        for u in config.workers:
            by_url.setdefault(u.rstrip("/"), Worker(u.rstrip("/")))
        for spec in config.prefill:
            pool_name, u = parse_prefill_spec(spec)
            by_url.setdefault(u.rstrip("/"), Worker(u.rstrip("/"), "prefill", pool_name))
        for u in config.decode:
            by_url.setdefault(u.rstrip("/"), Worker(u.rstrip("/"), "decode"))
        self.workers = list(by_url.values())
        self.disaggregated = bool(config.decode)
        self.metrics = GatewayMetrics()
        self.prefix_index = PrefixIndex(config.prefix_index_blocks)
        self.api_keys = ApiKeys.from_file(config.api_keys_file) if config.api_keys_file else None
        self.rate_limiter = TokenRateLimiter()
        self.result_cache = (
            ResultCache(config.result_cache_entries, config.result_cache_bytes, config.result_cache_ttl)
            if config.result_cache
            else None
        )
        self.prompts = PromptTokenizer(config.tokenizer, config.trust_remote_code)
        self.waiting_room = WaitingRoom(config.hold_timeout, config.max_held_requests, self.metrics.held,
                                        self.metrics.held_outcomes)  # fmt: skip
        self.kv = KVMirrors(self.workers, self.monitor_config.scrape_interval, config.policy == "kv-aware",
                            self.prefix_index.forget_worker, config.kv_secret)  # fmt: skip
        self.admission = Admission(self.workers, self.prompts, self.metrics, self.api_keys, self.result_cache,
                                   self.rate_limiter, config.share_prefix_cache,
                                   self.waiting_room.enabled)  # fmt: skip
        self._admin_digest = key_digest(config.admin_key) if config.admin_key else None
        self.settlement = Settlement(self.rate_limiter, self.metrics, self.result_cache)
        routing = Routing(self.router, self.prefix_index, self.kv, self.prompts, self.metrics)
        self.proxy = Proxy(self.workers, routing, self.kv, self.prompts, self.settlement, self.metrics,
                           self.monitor_config, config.max_retries, config.pd_min_prefill_tokens,
                           self.waiting_room)  # fmt: skip
        self.client: httpx.AsyncClient | None = None
        self.monitors: list[WorkerMonitor] = []
        self.draining = False
        self.also_run: list[Callable[[], Coroutine]] = []  # tasks to run while the gateway runs (`ferry up`'s)
        self._also_tasks: list[asyncio.Task] = []
        self.server: uvicorn.Server | None = None  # set by whoever runs the app; the drain stops it
        self._drain_task: asyncio.Task | None = None
        self._outermost: _Outermost | None = None
        self.app = self._build_app()

    # -- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.request_timeout, connect=5.0), limits=limits,
                                        verify=self.config.worker_verify)  # fmt: skip
        self.proxy.client = self.client
        self.monitors = [WorkerMonitor(w, self.client, self.monitor_config, self.waiting_room.worker_checked)
                         for w in self.workers]  # fmt: skip
        for m in self.monitors:
            m.start()
        await asyncio.wait([asyncio.create_task(m.first_check.wait()) for m in self.monitors], timeout=10)
        self.kv.start()
        self._also_tasks = [asyncio.create_task(run()) for run in self.also_run]
        logger.info("gateway over %d workers, policy %s", len(self.workers), self.config.policy)

    def start_drain(self) -> None:
        """SIGTERM: readiness turns 503 and new requests get 503 while the ones in flight (streams
        included) get up to `drain_timeout` seconds; then the server stops."""
        if self.draining:
            return
        self.draining = True
        logger.info("draining: %d requests in flight, up to %.0fs", self._outermost.count, self.config.drain_timeout)
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        left = await wait_drained(lambda: self._outermost.count, self.config.drain_timeout)
        if left:
            logger.warning("drain timeout: stopping with %d requests in flight", left)
        if self.server is not None:
            self.server.should_exit = True

    async def stop(self) -> None:
        for t in self._also_tasks:
            t.cancel()
        await asyncio.gather(*self._also_tasks, return_exceptions=True)
        await self.kv.stop()
        for m in self.monitors:
            await m.stop()
        if self.client is not None:
            await self.client.aclose()

    # -- requests ---------------------------------------------------------

    async def handle(self, request: Request, kind: str) -> Response:
        if self.draining:
            return error_response(503, "the gateway is shutting down", "service_unavailable",
                                  headers={"Retry-After": "1"})  # fmt: skip
        try:
            ctx = await self.admission.admit(request, kind)
        except ClientDisconnect:  # gone before its body was read
            self.metrics.client_gone.labels("before_response").inc()
            return Response(status_code=499)
        if not isinstance(ctx, RequestContext):
            return ctx  # refused, or answered from the result cache
        # Until a worker's response starts (for a non-streamed request: until the worker has
        # finished it) nothing is sent to the client, so nothing would notice it leave: watch for
        # that, and cancel the routing, which closes the connections to the workers (the prefill
        # hop's too) and so aborts what they started. From the response on, Starlette watches.
        route = self.proxy.route_pd(ctx, request) if self.disaggregated else self.proxy.route(ctx, request)
        routing = asyncio.ensure_future(route)
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        left = False
        try:
            await asyncio.wait({routing, gone}, return_when=asyncio.FIRST_COMPLETED)
            if routing.done():  # answered (even if the client left meanwhile: the response's close settles it)
                return routing.result()
            left = True
            self.metrics.client_gone.labels("before_response").inc()
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"
        finally:
            gone.cancel()  # a receiver must not outlive this: the response listens for the disconnect
            if not routing.done():
                routing.cancel()
                await asyncio.gather(routing, return_exceptions=True)
            if not ctx.handed_off:  # no passed-through response settles the charge: it is settled here
                if left:
                    self.settlement.abandoned(ctx)  # the prompt stays charged if a worker was sent it
                else:
                    self.settlement.release(ctx)  # nothing ran: nothing charged

    def is_admin(self, authorization: str | None) -> bool:
        """Whether a request may read the gateway's own state (/metrics, /gateway/workers, /gateway/state): anyone
        when no key is configured at all; else `--admin-key` or a key file's admin key."""
        if self.api_keys is None and self._admin_digest is None:
            return True
        if self.api_keys is not None:
            key = self.api_keys.authenticate(authorization)
            if key is not None and key.admin:
                return True
        return self._admin_digest is not None and match_digest(authorization, [self._admin_digest]) is not None

    def _worker_state(self, w: Worker) -> dict:
        now = time.monotonic()
        return {"url": w.url, "role": w.role, "prefill_pool": w.prefill_pool, "healthy": w.healthy,
                "reachable": w.reachable, "circuit_open_s": max(0.0, w.open_until - now),
                "models": sorted(w.models), "in_flight": w.in_flight, "reserved": w.reserved, "waiting": w.waiting,
                "running": w.running, "kv_usage": w.kv_usage, "prefix_queries": w.prefix_queries,
                "prefix_hits": w.prefix_hits, "last_error": w.last_error, "kv_blocks_known": self.kv.blocks_known(w),
                "kv_mirrored": self.kv.mirrored(w)}  # fmt: skip

    # -- app --------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI):
            await self.start()
            try:
                yield
            finally:
                await self.stop()

        app = FastAPI(title="ferry gateway", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

        @app.exception_handler(Exception)  # (what InternalErrorAnswer, inside the middleware, did not see)
        async def _internal_error(request: Request, exc: Exception) -> Response:
            return internal_error(exc)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.handle(request, "completions")

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self.handle(request, "chat")

        @app.post("/v1/embeddings")
        async def embeddings(request: Request) -> Response:
            return await self.handle(request, "embeddings")

        @app.post("/v1/responses")
        async def responses(request: Request) -> Response:
            return await self.handle(request, "responses")

        async def score(request: Request) -> Response:
            return await self.handle(request, "score")

        async def rerank(request: Request) -> Response:
            return await self.handle(request, "rerank")

        for path in ("/score", "/v1/score"):  # as ferry serve (and vLLM) serve them
            app.add_api_route(path, score, methods=["POST"])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.add_api_route(path, rerank, methods=["POST"])

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            if self.api_keys is not None and self.api_keys.authenticate(request.headers.get("authorization")) is None:
                return unauthorized()
            names = sorted({m for w in self.workers if w.healthy for m in w.models})
            data = [{"id": n, "object": "model", "created": 0, "owned_by": "ferry"} for n in names]
            return JSONResponse({"object": "list", "data": data})

        @app.get("/v1/models/{model:path}")
        async def one_model(request: Request, model: str) -> Response:
            if self.api_keys is not None and self.api_keys.authenticate(request.headers.get("authorization")) is None:
                return unauthorized()
            if not any(w.healthy and model in w.models for w in self.workers):
                return error_response(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
            return JSONResponse({"id": model, "object": "model", "created": 0, "owned_by": "ferry"})

        @app.get("/health")
        async def health() -> Response:
            return JSONResponse({"status": "ok"})

        @app.get("/ready")
        async def ready() -> Response:
            if self.draining:
                return JSONResponse({"status": "draining"}, status_code=503)
            healthy = [w.url for w in self.workers if w.healthy]
            if self.waiting_room.enabled:  # no worker yet is no reason to turn clients away: they wait
                return JSONResponse({"status": "ready", "workers": healthy, "held": self.waiting_room.held})
            return JSONResponse({"status": "ready" if healthy else "no healthy worker", "workers": healthy},
                                status_code=200 if healthy else 503)  # fmt: skip

        @app.get("/gateway/workers")
        async def workers(request: Request) -> Response:
            if not self.is_admin(request.headers.get("authorization")):
                return unauthorized()
            return JSONResponse([self._worker_state(w) for w in self.workers])

        @app.get("/gateway/state")
        async def state(request: Request) -> Response:
            """What the dashboard draws: the workers, the gateway's own load, recent decisions, and
            latency and throughput per time slot (activity.py)."""
            if not self.is_admin(request.headers.get("authorization")):
                return unauthorized()
            activity = self.metrics.activity
            return JSONResponse({
                "time": time.time(), "policy": self.config.policy, "disaggregated": self.disaggregated,
                "draining": self.draining, "in_progress": self._outermost.count, "held": self.waiting_room.held,
                "hold_timeout": self.waiting_room.timeout,
                "workers": [self._worker_state(w) for w in self.workers],
                "routing": list(reversed(activity.routing)), "pd": list(reversed(activity.pd)),
                "slot_seconds": activity.slot_seconds, "series": activity.series(),
            })  # fmt: skip

        if self.config.dashboard:
            WebPages("ferry.gateway", "web").add_routes(app, "/dashboard", "dashboard.html", "/dashboard")

            @app.get("/", include_in_schema=False)
            async def root() -> Response:
                # Relative, as the pages' own URLs: behind a proxy that serves the gateway under a path
                # prefix (an ingress rewrite), the browser stays under it.
                return RedirectResponse("dashboard")

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            if not self.is_admin(request.headers.get("authorization")):
                return unauthorized()
            return Response(self.metrics.render(self.workers), media_type="text/plain; version=0.0.4")

        add_http_middleware(app, self.config.cors, self.config.request_id_headers, internal_error)
        drop = None if self.config.worker_header else WORKER_HEADER.lower().encode()
        self._outermost = _Outermost(app, self.metrics.in_progress, drop)
        return self._outermost


class _Outermost:
    """ASGI wrapper around the routes: counts the API requests in progress, from their first byte
    to their response's last (a streamed response outlives its route), for the drain and
    /metrics; drops one response header on every path (cache hits, errors, pass-through) if asked."""

    def __init__(self, app: FastAPI, in_progress: Gauge, drop_header: bytes | None) -> None:
        self.app, self.in_progress, self.drop_header = app, in_progress, drop_header
        self.count = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drop_header is not None:
            send = self._filtered(send)
        if not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        self.count += 1
        self.in_progress.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1
            self.in_progress.dec()

    def _filtered(self, send):
        async def filtered(message) -> None:
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [(k, v) for k, v in message["headers"] if k.lower() != self.drop_header],
                }
            await send(message)

        return filtered
