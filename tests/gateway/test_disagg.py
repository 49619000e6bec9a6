"""Prefill/decode disaggregation as users run it: real prefill and decode workers, a real Redis,
and real gateway processes on 127.0.0.1, for each KV transport (tcp, shm, redis)."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from server_utils import (
    SIDE_BY_SIDE,
    GatewayProcess,
    ServerProcess,
    finished,
    open_request,
    read_until,
    redis_server,
    start_together,
    wait_for,
)

from ferry.utils.network import free_port

MODEL = "smol"
TRANSPORTS = ("tcp", "shm", "redis")
# fp32 weights (`--quantization none`): these tests hold PD outputs to equal colocated ones token for
# token. With the GGUF's blocks run as stored, prompt rows compute the same on either side up to fp32
# GEMM rounding, but in decode that rounding can flip an int8 activation step and, some tokens
# later, a greedy choice (tests/models/test_gguf_quantized.py bounds what stays exact).
FLAGS = ("--max-model-len", "1024", "--num-kv-blocks", "160", "--served-model-name", MODEL, "--quantization", "none")


def long_prompt(tag: str, i: int) -> str:
    return (f"[{tag} {i}] The ferry crosses the fjord at dawn; the captain logs the weather, the cargo, the "
            f"passengers and the tide. " * 5 + f"Question {i}: what does the captain log?")  # fmt: skip


@pytest.fixture(scope="module")
def redis_url():
    """A real Redis: the one `.ci/run` started, else our own redis-server on a free port."""
    url = os.environ.get("FERRY_TEST_REDIS_URL")
    if url:
        yield url
        return
    with redis_server() as port:
        yield f"redis://127.0.0.1:{port}/0"


# Every transfer message and KV-event batch carries an HMAC with the deployment's secret, and block
# hashes its salt (utils/deployment_secret.py): the workers and the gateways share it.
DEPLOYMENT = {"FERRY_KV_TRANSFER_SECRET": "test-deployment-secret-42", **SIDE_BY_SIDE}


@pytest.fixture(scope="module")
def cluster(redis_url):
    """Two decode workers (they pull from Redis too) and one prefill worker per transport."""
    env = DEPLOYMENT

    # Request logs: the tests read which ids each worker saw.
    def decode_worker() -> ServerProcess:
        return ServerProcess("--role", "decode", "--enable-kv-events", "--redis-url", redis_url,
                             "--enable-log-requests", *FLAGS, env=env)  # fmt: skip

    def prefill_worker(t: str) -> ServerProcess:
        # The Redis prefill worker takes its URL from the environment, as deploy/'s pd-redis overlay
        # gives it (a password stays out of the process list); the decode workers take the flag.
        penv = {**env, "FERRY_REDIS_URL": redis_url} if t == "redis" else env
        return ServerProcess("--role", "prefill", "--kv-transfer", t, "--kv-transfer-timeout", "3",
                             "--enable-kv-events", "--enable-log-requests", *FLAGS, env=penv)  # fmt: skip

    started = start_together(decode_worker, decode_worker, *[lambda t=t: prefill_worker(t) for t in TRANSPORTS])
    decode, prefill = started[:2], dict(zip(TRANSPORTS, started[2:]))
    yield {"decode": decode, "prefill": prefill, "redis": redis_url}
    for s in [*decode, *prefill.values()]:
        if s.proc.poll() is None:
            s.stop()


def pd_gateway(prefill: list[str], decode: list[str], *flags: str) -> GatewayProcess:
    args = [*flags]
    for p in prefill:
        args += ["--prefill", p]
    for d in decode:
        args += ["--decode", d]
    return GatewayProcess([], *args, env=DEPLOYMENT)


def complete(url: str, prompt: str, stream: bool = False, headers: dict | None = None, **extra):
    """(response headers, text) of a greedy completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream, **extra}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers or {}, timeout=120) as r:
        raw = r.read()
        assert r.status_code == 200, raw
        if not stream:
            return r.headers, json.loads(raw)["choices"][0]["text"]
        text = ""
        for line in raw.decode().splitlines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += "".join(c["text"] for c in chunk["choices"])
        return r.headers, text


def reset(servers) -> None:
    for s in servers:
        assert httpx.post(s.url + "/reset_prefix_cache", timeout=10).status_code == 200


