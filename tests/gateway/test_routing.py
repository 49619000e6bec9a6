"""Routing logic on hand-built worker states: policies, balance guard, the prefix index, the KV index."""

import pytest

from ferry.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from ferry.gateway.kv_index import KVIndex
from ferry.gateway.policies import PolicyConfig, Router
from ferry.gateway.prefix_index import PrefixIndex
from ferry.gateway.replicas import MonitorConfig, Worker, parse_load_metrics


def workers(*loads: int) -> list[Worker]:
    return [Worker(f"http://w{i}", in_flight=n, reachable=True) for i, n in enumerate(loads)]


def test_round_robin_cycles_and_least_load_picks_the_idlest():
    ws = workers(0, 0, 0)
    rr = Router("round-robin")
    assert [rr.choose(ws).worker.url for _ in range(4)] == ["http://w0", "http://w1", "http://w2", "http://w0"]
    ll = Router("least-load")
    assert ll.choose(workers(3, 1, 2)).worker.url == "http://w1"
    # The worker's own queue counts when it is larger than what the gateway sent it.
    ws = workers(0, 1)
    ws[0].waiting = 5
    assert ll.choose(ws).worker.url == "http://w1"


def test_kv_aware_prefers_the_cached_prefix_until_load_outweighs_it():
    r = Router("kv-aware", PolicyConfig(balance_abs=100))
    d = r.choose(workers(2, 0), num_prompt_blocks=10, overlaps=[10, 0])
    assert d.worker.url == "http://w0" and d.reason == "prefix-overlap" and d.overlap == 1.0
    # A small overlap does not beat a large load difference.
    assert r.choose(workers(6, 0), num_prompt_blocks=10, overlaps=[1, 0]).worker.url == "http://w1"
    # No overlap anywhere: the less loaded worker.
    d = r.choose(workers(3, 1), num_prompt_blocks=10, overlaps=[0, 0])
    assert d.worker.url == "http://w1" and d.reason == "no-overlap"
    # KV usage breaks a tie.
    ws = workers(0, 0)
    ws[0].kv_usage = 0.9
    assert r.choose(ws, num_prompt_blocks=4, overlaps=[0, 0]).worker.url == "http://w1"


def test_balance_guard_needs_both_thresholds():
    r = Router("kv-aware", PolicyConfig(balance_abs=4, balance_rel=2.0))
    # 6 vs 0: 6 more (> 4) and 7x (> 2x): by load alone, even though w0 holds the prefix.
    d = r.choose(workers(6, 0), num_prompt_blocks=4, overlaps=[4, 0])
    assert d.worker.url == "http://w1" and d.reason == "balance-guard"
    # 14 vs 9: 5 more but only 1.5x: the guard stays off and the prefix wins.
    assert r.choose(workers(14, 9), num_prompt_blocks=4, overlaps=[4, 0]).reason == "prefix-overlap"
    # 3 vs 0: 4x but only 3 more: off.
    assert r.choose(workers(3, 0), num_prompt_blocks=4, overlaps=[4, 0]).reason == "prefix-overlap"


def test_router_rejects_unknown_policy_and_empty_pool():
    with pytest.raises(ValueError, match="policy must be one of"):
        Router("random")
    with pytest.raises(ValueError):
        Router("least-load").choose([])


def test_prefix_index_overlap_insert_and_lru_keeps_chain_heads():
    idx = PrefixIndex(max_blocks=4)
    idx.insert([b"a", b"b", b"c"], "w0")
    assert idx.overlap([b"a", b"b", b"x"], "w0") == 2
    assert idx.overlap([b"a", b"b"], "w1") == 0
    idx.insert([b"d", b"e"], "w1")  # 5 blocks > 4: the oldest, the tail "c" of w0's chain, goes
    assert len(idx) == 4
    assert idx.overlap([b"a", b"b", b"c"], "w0") == 2
    assert idx.overlap([b"d", b"e"], "w1") == 2
    idx.forget_worker("w1")
    assert idx.overlap([b"d"], "w1") == 0 and len(idx) == 2


def test_kv_index_applies_events_in_order():
    idx = KVIndex()
    idx.reset(5, [b"a"])
    idx.apply(KVEventBatch(6, 0.0, [BlockStored([b"b", b"c"], b"a")]))
    assert idx.overlap([b"a", b"b", b"c", b"d"]) == 3 and idx.seq == 6
    idx.apply(KVEventBatch(7, 0.0, [BlockRemoved([b"b"])]))
    assert idx.overlap([b"a", b"b", b"c"]) == 1  # a hole ends the prefix
    idx.apply(KVEventBatch(8, 0.0, [AllBlocksCleared()]))
    assert idx.hashes == set() and idx.seq == 8


def test_parse_load_metrics_and_circuit_breaker():
    text = (
        "# HELP ferry:num_requests_waiting x\n"
        'ferry:num_requests_waiting{model_name="m"} 3.0\n'
        'ferry:num_requests_running{model_name="m"} 2.0\n'
        'ferry:kv_cache_usage_perc{model_name="m"} 0.25\n'
        'ferry:num_requests_waiting_other{model_name="m"} 9.0\n'
        'ferry:prefix_cache_queries_total{model_name="m"} 400.0\n'
        'ferry:prefix_cache_queries_created{model_name="m"} 1.7e9\n'
        'ferry:prefix_cache_hits_total{model_name="m"} 100.0\n'
    )
    assert parse_load_metrics(text) == {"waiting": 3.0, "running": 2.0, "kv_usage": 0.25, "prefix_queries": 400.0,
                                        "prefix_hits": 100.0}  # fmt: skip
    w = Worker("http://w", reachable=True)
    cfg = MonitorConfig(failure_threshold=2, cooldown=60)
    w.record_failure("boom", cfg)
    assert w.healthy
    w.record_failure("boom", cfg)
    assert not w.healthy  # open for the cooldown, even though the worker still answers
    w.record_success()
    assert not w.healthy  # a passing probe does not cut the cooldown short
    w.open_until -= 61  # the cooldown has passed
    assert w.healthy
    w.reachable = False  # ... but only a worker whose last probe answered is back in its pool
    assert not w.healthy


def test_kv_index_counts_just_routed_prompts_until_events_confirm_or_time_out():
    now = [0.0]
    idx = KVIndex(clock=lambda: now[0])
    idx.add_pending([b"a", b"b"])
    assert idx.overlap([b"a", b"b", b"c"]) == 2  # routed here a moment ago: its prefill is under way
    idx.apply(KVEventBatch(1, 0.0, [BlockStored([b"a"], None)]))
    assert b"a" not in idx.pending and idx.overlap([b"a", b"b"]) == 2
    now[0] += 11  # "b" never arrived (evicted before it was published, or the request failed)
    assert idx.overlap([b"a", b"b"]) == 1 and b"b" not in idx.pending


def test_what_runs_whole_on_a_decode_worker():
    """Bodies a prefill/decode split cannot serve run where they decode, each with its reason."""
    from ferry.gateway.disagg import why_not_disaggregated

    assert why_not_disaggregated({"prompt": "Hi"}, "completions") is None
    for data, kind, why in (({"input": "x"}, "embeddings", "an embedding"), ({"query": "q"}, "rerank", "an embedding"),
                            ({"prompt": "Hi", "use_beam_search": True, "n": 2}, "completions", "beam search"),
                            ({"messages": [], "use_beam_search": True}, "chat", "beam search")):  # fmt: skip
        assert why_not_disaggregated(data, kind) == why
