"""A real `ferry serve` process on 127.0.0.1 for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, ready_timeout: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="ferry-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "ferry.cli", "serve", "--port", str(self.port), *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ferry serve exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"ferry serve not ready after {timeout}s:\n{self.logs()}")

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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
