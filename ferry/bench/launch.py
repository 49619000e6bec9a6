"""Start a server process for a benchmark, wait until it answers, stop it afterwards."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from ferry.utils.network import handed_over


class LaunchedServer:
    """`with LaunchedServer(cmd, port, ready_path="/ready") as url:`. The server's output goes to a temp
    file, removed when the server stopped cleanly and the block raised nothing; else kept, and named on
    stderr (every benchmark run left one behind before: thousands of them in /tmp)."""

    def __init__(self, cmd: list[str], port: int, ready_path: str = "/health", timeout: float = 600.0,
                 env: dict[str, str] | None = None, sock: socket.socket | None = None,
                 tls: ssl.SSLContext | None = None) -> None:  # fmt: skip
        """`sock`: the port already bound here (utils/network.py reserve_ports), handed to the server
        (`--fd`, which `ferry serve` and `ferry gateway` take) so nothing can take it meanwhile.
        `tls`: the server speaks HTTPS (its --ssl-certfile); what the readiness poll checks it with."""
        self.cmd, self.port, self.ready_path, self.timeout = cmd, port, ready_path, timeout
        self.sock, self.tls = sock, tls
        self.env = {**os.environ, **(env or {})}
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="ferry-bench-server-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        sock, self.sock = self.sock, None
        with handed_over(self.cmd, sock) as (cmd, fds):
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, pass_fds=fds)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()  # kept: it says why
                raise RuntimeError(f"{self.cmd[0]} exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2, context=self.tls) as r:
                    if r.status == 200:
                        return self.url
            except (urllib.error.URLError, OSError):
                pass
            # ~0.25 s sooner on average than at 0.5 s. A poll is a refused connection until the server
            # listens, then a 503 answered in ~1 ms while the model loads.
            time.sleep(0.05)
        self._stop()
        self.log.close()
        raise RuntimeError(f"{self.cmd[0]} not ready after {self.timeout}s; log: {self.log.name}")

    def _stop(self) -> bool:
        """Stop the server (SIGINT, then SIGKILL after 30 s); whether it ended cleanly: exited 0 or of
        that SIGINT."""
        if self.proc is None:
            return False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return False
        return self.proc.returncode in (0, -signal.SIGINT)

    def __exit__(self, exc_type, *exc) -> None:
        clean = self._stop()
        self.log.close()
        if clean and exc_type is None:
            os.unlink(self.log.name)
        else:
            print(f"{self.cmd[0]} log kept: {self.log.name}", file=sys.stderr)
