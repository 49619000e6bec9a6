"""`ferry bench pd`: colocated vs prefill/decode-disaggregated serving, same workers, one run.

The workload is what disaggregation is for: short-prompt streams decoding
while long prompts (>= 1,500 tokens) arrive. Colocated, every long prefill
rides in the same steps as the decodes and stalls them; disaggregated (one
prefill and one decode worker for two colocated replicas), the long prompts
are prefilled elsewhere and only their KV blocks arrive at the decode worker.
Each configuration runs twice behind a `ferry gateway`: the short streams
alone (the baseline TPOT), then with the long arrivals. Reported: TTFT and
TPOT p50/p99 of the short streams, TTFT of the long prompts, the p99-TPOT
ratio with/without arrivals, the KV bytes and transfer times the prefill
worker reports, and whether each request's greedy text equals the
colocated run's (it measures the effect of `--kv-transfer-dtype int8`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

import aiohttp
import httpx

from ferry.bench.launch import LaunchedServer
from ferry.bench.serve import distribution, send_request
from ferry.config import EngineArgs
from ferry.gateway.up import Replicas
from ferry.utils.network import reserve_port, reserve_ports


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or HF model directory (default: bundled SmolLM2)")
    p.add_argument("--num-short", type=int, default=8, help="short-prompt streams, all started at once")
    p.add_argument("--short-input-len", type=int, default=64)
    p.add_argument("--short-output-len", type=int, default=128)
    p.add_argument("--num-long", type=int, default=3, help="long prompts arriving while the short ones decode")
    p.add_argument("--long-input-len", type=int, default=1536)
    p.add_argument("--long-output-len", type=int, default=8)
    p.add_argument("--long-interval", type=float, default=1.5, help="seconds between long arrivals")
    p.add_argument("--long-start", type=float, default=1.0, help="seconds before the first long arrival")
    p.add_argument("--kv-transfer", choices=("tcp", "shm", "redis"), default="tcp")
    p.add_argument("--redis-url", default=None)
    p.add_argument("--kv-transfer-dtype", choices=("auto", "int8"), default="auto")
    p.add_argument("--pd-min-prefill-tokens", type=int, default=256)
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads per worker (OMP_NUM_THREADS)")
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--json", default=None)


def workload(args) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(args.bench_seed)
    short = [[rng.randrange(100, 40000) for _ in range(args.short_input_len)] for _ in range(args.num_short)]
    long = [[rng.randrange(100, 40000) for _ in range(args.long_input_len)] for _ in range(args.num_long)]
    return short, long


async def drive(url: str, short, long, args, with_long: bool):
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1200)) as session:
        async with session.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def later(delay, prompt, n):
            await asyncio.sleep(delay)
            return await send_request(session, url, model, prompt, n)

        tasks = [asyncio.create_task(send_request(session, url, model, p, args.short_output_len)) for p in short]
        if with_long:
            tasks += [asyncio.create_task(later(args.long_start + i * args.long_interval, p, args.long_output_len))
                      for i, p in enumerate(long)]  # fmt: skip
        results = await asyncio.gather(*tasks)
    return results[: len(short)], results[len(short) :]


def metric_sum(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_config(name: str, workers: list[tuple[str, list[str]]], gateway_flags: list[str], short, long, args,
               log_dir: str) -> dict:  # fmt: skip
    eargs = EngineArgs(model=args.model, max_model_len=args.long_input_len + args.long_output_len + 64)
    socks = reserve_ports(len(workers))  # handed to the replicas (Replicas, ferry up)
    ports = [s.getsockname()[1] for s in socks]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    base = [sys.executable, "-m", "ferry.cli", "serve", *([args.model] if args.model else []), "--enable-kv-events",
            *eargs.to_cli_flags()]  # fmt: skip
    cmds = [[*base, "--port", str(port), *flags] for port, (_, flags) in zip(ports, workers)]
    logs = [open(os.path.join(log_dir, f"{name}-{i}.log"), "wb") for i in range(len(workers))]
    replicas = Replicas(
        cmds, urls, env={"OMP_NUM_THREADS": str(args.worker_threads)}, log_files=logs, split_cpus=False, sockets=socks
    )  # as recorded in BENCHMARKS.md: threads by flag, no pinning
    out = {"config": name}
    try:
        replicas.start(600)
        gw_sock, port = reserve_port()  # held until the gateway has it (--fd)
        gw_cmd = [sys.executable, "-m", "ferry.cli", "gateway", "--port", str(port), *gateway_flags]
        for (role, _), url in zip(workers, urls):
            gw_cmd += [{"both": "--worker", "prefill": "--prefill", "decode": "--decode"}[role], url]
        with LaunchedServer(gw_cmd, port, "/ready", 120, sock=gw_sock) as gw:
            for phase, with_long in (("alone", False), ("with_long", True)):
                for url in urls:
                    httpx.post(url + "/reset_prefix_cache", timeout=30)
                # A fresh first token per phase: no phase hits the cache an earlier one filled.
                salt = 1 if with_long else 2
                s = [[100 + salt, *p[1:]] for p in short]
                lg = [[200 + salt, *p[1:]] for p in long]
                t0 = time.perf_counter()
                rs, rl = asyncio.run(drive(gw, s, lg, args, with_long))
                failed = [r.error for r in rs + rl if not r.ok]
                out[phase] = {
                    "seconds": time.perf_counter() - t0,
                    "failed": len(failed),
                    "errors": failed[:3],
                    "short_ttft_ms": distribution([r.ttft * 1000 for r in rs if r.ok]),
                    "short_tpot_ms": distribution([r.tpot * 1000 for r in rs if r.ok and r.tpot is not None]),
                    "short_itl_ms": distribution([x * 1000 for r in rs if r.ok for x in r.itls]),
                    "long_ttft_ms": distribution([r.ttft * 1000 for r in rl if r.ok]),
                    "texts": [r.text for r in rs + rl],
                }
        prefill_urls = [u for (role, _), u in zip(workers, urls) if role == "prefill"]
        if prefill_urls:
            p = prefill_urls[0]
            out["kv_bytes_sent"] = metric_sum(p, "ferry:kv_transfer_bytes_total", direction="sent")
            out["kv_transfers"] = metric_sum(p, "ferry:kv_transfer_seconds_count", direction="sent")
            out["kv_transfer_seconds"] = metric_sum(p, "ferry:kv_transfer_seconds_sum", direction="sent")
            out["kv_transfer_failures"] = metric_sum(p, "ferry:kv_transfer_failures_total", direction="sent")
    finally:
        replicas.stop()
        for f in logs:
            f.close()
    return out


def row(label: str, r: dict) -> str:
    return (f"{label:<28} short TTFT p50 {r['short_ttft_ms']['p50']:7.0f} p99 {r['short_ttft_ms']['p99']:7.0f} ms | "
            f"TPOT p50 {r['short_tpot_ms']['p50']:6.1f} p99 {r['short_tpot_ms']['p99']:6.1f} ms | "
            f"ITL p99 {r['short_itl_ms']['p99']:6.0f} ms | long TTFT p50 {r['long_ttft_ms']['p50']:7.0f} ms | "
            f"{r['seconds']:5.1f} s, failed {r['failed']}")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    if args.num_short < 1 or args.num_long < 1:
        raise ValueError("need --num-short >= 1 and --num-long >= 1")
    if args.kv_transfer == "redis" and not args.redis_url:
        raise ValueError("--kv-transfer redis needs --redis-url")
    short, long = workload(args)
    log_dir = tempfile.mkdtemp(prefix="ferry-bench-pd-")
    print(f"{args.num_short} short streams ({args.short_input_len} in / {args.short_output_len} out) + {args.num_long} "
          f"long prompts ({args.long_input_len} in / {args.long_output_len} out, every {args.long_interval}s); 2 "
          f"workers x {args.worker_threads} thread(s); logs in {log_dir}")  # fmt: skip
    redis = ["--redis-url", args.redis_url] if args.redis_url else []
    prefill_flags = ["--role", "prefill", "--kv-transfer", args.kv_transfer, "--kv-transfer-dtype",
                     args.kv_transfer_dtype, *redis]  # fmt: skip
    configs = [
        ("colocated", [("both", []), ("both", [])], []),
        ("disaggregated", [("prefill", prefill_flags), ("decode", ["--role", "decode", *redis])],
         ["--pd-min-prefill-tokens", str(args.pd_min_prefill_tokens)]),
    ]  # fmt: skip
    runs = []
    for name, workers, gw_flags in configs:
        r = run_config(name, workers, gw_flags, short, long, args, log_dir)
        runs.append(r)
        for phase in ("alone", "with_long"):
            print(row(f"{name}, {phase.replace('_', ' ')}", r[phase]), flush=True)
        if "kv_bytes_sent" in r:
            n = max(r["kv_transfers"], 1)
            print(f"{'':<28} KV sent: {r['kv_bytes_sent'] / 2**20:.1f} MiB in {r['kv_transfers']:.0f} transfers, "
                  f"{1000 * r['kv_transfer_seconds'] / n:.1f} ms each on average, {r['kv_transfer_failures']:.0f} "
                  "failed")  # fmt: skip
    for r in runs:
        ratio = r["with_long"]["short_tpot_ms"]["p99"] / r["alone"]["short_tpot_ms"]["p99"]
        r["tpot_p99_ratio"] = ratio
        print(f"{r['config']}: short-stream TPOT p99 with long arrivals / without = {ratio:.2f}")
    ref = runs[0]["with_long"]["texts"]
    same = sum(a == b for a, b in zip(ref, runs[1]["with_long"]["texts"]))
    print(f"greedy texts equal to the colocated run's: {same}/{len(ref)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args) | {"func": None}, "runs": runs, "same_texts": same, "time": time.time(),
                       "cpus": os.cpu_count()}, f, indent=2, default=str)  # fmt: skip
    return 0
