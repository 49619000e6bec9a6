"""`ferry serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

This process validates, tokenizes, detokenizes and streams; the model runs in
the EngineCore process (see `ferry/engine/core_proc.py`). Probes:
`/health` (liveness: this process answers and the core answers a ping),
`/ready` (503 until the model is loaded and warmed, and while draining).
OpenAI's /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/responses and /v1/models, and vLLM's
`/tokenize`, `/detokenize` and `/version`. `/` is a chat playground (web/, unless
`--no-playground`): static files that call /v1/chat/completions like any client.
SIGTERM drains: readiness turns 503, new requests get 503, in-flight
requests get `--drain-timeout` seconds to finish, then the server exits 0.
If the core dies, readiness turns 503 and the server exits non-zero.
The command line (flags, checks, the core's spawn) is serve_command.py's; `run_server` here.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import socket
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ferry.config import (
    EngineArgs,
    KVEventsConfig,
    KVTransferConfig,
)
from ferry.core.block_hash import lora_name_fingerprint
from ferry.core.kv_events import HASH_ALGORITHM, TOPIC
from ferry.engine.async_llm import AsyncLLM, EngineStalledError
from ferry.engine.core_client import EngineDeadError, SpawnedCore
from ferry.entrypoints.draining_server import DrainingServer, wait_drained
from ferry.entrypoints.openai import serving_lora, serving_score, serving_tokenization
from ferry.entrypoints.openai.chat_template import template_digest
from ferry.entrypoints.openai.http_middleware import add_http_middleware, cors_options
from ferry.entrypoints.openai.metrics import ServerMetrics
from ferry.entrypoints.openai.protocol import (
    OFFLOAD_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    OpenAIError,
    PromptLimits,
    RerankRequest,
    ScoreRequest,
    StreamOptions,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    decode_json_object,
    precheck_body,
    precheck_raw,
    read_body,
    validate_body,
)
from ferry.entrypoints.openai.request_log import RequestLogger
from ferry.entrypoints.openai.responses_protocol import ResponsesRequest, precheck_responses
from ferry.entrypoints.openai.serving import (
    RequestAbortedError,
    RequestTimeoutError,
    ServerState,
    as_openai_error,
    ready_engine,
)
from ferry.entrypoints.openai.serving_chat import create_chat_completion
from ferry.entrypoints.openai.serving_completion import create_completion
from ferry.entrypoints.openai.serving_embedding import create_embedding
from ferry.entrypoints.openai.serving_responses import create_response
from ferry.entrypoints.openai.stats_log import StatsLog
from ferry.entrypoints.tls import uvicorn_tls_options
from ferry.models.paths import resolve_model_path
from ferry.tokenizer import load_tokenizer
from ferry.utils.bearer import key_digest, match_digest
from ferry.utils.web_pages import WebPages

logger = logging.getLogger("ferry.server")
# Outside /v1/ but behind --api-key too: they cost the server work (probes and /metrics stay open).
_KEYED_PATHS = frozenset({"/reset_prefix_cache", "/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank"})


def _version() -> str:
    """The installed distribution's version (not `ferry.__version__`: importing the package's
    root would, to the import linter, pull the engine into this process)."""
    try:
        return importlib.metadata.version("ferry")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _internal_error_response(exc: Exception) -> JSONResponse:
    """An exception no handler took, as its OpenAI error (a 500 logs it with the id it answers)."""
    return _error_response(as_openai_error(exc))


def _decode(raw: bytes, limits: PromptLimits, precheck=precheck_body) -> dict:
    precheck_raw(raw, lambda _model: limits)  # millions of token ids refused before they are built
    data = decode_json_object(raw)
    precheck(data, limits)
    return data


async def _parse(request: Request, model: type, limits: PromptLimits, precheck=precheck_body) -> Any:
    """The body as `model`, bounded by `precheck(data, limits)` before the schema walks it."""
    raw = await read_body(request)
    if len(raw) <= OFFLOAD_BYTES:
        return validate_body(_decode(raw, limits, precheck), model)
    data = await asyncio.to_thread(_decode, raw, limits, precheck)
    return await asyncio.to_thread(validate_body, data, model)


class RootPathMiddleware:
    """--root-path: each request's ASGI root_path (what FastAPI's deprecated `root_path=` did), so
    the router takes paths with the prefix or without it."""

    def __init__(self, app, root_path: str) -> None:
        self.app, self.root_path = app, root_path

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


def route_path(scope) -> str:
    """A request's path as the app routes it: without the root path (--root-path) when it starts
    with it, as Starlette's routing strips it (a proxy may forward the prefix or strip it)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


