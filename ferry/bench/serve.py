"""`ferry bench serve`: load-test any OpenAI-compatible server (ferry, vLLM, llama.cpp's llama-server).

A seeded workload (random token-id prompts, lengths U[in], outputs U[out] with
EOS ignored, greedy) is sent to `/v1/completions` with streaming, at a Poisson
request rate (`--request-rate`, `inf` = all at once) and/or a concurrency cap
(`--max-concurrency`). Reports TTFT, TPOT (per request: (e2e - ttft) / (tokens - 1)),
ITL (gaps between streamed chunks) and E2E latency (mean, p50, p90, p99),
request and token throughput, and goodput under `--goodput` SLOs; writes JSON
and a PNG. `--sweep R1 R2 ...` runs one pass per rate and plots latency
percentiles and throughput against the rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import ssl
import statistics
import time
from dataclasses import dataclass, field

import aiohttp

from ferry.bench.synthetic import synthetic_requests

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    worker: str | None = None  # the x-ferry-worker header, behind a ferry gateway
    text: str = ""  # what was streamed

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the server")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--vocab-size", type=int, default=49152, help="prompt token ids are drawn below this")
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate in requests/s (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--sweep", type=float, nargs="+", default=None, metavar="RATE", help="one run per request rate")
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:200"], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:2000 tpot:200 e2e:30000 (milliseconds)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="write a PNG here")
    p.add_argument("--label", default=None, help="name of the server in the output")
    p.add_argument("--api-key", default=None,
                   help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY, as vLLM's bench reads "
                        "it)")  # fmt: skip
    p.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                   help="CA certificates (PEM) an https:// server's certificate is checked against (default: "
                        "the system's)")  # fmt: skip


@dataclass(frozen=True)
class ClientAuth:
    """How the load generator reaches a keyed or HTTPS server."""

    api_key: str | None = None
    ca_certs: str | None = None  # trust these CAs for https:// (a private CA's server)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClientAuth:
        return cls(args.api_key or os.environ.get("OPENAI_API_KEY") or None, args.ssl_ca_certs)

    def session_options(self) -> tuple[dict[str, str], ssl.SSLContext | bool]:
        """(the session's headers, the connector's `ssl`: True verifies against the system's CAs)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return headers, ssl.create_default_context(cafile=self.ca_certs) if self.ca_certs else True


async def _first_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models") as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


async def send_request(
    session, url: str, model: str, prompt: list[int], max_tokens: int, ignore_eos: bool = True
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult(ok=False, prompt_tokens=len(prompt))
    chunks = 0
    usage_tokens = None
    t0 = time.perf_counter()
    last = t0
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            res.worker = resp.headers.get("x-ferry-worker")
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                choices = obj.get("choices") or []
                if choices and choices[0].get("text"):
                    res.text += choices[0]["text"]
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
                    chunks += 1
        res.e2e = time.perf_counter() - t0
        res.output_tokens = usage_tokens if usage_tokens is not None else chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no tokens streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(
    url: str,
    model: str | None,
    requests,
    rate: float,
    max_concurrency: int | None,
    timeout: float,
    seed: int,
    ignore_eos: bool = True,
    auth: ClientAuth = ClientAuth(),
) -> tuple[list[RequestResult], float, str]:
    # A fresh connection per request: servers close keep-alive connections on their own terms
    # (llama-server after 5 requests), and a reused connection the server just closed would fail.
    headers, tls = auth.session_options()
    conn = aiohttp.TCPConnector(limit=0, force_close=True, ssl=tls)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout),
                                     headers=headers) as session:  # fmt: skip
        model = model or await _first_model(session, url)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        rng = random.Random(seed)

        async def one(prompt, n):
            if sem is None:
                return await send_request(session, url, model, prompt, n, ignore_eos)
            async with sem:
                return await send_request(session, url, model, prompt, n, ignore_eos)

        tasks = []
        t0 = time.perf_counter()
        for prompt, n in requests:
            tasks.append(asyncio.create_task(one(prompt, n)))
            if math.isfinite(rate) and rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0, model


def salted(requests: list[tuple[list[int], int]], salt: int) -> list[tuple[list[int], int]]:
    """The same workload with a pass-specific first token: block hashes chain from the first
    block, so no pass can hit the prefix cache filled by an earlier pass on the same server."""
    return [([100 + salt % 1000, *prompt[1:]], n) for prompt, n in requests]


def distribution(values: list[float]) -> dict[str, float]:
    """Mean and nearest-rank PERCENTILES of `values` ({"mean", "p50", "p90", "p99"}); NaN when empty."""
    if not values:
        return {"mean": float("nan")} | {f"p{p}": float("nan") for p in PERCENTILES}
    s = sorted(values)
    out = {"mean": statistics.fmean(s)}
    for p in PERCENTILES:
        out[f"p{p}"] = s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]
    return out


