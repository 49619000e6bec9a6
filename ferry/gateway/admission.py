"""Admission: everything a request must pass before any worker sees it, and the context it leaves with.

In this order, each step answering the client itself when the request stops
there: the API key (`--api-keys`, auth.py; 401), the body (413 over
MAX_BODY_BYTES; 400 if it is not strict UTF-8 JSON, has no `model`, or fails
the worker's own schema, so what is counted below is exactly what a worker
will run), the model (404 if no worker ever advertised it), the result cache
(`--result-cache`, result_cache.py; keyed by API key and body; a hit is
answered from it, charged to the key's limits at its recorded usage;
`x-ferry-cache: skip` bypasses it), and the key's token rate limits
(rate_limit.py; 429 with Retry-After, or 400 for a request that could never
fit). The order matters: an unknown key learns nothing about models, and only
a request that will be forwarded holds a charge, which settlement.py
reconciles with the usage the worker reports.

What passes is forwarded as the operator wants it, not as the client sent it
(`forwarded_body`): no `kv_transfer_params` (the gateway's own to set), the
key's `priority` instead of the client's, the key's cache salt (tenants share
no prefix-cache blocks unless `--share-prefix-cache`), and for streams
`include_usage` on, so every charge settles at real usage (the usage chunk is
dropped on the way back if the client did not ask for it). It becomes a
`RequestContext`: the body to forward, its parsed form, and what the later
stages need to know about it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ferry.entrypoints.openai.http_middleware import client_request_id
from ferry.entrypoints.openai.protocol import (
    OFFLOAD_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    OpenAIError,
    PromptLimits,
    RerankRequest,
    ScoreRequest,
    decode_json_object,
    precheck_body,
    precheck_raw,
    read_body,
    validate_body,
)
from ferry.entrypoints.openai.responses_protocol import ResponsesRequest, precheck_responses
from ferry.gateway.auth import ApiKey, ApiKeys
from ferry.gateway.metrics import GatewayMetrics
from ferry.gateway.prompts import PromptTokenizer, prompts_of
from ferry.gateway.rate_limit import Charge, TokenRateLimiter
from ferry.gateway.replicas import Worker, pool
from ferry.gateway.responses import CACHE_HEADER, WORKER_HEADER, error_response
from ferry.gateway.result_cache import ResultCache, cache_key, is_deterministic, with_answer_id


def _limited(limits) -> bool:
    return limits is not None and any(v is not None for v in vars(limits).values())


@dataclass
class RequestContext:
    kind: str  # "completions" | "chat" | "embeddings" | "responses" | "score" | "rerank"
    path: str
    raw: bytes
    data: dict
    model: str
    key_name: str
    streamed: bool
    started: float = field(default_factory=time.monotonic)
    prefill_pool: str | None = None  # the API key's prefill pool (disaggregated serving)
    cache_salt: str | None = None  # as forwarded: routing hashes the prompt's blocks with it
    strip_usage: bool = False  # a stream whose usage chunk the client did not ask for
    request_id: str | None = None  # the client's X-Request-Id, passed on: the worker's answer names it
    cache_key: str | None = None
    charge: Charge | None = None
    handed_off: bool = False  # a worker's response is being passed through (it settles the charge)
    delivered: bool = False  # a worker (the prefill hop's included) has been sent the request
    _ids: list[int] | None = None
    _ids_done: bool = False

    async def token_ids(self, prompts: PromptTokenizer, worker: Worker) -> list[int] | None:
        """The prompt's token ids as the replica will see them, computed once per request."""
        if not self._ids_done:
            self._ids = await asyncio.to_thread(prompts.token_ids, self.kind, self.data, worker)
            self._ids_done = True
        return self._ids


def unauthorized() -> JSONResponse:
    return error_response(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                          param=None, code="invalid_api_key")  # fmt: skip


def _num_prompts(data: dict) -> int:
    """Prompts in a /v1/completions or /v1/embeddings body (a list of strings or of token-id lists);
    1 otherwise."""
    prompt = prompts_of(data)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def _max_model_len(pool: list[Worker]) -> int | None:
    return next((w.info.get("max_model_len") for w in pool if w.info and w.info.get("max_model_len")), None)


