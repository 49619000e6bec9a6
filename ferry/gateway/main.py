"""`ferry gateway` command line."""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from ferry.entrypoints.draining_server import DrainingServer
from ferry.entrypoints.openai.http_middleware import add_http_args, cors_options
from ferry.entrypoints.tls import (
    add_tls_args,
    add_worker_tls_args,
    server_tls,
    uvicorn_tls_options,
    watchers,
    worker_client_tls,
)
from ferry.gateway.app import Gateway, GatewayConfig
from ferry.gateway.policies import POLICIES, PolicyConfig
from ferry.gateway.replicas import MonitorConfig
from ferry.utils.deployment_secret import load_secret
from ferry.utils.network import UVICORN_LOG_LEVELS, port_number, server_socket

logger = logging.getLogger(__name__)


def add_gateway_args(p: argparse.ArgumentParser, workers_required: bool = True) -> None:
    if workers_required:
        p.add_argument("--worker", action="append", default=[], metavar="URL",
                       help="a ferry serve (or any OpenAI-compatible) replica; repeat for each")  # fmt: skip
        g = p.add_argument_group("prefill/decode disaggregation")
        g.add_argument("--prefill", action="append", default=[], metavar="[POOL=]URL",
                       help="a `ferry serve --role prefill` worker, optionally in a named pool (API keys pick "
                            "pools with their prefill_pool); repeat for each")  # fmt: skip
        g.add_argument("--decode", action="append", default=[], metavar="URL",
                       help="a `ferry serve --role decode` worker; repeat for each")  # fmt: skip
    p.add_argument("--pd-min-prefill-tokens", type=int, default=256,
                   help="disaggregated: prompts whose part not cached on the decode worker is shorter than this "
                        "are prefilled there")  # fmt: skip
    p.add_argument("--policy", choices=POLICIES, default="kv-aware")
    add_http_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8080)
    p.add_argument("--fd", type=int, default=None,
                   help="serve on this inherited, bound TCP socket instead of binding --host/--port (a launcher "
                        "that holds the port until the gateway has it)")  # fmt: skip
    if workers_required:  # under `ferry up`, --tokenizer is the engine flag (and the workers report it)
        p.add_argument("--tokenizer", default=None, help="tokenizer for prompt hashing (default: the workers' own)")
        p.add_argument("--trust-remote-code", action="store_true",
                       help="load a tokenizer that is its own Python code (an auto_map in its tokenizer_config.json), "
                            "as workers started with it do; without it their prompts are routed by load")  # fmt: skip
    p.add_argument("--max-retries", type=int, default=2, help="other workers to try when one fails before a byte")
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="require `Authorization: Bearer KEY`: one key per line, or JSON with per-key token limits, "
        "priorities, prefill pools and admin rights",
    )
    p.add_argument("--admin-key", default=None,
                   help="a key for /metrics, /gateway/workers and /gateway/state (default: $FERRY_ADMIN_KEY); "
                        "with --api-keys those need an admin key, of the file's or this one")  # fmt: skip
    p.add_argument("--share-prefix-cache", action="store_true",
                   help="let API keys share prefix-cache blocks (default: each key's requests carry its own "
                        "cache_salt, so cached_tokens and routing reveal nothing across keys)")  # fmt: skip
    p.add_argument("--no-dashboard", action="store_true",
                   help="serve no live dashboard at /dashboard (its data, /gateway/state, needs the admin "
                        "key)")  # fmt: skip
    p.add_argument("--no-worker-header", action="store_true",
                   help="do not name the serving worker in an `x-ferry-worker` response header")  # fmt: skip
    g = p.add_argument_group("result cache (deterministic requests: temperature 0 or a seed)")
    g.add_argument("--result-cache", action="store_true", help="answer repeated deterministic requests from a cache")
    g.add_argument("--result-cache-entries", type=int, default=1024)
    g.add_argument("--result-cache-bytes", type=int, default=64 << 20)
    g.add_argument("--result-cache-ttl", type=float, default=600.0, help="seconds")
    d, m = PolicyConfig(), MonitorConfig()
    g = p.add_argument_group("routing weights (kv-aware, prefix)")
    g.add_argument("--prefix-weight", type=float, default=d.prefix_weight, help="weight of the cached share (0..1)")
    g.add_argument("--load-weight", type=float, default=d.load_weight, help="weight of the relative load (0..1)")
    g.add_argument("--kv-usage-weight", type=float, default=d.kv_usage_weight, help="weight of KV usage (0..1)")
    g.add_argument(
        "--balance-abs",
        type=float,
        default=d.balance_abs,
        help="balance guard: route by load alone when the busiest worker has this many more requests",
    )
    g.add_argument("--balance-rel", type=float, default=d.balance_rel,
                   help="... and this factor more (+1 each) than the least busy")  # fmt: skip
    g = p.add_argument_group("health")
    g.add_argument("--scrape-interval", type=float, default=m.scrape_interval, help="seconds between /metrics scrapes")
    g.add_argument("--health-interval", type=float, default=m.health_interval, help="seconds between /health checks")
    g.add_argument("--failure-threshold", type=int, default=m.failure_threshold,
                   help="consecutive failures that take a worker out of its pool")  # fmt: skip
    g.add_argument("--cooldown", type=float, default=m.cooldown, help="seconds a failed worker stays out")
    p.add_argument("--kv-transfer-secret-file", default=None, metavar="PATH",
                   help="the deployment's shared secret, as given to its workers (>= 16 bytes; default: "
                        "$FERRY_KV_TRANSFER_SECRET): KV events count only with its HMAC, and prompts hash with "
                        "the salt the workers derive from it")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds requests in flight (streams too) get after SIGTERM; new ones get 503")  # fmt: skip
    g = p.add_argument_group("scale from zero")
    g.add_argument("--hold-timeout", type=float, default=0.0,
                   help="seconds a request waits for a worker of its model to become ready (while an autoscaler "
                        "starts one) before a 503; /ready then stays 200 with no worker (default 0: none "
                        "waits)")  # fmt: skip
    g.add_argument("--max-held-requests", type=int, default=256,
                   help="requests that may wait at once; more get a 503 at once")  # fmt: skip
    p.add_argument("--uvicorn-log-level", default="warning", choices=UVICORN_LOG_LEVELS)
    add_tls_args(p)
    if workers_required:  # `ferry up`'s workers are its own, on 127.0.0.1, over plain HTTP
        add_worker_tls_args(p)