def wait_idle(servers, timeout: float = 10.0) -> None:
    """Every worker's KV usage back to 0 (nothing held once requests are done)."""
    deadline = time.monotonic() + timeout
    while True:
        usage = {s.url: s.metric("ferry:kv_cache_usage_perc") for s in servers}
        if all(u == 0.0 for u in usage.values()):
            return
        assert time.monotonic() < deadline, f"KV blocks still held when idle: {usage}"
        time.sleep(0.2)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_outputs_through_prefill_and_decode_workers_equal_colocated(cluster, transport):
    d1, d2 = cluster["decode"]
    p = cluster["prefill"][transport]
    prompts = [long_prompt(transport, i) for i in range(2)]
    colocated = [complete(d1.url, q)[1] for q in prompts]  # a decode worker serves whole requests too
    reset([d1, d2])
    segments = {f for f in os.listdir("/dev/shm") if f.startswith("psm_")} if os.path.isdir("/dev/shm") else set()
    gw = pd_gateway([p.url], [d1.url, d2.url], "--pd-min-prefill-tokens", "0")
    try:
        tokens_before = p.metric("ferry:generation_tokens_total")
        continued_before = sum(d.metric("ferry:remote_prefill_requests_total") for d in (d1, d2))
        sent_before = p.metric("ferry:kv_transfer_bytes_total")
        received_before = sum(d.metric("ferry:kv_transfer_bytes_total") for d in (d1, d2))
        decoders = set()
        for stream in (False, True):
            for q, want in zip(prompts, colocated):
                headers, text = complete(gw.url, q, stream=stream)
                assert text == want, (transport, stream)
                assert headers["x-ferry-prefill-worker"] == p.url
                decoders.add(headers["x-ferry-worker"])
        assert decoders <= {d1.url, d2.url}
        # The prefill side generated one token per request, the decode side continued from it.
        assert p.metric("ferry:generation_tokens_total") - tokens_before == 4
        assert sum(d.metric("ferry:remote_prefill_requests_total") for d in (d1, d2)) - continued_before == 4
        sent = p.metric("ferry:kv_transfer_bytes_total") - sent_before
        received = sum(d.metric("ferry:kv_transfer_bytes_total") for d in (d1, d2)) - received_before
        assert sent > 0 and received > 0
        if transport != "redis":  # Redis values carry a small header per block
            assert sent == received
        assert gw.metric("ferry_gateway_pd_decisions_total", decision="disaggregated") == 4
        wait_idle([p, d1, d2])
        if transport == "shm":  # every segment was unlinked after its transfer
            assert {f for f in os.listdir("/dev/shm") if f.startswith("psm_")} <= segments
    finally:
        gw.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_blocks_the_decode_worker_holds_are_not_sent_again(cluster, transport):
    d1 = cluster["decode"][0]
    p = cluster["prefill"][transport]
    receiver = httpx.get(d1.url + "/ferry/info", timeout=10).json()["kv_transfer"]["receiver"]
    body = {"model": MODEL, "prompt": long_prompt("resend-" + transport, 0), "max_tokens": 30, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "decode_receiver": receiver}}  # fmt: skip
    first = httpx.post(p.url + "/v1/completions", json=body, timeout=60).json()
    assert first["usage"]["completion_tokens"] == 1  # a prefill worker generates at most one token
    kv = first["kv_transfer_params"]
    full_blocks = first["usage"]["prompt_tokens"] // 16
    assert full_blocks >= 8 and kv["ok"] and kv["num_blocks"] == full_blocks, kv
    again = httpx.post(p.url + "/v1/completions", json=body, timeout=60).json()["kv_transfer_params"]
    assert again["ok"] and again["num_blocks"] == 0 and again["num_bytes"] == 0, again
    if transport == "redis":  # the decode worker pulls what it lacks when the request arrives
        import redis

        client = redis.Redis.from_url(cluster["redis"])
        keys = client.keys("ferry:kv:*")
        assert keys and 0 < client.ttl(keys[0]) <= 600  # every block expires
        before = d1.metric("ferry:kv_transfer_blocks_total")
        decode = {**body, "max_tokens": 4,
                  "kv_transfer_params": {"do_remote_prefill": True, "first_token_ids": kv["first_token_ids"],
                                         "prompt_digest": kv["prompt_digest"]}}  # fmt: skip
        out = httpx.post(d1.url + "/v1/completions", json=decode, timeout=60).json()
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * full_blocks
        assert d1.metric("ferry:kv_transfer_blocks_total") - before == full_blocks
        # Pulled once: the next request for the prompt finds the blocks here.
        httpx.post(d1.url + "/v1/completions", json=decode, timeout=60).json()
        assert d1.metric("ferry:kv_transfer_blocks_total") - before == full_blocks


