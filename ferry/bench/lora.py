"""`ferry bench lora`: what serving LoRA adapters costs, against the base model, in one run.

Random PEFT adapters (`--num-adapters`, rank `--rank`, on every attention and MLP projection unless
`--targets` says otherwise) are written for the model and loaded into one engine (prefix caching
off, so no run reuses another's K/V). The same requests (`--num-prompts` of `--input-len` random
tokens, `--output-len` generated, EOS ignored) then run three times, all at once each time:
  base   no request names an adapter (the adapters stay loaded: what holding them costs)
  one    every request under the same adapter
  mixed  the requests spread round-robin over all the adapters (`--max-loras` = their number)
Reported per run: output tok/s, and the mean decode step time relative to the base run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ferry.bench.latency import _requests, run_batch
from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.lora_request import LoRARequest
from ferry.models.config import ModelConfig

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", nargs="+", default=list(ALL_TARGETS), choices=ALL_TARGETS)
    p.add_argument("--json", default=None, help="also write the results to this file")


def write_random_adapter(path: Path, cfg: ModelConfig, rank: int, targets=ALL_TARGETS, seed: int = 0,
                         b_scale: float = 0.02) -> None:  # fmt: skip
    """A LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors) for a model of
    `cfg`, random A and B (PEFT would start B at zero: then the adapter changes nothing)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for module in targets:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{block}.{module}"
            fan_in, fan_out = shapes[module]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * b_scale
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
              "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))


def _run(engine: LLMEngine, prompts: list[list[int]], output_len: int, loras: list[str | None]) -> dict:
    t0 = time.perf_counter()
    steps = run_batch(engine, prompts, output_len, "lora", loras)
    wall = time.perf_counter() - t0
    decode = [dt for rec, dt in steps if not rec.num_prefill_tokens]
    return {"output_tok_per_s": len(prompts) * output_len / wall, "decode_step_ms": statistics.fmean(decode) * 1e3,
            "seconds": wall}  # fmt: skip


def main(args: argparse.Namespace) -> int:
    if args.num_adapters < 1 or args.rank < 1:
        raise ValueError("--num-adapters and --rank must be >= 1")
    eargs = EngineArgs.from_cli_args(args)
    eargs = dataclasses.replace(eargs, enable_lora=True, lora_modules=None, max_loras=args.num_adapters,
                                max_lora_rank=max(args.rank, eargs.max_lora_rank),
                                enable_prefix_caching=False)  # fmt: skip
    engine = LLMEngine(eargs)
    try:
        cfg = engine.model_config
        names = [f"adapter{i}" for i in range(args.num_adapters)]
        with tempfile.TemporaryDirectory() as tmp:
            for i, name in enumerate(names):
                write_random_adapter(Path(tmp) / name, cfg, args.rank, args.targets, seed=i)
                engine.add_lora(LoRARequest(name, i + 1, str(Path(tmp) / name)))
        prompts = _requests(random.Random(0), args.num_prompts, args.input_len, cfg.vocab_size)
        n = len(prompts)
        _run(engine, prompts[:2], 4, [None, names[0]])  # warm-up: both paths
        runs = {
            "base": _run(engine, prompts, args.output_len, [None] * n),
            "one": _run(engine, prompts, args.output_len, [names[0]] * n),
            "mixed": _run(engine, prompts, args.output_len, [names[i % len(names)] for i in range(n)]),
        }
    finally:
        engine.shutdown()
    base_step = runs["base"]["decode_step_ms"]
    print(f"{n} requests x ({args.input_len} prompt + {args.output_len} output) tokens; {args.num_adapters} "
          f"adapters of rank {args.rank} on {', '.join(args.targets)}")  # fmt: skip
    print(f"{'run':<6} {'output tok/s':>13} {'decode step ms':>15} {'vs base':>8}")
    for name, r in runs.items():
        r["step_vs_base"] = r["decode_step_ms"] / base_step
        print(f"{name:<6} {r['output_tok_per_s']:>13.1f} {r['decode_step_ms']:>15.2f} {r['step_vs_base']:>7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list))},
                       "runs": runs}, f, indent=2)  # fmt: skip
    return 0
