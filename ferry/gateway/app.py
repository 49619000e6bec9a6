"""`ferry gateway`: one OpenAI-compatible endpoint over many `ferry serve` replicas.

A request's way through: parse the body (400 if it is not JSON), find the pool
of healthy workers that serve its `model` (404 if no worker ever advertised
it, 503 if none is healthy now), compute the prompt's block hashes when the
policy needs them (the model's tokenizer and chat template, as the replica
will), let the Router pick a worker, and forward the body untouched. The
worker's response, streamed or not, is passed through byte for byte with an
`x-ferry-worker` header. A worker that refuses the connection or answers 5xx
before the first byte counts as a failure for its circuit breaker and the
request is retried on another worker of the pool.

Around that, in this order: the API key (`--api-keys`, auth.py; 401), the
result cache (`--result-cache`, result_cache.py; a hit is answered here),
the key's token rate limits (rate_limit.py; 429 with Retry-After), and after
the response its usage, which reconciles the rate-limit charge and feeds the
OpenTelemetry GenAI metrics (response_usage.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ferry.core.block_hash import hash_prompt_blocks
from ferry.core.kv_events import HASH_ALGORITHM
from ferry.gateway.auth import ApiKeys
from ferry.gateway.disagg import (
    DISAGGREGATED,
    FALLBACK,
    LOCAL,
    choose_decode,
    decode_body,
    parse_prefill_spec,
    prefill_body,
    receiver_of,
    why_not_disaggregated,
)
from ferry.gateway.kv_index import KVEventSubscriber
from ferry.gateway.metrics import GatewayMetrics
from ferry.gateway.policies import PolicyConfig, Router
from ferry.gateway.prefix_index import PrefixIndex
from ferry.gateway.rate_limit import Charge, TokenRateLimiter
from ferry.gateway.replicas import MonitorConfig, Worker, WorkerMonitor
from ferry.gateway.response_usage import first_text_chunk, has_error_event, response_usage
from ferry.gateway.result_cache import ResultCache, cache_key, is_deterministic

logger = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per scrape otherwise

MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_KEPT_BYTES = 8 * 1024 * 1024  # of a response, for usage and the result cache
WORKER_HEADER = "x-ferry-worker"
PREFILL_HEADER = "x-ferry-prefill-worker"  # disaggregated: the worker that prefilled
CACHE_HEADER = "x-ferry-cache"  # response: hit | miss; request: skip
# Hop-by-hop and length headers are the gateway's own business, not the worker's.
_DROP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None, code: str | int | None = None) -> JSONResponse:  # fmt: skip
    body = {"error": {"message": message, "type": type_, "param": param, "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass
class RequestContext:
    kind: str  # "completions" | "chat"
    path: str
    raw: bytes
    data: dict
    model: str
    key_name: str
    streamed: bool
    started: float = field(default_factory=time.monotonic)
    prefill_pool: str | None = None  # the API key's prefill pool (disaggregated serving)
    cache_key: str | None = None
    charge: Charge | None = None
    handed_off: bool = False  # a worker's response is being passed through (it settles the charge)
    _ids: list[int] | None = None
    _ids_done: bool = False

    async def token_ids(self, gateway: "Gateway", worker: Worker) -> list[int] | None:
        """The prompt's token ids as the replica will see them, computed once per request."""
        if not self._ids_done:
            self._ids = await asyncio.to_thread(gateway.prompt_token_ids, self.kind, self.data, worker)
            self._ids_done = True
        return self._ids


