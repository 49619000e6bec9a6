"""`ferry up`: replicas and a gateway from one command, supervised, all gone after SIGTERM or SIGKILL."""

import os
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest
import zmq
from server_utils import open_request, read_until, wait_for

from ferry.bench.launch import LaunchedServer
from ferry.gateway.up import cpu_slices
from ferry.utils.network import free_port, reserve_ports, server_socket


def test_cpu_slices_split_evenly_and_wrap_when_short():
    assert cpu_slices([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert cpu_slices([0, 1], 3) == [[0], [1], [0]]
    assert cpu_slices([4, 5, 6, 7], 4) == [[4], [5], [6], [7]]


def test_reserved_ports_are_distinct_and_nobody_else_binds_them_until_handed_over():
    """`ferry up` holds its workers' ports from the pick to each worker's start: a port let go
    in between was taken by a starting worker's ZMQ socket (bound at random from the same
    range; a CI failure of the PD test below), and ports picked one by one could repeat."""
    socks = reserve_ports(64)
    try:
        ports = [s.getsockname()[1] for s in socks]
        assert len(set(ports)) == 64
        ctx = zmq.Context()
        try:
            for port in ports[:4]:
                with socket.socket() as other:
                    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    with pytest.raises(OSError, match="in use"):
                        other.bind(("127.0.0.1", port))
                with ctx.socket(zmq.PUB) as pub, pytest.raises(zmq.ZMQError):
                    pub.bind(f"tcp://127.0.0.1:{port}")
            socks[1].close()  # let go, the port is anyone's
            with ctx.socket(zmq.PUB) as pub:
                pub.bind(f"tcp://127.0.0.1:{ports[1]}")
        finally:
            ctx.term()
        # What `ferry serve --fd` does with one: take it, and once its HTTP side listens, the port answers.
        served = server_socket("127.0.0.1", ports[0], fd=socks[0].fileno())
        with pytest.raises(ConnectionRefusedError):  # not before: a client is refused, as by a port not yet bound
            socket.create_connection(("127.0.0.1", ports[0]), timeout=5)
        served.listen()
        # A client the moment it listens (a readiness probe): its handshake completes in the kernel
        # before the server does anything more, and must still not keep the port from a restart.
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=5) as client:
            conn, _ = served.accept()
            conn.close()  # the server closes first: its side of the connection waits in TIME_WAIT
            assert client.recv(1) == b""
        served.detach()
        socks[0].close()  # the replica died; one started again binds the port by number
        again = server_socket("127.0.0.1", ports[0])
        again.listen()  # and again a client at once, the server first to close, and again a restart
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=5) as client:
            again.accept()[0].close()
            assert client.recv(1) == b""
        again.close()
        server_socket("127.0.0.1", ports[0]).close()
    finally:
        for s in socks:
            s.close()


def test_server_socket_refuses_what_is_not_a_bound_tcp_socket(tmp_path):
    with open(tmp_path / "f", "w") as f, pytest.raises(ValueError, match="not an open socket"):
        server_socket("127.0.0.1", 0, fd=f.fileno())
    with socket.socket() as unbound, pytest.raises(ValueError, match="not bound"):
        server_socket("127.0.0.1", 0, fd=unbound.fileno())
    with socket.socket(socket.AF_UNIX) as unix, pytest.raises(ValueError, match="not a TCP socket"):
        server_socket("127.0.0.1", 0, fd=unix.fileno())


def test_server_socket_on_all_ipv6_addresses_follows_the_kernel_default_for_ipv4():
    """`--host ::` listens as uvicorn's own bind did: with Linux's default (bindv6only 0) IPv4
    clients reach it as well; socket.create_server would have made it IPv6-only everywhere."""
    with open("/proc/sys/net/ipv6/bindv6only") as f:
        dual_stack = f.read().strip() == "0"
    with server_socket("::", 0) as sock:
        sock.listen()
        try:
            socket.create_connection(("127.0.0.1", sock.getsockname()[1]), timeout=5).close()
            reached = True
        except ConnectionRefusedError:
            reached = False
    assert reached == dual_stack


