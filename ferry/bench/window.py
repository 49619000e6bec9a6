"""`ferry bench window`: a request far longer than a sliding window, in a KV cache sized for a little
more than the window.

A Mistral-shaped model with random weights (`--load-format dummy`; every layer windowed) and a KV
cache of `--cache-tokens` runs one request of `--input-len` prompt tokens and `--output-len` more.
The blocks that fall out of the window are released while it runs (core/kv_cache_manager.py), so
it completes although its context is several times the cache; the peak of blocks it held at once
is reported against the window, with its prefill and decode rates. Without the window the same
request would need its whole context in cache.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from ferry.bench.latency import _requests
from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.models.dummy_weights import write_config_dir
from ferry.sampling_params import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=int, default=4096, help="the model's sliding window, in tokens")
    p.add_argument("--input-len", type=int, default=16384)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--cache-tokens", type=int, default=6144, help="the KV cache's size, in tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="prefill chunk per step")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", default=None, help="also write the results to this file")


def _config(args: argparse.Namespace) -> dict:
    h = args.hidden_size
    return {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": h,
        "intermediate_size": 4 * h,
        "num_hidden_layers": args.layers,
        "num_attention_heads": h // 64,
        "num_key_value_heads": max(1, h // 128),
        "head_dim": 64,
        "max_position_embeddings": max(32768, args.input_len + args.output_len),
        "sliding_window": args.window,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        eargs = EngineArgs(model=write_config_dir(tmp, _config(args)), load_format="dummy", device=args.device,
                           dtype=args.dtype,
                           block_size=args.block_size, num_kv_blocks=args.cache_tokens // args.block_size,
                           max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)  # fmt: skip
        engine = LLMEngine(eargs)
        try:
            context = args.input_len + args.output_len
            if engine.max_model_len < context:
                raise ValueError(f"max_model_len is {engine.max_model_len}, below the request's {context} tokens: "
                                 "the cache cannot hold a window plus a step")  # fmt: skip
            prompt = _requests(random.Random(0), 1, args.input_len, engine.model_config.vocab_size)[0]
            params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
            engine.add_request("long", {"prompt_token_ids": prompt}, params)
            held, timed, records = [], [], []
            engine.core.step_records = records  # what each step ran (prefill tokens, decodes)
            while engine.has_unfinished_requests():
                seen, t0 = len(records), time.perf_counter()
                engine.step()
                if len(records) > seen:  # the step ran the model
                    timed.append((records[-1], time.perf_counter() - t0))
                held.append(engine.kv.num_blocks_held("long"))
            engine.core.step_records = None
            prefill_s = sum(dt for r, dt in timed if r.num_prefill_tokens)
            decode_s = [dt for r, dt in timed if not r.num_prefill_tokens]
        finally:
            engine.shutdown()
    peak = max(held) * args.block_size
    result = {
        "window": args.window, "input_len": args.input_len, "output_len": args.output_len,
        "cache_tokens": args.cache_tokens, "peak_tokens_held": peak, "steps": len(held),
        "prefill_tok_per_s": args.input_len / prefill_s if prefill_s else None,
        "tpot_ms": statistics.fmean(decode_s) * 1e3 if decode_s else None,
    }  # fmt: skip
    print(
        f"{args.input_len}-token prompt + {args.output_len} tokens, window {args.window}, KV cache of "
        f"{args.cache_tokens} tokens ({args.layers} layers, hidden {args.hidden_size}): completed in "
        f"{len(held)} steps; peak held {peak} tokens of KV ({peak / args.window:.2f}x the window, "
        f"{peak / context:.2f}x the context); prefill {result['prefill_tok_per_s']:.0f} tok/s, "
        f"TPOT {result['tpot_ms']:.2f} ms"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
