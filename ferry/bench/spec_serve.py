"""`ferry bench spec --serve`: speculative decoding through `ferry serve`, off against on.

Two workloads per server, each server started fresh (`ferry serve` with the same flags, once
without and once with `--speculative-config`), alternately, `--rounds` times:

- editing: the shipped editing prompts (spec_workloads.py), chat template, greedy, EOS honoured,
  up to `--max-tokens`; `--serve-edit-requests` of them (the prompts in turn, each with a ticket
  number in front so no two are the same text), at most `--concurrency` in flight;
- throughput: `ferry bench throughput`'s default workload (64 random-token prompts of 32-512
  tokens, 32-256 output tokens, EOS ignored), all at once: where speculation has little to find
  and the batch is large, so what it costs shows.

Output tok/s per pass comes from the server's own usage counts; the median over rounds is
compared.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys

from ferry.bench.launch import LaunchedServer
from ferry.bench.serve import bench_once, parse_slos
from ferry.bench.spec_workloads import EDIT_PROMPTS
from ferry.bench.synthetic import synthetic_requests
from ferry.config import EngineArgs
from ferry.utils.network import reserve_port


def edit_requests(tokenizer, n: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """n chat-templated editing prompts, the shipped ones in turn, each made distinct."""
    out = []
    for i in range(n):
        text = f"(ticket {i + 1}) " + EDIT_PROMPTS[i % len(EDIT_PROMPTS)]
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
        out.append((tokenizer.encode(chat, add_special_tokens=False), max_tokens))
    return out


def run(args, eargs: EngineArgs, spec_config: str, tokenizer, vocab_size: int) -> dict:
    """Both workloads against a server without and one with speculation; prints and returns the figures."""
    slos = parse_slos(["ttft:2000", "tpot:200"])
    edits = edit_requests(tokenizer, args.serve_edit_requests, args.max_tokens)
    batch = synthetic_requests(64, [32, 512], [32, 256], vocab_size, 0)
    flags = {
        "off": dataclasses.replace(eargs, speculative_config=None).to_cli_flags(),
        "on": dataclasses.replace(eargs, speculative_config=spec_config).to_cli_flags(),
    }
    runs: dict[str, dict[str, list[float]]] = {m: {"edit": [], "throughput": []} for m in flags}
    for r in range(args.rounds):
        for mode, mode_flags in flags.items():
            sock, port = reserve_port()  # held until the server has it (--fd)
            cmd = [sys.executable, "-m", "ferry.cli", "serve", "--port", str(port), *mode_flags]
            if args.model:
                cmd.insert(4, args.model)
            with LaunchedServer(cmd, port, ready_path="/ready", sock=sock) as url:
                bench_once(url, None, edits[:2], math.inf, None, 600, 0, slos, ignore_eos=False)  # warm-up
                edit = bench_once(url, None, edits, math.inf, args.concurrency, 600, 0, slos, ignore_eos=False)
                tput = bench_once(url, None, batch, math.inf, None, 600, 0, slos)
            for name, summary in (("edit", edit), ("throughput", tput)):
                if summary["failed"]:
                    raise RuntimeError(f"{mode} round {r}: {summary['failed']} {name} requests failed")
                runs[mode][name].append(summary["output_throughput"])
            print(f"round {r} speculation {mode}: editing at concurrency {args.concurrency} "
                  f"{edit['output_throughput']:.1f} output tok/s; throughput workload (64 at once) "
                  f"{tput['output_throughput']:.1f} output tok/s")  # fmt: skip
    result = {"concurrency": args.concurrency, "edit_requests": len(edits), "runs": runs}
    for name in ("edit", "throughput"):
        off, on = statistics.median(runs["off"][name]), statistics.median(runs["on"][name])
        result[name] = {"off_tok_per_s": off, "on_tok_per_s": on, "ratio": on / off}
        print(f"ferry serve, {name}: {off:.1f} -> {on:.1f} output tok/s = {on / off:.2f}x (median of {args.rounds})")
    return result
