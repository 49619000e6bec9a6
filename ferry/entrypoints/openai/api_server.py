"""`ferry serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

This process validates, tokenizes, detokenizes and streams; the model runs in
the EngineCore process (see `ferry/engine/core_proc.py`). Probes:
`/health` (liveness: this process answers and the core answers a ping),
`/ready` (503 until the model is loaded and warmed, and while draining).
OpenAI's /v1/completions, /v1/chat/completions, /v1/embeddings and /v1/models, and vLLM's
`/tokenize`, `/detokenize` and `/version`. `/` is a chat playground (web/, unless
`--no-playground`): static files that call /v1/chat/completions like any client.
SIGTERM drains: readiness turns 503, new requests get 503, in-flight
requests get `--drain-timeout` seconds to finish, then the server exits 0.
If the core dies, readiness turns 503 and the server exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
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
    KV_DEFAULT_ALLOWED_RECEIVERS,
    KV_ROLES,
    KV_TRANSPORTS,
    EngineArgs,
    KVEventsConfig,
    KVTransferConfig,
)
from ferry.core.kv_events import HASH_ALGORITHM, TOPIC
from ferry.engine.async_llm import AsyncLLM, EngineStalledError
from ferry.engine.core_client import EngineDeadError
from ferry.entrypoints.draining_server import DrainingServer, wait_drained
from ferry.entrypoints.openai import serving_tokenization
from ferry.entrypoints.openai.metrics import ServerMetrics
from ferry.entrypoints.openai.protocol import (
    OFFLOAD_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    OpenAIError,
    PromptLimits,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    decode_json_object,
    precheck_body,
    precheck_raw,
    read_body,
    validate_body,
)
from ferry.entrypoints.openai.reasoning import REASONING_PARSERS
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
from ferry.entrypoints.openai.tool_parsers import TOOL_PARSERS
from ferry.kv_transfer.allowed_receivers import allow_list
from ferry.models.paths import resolve_model_path
from ferry.tokenizer import load_tokenizer
from ferry.utils.bearer import key_digest, match_digest
from ferry.utils.deployment_secret import load_secret
from ferry.utils.web_pages import WebPages

logger = logging.getLogger("ferry.server")
# Outside /v1/ but behind --api-key too: they cost the server work (probes and /metrics stay open).
_KEYED_PATHS = frozenset({"/reset_prefix_cache", "/tokenize", "/detokenize"})


def _version() -> str:
    """The installed distribution's version (not `ferry.__version__`: importing the package's
    root would, to the import linter, pull the engine into this process)."""
    try:
        return importlib.metadata.version("ferry")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _decode(raw: bytes, limits: PromptLimits) -> dict:
    precheck_raw(raw, lambda _model: limits)  # millions of token ids refused before they are built
    data = decode_json_object(raw)
    precheck_body(data, limits)
    return data


async def _parse(request: Request, model: type, limits: PromptLimits) -> Any:
    raw = await read_body(request)
    if len(raw) <= OFFLOAD_BYTES:
        return validate_body(_decode(raw, limits), model)
    data = await asyncio.to_thread(_decode, raw, limits)
    return await asyncio.to_thread(validate_body, data, model)


class Server:
    """The app, its engine and its lifecycle (start, drain, die)."""

    def __init__(self, engine_args: EngineArgs, served_model_names: list[str], *, max_queue_len: int,
                 drain_timeout: float, kv_events: KVEventsConfig | None = None,
                 kv_transfer: KVTransferConfig | None = None, api_keys: list[str] | None = None,
                 allow_client_priority: bool = False, request_timeout: float | None = None,
                 engine_stall_timeout: float | None = None, tool_parser: str | None = None,
                 enable_auto_tool_choice: bool = False, reasoning_parser: str | None = None,
                 playground: bool = True) -> None:  # fmt: skip
        self.engine_args = engine_args
        self.playground = WebPages("ferry.entrypoints", "web") if playground else None
        self.kv_events = kv_events
        self.kv_transfer = kv_transfer
        self.api_keys = [key_digest(k) for k in api_keys or []]
        self.engine_stall_timeout = engine_stall_timeout
        self.state = ServerState(served_model_names, max_queue_len, allow_client_priority, request_timeout,
                                 tool_parser=tool_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                                 reasoning_parser=reasoning_parser)  # fmt: skip
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
                          kv_transfer=self.kv_transfer, stall_timeout=self.engine_stall_timeout)  # fmt: skip
        engine.on_dead = self._on_engine_dead
        self.state.engine = engine
        try:
            await engine.start(tokenizer_loader=lambda: load_tokenizer(self.engine_args.tokenizer or self.model_path))
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
        yield
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
                # Probes, metrics and /ferry/info stay open (kubelets and Prometheus carry no key).
                path = request.url.path
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

        @app.exception_handler(Exception)
        async def _internal_error(request: Request, exc: Exception):
            return _error_response(as_openai_error(exc))  # logs the exception with the id it answers

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

        @app.get("/v1/models")
        async def models() -> Response:
            engine = state.engine
            max_len = engine.info.max_model_len if engine is not None and engine.info is not None else None
            data = [
                {"id": name, "object": "model", "created": 0, "owned_by": "ferry", "root": self.model_path,
                 "max_model_len": max_len}
                for name in state.served_model_names
            ]  # fmt: skip
            return JSONResponse({"object": "list", "data": data})

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
                "block_size": i.block_size,
                "num_kv_blocks": i.num_kv_blocks,
                "max_model_len": i.max_model_len,
                "prefix_caching": self.engine_args.enable_prefix_caching,
                "block_hash": HASH_ALGORITHM,
                "block_hash_salt": i.block_hash_salt,  # the fingerprint of the deployment's salt, or None
                "kv_events": events,
                "role": i.kv_role,
                "kv_transfer": {"sends_by": i.kv_transfer, "receiver": i.kv_receiver, "redis": i.kv_redis},
                "startup_seconds": i.startup_seconds,  # `ferry bench startup`
            })  # fmt: skip

        async def generate(request: Request, body_type: type, handler) -> Response:
            engine = ready_engine(state)  # 503 before reading a body this server cannot serve yet
            try:
                body = await _parse(request, body_type, state.prompt_limits(engine))
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

        app.openapi = partial(_openapi_with_bodies, app, {"/v1/completions": CompletionRequest,
                                                          "/v1/chat/completions": ChatCompletionRequest,
                                                          "/v1/embeddings": EmbeddingRequest})  # fmt: skip
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


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file or HF model directory (default: the bundled SmolLM2); with "
                        "--load-format dummy, also a config-only directory or a shipped config name")  # fmt: skip
    p.add_argument("--model", default=None, help="same as the positional MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, help="names clients use (default: MODEL)")
    p.add_argument("--max-queue-len", type=int, default=1024,
                   help="answer 429 past this many sequences (prompts x n) waiting for their first token")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    p.add_argument("--api-key", nargs="+", default=None,
                   help="require `Authorization: Bearer <key>` (one of these) on /v1/* (default: $FERRY_API_KEY); "
                        "probes and /metrics stay open")  # fmt: skip
    p.add_argument("--allow-client-priority", action="store_true",
                   help="let requests set `priority` (else only 0 is taken: a client could jump every queue); "
                        "`ferry gateway` sets it per API key")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take, queueing included, before it is aborted with a 504")  # fmt: skip
    p.add_argument("--engine-stall-timeout", type=float, default=30.0,
                   help="seconds the engine core may go without finishing a step or sending a heartbeat before "
                        "/ready turns 503 and its requests fail with 503 (0: never)")  # fmt: skip
    p.add_argument("--uvicorn-log-level", default="warning")
    p.add_argument("--no-playground", action="store_true",
                   help="serve no chat playground at / (it holds no secrets: it calls /v1/* with the key typed "
                        "in)")  # fmt: skip
    g = p.add_argument_group("tools and reasoning")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='take tool_choice "auto" (the default with tools): the model decides, and --tool-call-parser '
                        "reads its calls out of the text")  # fmt: skip
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the model's tool-call format: hermes (<tool_call> JSON: Hermes, Qwen2.5, Qwen3), "
                        "llama3_json (Llama 3.1+), mistral ([TOOL_CALLS])")  # fmt: skip
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split <think>...</think> off into reasoning_content (Qwen3, DeepSeek-R1); structured "
                        "output and tool grammars then apply after the reasoning")  # fmt: skip
    p.add_argument(
        "--enable-kv-events",
        action="store_true",
        help="publish KV-cache events over ZMQ for the gateway's kv-aware routing (see /ferry/info)",
    )
    p.add_argument("--kv-events-host", default=None, help="address to publish on (default: --host)")
    p.add_argument("--kv-events-port", type=int, default=0, help="PUB port (0: any free one)")
    p.add_argument("--kv-events-replay-port", type=int, default=0, help="replay port (0: any free one)")
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--role", choices=KV_ROLES, default="both",
                   help="prefill: compute prompts and send their KV blocks (at most one token per request); "
                        "decode: receive KV blocks and generate; both: either (default)")  # fmt: skip
    g.add_argument("--kv-transfer", choices=KV_TRANSPORTS, default=None,
                   help="how this worker sends KV blocks: tcp (ZMQ, across hosts), shm (shared memory, same "
                        "host), redis (a shared store, needs --redis-url)")  # fmt: skip
    g.add_argument("--kv-transfer-host", default=None, help="where the KV receiver listens (default: --host)")
    g.add_argument("--kv-transfer-port", type=int, default=0, help="KV receiver port (0: any free one)")
    g.add_argument("--kv-transfer-dtype", choices=("auto", "int8"), default="auto",
                   help="KV in transit: auto (the cache's dtype) or int8 (per-vector scales)")  # fmt: skip
    g.add_argument("--kv-transfer-timeout", type=float, default=10.0, help="seconds for every KV-transfer wait")
    g.add_argument("--kv-transfer-secret-file", default=None, metavar="PATH",
                   help="the deployment's shared secret (>= 16 bytes; default: $FERRY_KV_TRANSFER_SECRET): "
                        "every KV-transfer message and KV-event batch carries an HMAC with it (others are "
                        "dropped), Redis values are sealed with it, and block hashes salted")  # fmt: skip
    g.add_argument("--kv-transfer-allowed-receivers", nargs="+", default=list(KV_DEFAULT_ALLOWED_RECEIVERS),
                   metavar="NET[:PORT]",
                   help="decode receivers this worker may push to when a request names one: IP networks, "
                        "addresses or host names, each optionally with :PORT (default: loopback only)")  # fmt: skip
    g.add_argument("--redis-url", default=None,
                   help="redis://host:port/db: a shared KV-block store; new requests pull the prompt blocks "
                        "missing here from it (default: $FERRY_REDIS_URL, which keeps a password out of the "
                        "process list)")  # fmt: skip
    g.add_argument("--redis-ttl", type=float, default=600.0, help="seconds a block stays in Redis")
    g.add_argument("--redis-max-memory", default=None,
                   help="set the Redis server's maxmemory (e.g. 2gb) with allkeys-lru eviction")  # fmt: skip


def default_served_name(model: str | None, path: str) -> str:
    if model:
        return model
    name = os.path.basename(path)
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def serve(args: argparse.Namespace) -> int:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model_tag or args.model
    engine_args = EngineArgs.from_cli_args(args)
    if args.max_queue_len < 1:
        raise ValueError(f"max_queue_len must be >= 1, got {args.max_queue_len}")
    if args.drain_timeout < 0:
        raise ValueError(f"drain_timeout must be >= 0, got {args.drain_timeout}")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError(f"request_timeout must be > 0, got {args.request_timeout}")
    if args.engine_stall_timeout < 0:
        raise ValueError(f"engine_stall_timeout must be >= 0, got {args.engine_stall_timeout}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    api_keys = args.api_key or ([os.environ["FERRY_API_KEY"]] if os.environ.get("FERRY_API_KEY") else None)
    path = resolve_model_path(engine_args.model, engine_args.load_format)  # FileNotFoundError: a clear message, exit 2
    names = args.served_model_name or [default_served_name(engine_args.model, path)]
    secret = load_secret(args.kv_transfer_secret_file)  # the deployment's (utils/deployment_secret.py)
    kv_events = None
    if args.enable_kv_events:
        kv_events = KVEventsConfig(args.kv_events_host or args.host, args.kv_events_port, args.kv_events_replay_port,
                                   secret=secret)  # fmt: skip
    kv_transfer = None
    redis_url = args.redis_url or os.environ.get("FERRY_REDIS_URL") or None
    if args.role != "both" or args.kv_transfer or redis_url:
        kv_transfer = KVTransferConfig(
            role=args.role, transport=args.kv_transfer, host=args.kv_transfer_host or args.host,
            port=args.kv_transfer_port, redis_url=redis_url, redis_ttl=args.redis_ttl,
            redis_max_memory=args.redis_max_memory, encoding="int8" if args.kv_transfer_dtype == "int8" else "raw",
            timeout=args.kv_transfer_timeout, secret=secret,
            allowed_receivers=tuple(args.kv_transfer_allowed_receivers),
        )  # fmt: skip
        kv_transfer.validate()  # ValueError: a clear message, exit 2
        allow_list(kv_transfer.allowed_receivers)  # ValueError naming a bad entry
    server = Server(engine_args, names, max_queue_len=args.max_queue_len, drain_timeout=args.drain_timeout,
                    kv_events=kv_events, kv_transfer=kv_transfer, api_keys=api_keys,
                    allow_client_priority=args.allow_client_priority, request_timeout=args.request_timeout,
                    engine_stall_timeout=args.engine_stall_timeout or None, tool_parser=args.tool_call_parser,
                    enable_auto_tool_choice=args.enable_auto_tool_choice,
                    reasoning_parser=args.reasoning_parser, playground=not args.no_playground)  # fmt: skip
    config = uvicorn.Config(
        server.app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=5,
    )
    uv = DrainingServer(config, server.start_drain, lambda: server.state.draining)
    server.uvicorn = uv
    logger.info("ferry serve on http://%s:%d (model %s)", args.host, args.port, path)
    uv.run()
    if not uv.started and server.exit_code == 0:
        return 1  # could not bind the port
    return server.exit_code