def build_gateway(args: argparse.Namespace, workers: list[str], prefill: list[str] | None = None,
                  decode: list[str] | None = None, secret: bytes | None = None) -> Gateway:  # fmt: skip
    """`secret`: the deployment's (`ferry up` passes the one it made); default: the flag's or the env's."""
    if args.max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {args.max_retries}")
    for name in ("scrape_interval", "health_interval", "cooldown"):
        if getattr(args, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {getattr(args, name)}")
    if args.failure_threshold < 1:
        raise ValueError(f"failure_threshold must be >= 1, got {args.failure_threshold}")
    if args.drain_timeout < 0:
        raise ValueError(f"drain_timeout must be >= 0, got {args.drain_timeout}")
    if args.result_cache_entries < 1 or args.result_cache_bytes < 1 or args.result_cache_ttl <= 0:
        raise ValueError("--result-cache-entries, --result-cache-bytes and --result-cache-ttl must be positive")
    # The certificate files, loaded once to check them (before `ferry up` starts its workers).
    args.tls = server_tls(args)
    worker_tls = worker_client_tls(args) if hasattr(args, "worker_ssl_certfile") else (True, None)
    args.tls_watching = watchers(args, args.tls, worker_tls)
    config = GatewayConfig(
        workers,
        policy=args.policy,
        tokenizer=getattr(args, "tokenizer", None),
        max_retries=args.max_retries,
        api_keys_file=args.api_keys,
        trust_remote_code=getattr(args, "trust_remote_code", False),  # `ferry up`: the engine flag
        result_cache=args.result_cache,
        result_cache_entries=args.result_cache_entries,
        result_cache_bytes=args.result_cache_bytes,
        result_cache_ttl=args.result_cache_ttl,
        prefill=list(prefill or []),
        decode=list(decode or []),
        pd_min_prefill_tokens=args.pd_min_prefill_tokens,
        admin_key=args.admin_key or os.environ.get("FERRY_ADMIN_KEY") or None,
        share_prefix_cache=args.share_prefix_cache,
        worker_header=not args.no_worker_header,
        dashboard=not args.no_dashboard,
        hold_timeout=args.hold_timeout,
        max_held_requests=args.max_held_requests,
        drain_timeout=args.drain_timeout,
        kv_secret=secret if secret is not None else load_secret(args.kv_transfer_secret_file),
        cors=cors_options(args),
        request_id_headers=args.enable_request_id_headers,
        worker_verify=worker_tls[0],
    )
    monitor = MonitorConfig(args.scrape_interval, args.health_interval, args.failure_threshold, args.cooldown)
    policy = PolicyConfig(args.prefix_weight, args.load_weight, args.kv_usage_weight, args.balance_abs,
                          args.balance_rel)  # fmt: skip
    return Gateway(config, monitor, policy)


def gateway_server(gateway: Gateway, args: argparse.Namespace) -> DrainingServer:
    """The uvicorn server for `gateway`: SIGTERM drains it (Gateway.start_drain)."""
    config = uvicorn.Config(gateway.app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_keep_alive=5, timeout_graceful_shutdown=5,
                            **uvicorn_tls_options(args.tls, args.ssl_cert_reqs))  # fmt: skip
    server = DrainingServer(config, gateway.start_drain, lambda: gateway.draining, args.tls_watching)
    gateway.server = server
    return server


def run_gateway(args: argparse.Namespace) -> int:
    if not args.worker and not args.decode:
        raise ValueError("give --worker URLs, or --prefill and --decode URLs")
    sock = server_socket(args.host, args.port, args.fd)  # before anything else (utils/network.py)
    gateway = build_gateway(args, args.worker, args.prefill, args.decode)
    server = gateway_server(gateway, args)
    logger.info(
        "ferry gateway on %s://%s:%d over %s",
        "https" if args.tls else "http",
        args.host,
        sock.getsockname()[1],
        ", ".join(args.worker + [f"prefill {u}" for u in args.prefill] + [f"decode {u}" for u in args.decode]),
    )
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it has already handled
        pass
    return 0 if server.started else 1