def _completion_estimate(body, pool: list[Worker]) -> int:
    """The validated request's max tokens (chat: max_completion_tokens first, as the worker reads
    it) x n x prompts; without one, the room a replica's context leaves (or 1,024). An embedding
    generates nothing."""
    if isinstance(body, (EmbeddingRequest, ScoreRequest, RerankRequest)):
        return 0
    if isinstance(body, ResponsesRequest):
        limit = body.max_output_tokens
        return limit if limit is not None else _max_model_len(pool) or 1024
    seqs = body.n * (_num_prompts({"prompt": body.prompt}) if isinstance(body, CompletionRequest) else 1)
    limit = getattr(body, "max_completion_tokens", None)
    limit = limit if limit is not None else body.max_tokens
    return (limit if limit is not None else _max_model_len(pool) or 1024) * seqs


_SCHEMAS = {"completions": CompletionRequest, "chat": ChatCompletionRequest, "embeddings": EmbeddingRequest,
            "responses": ResponsesRequest, "score": ScoreRequest, "rerank": RerankRequest}  # fmt: skip
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "embeddings": "/v1/embeddings",
         "responses": "/v1/responses", "score": "/v1/score", "rerank": "/v1/rerank"}  # fmt: skip
# Kinds whose answer is a function of the body alone (vectors, similarities): cacheable as they are.
POOLING_KINDS = ("embeddings", "score", "rerank")


def _parse(raw: bytes, kind: str, limits_of: Callable[[object], PromptLimits | None]) -> tuple[dict, object]:
    """(the body as a dict, validated by the worker's own schema); OpenAIError when either fails.
    The prompt is bounded first, as the worker bounds it (`limits_of(model)`), before the schema
    walks a list of millions of token ids."""
    precheck_raw(raw, limits_of)  # millions of token ids refused before they are built
    data = decode_json_object(raw)
    limits = limits_of(data.get("model"))
    if limits is not None:
        (precheck_responses if kind == "responses" else precheck_body)(data, limits)
    return data, validate_body(data, _SCHEMAS[kind])


def forwarded_body(data: dict, body, key: ApiKey | None, share_prefix_cache: bool) -> tuple[dict, bool]:
    """The body a worker gets: (dict, whether the client's stream lacks the usage chunk we add)."""
    out = dict(data)
    out.pop("kv_transfer_params", None)  # set by this gateway only (disagg.py), never by a client
    out.pop("priority", None)
    if key is not None and key.priority:
        out["priority"] = key.priority
    if key is not None and not share_prefix_cache:
        # The client's own salt, if any, partitions within the key's partition, never across keys.
        out["cache_salt"] = key.cache_salt + (f":{body.cache_salt}" if body.cache_salt else "")
    strip_usage = False
    if getattr(body, "stream", False) and not body.include_usage:
        # (continuous_usage_stats off: without include_usage the client asked for no usage at all)
        out["stream_options"] = {**(data.get("stream_options") or {}), "include_usage": True,
                                 "continuous_usage_stats": False}  # fmt: skip
        strip_usage = True
    return out, strip_usage


def _rate_limited(why: str, wait: float) -> Response:
    headers = {"Retry-After": str(max(1, math.ceil(wait)))}
    return error_response(429, f"Rate limit for this API key: {why}.", "rate_limit_exceeded",
                          code="rate_limit_exceeded", headers=headers)  # fmt: skip


