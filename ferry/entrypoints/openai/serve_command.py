"""`ferry serve`'s command line: its flags, their checks, and the order the server starts in.

The engine core is spawned as soon as the flags are checked, before this process imports its HTTP
side (FastAPI, the API's pydantic models, uvicorn, the OpenAI serving code; api_server.py): the
core's own start (torch, the weights, the warm-up) is the longer way to /ready, and the two
processes now start side by side. So this module imports nothing heavy (every `ferry` command
builds these flags too).
"""

from __future__ import annotations

import argparse
import os

from ferry.config import (
    KV_DEFAULT_ALLOWED_RECEIVERS,
    KV_ROLES,
    KV_TRANSPORTS,
    EngineArgs,
    KVEventsConfig,
    KVTransferConfig,
)
from ferry.engine.core_client import spawn_engine_core
from ferry.entrypoints.openai.chat_template import load_chat_template
from ferry.entrypoints.openai.http_middleware import add_http_args
from ferry.entrypoints.openai.reasoning import REASONING_PARSERS
from ferry.entrypoints.openai.stats_log import log_stats_interval
from ferry.entrypoints.openai.tool_parsers import TOOL_PARSERS
from ferry.entrypoints.tls import add_tls_args, server_tls, watchers
from ferry.kv_transfer.allowed_receivers import allow_list
from ferry.models.generation_config import sampling_defaults
from ferry.models.paths import resolve_model_path
from ferry.sampling_params import SamplingParams
from ferry.utils.deployment_secret import load_secret
from ferry.utils.json_args import json_object
from ferry.utils.network import UVICORN_LOG_LEVELS, port_number, server_socket


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file or HF model directory (default: the bundled SmolLM2); with "
                        "--load-format dummy, also a config-only directory or a shipped config name")  # fmt: skip
    p.add_argument("--model", default=None, help="same as the positional MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--fd", type=int, default=None,
                   help="serve on this inherited, bound TCP socket instead of binding --host/--port (a launcher "
                        "that holds the port until the server has it: `ferry up`)")  # fmt: skip
    p.add_argument("--served-model-name", nargs="+", default=None, help="names clients use (default: MODEL)")
    p.add_argument("--max-queue-len", type=int, default=1024,
                   help="answer 429 past this many sequences (prompts x n) waiting for their first token")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    p.add_argument("--api-key", nargs="+", default=None,
                   help="require `Authorization: Bearer <key>` (one of these) on /v1/* (default: $FERRY_API_KEY, else "
                        "$VLLM_API_KEY); "
                        "probes and /metrics stay open")  # fmt: skip
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="vLLM's: priority lets requests carry a `priority` (lower first), as "
                        "--allow-client-priority does; fcfs refuses a nonzero one (ties run first come, first "
                        "served either way)")  # fmt: skip
    p.add_argument("--allow-client-priority", action="store_true",
                   help="let requests set `priority` (else only 0 is taken: a client could jump every queue); "
                        "`ferry gateway` sets it per API key")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take, queueing included, before it is aborted with a 504")  # fmt: skip
    p.add_argument("--engine-stall-timeout", type=float, default=30.0,
                   help="seconds the engine core may go without finishing a step or sending a heartbeat before "
                        "/ready turns 503 and its requests fail with 503 (0: never)")  # fmt: skip
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for requests that leave them unset: auto (the model's "
                        "generation_config.json, as vLLM), vllm (none: temperature 1, ...), or a directory "
                        "with a generation_config.json")  # fmt: skip
    p.add_argument("--override-generation-config", type=json_object, default=None, metavar="JSON",
                   help="sampling defaults set over --generation-config's, in generation_config.json's names, "
                        "e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 1024}' (vLLM's)")  # fmt: skip
    p.add_argument("--uvicorn-log-level", default="warning", choices=UVICORN_LOG_LEVELS)
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no line per HTTP request from uvicorn (it logs them at --uvicorn-log-level info)")  # fmt: skip
    p.add_argument("--root-path", default="",
                   help="the path prefix a path-based proxy serves this server under (e.g. /llm): requests come "
                        "with it or without it (vLLM's; FastAPI's root_path)")  # fmt: skip
    p.add_argument(
        "--response-role",
        default="assistant",
        help="the role of a chat answer that follows a generation prompt (vLLM's; default assistant)",
    )
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token `token_id:<id>` (exact whatever its text; a request's own "
                        "return_tokens_as_token_ids wins)")  # fmt: skip
    p.add_argument("--allow-runtime-lora-updating", nargs="+", default=None, metavar="DIR",
                   help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's) for adapters in these "
                        "directories (a path elsewhere is refused); needs --enable-lora")  # fmt: skip
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="end every stream with its usage chunk, whether or not the request asked "
                        "(stream_options.include_usage)")  # fmt: skip
    # vLLM's flags for what ferry does always: accepted, so a vLLM command line runs unchanged.
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="accepted for vLLM's command lines: ferry serves no /docs or /redoc pages anyway")  # fmt: skip
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="accepted for vLLM's command lines: usage.prompt_tokens_details.cached_tokens is always "
                        "reported")  # fmt: skip
    add_tls_args(p)
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's prompt and sampling parameters as it is added (users' data: off by "
                        "default, as in vLLM)")  # fmt: skip
    p.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM's older flag for what is now the default: no request log")  # fmt: skip
    p.add_argument("--enable-log-outputs", action="store_true",
                   help="log each finished choice's text and token ids")  # fmt: skip
    p.add_argument("--max-log-len", type=int, default=None,
                   help="characters of text, or token ids, the request log shows of a prompt or output (default: "
                        "all)")  # fmt: skip
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic engine log line (throughputs, running and waiting requests, KV usage, "
                        "prefix hit rate) every $FERRY_LOG_STATS_INTERVAL seconds (default 10)")  # fmt: skip
    add_http_args(p)
    p.add_argument("--no-playground", action="store_true",
                   help="serve no chat playground at / (it holds no secrets: it calls /v1/* with the key typed "
                        "in)")  # fmt: skip
    p.add_argument("--chat-template", default=None,
                   help="the Jinja chat template for /v1/chat/completions, instead of the tokenizer's: a file, or "
                        "the template itself (vLLM's flag)")  # fmt: skip
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


