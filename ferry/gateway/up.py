"""`ferry up --replicas N`: N `ferry serve` replicas and a gateway over them, on this machine.

`ferry up --pd P:D` instead starts P prefill and D decode workers (`--role`,
KV blocks over `--kv-transfer`, tcp by default) and a disaggregating gateway.

The replicas start as child processes on free ports (with KV events on, for
the kv-aware policy), each given the engine flags of this command; when all
are ready the gateway runs in this process. Ctrl-C or SIGTERM stops the
gateway, then sends SIGTERM to every replica (they drain) and waits for them.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import uvicorn

from ferry.config import EngineArgs
from ferry.gateway.main import add_gateway_args, build_gateway
from ferry.utils.network import free_ports

logger = logging.getLogger(__name__)


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file or HF model directory (default: the bundled SmolLM2)")  # fmt: skip
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--pd", default=None, metavar="P:D",
                   help="disaggregated: P prefill and D decode workers instead of --replicas")  # fmt: skip
    p.add_argument("--kv-transfer", choices=("tcp", "shm", "redis"), default="tcp", help="with --pd")
    p.add_argument("--redis-url", default=None, help="with --pd and --kv-transfer redis")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: the model's)")
    p.add_argument("--replica-ready-timeout", type=float, default=300.0)
    add_gateway_args(p, workers_required=False)
    EngineArgs.add_cli_args(p)


class Replicas:
    def __init__(self, cmds: list[list[str]], urls: list[str], env: dict[str, str] | None = None,
                 log_files: list | None = None) -> None:  # fmt: skip
        self.cmds, self.urls = cmds, urls
        self.env = {**os.environ, **(env or {})}
        self.log_files = log_files  # one open file per replica for its output (default: ours)
        self.procs: list[subprocess.Popen] = []

    def start(self, timeout: float) -> None:
        for i, cmd in enumerate(self.cmds):
            out = self.log_files[i] if self.log_files else None
            # Own process group: a terminal's Ctrl-C reaches us, and we stop them in order.
            self.procs.append(subprocess.Popen(cmd, start_new_session=True, env=self.env, stdout=out, stderr=out))
        deadline = time.monotonic() + timeout
        pending = set(range(len(self.procs)))
        while pending:
            for i in list(pending):
                if self.procs[i].poll() is not None:
                    raise RuntimeError(f"replica {self.urls[i]} exited with {self.procs[i].returncode} while starting")
                try:
                    with urllib.request.urlopen(self.urls[i] + "/ready", timeout=2) as r:
                        if r.status == 200:
                            pending.discard(i)
                            logger.info("replica %s ready", self.urls[i])
                except (urllib.error.URLError, OSError):
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"replicas not ready after {timeout:.0f}s: {[self.urls[i] for i in pending]}")
            if pending:
                time.sleep(0.5)

    def stop(self, timeout: float = 60.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def run_up(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {args.replicas}")
    args.model = args.model_tag
    eargs = EngineArgs.from_cli_args(args)  # validates the engine flags before anything starts
    roles = ["both"] * args.replicas
    if args.pd:
        try:
            num_p, num_d = (int(x) for x in args.pd.split(":"))
        except ValueError:
            raise ValueError(f"--pd expects P:D (e.g. 1:2), got {args.pd!r}") from None
        if num_p < 1 or num_d < 1:
            raise ValueError("--pd needs at least one prefill and one decode worker")
        if args.kv_transfer == "redis" and not args.redis_url:
            raise ValueError("--kv-transfer redis needs --redis-url")
        roles = ["prefill"] * num_p + ["decode"] * num_d
    ports = free_ports(len(roles), exclude=frozenset({args.port}))  # the gateway's own port too
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    cmds = []
    for port, role in zip(ports, roles):
        cmd = [sys.executable, "-m", "ferry.cli", "serve", *([args.model] if args.model else []),
               "--port", str(port), "--enable-kv-events", *eargs.to_cli_flags(),
               "--allow-client-priority"]  # the gateway is the client: it sets each API key's priority  # fmt: skip
        if args.served_model_name:
            cmd += ["--served-model-name", args.served_model_name]
        if role != "both":
            cmd += ["--role", role]
            if role == "prefill":
                cmd += ["--kv-transfer", args.kv_transfer]
            if args.redis_url:
                cmd += ["--redis-url", args.redis_url]
        cmds.append(cmd)
    if args.pd:
        gateway = build_gateway(args, [], [u for u, r in zip(urls, roles) if r == "prefill"],
                                [u for u, r in zip(urls, roles) if r == "decode"])  # fmt: skip
    else:
        gateway = build_gateway(args, urls)
    # The workers' KV transfers carry an HMAC with this deployment's secret: the operator's, or one
    # made here (it never leaves these processes' environments).
    secret = os.environ.get("FERRY_KV_TRANSFER_SECRET") or secrets.token_hex(32)
    replicas = Replicas(cmds, urls, env={"FERRY_KV_TRANSFER_SECRET": secret} if args.pd else None)
    # SIGTERM (Kubernetes, systemd, kill) stops the gateway like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        replicas.start(args.replica_ready_timeout)
        config = uvicorn.Config(gateway.app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                timeout_keep_alive=5, timeout_graceful_shutdown=5)  # fmt: skip
        server = uvicorn.Server(config)
        logger.info("ferry up: gateway on http://%s:%d, %s (%s)", args.host, args.port,
                    f"{args.pd} prefill:decode workers" if args.pd else f"{args.replicas} replicas",
                    args.policy)  # fmt: skip
        server.run()
        return 0 if server.started else 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    finally:
        replicas.stop()
