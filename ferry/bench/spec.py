"""`ferry bench spec`: single-stream decode with and without speculative decoding, on the shipped
editing and chat prompts (ferry/bench/spec_workloads.py), in one process and one run.

The model is loaded once; an engine without speculation and one with `--speculative-config`
share it. Each prompt runs alone (chat template, greedy, EOS honoured, `--max-tokens`), first
without, then with speculation, `--rounds` times. Decode tok/s counts the tokens after the
first over the time after the first (the prompt's prefill is the same work either way);
acceptance length is tokens gained per verifying step (kept drafts + the model's own). Greedy
output with speculation must equal the output without: the run fails loudly if it does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time

from ferry.bench.latency import cache_sized_for, timed_engine
from ferry.bench.spec_workloads import WORKLOADS
from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.sampling_params import SamplingParams
from ferry.worker.model_loading import load_model

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per prompt at most")
    p.add_argument("--rounds", type=int, default=2, help="times each prompt runs each way (alternating)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument(
        "--serve",
        action="store_true",
        help="instead: ferry serve without and with speculation, on editing requests at --concurrency "
        "and on the throughput workload (spec_serve.py)",
    )
    p.add_argument("--concurrency", type=int, default=16, help="--serve: editing requests in flight")
    p.add_argument("--serve-edit-requests", type=int, default=48, help="--serve: editing requests per pass")
    p.add_argument(
        "--verify-cost",
        action="store_true",
        help="instead: a verify step's time against a plain decode step's, by batch (spec_verify_cost.py)",
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="--verify-cost: batches")
    p.add_argument("--drafts", type=int, default=4, help="--verify-cost: drafts per request and step")
    p.add_argument("--input-len", type=int, default=128, help="--verify-cost: prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="--verify-cost: output tokens")


def copied_share(prompt: list[int], output: list[int], n: int = 4) -> float:
    """Share of the output's tokens that lie in some n-gram of it also found in the prompt: how
    much of the answer copies the prompt (what prompt lookup can draft)."""
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(output)
    for i in range(len(output) - n + 1):
        if tuple(output[i : i + n]) in grams:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(output) if output else 0.0


def _run_one(engine: LLMEngine, prompt: list[int], max_tokens: int, tag: str) -> tuple[list[int], float]:
    """(tokens, seconds from the first token to the last)."""
    engine.add_request(tag, {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    first = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                tokens = out.outputs[0].token_ids
    end = time.perf_counter()
    return tokens, end - (first or end)


def main(args: argparse.Namespace) -> int:
    if args.max_tokens < 2 or args.rounds < 1:
        raise ValueError("--max-tokens must be >= 2 and --rounds >= 1")
    eargs = EngineArgs.from_cli_args(args)
    eargs.model = args.model
    spec_config = eargs.speculative_config or DEFAULT_SPEC
    plain_args = dataclasses.replace(eargs, speculative_config=None)
    spec_args = dataclasses.replace(eargs, speculative_config=spec_config)
    loaded = load_model(plain_args)
    if args.verify_cost:
        from ferry.bench import spec_verify_cost

        result = spec_verify_cost.run(args, eargs, loaded)
    elif args.serve:
        from ferry.bench import spec_serve

        print(f"model {args.model or 'default'}; speculative_config {spec_config}; ferry serve")
        result = spec_serve.run(args, eargs, spec_config, loaded.tokenizer, loaded.model.config.vocab_size)
        result = {"speculative_config": spec_config, **result}
    else:
        result = _single_stream(args, loaded, plain_args, spec_args, spec_config)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _single_stream(args, loaded, plain_args: EngineArgs, spec_args: EngineArgs, spec_config: str) -> dict:
    """Each shipped prompt alone, without and with speculation (the module's docstring)."""
    tok = loaded.tokenizer
    prompts = {name: [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                                          add_generation_prompt=True, tokenize=False),
                                 add_special_tokens=False) for text in WORKLOADS[name]]
               for name in args.workloads}  # fmt: skip
    # one request at a time; room for the drafts of the last step beyond max_tokens
    longest = max(len(ids) for ids in itertools.chain(*prompts.values())) + args.max_tokens + 64
    plain = timed_engine(cache_sized_for(plain_args, 1, longest), loaded)
    spec = timed_engine(cache_sized_for(spec_args, 1, longest), loaded)
    print(f"model {args.model or 'default'}; speculative_config {spec_config}; max {args.max_tokens} tokens")
    result: dict = {"speculative_config": spec_config, "max_tokens": args.max_tokens, "workloads": {}}
    for name in args.workloads:
        rows = []
        for i, ids in enumerate(prompts[name]):
            runs: dict[str, list[float]] = {"off": [], "on": []}
            out_tokens = None
            drafts0, accepted0 = spec.get_stats().spec_num_drafts, spec.get_stats().spec_num_accepted_tokens
            for r in range(args.rounds):
                for mode, engine in (("off", plain), ("on", spec)):
                    toks, decode_s = _run_one(engine, ids, args.max_tokens, f"{name}{i}-{mode}{r}")
                    if out_tokens is None:
                        out_tokens = toks
                    elif toks != out_tokens:
                        raise RuntimeError(f"{name} prompt {i}: greedy output with speculation differs from without")
                    runs[mode].append((len(toks) - 1) / decode_s if decode_s > 0 else float("nan"))
            stats = spec.get_stats()
            drafts = stats.spec_num_drafts - drafts0
            accept_len = 1 + (stats.spec_num_accepted_tokens - accepted0) / drafts if drafts else 1.0
            off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
            row = {"prompt": i, "prompt_tokens": len(ids), "output_tokens": len(out_tokens),
                   "off_tok_per_s": off, "on_tok_per_s": on, "speedup": on / off,
                   "acceptance_length": accept_len, "copied_share": copied_share(ids, out_tokens),
                   "runs": runs}  # fmt: skip
            rows.append(row)
            print(
                f"{name} #{i}: {len(ids)} prompt, {len(out_tokens)} output tokens; decode {off:.1f} -> {on:.1f} "
                f"tok/s = {on / off:.2f}x; acceptance length {accept_len:.2f}; copies {row['copied_share']:.0%}"
            )
        speedups = [r["speedup"] for r in rows]
        total_off = sum(r["output_tokens"] for r in rows) / sum(r["output_tokens"] / r["off_tok_per_s"] for r in rows)
        total_on = sum(r["output_tokens"] for r in rows) / sum(r["output_tokens"] / r["on_tok_per_s"] for r in rows)
        print(
            f"{name}: {total_off:.1f} -> {total_on:.1f} tok/s over all its prompts = {total_on / total_off:.2f}x "
            f"(per prompt {min(speedups):.2f}-{max(speedups):.2f}x)"
        )
        result["workloads"][name] = {"prompts": rows, "off_tok_per_s": total_off, "on_tok_per_s": total_on,
                                     "speedup": total_on / total_off}  # fmt: skip
    return result
