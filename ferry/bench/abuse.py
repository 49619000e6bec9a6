"""`ferry bench abuse`: does a server (and a gateway in front of it) keep answering while clients
send hostile bodies?

For each target (`ferry serve` alone, then a `ferry gateway` in front of it), two phases of
`--duration` seconds: quiet, then under abuse. In both, a prober times `GET /health` every
`--probe-interval` seconds and a well-behaved client sends a short greedy completion after
another (its latency and status). Under abuse, `--abusers` processes (not threads of this one, so
building and sending bodies never delays the prober's clock) send hostile requests in turn:

- `token-ids-30MB`: a prompt of 4.3M token ids (refused from its length: 400),
- `chunked-33MB`: a chunked body that passes the 32 MB cap (413 as it passes),
- `text-2M-words`: a 10 MB text prompt (400 before any tokenization),
- `nested-json`: an array nested 100,000 deep (400),
- `many-prompts`: 100,000 one-token prompts in one request (400),
- `slow-body`: a valid request dribbled at ~200 bytes/s (served once it is all in).

Every hostile request's status and the time from its last byte to the answer are recorded. What
it shows: /health latency and the good client's latency, quiet against abused, in one run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import platform
import socket
import sys
import threading
import time
from collections import Counter, defaultdict
from urllib.parse import urlparse

import httpx

from ferry.bench.launch import LaunchedServer
from ferry.bench.serve import distribution
from ferry.utils.network import reserve_port

KINDS = ("token-ids-30MB", "chunked-33MB", "text-2M-words", "nested-json", "many-prompts", "slow-body")
MODEL = "abuse-bench"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2)")
    p.add_argument("--targets", nargs="+", choices=("server", "gateway"), default=["server", "gateway"])
    p.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    p.add_argument("--abusers", type=int, default=2, help="processes sending hostile requests")
    p.add_argument("--probe-interval", type=float, default=0.05, help="seconds between /health probes")
    p.add_argument("--json", default=None)


def hostile_request(kind: str, host: str) -> tuple[bytes, bytes | list[bytes]]:
    """(headers, body) of one hostile request: the body as bytes, or a list of pieces to send apart."""
    path = "/v1/completions"
    if kind == "token-ids-30MB":
        body = json.dumps({"model": MODEL, "prompt": list(range(10000, 15000)) * 860, "max_tokens": 2}).encode()
    elif kind == "chunked-33MB":
        piece = b"a" * (1 << 20)
        chunks = [b'{"model": "' + MODEL.encode() + b'", "prompt": "']
        chunks += [piece] * 33 + [b'", "max_tokens": 2}']
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        head += "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        return head.encode(), [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks] + [b"0\r\n\r\n"]
    elif kind == "text-2M-words":
        body = json.dumps({"model": MODEL, "prompt": "word " * 2_000_000, "max_tokens": 2}).encode()
    elif kind == "nested-json":
        body = b'{"model": "' + MODEL.encode() + b'", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    elif kind == "many-prompts":
        body = json.dumps({"model": MODEL, "prompt": [[1]] * 100_000, "max_tokens": 1}).encode()
    elif kind == "slow-body":
        # ~200 bytes: ~1 s at 200 bytes/s, so a phase ends about when its duration does (a longer one
        # ran its last body for seconds after it)
        body = json.dumps({"model": MODEL, "prompt": "The ferry crosses " * 10, "max_tokens": 1}).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        return head.encode(), [body[i : i + 20] for i in range(0, len(body), 20)]
    else:
        raise ValueError(f"unknown kind {kind!r}")
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return head.encode(), body


def abuse(url: str, duration: float, offset: int, ready, go) -> list[tuple[str, str, float]]:
    """One abuser process: builds its bodies, says `ready`, waits for `go`, then sends hostile
    requests in turn for `duration` seconds; (kind, status, seconds from the last byte sent to
    the answer's status line) each."""
    u = urlparse(url)
    requests = {k: hostile_request(k, u.netloc) for k in KINDS}
    ready.put(offset)
    go.wait()
    deadline = time.monotonic() + duration
    out = []
    i = offset
    while time.monotonic() < deadline:
        kind = KINDS[i % len(KINDS)]
        i += 1
        head, body = requests[kind]
        sock = socket.create_connection((u.hostname, u.port), timeout=120)
        status, after = "no answer", float("nan")
        try:
            try:
                sock.sendall(head)
                if isinstance(body, list):
                    for j, piece in enumerate(body):
                        if kind == "slow-body" and j:
                            time.sleep(0.1)  # between pieces: the clock below starts at the last byte
                        sock.sendall(piece)
                else:
                    sock.sendall(body)
                sent = time.perf_counter()
            except OSError:  # the server answered (413) and closed while the body was still going out
                sent = None
            line = sock.makefile("rb").readline()
            if sent is not None:
                after = time.perf_counter() - sent
            if len(line.split()) > 1:
                status = line.split()[1].decode()
        except OSError as e:  # reset before an answer could be read
            status = type(e).__name__
        finally:
            sock.close()
        out.append((kind, status, after))
    return out


def probe(url: str, stop: threading.Event, interval: float, out: list[float], errors: list[str]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = client.get(url + "/health")
                if r.status_code != 200:
                    errors.append(str(r.status_code))
            except httpx.HTTPError as e:
                errors.append(type(e).__name__)
            out.append(time.perf_counter() - t0)
            stop.wait(interval)


def well_behaved(url: str, stop: threading.Event, out: list[float], errors: list[str]) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = client.post(url + "/v1/completions", json=body)
                if r.status_code != 200:
                    errors.append(str(r.status_code))
            except httpx.HTTPError as e:
                errors.append(type(e).__name__)
            out.append(time.perf_counter() - t0)


def phase(url: str, args, abusers: int) -> dict:
    stop = threading.Event()
    health, health_errors, completions, completion_errors = [], [], [], []
    threads = [threading.Thread(target=probe, args=(url, stop, args.probe_interval, health, health_errors)),
               threading.Thread(target=well_behaved, args=(url, stop, completions, completion_errors))]  # fmt: skip
    hostile: list[tuple[str, str, float]] = []
    with contextlib.ExitStack() as stack:
        futures = []
        if abusers:  # (a quiet phase starts no processes: a manager and a pool took ~2 s to start and stop)
            mp = multiprocessing.get_context("spawn")
            manager = stack.enter_context(mp.Manager())
            ex = stack.enter_context(concurrent.futures.ProcessPoolExecutor(abusers, mp_context=mp))
            ready, go = manager.Queue(), manager.Event()
            futures = [ex.submit(abuse, url, args.duration, i, ready, go) for i in range(abusers)]
            for _ in range(abusers):  # their start-up (imports, building the bodies) stays out of the phase
                ready.get(timeout=600)
        for t in threads:
            t.start()
        if abusers:
            go.set()
        time.sleep(args.duration)
        for f in futures:
            hostile += f.result()
        stop.set()
        for t in threads:
            t.join()
    by_kind: dict[str, list] = defaultdict(list)
    for kind, status, after in hostile:
        by_kind[kind].append((status, after))
    return {
        "health_ms": distribution([x * 1000 for x in health]) | {"max": max(health) * 1000, "n": len(health)},
        "health_errors": dict(Counter(health_errors)),
        "completion_ms": distribution([x * 1000 for x in completions])
        | {"max": max(completions, default=float("nan")) * 1000, "n": len(completions)},
        "completion_errors": dict(Counter(completion_errors)),
        "hostile": {
            k: {
                "n": len(v),
                "statuses": dict(Counter(s for s, _ in v)),
                "answer_after_last_byte_ms": distribution([a * 1000 for _, a in v if a == a]),
            }
            for k, v in sorted(by_kind.items())
        },  # fmt: skip
    }


def report(target: str, name: str, r: dict) -> None:
    h, c = r["health_ms"], r["completion_ms"]
    print(f"{target:<8} {name:<6} /health p50 {h['p50']:7.1f}  p99 {h['p99']:7.1f}  max {h['max']:7.1f} ms "
          f"({h['n']} probes, errors {r['health_errors'] or 0}) | completion p50 {c['p50']:7.1f}  max "
          f"{c['max']:7.1f} ms ({c['n']}, errors {r['completion_errors'] or 0})")  # fmt: skip
    for kind, k in r["hostile"].items():
        a = k["answer_after_last_byte_ms"]
        print(f"{'':<16}{kind:<16} {k['n']:4d} sent, statuses {k['statuses']}, answered {a['p50']:.0f} ms "
              f"(p50) / {a['p99']:.0f} ms (p99) after the last byte")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    if args.duration <= 0 or args.abusers < 1 or args.probe_interval <= 0:
        raise ValueError("need --duration > 0, --abusers >= 1 and --probe-interval > 0")
    sock, port = reserve_port()  # held until the server has it (--fd)
    serve = [sys.executable, "-m", "ferry.cli", "serve", *([args.model] if args.model else []), "--port", str(port),
             "--served-model-name", MODEL, "--max-model-len", "2048"]  # fmt: skip
    results: dict = {}
    with LaunchedServer(serve, port, "/ready", 600, sock=sock) as server_url:
        for target in args.targets:
            if target == "server":
                runs = {name: phase(server_url, args, n) for name, n in (("quiet", 0), ("abused", args.abusers))}
            else:
                gw_sock, gw_port = reserve_port()
                gw = [sys.executable, "-m", "ferry.cli", "gateway", "--port", str(gw_port), "--worker", server_url]
                with LaunchedServer(gw, gw_port, "/ready", 120, sock=gw_sock) as gw_url:
                    runs = {name: phase(gw_url, args, n) for name, n in (("quiet", 0), ("abused", args.abusers))}
            results[target] = runs
            for name, r in runs.items():
                report(target, name, r)
    if args.json:
        machine = {"cpus": os.cpu_count(), "processor": platform.processor(), "python": platform.python_version()}
        with open(args.json, "w") as f:
            json.dump({"args": vars(args) | {"func": None}, "results": results, "machine": machine,
                       "time": time.time()}, f, indent=2, default=str)  # fmt: skip
    return 0
