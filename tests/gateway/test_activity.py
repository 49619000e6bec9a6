"""gateway/activity.py: the dashboard's memory of recent decisions and latency, bounded."""

from __future__ import annotations

from ferry.gateway.activity import Activity


def test_activity_keeps_the_latest_decisions_and_per_slot_means():
    a = Activity(keep=3, slots=4, slot_seconds=60.0)
    for i in range(5):
        a.routed("m", f"http://w{i}", "prefix-overlap", 0.5)
    a.routed("m", "http://w9", "round-robin", -1.0)  # no overlap measured: None, not a fake 0
    assert [d["worker"] for d in a.routing] == ["http://w3", "http://w4", "http://w9"]  # the last 3
    assert a.routing[-1]["overlap"] is None and a.routing[0]["overlap"] == 0.5
    a.pd_decided("m", "disaggregated", "http://d0", "http://p0", 0.25)
    a.pd_decided("m", "local", "http://d1", None, None)
    assert [(p["decision"], p["prefill"]) for p in a.pd] == [("disaggregated", "http://p0"), ("local", None)]

    a.settled(10, 0.2, 0.01, now=6000.5)
    a.settled(30, 0.4, None, now=6059.9)  # a stream that ended early: no TPOT
    a.settled(None, None, None, now=6010.0)  # a non-streamed response: no first-token time
    (slot,) = a.series()
    assert abs(slot["ttft"] - 0.3) < 1e-9 and abs(slot["tpot"] - 0.01) < 1e-9
    assert slot["requests_per_s"] == 3 / 60.0 and slot["output_tokens_per_s"] == 40 / 60.0
    assert slot["time"] == 6000.0
    a.settled(1, None, None, now=6060.0)  # the next slot
    assert [p["time"] for p in a.series()] == [6000.0, 6060.0]


def test_activity_series_is_bounded():
    a = Activity(slots=3, slot_seconds=1.0)
    for start in range(10):  # ten slots' worth of settlements, oldest first
        a.settled(1, None, None, now=1000.0 + start)
    series = a.series()
    assert [p["time"] for p in series] == [1007.0, 1008.0, 1009.0]
    assert all(p["ttft"] is None and p["tpot"] is None for p in series)
