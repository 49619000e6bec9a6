"""The gateway's registry of replicas: each one's models, health, load and circuit breaker.

(`Worker` is the gateway's name for a replica, as in `--worker URL`; the
engine's tensor-parallel rank processes are another thing, ferry/distributed.)

A monitor task per worker scrapes `/metrics` every `scrape_interval` (queue
depth, running requests, KV usage, prefix-cache hits) and checks `/health` + `/v1/models` every
`health_interval`. The circuit breaker opens after `failure_threshold`
consecutive failures (probes, or routed requests that could not connect or got
a 5xx before any byte) and keeps the worker out of every pool for `cooldown`
seconds; after that it is back as soon as a health check passes. A request
is served by a pool: the healthy workers of some roles that list its model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from ferry.gateway.background import BackgroundTask

logger = logging.getLogger(__name__)


@dataclass
class MonitorConfig:
    scrape_interval: float = 0.25
    health_interval: float = 1.0
    failure_threshold: int = 3
    cooldown: float = 5.0
    timeout: float = 5.0


@dataclass
class Worker:
    url: str
    role: str = "both"  # both | prefill | decode (disaggregated serving, gateway/disagg.py)
    prefill_pool: str | None = None  # a prefill worker's pool name (`--prefill NAME=URL`)
    models: set[str] = field(default_factory=set)
    info: dict | None = None  # /ferry/info, when the worker is a ferry serve
    # Load: requests the gateway has in flight here, and what /metrics last said.
    started_at: float = 0.0  # its process's start (/metrics process_start_time_seconds): a change is a restart
    in_flight: int = 0
    reserved: int = 0  # decode requests chosen for it whose prefill hop runs (sent once it is done)
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    # Its prefix cache's lifetime counters (prompt tokens looked up, found), for the dashboard.
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    # Health.
    reachable: bool = False  # the last probe answered
    consecutive_failures: int = 0
    open_until: float = 0.0  # circuit open (out of the pool) until this monotonic time
    last_error: str | None = None

    @property
    def healthy(self) -> bool:
        return self.reachable and time.monotonic() >= self.open_until

    @property
    def load(self) -> float:
        """Requests this worker has to get through: the gateway's own in-flight count, or the
        worker's running + waiting if other clients use it too (whichever is larger), and the
        decode requests on their way to it (prefill hops: seconds before they count as in flight)."""
        return max(float(self.in_flight), self.running + self.waiting) + self.reserved

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.reachable = True

    def record_failure(self, why: str, config: MonitorConfig) -> None:
        self.consecutive_failures += 1
        self.last_error = why
        if self.consecutive_failures >= config.failure_threshold and time.monotonic() >= self.open_until:
            self.open_until = time.monotonic() + config.cooldown
            logger.warning("worker %s out of the pool for %.0fs: %s", self.url, config.cooldown, why)


_METRICS = {
    "ferry:num_requests_waiting": "waiting",
    "ferry:num_requests_running": "running",
    "ferry:kv_cache_usage_perc": "kv_usage",
    "ferry:prefix_cache_queries_total": "prefix_queries",
    "ferry:prefix_cache_hits_total": "prefix_hits",
    "process_start_time_seconds": "started_at",
}


def parse_load_metrics(text: str) -> dict[str, float]:
    """Sum each load gauge (and prefix-cache counter) over its label sets (one model per replica, so
    one sample each)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        attr = _METRICS.get(name)
        if attr is not None:
            try:
                out[attr] = out.get(attr, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return out


def pool(workers: list[Worker], model: str, roles: tuple[str, ...] = ("both",)) -> tuple[list[Worker], bool]:
    """(healthy workers of these roles serving `model`, whether any worker ever advertised it)."""
    known = [w for w in workers if model in w.models]
    return [w for w in known if w.healthy and w.role in roles], bool(known)


class WorkerMonitor(BackgroundTask):
    """Keeps one Worker's health and load current."""

    def __init__(self, worker: Worker, client: httpx.AsyncClient, config: MonitorConfig,
                 on_passed: Callable[[], None] | None = None) -> None:  # fmt: skip
        super().__init__(f"monitor {worker.url}")
        self.worker, self.client, self.config = worker, client, config
        self.on_passed = on_passed  # called after every passed health check (waiting_room.py listens)
        self.first_check = asyncio.Event()

    async def _run(self) -> None:
        next_health = 0.0
        while True:
            now = time.monotonic()
            if now >= next_health:
                await self.check_health()
                self.first_check.set()
                next_health = now + self.config.health_interval
            elif self.worker.reachable:
                await self.scrape()
            await asyncio.sleep(self.config.scrape_interval)

    async def check_health(self) -> None:
        w = self.worker
        try:
            r = await self.client.get(w.url + "/health", timeout=self.config.timeout)
            if r.status_code != 200 or r.json().get("status") != "ok":
                raise RuntimeError(f"/health answered {r.status_code} {r.text[:200]}")
            models = await self.client.get(w.url + "/v1/models", timeout=self.config.timeout)
            models.raise_for_status()
            w.models = {m["id"] for m in models.json().get("data", [])}
            if w.info is None:
                w.started_at = 0.0  # the info read now is the running process's: no restart to tell apart
                await self.read_info()
            await self.scrape()
        except Exception as e:  # any failure to answer is the worker's problem, not the gateway's
            if w.reachable or w.consecutive_failures == 0:
                logger.warning("worker %s failed its health check: %s", w.url, e)
            w.reachable = False
            w.record_failure(f"health check: {e}", self.config)
            return
        if not w.reachable:
            logger.info("worker %s is healthy (models %s)", w.url, sorted(w.models))
        w.record_success()  # an open circuit still waits out its cooldown
        if self.on_passed is not None:
            self.on_passed()

    async def scrape(self) -> None:
        w = self.worker
        try:
            r = await self.client.get(w.url + "/metrics", timeout=self.config.timeout)
            r.raise_for_status()
        except Exception as e:
            w.last_error = f"/metrics: {e}"
            return
        values = parse_load_metrics(r.text)
        started = values.pop("started_at", 0.0)
        for attr, value in values.items():
            setattr(w, attr, value)
        if started != w.started_at:
            if w.started_at != 0.0 and w.info is not None:
                # Back between two health checks: its KV-event and KV-receiver ports are new ones.
                logger.info("worker %s restarted: reading its /ferry/info again", w.url)
                w.info = None
            w.started_at = started
        if w.info is None and w.reachable:  # restarted (and perhaps still loading: then None still)
            try:
                await self.read_info()
            except Exception as e:
                w.last_error = f"/ferry/info: {e}"

    async def read_info(self) -> None:
        """/ferry/info: the ports and cache geometry of a ferry serve ({} for another server); left
        None while it loads (503), to be read again."""
        w = self.worker
        info = await self.client.get(w.url + "/ferry/info", timeout=self.config.timeout)
        if info.status_code != 503:
            w.info = info.json() if info.status_code == 200 else {}
