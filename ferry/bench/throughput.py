"""`ferry bench throughput`: offline throughput of ferry vs HF transformers, in one run.

Default workload (seeded): 64 requests, prompt lengths U[32, 512] of random
token ids, output lengths U[32, 256], EOS ignored, greedy. ferry gets all
requests at once (continuous batching); HF runs static batches of 8 in
arrival order. Also prints ferry's step-time breakdown and the FLOP rate of
its large-batch decode steps as a fraction of a torch fp32 matmul measured
in the same process.

`--dataset sharegpt-like`: 1,000 requests (by default) whose prompt and
output lengths follow seeded lognormals with ShareGPT's rough means (~200
prompt, ~180 output tokens), clipped to [4, 2048]; synthesized, no download.

`--prefix`: a shared-prefix workload (one long system prompt, short unique
suffixes) through ferry with prefix caching on, then off.

With `--load-format dummy` (random weights, e.g. `--model qwen3-0.6b`) the HF
reference gets the same random weights (`from_config`), on the same device and
dtype; `--hf-num-prompts` runs it on the first N requests only (tok/s compared).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import random
import statistics
import time
from dataclasses import asdict

import torch

from ferry.bench.hardware import device_name
from ferry.bench.latency import timed_engine, warm_up
from ferry.bench.synthetic import SHAREGPT_LIKE_CLIP, SHAREGPT_LIKE_MEANS, sharegpt_like_requests, synthetic_requests
from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.layers.linear import pack_weight, packed_linear, should_pack
from ferry.models.config import ModelConfig
from ferry.sampling_params import SamplingParams
from ferry.worker.model_loading import load_model
from ferry.worker.step_plan import StepRecord

logger = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=None, help="default: 64, or 1000 with --dataset sharegpt-like")
    p.add_argument(
        "--dataset",
        choices=("random", "sharegpt-like"),
        default="random",
        help="random: lengths U[--input-len], U[--output-len]; sharegpt-like: seeded lognormal lengths "
        f"(means ~{SHAREGPT_LIKE_MEANS[0]}/{SHAREGPT_LIKE_MEANS[1]}, clipped to {list(SHAREGPT_LIKE_CLIP)})",
    )
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the synthetic workload")
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument(
        "--hf-num-prompts",
        type=int,
        default=None,
        help="run the HF reference on the first N requests only (default: all)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers reference")
    p.add_argument("--prefix", action="store_true", help="shared-prefix workload, prefix caching on vs off")
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    p.add_argument("--prefix-output-len", type=int, default=32)
    p.add_argument("--min-decode-batch", type=int, default=32, help="decode steps at least this large count as 'large'")
    p.add_argument("--torch-profile", type=int, default=None, metavar="N",
                   help="instead of the timed run: torch.profiler over N steps with prefill and N decode-only "
                   "steps of the workload, operators by device (or CPU) time (bench/torch_profile.py)")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the results to this file")


def fit_context(reqs: list[tuple[list[int], int]], max_model_len: int) -> tuple[list[tuple[list[int], int]], int]:
    """Shorten requests that would not fit the context (prompt first keeps >= 1 output token)."""
    out, shortened = [], 0
    for ids, n in reqs:
        if len(ids) + n > max_model_len:
            shortened += 1
            ids = ids[: max_model_len - 1]
            n = max(1, min(n, max_model_len - len(ids)))
        out.append((ids, n))
    return out, shortened


def prefix_requests(n: int, prefix_len: int, suffix_range, out_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab - 100) for _ in range(prefix_len)]
    return [
        (prefix + [rng.randrange(100, vocab - 100) for _ in range(rng.randint(*suffix_range))], out_len)
        for _ in range(n)
    ]


def matmul_gflops(dtype: torch.dtype, device: torch.device, n: int = 2048, reps: int = 10) -> dict[str, float]:
    """The machine's dense n³ matmul rate, measured now: torch.matmul, and on the CPU in
    fp32 also oneDNN's packed linear (the GEMM ferry uses there, faster than MKL on AMD)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    fns = {"torch.matmul": lambda: a @ b}
    if should_pack(device, dtype):
        packed = pack_weight(b)
        fns["oneDNN linear"] = lambda: packed_linear(a, packed, None)
    rates = {}
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates[name] = 2 * n**3 * reps / (time.perf_counter() - t) / 1e9
    return rates