def test_serve_and_gateway_on_a_taken_port_fail_at_once_with_a_clear_error():
    """The port is bound before the engine core starts: a taken one is a flag to change (exit 2),
    not a failure after the model has loaded."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        for cmd in (["serve", "--port", port], ["gateway", "--port", port, "--worker", "http://127.0.0.1:1"]):
            out = subprocess.run([sys.executable, "-m", "ferry.cli", *cmd], capture_output=True, text=True,
                                 timeout=120)  # fmt: skip
            assert out.returncode == 2, out.stderr
            assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in out.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


def test_up_supervises_its_replicas_and_drains_on_sigterm():
    """Each replica runs on its own slice of the CPUs with that many OpenMP threads; one that dies
    is started again on its port while the gateway routes around it; SIGTERM lets a stream in
    flight finish, then every process is gone. API-key variables stay out of the replicas."""
    port = free_port()
    cmd = [sys.executable, "-m", "ferry.cli", "up", "--replicas", "2", "--port", str(port), "--health-interval",
           "0.5", "--max-model-len", "256", "--num-kv-blocks", "32", "--served-model-name", "smol"]  # fmt: skip
    # A key left in the shell from a `vllm serve` setup: the replicas behind the gateway must not take it
    # (the gateway calls them without one: every health check would be a 401).
    up = LaunchedServer(cmd, port, "/ready", 240, env={"VLLM_API_KEY": "from-a-vllm-shell"})
    url = up.__enter__()
    try:
        workers = httpx.get(url + "/gateway/workers", timeout=10).json()
        assert len(workers) == 2 and all(w["healthy"] for w in workers)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=3, temperature=0)
        assert out.choices[0].text
        # `ferry up` made a deployment secret for its replicas and its gateway: the replicas salt block
        # hashes alike, and the gateway mirrors their caches through authenticated KV events.
        salts = {httpx.get(w["url"] + "/ferry/info", timeout=10).json()["block_hash_salt"] for w in workers}
        assert len(salts) == 1 and None not in salts
        client.completions.create(model="smol", prompt="The ferry crosses the fjord at dawn. " * 6, max_tokens=1)
        wait_for(lambda: any(w["kv_blocks_known"] for w in httpx.get(url + "/gateway/workers", timeout=10).json()),
                 "the gateway's mirror of the replica's new blocks")  # fmt: skip
        children = _children(up.proc.pid)
        assert len(children) == 2
        cpus = sorted(os.sched_getaffinity(0))
        affinities = [os.sched_getaffinity(pid) for pid in children]
        assert sorted(len(a) for a in affinities) == sorted(len(c) for c in cpu_slices(cpus, 2))
        if len(cpus) >= 2:
            assert not affinities[0] & affinities[1]  # their own CPUs each
        for pid, a in zip(children, affinities):
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert f"OMP_NUM_THREADS={len(a)}".encode() in f.read().split(b"\0")

        os.kill(children[0], signal.SIGKILL)  # a replica dies; it is started again on its port
        wait_for(lambda: len(_children(up.proc.pid)) == 2 and children[0] not in _children(up.proc.pid),
                 "the dead replica was started again")  # fmt: skip
        wait_for(lambda: all(w["healthy"] for w in httpx.get(url + "/gateway/workers", timeout=10).json()),
                 "the restarted replica is back in the pool", interval=0.5)  # fmt: skip
        assert sorted(w["url"] for w in httpx.get(url + "/gateway/workers", timeout=10).json()) == sorted(
            w["url"] for w in workers
        )
        for _ in range(4):  # both replicas serve
            assert client.completions.create(model="smol", prompt="Hi", max_tokens=2).choices[0].text is not None

        children = _children(up.proc.pid)
        body = {"model": "smol", "prompt": "Tell me a story", "max_tokens": 100, "ignore_eos": True, "stream": True}
        sock = open_request(url, "/v1/completions", body)
        try:
            read_until(sock, b"data: {")
            up.proc.send_signal(signal.SIGTERM)
            rest = read_until(sock, b"data: [DONE]")  # the stream in flight finishes
            assert b'"finish_reason":"length"' in rest.replace(b" ", b"")
        finally:
            sock.close()
        assert up.proc.wait(120) == 0
        for w in workers:  # the replicas have exited (their ports refuse connections)
            try:
                httpx.get(w["url"] + "/health", timeout=2)
                raise AssertionError(f"{w['url']} still answers")
            except httpx.TransportError:
                pass
        for pid in children:
            assert not _alive(pid), pid
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
        # SIGKILLed, `ferry up` runs no cleanup: its workers (and their engine cores) die with it.
        family = [pid for child in _children(up.proc.pid) for pid in (child, *_children(child))]
        assert len(family) >= 4
        up.proc.send_signal(signal.SIGKILL)
        up.proc.wait(10)
        for pid in family:
            wait_for(lambda pid=pid: not _alive(pid), f"process {pid} exited with its parent")
    finally:
        up.__exit__(None, None, None)
