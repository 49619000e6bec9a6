"""The server's periodic engine log line, as vLLM's (`--disable-log-stats` turns it off).

Every FERRY_LOG_STATS_INTERVAL seconds (vLLM's VLLM_LOG_STATS_INTERVAL is read too; default 10):

    Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.0 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

(one line), and with speculative decoding a `SpecDecoding metrics:` line after it. Throughputs and
the hit rate are over the interval; running, waiting and the KV usage are the core's latest. Logged
at INFO while tokens flow and once after they stop (the line that says they did), at DEBUG while
idle, so an idle server does not fill its log. Everything comes from what ServerMetrics already
receives: the core's running totals (EngineStats) and the tokens the API process streamed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ferry.engine.messages import EngineStats

if TYPE_CHECKING:  # serve_command.py reads the interval before the HTTP side (and prometheus_client) loads
    from ferry.entrypoints.openai.metrics import ServerMetrics

logger = logging.getLogger("ferry.stats")

DEFAULT_INTERVAL = 10.0


def log_stats_interval(env=os.environ) -> float:
    """Seconds between two lines: $FERRY_LOG_STATS_INTERVAL, else $VLLM_LOG_STATS_INTERVAL, else 10."""
    name = "FERRY_LOG_STATS_INTERVAL" if env.get("FERRY_LOG_STATS_INTERVAL") else "VLLM_LOG_STATS_INTERVAL"
    raw = env.get(name)
    if not raw:
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {raw!r}")
    return value


# Before the core's first stats: nothing counted yet.
_NO_STATS = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_kv_blocks=0, prefix_cache_queries=0,
                        prefix_cache_hits=0, num_preemptions=0, num_evictions=0)  # fmt: skip


@dataclass(frozen=True)
class _Snapshot:
    """The running totals at one moment; a line is the difference of two."""

    at: float
    prompt_tokens: int
    generation_tokens: int
    stats: EngineStats  # the core's latest (its counters are running totals too)


class StatsLog:
    def __init__(self, metrics: ServerMetrics, engine_index: int = 0) -> None:
        self.metrics = metrics
        self.engine_index = engine_index
        self._prev = self._snapshot(time.monotonic())
        self._was_active = False

    def _snapshot(self, now: float) -> _Snapshot:
        m = self.metrics
        return _Snapshot(now, m.prompt_tokens_total, m.generation_tokens_total, m.last_stats or _NO_STATS)

    def lines(self, now: float) -> tuple[list[str], bool]:
        """The lines for the interval since the last call, and whether tokens flowed in it."""
        cur, prev = self._snapshot(now), self._prev
        self._prev = cur
        s, p = cur.stats, prev.stats
        seconds = max(cur.at - prev.at, 1e-9)
        prompt = cur.prompt_tokens - prev.prompt_tokens
        generation = cur.generation_tokens - prev.generation_tokens
        queries, hits = s.prefix_cache_queries - p.prefix_cache_queries, s.prefix_cache_hits - p.prefix_cache_hits
        out = [
            f"Engine {self.engine_index:03d}: Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {generation / seconds:.1f} tokens/s, Running: {s.num_running} reqs, "
            f"Waiting: {s.num_waiting} reqs, KV cache usage: {s.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        ]
        drafts = s.spec_num_drafts - p.spec_num_drafts
        if drafts:
            drafted = s.spec_num_draft_tokens - p.spec_num_draft_tokens
            accepted = s.spec_num_accepted_tokens - p.spec_num_accepted_tokens
            before = p.spec_accepted_per_pos
            per_pos = [
                (n - (before[i] if i < len(before) else 0)) / drafts for i, n in enumerate(s.spec_accepted_per_pos)
            ]
            out.append(
                f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted throughput: {accepted / seconds:.2f} tokens/s, "
                f"Drafted throughput: {drafted / seconds:.2f} tokens/s, Accepted: {accepted} tokens, "
                f"Drafted: {drafted} tokens, Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
                f"Avg Draft acceptance rate: {100 * accepted / drafted if drafted else 0.0:.1f}%"
            )
        return out, bool(prompt or generation)

    def log(self, now: float | None = None) -> None:
        out, active = self.lines(time.monotonic() if now is None else now)
        level = logging.INFO if active or self._was_active else logging.DEBUG
        self._was_active = active
        for line in out:
            logger.log(level, "%s", line)

    async def run(self, interval: float) -> None:
        """Log every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            self.log()
