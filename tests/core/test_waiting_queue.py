"""The waiting queue: (priority, arrival) order, cache-aware within its window, O(window) probes per admission."""

from ferry.core.request import Request
from ferry.core.waiting_queue import WaitingQueue
from ferry.sampling_params import SamplingParams


def req(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(), priority=priority, arrival_time=arrival, block_size=4,
                   max_tokens=8)  # fmt: skip


def test_priority_then_arrival_without_a_cache():
    q = WaitingQueue()
    for r in [req("late", 0, 3.0), req("urgent", -1, 9.0), req("early", 0, 1.0), req("low", 5, 0.0)]:
        q.push(r)
    assert [r.request_id for r in q] == ["urgent", "early", "late", "low"]
    assert [q.take_next().request_id for _ in range(4)] == ["urgent", "early", "late", "low"]
    assert q.take_next() is None and not q


def test_cached_prefix_wins_within_the_window_and_the_best_priority_only():
    q = WaitingQueue(window=3)
    for i in range(5):
        q.push(req(f"r{i}", 0, float(i)))
    q.push(req("urgent", -1, 10.0))
    hits = {"r2": 8, "r4": 99}
    asked = []

    def cached(r: Request) -> int:
        asked.append(r.request_id)
        return hits.get(r.request_id, 0)

    assert q.take_next(cached).request_id == "urgent"  # alone at its priority: nothing probed
    assert asked == []
    assert q.take_next(cached).request_id == "r2"  # r4 is past the window of the 3 earliest
    assert sorted(asked) == ["r0", "r1", "r2"]
    # r0, r1, r3 next; then r4 enters the window and wins over r1
    assert [q.take_next(cached).request_id for _ in range(3)] == ["r0", "r4", "r1"]


def test_removal_is_lazy_and_the_heap_stays_proportional_to_what_waits():
    q = WaitingQueue()
    reqs = [req(str(i), 0, float(i)) for i in range(2000)]
    for r in reqs:
        q.push(r)
    for r in reqs[:1990]:
        q.remove(r)
    assert len(q) == 10 and len(q._heap) <= 2 * 10 + 64
    assert reqs[5] not in q and reqs[1995] in q
    assert q.take_next().request_id == "1990"
    q.push(reqs[1990])  # given back: same place
    assert [r.request_id for r in q] == [str(i) for i in range(1990, 2000)]


def test_probes_per_admission_do_not_grow_with_the_queue():
    q = WaitingQueue(window=16)
    for i in range(2000):
        q.push(req(str(i), 0, float(i)))
    probes = 0

    def cached(r: Request) -> int:
        nonlocal probes
        probes += 1
        return 0

    for _ in range(100):
        q.take_next(cached)
    assert probes == 100 * 16 and len(q) == 1900
