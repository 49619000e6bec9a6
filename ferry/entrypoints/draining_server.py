"""uvicorn where SIGTERM means "drain", for `ferry serve` and `ferry gateway`.

Kubernetes, systemd and `ferry up` stop a process with SIGTERM and expect the
requests in flight to finish: plain uvicorn stops listening at once and gives
them `timeout_graceful_shutdown` seconds. Here the first SIGTERM calls the
owner's `start_drain` on the event loop instead (readiness turns 503, new
requests get 503, the owner sets `should_exit` once its in-flight requests
are done or its drain timeout has passed); a second signal stops at once, and
a SIGINT (Ctrl-C) stops as uvicorn does, a second one without waiting.

It also runs --enable-ssl-refresh's certificate watchers (tls.py) while it serves: uvicorn makes the
server's SSLContext as it starts, so they get it then.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

import uvicorn

from ferry.entrypoints.tls import Watching
from ferry.utils.network import allow_rebind


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, start_drain: Callable[[], None], draining: Callable[[], bool],
                 watching: Watching | None = None) -> None:  # fmt: skip
        super().__init__(config)
        self.start_drain, self.draining = start_drain, draining
        self.watching = watching
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)  # sockets from utils/network.py set SO_REUSEADDR as they listen
        for sock in sockets or ():
            # An event loop that listens on the descriptor itself (uvloop, when installed) never calls
            # ServerSocket.listen: then set here, once listening (a connection made in between lacks it).
            allow_rebind(sock)
        if self.watching is not None and not self.should_exit:
            c = self.config
            self.watching.start(c.ssl, lambda files: uvicorn.config.create_ssl_context(
                files.certfile, files.keyfile, c.ssl_keyfile_password, c.ssl_version, c.ssl_cert_reqs, files.ca_certs,
                c.ssl_ciphers))  # fmt: skip

    async def shutdown(self, sockets=None) -> None:
        if self.watching is not None:
            await self.watching.stop()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit or self.draining():
            self.force_exit = sig == signal.SIGINT  # a second Ctrl-C stops without waiting
            self.should_exit = True
        elif sig == signal.SIGTERM and self.loop is not None:
            self.loop.call_soon_threadsafe(self.start_drain)
        else:
            self.should_exit = True


async def wait_drained(in_flight: Callable[[], int], timeout: float) -> int:
    """Wait until `in_flight()` is 0 or `timeout` seconds have passed; what is still in flight."""
    deadline = time.monotonic() + timeout
    while in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return in_flight()
