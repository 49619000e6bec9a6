"""`ferry up --replicas N`: N `ferry serve` replicas and a gateway over them, on this machine.

`ferry up --pd P:D` instead starts P prefill and D decode workers (`--role`,
KV blocks over `--kv-transfer`, tcp by default) and a disaggregating gateway.

The replicas start as child processes (with KV events on, for the kv-aware
policy), each given the engine flags of this command and its port as a socket
this process bound and hands over (`--fd`: nothing else can take the port
between the pick and the replica's start); when all are ready the gateway
runs in this process, on the port it bound first. This process supervises them:

- they die with it, also when it is SIGKILLed and runs no cleanup (Linux's
  parent-death signal, set in each child before it runs);
- one that exits is started again on its port after a backoff (1 s, doubling
  to 60 s; back to 1 s once a replica has stayed up a minute), while the
  gateway routes around it (its health checks take it out and bring it back);
- the CPUs this process may use are split among them: each gets its own
  slice (affinity) and as many OpenMP threads as the slice has CPUs, since
  N replicas each spinning a thread per core thrash (3 replicas x 2 threads on
  2 cores took a routing benchmark from 4 to 14 minutes).

SIGTERM drains the gateway (streams in flight finish, new requests get 503,
up to --drain-timeout), then sends SIGTERM to every replica (they drain too)
and waits for them; Ctrl-C stops without the gateway's drain.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import partial

from ferry.config import EngineArgs
from ferry.gateway.main import add_gateway_args, build_gateway, gateway_server
from ferry.utils.deployment_secret import load_secret
from ferry.utils.network import handed_over, reserve_ports, server_socket
from ferry.utils.process import die_with_parent

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


def cpu_slices(cpus: list[int], n: int) -> list[list[int]]:
    """`cpus` split into `n` contiguous slices as even as can be; with fewer CPUs than replicas,
    replica i gets CPU i mod len(cpus)."""
    if n > len(cpus):
        return [[cpus[i % len(cpus)]] for i in range(n)]
    size, extra = divmod(len(cpus), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append(cpus[start:end])
        start = end
    return out


def _child_setup(cpus: list[int]) -> None:
    """Runs in each replica between fork and exec."""
    die_with_parent()  # also when `ferry up` is SIGKILLed
    os.sched_setaffinity(0, cpus)


BACKOFF_FIRST, BACKOFF_MAX, STABLE_AFTER = 1.0, 60.0, 60.0  # seconds
WORKER_KEY_VARIABLES = ("FERRY_API_KEY", "VLLM_API_KEY")  # `ferry serve`'s defaults for --api-key


class Replicas:
    """`ferry serve` processes, one per command, each with its `--port P` in its command. Where
    `sockets` gives replica i's port already bound (utils/network.py reserve_ports), its first
    start takes that socket (`--fd`) and this process closes its copy; a start again binds P."""

    def __init__(self, cmds: list[list[str]], urls: list[str], env: dict[str, str] | None = None,
                 log_files: list | None = None, split_cpus: bool = True,
                 sockets: list[socket.socket] | None = None) -> None:  # fmt: skip
        self.cmds, self.urls = cmds, urls
        self.handoff: list[socket.socket | None] = list(sockets) if sockets else [None] * len(cmds)
        # Not the API-key variables: the replicas listen on loopback behind the gateway, which holds the
        # keys (--api-keys) and calls them without one; a key in the shell (VLLM_API_KEY from a `vllm
        # serve` setup) would turn every health check and request into a 401.
        self.env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in WORKER_KEY_VARIABLES}
        self.log_files = log_files  # one open file per replica for its output (default: ours)
        self.procs: list[subprocess.Popen] = []
        self.cpus: list[list[int] | None] = [None] * len(cmds)
        if split_cpus and hasattr(os, "sched_getaffinity"):
            self.cpus = cpu_slices(sorted(os.sched_getaffinity(0)), len(cmds))
        self.started_at: list[float] = []
        self.backoff = [BACKOFF_FIRST] * len(cmds)
        self.restarts = [0] * len(cmds)
        self.stopping = False

    def _spawn(self, i: int) -> subprocess.Popen:
        out = self.log_files[i] if self.log_files else None
        env, cpus = self.env, self.cpus[i]
        if cpus is not None and "OMP_NUM_THREADS" not in env:  # the operator's setting wins
            env = {**env, "OMP_NUM_THREADS": str(len(cpus))}
        setup = partial(_child_setup, cpus) if cpus is not None else die_with_parent
        sock, self.handoff[i] = self.handoff[i], None  # a start again binds the port by number
        with handed_over(self.cmds[i], sock) as (cmd, fds):
            # Own process group: a terminal's Ctrl-C reaches us, and we stop them in order.
            return subprocess.Popen(cmd, start_new_session=True, env=env, stdout=out, stderr=out, preexec_fn=setup,
                                    pass_fds=fds)  # fmt: skip

    def start(self, timeout: float) -> None:
        for i in range(len(self.cmds)):
            self.procs.append(self._spawn(i))
            self.started_at.append(time.monotonic())
            if self.cpus[i] is not None:
                logger.info("replica %s on CPUs %s", self.urls[i], self.cpus[i])
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
                # 0.5 s added ~0.25 s to every start; a poll is a refused connection, or a 503 answered
                # in ~1 ms while the replica loads
                time.sleep(0.05)

    async def supervise(self, interval: float = 0.5) -> None:
        """Start again, after a backoff, every replica that exits while we are not stopping. Runs
        on the gateway's event loop, in the main thread: the parent-death signal is tied to the
        thread that forked, so a helper thread that ended would take its children with it."""
        restart_at: dict[int, float] = {}
        while not self.stopping:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for i, proc in enumerate(self.procs):
                if self.stopping or proc.poll() is None:
                    continue
                if i not in restart_at:
                    if now - self.started_at[i] >= STABLE_AFTER:
                        self.backoff[i] = BACKOFF_FIRST  # it ran fine for a while: not a crash loop
                    restart_at[i] = now + self.backoff[i]
                    logger.warning("replica %s exited with %s; starting it again in %.0fs", self.urls[i],
                                   proc.returncode, self.backoff[i])  # fmt: skip
                    self.backoff[i] = min(self.backoff[i] * 2, BACKOFF_MAX)
                elif now >= restart_at[i]:
                    del restart_at[i]
                    self.procs[i] = self._spawn(i)
                    self.started_at[i] = now
                    self.restarts[i] += 1
                    logger.info("replica %s started again (pid %d, restart %d)", self.urls[i], self.procs[i].pid,
                                self.restarts[i])  # fmt: skip

    def stop(self, timeout: float = 60.0) -> None:
        self.stopping = True
        for sock in self.handoff:
            if sock is not None:
                sock.close()
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
    # Every port is ours before any worker starts: the gateway's bound, the workers' reserved and
    # handed to them. A port picked and let go, a starting worker's ZMQ sockets (bound at random
    # from the same range) could take (seen in CI: a worker's readiness poll got a ZMTP greeting).
    gateway_sock = server_socket(args.host, args.port, args.fd)
    worker_socks = reserve_ports(len(roles))
    ports = [s.getsockname()[1] for s in worker_socks]
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
    # The deployment's secret keys the workers' KV transfers and KV events and salts every block hash
    # (utils/deployment_secret.py): the operator's (a file, or the environment), or one made here
    # that never leaves these processes' environments.
    secret = load_secret(args.kv_transfer_secret_file)
    if args.kv_transfer_secret_file:
        cmds = [[*cmd, "--kv-transfer-secret-file", args.kv_transfer_secret_file] for cmd in cmds]
        env = None
    else:
        if secret is None:
            secret = secrets.token_hex(32).encode()
        env = {"FERRY_KV_TRANSFER_SECRET": secret.decode()}
    if args.pd:
        gateway = build_gateway(args, [], [u for u, r in zip(urls, roles) if r == "prefill"],
                                [u for u, r in zip(urls, roles) if r == "decode"], secret=secret)  # fmt: skip
    else:
        gateway = build_gateway(args, urls, secret=secret)
    replicas = Replicas(cmds, urls, env=env, sockets=worker_socks)
    # Until the gateway runs, SIGTERM (Kubernetes, systemd, kill) stops the start like Ctrl-C does;
    # then the gateway's server drains on it (DrainingServer).
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        replicas.start(args.replica_ready_timeout)
        gateway.also_run.append(replicas.supervise)
        server = gateway_server(gateway, args)
        logger.info("ferry up: gateway on %s://%s:%d, %s (%s)", "https" if args.tls else "http", args.host,
                    gateway_sock.getsockname()[1],
                    f"{args.pd} prefill:decode workers" if args.pd else f"{args.replicas} replicas",
                    args.policy)  # fmt: skip
        server.run(sockets=[gateway_sock])
        return 0 if server.started else 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    finally:
        replicas.stop()
