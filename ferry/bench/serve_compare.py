"""`ferry bench serve-compare`: one workload through offline `LLM.generate`, `ferry serve` and
llama.cpp's `llama-server`, one after the other in one run (never concurrently: they share the CPU).

Reports (1) the server's cost: ferry serve's output tok/s with every request
in flight at once vs the offline engine's on the same requests, and (2) ferry
serve vs llama-server at the same concurrency (llama-server gets that many
slots), with TTFT and TPOT side by side. Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
from dataclasses import asdict

import torch

from ferry.bench.launch import LaunchedServer
from ferry.bench.serve import bench_once, format_summary, parse_slos, salted
from ferry.bench.synthetic import synthetic_requests
from ferry.bench.throughput import run_ferry
from ferry.config import EngineArgs
from ferry.models.loader import load_checkpoint
from ferry.utils.network import free_port, reserve_port


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=16, help="for the ferry serve vs llama-server comparison")
    p.add_argument("--llama-server", default=None, help="path to llama.cpp's llama-server binary (skipped if unset)")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:200"], metavar="METRIC:MS")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)


def main(args: argparse.Namespace) -> int:
    eargs = EngineArgs.from_cli_args(args)
    eargs.model = args.model
    ckpt = load_checkpoint(args.model)
    path = ckpt.path
    reqs = synthetic_requests(args.num_prompts, args.input_len, args.output_len, ckpt.config.vocab_size,
                              args.bench_seed)  # fmt: skip
    del ckpt
    slos = parse_slos(args.goodput)
    # Each timed pass gets its own salt (first token), so a server's prefix cache never carries
    # over from an earlier pass; ferry's concurrency pass and llama-server's see the same prompts.
    warmup = salted(reqs[:2], 0)
    saturation_reqs, concurrency_reqs = salted(reqs, 1), salted(reqs, 2)
    result: dict = {
        "model": path,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "seed": args.bench_seed, "prompt_tokens": sum(len(p) for p, _ in reqs),
                     "output_tokens": sum(n for _, n in reqs)},
        "engine_args": asdict(eargs),
        "ferry_flags": eargs.to_cli_flags(),
    }  # fmt: skip
    print(f"workload: {result['workload']}")

    if not args.skip_offline:
        from ferry.engine.llm_engine import LLMEngine

        engine = LLMEngine(eargs)
        off = run_ferry(engine, saturation_reqs, "offline")
        result["offline"] = {k: v for k, v in off.items() if k != "records"}
        print(f"== offline LLMEngine (all {len(reqs)} at once): {off['seconds']:.2f} s, "
              f"{off['tokens_per_s']:.1f} output tok/s")  # fmt: skip
        del engine, off
        gc.collect()

    sock, port = reserve_port()  # held until the server has it (--fd)
    cmd = [sys.executable, "-m", "ferry.cli", "serve", "--port", str(port), *eargs.to_cli_flags()]
    if args.model:
        cmd.insert(4, args.model)
    with LaunchedServer(cmd, port, ready_path="/ready", sock=sock) as url:
        bench_once(url, None, warmup, math.inf, None, 600, 0, slos)
        sat = bench_once(url, None, saturation_reqs, math.inf, None, 600, args.bench_seed, slos)
        print(format_summary(f"ferry serve, all {len(reqs)} at once", sat))
        conc = bench_once(url, None, concurrency_reqs, math.inf, args.concurrency, 600, args.bench_seed, slos)
        print(format_summary(f"ferry serve, concurrency {args.concurrency}", conc))
    result["ferry_serve_saturation"] = sat
    result["ferry_serve_concurrency"] = conc
    if "offline" in result:
        ratio = sat["output_throughput"] / result["offline"]["tokens_per_s"]
        result["serve_over_offline"] = ratio
        print(f"ferry serve / offline output throughput: {ratio:.3f}")

    if args.llama_server:
        port = free_port()
        ctx_per_slot = args.input_len[1] + args.output_len[1] + 16
        cmd = [args.llama_server, "-m", path, "--host", "127.0.0.1", "--port", str(port),
               "-np", str(args.concurrency), "-c", str(args.concurrency * ctx_per_slot),
               "-t", str(args.llama_threads), "--no-webui"]  # fmt: skip
        with LaunchedServer(cmd, port, ready_path="/health") as url:
            bench_once(url, None, warmup, math.inf, None, 600, 0, slos)
            llama = bench_once(url, None, concurrency_reqs, math.inf, args.concurrency, 600, args.bench_seed, slos)
            print(format_summary(f"llama-server, {args.concurrency} slots, concurrency {args.concurrency}", llama))
        result["llama_server"] = llama | {"cmd": " ".join(cmd)}
        ratio = conc["output_throughput"] / llama["output_throughput"]
        result["serve_over_llama_server"] = ratio
        print(f"ferry serve / llama-server output throughput at concurrency {args.concurrency}: {ratio:.2f}x")
        print(f"   TTFT p50 ms: ferry {conc['ttft']['p50'] * 1e3:.0f} vs llama-server "
              f"{llama['ttft']['p50'] * 1e3:.0f}; TPOT p50 ms: ferry {conc['tpot']['p50'] * 1e3:.1f} vs llama-server "
              f"{llama['tpot']['p50'] * 1e3:.1f}")  # fmt: skip

    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    if args.plot:
        plot(result, args.plot, args.concurrency)
    return 0


def plot(result: dict, path: str, concurrency: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names, tput = [], []
    if "offline" in result:
        names.append("offline\nLLM.generate")
        tput.append(result["offline"]["tokens_per_s"])
    names.append("ferry serve\nall at once")
    tput.append(result["ferry_serve_saturation"]["output_throughput"])
    names.append(f"ferry serve\nconc {concurrency}")
    tput.append(result["ferry_serve_concurrency"]["output_throughput"])
    if "llama_server" in result:
        names.append(f"llama-server\nconc {concurrency}")
        tput.append(result["llama_server"]["output_throughput"])
    axes[0].bar(names, tput, color="tab:blue")
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("throughput")
    servers = [("ferry serve", result["ferry_serve_concurrency"])]
    if "llama_server" in result:
        servers.append(("llama-server", result["llama_server"]))
    for ax, metric in ((axes[1], "ttft"), (axes[2], "tpot")):
        width = 0.35
        for i, (label, run) in enumerate(servers):
            ax.bar([j + i * width for j in range(4)], [run[metric][s] * 1e3 for s in ("mean", "p50", "p90", "p99")],
                   width, label=label)  # fmt: skip
        ax.set_xticks([j + width / 2 for j in range(4)], ["mean", "p50", "p90", "p99"])
        ax.set_ylabel("ms")
        ax.set_title(f"{metric.upper()} at concurrency {concurrency}")
        ax.legend()
    flags = " ".join(result.get("ferry_flags") or []) or "default engine args"
    fig.suptitle(
        f"{os.path.basename(result['model'])} on {result['cpus']} CPUs, torch {torch.__version__}; ferry: {flags}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
