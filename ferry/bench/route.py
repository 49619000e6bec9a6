"""`ferry bench route`: routing policies over the same replicas and workload, in one run.

Replicas with small KV caches (each holds the system prompts of only a few
tenants), tenants that each send their own long system prompt plus a short
question, in shuffled order, through a `ferry gateway` per policy. Between
policies every replica's prefix cache is reset, so each policy starts cold.
Reports per policy: wall time, TTFT, the replicas' prefix-cache hit rate
(hit tokens / looked-up tokens from their /metrics) and how requests spread
over replicas. A second workload gives one tenant most of the traffic, to
check that kv-aware routing does not pile it all onto one replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time

import httpx

from ferry.bench.launch import LaunchedServer
from ferry.bench.serve import run_load
from ferry.config import EngineArgs
from ferry.gateway.policies import POLICIES
from ferry.gateway.up import Replicas
from ferry.utils.network import reserve_port, reserve_ports


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or HF model directory (default: bundled SmolLM2)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=400, help="tokens of each tenant's system prompt")
    p.add_argument("--question-len", type=int, nargs=2, default=[8, 24], metavar=("MIN", "MAX"))
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--replica-kv-blocks", type=int, default=80, help="KV blocks per replica (16 tokens each)")
    p.add_argument("--replica-threads", type=int, default=1, help="torch threads per replica (OMP_NUM_THREADS)")
    p.add_argument("--policies", nargs="+", default=["round-robin", "least-load", "prefix", "kv-aware"],
                   choices=POLICIES)  # fmt: skip
    p.add_argument("--skew", type=float, default=0.7, help="share of the hot tenant in the skewed workload (0: skip)")
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--json", default=None)


def workload(args, rng: random.Random, hot_share: float | None = None) -> list[tuple[list[int], int, int]]:
    """(prompt ids, max_tokens, tenant) per request, shuffled."""
    prefixes = [[rng.randrange(100, 40000) for _ in range(args.prefix_len)] for _ in range(args.tenants)]
    reqs = []
    for i in range(args.num_requests):
        if hot_share is None:
            tenant = i % args.tenants
        else:
            tenant = 0 if rng.random() < hot_share else rng.randrange(1, args.tenants)
        question = [rng.randrange(100, 40000) for _ in range(rng.randint(*args.question_len))]
        reqs.append((prefixes[tenant] + question, args.max_tokens, tenant))
    rng.shuffle(reqs)
    return reqs


def cache_counters(urls: list[str]) -> tuple[float, float]:
    """(hit tokens, looked-up tokens) summed over replicas."""
    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("ferry:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("ferry:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def wait_mirrored(gw_url: str, workers: int, timeout: float = 60.0) -> None:
    """Until the kv-aware gateway mirrors every worker's cache (its KV-event snapshot is in): it
    answers /ready once a worker is healthy, and a worker it does not mirror yet is routed by load,
    so load sent at once measured the start-up instead of the policy (a hit rate of 0.38-0.48 for
    0.58 in some runs)."""
    deadline = time.monotonic() + timeout
    while True:
        states = httpx.get(gw_url + "/gateway/workers", timeout=10).json()
        if sum(w["kv_mirrored"] for w in states) == workers:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway mirrors {sum(w['kv_mirrored'] for w in states)} of {workers} workers' "
                               f"caches after {timeout:.0f}s")  # fmt: skip
        time.sleep(0.1)


def run_policy(policy: str, urls: list[str], reqs, args) -> dict:
    for url in urls:
        r = httpx.post(url + "/reset_prefix_cache", timeout=30)
        r.raise_for_status()
    hits0, queries0 = cache_counters(urls)
    sock, port = reserve_port()  # held until the gateway has it (--fd)
    cmd = [sys.executable, "-m", "ferry.cli", "gateway", "--port", str(port), "--policy", policy]
    for url in urls:
        cmd += ["--worker", url]
    with LaunchedServer(cmd, port, "/ready", 120, sock=sock) as gw_url:
        if policy == "kv-aware":
            wait_mirrored(gw_url, len(urls))
        results, seconds, _ = asyncio.run(
            run_load(gw_url, None, [(p, n) for p, n, _ in reqs], float("inf"), args.concurrency, 600, 0)
        )
    hits1, queries1 = cache_counters(urls)
    ok = [r for r in results if r.ok]
    share = {url: sum(1 for r in ok if r.worker == url) / max(1, len(ok)) for url in urls}
    tenants_per_worker = {url: len({t for r, (_, _, t) in zip(results, reqs) if r.worker == url}) for url in urls}
    ttfts = sorted(r.ttft * 1000 for r in ok)
    return {
        "policy": policy,
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "seconds": seconds,
        "hit_rate": (hits1 - hits0) / max(1.0, queries1 - queries0),
        "ttft_ms_p50": statistics.median(ttfts) if ttfts else None,
        "ttft_ms_p90": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
        "share": share,
        "max_share": max(share.values()) if share else 0.0,
        "tenants_per_worker": tenants_per_worker,
    }


def format_row(r: dict) -> str:
    return (
        f"{r['label']:<22} {r['seconds']:7.1f} s  hit rate {r['hit_rate']:5.3f}  TTFT p50 {r['ttft_ms_p50']:7.0f} ms"
        f"  p90 {r['ttft_ms_p90']:7.0f} ms  max replica share {r['max_share']:.2f}  failed {r['failed']}"
    )


def main(args: argparse.Namespace) -> int:
    if args.replicas < 2 or args.tenants < 1 or args.num_requests < 1 or args.concurrency < 1:
        raise ValueError("need --replicas >= 2 and positive --tenants, --num-requests, --concurrency")
    if not 0 <= args.skew < 1:
        raise ValueError(f"--skew must be in [0, 1), got {args.skew}")
    eargs = EngineArgs(model=args.model, num_kv_blocks=args.replica_kv_blocks,
                       max_model_len=args.prefix_len + args.question_len[1] + args.max_tokens + 16)  # fmt: skip
    socks = reserve_ports(args.replicas)  # handed to the replicas (Replicas, ferry up)
    ports = [s.getsockname()[1] for s in socks]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    cmds = [[sys.executable, "-m", "ferry.cli", "serve", *([args.model] if args.model else []), "--port", str(p),
             "--enable-kv-events", *eargs.to_cli_flags()] for p in ports]  # fmt: skip
    logs = [tempfile.NamedTemporaryFile(prefix="ferry-route-replica-", suffix=".log", delete=False) for _ in ports]
    replicas = Replicas(
        cmds, urls, env={"OMP_NUM_THREADS": str(args.replica_threads)}, log_files=logs, split_cpus=False, sockets=socks
    )  # as recorded in BENCHMARKS.md: threads by flag, no pinning
    rng = random.Random(args.bench_seed)
    even = workload(args, rng)
    skewed = workload(args, random.Random(args.bench_seed + 1), args.skew) if args.skew else None
    print(f"{args.replicas} replicas x {args.replica_kv_blocks} KV blocks, {args.tenants} tenants x {args.prefix_len}"
          f"-token system prompts, {args.num_requests} requests at concurrency {args.concurrency}, "
          f"{args.max_tokens} output tokens each; replica logs: {', '.join(f.name for f in logs)}")  # fmt: skip
    runs = []
    try:
        replicas.start(600)
        for policy in args.policies:
            r = run_policy(policy, urls, even, args)
            r["label"] = policy
            runs.append(r)
            print(format_row(r), flush=True)
        if skewed is not None:
            for policy in ("round-robin", "kv-aware"):
                r = run_policy(policy, urls, skewed, args)
                r["label"] = f"{policy}, skewed {args.skew:.0%}"
                runs.append(r)
                print(format_row(r), flush=True)
    finally:
        replicas.stop()
    by = {r["label"]: r for r in runs}
    if "kv-aware" in by and "round-robin" in by:
        print(f"kv-aware vs round-robin: {by['round-robin']['seconds'] / by['kv-aware']['seconds']:.2f}x faster, "
              f"hit rate {by['kv-aware']['hit_rate']:.3f} vs {by['round-robin']['hit_rate']:.3f}")  # fmt: skip
    if skewed is not None:
        r = by[f"kv-aware, skewed {args.skew:.0%}"]
        print(f"skewed ({args.skew:.0%} one tenant), kv-aware: busiest replica served {r['max_share']:.0%} of requests")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args) | {"func": None}, "runs": runs, "time": time.time(),
                       "cpus": os.cpu_count()}, f, indent=2, default=str)  # fmt: skip
    return 0
