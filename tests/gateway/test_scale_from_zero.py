"""Scale from zero: with --hold-timeout the gateway holds requests that find no ready worker until one
becomes ready (gateway/waiting_room.py). The room's logic on its own, then a real gateway process over
a pool at zero replicas, a real `ferry serve` started later on the worker's address."""

from __future__ import annotations

import asyncio
import threading

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge
from server_utils import GatewayProcess, ServerProcess, open_request, wait_for

from ferry.gateway.waiting_room import FULL, READY, TIMED_OUT, WaitingRoom
from ferry.utils.network import free_port

MODEL = "smol"


def room(timeout: float, capacity: int) -> tuple[WaitingRoom, CollectorRegistry]:
    r = CollectorRegistry()
    wr = WaitingRoom(timeout, capacity, Gauge("held", "held", registry=r),
                     Counter("outcomes", "outcomes", ["outcome"], registry=r))  # fmt: skip
    return wr, r


async def settle() -> None:
    """Let every ready task run until it blocks again (no I/O here: a few turns of the loop)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_waiting_room_holds_until_a_passed_check_finds_a_worker():
    async def main():
        pool = {"ready": False}
        wr, metrics = room(timeout=600, capacity=2)
        first = asyncio.create_task(wr.wait(lambda: pool["ready"]))
        second = asyncio.create_task(wr.wait(lambda: pool["ready"]))
        await settle()
        assert wr.held == 2 and not first.done() and not second.done()
        assert await wr.wait(lambda: pool["ready"]) == FULL  # no place left: refused at once
        wr.worker_checked()  # a check passed, but the pool is still empty: they wait on
        await settle()
        assert wr.held == 2 and not first.done()
        second.cancel()  # its client left: the place is given back
        await settle()
        assert wr.held == 1
        pool["ready"] = True
        wr.worker_checked()
        assert await asyncio.wait_for(first, 60) is None
        assert wr.held == 0 and metrics.get_sample_value("held") == 0
        assert metrics.get_sample_value("outcomes_total", {"outcome": READY}) == 1
        assert metrics.get_sample_value("outcomes_total", {"outcome": FULL}) == 1
        assert await wr.wait(lambda: True) is None  # a ready pool never waits

    asyncio.run(main())


def test_waiting_room_times_out_and_can_be_off():
    async def main():
        wr, _ = room(timeout=0.05, capacity=4)
        assert await wr.wait(lambda: False) == TIMED_OUT  # nothing ever becomes ready
        assert wr.held == 0
        off, _ = room(timeout=0, capacity=4)
        assert not off.enabled and await off.wait(lambda: False) == "disabled" and off.held == 0

    asyncio.run(main())


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


def test_gateway_holds_requests_until_a_worker_starts():
    port = free_port()  # the pool's one worker: nothing listens there yet
    gw = GatewayProcess([f"http://127.0.0.1:{port}"], "--hold-timeout", "600", "--max-held-requests", "3",
                        "--health-interval", "0.25", "--cooldown", "0.5")  # fmt: skip
    server = None
    try:
        ready = httpx.get(gw.url + "/ready", timeout=10)
        assert ready.status_code == 200 and ready.json()["workers"] == []  # clients are not turned away

        def held() -> float:
            return gw.metric("ferry_gateway_requests_held")

        results: dict[str, httpx.Response] = {}

        def ask(model: str) -> None:
            results[model] = httpx.post(gw.url + "/v1/chat/completions", json=chat(model), timeout=600)

        threads = [threading.Thread(target=ask, args=(m,)) for m in (MODEL, "no-such-model")]
        for t in threads:
            t.start()
        wait_for(lambda: held() == 2, "both requests held")
        leaving = open_request(gw.url, "/v1/chat/completions", chat(MODEL))  # a third waits, then leaves
        wait_for(lambda: held() == 3, "the third request held")
        full = httpx.post(gw.url + "/v1/chat/completions", json=chat(MODEL), timeout=60)
        assert full.status_code == 503 and "too many requests are waiting" in full.json()["error"]["message"]
        leaving.close()
        wait_for(lambda: held() == 2, "the place of the client that left given back")
        state = httpx.get(gw.url + "/gateway/state", timeout=10).json()  # what KEDA reads (scale-to-zero)
        assert state["held"] == 2 and state["in_progress"] == 2 and state["hold_timeout"] == 600

        server = ServerProcess("--max-model-len", "512", "--num-kv-blocks", "64", "--served-model-name", MODEL,
                               port=port)  # fmt: skip
        for t in threads:
            t.join(300)
        answered = results[MODEL]
        assert answered.status_code == 200, answered.text
        assert answered.headers["x-ferry-worker"] == server.url and answered.json()["choices"][0]["message"]["content"]
        assert results["no-such-model"].status_code == 404  # known once the worker answered: nobody serves it
        assert held() == 0 and gw.metric("ferry_gateway_held_requests_total", outcome="ready") == 2
    finally:
        gw.stop()
        if server is not None:
            server.stop()


def test_gateway_hold_times_out_with_a_503():
    gw = GatewayProcess([f"http://127.0.0.1:{free_port()}"], "--hold-timeout", "0.5")
    try:
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat(MODEL), timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "became ready within 0.5 s" in r.json()["error"]["message"]
        assert gw.metric("ferry_gateway_held_requests_total", outcome="timeout") == 1
        assert gw.metric("ferry_gateway_requests_held") == 0
        # Before any worker answers, a model is the client's text: failures are counted under one
        # label, not one series per name made up (metrics without bound).
        for name in ("made-up-1", "made-up-2"):
            assert httpx.post(gw.url + "/v1/chat/completions", json=chat(name), timeout=60).status_code == 503
        text = httpx.get(gw.url + "/metrics", timeout=10).text
        assert "made-up" not in text and gw.metric("ferry_gateway_failed_requests_total", model="unknown") == 3
    finally:
        gw.stop()
