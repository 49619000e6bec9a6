"""`ferry bench mla`: multi-head latent attention's KV bytes per token and batch decode speed at long
context, against a GQA model of the same width, in one run.

Both models are built here with random weights (`--load-format dummy`), dense (no experts: the
attention is what differs): a DeepSeek-V2-shaped MLA model (`--heads` heads of qk_nope 128 + rope 64
and v 128, a `--kv-lora-rank` latent, no q bottleneck, as V2-Lite) and its GQA twin, a Llama with the
same hidden size, heads of `--gqa-head-dim` and `--gqa-kv-heads` KV heads. `--batch-size` requests
of `--context` random tokens are prefilled (in chunked steps: their prompt tok/s is reported too, MLA's
expanded prefill against the twin's), then decode together; TPOT is the mean
wall time of the steps in which all of them decode, at least `--output-len` (as `ferry bench latency`
times them).

The KV bytes per token are read from the engines' own budget (`kv_bytes_per_token`), beside what
the same MLA model would cache with its K/V expanded per head, and the figures for the shipped
DeepSeek-V2-Lite config.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile

import torch

from ferry.bench.hardware import device_name, measure_cpu_read_bandwidth
from ferry.bench.latency import _fmt_bytes, _requests, prefill_tok_per_s, run_batch
from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.models.config import ModelConfig
from ferry.models.dummy_weights import weight_shapes, write_config_dir
from ferry.models.paths import shipped_config_dir
from ferry.utils.math import cdiv
from ferry.worker.memory import kv_bytes_per_token


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--gqa-kv-heads", type=int, default=4)
    p.add_argument("--gqa-head-dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")


def _config(args: argparse.Namespace, mla: bool) -> dict:
    d = {
        "architectures": ["DeepseekV2ForCausalLM" if mla else "LlamaForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "max_position_embeddings": args.context + args.output_len + 64,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": args.dtype,
    }
    if mla:  # DeepSeek-V2-Lite's attention shapes; no experts
        d.update(kv_lora_rank=args.kv_lora_rank, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, n_routed_experts=0)  # fmt: skip
    else:
        d.update(num_key_value_heads=args.gqa_kv_heads, head_dim=args.gqa_head_dim)
    return d


def expanded_kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """What an MLA model would cache per token with its K/V expanded: every head's K (qk_nope +
    rope) and V, in every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_head = cfg.qk_nope_head_dim + cfg.head_dim + cfg.v_head_dim
    return cfg.num_hidden_layers * cfg.num_attention_heads * per_head * elem


def _attention_params(cfg: ModelConfig) -> int:
    return sum(_numel(shape) for name, shape in weight_shapes(cfg) if ".self_attn." in name)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _measure(args: argparse.Namespace, path: str) -> dict:
    # The prompts take several chunked steps, and the requests prefilled first decode meanwhile: each
    # runs as many more tokens as there are prefill steps, so all of them decode together for at least
    # --output-len steps.
    budget = 4096
    prefill_steps = cdiv(args.batch_size * args.context, budget - args.batch_size) + 1
    max_tokens = args.output_len + prefill_steps
    tokens = args.batch_size * (args.context + max_tokens + 16)
    eargs = EngineArgs(model=path, load_format="dummy", device=args.device, dtype=args.dtype,
                       max_num_seqs=args.batch_size, enable_prefix_caching=False, num_kv_blocks=tokens // 16 + 16,
                       max_num_batched_tokens=budget)  # fmt: skip
    engine = LLMEngine(eargs)
    try:
        cfg = engine.model_config
        rng = random.Random(args.bench_seed)
        run_batch(engine, _requests(rng, 2, 32, cfg.vocab_size), 4, "warm")
        steps = run_batch(engine, _requests(rng, args.batch_size, args.context, cfg.vocab_size), max_tokens, "b")
        decode = [dt for r, dt in steps if r.num_prefill_tokens == 0 and r.num_decodes == args.batch_size]
        return {
            "tpot_ms": statistics.fmean(decode) * 1e3,
            "decode_steps": len(decode),
            "tok_per_s": args.batch_size / statistics.fmean(decode),
            "prefill_tok_per_s": prefill_tok_per_s(steps),
            "kv_bytes_per_token": kv_bytes_per_token(cfg, engine.kv_cache_dtype),
            "attention_params": _attention_params(cfg),
        }
    finally:
        engine.shutdown()


def main(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    with open(os.path.join(shipped_config_dir("deepseek-v2-lite"), "config.json")) as f:
        lite = ModelConfig.from_hf_dict(json.load(f))
    lite_bf16 = kv_bytes_per_token(lite, torch.bfloat16)
    lite_expanded = expanded_kv_bytes_per_token(lite, torch.bfloat16)
    print(f"DeepSeek-V2-Lite (shipped config, bf16): {lite_bf16:,} KV bytes/token as latent rows vs {lite_expanded:,} "
          f"expanded per head: {lite_expanded / lite_bf16:.1f}x smaller")  # fmt: skip
    print(f"{device_name(device)}; hidden {args.hidden_size}, {args.layers} layers, {args.heads} heads, {args.dtype}; "
          f"batch {args.batch_size} x {args.context}-token prompts, {args.output_len} decode steps; "
          "timings of one run, compared within it")  # fmt: skip
    if device.type == "cpu":
        print(f"memory read bandwidth (tensor.sum over 256 MB): {measure_cpu_read_bandwidth() / 1e9:.1f} GB/s")
    with tempfile.TemporaryDirectory() as tmp:
        mla_path = write_config_dir(os.path.join(tmp, "mla"), _config(args, mla=True))
        gqa_path = write_config_dir(os.path.join(tmp, "gqa"), _config(args, mla=False))
        mla_cfg = ModelConfig.from_hf_dict(_config(args, mla=True))
        mla, gqa = _measure(args, mla_path), _measure(args, gqa_path)
    mla["expanded_kv_bytes_per_token"] = expanded_kv_bytes_per_token(mla_cfg, dtype)
    ctx_tokens = args.batch_size * (args.context + args.output_len // 2)
    for name, row in (("MLA", mla), (f"GQA ({args.gqa_kv_heads} KV heads x {args.gqa_head_dim})", gqa)):
        kv = row["kv_bytes_per_token"]
        print(f"{name:28s}: {kv:7,} KV bytes/token ({_fmt_bytes(kv * ctx_tokens)} for the batch's context), "
              f"attention {row['attention_params'] / 1e6:.1f}M params; "
              f"TPOT {row['tpot_ms']:8.2f} ms = {row['tok_per_s']:7.1f} tok/s; "
              f"prefill {row['prefill_tok_per_s']:8.1f} prompt tok/s")  # fmt: skip
    expanded = mla["expanded_kv_bytes_per_token"]
    print(f"MLA's latent rows are {expanded / mla['kv_bytes_per_token']:.1f}x smaller than its "
          f"K/V expanded ({expanded:,} B/token) and "
          f"{gqa['kv_bytes_per_token'] / mla['kv_bytes_per_token']:.2f}x smaller than the GQA twin's; "
          f"decode tok/s MLA / GQA: {mla['tok_per_s'] / gqa['tok_per_s']:.2f}x, "
          f"prefill: {mla['prefill_tok_per_s'] / gqa['prefill_tok_per_s']:.2f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            options = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))}
            result = {"args": options, "mla": mla, "gqa": gqa, "deepseek_v2_lite_bf16": [lite_bf16, lite_expanded]}
            json.dump(result, f, indent=2)
    return 0