def _num_prompts(data: dict) -> int:
    """Prompts in a /v1/completions body (a list of strings or of token-id lists); 1 otherwise."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def _completion_estimate(data: dict, pool: list[Worker]) -> int:
    """max_tokens x n x prompts; without max_tokens, the room a replica's context leaves (or 1,024)."""
    n = data.get("n") if type(data.get("n")) is int and data.get("n") > 0 else 1
    n *= _num_prompts(data)
    for field_name in ("max_completion_tokens", "max_tokens"):
        value = data.get(field_name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value * n
    max_len = next((w.info.get("max_model_len") for w in pool if w.info and w.info.get("max_model_len")), None)
    return (max_len or 1024) * n


@dataclass
class GatewayConfig:
    workers: list[str]
    policy: str = "kv-aware"
    tokenizer: str | None = None  # default: what each worker's /ferry/info names
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


class _PassThroughResponse(StreamingResponse):
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


class Gateway:
    def __init__(self, config: GatewayConfig, monitor: MonitorConfig | None = None,
                 policy: PolicyConfig | None = None) -> None:  # fmt: skip
        if not config.workers and not config.decode:
            raise ValueError("give at least one --worker URL (or --prefill and --decode URLs)")
        if bool(config.prefill) != bool(config.decode):
            raise ValueError("disaggregated serving needs both --prefill and --decode workers")
        if config.pd_min_prefill_tokens < 0:
            raise ValueError("--pd-min-prefill-tokens must be >= 0")
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
        self._pd_turn = itertools.count()
        self.metrics = GatewayMetrics()
        self.prefix_index = PrefixIndex(config.prefix_index_blocks)
        self.api_keys = ApiKeys.from_file(config.api_keys_file) if config.api_keys_file else None
        self.rate_limiter = TokenRateLimiter()
        self.result_cache = (
            ResultCache(config.result_cache_entries, config.result_cache_bytes, config.result_cache_ttl)
            if config.result_cache
            else None
        )
        self.client: httpx.AsyncClient | None = None
        self.monitors: list[WorkerMonitor] = []
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._tokenizers: dict[str, object] = {}
        self._zmq: zmq.asyncio.Context | None = None
        self._sync_task: asyncio.Task | None = None
        self.app = self._build_app()

    # -- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.request_timeout, connect=5.0), limits=limits)
        self._zmq = zmq.asyncio.Context()
        self.monitors = [WorkerMonitor(w, self.client, self.monitor_config) for w in self.workers]
        for m in self.monitors:
            m.start()
        await asyncio.wait([asyncio.create_task(m.first_check.wait()) for m in self.monitors], timeout=10)
        self._sync_task = asyncio.create_task(self._sync_subscribers(), name="kv subscribers")
        logger.info("gateway over %d workers, policy %s", len(self.workers), self.config.policy)

    async def stop(self) -> None:
        if self._sync_task is not None:
            self._sync_task.cancel()
        for m in self.monitors:
            await m.stop()
        for s in self.subscribers.values():
            await s.stop()
        if self.client is not None:
            await self.client.aclose()
        if self._zmq is not None:
            self._zmq.term()

    async def _sync_subscribers(self) -> None:
        """Keep one live KV-event subscriber per reachable worker that publishes events (kv-aware);
        forget a worker's cache state when it goes away (it may come back empty)."""
        warned: set[str] = set()
        while True:
            for w in self.workers:
                try:
                    await self._sync_subscriber(w, warned)
                except Exception:  # one worker's odd /ferry/info must not stop the others' sync
                    logger.exception("KV-event subscriber for %s", w.url)
            await asyncio.sleep(self.monitor_config.scrape_interval)

    async def _sync_subscriber(self, w: Worker, warned: set[str]) -> None:
        sub = self.subscribers.get(w.url)
        if sub is not None and (not w.reachable or sub.task is None or sub.task.done()):
            await sub.stop()  # gone, or failed: a new one starts from a fresh snapshot
            del self.subscribers[w.url]
            sub = None
        if not w.reachable:
            self.prefix_index.forget_worker(w.url)
            w.info = None  # refetched on recovery: a restarted worker has new ports
            return
        if sub is None and self.config.policy == "kv-aware" and w.info and w.info.get("kv_events"):
            if w.info.get("block_hash") != HASH_ALGORITHM:
                if w.url not in warned:
                    warned.add(w.url)
                    logger.warning("worker %s hashes blocks with %s, not %s: routed by load", w.url,
                                   w.info.get("block_hash"), HASH_ALGORITHM)  # fmt: skip
                return
            ev = w.info["kv_events"]
            host = ev["host"]
            if host in ("0.0.0.0", "*", "::", ""):
                host = urlparse(w.url).hostname or "127.0.0.1"
            if ":" in host and not host.startswith("["):
                host = f"[{host}]"  # IPv6 in a tcp:// endpoint
            sub = KVEventSubscriber(self._zmq, host, int(ev["port"]), int(ev["replay_port"]), w.url)
            sub.start()
            self.subscribers[w.url] = sub

    # -- routing ----------------------------------------------------------

    def pool(self, model: str, roles: tuple[str, ...] = ("both",)) -> tuple[list[Worker], bool]:
        """(healthy workers of these roles serving `model`, whether any worker ever advertised it)."""
        known = [w for w in self.workers if model in w.models]
        return [w for w in known if w.healthy and w.role in roles], bool(known)

    def _tokenizer(self, worker: Worker):
        source = self.config.tokenizer or (worker.info or {}).get("tokenizer")
        if not source:
            return None
        if source not in self._tokenizers:
            from ferry.tokenizer import load_tokenizer

            self._tokenizers[source] = load_tokenizer(source)
        return self._tokenizers[source]

    def prompt_token_ids(self, kind: str, data: dict, worker: Worker) -> list[int] | None:
        """The token ids the replica will see for this body (its first prompt), or None when
        they cannot be known here (the replica then reports whatever is wrong)."""
        try:
            if kind == "completions":
                prompt = data.get("prompt")
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                    prompt = prompt[0]  # several prompts go to one worker; route by the first
                if isinstance(prompt, list):
                    ok = all(type(t) is int and 0 <= t < 2**32 for t in prompt)
                    return prompt if ok else None  # out-of-range ids: the replica's 400 says why
                tok = self._tokenizer(worker)
                return tok.encode(prompt) if isinstance(prompt, str) and tok is not None else None
            from ferry.entrypoints.openai.protocol import ChatCompletionRequest
            from ferry.entrypoints.openai.serving_chat import render_chat_prompt

            tok = self._tokenizer(worker)
            if tok is None:
                return None
            return render_chat_prompt(tok, ChatCompletionRequest.model_validate(data))["prompt_token_ids"]
        except Exception:  # a body the replica will reject: route it by load, let the replica say why
            return None

    async def decide(self, ctx: RequestContext, pool: list[Worker]):
        hashes: list[bytes] = []
        overlaps = None
        if self.router.needs_block_hashes:
            block_size = next((w.info["block_size"] for w in pool if w.info and w.info.get("block_size")), None)
            ids = await ctx.token_ids(self, pool[0]) if block_size else None
            if ids:
                hashes = hash_prompt_blocks(ids, block_size)
                if self.router.policy == "kv-aware":
                    overlaps = [self._kv_overlap(w, hashes) for w in pool]
                else:
                    overlaps = [self.prefix_index.overlap(hashes, w.url) for w in pool]
        decision = self.router.choose(pool, len(hashes), overlaps)
        if self.router.policy == "prefix" and hashes:
            self.prefix_index.insert(hashes, decision.worker.url)
        elif hashes and decision.worker.url in self.subscribers:
            self.subscribers[decision.worker.url].index.add_pending(hashes)
        self.metrics.decisions.labels(ctx.model, decision.worker.url, decision.reason).inc()
        if decision.overlap >= 0:
            self.metrics.overlap.observe(decision.overlap)
        return decision

    def _kv_overlap(self, worker: Worker, hashes: list[bytes]) -> int:
        sub = self.subscribers.get(worker.url)
        if sub is None or not sub.index.synced or sub.task is None or sub.task.done():
            return 0  # no live mirror of this worker's cache: route it by load
        return sub.index.overlap(hashes)

    async def handle(self, request: Request, kind: str) -> Response:
        key_name = "none"
        limits = None
        key_pool = None
        if self.api_keys is not None:
            key = self.api_keys.authenticate(request.headers.get("authorization"))
            if key is None:
                return error_response(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                                      param=None, code="invalid_api_key")  # fmt: skip
            key_name, limits, key_pool = key.name, key.limits, key.prefill_pool
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return error_response(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        buf = bytearray()
        async for piece in request.stream():
            buf += piece
            if len(buf) > MAX_BODY_BYTES:
                return error_response(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        raw = bytes(buf)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:
            return error_response(400, f"malformed JSON body: {e}")
        if not isinstance(data, dict):
            return error_response(400, "the request body must be a JSON object")
        model = data.get("model")
        if not isinstance(model, str):
            return error_response(400, "`model` is required (see GET /v1/models)", param="model")
        pool, known = self.pool(model, ("both", "prefill", "decode"))
        if not known:
            return error_response(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
        ctx = RequestContext(kind, path, raw, data, model, key_name, bool(data.get("stream")), prefill_pool=key_pool)

        cache = self.result_cache
        if cache is not None and request.headers.get(CACHE_HEADER, "").lower() != "skip" and is_deterministic(data):
            ctx.cache_key = cache_key(path, data)
            hit = cache.get(ctx.cache_key)
            if hit is not None:
                self.metrics.cache.labels("hit").inc()
                headers = {**hit.headers, CACHE_HEADER: "hit", WORKER_HEADER: hit.worker}
                return Response(hit.body, status_code=hit.status, headers=headers)
            self.metrics.cache.labels("miss").inc()

        if limits is not None and any(v is not None for v in vars(limits).values()):
            prompt_estimate = await self._prompt_estimate(ctx, pool)
            completion_estimate = _completion_estimate(data, pool)
            charge, wait, why = self.rate_limiter.admit(key_name, limits, prompt_estimate, completion_estimate)
            if charge is None:
                self.metrics.rate_limited.labels(key_name).inc()
                if wait is None:  # can never fit: retrying would not help, so not a 429
                    return error_response(400, f"{why}; lower max_tokens or the prompt", param="max_tokens")
                return error_response(429, f"Rate limit for this API key: {why}.", "rate_limit_exceeded",
                                      code="rate_limit_exceeded",
                                      headers={"Retry-After": str(max(1, math.ceil(wait)))})  # fmt: skip
            ctx.charge = charge
        try:
            if self.disaggregated:
                return await self._route_pd(ctx, request)
            return await self._route(ctx, request)
        except BaseException:
            if ctx.charge is not None and not ctx.handed_off:
                self.rate_limiter.reconcile(ctx.charge, 0, 0)  # nothing ran: nothing charged
            raise

    async def _route(self, ctx: RequestContext, request: Request) -> Response:
        """Pick a worker and forward; retry elsewhere while workers fail before their first byte."""
        pool, _ = self.pool(ctx.model)
        tried: set[str] = set()
        last_error: tuple[Worker, int, dict[str, str], bytes] | None = None
        while True:
            candidates = [w for w in pool if w.url not in tried]
            if not candidates or len(tried) > self.config.max_retries:
                break
            if tried:
                self.metrics.retries.labels(ctx.model).inc()
            decision = await self.decide(ctx, candidates)
            worker = decision.worker
            tried.add(worker.url)
            upstream, error = await self._send(worker, ctx.path, ctx.raw, request)
            if upstream is not None:
                ctx.handed_off = True
                return self._pass_through(ctx, worker, upstream)
            last_error = error or last_error
            pool, _ = self.pool(ctx.model)
        return self._no_worker(ctx, tried, last_error)

    def _no_worker(self, ctx: RequestContext, tried: set[str], last_error) -> Response:
        self.metrics.failed.labels(ctx.model).inc()
        if ctx.charge is not None:
            self.rate_limiter.reconcile(ctx.charge, 0, 0)  # nothing ran: nothing charged
        if last_error is not None:  # every attempt got a 5xx: the last one says why
            worker, status, headers, body = last_error
            return Response(body, status_code=status, headers={**headers, WORKER_HEADER: worker.url})
        message = f"no worker for model `{ctx.model}` could take the request" if tried else (
            f"no healthy worker for model `{ctx.model}`")  # fmt: skip
        return error_response(503, message, "service_unavailable", headers={"Retry-After": "1"})

    async def _route_pd(self, ctx: RequestContext, request: Request) -> Response:
        """Disaggregated: prefill on a prefill worker (unless not worth it), decode on a decode worker."""
        decode_pool, _ = self.pool(ctx.model, ("decode",))
        if not decode_pool:
            return await self._route(ctx, request)  # colocated workers of this model, if any
        d = choose_decode(decode_pool, next(self._pd_turn), self.router.config.kv_usage_weight)
        answer, prefill_worker, decision = None, None, LOCAL
        if why_not_disaggregated(ctx.data, ctx.kind) is None:
            ids = await ctx.token_ids(self, d)
            block_size = (d.info or {}).get("block_size")
            if ids and block_size:
                hashes = hash_prompt_blocks(ids, block_size)
                uncached = len(ids) - self._kv_overlap(d, hashes) * block_size
                if uncached >= self.config.pd_min_prefill_tokens:
                    answer, prefill_worker = await self._prefill(ctx, d, hashes)
                    decision = DISAGGREGATED if answer is not None and answer.get("ok") else FALLBACK
                if hashes and d.url in self.subscribers:
                    self.subscribers[d.url].index.add_pending(hashes)
        self.metrics.pd_decisions.labels(ctx.model, decision).inc()
        body = decode_body(ctx.data, answer)
        extra = {PREFILL_HEADER: prefill_worker.url} if prefill_worker is not None else {}
        tried: set[str] = set()
        last_error = None
        while True:  # a decode worker that fails before its first byte is replaced
            tried.add(d.url)
            upstream, error = await self._send(d, ctx.path, body, request)
            if upstream is not None:
                ctx.handed_off = True
                return self._pass_through(ctx, d, upstream, extra)
            last_error = error or last_error
            pool, _ = self.pool(ctx.model, ("decode",))
            candidates = [w for w in pool if w.url not in tried]
            if not candidates or len(tried) > self.config.max_retries:
                return self._no_worker(ctx, tried, last_error)
            self.metrics.retries.labels(ctx.model).inc()
            d = choose_decode(candidates, next(self._pd_turn), self.router.config.kv_usage_weight)

    async def _prefill(self, ctx: RequestContext, decode: Worker, hashes: list[bytes]):
        """(the prefill worker's kv_transfer_params, that worker), retrying on other prefill workers
        of the pool; (None, None) when none could."""
        body = prefill_body(ctx.data, receiver_of(decode))
        tried: set[str] = set()
        while len(tried) <= self.config.max_retries:
            pool, _ = self.pool(ctx.model, ("prefill",))
            if ctx.prefill_pool is not None:
                pool = [w for w in pool if w.prefill_pool == ctx.prefill_pool]
            candidates = [w for w in pool if w.url not in tried]
            if not candidates:
                break
            if tried:
                self.metrics.retries.labels(ctx.model).inc()
            overlaps = [self._kv_overlap(w, hashes) for w in candidates]
            worker = self.router.choose(candidates, len(hashes), overlaps).worker
            tried.add(worker.url)
            t0 = time.monotonic()
            worker.in_flight += 1
            try:
                r = await self.client.post(worker.url + ctx.path, content=body,
                                           headers={"content-type": "application/json"})  # fmt: skip
            except (httpx.TransportError, OSError) as e:
                if not isinstance(e, httpx.ReadTimeout):  # a long prefill is slow, not broken
                    worker.record_failure(f"{type(e).__name__}: {e}", self.monitor_config)
                logger.warning("prefill worker %s failed: %s", worker.url, e)
                continue
            finally:
                worker.in_flight -= 1
            if r.status_code != 200:
                if r.status_code in (502, 503, 504):
                    worker.record_failure(f"HTTP {r.status_code}", self.monitor_config)
                logger.warning("prefill worker %s answered %d: %s", worker.url, r.status_code, r.text[:300])
                if r.status_code < 500 and r.status_code != 429:
                    return None, None  # the request's own fault: the decode worker will say what it is
                continue  # broken or busy (429: its queue is full): another prefill worker
            worker.consecutive_failures = 0
            try:
                answer = r.json()["kv_transfer_params"]
                answer["first_token_ids"], answer["prompt_digest"]  # noqa: B018 -- both must be there
            except (ValueError, KeyError, TypeError):
                logger.warning("prefill worker %s sent no kv_transfer_params", worker.url)
                continue
            if not answer.get("ok"):
                logger.warning("KV transfer %s -> %s failed: %s", worker.url, decode.url, answer.get("error"))
            self.metrics.prefill_seconds.observe(time.monotonic() - t0)
            if hashes and worker.url in self.subscribers:
                self.subscribers[worker.url].index.add_pending(hashes)
            return answer, worker
        return None, None

    async def _prompt_estimate(self, ctx: RequestContext, pool: list[Worker]) -> int:
        ids = await ctx.token_ids(self, pool[0]) if pool else None
        if ids is not None:
            return len(ids) * _num_prompts(ctx.data)  # the first prompt's length for each
        return max(1, len(ctx.raw) // 4)  # no tokenizer here: ~4 bytes a token

    async def _send(self, worker: Worker, path: str, raw: bytes, request: Request):
        """(the worker's response with its headers read, None) or, when it failed before any
        byte, (None, its 5xx response as (worker, status, headers, body) if it sent one)."""
        headers = {"content-type": "application/json"}
        if "accept" in request.headers:
            headers["accept"] = request.headers["accept"]
        worker.in_flight += 1
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", worker.url + path, content=raw, headers=headers), stream=True
            )
        except (httpx.TransportError, OSError) as e:
            worker.in_flight -= 1
            worker.record_failure(f"{type(e).__name__}: {e}", self.monitor_config)
            logger.warning("worker %s failed before responding: %s", worker.url, e)
            return None, None
        except BaseException:  # cancelled (client gone, shutdown): nothing is in flight here
            worker.in_flight -= 1
            raise
        if upstream.status_code >= 500:
            try:
                body = await upstream.aread()
            except httpx.TransportError:
                body = b""
            finally:
                await upstream.aclose()
                worker.in_flight -= 1
            # Only a worker that cannot serve (unreachable, overloaded, draining) counts against its
            # breaker; a 500 may be the request's own doing, and one client must not eject the pool.
            if upstream.status_code in (502, 503, 504):
                worker.record_failure(f"HTTP {upstream.status_code}", self.monitor_config)
            logger.warning("worker %s answered %d; trying another", worker.url, upstream.status_code)
            kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_HEADERS}
            return None, (worker, upstream.status_code, kept, body[:65536])
        worker.consecutive_failures = 0
        return upstream, None

    def _pass_through(self, ctx: RequestContext, worker: Worker, upstream: httpx.Response,
                      extra_headers: dict[str, str] | None = None) -> Response:  # fmt: skip
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_HEADERS}
        headers[WORKER_HEADER] = worker.url
        headers.update(extra_headers or {})
        if ctx.cache_key is not None:
            headers[CACHE_HEADER] = "miss"
        status = upstream.status_code
        state = {"kept": bytearray(), "overflow": False, "complete": False, "first": None, "closed": False}

        async def body():
            # The bookkeeping (close) runs before the client can see the end of the response, so
            # a client that repeats a request right away finds it in the result cache: a
            # non-streamed body is read whole first (the worker sends it at the end anyway), a
            # stream is settled just before its `data: [DONE]` chunk goes out.
            try:
                if not ctx.streamed:
                    data = await upstream.aread()
                    state["kept"] += data[: MAX_KEPT_BYTES + 1]
                    state["overflow"] = len(data) > MAX_KEPT_BYTES
                    state["complete"] = True
                    await close()
                    yield data
                    return
                async for chunk in upstream.aiter_raw():
                    if state["first"] is None and first_text_chunk(chunk):
                        state["first"] = time.monotonic()
                    if not state["overflow"]:
                        state["kept"] += chunk
                        state["overflow"] = len(state["kept"]) > MAX_KEPT_BYTES
                    if chunk.rstrip().endswith(b"data: [DONE]"):
                        state["complete"] = True
                        await close()  # also closes the upstream: nothing may be read after this
                        yield chunk
                        return
                    yield chunk
            except httpx.TransportError as e:  # the worker broke the stream: nothing can be retried now
                logger.warning("worker %s broke a response after %.1fs: %s", worker.url,
                               time.monotonic() - ctx.started, e)  # fmt: skip
                return
            state["complete"] = True

        async def close() -> None:
            # Runs exactly once, whether the body was sent, broke, or never started (a client that
            # left before the first byte): the in-flight count and the charge must not leak.
            if state["closed"]:
                return
            state["closed"] = True
            worker.in_flight -= 1
            await upstream.aclose()
            kept = None if state["overflow"] else bytes(state["kept"])
            self._finish(ctx, worker, status, headers, kept, state["complete"], state["first"])

        return _PassThroughResponse(body(), close, status_code=status, headers=headers)

    def _finish(self, ctx: RequestContext, worker: Worker, status: int, headers: dict[str, str],
                body: bytes | None, complete: bool, first_token_at: float | None) -> None:  # fmt: skip
        """After a passed-through response: usage, rate-limit reconciliation, metrics, cache."""
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
        if first_token_at is not None:  # streamed: a non-streamed body's first byte is its last
            m.ttft.labels(*labels).observe(first_token_at - ctx.started)
            if completion and completion > 1 and complete:
                m.tpot.labels(*labels).observe((time.monotonic() - first_token_at) / (completion - 1))
        cacheable = complete and body is not None and not (ctx.streamed and has_error_event(body))
        if cacheable and ctx.cache_key is not None and self.result_cache is not None:
            kept = {k: v for k, v in headers.items() if k.lower() == "content-type"}
            self.result_cache.put(ctx.cache_key, status, kept, body, worker.url)

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

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.handle(request, "completions")

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self.handle(request, "chat")

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            if self.api_keys is not None and self.api_keys.authenticate(request.headers.get("authorization")) is None:
                return error_response(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                                      code="invalid_api_key")  # fmt: skip
            names = sorted({m for w in self.workers if w.healthy for m in w.models})
            data = [{"id": n, "object": "model", "created": 0, "owned_by": "ferry"} for n in names]
            return JSONResponse({"object": "list", "data": data})

        @app.get("/health")
        async def health() -> Response:
            return JSONResponse({"status": "ok"})

        @app.get("/ready")
        async def ready() -> Response:
            healthy = [w.url for w in self.workers if w.healthy]
            return JSONResponse({"status": "ready" if healthy else "no healthy worker", "workers": healthy},
                                status_code=200 if healthy else 503)  # fmt: skip

        @app.get("/gateway/workers")
        async def workers() -> Response:
            return JSONResponse([
                {"url": w.url, "role": w.role, "prefill_pool": w.prefill_pool, "healthy": w.healthy,
                 "models": sorted(w.models), "in_flight": w.in_flight,
                 "waiting": w.waiting, "running": w.running, "kv_usage": w.kv_usage, "last_error": w.last_error,
                 "kv_blocks_known": len(self.subscribers[w.url].index.hashes) if w.url in self.subscribers else None}
                for w in self.workers
            ])  # fmt: skip

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(self.workers), media_type="text/plain; version=0.0.4")

        return app