def parse_slos(specs: list[str]) -> dict[str, float]:
    slos = {}
    for spec in specs:
        name, _, ms = spec.partition(":")
        if name not in ("ttft", "tpot", "e2e") or not ms:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2e:MS, got {spec!r}")
        slos[name] = float(ms) / 1000
    return slos


def summarize(results: list[RequestResult], seconds: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [
        r
        for r in ok
        if r.ttft <= slos.get("ttft", math.inf)
        and (r.tpot or 0.0) <= slos.get("tpot", math.inf)
        and r.e2e <= slos.get("e2e", math.inf)
    ]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "seconds": seconds,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / seconds,
        "output_throughput": out_tokens / seconds,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / seconds,
        "goodput": len(good) / seconds,
        "slos_ms": {k: v * 1000 for k, v in slos.items()},
        "ttft": distribution([r.ttft for r in ok]),
        "tpot": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl": distribution([x for r in ok for x in r.itls]),
        "e2e": distribution([r.e2e for r in ok]),
    }


def format_summary(label: str, s: dict) -> str:
    lines = [
        f"== {label}: {s['completed']} ok, {s['failed']} failed in {s['seconds']:.2f} s",
        f"   throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s, goodput {s['goodput']:.2f} req/s {s['slos_ms']}",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = s[name]
        lines.append(
            f"   {name.upper():4s} ms: mean {d['mean'] * 1e3:8.1f}  "
            + "  ".join(f"p{p} {d[f'p{p}'] * 1e3:8.1f}" for p in PERCENTILES)
        )
    if s["errors"]:
        lines.append(f"   errors: {s['errors']}")
    return "\n".join(lines)


def bench_once(url, model, requests, rate, max_concurrency, timeout, seed, slos, ignore_eos: bool = True,
               auth: ClientAuth = ClientAuth()) -> dict:  # fmt: skip
    """One pass of `requests` ((prompt token ids, max_tokens) pairs, greedy; EOS ignored unless
    `ignore_eos` is False) against the server at `url`: the `summarize` dict."""
    results, seconds, model = asyncio.run(
        run_load(url, model, requests, rate, max_concurrency, timeout, seed, ignore_eos, auth)
    )
    summary = summarize(results, seconds, slos)
    summary.update(model=model, request_rate=rate, max_concurrency=max_concurrency)
    return summary


def plot_sweep(runs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["request_rate"] for r in runs]
    xs = [r if math.isfinite(r) else max([x for x in rates if math.isfinite(x)] or [1]) * 2 for r in rates]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for name, ax in (("ttft", axes[0]), ("tpot", axes[1])):
        for p in PERCENTILES:
            ax.plot(xs, [r[name][f"p{p}"] * 1e3 for r in runs], marker="o", label=f"p{p}")
        ax.set_xlabel("request rate (req/s; rightmost = inf)")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.legend()
        ax.grid(alpha=0.3)
    axes[2].plot(xs, [r["output_throughput"] for r in runs], marker="o", label="output tok/s")
    axes[2].set_xlabel("request rate (req/s; rightmost = inf)")
    axes[2].set_ylabel("output tokens/s")
    axes[2].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_single(run: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = ["ttft", "tpot", "itl", "e2e"]
    width = 0.2
    for i, stat in enumerate(["mean", "p50", "p90", "p99"]):
        ax.bar([j + i * width for j in range(len(names))], [run[n][stat] * 1e3 for n in names], width, label=stat)
    ax.set_xticks([j + 1.5 * width for j in range(len(names))], [n.upper() for n in names])
    ax.set_ylabel("ms (log)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"{title}: {run['output_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: argparse.Namespace) -> int:
    slos = parse_slos(args.goodput)
    requests = synthetic_requests(args.num_prompts, args.input_len, args.output_len, args.vocab_size, args.bench_seed)
    label = args.label or args.url
    rates = args.sweep or [args.request_rate]
    runs = []
    for i, rate in enumerate(rates):
        run = bench_once(args.url, args.model, salted(requests, i), rate, args.max_concurrency, args.timeout,
                         args.bench_seed, slos, auth=ClientAuth.from_args(args))  # fmt: skip
        runs.append(run)
        print(format_summary(f"{label} rate={rate} concurrency={args.max_concurrency}", run))
    result = {
        "url": args.url,
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "seed": args.bench_seed},
        "runs": runs,
    }  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        if len(runs) > 1:
            plot_sweep(runs, args.plot, label)
        else:
            plot_single(runs[0], args.plot, label)
    return 0 if all(r["failed"] == 0 for r in runs) else 1