def linear_flops_per_token(cfg: ModelConfig) -> int:
    """2 × the parameters a token multiplies through, lm_head included."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    return 2 * (cfg.num_hidden_layers * per_layer + h * cfg.vocab_size)


def step_flops(rec: StepRecord, cfg: ModelConfig) -> float:
    """Linear-layer FLOPs of a decode step plus its attention (QK^T and PV over the context)."""
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * rec.decode_context_tokens
    return rec.num_decodes * linear_flops_per_token(cfg) + attn


def release_engine(engine: LLMEngine | None) -> None:
    """Stop an engine and give its KV cache back (the GPU memory the next run needs); returns None."""
    if engine is not None:
        engine.shutdown()
        engine.runner.free_kv_cache()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None


def run_ferry(engine: LLMEngine, requests, tag: str) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    warm_up(engine, requests)  # outside the timed region
    engine.core.step_records = records = []
    t0 = time.perf_counter()
    for i, ((ids, _), p) in enumerate(zip(requests, params)):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, p)
    out_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                out_tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - t0
    engine.core.step_records = None
    stats = engine.get_stats()
    return {
        "seconds": elapsed,
        "output_tokens": out_tokens,
        "tokens_per_s": out_tokens / elapsed,
        "steps": len(records),
        "records": records,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "preemptions": stats.num_preemptions,
    }


def breakdown(records: list[StepRecord]) -> dict[str, float]:
    phases = ("schedule", "prepare", "forward", "sample", "update")
    totals = {ph: sum(getattr(r, ph) for r in records) for ph in phases}
    whole = sum(totals.values()) or 1.0
    return {ph: totals[ph] / whole for ph in phases} | {"seconds": whole}


def main(args: argparse.Namespace) -> int:
    if args.torch_profile is not None and args.torch_profile < 1:
        raise ValueError(f"--torch-profile needs at least 1 step, got {args.torch_profile}")
    if args.prefix and args.torch_profile is not None:
        raise ValueError("--torch-profile profiles the --dataset workload; it does not combine with --prefix")
    eargs = EngineArgs.from_cli_args(args)
    eargs.model = args.model
    if args.num_prompts is None:
        args.num_prompts = 1000 if args.dataset == "sharegpt-like" else 64
    loaded = load_model(eargs)
    model, tokenizer, device, dtype, path = loaded
    cfg = model.config
    engine = timed_engine(eargs, loaded)
    engine.runner.profile = True
    name = device_name(device)
    print(f"model {path} ({'random weights' if eargs.load_format == 'dummy' else 'checkpoint'}), {dtype} on {name}")
    result: dict = {
        "model": path,
        "load_format": eargs.load_format,
        "dtype": str(dtype),
        "device": str(device),
        "device_name": name,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "engine_args": asdict(eargs),
    }

    if args.prefix:
        reqs = prefix_requests(
            args.num_prompts, args.prefix_len, args.suffix_len, args.prefix_output_len, cfg.vocab_size, args.bench_seed
        )
        on = run_ferry(engine, reqs, "on")
        engine = release_engine(engine)
        eargs_off = EngineArgs(**{**asdict(eargs), "enable_prefix_caching": False})
        off = run_ferry(timed_engine(eargs_off, loaded), reqs, "off")
        print(
            f"shared-prefix workload: {args.num_prompts} requests, prefix {args.prefix_len} tokens, "
            f"suffix U{args.suffix_len}, output {args.prefix_output_len}"
        )
        for name, r in (("caching on ", on), ("caching off", off)):
            print(
                f"  {name}: {r['seconds']:7.2f} s  {r['tokens_per_s']:8.1f} output tok/s  "
                f"prefix hits {r['prefix_cache_hits']}/{r['prefix_cache_queries']} tokens"
            )
        speedup = off["seconds"] / on["seconds"]
        print(f"  speed-up from prefix caching: {speedup:.2f}x")
        result["prefix"] = {
            k: {kk: vv for kk, vv in v.items() if kk != "records"} for k, v in (("on", on), ("off", off))
        }
        result["prefix"]["speedup"] = speedup
    else:
        if args.dataset == "sharegpt-like":
            reqs = sharegpt_like_requests(args.num_prompts, cfg.vocab_size, args.bench_seed)
            shape = f"sharegpt-like lengths (lognormal, clipped to {list(SHAREGPT_LIKE_CLIP)})"
        else:
            reqs = synthetic_requests(
                args.num_prompts, args.input_len, args.output_len, cfg.vocab_size, args.bench_seed
            )
            shape = f"prompt U{args.input_len}, output U{args.output_len}"
        reqs, shortened = fit_context(reqs, engine.max_model_len)
        mean_in = statistics.fmean(len(p) for p, _ in reqs)
        mean_out = statistics.fmean(n for _, n in reqs)
        result["workload"] = {
            "dataset": args.dataset,
            "num_prompts": len(reqs),
            "mean_prompt_tokens": mean_in,
            "mean_output_tokens": mean_out,
            "prompt_tokens": sum(len(p) for p, _ in reqs),
            "output_tokens": sum(n for _, n in reqs),
            "shortened_to_fit_context": shortened,
        }
        if args.torch_profile is not None:
            from ferry.bench import torch_profile

            result["torch_profile"] = torch_profile.run(engine, reqs, args.torch_profile)
            _write_json(args.json, result)
            return 0
        r = run_ferry(engine, reqs, "tp")
        peak = matmul_gflops(dtype, device)
        print(
            f"workload: {len(reqs)} requests, {shape}, seed {args.bench_seed}, "
            f"{sum(len(p) for p, _ in reqs)} prompt tokens; mean prompt {mean_in:.1f}, output {mean_out:.1f} tokens"
            + (f" ({shortened} shortened to fit max_model_len {engine.max_model_len})" if shortened else "")
        )
        print(
            f"ferry: {r['seconds']:.2f} s, {r['output_tokens']} output tokens, {r['tokens_per_s']:.1f} tok/s, "
            f"{r['steps']} steps, {r['preemptions']} preemptions"
        )
        bd = breakdown(r["records"])
        print("ferry step-time breakdown: " + ", ".join(f"{k} {v * 100:.1f}%" for k, v in bd.items() if k != "seconds"))
        mixed = [x for x in r["records"] if x.num_prefill_tokens]
        pure = [x for x in r["records"] if not x.num_prefill_tokens]
        t_mixed, t_pure = sum(x.total() for x in mixed), sum(x.total() for x in pure)
        print(
            f"steps with prefill: {len(mixed)}, {t_mixed:.2f} s, "
            f"{sum(x.num_prefill_tokens for x in mixed) / max(t_mixed, 1e-9):.0f} prompt tok/s; "
            f"decode-only steps: {len(pure)}, {t_pure:.2f} s, "
            f"{sum(x.num_decodes for x in pure) / max(t_pure, 1e-9):.0f} tok/s"
        )
        result["step_split"] = {
            "prefill_steps": len(mixed),
            "prefill_seconds": t_mixed,
            "decode_steps": len(pure),
            "decode_seconds": t_pure,
        }
        large = [x for x in pure if x.num_decodes >= args.min_decode_batch]
        result["ferry"] = {k: v for k, v in r.items() if k != "records"} | {"breakdown": bd}
        result["matmul_gflops"] = peak
        print(f"{dtype} 2048^3 GEMM: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in peak.items()))
        if large:
            fl = sum(step_flops(x, cfg) for x in large)
            t_step = sum(x.total() for x in large)
            t_fwd = sum(x.forward for x in large)
            rate_step, rate_fwd = fl / t_step / 1e9, fl / t_fwd / 1e9
            print(
                f"decode steps with batch >= {args.min_decode_batch}: {len(large)} steps, "
                f"median batch {statistics.median(x.num_decodes for x in large):.0f}, "
                f"{rate_step:.1f} GFLOP/s per whole step ({rate_fwd:.1f} in the forward pass) = "
                + ", ".join(f"{rate_step / v * 100:.1f}% of {k}" for k, v in peak.items())
            )
            result["large_decode"] = {
                "steps": len(large),
                "gflops_step": rate_step,
                "gflops_forward": rate_fwd,
                "fraction_step": {k: rate_step / v for k, v in peak.items()},
            }
        if not args.no_hf:
            from ferry.bench.hf_baseline import load_hf_model, run_static_batches

            engine = release_engine(engine)  # its KV cache holds most of a GPU

            dummy = cfg if eargs.load_format == "dummy" else None
            hf = load_hf_model(path, dtype, device, dummy_config=dummy, seed=eargs.seed)
            run_static_batches(hf, [(reqs[0][0][:16], 4)], 1)  # warm-up
            hf_reqs = reqs[: args.hf_num_prompts] if args.hf_num_prompts else reqs
            pad = (tokenizer.pad_token_id if tokenizer is not None else None) or 0
            hf_s, hf_tokens = run_static_batches(hf, hf_reqs, args.hf_batch_size, pad_token_id=pad)
            ratio = (r["tokens_per_s"]) / (hf_tokens / hf_s)
            subset = f" on the first {len(hf_reqs)} of {len(reqs)} requests" if len(hf_reqs) < len(reqs) else ""
            print(
                f"HF transformers static batches of {args.hf_batch_size}{subset}: {hf_s:.2f} s, "
                f"{hf_tokens} output tokens, {hf_tokens / hf_s:.1f} tok/s"
            )
            print(f"ferry / HF output tok/s: {ratio:.2f}x")
            result["hf"] = {
                "num_prompts": len(hf_reqs),
                "batch_size": args.hf_batch_size,
                "seconds": hf_s,
                "output_tokens": hf_tokens,
                "tokens_per_s": hf_tokens / hf_s,
            }
            result["ratio"] = ratio
    _write_json(args.json, result)
    return 0


def _write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)