class Admission:
    def __init__(self, workers: list[Worker], prompts: PromptTokenizer, metrics: GatewayMetrics,
                 api_keys: ApiKeys | None, result_cache: ResultCache | None,
                 rate_limiter: TokenRateLimiter, share_prefix_cache: bool = False,
                 holding: bool = False) -> None:  # fmt: skip
        self.workers, self.prompts, self.metrics = workers, prompts, metrics
        self.api_keys, self.result_cache, self.rate_limiter = api_keys, result_cache, rate_limiter
        self.share_prefix_cache = share_prefix_cache
        self.holding = holding  # requests may wait for a worker (waiting_room.py)

    async def admit(self, request: Request, kind: str) -> RequestContext | Response:
        """The request's context, or the response that ends it here (an error or a cache hit)."""
        key_name = "none"
        limits = None
        key_pool = None
        key = None
        if self.api_keys is not None:
            key = self.api_keys.authenticate(request.headers.get("authorization"))
            if key is None:
                return unauthorized()
            key_name, limits, key_pool = key.name, key.limits, key.prefill_pool
        try:
            raw = await read_body(request)
            # Large bodies off the loop: decoding and validating 30 MB takes a good part of a second.
            if len(raw) <= OFFLOAD_BYTES:
                data, body = _parse(raw, kind, self._prompt_limits)
            else:
                data, body = await asyncio.to_thread(_parse, raw, kind, self._prompt_limits)
        except OpenAIError as e:
            return error_response(e.status, e.message, param=e.param)
        model = body.model
        if not model:
            return error_response(400, "`model` is required (see GET /v1/models)", param="model")
        model_pool, known = pool(self.workers, model, ("both", "prefill", "decode"))
        # While no worker has ever answered (a pool starting from zero), nobody knows the models yet:
        # with holding on, the request waits for a worker and the proxy checks its model then.
        cold = self.holding and not any(w.models for w in self.workers)
        if not known and not cold:
            return error_response(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        path = PATHS[kind]
        out, strip_usage = forwarded_body(data, body, key, self.share_prefix_cache)
        try:  # the decoder took it near its depth limit from a shallower stack: it may not go out again
            raw_out = msgspec.json.encode(out)
        except RecursionError:
            return error_response(400, "the request body is nested too deeply")
        request_id = client_request_id(request.headers.get("x-request-id"))  # (a worker takes no other)
        ctx = RequestContext(kind, path, raw_out, out, model, key_name, getattr(body, "stream", False),
                             prefill_pool=key_pool, cache_salt=out.get("cache_salt"), strip_usage=strip_usage,
                             request_id=request_id)  # fmt: skip

        cache = self.result_cache
        deterministic = kind in POOLING_KINDS or is_deterministic(data)  # an embedding is, alone or batched
        if cache is not None and request.headers.get(CACHE_HEADER, "").lower() != "skip" and deterministic:
            ctx.cache_key = cache_key(path, data, key_name)
            hit = cache.get(ctx.cache_key) if ctx.cache_key is not None else None
            if hit is not None:
                refused = self._charge_hit(key_name, limits, hit.usage)
                if refused is not None:
                    return refused
                self.metrics.cache.labels("hit").inc()
                headers = {**hit.headers, CACHE_HEADER: "hit", WORKER_HEADER: hit.worker}
                replay = with_answer_id(hit.body, ctx.streamed, ctx.request_id)
                return Response(replay, status_code=hit.status, headers=headers)
            self.metrics.cache.labels("miss").inc()

        if _limited(limits):
            prompt_estimate = await self._prompt_estimate(ctx, model_pool)
            completion_estimate = _completion_estimate(body, model_pool)
            charge, wait, why = self.rate_limiter.admit(key_name, limits, prompt_estimate, completion_estimate)
            if charge is None:
                self.metrics.rate_limited.labels(key_name).inc()
                if wait is None:  # can never fit: retrying would not help, so not a 429
                    return error_response(400, f"{why}; lower max_tokens or the prompt", param="max_tokens")
                return _rate_limited(why, wait)
            ctx.charge = charge
        return ctx

    def _prompt_limits(self, model: object) -> PromptLimits | None:
        """The prompt bounds of `model`'s pool (its first worker's: one pool serves one model)."""
        if not isinstance(model, str):
            return None
        model_pool, _ = pool(self.workers, model, ("both", "prefill", "decode"))
        return self.prompts.prompt_limits(model_pool[0]) if model_pool else None

    def _charge_hit(self, key_name: str, limits, usage: tuple[int | None, int | None]) -> Response | None:
        """A result-cache hit costs its key what the response it replays cost (its recorded usage):
        None when the key's limits take that, else the 429 to answer with."""
        if not _limited(limits):
            return None
        prompt, completion = usage
        charge, wait, why = self.rate_limiter.admit(key_name, limits, prompt or 0, completion or 0)
        if charge is None:
            self.metrics.rate_limited.labels(key_name).inc()
            return _rate_limited(why, wait or 1.0)
        return None

    async def _prompt_estimate(self, ctx: RequestContext, pool: list[Worker]) -> int:
        n = None
        if pool and _num_prompts(ctx.data) > 1:  # every prompt counts
            n = await asyncio.to_thread(self.prompts.num_prompt_tokens, prompts_of(ctx.data), pool[0])
        elif pool:  # the ids routing hashes too: tokenized once (RequestContext.token_ids)
            ids = await ctx.token_ids(self.prompts, pool[0])
            n = None if ids is None else len(ids)
        return n if n is not None else max(1, len(ctx.raw) // 4)  # no tokenizer here: ~4 bytes a token
