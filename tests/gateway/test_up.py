"""`ferry up`: replicas and a gateway from one command, all gone after SIGTERM."""

import signal
import socket
import subprocess
import sys

import httpx
import openai

from ferry.bench.launch import LaunchedServer
from ferry.utils.network import free_port, free_ports


def test_free_ports_are_distinct_and_bindable():
    """`ferry up` picks its workers' ports together: one port handed out twice made two workers
    race for it (a CI failure of the PD test below)."""
    taken = free_port()
    ports = free_ports(64, exclude=frozenset({taken}))
    assert len(set(ports)) == 64 and taken not in ports
    for port in ports[:8]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_up_serves_then_sigterm_stops_every_process():
    port = free_port()
    cmd = [sys.executable, "-m", "ferry.cli", "up", "--replicas", "2", "--port", str(port),
           "--max-model-len", "256", "--num-kv-blocks", "32", "--served-model-name", "smol"]  # fmt: skip
    up = LaunchedServer(cmd, port, "/ready", 240)
    url = up.__enter__()
    try:
        workers = httpx.get(url + "/gateway/workers", timeout=10).json()
        assert len(workers) == 2 and all(w["healthy"] for w in workers)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=3, temperature=0)
        assert out.choices[0].text
        children = subprocess.run(["pgrep", "-P", str(up.proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) >= 2
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
        for w in workers:  # the replicas have exited (their ports refuse connections)
            try:
                httpx.get(w["url"] + "/health", timeout=2)
                raise AssertionError(f"{w['url']} still answers")
            except httpx.TransportError:
                pass
        for pid in children:
            assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0, pid
    finally:
        up.__exit__(None, None, None)


def test_up_pd_starts_prefill_and_decode_workers_behind_a_disaggregating_gateway():
    port = free_port()
    cmd = [sys.executable, "-m", "ferry.cli", "up", "--pd", "1:1", "--port", str(port), "--pd-min-prefill-tokens",
           "0", "--max-model-len", "256", "--num-kv-blocks", "32", "--served-model-name", "smol"]  # fmt: skip
    up = LaunchedServer(cmd, port, "/ready", 240)
    url = up.__enter__()
    try:
        workers = httpx.get(url + "/gateway/workers", timeout=10).json()
        assert sorted(w["role"] for w in workers) == ["decode", "prefill"] and all(w["healthy"] for w in workers)
        prefill = next(w["url"] for w in workers if w["role"] == "prefill")
        body = {"model": "smol", "prompt": "The capital of France is a city called", "max_tokens": 3, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        assert r.headers["x-ferry-prefill-worker"] == prefill
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
    finally:
        up.__exit__(None, None, None)
