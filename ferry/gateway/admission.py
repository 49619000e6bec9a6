"""Admission: everything a request must pass before any worker sees it, and the context it leaves with.

In this order, each step answering the client itself when the request stops
there: the API key (`--api-keys`, auth.py; 401), the body (413 over
MAX_BODY_BYTES, 400 if it is not a JSON object or has no `model`), the model
(404 if no worker ever advertised it), the result cache (`--result-cache`,
result_cache.py; a hit is answered from it, `x-ferry-cache: skip` bypasses
it), and the key's token rate limits (rate_limit.py; 429 with Retry-After, or
400 for a request that could never fit). The order matters: an unknown key
learns nothing about models, a cache hit costs no tokens of the key's limit,
and only a request that will be forwarded holds a charge, which settlement.py
reconciles with the usage the worker reports.

What passes becomes a `RequestContext`: the body as received (forwarded
untouched), its parsed form, and what the later stages need to know about it.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ferry.gateway.auth import ApiKeys
from ferry.gateway.metrics import GatewayMetrics
from ferry.gateway.prompts import PromptTokenizer
from ferry.gateway.rate_limit import Charge, TokenRateLimiter
from ferry.gateway.replicas import Worker, pool
from ferry.gateway.responses import CACHE_HEADER, WORKER_HEADER, error_response
from ferry.gateway.result_cache import ResultCache, cache_key, is_deterministic

MAX_BODY_BYTES = 32 * 1024 * 1024


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


class Admission:
    def __init__(self, workers: list[Worker], prompts: PromptTokenizer, metrics: GatewayMetrics,
                 api_keys: ApiKeys | None, result_cache: ResultCache | None,
                 rate_limiter: TokenRateLimiter) -> None:  # fmt: skip
        self.workers, self.prompts, self.metrics = workers, prompts, metrics
        self.api_keys, self.result_cache, self.rate_limiter = api_keys, result_cache, rate_limiter

    async def admit(self, request: Request, kind: str) -> RequestContext | Response:
        """The request's context, or the response that ends it here (an error or a cache hit)."""
        key_name = "none"
        limits = None
        key_pool = None
        if self.api_keys is not None:
            key = self.api_keys.authenticate(request.headers.get("authorization"))
            if key is None:
                return unauthorized()
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
        model_pool, known = pool(self.workers, model, ("both", "prefill", "decode"))
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
            prompt_estimate = await self._prompt_estimate(ctx, model_pool)
            completion_estimate = _completion_estimate(data, model_pool)
            charge, wait, why = self.rate_limiter.admit(key_name, limits, prompt_estimate, completion_estimate)
            if charge is None:
                self.metrics.rate_limited.labels(key_name).inc()
                if wait is None:  # can never fit: retrying would not help, so not a 429
                    return error_response(400, f"{why}; lower max_tokens or the prompt", param="max_tokens")
                return error_response(429, f"Rate limit for this API key: {why}.", "rate_limit_exceeded",
                                      code="rate_limit_exceeded",
                                      headers={"Retry-After": str(max(1, math.ceil(wait)))})  # fmt: skip
            ctx.charge = charge
        return ctx

    async def _prompt_estimate(self, ctx: RequestContext, pool: list[Worker]) -> int:
        ids = await ctx.token_ids(self.prompts, pool[0]) if pool else None
        if ids is not None:
            return len(ids) * _num_prompts(ctx.data)  # the first prompt's length for each
        return max(1, len(ctx.raw) // 4)  # no tokenizer here: ~4 bytes a token
