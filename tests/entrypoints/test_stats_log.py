"""The periodic engine log line (stats_log.py): vLLM's format, over the interval, quiet when idle."""

from __future__ import annotations

import logging

import pytest

from ferry.engine.messages import EngineStats
from ferry.entrypoints.openai.metrics import ServerMetrics
from ferry.entrypoints.openai.stats_log import StatsLog, log_stats_interval


def stats(queries=0, hits=0, running=0, waiting=0, usage=0.0, **spec) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=usage, num_kv_blocks=64,
                       prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=0, num_evictions=0,
                       **spec)  # fmt: skip


def test_a_line_reports_the_interval_not_the_totals():
    metrics = ServerMetrics("m")
    log = StatsLog(metrics)
    log.lines(100.0)  # the first interval starts here
    metrics.on_stats(stats(queries=400, hits=100, running=3, waiting=2, usage=0.25))
    metrics.on_prompt(400)
    metrics.on_tokens(1, None)
    metrics.on_tokens(49, 0.01)
    lines, active = log.lines(110.0)
    assert active and lines == [
        "Engine 000: Avg prompt throughput: 40.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 "
        "reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    ]
    metrics.on_stats(stats(queries=600, hits=300, running=1, usage=0.125))  # 200 more looked up, all found
    metrics.on_tokens(20, 0.01)
    lines, active = log.lines(115.0)
    assert active and "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 4.0 tokens/s" in lines[0]
    assert "Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 100.0%" in lines[0]
    lines, active = log.lines(125.0)
    assert not active and "Avg generation throughput: 0.0 tokens/s" in lines[0] and "hit rate: 0.0%" in lines[0]


def test_speculative_decoding_adds_vllms_second_line():
    metrics = ServerMetrics("m")
    log = StatsLog(metrics)
    log.lines(0.0)
    metrics.on_stats(stats(spec_num_drafts=10, spec_num_draft_tokens=30, spec_num_accepted_tokens=15,
                           spec_accepted_per_pos=[8, 5, 2]))  # fmt: skip
    lines, _ = log.lines(5.0)
    assert lines[1] == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 3.00 tokens/s, Drafted "
        "throughput: 6.00 tokens/s, Accepted: 15 tokens, Drafted: 30 tokens, Per-position acceptance rate: "
        "0.800, 0.500, 0.200, Avg Draft acceptance rate: 50.0%"
    )
    lines, _ = log.lines(10.0)
    assert len(lines) == 1  # no drafts verified in this interval


def test_info_while_tokens_flow_and_once_after_then_debug(caplog):
    metrics = ServerMetrics("m")
    log = StatsLog(metrics)
    caplog.set_level(logging.DEBUG, logger="ferry.stats")
    levels = []
    for tokens in (0, 5, 5, 0, 0):
        metrics.on_tokens(tokens, None)
        caplog.clear()
        log.log()
        levels.append(caplog.records[0].levelno)
    assert levels == [logging.DEBUG, logging.INFO, logging.INFO, logging.INFO, logging.DEBUG]


def test_the_interval_comes_from_the_environment():
    assert log_stats_interval({}) == 10.0
    assert log_stats_interval({"VLLM_LOG_STATS_INTERVAL": "2.5"}) == 2.5
    assert log_stats_interval({"FERRY_LOG_STATS_INTERVAL": "1", "VLLM_LOG_STATS_INTERVAL": "2.5"}) == 1.0
    for bad in ("0", "-3", "soon", "nan"):
        with pytest.raises(ValueError, match="FERRY_LOG_STATS_INTERVAL"):
            log_stats_interval({"FERRY_LOG_STATS_INTERVAL": bad})
    with pytest.raises(ValueError, match="^VLLM_LOG_STATS_INTERVAL must be"):
        log_stats_interval({"VLLM_LOG_STATS_INTERVAL": "0"})