class Server:
    """The app, its engine and its lifecycle (start, drain, die)."""

    def __init__(self, engine_args: EngineArgs, served_model_names: list[str], *, max_queue_len: int,
                 drain_timeout: float, kv_events: KVEventsConfig | None = None,
                 kv_transfer: KVTransferConfig | None = None, api_keys: list[str] | None = None,
                 allow_client_priority: bool = False, request_timeout: float | None = None,
                 engine_stall_timeout: float | None = None, tool_parser: str | None = None,
                 enable_auto_tool_choice: bool = False, reasoning_parser: str | None = None,
                 playground: bool = True, spawned: SpawnedCore | None = None,
                 sampling_defaults: dict | None = None, cors: dict | None = None,
                 request_id_headers: bool = False, log_stats_interval: float | None = None,
                 request_logger: RequestLogger | None = None, chat_template: str | None = None,
                 response_role: str = "assistant", force_include_usage: bool = False,
                 return_tokens_as_token_ids: bool = False, root_path: str = "",
                 lora_update_dirs: list[str] | None = None) -> None:  # fmt: skip
        self.engine_args = engine_args
        self.root_path = root_path  # --root-path: served under this prefix too (FastAPI's root_path)
        self.log_stats_interval = log_stats_interval  # None: --disable-log-stats
        self.cors = cors  # CORSMiddleware's options (http_middleware.py); None: no browser access
        self.request_id_headers = request_id_headers
        self.spawned = spawned  # the core, when `ferry serve` started it before importing this module
        self.playground = WebPages("ferry.entrypoints", "web") if playground else None
        self.kv_events = kv_events
        self.kv_transfer = kv_transfer
        self.api_keys = [key_digest(k) for k in api_keys or []]
        self.engine_stall_timeout = engine_stall_timeout
        self.state = ServerState(served_model_names, max_queue_len, allow_client_priority, request_timeout,
                                 tool_parser=tool_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                                 reasoning_parser=reasoning_parser,
                                 sampling_defaults=sampling_defaults or {},
                                 request_logger=request_logger, chat_template=chat_template,
                                 response_role=response_role, force_include_usage=force_include_usage,
                                 return_tokens_as_token_ids=return_tokens_as_token_ids,
                                 lora_modules=dict(engine_args.lora_adapters),
                                 lora_update_dirs=lora_update_dirs)  # fmt: skip
        self.metrics = ServerMetrics(served_model_names[0])
        self.drain_timeout = drain_timeout
        self.model_path = resolve_model_path(engine_args.model, engine_args.load_format)
        self.uvicorn: uvicorn.Server | None = None
        self.exit_code = 0
        self._start_task: asyncio.Task | None = None
        self._drain_task: asyncio.Task | None = None
        self.app = self._build_app()

    # -- lifecycle --------------------------------------------------------

    async def _start_engine(self) -> None:
        engine = AsyncLLM(self.engine_args, tokenizer=None, metrics=self.metrics, kv_events=self.kv_events,
                          kv_transfer=self.kv_transfer, stall_timeout=self.engine_stall_timeout,
                          spawned=self.spawned)  # fmt: skip
        engine.on_dead = self._on_engine_dead
        self.state.engine = engine
        try:
            args = self.engine_args
            await engine.start(tokenizer_loader=lambda: load_tokenizer(args.tokenizer or self.model_path,
                                                                       args.trust_remote_code))  # fmt: skip
        except Exception as e:  # EngineDeadError has already called _on_engine_dead
            self.state.startup_error = str(e)
            if engine.dead is None:
                logger.exception("engine failed to start")
                self._on_engine_dead(str(e))
            return
        self.metrics.set_engine_info(engine.info)
        self.state.prompt_limits(engine)
        logger.info("ready: serving %s (max_model_len %d)", self.state.served_model_names, engine.info.max_model_len)

    def _on_engine_dead(self, why: str) -> None:
        logger.error("EngineCore is gone (%s); exiting", why)
        self.exit_code = 1
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True

    def start_drain(self) -> None:
        if self.state.draining:
            return
        self.state.draining = True
        logger.info("draining: %d requests in flight, up to %.0fs", self._in_flight(), self.drain_timeout)
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    def _in_flight(self) -> int:
        return self.state.engine.num_in_flight if self.state.engine is not None else 0

    async def _drain(self) -> None:
        await wait_drained(self._in_flight, self.drain_timeout)
        self.abort_all("drain timeout")
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True

    def abort_all(self, why: str) -> None:
        engine = self.state.engine
        if engine is None:
            return
        streams = list(engine.streams.values())
        if streams:
            logger.warning("aborting %d requests: %s", len(streams), why)
        for stream in streams:
            engine.abort(stream.request_id)
            stream.queue.put_nowait(RequestAbortedError(f"the request was aborted: {why}"))

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI):
        self._start_task = asyncio.create_task(self._start_engine())
        stats_task = None
        if self.log_stats_interval is not None:
            stats_task = asyncio.create_task(StatsLog(self.metrics).run(self.log_stats_interval))
        yield
        if stats_task is not None:
            stats_task.cancel()
        self.abort_all("server shutdown")
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
        if self.state.engine is not None:
            await self.state.engine.shutdown()

    # -- routes -----------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="ferry", lifespan=self._lifespan, docs_url=None, redoc_url=None)
        state = self.state

        if self.api_keys:
            keys = self.api_keys

            @app.middleware("http")
            async def _require_api_key(request: Request, call_next):
                # Probes, metrics and /ferry/info stay open (kubelets and Prometheus carry no key). The
                # path as routed: a --root-path prefix, if sent, is not part of it.
                path = route_path(request.scope)
                if path.startswith("/v1/") or path == "/v1" or path in _KEYED_PATHS:
                    if match_digest(request.headers.get("authorization"), keys) is None:
                        return _error_response(OpenAIError(
                            401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                            "invalid_request_error", code="invalid_api_key",
                        ))  # fmt: skip
                return await call_next(request)

        @app.exception_handler(OpenAIError)
        async def _openai_error(request: Request, exc: OpenAIError):
            return _error_response(exc)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException):
            kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
            return _error_response(OpenAIError(exc.status_code, str(exc.detail), kind, code=exc.status_code))

        @app.exception_handler(Exception)  # (what InternalErrorAnswer, inside the middleware, did not see)
        async def _internal_error(request: Request, exc: Exception):
            return _internal_error_response(exc)

        @app.get("/health")
        async def health() -> Response:
            engine = state.engine
            if engine is None or engine.dead is not None:
                return JSONResponse({"status": "dead", "reason": engine.dead if engine else None}, status_code=503)
            if not engine.ready:  # loading: the process is alive, the core is starting
                alive = engine.client.alive
                return JSONResponse({"status": "loading"}, status_code=200 if alive else 503)
            try:
                await engine.call("ping", timeout=10.0)
            except (EngineDeadError, asyncio.TimeoutError, RuntimeError) as e:
                return JSONResponse({"status": "unresponsive", "reason": str(e)}, status_code=503)
            return JSONResponse({"status": "ok"})

        @app.get("/ready")
        async def ready() -> Response:
            engine = state.engine
            if state.draining:
                return JSONResponse({"status": "draining"}, status_code=503)
            if engine is None or engine.dead is not None:
                return JSONResponse({"status": "dead"}, status_code=503)
            if engine.stalled is not None:
                return JSONResponse({"status": "stalled", "reason": engine.stalled}, status_code=503)
            if not engine.ready:
                return JSONResponse({"status": "loading"}, status_code=503)
            return JSONResponse({"status": "ready"})

        if self.playground is not None:
            self.playground.add_routes(app, "/", "playground.html", "/playground")

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        def model_cards() -> list[dict]:
            engine = state.engine
            max_len = engine.info.max_model_len if engine is not None and engine.info is not None else None
            base = [
                {"id": name, "object": "model", "created": 0, "owned_by": "ferry", "root": self.model_path,
                 "parent": None, "max_model_len": max_len}
                for name in state.served_model_names
            ]  # fmt: skip
            # LoRA adapters as vLLM lists them: their directory as root, the base model as parent
            adapters = [{**base[0], "id": name, "root": path, "parent": state.model_name}
                        for name, path in state.lora_modules.items()]  # fmt: skip
            return base + adapters

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": model_cards()})

        @app.get("/v1/models/{model:path}")
        async def model(model: str) -> Response:
            """One model (OpenAI's `models.retrieve`); names may hold slashes (org/name)."""
            card = next((c for c in model_cards() if c["id"] == model), None)
            if card is None:
                raise OpenAIError(404, f"The model `{model}` does not exist.", "NotFoundError", param="model", code=404)
            return JSONResponse(card)

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            """Forget the prefix cache (vLLM's endpoint): for benchmarks that compare cold runs.
            409 while requests hold blocks."""
            engine = ready_engine(state)
            try:
                await engine.call("reset_prefix_cache", timeout=10.0)
            except (EngineDeadError, asyncio.TimeoutError) as e:
                return _error_response(OpenAIError(503, f"the engine did not answer: {e}", "service_unavailable",
                                                   code=503))  # fmt: skip
            except RuntimeError as e:  # the core's refusal: requests hold blocks
                return _error_response(OpenAIError(409, str(e), code=409))
            return JSONResponse({"status": "ok"})

        @app.get("/ferry/info")
        async def info() -> Response:
            """What a router needs to mirror this replica's prefix cache (gateway, kv-aware policy)."""
            engine = state.engine
            if engine is None or engine.info is None:
                return JSONResponse({"status": "loading"}, status_code=503)
            i = engine.info
            events = None
            if i.kv_events_port is not None:
                events = {"host": i.kv_events_host, "port": i.kv_events_port, "replay_port": i.kv_events_replay_port,
                          "topic": TOPIC.decode()}  # fmt: skip
            return JSONResponse({
                "models": state.served_model_names,
                "model_path": self.model_path,
                "tokenizer": self.engine_args.tokenizer or self.model_path,
                # --chat-template's text, so a gateway renders chats as this server does. Behind a key,
                # only its digest: /ferry/info is open, and the template may hold the operator's system
                # prompt (without a key, /tokenize and /detokenize show what it renders anyway).
                "chat_template": None if self.api_keys else state.chat_template,
                "chat_template_sha256": template_digest(state.chat_template),
                "block_size": i.block_size,
                "num_kv_blocks": i.num_kv_blocks,
                # LoRA adapters' digests under a fingerprint of their names (their prompts' block hashes
                # mix in name and digest): a gateway routes adapter requests by cache overlap too.
                "lora_digests": {lora_name_fingerprint(n): d for n, d in i.lora_digests.items()},
                "max_model_len": i.max_model_len,
                "prefix_caching": self.engine_args.enable_prefix_caching,
                "block_hash": HASH_ALGORITHM,
                "block_hash_salt": i.block_hash_salt,  # the fingerprint of the deployment's salt, or None
                "kv_events": events,
                "role": i.kv_role,
                "kv_transfer": {"sends_by": i.kv_transfer, "receiver": i.kv_receiver, "redis": i.kv_redis},
                "startup_seconds": i.startup_seconds,  # `ferry bench startup`
            })  # fmt: skip

        async def generate(request: Request, body_type: type, handler, precheck=precheck_body) -> Response:
            engine = ready_engine(state)  # 503 before reading a body this server cannot serve yet
            try:
                body = await _parse(request, body_type, state.prompt_limits(engine), precheck)
                if state.force_include_usage and getattr(body, "stream", False) and not body.include_usage:
                    # vLLM's --enable-force-include-usage: the stream ends with its usage, asked or not
                    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
                    body.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=continuous)
            except ClientDisconnect:  # gone before its body was read: nothing started, nothing to answer
                return Response(status_code=499)
            try:
                response = await handler(request, state, body)
            except (ValueError, EngineDeadError, EngineStalledError, RequestAbortedError, RequestTimeoutError) as e:
                raise as_openai_error(e) from None
            # None: the client disconnected; nobody reads this status, nginx's 499 names the case in logs.
            return response if response is not None else Response(status_code=499)

        async def tokenization(request: Request, handler, schema_of) -> Response:
            engine = ready_engine(state)
            try:
                raw = await read_body(request)
            except ClientDisconnect:
                return Response(status_code=499)
            data = await asyncio.to_thread(_decode, raw, state.prompt_limits(engine))
            body = await asyncio.to_thread(validate_body, data, schema_of(data))
            return JSONResponse(await handler(state, body))

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            """vLLM's: a prompt's (or chat's) token ids as this server's tokenizer and template make them."""

            def schema(data: dict) -> type:
                return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest

            return await tokenization(request, serving_tokenization.tokenize, schema)

        @app.post("/detokenize")
        async def detokenize(request: Request) -> Response:
            return await tokenization(request, serving_tokenization.detokenize, lambda d: DetokenizeRequest)

        async def lora_update(request: Request, body_type: type, handler) -> Response:
            try:
                raw = await read_body(request)
            except ClientDisconnect:
                return Response(status_code=499)
            return await handler(
                state, validate_body(_decode(raw, state.prompt_limits(ready_engine(state))), body_type)
            )

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            """vLLM's: load a PEFT adapter from a directory under --allow-runtime-lora-updating's."""
            return await lora_update(request, serving_lora.LoadLoRAAdapterRequest, serving_lora.load_lora_adapter)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            return await lora_update(request, serving_lora.UnloadLoRAAdapterRequest, serving_lora.unload_lora_adapter)

        @app.get("/version")
        async def version() -> Response:
            return JSONResponse({"version": _version()})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await generate(request, CompletionRequest, create_completion)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await generate(request, ChatCompletionRequest, create_chat_completion)

        @app.post("/v1/embeddings")
        async def embeddings(request: Request) -> Response:
            return await generate(request, EmbeddingRequest, create_embedding)

        @app.post("/v1/responses")
        async def responses(request: Request) -> Response:
            return await generate(request, ResponsesRequest, create_response, precheck_responses)

        async def score(request: Request) -> Response:
            """vLLM's: cosine similarity of text pairs' embeddings (serving_score.py)."""
            return await generate(request, ScoreRequest, serving_score.create_score)

        async def rerank(request: Request) -> Response:
            """vLLM's (Jina's and Cohere's shape): documents by their similarity to a query, best first."""
            return await generate(request, RerankRequest, serving_score.create_rerank)

        for path in ("/score", "/v1/score"):
            app.add_api_route(path, score, methods=["POST"])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.add_api_route(path, rerank, methods=["POST"])

        app.openapi = partial(_openapi_with_bodies, app, {"/v1/completions": CompletionRequest,
                                                          "/v1/chat/completions": ChatCompletionRequest,
                                                          "/v1/embeddings": EmbeddingRequest,
                                                          "/v1/score": ScoreRequest,
                                                          "/v1/rerank": RerankRequest,
                                                          "/v1/responses": ResponsesRequest})  # fmt: skip
        add_http_middleware(app, self.cors, self.request_id_headers, _internal_error_response)
        if self.root_path:  # added last, so outermost: every middleware and the router see it
            app.add_middleware(RootPathMiddleware, root_path=self.root_path)
        return app


