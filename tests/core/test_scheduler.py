"""Scheduler and KV-cache manager on tiny configs: exact blocks, budgets, priorities, preemption."""

import pytest

from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.request import Request, RequestStatus
from ferry.core.scheduler import Scheduler
from ferry.sampling_params import SamplingParams

BS = 4


def make(num_blocks=16, budget=64, max_seqs=8, caching=True, chunked=True):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    return kv, Scheduler(
        kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=1000, enable_chunked_prefill=chunked
    )


def req(rid, tokens, priority=0, arrival=0.0, max_tokens=100):
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=max_tokens),
        priority=priority,
        arrival_time=arrival,
        block_size=BS,
        max_tokens=max_tokens,
    )


def fake_step(sched, out, token=7):
    """What the engine does after a forward: append a token to requests whose prefill completed."""
    for r, _ in out.scheduled:
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(token)


def test_prefill_then_decode_exact_blocks():
    kv, s = make()
    a = req("a", list(range(10)))
    s.add_request(a)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 10)]
    assert kv.block_ids("a") == [0, 1, 2]
    fake_step(s, out)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1)]
    assert kv.block_ids("a") == [0, 1, 2]  # token 11 still fits in block 2
    for _ in range(2):
        fake_step(s, out)
        out = s.schedule()
    assert kv.block_ids("a") == [0, 1, 2, 3]  # 13th token opens block 3


def test_token_budget_chunks_prefill_and_mixes_decode():
    kv, s = make(budget=8)
    a, b = req("a", list(range(5)), arrival=0), req("b", list(range(100, 120)), arrival=1)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 5), ("b", 3)]
    fake_step(s, out)
    out = s.schedule()  # a decodes (1), b continues its prefill with the rest of the budget
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 7)]
    assert b.num_computed_tokens == 10


def test_no_chunking_waits_for_budget():
    kv, s = make(budget=8, chunked=False)
    s.add_request(req("a", list(range(12))))
    assert s.schedule().is_empty


def test_max_num_seqs():
    kv, s = make(max_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), [i] * 3, arrival=i))
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["0", "1"]
    assert [r.request_id for r in s.waiting] == ["2"]


def test_priority_then_fcfs():
    kv, s = make(max_seqs=3)
    s.add_request(req("late-low", [1, 2], priority=1, arrival=0))
    s.add_request(req("b", [3, 4], priority=0, arrival=2))
    s.add_request(req("a", [5, 6], priority=0, arrival=1))
    s.add_request(req("high", [7, 8], priority=-1, arrival=3))
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["high", "a", "b"]


def test_preempts_lowest_priority_latest_and_requeues():
    kv, s = make(num_blocks=6, budget=64)
    a = req("a", list(range(8)), priority=0, arrival=0)  # 2 blocks
    b = req("b", list(range(10, 18)), priority=0, arrival=1)  # 2 blocks
    c = req("c", list(range(20, 28)), priority=1, arrival=0)  # 2 blocks, lowest priority
    for r in (a, b, c):
        s.add_request(r)
    out = s.schedule()
    assert kv.pool.num_free_blocks == 0
    fake_step(s, out)
    out = s.schedule()  # a needs a 3rd block: c (priority 1) is the victim
    assert out.preempted == [c]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert list(s.waiting) == [c] and s.num_preemptions == 1
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b"]
    # c's blocks were freed tail first (5, then 4), so a gets 5 and b gets 4.
    assert kv.block_ids("a") == [0, 1, 5] and kv.block_ids("b") == [2, 3, 4]


def test_preemption_of_self_when_alone_lowest():
    kv, s = make(num_blocks=4)
    a = req("a", list(range(8)), arrival=0)
    b = req("b", list(range(10, 18)), arrival=1)
    s.add_request(a)
    s.add_request(b)
    fake_step(s, s.schedule())
    out = s.schedule()
    # a needs a block: b (later) is preempted; b would need one too but is gone.
    assert out.preempted == [b]
    assert [r.request_id for r, _ in out.scheduled] == ["a"]