def test_bad_transfer_params_are_refused_and_a_foreign_token_is_recomputed(cluster):
    d1 = cluster["decode"][0]
    p = cluster["prefill"]["tcp"]
    prompt = long_prompt("bad", 0)
    r = httpx.post(p.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "stream": True,
                   "kv_transfer_params": {"do_remote_decode": True, "decode_receiver": "tcp://127.0.0.1:1"}},
                   timeout=30)  # fmt: skip
    assert r.status_code == 400 and "not streamed" in r.json()["error"]["message"]
    r = httpx.post(p.url + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                   "kv_transfer_params": {"do_remote_decode": True}}, timeout=30)  # fmt: skip
    assert r.status_code == 400 and "decode_receiver" in r.json()["error"]["message"]
    for foreign in ("tcp://10.1.2.3:5555", "tcp://attacker.example.com:5555"):  # not in the default allow-list
        r = httpx.post(p.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                       "kv_transfer_params": {"do_remote_decode": True, "decode_receiver": foreign}},
                       timeout=30)  # fmt: skip
        assert r.status_code == 403 and "--kv-transfer-allowed-receivers" in r.json()["error"]["message"], r.text
    r = httpx.post(d1.url + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                   "kv_transfer_params": {"do_remote_prefill": True, "first_token_ids": "x"}}, timeout=30)  # fmt: skip
    assert r.status_code == 400
    # A token for another prompt (digest mismatch) is not used: the decode worker computes its own.
    want = complete(d1.url, prompt)[1]
    before = d1.metric("ferry:remote_prefill_requests_total")
    got = complete(d1.url, prompt, kv_transfer_params={"do_remote_prefill": True, "first_token_ids": [42],
                                                       "prompt_digest": "0" * 32})[1]  # fmt: skip
    assert got == want
    assert d1.metric("ferry:remote_prefill_requests_total") - before == 1  # counted, as "recomputed"
    # A transfer to a receiver that never answers times out (3 s) and the prefill still answers.
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "decode_receiver": f"tcp://127.0.0.1:{free_port()}"},
    }
    t0 = time.monotonic()
    kv = httpx.post(p.url + "/v1/completions", json=body, timeout=60).json()["kv_transfer_params"]
    assert not kv["ok"] and "within" in kv["error"] and time.monotonic() - t0 < 10
    wait_idle([p, d1])


def test_short_prompts_are_prefilled_on_the_decode_worker(cluster):
    d1, d2 = cluster["decode"]
    p = cluster["prefill"]["tcp"]
    gw = pd_gateway([p.url], [d1.url, d2.url], "--pd-min-prefill-tokens", "64")
    try:
        before = p.metric("ferry:prompt_tokens_total")
        headers, text = complete(gw.url, "Name a colour.")  # ~5 tokens: not worth a transfer
        assert "x-ferry-prefill-worker" not in headers and text
        assert p.metric("ferry:prompt_tokens_total") == before
        headers, _ = complete(gw.url, long_prompt("conditional", 0), headers={"X-Request-Id": "trace-pd-1"})
        assert headers["x-ferry-prefill-worker"] == p.url
        # The client's id went to both hops: each worker's request log names it.
        decoder = next(d for d in (d1, d2) if d.url == headers["x-ferry-worker"])
        for worker in (p, decoder):
            with open(worker.log.name, errors="replace") as f:
                assert "Received request cmpl-trace-pd-1-" in f.read(), worker.url
        assert gw.metric("ferry_gateway_pd_decisions_total", decision="local") == 1
        assert gw.metric("ferry_gateway_pd_decisions_total", decision="disaggregated") == 1
        # An embedding is one pass over its prompt: a decode worker runs it whole, however long.
        r = httpx.post(gw.url + "/v1/embeddings", json={"model": MODEL, "input": long_prompt("conditional", 1)},
                       timeout=120)  # fmt: skip
        assert r.status_code == 200 and "x-ferry-prefill-worker" not in r.headers, r.text
        assert r.headers["x-ferry-worker"] in (d1.url, d2.url) and len(r.json()["data"][0]["embedding"]) > 0
        assert gw.metric("ferry_gateway_pd_decisions_total", decision="local") == 2
        # Prompt logprobs read every prompt position's logits, cached or not: no prefill hop for them.
        before = p.metric("ferry:prompt_tokens_total")
        headers, _ = complete(gw.url, long_prompt("conditional", 2), prompt_logprobs=1)
        assert "x-ferry-prefill-worker" not in headers and p.metric("ferry:prompt_tokens_total") == before
        assert gw.metric("ferry_gateway_pd_decisions_total", decision="local") == 3
    finally:
        gw.stop()