def api_keys_from(flag: list[str] | None, env) -> list[str] | None:
    """The keys /v1/* requires: --api-key, else $FERRY_API_KEY, else vLLM's $VLLM_API_KEY (a
    deployment moved from `vllm serve` must not lose its key silently); None: no key."""
    env_key = env.get("FERRY_API_KEY") or env.get("VLLM_API_KEY")
    return flag or ([env_key] if env_key else None)


def check_runtime_lora_updating(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    """--allow-runtime-lora-updating's directories, resolved in place (serving_lora.py compares
    resolved paths with them); ValueError for a setup that cannot load adapters at run time."""
    dirs = args.allow_runtime_lora_updating
    if dirs is None:
        if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"):
            raise ValueError("VLLM_ALLOW_RUNTIME_LORA_UPDATING: ferry loads adapters at run time only from "
                             "directories it is given: --allow-runtime-lora-updating DIR [DIR ...]")  # fmt: skip
        return
    if not engine_args.enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    if engine_args.tensor_parallel_size > 1:
        raise ValueError("--allow-runtime-lora-updating: under tensor parallelism adapters load at start "
                         "(--lora-modules)")  # fmt: skip
    for d in dirs:
        if not os.path.isdir(d):
            raise ValueError(f"--allow-runtime-lora-updating: {d!r} is not a directory")
    args.allow_runtime_lora_updating = [os.path.realpath(d) for d in dirs]


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
    api_keys = api_keys_from(args.api_key, os.environ)
    args.allow_client_priority = args.allow_client_priority or args.scheduling_policy == "priority"
    args.tls = server_tls(args)  # the certificate files, loaded once to check them; ValueError: exit 2
    args.tls_watching = watchers(args, args.tls)  # --enable-ssl-refresh's
    args.chat_template = load_chat_template(args.chat_template)  # the text; ValueError: exit 2
    args.log_stats_interval = None if args.disable_log_stats else log_stats_interval()  # ValueError: exit 2
    if args.enable_log_requests and args.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each other")
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise ValueError(f"--root-path must start with / and not end with one (e.g. /llm), got {args.root_path!r}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"max_log_len must be >= 0, got {args.max_log_len}")
    path = resolve_model_path(engine_args.model, engine_args.load_format)  # FileNotFoundError: a clear message, exit 2
    defaults = sampling_defaults(path, args.generation_config, args.override_generation_config)  # ValueError: exit 2
    try:  # a default out of range would fail every request that leaves the field unset: fail here instead
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(
            f"the sampling defaults of the model's generation_config.json (--generation-config "
            f"vllm ignores it) and --override-generation-config: {e}"
        ) from None
    names = args.served_model_name or [default_served_name(engine_args.model, path)]
    for name, lora_path in engine_args.lora_adapters:  # checked whole by the core as it loads them
        if name in names:
            raise ValueError(f"--lora-modules: {name!r} is also a served model name; give the adapter another")
        if not os.path.isfile(os.path.join(lora_path, "adapter_config.json")):
            raise ValueError(f"--lora-modules: {lora_path!r} has no adapter_config.json (a PEFT LoRA adapter's)")
    check_runtime_lora_updating(args, engine_args)
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
    # The port before anything else: a taken one fails now, not after the model has loaded, and no
    # socket the core binds at random (KV events, KV transfer) can take it meanwhile. Listened on
    # when the HTTP side is up: until then clients are refused.
    sock = server_socket(args.host, args.port, args.fd)  # ValueError: a taken port, exit 2
    # Then the core: it loads the model while this process imports its HTTP side.
    spawned = spawn_engine_core(engine_args, kv_events, kv_transfer)
    from ferry.entrypoints.openai.api_server import run_server

    return run_server(args, engine_args, names, path, kv_events, kv_transfer, api_keys, sock, spawned, defaults)
