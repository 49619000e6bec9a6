"""The HTTP layers vLLM's serve flags switch on: CORS for browser clients (--allowed-origins, ...)
and an X-Request-Id on every answer (--enable-request-id-headers).

CORS is off unless origins are named. vLLM allows every origin by default; here a server without an
API key on a laptop or a cluster's internal address would then be readable by any web page its
user opens (the browser sends the page's requests), so browsers get access only where asked for.
"""

from __future__ import annotations

import argparse
import logging
import re
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ferry.utils.json_args import json_list

if TYPE_CHECKING:  # (serve's argument parsing imports this module before the core starts: kept light)
    from fastapi import FastAPI
    from starlette.responses import Response
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

# The X-Request-Id values taken from clients: visible ASCII, nothing that could forge a log line.
_CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def client_request_id(value: str | None) -> str | None:
    """A client's X-Request-Id header, if it is one the server, the gateway and their logs take."""
    return value if value is not None and _CLIENT_REQUEST_ID.fullmatch(value) else None


def add_http_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("browser access and request ids (vLLM's flags)")
    g.add_argument("--allowed-origins", type=json_list, default=[], metavar="JSON",
                   help='origins whose web pages may call this server, e.g. \'["https://app.example.com"]\' '
                        "or '[\"*\"]' (default: none; vLLM's is every origin)")  # fmt: skip
    for what, verb in (("methods", "use"), ("headers", "send")):
        g.add_argument(f"--allowed-{what}", type=json_list, default=["*"], metavar="JSON",
                       help=f"the {what} they may {verb} (default: all)")  # fmt: skip
    g.add_argument("--allow-credentials", action="store_true", help="let them send credentials (cookies, HTTP auth)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="answer with an X-Request-Id header: the client's, else a new one (the answer's id "
                        "then carries it, as with a client's)")  # fmt: skip


def cors_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """CORSMiddleware's options from the flags; None when no origin is allowed."""
    if not args.allowed_origins:
        return None
    if "*" in args.allowed_origins and args.allow_credentials:
        logger.warning("--allowed-origins '[\"*\"]' with --allow-credentials: every site's pages may call this "
                       "server with the user's cookies and HTTP auth (harmless with API keys alone; not behind "
                       "a proxy that authenticates by cookie)")  # fmt: skip
    return {
        "allow_origins": args.allowed_origins,
        "allow_methods": args.allowed_methods,
        "allow_headers": args.allowed_headers,
        "allow_credentials": args.allow_credentials,
    }


def add_http_middleware(app: FastAPI, cors: dict[str, Any] | None, request_id_headers: bool,
                        internal_error: Callable[[Exception], Response]) -> None:  # fmt: skip
    """Added last, so they wrap everything: a browser's preflight (OPTIONS, with no API key) is
    answered before the key check, and 401s carry the CORS headers a page needs to read them.
    `internal_error`: the 500 that answers an exception no handler took (InternalErrorAnswer)."""
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(InternalErrorAnswer, answer=internal_error)  # innermost of the three
    if request_id_headers:
        app.add_middleware(RequestIdHeader)
    if cors is not None:  # (pages may read the id too)
        expose = ["X-Request-Id"] if request_id_headers else []
        app.add_middleware(CORSMiddleware, **cors, expose_headers=expose)


class InternalErrorAnswer:
    """An exception no handler took, answered by `answer` (the OpenAI-shaped 500 naming the log's
    error id) here, inside the CORS and X-Request-Id layers: Starlette's own last-resort layer sits
    outside every middleware, so its 500 reached a browser without the CORS headers that let the page
    read it, and without the request's id. Once an answer has started (a stream), no other can be
    sent: the exception goes on, and the connection closes."""

    def __init__(self, app: ASGIApp, answer: Callable[[Exception], Response]) -> None:
        self.app = app
        self.answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            response = self.answer(exc)  # (a 500 logs its exception under the id it names)
            if response.status_code < 500:  # a refusal that escaped its route's handling: a bug to find
                logger.warning("%s escaped its route, answered %d", type(exc).__name__, response.status_code,
                               exc_info=exc)  # fmt: skip
            await response(scope, receive, send)


class RequestIdHeader:
    """X-Request-Id on every answer the app makes (a bug's 500 too: InternalErrorAnswer answers it
    inside this layer, where Starlette's outermost one would not carry the id): the client's header,
    else (none, or one request_ids would not take) a new id, which replaces it on the request, so the
    answer's `id` names it and logs and client agree."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = list(scope["headers"])
        rid = next((v for k, v in headers if k == b"x-request-id"), None)
        if rid is None or client_request_id(rid.decode("latin-1")) is None:
            rid = uuid.uuid4().hex.encode()
            kept = [(k, v) for k, v in headers if k != b"x-request-id"]
            scope = {**scope, "headers": [*kept, (b"x-request-id", rid)]}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*kept, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
