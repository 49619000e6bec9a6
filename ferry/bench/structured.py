"""`ferry bench structured`: what structured output costs, in one process and one run.

Throughput: `--num-requests` chat requests at `--concurrency` in flight (continuous batching: a
finished request's place goes to the next), each asking for JSON following one of the schemas
below (temperature 0.8, seeded), then the same requests unconstrained with the same seeds and
exactly the output lengths the constrained ones had (min_tokens = max_tokens, EOS ignored), so
both passes decode the same number of tokens at the same batch sizes and the difference is the
grammar's: the batch bitmask filled and applied each step, the matcher advanced per token.
Passes alternate for `--rounds`; output tok/s is output tokens over the pass's wall time.

Compile time per schema: cold (a fresh compiler: llguidance builds the lexer and parser for this
tokenizer; the tokenizer's own conversion, once per engine, is reported apart) and cached (the
compiled grammar copied), and the API side's validation (no tokenizer), cold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ferry.bench.latency import timed_engine
from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.sampling_params import SamplingParams, StructuredOutputsParams
from ferry.structured_output import grammar as grammar_mod
from ferry.structured_output.compiler import GrammarCompiler
from ferry.worker.model_loading import load_model

_NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS: dict[str, tuple[str, dict]] = {
    "person": ("Invent a person.", {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "email": {"type": "string", "pattern": "^[a-z]{2,10}@[a-z]{2,10}\\.com$"}}}),
    "order": ("Write a shop order.", {
        "type": "object", "additionalProperties": False, "required": ["order_id", "items"],
        "properties": {"order_id": {"type": "integer", "minimum": 1},
                       "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
                           "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
                           "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                          "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                                          "price": {"type": "number", "minimum": 0, "maximum": 1000}}}}}}),
    "event": ("Plan an event.", {
        "type": "object", "additionalProperties": False, "required": ["title", "date", "tags", "public"],
        "properties": {"title": _NAME, "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                       "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["music", "food", "art", "sport"]}},
                       "public": {"type": "boolean"}}}),
    "review": ("Review a restaurant.", {
        "type": "object", "additionalProperties": False, "required": ["restaurant", "stars", "summary"],
        "properties": {"restaurant": _NAME, "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                       "summary": {"type": "string", "maxLength": 120},
                       "would_return": {"type": ["boolean", "null"]}}}),
}  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="constrained / unconstrained passes, alternating")
    p.add_argument("--json", default=None, help="also write the results to this file")


def _requests(tok, n: int, max_tokens: int) -> list[tuple[list[int], SamplingParams]]:
    names = list(SCHEMAS)
    out = []
    for i in range(n):
        text, schema = SCHEMAS[names[i % len(names)]]
        chat = [{"role": "user", "content": f"{text} Answer in JSON. (#{i})"}]
        ids = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)  # fmt: skip
        out.append((ids, SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens,
                                        structured_outputs=StructuredOutputsParams(json=schema))))  # fmt: skip
    return out


def _pass(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], concurrency: int, tag: str):
    """Run the requests with `concurrency` in flight; (outputs in order, seconds)."""
    outputs: dict[int, object] = {}
    queue = list(enumerate(requests))
    start = time.perf_counter()
    in_flight = 0
    while queue or in_flight:
        while queue and in_flight < concurrency:
            i, (ids, params) = queue.pop(0)
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id.rsplit("-", 1)[1])] = out.outputs[0]
                in_flight -= 1
    return [outputs[i] for i in range(len(requests))], time.perf_counter() - start


def _compile_times(loaded, vocab_size: int, eos: set[int]) -> dict:
    """Per schema: the API side's validation, cold; the engine's compile, cold and cached."""
    fresh = GrammarCompiler(lambda: loaded.tokenizer, vocab_size, eos)
    t = time.perf_counter()
    fresh.ll_tokenizer()
    result = {"tokenizer_conversion_ms": (time.perf_counter() - t) * 1e3, "schemas": {}}
    for name, (_, schema) in SCHEMAS.items():
        params = StructuredOutputsParams(json=schema)
        grammar_mod.clear_validation_cache()
        t0 = time.perf_counter()
        grammar_mod.check(params)
        t1 = time.perf_counter()
        fresh.submit(params).result()
        t2 = time.perf_counter()
        fresh.submit(params).result()
        t3 = time.perf_counter()
        result["schemas"][name] = {"validate_ms": (t1 - t0) * 1e3, "compile_cold_ms": (t2 - t1) * 1e3,
                                   "compile_cached_ms": (t3 - t2) * 1e3}  # fmt: skip
    fresh.shutdown()
    return result


def main(args: argparse.Namespace) -> int:
    if args.num_requests < 1 or args.concurrency < 1 or args.rounds < 1:
        raise ValueError("--num-requests, --concurrency and --rounds must be >= 1")
    eargs = EngineArgs.from_cli_args(args)
    loaded = load_model(eargs)
    engine = timed_engine(eargs, loaded)
    tok = loaded.tokenizer
    constrained = _requests(tok, args.num_requests, args.max_tokens)
    print(f"model {eargs.model or 'default'}; {args.num_requests} JSON-schema requests at concurrency "
          f"{args.concurrency}, temperature 0.8, max {args.max_tokens} tokens")  # fmt: skip
    _pass(engine, constrained[: args.concurrency], args.concurrency, "warm")  # compiles, caches, warms kernels
    runs: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    lengths: list[int] | None = None
    valid = total = 0
    for r in range(args.rounds):
        outs, secs = _pass(engine, constrained, args.concurrency, f"c{r}")
        for o in outs:
            total += 1
            try:
                json.loads(o.text)
                valid += o.finish_reason == "stop"
            except ValueError:
                pass
        if lengths is None:
            lengths = [len(o.token_ids) for o in outs]
            plain = [(ids, p.clone(structured_outputs=None, min_tokens=n, max_tokens=n, ignore_eos=True))
                     for (ids, p), n in zip(constrained, lengths)]  # fmt: skip
        runs["constrained"].append(sum(len(o.token_ids) for o in outs) / secs)
        outs, secs = _pass(engine, plain, args.concurrency, f"u{r}")
        assert [len(o.token_ids) for o in outs] == lengths
        runs["unconstrained"].append(sum(len(o.token_ids) for o in outs) / secs)
        print(f"  round {r}: constrained {runs['constrained'][-1]:.1f} tok/s, "
              f"unconstrained {runs['unconstrained'][-1]:.1f} tok/s")  # fmt: skip
    c, u = statistics.median(runs["constrained"]), statistics.median(runs["unconstrained"])
    print(f"output tok/s (median of {args.rounds}): constrained {c:.1f}, unconstrained {u:.1f}: ratio {c / u:.3f}; "
          f"{valid}/{total} outputs complete JSON; mean output {statistics.mean(lengths):.0f} tokens")  # fmt: skip
    compile_times = _compile_times(loaded, engine.core.info.vocab_size, engine.core.eos_token_ids)
    print(f"llguidance tokenizer conversion (once per engine): {compile_times['tokenizer_conversion_ms']:.0f} ms")
    print(f"{'schema':<8} {'validate (API)':>15} {'compile cold':>13} {'compile cached':>15}")
    for name, t in compile_times["schemas"].items():
        print(f"{name:<8} {t['validate_ms']:>12.2f} ms {t['compile_cold_ms']:>10.2f} ms "
              f"{t['compile_cached_ms']:>12.3f} ms")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "ratio": c / u, "valid": valid, "total": total, "lengths": lengths,
                       "compile": compile_times, "concurrency": args.concurrency}, f, indent=2)  # fmt: skip
    return 0
