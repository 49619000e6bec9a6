"""One exchange with a worker: send a request, then pass its response through byte for byte.

`send` decides whether the worker took the request. Up to its first byte a
failure can still be retried elsewhere, so a connection error or a 5xx is
returned as a failure (the 5xx kept, as the answer if no other worker does
better) and counted against the worker's circuit breaker when the worker is
at fault: connection errors, 502 and 503, not a 500, which may be the
request's own doing (one client must not empty the pool), nor a timeout
(the gateway's read timeout, a worker's 504): slow is not dead, and such a
request is answered, not retried. After the first
byte nothing can be retried: `pass_through` streams the response to the
client with an `x-ferry-worker` header, keeps up to MAX_KEPT_BYTES of it and
the first token's time, and settles it (settlement.py) when it ends.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import httpx
import msgspec
from fastapi.responses import Response

from ferry.entrypoints.openai.protocol import OpenAIError
from ferry.gateway.admission import RequestContext
from ferry.gateway.replicas import MonitorConfig, Worker
from ferry.gateway.response_usage import StreamEnd, UsageChunkFilter, first_text_chunk
from ferry.gateway.responses import CACHE_HEADER, WORKER_HEADER
from ferry.gateway.settlement import PassThroughResponse, Settlement

logger = logging.getLogger(__name__)

MAX_KEPT_BYTES = 8 * 1024 * 1024  # of a response, for usage and the result cache
# Hop-by-hop and length headers are the gateway's own business, not the worker's.
_DROP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


def worker_headers(request_id: str | None) -> dict[str, str]:
    """A request's headers to a worker: JSON, and the client's X-Request-Id (checked at admission),
    so that the worker's answer and logs carry the id the client traces."""
    headers = {"content-type": "application/json"}
    if request_id is not None:
        headers["x-request-id"] = request_id
    return headers


class UpstreamError(NamedTuple):
    """A worker's 5xx before any byte reached the client, kept to answer with if no worker does better."""

    worker: Worker
    status: int
    headers: dict[str, str]
    body: bytes
    retry: bool = True  # False: no other worker would do better (answer with this)


async def send(client: httpx.AsyncClient, worker: Worker, path: str, raw: bytes, accept: str | None,
               breaker: MonitorConfig,
               request_id: str | None = None) -> tuple[httpx.Response | None, UpstreamError | None]:  # fmt: skip
    """(the worker's response with its headers read, None) or, when it failed before any
    byte, (None, its 5xx response if it sent one). `request_id`: the client's X-Request-Id."""
    headers = worker_headers(request_id)
    if accept is not None:
        headers["accept"] = accept
    worker.in_flight += 1
    try:
        upstream = await client.send(
            client.build_request("POST", worker.url + path, content=raw, headers=headers), stream=True
        )
    except httpx.ReadTimeout:
        # Slow is not dead: a non-streamed request sends nothing until it is done, and a long one
        # may outlast the gateway's timeout on a healthy worker. No breaker count, and no retry
        # (another worker would only run the same long request again).
        worker.in_flight -= 1
        logger.warning("worker %s did not answer within the gateway's --request-timeout", worker.url)
        error = OpenAIError(504, "the worker did not answer within the gateway's request timeout", "timeout", code=504)
        body = msgspec.json.encode(error.body())
        return None, UpstreamError(worker, 504, {"content-type": "application/json"}, body, retry=False)
    except (httpx.TransportError, OSError) as e:
        worker.in_flight -= 1
        worker.record_failure(f"{type(e).__name__}: {e}", breaker)
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
        # A 504 is the request's own deadline (`ferry serve --request-timeout`): slow, not dead,
        # and no other worker would finish it sooner.
        if upstream.status_code in (502, 503):
            worker.record_failure(f"HTTP {upstream.status_code}", breaker)
        retry = upstream.status_code != 504
        logger.warning("worker %s answered %d%s", worker.url, upstream.status_code, "; trying another" * retry)
        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_HEADERS}
        return None, UpstreamError(worker, upstream.status_code, kept, body[:65536], retry)
    worker.consecutive_failures = 0
    return upstream, None


def pass_through(ctx: RequestContext, worker: Worker, upstream: httpx.Response, settlement: Settlement,
                 extra_headers: dict[str, str] | None = None) -> Response:  # fmt: skip
    """The client's response: `upstream` (in flight on `worker`) streamed through; settled once it ends."""
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_HEADERS}
    headers[WORKER_HEADER] = worker.url
    headers.update(extra_headers or {})
    if ctx.cache_key is not None:
        headers[CACHE_HEADER] = "miss"
    status = upstream.status_code
    sse = ctx.streamed and upstream.headers.get("content-type", "").startswith("text/event-stream")
    state = {"kept": bytearray(), "overflow": False, "complete": False, "first": None, "closed": False,
             "broken": False}  # fmt: skip

    async def body():
        # The bookkeeping (close) runs before the client can see the end of the response, so
        # a client that repeats a request right away finds it in the result cache: a
        # non-streamed body is read whole first (the worker sends it at the end anyway), a
        # stream is settled just before its last event (`data: [DONE]`, ...: StreamEnd) goes out.
        try:
            if not sse:  # a non-streamed response, or a worker's error answer to a streamed request
                data = await upstream.aread()
                state["kept"] += data[: MAX_KEPT_BYTES + 1]
                state["overflow"] = len(data) > MAX_KEPT_BYTES
                state["complete"] = True
                await close()
                yield data
                return
            strip = UsageChunkFilter() if ctx.strip_usage else None
            end = StreamEnd()
            async for chunk in upstream.aiter_raw():
                if state["first"] is None and first_text_chunk(chunk):
                    state["first"] = time.monotonic()
                if not state["overflow"]:
                    state["kept"] += chunk  # as the worker sent it: settlement reads its usage
                    state["overflow"] = len(state["kept"]) > MAX_KEPT_BYTES
                out = chunk if strip is None else strip.feed(chunk)
                if end.feed(chunk):
                    state["complete"] = True
                    await close()  # also closes the upstream: nothing may be read after this
                    yield out + (strip.flush() if strip is not None else b"")
                    return
                if out:
                    yield out
            if strip is not None and (tail := strip.flush()):
                yield tail  # a stream that ended without [DONE]: what the filter still held
        except httpx.TransportError as e:  # the worker broke the stream: nothing can be retried now
            state["broken"] = True
            logger.warning("worker %s broke a response after %.1fs: %s", worker.url,
                           time.monotonic() - ctx.started, e)  # fmt: skip
            return
        state["complete"] = True

    async def close() -> None:
        # Runs exactly once, whether the body was sent, broke, or never started (a client that
        # left before the first byte): the in-flight count and the charge must not leak. Closing
        # the upstream connection early is what tells the worker to abort the request.
        if state["closed"]:
            return
        state["closed"] = True
        worker.in_flight -= 1
        await upstream.aclose()
        kept = None if state["overflow"] else bytes(state["kept"])
        client_left = not state["complete"] and not state["broken"]
        settlement.settle(ctx, worker, status, headers, kept, state["complete"], state["first"], client_left)

    return PassThroughResponse(body(), close, status_code=status, headers=headers)