def _openapi_with_bodies(app: FastAPI, bodies: dict[str, type]) -> dict[str, Any]:
    """The app's OpenAPI document with the request bodies FastAPI cannot see (the routes read the
    raw body themselves, to bound and check it before validation): clients and fuzzers get the
    schema the server validates with."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(schema.pop("$defs", {}))
            components[model.__name__] = schema
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
            }
        app.openapi_schema = doc
    return app.openapi_schema


def run_server(args: argparse.Namespace, engine_args: EngineArgs, names: list[str], path: str,
               kv_events: KVEventsConfig | None, kv_transfer: KVTransferConfig | None, api_keys: list[str] | None,
               sock: socket.socket, spawned: SpawnedCore | None = None,
               sampling_defaults: dict | None = None) -> int:  # fmt: skip
    """Serve on the listening `sock` until SIGTERM (drained) or the core's death; the exit code.
    `args` are checked already (serve_command.py), `spawned` is the core started meanwhile, if it
    was, and `sampling_defaults` the model's generation_config.json defaults (--generation-config)."""
    server = Server(engine_args, names, max_queue_len=args.max_queue_len, drain_timeout=args.drain_timeout,
                    kv_events=kv_events, kv_transfer=kv_transfer, api_keys=api_keys,
                    allow_client_priority=args.allow_client_priority, request_timeout=args.request_timeout,
                    engine_stall_timeout=args.engine_stall_timeout or None, tool_parser=args.tool_call_parser,
                    enable_auto_tool_choice=args.enable_auto_tool_choice,
                    reasoning_parser=args.reasoning_parser, playground=not args.no_playground,
                    spawned=spawned, sampling_defaults=sampling_defaults, cors=cors_options(args),
                    request_id_headers=args.enable_request_id_headers,
                    log_stats_interval=args.log_stats_interval,
                    request_logger=RequestLogger.from_flags(args), chat_template=args.chat_template,
                    response_role=args.response_role, force_include_usage=args.enable_force_include_usage,
                    return_tokens_as_token_ids=args.return_tokens_as_token_ids, root_path=args.root_path,
                    lora_update_dirs=args.allow_runtime_lora_updating)  # fmt: skip
    config = uvicorn.Config(
        server.app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=5,
        access_log=not args.disable_uvicorn_access_log,
        **uvicorn_tls_options(args.tls, args.ssl_cert_reqs),
    )
    uv = DrainingServer(config, server.start_drain, lambda: server.state.draining, args.tls_watching)
    server.uvicorn = uv
    scheme = "https" if args.tls else "http"
    logger.info("ferry serve on %s://%s:%d (model %s)", scheme, args.host, sock.getsockname()[1], path)
    uv.run(sockets=[sock])
    if not uv.started and server.exit_code == 0:
        return 1  # the HTTP side did not start
    return server.exit_code