def test_prefix_hits_share_blocks_and_count():
    kv, s = make()
    a = req("a", list(range(10)), arrival=0)
    s.add_request(a)
    fake_step(s, s.schedule())
    b = req("b", list(range(9)) + [99], arrival=1)
    s.add_request(b)
    out = s.schedule()
    # b reuses a's two full blocks and computes only its last 2 tokens.
    assert dict((r.request_id, n) for r, n in out.scheduled)["b"] == 2
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.pool.blocks[0].ref_cnt == 2
    assert b.num_cached_tokens == 8
    assert kv.prefix_hits == 8 and kv.prefix_queries == 10 + 10


def test_fully_cached_prompt_recomputes_last_block():
    kv, s = make()
    a = req("a", list(range(8)))
    s.add_request(a)
    fake_step(s, s.schedule())
    s.finish_request(a, RequestStatus.FINISHED_STOPPED)
    b = req("b", list(range(8)))
    s.add_request(b)
    out = s.schedule()
    assert out.scheduled == [(b, 4)] and b.num_cached_tokens == 4


def test_waiting_order_prefers_longest_cached_prefix_within_priority():
    kv, s = make(max_seqs=1)
    warm = req("warm", list(range(12)), arrival=0)
    s.add_request(warm)
    fake_step(s, s.schedule())
    s.finish_request(warm, RequestStatus.FINISHED_STOPPED)
    s.add_request(req("cold", [50, 51, 52, 53, 54], arrival=1))
    s.add_request(req("hot", list(range(12)) + [1], arrival=2))
    s.add_request(req("urgent", [60, 61], priority=-1, arrival=3))
    order = []
    while s.waiting:
        out = s.schedule()
        order.append(out.scheduled[0][0].request_id)
        s.finish_request(out.scheduled[0][0], RequestStatus.FINISHED_STOPPED)
    assert order == ["urgent", "hot", "cold"]


def test_abort_frees_everything():
    kv, s = make()
    reqs = [req(str(i), list(range(i * 10, i * 10 + 9)), arrival=i) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    fake_step(s, s.schedule())
    s.add_request(req("w", [1, 2, 3]))
    for r in list(s.requests):
        s.abort_request(r)
    assert not s.has_unfinished_requests()
    assert kv.pool.num_referenced() == 0 and kv.pool.num_free_blocks == kv.pool.num_blocks
    assert s.abort_request("nope") is None


def test_free_order_evicts_tail_first():
    kv, s = make(num_blocks=8)
    a = req("a", list(range(12)))
    s.add_request(a)
    fake_step(s, s.schedule())
    assert kv.block_ids("a") == [0, 1, 2]
    s.finish_request(a, RequestStatus.FINISHED_STOPPED)
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]


def test_duplicate_request_id_rejected():
    kv, s = make()
    s.add_request(req("a", [1]))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(req("a", [2]))


def test_max_loras_holds_other_adapters_back_and_passes_over_one_window_a_step():
    """max_loras=1: while adapter 0's request runs, adapter 1's wait (in their order) and a base
    request behind them runs; a step passes over at most one queue window of held-back requests,
    so a long queue of them costs no more. Once adapter 0's request ends, adapter 1's run."""
    kv = KVCacheManager(256, BS, enable_prefix_caching=True)
    s = Scheduler(kv, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1000, max_loras=1)
    first = req("a0", [1, 2, 3], arrival=0.0)
    first.lora_slot = 0
    s.add_request(first)
    fake_step(s, s.schedule())
    for i in range(40):  # adapter 1, then a base request behind 3 of them
        r = req(f"b{i}", [10 + i, 2, 3], arrival=1.0 + i)
        r.lora_slot = 1
        s.add_request(r)
    s.add_request(req("base", [9, 9, 9], arrival=3.5))
    taken = []
    real_take = s.waiting.take_next
    s.waiting.take_next = lambda cached=None: taken.append(1) or real_take(cached)
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["a0", "base"]
    assert len(taken) <= s.waiting.window + 1  # not one per waiting request
    assert len(s.waiting) == 40
    s.finish_request(first, RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert {r.request_id for r, _ in out.scheduled} >= {f"b{i}" for i in range(16)}
    assert all(r.lora_slot == 1 for r in s.running if r.request_id != "base")
