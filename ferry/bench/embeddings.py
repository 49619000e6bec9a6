"""`ferry bench embeddings`: /v1/embeddings requests per second at a concurrency, with the engine
core's dynamic batching of embedding requests off and on, in one run.

For each `--delays` value a `ferry serve` starts with `--embed-max-delay-ms` set to it (0: off,
every request scheduled as it arrives; the scheduler still batches what waits together) and
`--embed-max-batch`; `--num-requests` requests, one text each (a RAG-sized chunk of varied
length), go out with `--concurrency` in flight, each sent when one returns. Reported: requests
per second over the pass's wall time and latency p50 / p99 (client side, send to whole body),
after a warm-up pass of `--concurrency` requests.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import httpx

from ferry.bench.launch import LaunchedServer
from ferry.config import EngineArgs
from ferry.utils.network import reserve_port

TOPICS = ["the harbour at dawn", "a contract dispute", "protein folding", "a recipe for bread", "tax law changes",
          "a football match", "solar panel efficiency", "the history of Rome", "a bug in a compiler",
          "migratory birds"]  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--delays", default="0,2,5", help="--embed-max-delay-ms values to compare (0: batching off)")
    p.add_argument("--embed-batch", type=int, default=32, help="--embed-max-batch of the servers")
    p.add_argument("--words", default="20,80", help="MIN,MAX words per text (20,80: RAG chunks; 4,12: queries)")
    p.add_argument("--json", default=None, help="also write the results to this file")


def texts(n: int, low: int = 20, high: int = 80) -> list[str]:
    """Texts of `low` to `high` words (chunks, as a RAG indexer sends them, or short queries)."""
    out = []
    for i in range(n):
        words = low + (i * 37) % (high - low + 1)
        body = " ".join(f"{TOPICS[(i + k) % len(TOPICS)].split()[-1]}{k % 7}" for k in range(words))
        out.append(f"Passage {i} about {TOPICS[i % len(TOPICS)]}: {body}.")
    return out


async def _load(url: str, inputs: list[str], concurrency: int) -> dict:
    latencies: list[float] = []
    errors = 0
    queue = list(reversed(inputs))

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors
        while queue:
            text = queue.pop()
            t0 = time.perf_counter()
            r = await client.post(url + "/v1/embeddings", json={"model": "bench", "input": text})
            if r.status_code != 200 or len(r.json()["data"][0]["embedding"]) == 0:
                errors += 1
            latencies.append(time.perf_counter() - t0)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    latencies.sort()
    return {"requests": len(inputs), "errors": errors, "seconds": wall, "requests_per_s": len(inputs) / wall,
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}  # fmt: skip


def main(args: argparse.Namespace) -> int:
    eargs = EngineArgs.from_cli_args(args)
    delays = [float(d) for d in args.delays.split(",")]
    low, high = (int(w) for w in args.words.split(","))
    inputs = texts(args.num_requests, low, high)
    results = {}
    for delay in delays:
        flags = dataclasses.replace(eargs, embed_max_delay_ms=delay, embed_max_batch=args.embed_batch).to_cli_flags()
        sock, port = reserve_port()  # held until the server has it (--fd)
        cmd = [sys.executable, "-m", "ferry.cli", "serve", *([eargs.model] if eargs.model else []),
               "--port", str(port), "--served-model-name", "bench", "--max-queue-len", str(4 * args.concurrency),
               *flags]  # fmt: skip
        with LaunchedServer(cmd, port, "/ready", 600, sock=sock) as url:
            asyncio.run(_load(url, inputs[: args.concurrency], args.concurrency))  # warm-up
            r = asyncio.run(_load(url, inputs, args.concurrency))
        results[f"delay_{delay:g}ms"] = r
        print(f"--embed-max-delay-ms {delay:<4g} {r['requests_per_s']:7.1f} req/s   p50 {r['p50_ms']:7.1f} ms   "
              f"p99 {r['p99_ms']:7.1f} ms   ({r['requests']} requests, {r['errors']} errors, "
              f"concurrency {args.concurrency})", flush=True)  # fmt: skip
    if args.json:
        machine = {"cpus": os.cpu_count(), "processor": platform.processor(), "python": platform.python_version()}
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"}, "results": results,
                       "machine": machine, "time": time.time()}, f, indent=2, default=str)  # fmt: skip
    return 0
