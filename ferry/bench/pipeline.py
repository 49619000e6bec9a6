"""`ferry bench pipeline`: pipeline parallelism's output tok/s, its stages overlapping or taking turns,
beside one process, in one run.

The same requests (`--num-requests` of `--input-len` random tokens, `--output-len` greedy tokens each)
run three ways on the engine the flags describe: in one process (`--pipeline-parallel-size 1`, layer by
layer as a stage runs: `--enforce-eager`, so not the C++ whole-step decode a GGUF takes there); split
into `--stages` pipeline stages with one micro-batch per stage in flight, so that every stage works on
a different one at once; and split the same way with one micro-batch at a time, so that the stages
take turns (what pipelining without micro-batches gives). The layers per stage are the engine's own
choice (pipeline_partition.py: measured per-layer and head costs), printed with the stage loads it
measured. Times are wall clock from the first request to the last token, after a warm-up request;
engine start-up (process spawn, loading) is not counted. On a CPU the stages share the machine's
cores (each process takes cores / stages threads), so the overlapped pipeline at best matches one
process using every core; the turn-taking one leaves all but one stage's cores idle.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

from ferry.bench.hardware import device_name
from ferry.bench.latency import _requests
from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.sampling_params import SamplingParams
from ferry.worker.model_loading import resolve_device


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int, default=2, help="pipeline stages of the split runs")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")


def _run(eargs: EngineArgs, prompts: list[list[int]], output_len: int, micro_batches: int | None) -> dict:
    engine = LLMEngine(eargs)
    try:
        if micro_batches is not None:
            engine.core.micro_batches = micro_batches
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        engine.add_request("warmup", {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        engine.core.max_in_flight = 0
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
        elapsed = time.perf_counter() - t0
        ranges = engine.tp_workers.layer_ranges if engine.tp_workers else [(0, engine.model_config.num_hidden_layers)]
        return {"output_tokens": tokens, "seconds": elapsed, "output_tok_per_s": tokens / elapsed,
                "layer_ranges": ranges, "max_in_flight": engine.core.max_in_flight}  # fmt: skip
    finally:
        engine.shutdown()


def main(args: argparse.Namespace) -> int:
    base = EngineArgs.from_cli_args(args)
    if args.stages < 2:
        raise ValueError("--stages must be at least 2")
    one = dataclasses.replace(base, pipeline_parallel_size=1, enforce_eager=True)
    split = dataclasses.replace(base, pipeline_parallel_size=args.stages)
    vocab = _vocab_size(one)
    prompts = _requests(random.Random(args.bench_seed), args.num_requests, args.input_len, vocab)
    device = device_name(resolve_device(base.device))
    print(f"{args.num_requests} requests x ({args.input_len} in, {args.output_len} out), {device}")
    results = {}
    for name, eargs, micro in (("one process (layer by layer)", one, None),
                               (f"{args.stages} stages, overlapped", split, None),
                               (f"{args.stages} stages, taking turns", split, 1)):  # fmt: skip
        r = _run(eargs, prompts, args.output_len, micro)
        results[name] = r
        print(f"{name:29s}: {r['output_tok_per_s']:8.1f} output tok/s ({r['seconds']:.2f} s), layers per stage "
              f"{[b - a for a, b in r['layer_ranges']]}, micro-batches in flight <= {r['max_in_flight']}")  # fmt: skip
    over = results[f"{args.stages} stages, overlapped"]["output_tok_per_s"]
    turns = results[f"{args.stages} stages, taking turns"]["output_tok_per_s"]
    single = results["one process (layer by layer)"]["output_tok_per_s"]
    print(f"overlapped / taking turns: {over / turns:.2f}x; overlapped / one process: {over / single:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device_name": device, "runs": results}, f, indent=2)
    return 0


def _vocab_size(eargs: EngineArgs) -> int:
    from ferry.models.loader import load_checkpoint

    return load_checkpoint(eargs.model, "dummy", eargs.seed).config.vocab_size