def test_prefill_pools_per_tenant_feed_one_decode_pool(cluster, tmp_path):
    d1 = cluster["decode"][0]
    p_tcp, p_redis = cluster["prefill"]["tcp"], cluster["prefill"]["redis"]
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"key": "sk-a", "name": "a", "prefill_pool": "a"},
                                {"key": "sk-b", "name": "b", "prefill_pool": "b"}]))  # fmt: skip
    gw = pd_gateway([f"a={p_tcp.url}", f"b={p_redis.url}"], [d1.url], "--pd-min-prefill-tokens", "0",
                    "--api-keys", str(keys))  # fmt: skip
    try:
        for key, worker in (("sk-a", p_tcp.url), ("sk-b", p_redis.url)) * 2:
            headers, text = complete(gw.url, long_prompt("tenant-" + key, 0),
                                     headers={"Authorization": f"Bearer {key}"})  # fmt: skip
            assert headers["x-ferry-prefill-worker"] == worker and headers["x-ferry-worker"] == d1.url and text
    finally:
        gw.stop()


def test_a_client_that_leaves_during_the_prefill_hop_is_charged_its_prompt(cluster, tmp_path):
    """A streamed request whose client leaves while a prefill worker computes its prompt keeps the
    prompt's charge (it was given back whole: leaving made prompts free to prefill), as a colocated
    worker's stream keeps it once its headers are out."""
    d1, _ = cluster["decode"]
    p = cluster["prefill"]["tcp"]
    keys = tmp_path / "keys.json"
    keys.write_text('[{"key": "sk-p", "name": "p", "prompt_tokens_per_minute": 1200}, '
                    '{"key": "sk-ops", "name": "ops", "admin": true}]')  # fmt: skip
    gw = pd_gateway([p.url], [d1.url], "--pd-min-prefill-tokens", "0", "--api-keys", str(keys))
    gw.admin = {"Authorization": "Bearer sk-ops"}
    auth = {"Authorization": "Bearer sk-p"}
    prompt = " ".join(long_prompt("charged", i) for i in range(6))  # ~700 tokens: two do not fit in 1,200
    core = p.core_pid()

    def prefill_in_flight() -> bool:
        workers = httpx.get(gw.url + "/gateway/workers", headers=gw.admin, timeout=10).json()
        return any(w["url"] == p.url and w["in_flight"] == 1 for w in workers)

    try:
        os.kill(core, signal.SIGSTOP)  # the prompt waits on the prefill worker until the client has left
        try:
            sock = open_request(gw.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                            "stream": True}, headers=auth)  # fmt: skip
            wait_for(prefill_in_flight, "the prefill hop under way")
            sock.close()
            wait_for(lambda: gw.metric("ferry_gateway_client_disconnects_total") >= 1, "the gateway saw it leave")
        finally:
            os.kill(core, signal.SIGCONT)
        r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
                       headers=auth, timeout=120)  # fmt: skip
        assert r.status_code == 429 and "prompt tokens" in r.json()["error"]["message"], r.text
    finally:
        gw.stop()


