"""Real `ferry serve` and `ferry gateway` processes on 127.0.0.1 for tests, and raw-socket clients."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import httpx
import openai
import pytest

from ferry.bench.launch import LaunchedServer
from ferry.utils.network import free_port, reserve_port, reserve_ports

T = TypeVar("T")

# Servers that run beside each other (a gateway's replicas, PD workers) take one torch thread each: on
# two cores, OpenMP teams of two threads each spin at their barriers for a descheduled peer, and a burst
# of ten 24-token chats over two replicas took 3-17 s instead of 0.7 s (2026-11-30). A server whose
# outputs a test compares with this process's keeps the thread count it inherits (this process's): the
# order of a GEMM's sums, and so a near-tie's greedy token, can depend on it.
SIDE_BY_SIDE = {"OMP_NUM_THREADS": "1"}


class ServerProcess:
    def __init__(self, *args: str, ready_timeout: float = 180.0, env: dict[str, str] | None = None,
                 port: int | None = None, tls: ssl.SSLContext | None = None) -> None:  # fmt: skip
        # A port given: a replica coming back where it was. Else one held from the pick to the server
        # (`--fd`): another server's ZMQ socket or an outgoing connection could take a port let go.
        sock = None if port else reserve_ports(1)[0]
        self.port = port or sock.getsockname()[1]
        cmd = [sys.executable, "-m", "ferry.cli", "serve", "--port", str(self.port), *args]
        env = {"PYTHONUNBUFFERED": "1", **(env or {})}
        self.launched = LaunchedServer(cmd, self.port, "/ready", ready_timeout, env=env, sock=sock, tls=tls)
        self.log = self.launched.log
        try:
            self.url = self.launched.__enter__()
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{self.logs()}") from None
        self.proc = self.launched.proc

    def logs(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-5000:]

    def core_pid(self) -> int:
        """The EngineCore child (spawned with multiprocessing, so its cmdline names the spawn module)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in out:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ")
            if b"spawn_main" in cmdline:
                return int(pid)
        raise RuntimeError(f"no EngineCore child of {self.proc.pid} among {out}")

    def metric(self, name: str) -> float:
        """Sum of the samples of one metric family on /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        total, seen = 0.0, False
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
        if not seen:
            raise KeyError(name)
        return total

    def stop(self) -> int:
        self.launched.__exit__(None, None, None)
        return self.proc.returncode


class GatewayProcess:
    def __init__(self, workers: list[str], *flags: str, env: dict[str, str] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:  # fmt: skip
        sock, self.port = reserve_port()
        cmd = [sys.executable, "-m", "ferry.cli", "gateway", "--port", str(self.port), *flags]
        for w in workers:
            cmd += ["--worker", w]
        self.launched = LaunchedServer(cmd, self.port, "/ready", 60, env={"PYTHONUNBUFFERED": "1", **(env or {})},
                                       sock=sock, tls=tls)  # fmt: skip
        self.log = self.launched.log
        self.url = self.launched.__enter__()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.admin: dict[str, str] = {}  # the headers that let this test read /metrics

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(self.url + "/metrics", headers=self.admin, timeout=10).text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def logs(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-5000:]

    def stop(self) -> None:
        self.launched.__exit__(None, None, None)


def start_together(*starts: Callable[[], T]) -> list[T]:
    """Run several starts (`lambda: ServerProcess(...)`) at once and return what they started, in
    order: a start is mostly one process's imports and load, so on two cores overlapping them takes
    about half the time of one after another. If one fails, the others are stopped and its error raised."""
    pool = ThreadPoolExecutor(len(starts))
    futures = [pool.submit(start) for start in starts]
    started = False
    try:
        wait(futures)
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            raise failed[0]
        started = True
        return [f.result() for f in futures]
    finally:  # a start failed, or this thread was interrupted: stop whatever did start
        pool.shutdown(wait=True)  # (each start is bounded by its ready timeout)
        if not started:
            for f in futures:
                if f.exception() is None:
                    with contextlib.suppress(Exception):
                        f.result().stop()


def finished(server: ServerProcess, reason: str) -> float:
    """How many requests `server` has finished with `reason` (length, stop, abort)."""
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("ferry:request_success_total{") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(condition, what: str, timeout: float = 180.0, interval: float = 0.1) -> None:
    """Poll `condition()` until it is true; `timeout` only bounds a failure (it is not a speed check)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(interval)


def open_request(url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> socket.socket:
    """A POST sent over a raw socket whose response nobody has read yet: the test decides when the
    client goes away (`sock.close()`), which no HTTP client library lets it do mid-request."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=300)
    raw = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: {len(raw)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(head.encode() + b"\r\n" + raw)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    """What the socket received up to and including `marker` (an AssertionError if it closes first)."""
    got = b""
    while marker not in got:
        piece = sock.recv(65536)
        assert piece, f"the connection closed before {marker!r}: {got[:500]!r}"
        got += piece
    return got


@contextlib.contextmanager
def redis_server(password: str | None = None, tls_ca: str | None = None) -> Iterator[int]:
    """A real redis-server on a free 127.0.0.1 port (its port); skipped where none is installed,
    except under CI (`.ci/run` installs it). With `tls_ca` (a path to write): TLS only, with a
    certificate for 127.0.0.1 made by openssl beside it, signed by itself and written to `tls_ca`."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (.ci/run installs it)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    import redis

    port = free_port()
    args = ["--requirepass", password] if password else []
    ssl = {}
    if tls_ca:
        key = tls_ca + ".key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", tls_ca,
                        "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)  # fmt: skip
        args += ["--tls-port", str(port), "--tls-cert-file", tls_ca, "--tls-key-file", key, "--tls-ca-cert-file",
                 tls_ca, "--tls-auth-clients", "no"]  # fmt: skip
        ssl = {"ssl": True, "ssl_ca_certs": tls_ca}
    plain_port = "0" if tls_ca else str(port)
    proc = subprocess.Popen([binary, "--port", plain_port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             *args], stdout=subprocess.DEVNULL)  # fmt: skip
    client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=5, **ssl)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"redis-server on port {port} did not answer")
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def path_prefix_proxy(target: str, prefix: str) -> Iterator[str]:
    """A reverse proxy on 127.0.0.1 that serves `target` under the path `prefix` and strips it on the
    way (an ingress with a rewrite, `kubectl proxy`): its base URL. Bodies and streams pass through
    as they come; other paths are 404s."""
    import asyncio
    import threading

    import aiohttp
    from aiohttp import web

    hop_by_hop = {"host", "content-length", "transfer-encoding", "connection"}  # (bodies pass as sent, encoded or not)
    loop = asyncio.new_event_loop()
    state: dict = {}

    async def forward(request: web.Request) -> web.StreamResponse:
        path = request.rel_url.path_qs
        if not path.startswith(prefix + "/"):
            return web.Response(status=404, text="outside the prefix")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in hop_by_hop}
        async with state["session"].request(request.method, target + path[len(prefix):], headers=headers,
                                            data=await request.read(), allow_redirects=False) as upstream:  # fmt: skip
            kept = {k: v for k, v in upstream.headers.items() if k.lower() not in hop_by_hop}
            response = web.StreamResponse(status=upstream.status, headers=kept)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def start() -> None:
        state["session"] = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        state["runner"] = runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state["port"] = runner.addresses[0][1]

    async def stop() -> None:
        await state["runner"].cleanup()
        await state["session"].close()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield f"http://127.0.0.1:{state['port']}{prefix}"
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
