"""Scale from zero: requests that find no healthy worker for their model wait for one.

An autoscaler that takes a pool to zero replicas (KEDA's `minReplicaCount: 0`)
needs someone to take the next request while the first replica starts, and a
signal to start it. With `--hold-timeout S`, the gateway is that someone: a
request whose model has no healthy worker waits here, up to S seconds, until a
worker passes its health check (replicas.py wakes the room on every passed
check), and is then routed as usual; the requests waiting count in
`ferry_gateway_requests_held` and in `held` of `/gateway/state`, which the
autoscaler reads to start a replica. At most `capacity` requests wait at once
(an admitted, authenticated request holds a place; the rest get a 503 at once,
as does one still waiting when its time is up), and a client that leaves gives
its place back (the gateway cancels its routing, and with it the wait).

Without `--hold-timeout` (0) nothing waits: no healthy worker is a 503 at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import Counter, Gauge

READY, TIMED_OUT, FULL = "ready", "timeout", "full"


class WaitingRoom:
    def __init__(self, timeout: float, capacity: int, held: Gauge, outcomes: Counter) -> None:
        self.timeout, self.capacity = timeout, capacity
        self.held_gauge, self.outcomes = held, outcomes
        self.held = 0
        self._changed = asyncio.Event()

    @property
    def enabled(self) -> bool:
        return self.timeout > 0

    def worker_checked(self) -> None:
        """A worker passed a health check: every waiting request looks at its pool again."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(self, ready: Callable[[], bool]) -> str | None:
        """None once `ready()` holds (at once if it already does); else why not: TIMED_OUT, FULL, or
        "disabled" when nothing may wait."""
        if ready():
            return None
        if not self.enabled:
            return "disabled"
        if self.held >= self.capacity:
            self.outcomes.labels(FULL).inc()
            return FULL
        self.held += 1
        self.held_gauge.inc()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            while not ready():
                left = deadline - loop.time()
                if left <= 0:
                    self.outcomes.labels(TIMED_OUT).inc()
                    return TIMED_OUT
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
            self.outcomes.labels(READY).inc()
            return None
        finally:
            self.held -= 1
            self.held_gauge.dec()