def test_clients_that_leave_early_abort_the_prefill_hop_and_the_decode(cluster):
    """10 raw-socket clients go away early on each disaggregated path: right after sending (the
    gateway is mostly still in the prefill hop then), not streamed while their requests decode
    (before any byte), streamed after a first token. Nothing runs to its 300 tokens, and every
    worker, prefill ones included, ends idle with no KV block held."""
    d1, d2 = cluster["decode"]
    p = cluster["prefill"]["tcp"]
    gw = pd_gateway([p.url], [d1.url, d2.url], "--pd-min-prefill-tokens", "0")
    n = 10
    body = {"model": MODEL, "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    length_before = sum(finished(s, "length") for s in (d1, d2))

    def decoding() -> float:
        return sum(s.metric("ferry:num_requests_running") + s.metric("ferry:num_requests_waiting") for s in (d1, d2))

    def idle() -> bool:
        return (all(s.metric("ferry:num_requests_running") + s.metric("ferry:num_requests_waiting") == 0
                    and s.metric("ferry:kv_cache_usage_perc") == 0 for s in (p, d1, d2))
                and gw.metric("ferry_gateway_requests_in_progress") == 0)  # fmt: skip

    try:
        for stream, leave in ((False, "sent"), (False, "running"), (True, "running")):
            gone_before = gw.metric("ferry_gateway_client_disconnects_total")
            socks = [open_request(gw.url, "/v1/completions", {**body, "stream": stream,
                                  "prompt": long_prompt(f"leave-{stream}-{leave}", i)}) for i in range(n)]  # fmt: skip
            if leave == "running" and stream:
                for sock in socks:
                    read_until(sock, b"data: {")
            elif leave == "running":
                wait_for(lambda: decoding() >= n, f"{n} requests on the decode workers")
            for sock in socks:
                sock.close()
            wait_for(lambda g=gone_before: gw.metric("ferry_gateway_client_disconnects_total") >= g + n,
                     "the gateway noticed every client leave")  # fmt: skip
            wait_for(idle, f"idle after stream={stream} leave={leave}")
        assert sum(finished(s, "length") for s in (d1, d2)) == length_before  # no decode ran to its end
        headers, text = complete(gw.url, long_prompt("after-leaving", 0))  # and PD still works
        assert headers["x-ferry-prefill-worker"] == p.url and text
    finally:
        gw.stop()


def test_a_burst_is_spread_over_the_decode_workers_while_its_prefill_hops_run(cluster):
    """The decode worker is chosen before the prefill hop and counts the request as in flight only
    once it is sent: a burst chosen meanwhile saw the same loads, and with one worker busier when
    last scraped every request of it went to the other."""
    d1, d2 = cluster["decode"]
    p = cluster["prefill"]["tcp"]
    other = open_request(d1.url, "/v1/completions", {"model": MODEL, "prompt": "Another client's request",
                         "max_tokens": 1000, "ignore_eos": True, "stream": True})  # fmt: skip
    read_until(other, b"data: {")  # d1 runs one request when the gateway looks, and is never scraped again
    gw = pd_gateway([p.url], [d1.url, d2.url], "--pd-min-prefill-tokens", "0", "--scrape-interval", "3600",
                    "--health-interval", "3600", "--admin-key", "admin-key-for-state")  # fmt: skip
    socks = []
    try:
        state = httpx.get(gw.url + "/gateway/state", headers={"authorization": "Bearer admin-key-for-state"}).json()
        assert {w["url"]: w["running"] for w in state["workers"] if w["role"] == "decode"} == {d1.url: 1, d2.url: 0}
        body = {"model": MODEL, "max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True}
        socks = [open_request(gw.url, "/v1/completions", {**body, "prompt": long_prompt("burst", i)})
                 for i in range(8)]  # fmt: skip
        heads = [read_until(s, b"data: {").split(b"\r\n\r\n")[0].decode().lower() for s in socks]
        chosen = [next(h.split(": ", 1)[1] for h in head.split("\r\n") if h.startswith("x-ferry-worker:"))
                  for head in heads]  # fmt: skip
        assert min(chosen.count(d1.url), chosen.count(d2.url)) >= 2, chosen
    finally:
        for s in [other, *socks]:
            s.close()
        gw.stop()
    wait_for(lambda: all(s.metric("ferry:num_requests_running") == 0 for s in (d1, d2)), "the burst aborted")


def test_failed_prefill_and_decode_workers_are_replaced(cluster):
    """Runs last: it kills workers. A dead prefill worker's requests are prefilled by another; a
    decode worker that dies before streaming is replaced; outputs stay those of a colocated run."""
    d1, d2 = cluster["decode"]
    p_shm, p_tcp = cluster["prefill"]["shm"], cluster["prefill"]["tcp"]
    prompts = [long_prompt("failover", i) for i in range(3)]
    colocated = [complete(d1.url, q)[1] for q in prompts]
    reset([d1])
    # Health checks far apart: the gateway learns of the deaths from the requests themselves.
    gw = pd_gateway([p_shm.url, p_tcp.url], [d1.url, d2.url], "--pd-min-prefill-tokens", "0",
                    "--health-interval", "60", "--failure-threshold", "1")  # fmt: skip
    try:
        for s in (p_shm, d2):
            s.proc.send_signal(signal.SIGKILL)
            s.proc.wait(10)
        for q, want in zip(prompts, colocated):
            headers, text = complete(gw.url, q, stream=True)
            assert text == want
            assert headers["x-ferry-worker"] == d1.url
            assert headers.get("x-ferry-prefill-worker") in (p_tcp.url, None)
        assert gw.metric("ferry_gateway_retries_total") >= 1
        wait_idle([p_tcp, d1])
    finally:
        gw.stop()
